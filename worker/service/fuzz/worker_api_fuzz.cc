// libFuzzer target: any bytes as what a caller sends to a worker's control
// API (framed TBinaryProtocol calls, several per input), read by the
// generated WorkerProcessor with the server's limits and handled by a
// handler that runs what the worker does with a request before the engine:
// FromRpc (worker/service/worker_server.h) and ValidateGenerationRequest
// (worker/engine/runtime.h) over a small model configuration. No model, no
// scheduler.
//
// A finding: a crash or sanitizer report; an exception other than Thrift's
// own or a handler error other than PenumbraError; a request accepted that
// breaks what validation promises (an id outside the vocabulary, a prompt
// over the context, document ends out of order, draws_done past the prompt,
// too many stop ids, sampling out of range).
//
// With PENUMBRA_FUZZ_SEEDS=DIR, LLVMFuzzerInitialize writes valid calls made
// by the generated client into DIR (.ci/fuzz.sh does).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>

#include <thrift/TOutput.h>
#include <thrift/TProcessor.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/transport/TBufferTransports.h>

#include "gen-cpp/Worker.h"
#include "transport/fuzz/thrift_fuzz.h"
#include "transport/thrift_util.h"
#include "worker/engine/runtime.h"
#include "worker/service/worker_server.h"

namespace penumbra::service {
namespace {

using apache::thrift::protocol::TBinaryProtocol;
using apache::thrift::transport::TFramedTransport;
using apache::thrift::transport::TMemoryBuffer;

void Fail(const char* what) {
  std::fprintf(stderr, "worker_api_fuzz: %s\n", what);
  std::abort();
}

transport::ThriftLimits Limits() {
  transport::ThriftLimits l;
  l.max_frame_bytes = 1 << 20;
  l.max_string_bytes = 1 << 20;
  l.max_container_elements = 1 << 18;
  return l;
}

// A small model: what validation reads of it.
ModelConfig Config(bool sliding) {
  ModelConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.vocab_size = 512;
  c.max_position_embeddings = 1024;
  c.eos_token_ids = {2};
  c.sliding_window = sliding ? 768 : 0;
  c.use_sliding_window = sliding;
  return c;
}

[[noreturn]] void Throw(const Status& s) { throw transport::ToRpcError(s); }

class ValidatingWorker : public rpc::WorkerIf {
 public:
  void set_config(const ModelConfig& c) { config_ = c; }

  void Generate(std::string& handle, const rpc::WorkerGenerateRequest& request) override {
    Result<GenerationRequest> g = FromRpc(request);
    if (!g.ok()) Throw(g.status());
    Status s = ValidateGenerationRequest(*g, config_);
    if (!s.ok()) Throw(s);
    CheckAccepted(*g);
    if (request.deadline_ms < 0 || request.deadline_ms > WorkerHandler::kMaxDeadlineMs) Fail("deadline accepted");
    if (!(request.share_weight > 0 && request.share_weight <= 1e6)) Fail("share_weight accepted");
    if (!ValidateOwnerId(request.owner_id).ok()) Fail("owner_id accepted");
    handle = "0123456789abcdef0123456789abcdef";
  }
  void Poll(rpc::TokenChunk&, const std::string&, int64_t offset, int32_t wait_ms) override {
    if (wait_ms < 0 || wait_ms > WorkerHandler::kMaxWaitMs) Throw(Status::InvalidArgument("wait_ms out of range"));
    if (offset < 0) Throw(Status::InvalidArgument("offset must be >= 0"));
    Throw(Status::NotFound("request is unknown"));
  }
  void Cancel(const std::string&) override { Throw(Status::NotFound("request is unknown")); }
  void Release(const std::string&) override { Throw(Status::NotFound("request is unknown")); }
  int32_t ForgetPrefixes(const std::vector<int32_t>& prompt, const std::vector<int64_t>& document_ends,
                         const std::string& cache_namespace) override {
    // The checks of a put of this prompt, as the worker makes them.
    GenerationRequest g;
    g.prompt = prompt;
    g.document_ends = document_ends;
    g.cache_namespace = cache_namespace;
    g.max_new_tokens = 0;
    Status s = ValidateGenerationRequest(g, config_);
    if (!s.ok()) Throw(s);
    CheckAccepted(g);
    return 0;
  }
  void Health(rpc::WorkerHealth& out) override {
    out.serving = true;
    out.max_context = config_.max_position_embeddings;
    out.vocab_size = config_.vocab_size;
  }
  void Stats(rpc::WorkerStats&) override {}
  void Renew(std::vector<std::string>& out, const std::string& owner_id) override {
    Status s = ValidateOwnerId(owner_id);
    if (!s.ok()) Throw(s);
    out.clear();
  }

