// libFuzzer target: any bytes as what a client sends to the public API's port
// (framed TBinaryProtocol calls, several per input), read by the generated
// PenumbraProcessor with the server's limits and handled by a handler that
// authenticates against a small in-memory tenant set (keys, a tenant that
// requires a client certificate, a token quota) and runs the coordinator's
// real validation functions (coordinator/server/validation.h) -- everything
// the coordinator does with a request before it reaches a worker.
//
// A finding: a crash or sanitizer report; an exception other than Thrift's
// own (a malformed frame ends the connection) or a handler error other than
// PenumbraError; a request accepted that breaks what validation promises
// (a list past its limit, an id outside the vocabulary, a prompt over the
// context, a reservation over the quota); an authentication refusal whose
// text depends on the key; an error message that grows with the input.
//
// With PENUMBRA_FUZZ_SEEDS=DIR, LLVMFuzzerInitialize writes valid calls made
// by the generated client into DIR (.ci/fuzz.sh does).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <thrift/TApplicationException.h>
#include <thrift/TOutput.h>
#include <thrift/TProcessor.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/protocol/TProtocolException.h>
#include <thrift/transport/TBufferTransports.h>
#include <thrift/transport/TTransportException.h>

#include "coordinator/server/validation.h"
#include "coordinator/tenants/tenants.h"
#include "gen-cpp/Penumbra.h"
#include "transport/fuzz/thrift_fuzz.h"
#include "transport/thrift_util.h"

namespace penumbra::coordinator {
namespace {

using apache::thrift::TException;
using apache::thrift::protocol::TBinaryProtocol;
using apache::thrift::transport::TFramedTransport;
using apache::thrift::transport::TMemoryBuffer;

constexpr char kAlphaKey[] = "alpha-key-0123456789";  // tenant alpha: 100 generated tokens a minute
constexpr char kBetaKey[] = "beta-key-0123456789";    // tenant beta: only with client certificate beta-app
constexpr char kBetaCert[] = "beta-app";
constexpr int64_t kAlphaRate = 100;

void Fail(const char* what) {
  std::fprintf(stderr, "public_api_fuzz: %s\n", what);
  std::abort();
}

// The server's limits, with frames small enough for the fuzzer's inputs.
transport::ThriftLimits Limits() {
  transport::ThriftLimits l;
  l.max_frame_bytes = 1 << 20;
  l.max_string_bytes = 1 << 20;
  l.max_container_elements = 1 << 18;
  return l;
}

ModelLimits Model() {
  ModelLimits m;
  m.vocab_size = 512;
  m.max_context = 1024;
  m.can_encode = true;
  m.can_decode = true;
  return m;
}

// A refusal: checked (a bounded message) and thrown as the coordinator
// throws it.
[[noreturn]] void Throw(const Status& s) {
  if (s.ok()) Fail("threw an OK status");
  if (s.message().size() > 4096) Fail("an error message of more than 4 KiB");
  throw transport::ToRpcError(s);
}

class ValidatingHandler : public rpc::PenumbraIf {
 public:
  ValidatingHandler() {
    tenants::TenantsConfig c;
    tenants::TenantConfig alpha;
    alpha.name = "alpha";
    alpha.api_keys = {*tenants::HashApiKey(kAlphaKey)};
    alpha.quotas.generated_tokens_per_minute = kAlphaRate;
    tenants::TenantConfig beta;
    beta.name = "beta";
    beta.api_keys = {*tenants::HashApiKey(kBetaKey)};
    beta.client_certificate = kBetaCert;
    beta.admin = true;
    c.tenants = {alpha, beta};
    tenants::TenantRegistryOptions o;
    o.clock = [] { return 1000.0; };  // fixed: every input sees the same buckets
    auto r = tenants::TenantRegistry::Create(c, o);
    if (!r.ok()) Fail("the tenant set does not load");
    registry_ = std::move(*r);
  }

  // The client certificate the current input's connection presents.
  void set_client_certificate(std::string name) { cert_ = std::move(name); }

