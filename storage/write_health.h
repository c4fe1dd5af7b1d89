// How a durable store's writes fare (the document registry, the job store,
// the segment store), for /metrics and logs. Plain data; no RocksDB here.
#pragma once

#include <cstdint>
#include <string>

namespace penumbra::storage {

struct WriteHealth {
  int64_t write_errors = 0;  // writes refused since the store opened (each one a call that returned an error)
  int64_t recoveries = 0;    // times the store became writable again after failures, without a restart
  int64_t reopens = 0;       // of them, by reopening its database (the rest by RocksDB's Resume)
  bool degraded = false;     // a write failed and no recovery has succeeded since: writes are refused
  std::string last_error;    // the last failure ("" when none)
};

}  // namespace penumbra::storage