 private:
  // What ValidateGenerationRequest promises of a request it accepts.
  void CheckAccepted(const GenerationRequest& g) const {
    const int64_t n = static_cast<int64_t>(g.prompt.size());
    if (n == 0) Fail("an empty prompt");
    if (g.max_new_tokens < 0 || n + g.max_new_tokens > config_.max_position_embeddings) Fail("over the context");
    if (config_.use_sliding_window && n + g.max_new_tokens > config_.sliding_window) Fail("over the window");
    for (int32_t id : g.prompt) {
      if (id < 0 || id >= config_.vocab_size) Fail("a prompt id outside the vocabulary");
    }
    int64_t prev = 0;
    for (int64_t e : g.document_ends) {
      if (e <= prev || e > n) Fail("document ends out of order or past the prompt");
      prev = e;
    }
    if (g.draws_done < 0 || g.draws_done > n) Fail("draws_done past the prompt");
    if (static_cast<int64_t>(g.stop_ids.size()) > GenerationRequest::kMaxStopIds) Fail("too many stop ids");
    for (int32_t id : g.stop_ids) {
      if (id < 0 || id >= config_.vocab_size) Fail("a stop id outside the vocabulary");
    }
    const SamplingOptions& s = g.sampling;
    if (!(s.temperature >= 0 && s.temperature <= SamplingOptions::kMaxTemperature)) Fail("temperature");
    if (!(s.top_p > 0 && s.top_p <= 1) || s.top_k < 0) Fail("top_p or top_k");
  }

  ModelConfig config_ = Config(false);
};

class FailOnHandlerError : public apache::thrift::TProcessorEventHandler {
 public:
  void handlerError(void*, const char* fn_name) override {
    std::fprintf(stderr, "worker_api_fuzz: %s threw something other than PenumbraError\n", fn_name);
    std::abort();
  }
};

struct Harness {
  std::shared_ptr<ValidatingWorker> handler = std::make_shared<ValidatingWorker>();
  std::shared_ptr<rpc::WorkerProcessor> processor = std::make_shared<rpc::WorkerProcessor>(handler);
  Harness() { processor->setEventHandler(std::make_shared<FailOnHandlerError>()); }
};

Harness& TheHarness() {
  static Harness* h = new Harness();
  return *h;
}

void WriteSeed(const std::string& dir, const std::string& name, const std::function<void(rpc::WorkerClient&)>& send) {
  transport::fuzz::WriteSeed<rpc::WorkerClient>(dir, name, send);
}

void WriteSeeds(const std::string& dir) {
  WriteSeed(dir, "generate", [](rpc::WorkerClient& c) {
    rpc::WorkerGenerateRequest g;
    g.prompt = {1, 17, 33, 200, 5, 6, 7, 8};
    g.document_ends = {3, 5};
    g.cache_namespace = "tenant-a";
    g.max_new_tokens = 32;
    g.sampling.temperature = 0.8;
    g.sampling.top_k = 20;
    g.sampling.top_p = 0.95;
    g.sampling.seed = 3;
    g.stop_ids = {2, 9};
    g.deadline_ms = 60000;
    g.share_weight = 2;
    g.tenant = "tenant-a";
    g.draws_done = 2;
    c.send_Generate(g);
  });
  WriteSeed(dir, "put", [](rpc::WorkerClient& c) {
    rpc::WorkerGenerateRequest g;
    g.prompt = {1, 2, 3, 4, 5, 6};
    g.document_ends = {6};
    g.max_new_tokens = 0;
    c.send_Generate(g);
    c.send_ForgetPrefixes(g.prompt, g.document_ends, "tenant-a");
  });
  WriteSeed(dir, "handles", [](rpc::WorkerClient& c) {
    c.send_Poll("0123456789abcdef0123456789abcdef", 0, 100);
    c.send_Cancel("0123456789abcdef0123456789abcdef");
    c.send_Release("0123456789abcdef0123456789abcdef");
    c.send_Health();
    c.send_Stats();
  });
}

}  // namespace
}  // namespace penumbra::service

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Thrift's own notes ("received invalid message type") are not findings.
  apache::thrift::GlobalOutput.setOutputFunction([](const char*) {});
  if (const char* dir = std::getenv("PENUMBRA_FUZZ_SEEDS")) penumbra::service::WriteSeeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace penumbra::service;
  Harness& h = TheHarness();
  // An odd-sized input is checked against a model with a sliding window.
  h.handler->set_config(Config(size % 2 == 1));
  penumbra::transport::fuzz::RunFrames(*h.processor, data, size, Limits());
  return 0;
}