  void PutDocument(rpc::DocumentInfo& out, const rpc::PutDocumentRequest& r) override {
    Auth(r.api_key);
    Check(ValidatePutDocumentRequest(r, limits_, model_), r.api_key);
    const int64_t n = r.__isset.token_ids ? static_cast<int64_t>(r.token_ids.size()) : 0;
    if (n >= model_.max_context) Fail("a document over the context was accepted");
    for (int32_t id : r.token_ids) {
      if (r.__isset.token_ids && (id < 0 || id >= model_.vocab_size)) Fail("a document id outside the vocabulary");
    }
    out.name = r.name;
    out.tokens = n;
  }
  void GetDocument(rpc::DocumentInfo& out, const std::string& api_key, const std::string& id,
                   int64_t deadline_ms) override {
    Auth(api_key);
    Check(ValidateId("document_id", id, limits_), api_key);
    Check(ValidateDeadline("deadline_ms", deadline_ms, limits_), api_key);
    out.id = id;
  }
  void ListDocuments(rpc::DocumentList&, const rpc::ListDocumentsRequest& r) override {
    Auth(r.api_key);
    Check(ValidatePageSize(r.page_size, limits_), r.api_key);
    Check(ValidateId("page_token", r.page_token, limits_), r.api_key);
    Check(ValidateDeadline("deadline_ms", r.deadline_ms, limits_), r.api_key);
  }
  void DeleteDocument(const std::string& api_key, const std::string& id, int64_t deadline_ms) override {
    Auth(api_key);
    Check(ValidateId("document_id", id, limits_), api_key);
    Check(ValidateDeadline("deadline_ms", deadline_ms, limits_), api_key);
  }
  void Generate(std::string& out, const rpc::GenerateRequest& r) override {
    const std::string tenant = Auth(r.api_key);
    Check(ValidateGenerateRequest(r, limits_, model_), r.api_key);
    CheckAccepted(r);
    // No documents are stored here: the question alone is the prompt (a
    // text's length in bytes stands in for its tokens).
    const int64_t prompt =
        r.__isset.token_ids ? static_cast<int64_t>(r.token_ids.size()) : static_cast<int64_t>(r.text.size());
    Check(ValidatePromptLength(prompt, r.max_new_tokens, model_), r.api_key);
    const int64_t bound = GeneratedTokensBound(prompt, r.max_new_tokens, model_);
    if (bound < 0 || bound > r.max_new_tokens || prompt + bound > model_.max_context) Fail("a bad token bound");
    tenants::TokenReservation reservation;
    tenants::QuotaDecision d = registry_->ReserveTokens(tenant, bound, &reservation);
    if (!d.ok()) Check(d.status.WithRetryAfter(d.retry_after_ms()), r.api_key);
    if (tenant == "alpha" && reservation.reserved() > kAlphaRate) Fail("a reservation over the quota");
    reservation.Settle(0);
    out = "req-0123456789abcdef0123456789abcdef";
  }
  void Poll(rpc::GenerateChunk&, const std::string& api_key, const std::string& id, int64_t offset,
            int32_t wait_ms) override {
    Auth(api_key);
    Check(ValidateWaitMs(wait_ms, limits_), api_key);
    Check(ValidateId("request_id", id, limits_), api_key);
    if (offset < 0) Check(Status::InvalidArgument("offset must be >= 0"), api_key);
    Check(Status::NotFound("request '" + Excerpt(id, 40) + "' is unknown"), api_key);
  }
  void Cancel(const std::string& api_key, const std::string& id) override {
    Auth(api_key);
    Check(ValidateId("request_id", id, limits_), api_key);
  }
  void Complete(rpc::GenerateChunk& out, const rpc::GenerateRequest& r) override { Generate(out.request_id, r); }
  void SubmitJob(rpc::JobInfo& out, const rpc::SubmitJobRequest& r) override {
    const std::string tenant = Auth(r.api_key);
    Check(ValidateSubmitJobRequest(r, limits_, model_), r.api_key);
    if (r.items.empty() || static_cast<int64_t>(r.items.size()) > limits_.max_job_items) Fail("a job's item count");
    if (static_cast<int64_t>(r.metadata.size()) > limits_.max_job_metadata_bytes) Fail("a job's metadata size");
    for (const rpc::JobItem& it : r.items) {
      CheckAccepted(it.request);
      Check(registry_->CheckTokensFit(tenant, it.request.max_new_tokens).status, r.api_key);
    }
    out.total = static_cast<int64_t>(r.items.size());
    out.metadata = r.metadata;
  }
  void GetJob(rpc::JobInfo&, const std::string& api_key, const std::string& id) override { IdCall(api_key, id); }
  void ListJobs(rpc::JobList&, const std::string& api_key, const std::string& page_token, int32_t page_size) override {
    Auth(api_key);
    Check(ValidatePageSize(page_size, limits_), api_key);
    Check(ValidateId("page_token", page_token, limits_), api_key);
  }
  void GetJobResults(rpc::JobResults&, const std::string& api_key, const std::string& id, const std::string& after,
                     int32_t page_size) override {
    IdCall(api_key, id);
    Check(ValidatePageSize(page_size, limits_), api_key);
    Check(ValidateId("after_custom_id", after, limits_), api_key);
  }
  void CancelJob(rpc::JobInfo&, const std::string& api_key, const std::string& id) override { IdCall(api_key, id); }
  void DeleteJob(const std::string& api_key, const std::string& id) override { IdCall(api_key, id); }
  void Health(rpc::HealthResponse& out) override {
    out.serving = true;
    out.model = "fuzz-model";
  }
  void Stats(rpc::StatsResponse& out, const std::string& api_key) override {
    const std::string tenant = Auth(api_key);
    Result<tenants::TenantConfig> t = registry_->Tenant(tenant);
    if (!t.ok()) Fail("an authenticated tenant is not configured");
    if (t->admin) out.workers.resize(1);
  }

