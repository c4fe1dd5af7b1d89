// libFuzzer target: a request body of the OpenAI-compatible API as a client
// sends it (coordinator/openai/openai_api.h): ParseBody, then
// ParseCompletions, ParseChat (through a chat template) and
// ParsePutDocument; the bytes as a batch's JSONL input file
// (ParseBatchInput) and the body as a POST /v1/batches (ParseCreateBatch).
// Every input must end in a request or a typed refusal
// (InvalidArgument, NotFound for another model): never a crash, undefined
// behaviour, a leak, or a parse nested past kMaxJsonDepth.
// Built and run by .ci/fuzz.sh; with PENUMBRA_FUZZ_SEEDS=DIR,
// LLVMFuzzerInitialize writes a few seed bodies there.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "coordinator/openai/batch_api.h"
#include "coordinator/openai/openai_api.h"
#include "tests/fuzz_seeds.h"

namespace {

using penumbra::StatusCode;
namespace oa = penumbra::openai;

const char* kSeeds[] = {
    R"({"model": "m", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stop": ["\n", "."]})",
    R"({"model": "m", "prompt": [[1, 2, 3]], "stream": true, "stream_options": {"include_usage": true}, "seed": -5})",
    R"({"model": "m", "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content":
        [{"type": "text", "text": "hi"}]}], "max_completion_tokens": 4, "documents": ["doc-1"], "top_k": 3})",
    R"({"model": "m", "messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function"}],
        "logprobs": true, "n": 2, "response_format": {"type": "json_object"}})",
    R"({"name": "report", "text": "a long document", "wait": false})",
    R"({"input_file_id": "file-1", "endpoint": "/v1/completions", "completion_window": "24h", "metadata": {"a": "b"}})",
    "{\"custom_id\": \"a\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"model\": \"m\", "
    "\"prompt\": \"hi\"}}\n\n{\"custom_id\": \"b\", \"url\": \"/v1/completions\", \"body\": {\"model\": \"m\", "
    "\"prompt\": [1, 2]}}\n",
};

bool Typed(const penumbra::Status& s) {
  return s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kNotFound ||
         s.code() == StatusCode::kFailedPrecondition;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  penumbra::testing::WriteFuzzSeeds(kSeeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const oa::ChatTemplate* chat = [] {
    auto t = oa::ChatTemplate::Parse(
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}");
    if (!t.ok()) std::abort();
    return new oa::ChatTemplate(std::move(*t));
  }();
  oa::ServedModel model;
  model.id = "m";
  model.max_new_tokens = 4096;
  model.chat = chat;
  model.bos_token = "<s>";
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  for (oa::Endpoint e : {oa::Endpoint::kCompletions, oa::Endpoint::kChat}) {
    auto items = oa::ParseBatchInput(
        bytes, e, model, [] { return int64_t{7}; }, std::chrono::system_clock::time_point(), 100);
    if (!items.ok() && !Typed(items.status())) std::abort();
    if (items.ok() && (items->empty() || items->size() > 100)) std::abort();
  }
  penumbra::Result<nlohmann::json> body = oa::ParseBody(bytes);
  if (!body.ok()) {
    if (body.status().code() != StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  auto check = [](const penumbra::Result<oa::Parsed>& p) {
    if (!p.ok() && !Typed(p.status())) std::abort();
    if (p.ok() && (p->generate.max_new_tokens < 1 || p->generate.max_new_tokens > 4096)) std::abort();
  };
  check(oa::ParseCompletions(*body, model, 7));
  check(oa::ParseChat(*body, model, 7, std::chrono::system_clock::time_point()));
  penumbra::Result<oa::BatchRequest> batch = oa::ParseCreateBatch(*body);
  if (!batch.ok() && batch.status().code() != StatusCode::kInvalidArgument) std::abort();
  if (batch.ok() && oa::BatchOfJob(oa::BatchJobMetadata(*batch))->input_file_id != batch->input_file_id) std::abort();
  penumbra::Result<penumbra::rpc::PutDocumentRequest> put = oa::ParsePutDocument(*body);
  if (!put.ok() && put.status().code() != StatusCode::kInvalidArgument) std::abort();
  return 0;
}
