// libFuzzer target: any bytes as what a caller sends to a worker's control
// API (framed TBinaryProtocol calls, several per input), read by the
// generated WorkerProcessor with the server's limits and handled by a
// handler that runs what the worker does with a request before the engine:
// FromRpc (worker/service/worker_server.h) and ValidateGenerationRequest
// (worker/engine/runtime.h) over a small model configuration, and
// ValidateJoin (worker/service/group_member.h) for both ranks of a group of
// 2. No model, no scheduler.
//
// A finding: a crash or sanitizer report; an exception other than Thrift's
// own or a handler error other than PenumbraError; a request accepted that
// breaks what validation promises (an id outside the vocabulary, a prompt
// over the context, document ends out of order, draws_done past the prompt,
// too many stop ids, sampling out of range).
//
// With PENUMBRA_FUZZ_SEEDS=DIR, LLVMFuzzerInitialize writes valid calls made
// by the generated client into DIR (.ci/fuzz.sh does).
#include <algorithm>
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
#include "transport/worker_documents.h"
#include "worker/engine/runtime.h"
#include "worker/service/group_member.h"
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
    Accept(FromRpc(request, config_.max_position_embeddings), request.deadline_ms, request.share_weight, request.tenant,
           request.owner_id);
    handle = "0123456789abcdef0123456789abcdef";
  }
  void PutDocument(std::string& handle, const rpc::WorkerPutRequest& request) override {
    Accept(FromRpc(request, config_.max_position_embeddings), request.deadline_ms, request.share_weight, request.tenant,
           request.owner_id);
    handle = "0123456789abcdef0123456789abcdef";
  }
  void WaitPut(rpc::WorkerPutProgress&, const std::string&, int64_t, int32_t wait_ms) override {
    if (wait_ms < 0 || wait_ms > WorkerHandler::kMaxWaitMs) Throw(Status::InvalidArgument("wait_ms out of range"));
    Throw(Status::NotFound("request is unknown"));
  }
  void Poll(rpc::TokenChunk&, const std::string&, int64_t offset, int32_t wait_ms) override {
    if (wait_ms < 0 || wait_ms > WorkerHandler::kMaxWaitMs) Throw(Status::InvalidArgument("wait_ms out of range"));
    if (offset < 0) Throw(Status::InvalidArgument("offset must be >= 0"));
    Throw(Status::NotFound("request is unknown"));
  }
  void PollMany(std::vector<rpc::TokenChunk>&, const std::vector<rpc::WorkerPollTarget>& targets,
                int32_t wait_ms) override {
    if (wait_ms < 0 || wait_ms > WorkerHandler::kMaxWaitMs) Throw(Status::InvalidArgument("wait_ms out of range"));
    if (targets.size() > WorkerHandler::kMaxPollTargets) Throw(Status::InvalidArgument("too many targets"));
  }
  void Cancel(const std::string&) override { Throw(Status::NotFound("request is unknown")); }
  void Release(const std::string&) override { Throw(Status::NotFound("request is unknown")); }
  int32_t ForgetDocuments(const std::vector<rpc::WorkerDocument>& documents,
                          const std::string& cache_namespace) override {
    // The checks of a put of these documents by digest, as the worker makes them.
    GenerationRequest g;
    Status s = AppendDocuments(documents, config_.max_position_embeddings, &g);
    if (!s.ok()) Throw(s);
    g.cache_namespace = cache_namespace;
    g.max_new_tokens = 0;
    if (g.prompt.empty()) Throw(Status::InvalidArgument("no document"));
    s = ValidateGenerationRequest(g, config_);
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
  void JoinGroup(std::string& rendezvous, const rpc::WorkerJoinGroup& join) override {
    // The checks of both ranks of a group "g" of 2, then what they promise.
    for (int rank = 0; rank < 2; ++rank) {
      GroupMemberOptions o;
      o.name = "g";
      o.rank = rank;
      o.world = 2;
      Result<std::string> secret = ValidateJoin(o, join);
      if (!secret.ok()) {
        if (rank == 1) Throw(secret.status());
        continue;
      }
      if (join.name != "g" || join.rank != rank || join.world != 2) Fail("a join of another member accepted");
      if (join.epoch <= 0) Fail("epoch <= 0 accepted");
      if (secret->size() < 16) Fail("a secret under 128 bits accepted");
      if ((rank == 0) != join.rendezvous.empty()) Fail("a rendezvous for the wrong rank accepted");
      rendezvous = rank == 0 ? "127.0.0.1:1" : join.rendezvous;
      return;
    }
  }
  void Renew(std::vector<std::string>& out, const std::string& owner_id) override {
    Status s = ValidateOwnerId(owner_id);
    if (!s.ok()) Throw(s);
    out.clear();
  }

 private:
  // The worker's checks (conversion, the control API's fields, the request
  // against the model), then what they promise of a request they accept.
  void Accept(Result<GenerationRequest> g, int64_t deadline_ms, double share_weight, const std::string& tenant,
              const std::string& owner_id) const {
    if (!g.ok()) Throw(g.status());
    Result<SubmitOptions> o = SubmitOptionsFromRpc(deadline_ms, share_weight, tenant, owner_id);
    if (!o.ok()) Throw(o.status());
    Status s = ValidateGenerationRequest(*g, config_);
    if (!s.ok()) Throw(s);
    CheckAccepted(*g);
    if (deadline_ms < 0 || deadline_ms > WorkerHandler::kMaxDeadlineMs) Fail("deadline accepted");
    if (!(share_weight > 0 && share_weight <= 1e6)) Fail("share_weight accepted");
    if (!ValidateOwnerId(owner_id).ok()) Fail("owner_id accepted");
  }
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
    if (!g.document_digests.empty() && g.document_digests.size() != g.document_ends.size()) Fail("digests");
    if (g.ids_from != 0 && (g.document_digests.empty() || std::find(g.document_ends.begin(), g.document_ends.end(),
                                                                    g.ids_from) == g.document_ends.end())) {
      Fail("ids_from");
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
    transport::SetPrompt(&g, {1, 17, 33, 200, 5, 6, 7, 8}, {3, 5});
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
    // The same documents named by digest alone.
    for (rpc::WorkerDocument& d : g.documents) {
      d.ids.clear();
      d.__isset.ids = false;
    }
    c.send_Generate(g);
  });
  WriteSeed(dir, "put", [](rpc::WorkerClient& c) {
    rpc::WorkerPutRequest p;
    p.documents = transport::DocumentsOf({1, 2, 3, 4, 5, 6}, {6});
    p.cache_namespace = "tenant-a";
    c.send_PutDocument(p);
    c.send_WaitPut("0123456789abcdef0123456789abcdef", 0, 100);
    c.send_ForgetDocuments(p.documents, "tenant-a");
  });
  WriteSeed(dir, "handles", [](rpc::WorkerClient& c) {
    c.send_Poll("0123456789abcdef0123456789abcdef", 0, 100);
    c.send_Cancel("0123456789abcdef0123456789abcdef");
    c.send_Release("0123456789abcdef0123456789abcdef");
    c.send_Health();
    c.send_Stats();
  });
  WriteSeed(dir, "join", [](rpc::WorkerClient& c) {
    rpc::WorkerJoinGroup j;
    j.name = "g";
    j.epoch = 3;
    j.world = 2;
    j.rank = 0;
    j.secret = "00112233445566778899aabbccddeeff";
    c.send_JoinGroup(j);
    j.rank = 1;
    j.rendezvous = "127.0.0.1:40123";
    c.send_JoinGroup(j);
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
