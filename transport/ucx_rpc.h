// A request/reply plane over UCX active messages: the data plane between
// workers and value-store nodes (docs/architecture.md, "Value-store nodes").
// The same code runs over TCP or shared memory on one machine and over RDMA
// in a cluster (UCX picks; UCX_TLS narrows it). Large payloads go by UCX's
// rendezvous protocol (zero-copy gets where the transport has them).
//
// Security (docs/storage.md, "The store plane's security"). UCX has no TLS,
// so the plane makes its own, from the cluster secret (common/crypto.h):
//   - With a secret (UcxServerOptions::secret / UcxClientOptions::secret,
//     the plane key being secret.Derive(secret_purpose)), a connection starts
//     with a mutual challenge-response over fresh nonces (transport/ucx_frame.h):
//     the client proves it holds the key, then the server does, and both
//     derive this connection's keys. Every later frame's header carries a MAC
//     that is verified on arrival before its body is received or any size in
//     it is trusted; its body is encrypted and authenticated (AES-256-GCM,
//     per-direction counters as nonces); a frame seen already is refused. A
//     peer that sends anything unauthenticated, or does not finish the
//     handshake within handshake_timeout, is disconnected and counted.
//   - Without one (plain: only on loopback; the callers check it), the
//     handshake only names the client, and bodies carry an XXH3 checksum
//     (a mismatch is Corruption, never data).
//   Either way a body's announced length is bounded (max_body_bytes) before
//   anything is allocated for it, a server takes at most max_endpoints
//   connections and max_inflight_bytes of requests at once, and the UCX
//   worker opens its network listeners only on the device of the address it
//   serves or dials (UcxNetDevices), not on every interface.
//
// Each client has a random 128-bit id, stable across its reconnects and
// proved with the secret at every handshake; handlers see it (UcxCaller) and
// bind what they hand out to it.
//
// Failures: every call has a deadline (DeadlineExceeded); a failed endpoint
// (the peer died, the connection broke) fails the calls in flight on it with
// Unavailable, and the next call connects again; a refused handshake is
// PermissionDenied.
//
// Threads: a server owns several UCX workers (UcxServerOptions::workers,
// its connections spread over them), a client one per connection
// (UcxClientOptions::connections), each driven by one progress thread
// (UCX is used single-threaded); callers hand it work through a queue and
// an eventfd. The server runs handlers on its own pool, so a slow handler
// (a disk read) does not hold up the others' messages; bodies are sealed
// and opened on the callers' and the pool's threads, not the progress thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/crypto.h"
#include "common/status.h"
#include "transport/ucx_frame.h"

namespace penumbra::transport {

// Who sent a request, as the handshake established it.
struct UcxCaller {
  std::string client_id;       // 32 hex digits: the client's id (proved with the secret when authenticated)
  bool authenticated = false;  // the connection is sealed (the client proved the cluster secret)
  uint64_t connection = 0;     // this server's number for the connection (logs)
};

struct UcxServerOptions {
  int threads = 4;  // handler threads. Default: 4.
  // UCX workers, each with its progress thread; accepted connections are
  // spread over them (round robin), so many clients' bytes move on several
  // cores. Default: 4.
  int workers = 4;
  // The cluster secret: a sealed plane (only clients with the same secret
  // connect). None: plain (the caller allows that only on loopback).
  // Default: none.
  std::optional<ClusterSecret> secret;
  std::string secret_purpose = "store-plane";  // the plane key is secret->Derive(this). Default: store-plane.
  // A connection that has not finished its handshake by then is closed.
  // Default: 10 s.
  std::chrono::milliseconds handshake_timeout{10000};
  int max_endpoints = 1024;  // connections at once (more are rejected). Default: 1024.
  // The largest request body accepted (the announced length is checked
  // before anything is allocated). Default: 65 MiB (ucx_frame::kDefaultMaxBody).
  size_t max_body_bytes = ucx_frame::kDefaultMaxBody;
  // Request bytes received and not yet answered, server-wide; a request
  // beyond it is answered ResourceExhausted without being received.
  // Default: 1 GiB.
  size_t max_inflight_bytes = size_t{1} << 30;
  // UCX network devices (UCX_NET_DEVICES syntax); "": the device of `host`
  // (all devices for 0.0.0.0), see UcxNetDevices. The environment's
  // UCX_NET_DEVICES, when set, wins. Default: "".
  std::string net_devices;
};

// Counters of a server's connections and frames (monotonic).
struct UcxServerStats {
  int64_t connections = 0;           // accepted
  int64_t connections_rejected = 0;  // over max_endpoints
  int64_t handshakes = 0;            // completed
  int64_t handshake_failures = 0;    // refused: wrong or missing secret, bad proof, malformed
  int64_t handshake_timeouts = 0;    // closed for not finishing in time
  int64_t frames_rejected = 0;       // unauthenticated, malformed, oversized or replayed: connection closed
  int64_t replays = 0;               // ... of which replayed (seen already, or older than the window)
  int64_t requests = 0;              // handled
  int64_t busy = 0;                  // refused for max_inflight_bytes
  int64_t endpoints_open = 0;        // now (a gauge)
};

class UcxServer {
 public:
  // A request's answer: the reply payload, or an error sent back as it is.
  // Runs on a pool thread; an exception is caught and answered Internal
  // (ResourceExhausted for bad_alloc).
  using Handler = std::function<Result<std::string>(const UcxCaller& caller, uint32_t method, std::string payload)>;
  // Listens on host:port (port 0: one the OS picks; port() says which) and
  // serves requests with `handler`.
  static Result<std::unique_ptr<UcxServer>> Start(const std::string& host, int port, Handler handler,
                                                  const UcxServerOptions& options = {});
  ~UcxServer();  // Stop()
  UcxServer(const UcxServer&) = delete;
  UcxServer& operator=(const UcxServer&) = delete;
  int port() const;
  bool sealed() const;
  UcxServerStats stats() const;
  // Stops listening, closes every endpoint, joins the threads.
  void Stop();