 private:
  std::string Auth(const std::string& api_key) {
    Result<std::string> t = registry_->Authenticate(api_key, cert_);
    if (!t.ok()) {
      if (t.status().code() != StatusCode::kPermissionDenied) Fail("authentication failed with another code");
      // The refusal is one fixed text: it echoes nothing of the key and does
      // not tell a valid key without its certificate from a wrong one.
      if (t.status().message() != tenants::TenantRegistry::kNotAuthorized &&
          !(api_key.empty() && t.status().message() == "no API key was given")) {
        Fail("an authentication refusal that depends on the key");
      }
      Throw(t.status());
    }
    if (*t == "beta" && cert_ != kBetaCert) Fail("beta authenticated without its client certificate");
    return *t;
  }
  void Check(const Status& s, const std::string&) {
    if (!s.ok()) Throw(s);
  }
  void IdCall(const std::string& api_key, const std::string& id) {
    Auth(api_key);
    Check(ValidateId("job_id", id, limits_), api_key);
  }
  // What ValidateGenerateRequest promises of a request it accepts.
  void CheckAccepted(const rpc::GenerateRequest& r) const {
    if (static_cast<int64_t>(r.document_ids.size()) > limits_.max_document_ids) Fail("too many document ids");
    for (size_t i = 0; i < r.document_ids.size(); ++i) {
      if (static_cast<int64_t>(r.document_ids[i].size()) > limits_.max_id_bytes) Fail("an over-long document id");
      for (size_t j = 0; j < i; ++j) {
        if (r.document_ids[i] == r.document_ids[j]) Fail("a document id twice");
      }
    }
    if (r.__isset.text == r.__isset.token_ids) Fail("not exactly one of text and token_ids");
    if (r.__isset.token_ids) {
      if (r.token_ids.empty() || static_cast<int64_t>(r.token_ids.size()) >= model_.max_context) Fail("question size");
      for (int32_t id : r.token_ids) {
        if (id < 0 || id >= model_.vocab_size) Fail("a question id outside the vocabulary");
      }
    }
    if (r.max_new_tokens < 1 || r.max_new_tokens >= model_.max_context) Fail("max_new_tokens out of range");
    if (static_cast<int64_t>(r.stop.size()) > limits_.max_stop_strings) Fail("too many stop strings");
    if (static_cast<int64_t>(r.stop_ids.size()) > limits_.max_stop_ids) Fail("too many stop ids");
    for (int32_t id : r.stop_ids) {
      if (id < 0 || id >= model_.vocab_size) Fail("a stop id outside the vocabulary");
    }
    if (!(r.sampling.temperature >= 0 && r.sampling.temperature <= 100)) Fail("temperature out of range");
    if (!(r.sampling.top_p > 0 && r.sampling.top_p <= 1)) Fail("top_p out of range");
  }

