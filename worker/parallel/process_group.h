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
//
// Who may join (docs/operations.md, "Context parallel"): with TLS files,
// every connection of the group is mutual TLS (transport/tls.h): each side
// presents a certificate from the cluster CA whose role is one of
// peer_roles (worker), and a rank > 0 checks that rank 0's certificate
// names the rendezvous host. The control plane, the CPU backend's data and
// the NCCL group's unique id travel only inside those sessions. Without TLS
// the group is plaintext, allowed only on loopback unless `insecure`.
// A group may also have a secret (group_secret, 128 bits or more; the
// coordinator would hand one to each rank over its mTLS control plane):
// every rank then proves it knows it (HMAC-SHA256 over both sides' nonces,
// the rank, the world and, under TLS, the session's exporter), and rank 0
// proves it back in its welcome.
//
// The rendezvous is not hijacked or aborted by what connects to it: rank 0
// gives each connection hello_timeout_s to finish its handshake and say a
// valid hello, holds at most max_pending such connections (and
// max_pending_per_host from one address), and closes (and logs) any that
// fails its handshake or certificate check, sends bytes that are not a
// hello of this protocol (wrong magic, wrong size), or names a rank out of
// range or already taken, a different world, or a wrong secret; it keeps
// waiting for the real ranks until timeout_s. A peer refused for its
// certificate's role, its rank, world or secret is told why (a rank of
// ours, misconfigured, fails with that error); one that fails the
// handshake or says no valid hello is only closed. Every length read from
// a peer is checked against the call's or the protocol's own before
// anything is allocated or read.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "transport/tls.h"
#include "worker/engine/backend.h"
#include "worker/engine/collective.h"

namespace penumbra {

// Who may join a group, and how its connections are protected.
struct CollectiveSecurity {
  // CA, this rank's certificate and key: mutual TLS on every connection of
  // the group when set. Default: none (plaintext).
  transport::TlsFiles tls;
  // The roles a peer's certificate must carry. Default: {worker}.
  std::vector<std::string> peer_roles = {transport::role::kWorker};
  // A rank > 0 requires rank 0's certificate to name the rendezvous host
  // (subjectAltName). Default: true.
  bool verify_host = true;
  // Raw bytes (at least 16) every rank must hold: each proves it knows them
  // at the rendezvous, in addition to its certificate. Default: none.
  std::string group_secret;
  // Plaintext (no TLS) on a non-loopback rendezvous. Default: false (refused).
  bool insecure = false;
};

struct CollectiveOptions {
  int rank = 0;
  int world = 1;
  // "host:port" ("[v6addr]:port" for IPv6) where rank 0 listens; rank 0
  // binds it unless given a listener (then it is not read on rank 0).
  std::string rendezvous;
  // Joining (every rank connected, within timeout_s of the call), and every
  // exchange after it (no byte moving for timeout_s): DeadlineExceeded.
  double timeout_s = 60;
  CollectiveSecurity security;
  // Rank 0: a connection's time to finish its TLS handshake and send its
  // hello, from its accept (at most timeout_s). Default: 10.
  double hello_timeout_s = 10;
  // Rank 0: connections accepted but not yet joined, at most; more are
  // closed at accept (the ranks they were retry). Default: 64.
  int max_pending = 64;
  // Rank 0: the same from one address. Default: 16.
  int max_pending_per_host = 16;
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
  // The host it was bound on ("0.0.0.0" for "").
  const std::string& host() const { return host_; }

 private:
  CollectiveListener(int fd, int port, std::string host) : fd_(fd), port_(port), host_(std::move(host)) {}
  int fd_;
  int port_;
  std::string host_;
};

// Joins the group `options` names; returns when every rank has joined.
// `backend` chooses the data plane: null or a CPU backend, TCP (host
// memory); a CUDA backend, NCCL on its device and main stream
// (Unimplemented when this build has no NCCL). Rank 0 listens on `listener`
// when given (other ranks must not pass one), else binds
// options.rendezvous. Errors: InvalidArgument for inconsistent options, a
// plaintext group off loopback without `insecure`, or (on the rank that
// said it) a hello rank 0 refused for its rank or world;
// PermissionDenied for a certificate or group secret the other side
// refused; DeadlineExceeded when the group is not complete within
// timeout_s (rank 0's message names the missing ranks and the last
// connection it refused).
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
