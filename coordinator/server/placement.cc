#include "coordinator/server/placement.h"

#include <algorithm>
#include <tuple>

namespace penumbra::coordinator {

std::vector<int> OrderWorkers(std::vector<PlacementCandidate> c, int64_t min_free_bytes) {
  auto key = [min_free_bytes](const PlacementCandidate& w) {
    const bool short_of_memory = w.memory_free_bytes >= 0 && w.memory_free_bytes < min_free_bytes;
    // Ascending order of every field: holders, room, load, documents, memory (negated), index.
    return std::make_tuple(!w.holds_document, short_of_memory, w.routed, w.documents_held, -w.memory_free_bytes,
                           w.worker);
  };
  std::sort(c.begin(), c.end(),
            [&](const PlacementCandidate& a, const PlacementCandidate& b) { return key(a) < key(b); });
  std::vector<int> out;
  out.reserve(c.size());
  for (const PlacementCandidate& w : c) out.push_back(w.worker);
  return out;
}

}  // namespace penumbra::coordinator
