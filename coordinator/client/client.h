// The C++ client of Penumbra's public API (transport/penumbra.thrift): one
// connection to a coordinator, errors as Status (the server's typed codes;
// a connection failure is Unavailable, a timeout DeadlineExceeded). Not
// thread-safe: one Client per thread.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/args.h"
#include "common/status.h"
#include "gen-cpp/Penumbra.h"
#include "transport/thrift_util.h"

namespace penumbra::client {

struct ClientOptions {
  std::string host = "127.0.0.1";
  int port = 7700;
  std::string api_key;
  // TLS (the coordinator's public API with TLS on): the CA its certificate
  // must chain to (and name `host`); a client certificate and key (role
  // client) for a tenant that requires one. All empty: plaintext.
  std::string tls_ca, tls_cert, tls_key;
  // Connect and call timeout (long polls add their wait; puts that wait use
  // their deadline).
  std::chrono::milliseconds timeout{30000};
  // Streaming (Stream, Follow): a poll that fails on the transport (the
  // coordinator restarting, a dropped connection) is retried on a new
  // connection, at the same offset, for this long before the stream fails.
  // 0: fail at once. Default: 30 s.
  std::chrono::milliseconds reconnect_window{30000};
};

// "host:port" -> options.host/port; InvalidArgument naming the text.
Status ParseAddress(const std::string& address, ClientOptions* options);

// The flags every client command takes (the CLI, penumbra-service-bench):
// --address (default $PENUMBRA_ADDRESS, else 127.0.0.1:7700), --api-key-file
// (default $PENUMBRA_API_KEY_FILE; else the key in $PENUMBRA_API_KEY: never a
// key on a command line), --tls-ca/--tls-cert/--tls-key (default
// $PENUMBRA_TLS_CA/CERT/KEY), --timeout-ms, --reconnect-ms.
void AddConnectionFlags(Args& a);
Result<ClientOptions> OptionsFromFlags(const Args& a);

class Client {
 public:
  static Result<std::unique_ptr<Client>> Connect(const ClientOptions& options);

  // A document from text or token ids (exactly one non-empty). wait: returns
  // when READY or FAILED, calling `progress` (if set) with the document's
  // state every half second meanwhile. kv_policy: the document's pin
  // (PutDocumentRequest.kv_policy).
  Result<rpc::DocumentInfo> PutDocument(const std::string& name, const std::string* text,
                                        const std::vector<int32_t>* ids, bool wait = true,
                                        std::chrono::milliseconds deadline = std::chrono::milliseconds(0),
                                        const std::function<void(const rpc::DocumentInfo&)>& progress = {},
                                        const std::string& kv_policy = "");
  Result<rpc::DocumentInfo> GetDocument(const std::string& id);
  // Every page.
  Result<std::vector<rpc::DocumentInfo>> ListDocuments(int page_size = 100);
  Status DeleteDocument(const std::string& id);

  // request.api_key is filled in.
  Result<std::string> Generate(rpc::GenerateRequest request);
  Result<rpc::GenerateChunk> Poll(const std::string& request_id, int64_t offset, int32_t wait_ms);
  // Generate, then long polls until the end (Follow), calling on_text with
  // each new piece of the answer's text as it arrives; returns the last
  // chunk (the whole text, usage).
  Result<rpc::GenerateChunk> Stream(rpc::GenerateRequest request,
                                    const std::function<void(const std::string& delta)>& on_text);
  // Long polls `request_id` from token `offset` until it ends, calling
  // on_chunk (if set) with every chunk; returns the last chunk (its ids
  // cleared: they were passed to on_chunk). A transport failure is retried
  // at the current offset on a new connection for
  // options.reconnect_window (a coordinator restarted on its data directory
  // continues the request); any error the coordinator returns is final.
  Result<rpc::GenerateChunk> Follow(const std::string& request_id, int64_t offset,
                                    const std::function<void(const rpc::GenerateChunk&)>& on_chunk);
  // The blocking call: the whole answer.
  Result<rpc::GenerateChunk> Complete(rpc::GenerateRequest request);
  Status Cancel(const std::string& request_id);
  Result<rpc::HealthResponse> Health();
  Result<rpc::StatsResponse> Stats();

  // Batch jobs (request.api_key is filled in).
  Result<rpc::JobInfo> SubmitJob(rpc::SubmitJobRequest request);
  Result<rpc::JobInfo> GetJob(const std::string& job_id);
  // Every page.
  Result<std::vector<rpc::JobInfo>> ListJobs(int page_size = 100);
  // Every finished item's result, by custom_id.
  Result<std::vector<rpc::JobItemResult>> JobResults(const std::string& job_id, int page_size = 500);
  Result<rpc::JobInfo> CancelJob(const std::string& job_id);
  Status DeleteJob(const std::string& job_id);

 private:
  explicit Client(const ClientOptions& o) : o_(o) {}
  Status Reconnect();
  // Runs one RPC; after a transport failure the connection is dropped and
  // the next call opens a new one.
  Status Call(const std::string& what, const std::function<void()>& call);
  void SetTimeout(std::chrono::milliseconds t);
  ClientOptions o_;
  std::shared_ptr<const transport::TlsClientContext> tls_;
  std::unique_ptr<transport::ThriftClient<rpc::PenumbraClient>> c_;
};

}  // namespace penumbra::client
