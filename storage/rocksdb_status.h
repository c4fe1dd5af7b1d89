// RocksDB's Status as ours, for the .cc files that use RocksDB (the segment
// store, the job store, the document registry): `what` says which store and
// which call. A full disk (RocksDB's NoSpace or SpaceLimit) is
// ResourceExhausted saying so. Header-only; include it only where rocksdb/
// headers are already included.
#pragma once

#include <string>

#include <rocksdb/status.h>

#include "common/status.h"

namespace penumbra::storage {

inline Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return Status::OK();
  if (s.IsNoSpace() || s.subcode() == rocksdb::Status::kSpaceLimit) {
    return Status::ResourceExhausted(what + ": the disk is full (" + s.ToString() + ")");
  }
  if (s.IsNotFound()) return Status::NotFound(what + ": " + s.ToString());
  if (s.IsCorruption()) return Status::Corruption(what + ": " + s.ToString());
  if (s.IsIOError()) return Status::IOError(what + ": " + s.ToString());
  if (s.IsInvalidArgument()) return Status::InvalidArgument(what + ": " + s.ToString());
  return Status::Internal(what + ": " + s.ToString());
}

}  // namespace penumbra::storage
