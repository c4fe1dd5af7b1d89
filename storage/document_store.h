// DocumentStore: the persistent tier of the document cache as the engine
// sees it: stored documents (segments of named blobs) by key, read whole, in
// part, or piece by piece through a reader that keeps the document in place.
// Implemented by the local RocksDB store (SegmentStore) and by a client of
// a value-store node over UCX (store_node/store_node.h: penumbra-store), so
// a worker's document cache sits in front of either without knowing which.
//
// Every implementation verifies what it returns (block checksums on disk,
// authenticated or checksummed messages on the wire): Corruption, never
// wrong bytes.
// Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/hash.h"
#include "common/status.h"

namespace penumbra::storage {

class BlobReader;

struct SegmentInfo {
  std::string cache_namespace;
  int64_t tokens = 0;
  size_t bytes = 0;  // blob bytes
  bool pinned = false;
  int attached = 0;        // in-memory users (0 after a reopen)
  uint64_t last_used = 0;  // logical clock, larger = more recent
};

// One blob of a stored segment, as its record holds it.
struct BlobLayout {
  std::string name;
  uint64_t size = 0;       // bytes
  size_t block_bytes = 0;  // bytes per block (the last one holds the rest)
  uint32_t blocks = 0;
};

class DocumentStore {
 public:
  virtual ~DocumentStore() = default;
  // Stores a segment (SegmentStore::Put): over a key already stored, the
  // same content is a no-op and other content replaces it (FailedPrecondition
  // while a reader holds it). ResourceExhausted when it cannot fit;
  // Unavailable when a remote store cannot be reached.
  virtual Status Put(const Hash128& key, const std::string& cache_namespace, int64_t tokens,
                     const std::map<std::string, std::string>& blobs,
                     const std::map<std::string, size_t>& blob_block_bytes = {}) = 0;
  // Every blob, or those named in `only` (InvalidArgument for a name the
  // segment lacks). NotFound when absent.
  virtual Result<std::map<std::string, std::string>> Get(const Hash128& key) = 0;
  virtual Result<std::map<std::string, std::string>> Get(const Hash128& key, const std::set<std::string>& only) = 0;
  virtual Result<std::vector<BlobLayout>> Layout(const Hash128& key) const = 0;
  virtual Result<SegmentInfo> Info(const Hash128& key) const = 0;
  // Removes a segment. FailedPrecondition while a reader holds it; NotFound
  // when absent.
  virtual Status Erase(const Hash128& key) = 0;
  // A reader of the segment's blobs that keeps it in place (neither evicted
  // nor erased) while it lives. NotFound when absent.
  virtual Result<std::shared_ptr<BlobReader>> OpenReader(const Hash128& key) = 0;
};

}  // namespace penumbra::storage
