// libFuzzer target: ChatTemplate::Parse and Render (coordinator/openai/
// chat_template.h) on an arbitrary template and context. Both come from
// outside (a model's tokenizer_config.json, a client's messages), so every
// input must end in an output or an InvalidArgument: never a crash, a hang,
// undefined behaviour, a leak (macros and namespaces can refer to themselves)
// or memory beyond the limits.
// Input: the template's source, then optionally a NUL byte and the context as
// JSON (an object; anything else renders with a fixed conversation).
// Built and run by .ci/fuzz.sh; with PENUMBRA_FUZZ_SEEDS=DIR,
// LLVMFuzzerInitialize writes a few seed inputs there.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "coordinator/openai/chat_template.h"
#include "tests/fuzz_seeds.h"

namespace {

const char* kDefaultContext = R"({"messages": [{"role": "system", "content": "Be brief."},
  {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>x</think>Hello",
  "tool_calls": [{"function": {"name": "f", "arguments": {"a": [1, 2.5, null, true]}}}]},
  {"role": "tool", "content": "{}"}], "tools": [{"type": "function", "function": {"name": "f"}}],
  "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>"})";

const char* kSeeds[] = {
    "{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content | trim }}{% if not loop.last %}\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
    "{% set ns = namespace(i=-1) %}{% for m in messages[::-1] %}{% if ns.i < 0 and m.role == 'user' %}"
    "{% set ns.i = loop.revindex0 %}{% endif %}{% endfor %}{{ ns.i }}{{ tools | tojson(indent=2) }}",
    "{{ bos_token }}{% for m in messages if m.role != 'system' %}{% if (m.role == 'user') != loop.index is odd %}"
    "{{ raise_exception('alternate') }}{% endif %}[{{ m.role | upper }}] {{ m.content }}{% endfor %}",
    "{% macro r(x, d=0) %}{% if x is mapping %}{% for k, v in x | dictsort %}{{ k }}:{{ r(v, d + 1) }}{% endfor %}"
    "{% elif x is iterable and x is not string %}[{{ x | map('string') | join(',') }}]{% else %}{{ x }}"
    "{% endif %}{% endmacro %}{{ r(messages[2]) }}{{ strftime_now('%Y %B') }}",
    "  {%- raw %}{{ x }}{% endraw %}\n{# c #}\n  {%+ if true -%}  {{ 'a' ~ 1 ~ none }}{%- endif +%}\n"
    "{% filter upper %}{{ range(3) | list }}{% endfilter %}{% set a, b = 1, 2.5 %}{{ a // b }}",
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  penumbra::testing::WriteFuzzSeeds(kSeeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const nlohmann::ordered_json kContext = nlohmann::ordered_json::parse(kDefaultContext);
  std::string_view input(reinterpret_cast<const char*>(data), size);
  size_t nul = input.find('\0');
  nlohmann::ordered_json context = kContext;
  if (nul != std::string_view::npos) {
    nlohmann::ordered_json parsed = nlohmann::ordered_json::parse(input.substr(nul + 1), nullptr, false);
    if (parsed.is_object()) context = std::move(parsed);
    input = input.substr(0, nul);
  }
  penumbra::openai::ChatTemplateLimits limits;
  limits.max_output_bytes = 1 << 20;
  limits.max_steps = 200000;
  limits.max_depth = 64;
  penumbra::Result<penumbra::openai::ChatTemplate> t = penumbra::openai::ChatTemplate::Parse(input, limits);
  if (!t.ok()) {
    if (t.status().code() != penumbra::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  penumbra::Result<std::string> out = t->Render(context, std::chrono::system_clock::time_point());
  if (!out.ok() && out.status().code() != penumbra::StatusCode::kInvalidArgument) std::abort();
  if (out.ok() && static_cast<int64_t>(out->size()) > limits.max_output_bytes) std::abort();
  return 0;
}