  struct Impl;

 private:
  explicit UcxServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct UcxClientOptions {
  // The cluster secret (as UcxServerOptions::secret); the server must have
  // the same, or have none when this has none. Default: none.
  std::optional<ClusterSecret> secret;
  std::string secret_purpose = "store-plane";
  // Connecting (the UCX connection and the handshake) takes at most this,
  // and at most the call's own deadline. Default: 10 s.
  std::chrono::milliseconds handshake_timeout{10000};
  size_t max_body_bytes = ucx_frame::kDefaultMaxBody;  // the largest reply body accepted. Default: 65 MiB.
  // UCX network devices; "": the device that routes to the server (see
  // UcxNetDevices). Default: "".
  std::string net_devices;
  // Connections to the server, each with its own UCX worker and progress
  // thread; calls are spread over them (round robin), so one caller's
  // parallel reads move at once. Each is made at its first call. Default: 4.
  int connections = 4;
};

class UcxClient {
 public:
  // A client of a UcxServer (the connection and its handshake are made by
  // the first call, and again after a failure). Thread-safe: many calls may
  // be in flight. InvalidArgument for a bad address.
  static Result<std::unique_ptr<UcxClient>> Connect(const std::string& host, int port,
                                                    const UcxClientOptions& options = {});
  ~UcxClient();
  UcxClient(const UcxClient&) = delete;
  UcxClient& operator=(const UcxClient&) = delete;

  // Sends `payload` as request `method` and waits for the reply: its payload,
  // the handler's error, Unavailable when the server cannot be reached or
  // the endpoint failed, PermissionDenied when the handshake was refused
  // (a wrong or missing secret) or the server failed to prove the secret,
  // DeadlineExceeded after `timeout`, Corruption when the reply does not
  // verify.
  Result<std::string> Call(uint32_t method, std::string_view payload, std::chrono::milliseconds timeout);
  // The same, the reply's body received in place: its bytes land in `into`
  // (the caller's buffers, one after another; by UCX's rendezvous straight
  // from the server where the transport allows, no intermediate copy) and
  // are verified there (plain: the checksum; sealed: decrypted in place and
  // the tag checked). A successful reply whose body is not exactly the
  // parts' total is refused before it is received (Corruption naming both
  // sizes); an error reply is returned as Call's. On any error the parts'
  // bytes are unspecified. The parts are written only until this returns:
  // past the deadline, a reply still arriving closes its connection and the
  // call waits for UCX to let go of the buffers.
  Status CallInto(uint32_t method, std::string_view payload, std::chrono::milliseconds timeout,
                  std::span<const ucx_frame::BodyPart> into);
  // The transports UCX chose for each connection made so far: one line per
  // lane ("lane[0]: ... posix/memory ..." as ucp_ep_print_info says), for
  // logs and the bench. Empty before the first call.
  std::vector<std::string> Transports() const;
  int connections() const;
  // This client's id (32 hex digits), as servers see it (UcxCaller).
  const std::string& client_id() const;

  struct Impl;

 private:
  explicit UcxClient(std::vector<std::unique_ptr<Impl>> lanes);
  Impl& Lane();
  std::vector<std::unique_ptr<Impl>> lanes_;  // one per connection
  std::atomic<uint64_t> next_lane_{0};
};

// The UCX network devices (UCX_NET_DEVICES syntax) for a process that
// serves or dials `ip`: the interface holding that address (for a server)
// or the one routing to it (for a client, `route` true), and the RDMA
// devices (/sys/class/infiniband, which open no IP listener); "" for a
// wildcard address (every device). UCX's TCP transport listens on each
// device it uses, so without this a node bound to 127.0.0.1 would also
// accept TCP connections on every other interface. NotFound when no
// interface holds the address.
Result<std::string> UcxNetDevices(const std::string& ip, bool route);

}  // namespace penumbra::transport
