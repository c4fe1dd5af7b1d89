// penumbra-store's command-line options (beside the security flags of
// transport/tls.h), declared once (common/option_table.h): each flag with its
// default (the structs' own), range and help, from which the node's parsing,
// validation, --help and docs/operations.md's table come. Its store's options
// come from the storage YAML's `disk:` section
// (storage::SegmentStoreOptionTable).
#pragma once

#include <string>

#include "common/option_table.h"
#include "store_node/store_node.h"

namespace penumbra::transport {

struct StoreNodeProcessOptions {
  std::string path;            // the store's RocksDB directory; "": the storage config's disk.path. Default: "".
  std::string port_file;       // written once serving; "": none. Default: "".
  std::string storage_config;  // a storage YAML whose disk: section configures the store; "": none. Default: "".
  StoreNodeOptions node;       // the address, the plane's and the service's limits
};

const OptionTable<StoreNodeProcessOptions>& StoreNodeOptionTable();

}  // namespace penumbra::transport
