// Collective: the ranks of a context-parallel group (one sequence split into
// contiguous shards over several processes, each with its own backend; see
// docs/architecture.md, "Context parallel") exchanging tensors.
//
// The engine sees only this interface; the implementations live in
// worker/parallel/ (process_group.h): NCCL for CUDA backends (device buffers,
// ordered on the backend's main stream) and TCP for the CPU backend (host
// buffers). Every rank makes the same calls in the same order (SPMD); a call
// that fails (a peer gone, a deadline passed) leaves the group unusable:
// every later call fails too.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace penumbra {

class Collective {
 public:
  virtual ~Collective() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;

  // ---- data plane: memory of the backend the group was made for ----
  // recv (world * bytes) = every rank's send (bytes), concatenated in rank
  // order. Ordered after the work already issued on the backend's main
  // stream, before the work issued after it (CUDA); synchronous on the CPU.
  // send may alias recv + rank * bytes.
  virtual Status AllGather(const void* send, void* recv, size_t bytes) = 0;
  // buf (bytes) on every rank = root's.
  virtual Status Broadcast(void* buf, size_t bytes, int root) = 0;

  // ---- control plane: host memory, synchronous on every backend ----
  virtual Status BroadcastHost(void* buf, size_t bytes, int root) = 0;
  virtual Status AllGatherHost(const void* send, void* recv, size_t bytes) = 0;
  // Returns when every rank has called it.
  virtual Status Barrier() = 0;

  // Whether every peer's connection is still open, without waiting: OK, or
  // Unavailable naming the rank whose connection closed (its process gone).
  // Any thread may call it, while another makes the group's calls (a
  // watchdog of device work that waits for peers). Default: OK.
  virtual Status Probe() { return Status::OK(); }
};

}  // namespace penumbra
