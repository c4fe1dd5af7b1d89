// libFuzzer target: a request body of the OpenAI-compatible API as a client
// sends it (coordinator/openai/openai_api.h): ParseBody, then
// ParseCompletions, ParseChat (through a chat template) and
// ParsePutDocument. Every input must end in a request or a typed refusal
// (InvalidArgument, NotFound for another model): never a crash, undefined
// behaviour, a leak, or a parse nested past kMaxJsonDepth.
// Built and run by .ci/fuzz.sh; with PENUMBRA_FUZZ_SEEDS=DIR,
// LLVMFuzzerInitialize writes a few seed bodies there.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>

#include "coordinator/openai/openai_api.h"

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
};

bool Typed(const penumbra::Status& s) {
  return s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kNotFound ||
         s.code() == StatusCode::kFailedPrecondition;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("PENUMBRA_FUZZ_SEEDS")) {
    int n = 0;
    for (const char* seed : kSeeds) std::ofstream(std::string(dir) + "/seed" + std::to_string(n++)) << seed;
  }
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
  penumbra::Result<nlohmann::json> body = oa::ParseBody(std::string_view(reinterpret_cast<const char*>(data), size));
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
  penumbra::Result<penumbra::rpc::PutDocumentRequest> put = oa::ParsePutDocument(*body);
  if (!put.ok() && put.status().code() != StatusCode::kInvalidArgument) std::abort();
  return 0;
}
