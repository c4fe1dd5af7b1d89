// The coordinator's OpenAI-compatible HTTP API (docs/openai.md): a port of
// penumbra-coordinator beside its Thrift public API, answering
//   GET  /v1/models, /v1/models/{id}
//   POST /v1/completions, /v1/chat/completions (stream: server-sent events)
//   /v1/documents (ours), /v1/files and /v1/batches (openai_batches.cc)
// by calling the same Coordinator in process: the same tenants (the
// Authorization: Bearer key is the tenant's API key), quotas, routing,
// document cache, deadlines and TLS (the public API's certificate; a
// tenant that requires a client certificate gets in only with one). The
// translation is coordinator/openai/openai_api.h.
//
// A stream polls its generation and sends each piece of new text as a
// chunk; a client that goes away (a write fails or times out) has its
// generation cancelled. A non-streaming answer waits in Complete, which
// cancels the generation when the client hangs up (seen under TLS, where
// the connection's socket is known).
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "coordinator/jobs/file_store.h"
#include "coordinator/openai/batch_api.h"
#include "coordinator/openai/openai_api.h"
#include "coordinator/server/coordinator.h"
#include "transport/http_server.h"

namespace penumbra::coordinator {

struct OpenAiGatewayOptions {
  transport::HttpServerOptions http;  // address, TLS, threads, body limit, timeouts
  // A chat template for a model whose tokenizer_config.json has none; "":
  // the model's own (without one, /v1/chat/completions is refused). Default: "".
  std::string chat_template_file;
  // How long one poll of a streaming generation waits for new tokens (a
  // stream's liveness check runs at least this often). Default: 1000 ms.
  std::chrono::milliseconds stream_poll{1000};
  // The store of uploaded files (/v1/files; the coordinator's
  // <data-dir>/files). Empty path: files and batches are refused (409).
  // max_file_bytes is raised to the HTTP body limit when below it.
  jobs::FileStoreOptions files;
};

class OpenAiGateway {
 public:
  // Serves `coordinator` (which outlives it) for the model in `model_dir`
  // (its chat template), named as Health names it.
  static Result<std::unique_ptr<OpenAiGateway>> Start(Coordinator* coordinator, const std::string& model_dir,
                                                      const OpenAiGatewayOptions& options);
  ~OpenAiGateway();
  int port() const { return http_->port(); }
  void Stop();

 private:
  OpenAiGateway() = default;
  void Routes();
  void Generate(openai::Endpoint e, const httplib::Request& req, httplib::Response& res);

  // ---- files and batches (openai_batches.cc) ----
  void BatchRoutes();
  // The caller's tenant; FailedPrecondition without a file store.
  Result<std::string> FilesTenant(const httplib::Request& req) const;
  // A batch of the caller's: its job and what it was made from (NotFound
  // for an id that is not a batch, or a job of the Thrift API).
  Result<std::pair<rpc::JobInfo, openai::BatchRequest>> Batch(const std::string& key,
                                                              const std::string& batch_id) const;
  // A batch's output or error file, once the batch announces it.
  struct ResultFileView {
    rpc::JobInfo job;
    openai::BatchRequest batch;
    bool errors = false;
  };
  Result<ResultFileView> ResultFileOf(const std::string& key, const std::string& file_id) const;
  // The lines of one page of a batch's output (or error) file, in custom_id
  // order, from the result after *after; *after becomes the next page's
  // start ("" after the last).
  Result<std::string> ResultPage(const std::string& key, const ResultFileView& f, std::string* after) const;

  Coordinator* c_ = nullptr;
  OpenAiGatewayOptions o_;
  openai::ServedModel model_;
  std::shared_ptr<const openai::ChatTemplate> chat_;
  int64_t created_ = 0;                     // the model object's "created": when this gateway started
  std::unique_ptr<jobs::FileStore> files_;  // null: files and batches refused
  std::unique_ptr<transport::HttpServer> http_;
};

}  // namespace penumbra::coordinator
