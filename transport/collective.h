// The process groups behind the engine's Collective (worker/engine/
// collective.h): the ranks of a context-parallel group, one process each,
// joined over TCP through a rendezvous address where rank 0 listens.
//
// Two planes:
//   control (BroadcastHost, AllGatherHost, Barrier): TCP on every backend;
//   data (AllGather, Broadcast): TCP on the CPU backend (host memory), NCCL
//     on a CUDA backend (device memory, asynchronous on the backend's main
//     stream), its ncclUniqueId sent from rank 0 over the control plane.
//
// The TCP group is a star: every rank > 0 holds one connection to rank 0,
// which gathers every call's contributions and sends the results back. Each
// message carries the call's op, sequence number, root and size, checked
// on arrival: ranks that are not in the same call (an SPMD misuse) fail
// with FailedPrecondition naming both calls rather than exchange wrong bytes
// or hang. A peer gone is Unavailable naming it; no byte moving for
// timeout_s is DeadlineExceeded (ranks must enter each call within
// timeout_s of one another). The first failure breaks the group: the rank
// that sees it tells the others (they fail with its message) and closes its
// connections; every later call returns the same error.
//
// A group is used by one thread at a time (each call is a step of the
// SPMD program; none may overlap).
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "worker/engine/backend.h"
#include "worker/engine/collective.h"

namespace penumbra {

struct CollectiveOptions {
  int rank = 0;
  int world = 1;
  // "host:port" ("[v6addr]:port" for IPv6) where rank 0 listens; rank 0
  // binds it unless given a listener (then it is not read on rank 0).
  std::string rendezvous;
  // Joining (every rank connected, within timeout_s of the call), and every
  // exchange after it (no byte moving for timeout_s): DeadlineExceeded.
  double timeout_s = 60;
};

// "host:port" or "[host]:port" -> host and port (0..65535); InvalidArgument
// naming the text.
Status ParseRendezvous(const std::string& text, std::string* host, int* port);

// Rank 0's listening socket, bound before the group is joined: port 0 binds
// one the OS picks, which port() tells (for tests, and for a port file read
// by whoever starts the other ranks). The group closes it once every rank
// has joined.
class CollectiveListener {
 public:
  // host "" or "0.0.0.0": every IPv4 interface; "::": every interface.
  static Result<std::unique_ptr<CollectiveListener>> Bind(const std::string& host, int port);
  ~CollectiveListener();
  CollectiveListener(const CollectiveListener&) = delete;
  CollectiveListener& operator=(const CollectiveListener&) = delete;
  int port() const { return port_; }
  int fd() const { return fd_; }

 private:
  CollectiveListener(int fd, int port) : fd_(fd), port_(port) {}
  int fd_;
  int port_;
};

// Joins the group `options` names; returns when every rank has joined.
// `backend` chooses the data plane: null or a CPU backend, TCP (host
// memory); a CUDA backend, NCCL on its device and main stream
// (Unimplemented when this build has no NCCL). Rank 0 listens on `listener`
// when given (other ranks must not pass one), else binds
// options.rendezvous. Errors: InvalidArgument for inconsistent options or a
// peer that says a wrong rank or world (naming it, on rank 0 and on that
// peer), DeadlineExceeded when the group is not complete within timeout_s.
Result<std::unique_ptr<Collective>> ConnectCollective(Backend* backend, const CollectiveOptions& options,
                                                      std::unique_ptr<CollectiveListener> listener = nullptr);

// The pieces ConnectCollective puts together.
// The TCP group alone (host memory for both planes).
Result<std::unique_ptr<Collective>> ConnectTcpCollective(const CollectiveOptions& options,
                                                         std::unique_ptr<CollectiveListener> listener = nullptr);
// Whether this build has the NCCL data plane (CUDA builds with libnccl).
bool NcclCollectiveCompiled();
// The NCCL data plane for a CUDA backend over a joined control group (whose
// rank and world it takes; the group's ranks must all call it). The result
// owns `control` and uses it for the host-memory calls.
Result<std::unique_ptr<Collective>> ConnectNcclCollective(Backend* backend, std::unique_ptr<Collective> control,
                                                          double timeout_s);

}  // namespace penumbra