  RequestLimits limits_;
  ModelLimits model_ = Model();
  std::unique_ptr<tenants::TenantRegistry> registry_;
  std::string cert_;
};

// A handler error that is not a PenumbraError (the processor would turn it
// into an application exception): a finding.
class FailOnHandlerError : public apache::thrift::TProcessorEventHandler {
 public:
  void handlerError(void*, const char* fn_name) override {
    std::fprintf(stderr, "public_api_fuzz: %s threw something other than PenumbraError\n", fn_name);
    std::abort();
  }
};

struct Harness {
  std::shared_ptr<ValidatingHandler> handler = std::make_shared<ValidatingHandler>();
  std::shared_ptr<rpc::PenumbraProcessor> processor = std::make_shared<rpc::PenumbraProcessor>(handler);
  Harness() { processor->setEventHandler(std::make_shared<FailOnHandlerError>()); }
};

Harness& TheHarness() {
  static Harness* h = new Harness();
  return *h;
}

// Writes one seed: the calls `send` makes through the generated client, framed.
void WriteSeed(const std::string& dir, const std::string& name, const std::function<void(rpc::PenumbraClient&)>& send) {
  transport::fuzz::WriteSeed<rpc::PenumbraClient>(dir, name, send);
}

rpc::GenerateRequest Question(const std::string& key, std::vector<int32_t> ids, int32_t max_new) {
  rpc::GenerateRequest r;
  r.api_key = key;
  r.__set_token_ids(std::move(ids));
  r.max_new_tokens = max_new;
  return r;
}

void WriteSeeds(const std::string& dir) {
  WriteSeed(dir, "health", [](rpc::PenumbraClient& c) { c.send_Health(); });
  WriteSeed(dir, "stats_beta", [](rpc::PenumbraClient& c) { c.send_Stats(kBetaKey); });
  WriteSeed(dir, "generate", [](rpc::PenumbraClient& c) {
    rpc::GenerateRequest r = Question(kAlphaKey, {1, 2, 3, 4}, 16);
    r.document_ids = {"doc-0123456789abcdef", "doc-fedcba9876543210"};
    r.stop = {"\n\n", "END"};
    r.stop_ids = {2, 7};
    r.sampling.temperature = 0.7;
    r.sampling.top_p = 0.9;
    r.sampling.top_k = 40;
    r.sampling.seed = 5;
    r.kv_policy = "shadowkv";
    r.deadline_ms = 30000;
    c.send_Generate(r);
  });
  WriteSeed(dir, "complete_text", [](rpc::PenumbraClient& c) {
    rpc::GenerateRequest r;
    r.api_key = kBetaKey;
    r.__set_text("What did Ben find in the park?");
    r.max_new_tokens = 64;
    c.send_Complete(r);
  });
  WriteSeed(dir, "put_ids", [](rpc::PenumbraClient& c) {
    rpc::PutDocumentRequest r;
    r.api_key = kAlphaKey;
    r.name = "story";
    r.__set_token_ids({1, 5, 9, 11, 300});
    r.wait = false;
    c.send_PutDocument(r);
  });
  WriteSeed(dir, "put_text", [](rpc::PenumbraClient& c) {
    rpc::PutDocumentRequest r;
    r.api_key = kAlphaKey;
    r.name = "text";
    r.__set_text("Once upon a time there was a little dog.");
    c.send_PutDocument(r);
  });
  WriteSeed(dir, "documents", [](rpc::PenumbraClient& c) {
    rpc::ListDocumentsRequest l;
    l.api_key = kAlphaKey;
    l.page_size = 10;
    c.send_ListDocuments(l);
    c.send_GetDocument(kAlphaKey, "doc-0123456789abcdef", 1000);
    c.send_DeleteDocument(kAlphaKey, "doc-0123456789abcdef", 0);
  });
  WriteSeed(dir, "poll_cancel", [](rpc::PenumbraClient& c) {
    c.send_Poll(kAlphaKey, "req-0123456789abcdef0123456789abcdef", 0, 1000);
    c.send_Cancel(kAlphaKey, "req-0123456789abcdef0123456789abcdef");
  });
  WriteSeed(dir, "submit_job", [](rpc::PenumbraClient& c) {
    rpc::SubmitJobRequest j;
    j.api_key = kAlphaKey;
    j.metadata = "{\"batch\": 1}";
    j.completion_window_s = 3600;
    for (int i = 0; i < 3; ++i) {
      rpc::JobItem it;
      it.custom_id = "q" + std::to_string(i);
      it.request = Question("", {3, 4, 5}, 8 + i);
      it.request.document_ids = {"doc-0123456789abcdef"};
      j.items.push_back(it);
    }
    c.send_SubmitJob(j);
  });
  WriteSeed(dir, "jobs", [](rpc::PenumbraClient& c) {
    c.send_GetJob(kAlphaKey, "job-0123456789abcdef");
    c.send_ListJobs(kAlphaKey, "", 100);
    c.send_GetJobResults(kAlphaKey, "job-0123456789abcdef", "q1", 50);
    c.send_CancelJob(kAlphaKey, "job-0123456789abcdef");
    c.send_DeleteJob(kAlphaKey, "job-0123456789abcdef");
  });
}

}  // namespace
}  // namespace penumbra::coordinator

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Thrift's own notes ("received invalid message type") are not findings.
  apache::thrift::GlobalOutput.setOutputFunction([](const char*) {});
  if (const char* dir = std::getenv("PENUMBRA_FUZZ_SEEDS")) penumbra::coordinator::WriteSeeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace penumbra::coordinator;
  Harness& h = TheHarness();
  // An odd-sized input's connection presents beta's client certificate.
  h.handler->set_client_certificate(size % 2 ? kBetaCert : "");
  penumbra::transport::fuzz::RunFrames(*h.processor, data, size, Limits());
  return 0;
}
