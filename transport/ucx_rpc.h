// A request/reply plane over UCX active messages: the data plane between
// workers and value-store nodes (docs/architecture.md, "Value-store nodes").
// The same code runs over TCP or shared memory on one machine and over RDMA
// in a cluster (UCX picks; UCX_TLS narrows it). Large payloads go by UCX's
// rendezvous protocol (zero-copy gets where the transport has them).
//
// Every message carries an XXH3 checksum of its payload, verified on arrival
// (a mismatch is Corruption, never data); every call has a deadline
// (DeadlineExceeded); a failed endpoint (the peer died, the connection
// broke) fails the calls in flight on it with Unavailable, and the next call
// connects again.
//
// Threads: each side owns one UCX worker, driven by one progress thread
// (UCX is used single-threaded); callers hand it work through a queue and
// an eventfd. The server runs handlers on its own pool, so a slow handler
// (a disk read) does not hold up the others' messages.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"

namespace penumbra::transport {

class UcxServer {
 public:
  // A request's answer: the reply payload, or an error sent back as it is.
  using Handler = std::function<Result<std::string>(uint32_t method, std::string payload)>;
  // Listens on host:port (port 0: one the OS picks; port() says which) and
  // serves requests with `handler` on `threads` threads.
  static Result<std::unique_ptr<UcxServer>> Start(const std::string& host, int port, Handler handler,
                                                  int threads = 4);
  ~UcxServer();  // Stop()
  UcxServer(const UcxServer&) = delete;
  UcxServer& operator=(const UcxServer&) = delete;
  int port() const;
  // Stops listening, closes every endpoint, joins the threads.
  void Stop();

  struct Impl;

 private:
  explicit UcxServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class UcxClient {
 public:
  // Connects to a UcxServer (the connection is made by the first call, and
  // again after a failure). Thread-safe: many calls may be in flight.
  static Result<std::unique_ptr<UcxClient>> Connect(const std::string& host, int port);
  ~UcxClient();
  UcxClient(const UcxClient&) = delete;
  UcxClient& operator=(const UcxClient&) = delete;

  // Sends `payload` as request `method` and waits for the reply: its payload,
  // the handler's error, Unavailable when the server cannot be reached or
  // the endpoint failed, DeadlineExceeded after `timeout`, Corruption when
  // the reply's checksum does not match its bytes.
  Result<std::string> Call(uint32_t method, std::string_view payload, std::chrono::milliseconds timeout);

  struct Impl;

 private:
  explicit UcxClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace penumbra::transport
