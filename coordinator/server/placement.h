// Where the coordinator places a request or a document's put: an order of
// the healthy workers to try (the first that takes it serves it; one that
// refuses with ResourceExhausted or is unavailable passes it to the next).
//   1. Workers holding the request's first document (its factored state is
//      attached there, not prefilled again).
//   2. Within each group, workers with room before workers whose device is
//      short of memory (free memory known and under min_free_bytes).
//   3. Then the least loaded: fewest requests the coordinator placed there
//      and not finished.
//   4. Then the fewest documents held (new documents spread over the
//      workers' caches), then the most free memory, then the lowest index.
#pragma once

#include <cstdint>
#include <vector>

namespace penumbra::coordinator {

struct PlacementCandidate {
  int worker = 0;
  bool holds_document = false;  // holds the request's first document
  int64_t routed = 0;           // requests placed there by the coordinator, not finished
  int64_t documents_held = 0;
  int64_t memory_free_bytes = -1;  // the worker's last report; -1: not known
};

// The candidates' workers in placement order.
std::vector<int> OrderWorkers(std::vector<PlacementCandidate> candidates, int64_t min_free_bytes);

}  // namespace penumbra::coordinator
