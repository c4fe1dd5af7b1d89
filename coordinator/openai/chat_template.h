// Chat templates: renders a model's Hugging Face chat template (the Jinja2
// source under `chat_template` in tokenizer_config.json) into a prompt, byte
// for byte as transformers' apply_chat_template does.
//
// The interpreter implements the subset of Jinja2 that chat templates use,
// under the settings transformers uses: an immutable sandbox, trim_blocks and
// lstrip_blocks on, the loopcontrols extension ({% break %}, {% continue %}),
// the globals raise_exception(msg) and strftime_now(fmt), and a tojson filter
// that is Python's json.dumps(ensure_ascii=False). Supported: {% if %},
// {% for %} (loop.*, else, an inline `if` filter, tuple unpacking),
// {% set %} (namespaces, tuple targets, {% set x %}...{% endset %}),
// {% macro %}, {% filter %}, {% generation %}, {% raw %}, comments and all
// the whitespace controls; expressions with Python's semantics for the types
// JSON brings in (str, int, float, bool, None, list, dict); 37 of Jinja2's
// filters and its tests; the str and dict methods templates call; range(),
// namespace() and dict(). Not supported: template inheritance and includes,
// {% call %}, recursive loops, *args/**kwargs, `%` string formatting,
// format specs in str.format, and case mapping beyond ASCII.
//
// Templates and contexts come from outside (a model's files, a client's
// messages and tools), so nothing here trusts them: every error is a Status
// naming line:column, and ChatTemplateLimits bound the work, the output and
// the nesting so that no input can hang, exhaust memory or overflow the stack.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace penumbra::openai {

namespace chat_template_internal {
struct Template;
}  // namespace chat_template_internal

// Bounds on one template's parse and each of its renders. A render that
// crosses one fails with InvalidArgument naming the limit.
struct ChatTemplateLimits {
  // Largest rendered prompt, and largest string a render may build, in bytes. Default: 16 MiB.
  int64_t max_output_bytes = int64_t{16} << 20;
  // Work budget of one render: a step per expression and statement evaluated,
  // per loop iteration, per list or dict element built and per 16 bytes of a
  // string built. Default: 10,000,000.
  int64_t max_steps = 10'000'000;
  // Deepest nesting of the syntax tree (blocks inside blocks, operands inside
  // expressions), of blocks and expressions plus macro calls while rendering,
  // and of lists and dicts in the context and in computed values. Default: 256.
  int max_depth = 256;
};

// A parsed template. Copies share the parsed form; Render is const and may
// run on several threads at once.
class ChatTemplate {
 public:
  // Parses a template's source (UTF-8; "\r\n" and "\r" read as "\n"). On a
  // syntax error, an unknown tag or filter, invalid UTF-8 or a source nested
  // deeper than limits.max_depth: InvalidArgument naming line:column and what
  // was expected there. Limits that are not positive: InvalidArgument.
  static Result<ChatTemplate> Parse(std::string_view source, ChatTemplateLimits limits = {});

  // Renders the template with the members of `context` (a JSON object) as its
  // variables: messages, add_generation_prompt, bos_token, eos_token, tools...
  // whatever the caller passes. strftime_now(fmt) formats `now` in UTC.
  // Errors (all InvalidArgument, naming line:column): raise_exception(msg)
  // called by the template (the message carries msg), a type error, a use of
  // an undefined value that Jinja2 refuses, a mutating call the sandbox
  // forbids (list.append), or a crossed limit. Pass an ordered_json to keep
  // the order of object keys as the client sent them (json.loads keeps it;
  // it shows in tojson and in loops over dicts); nlohmann::json sorts keys.
  Result<std::string> Render(const nlohmann::ordered_json& context, std::chrono::system_clock::time_point now) const;
  Result<std::string> Render(const nlohmann::json& context, std::chrono::system_clock::time_point now) const;

 private:
  explicit ChatTemplate(std::shared_ptr<const chat_template_internal::Template> t) : template_(std::move(t)) {}
  std::shared_ptr<const chat_template_internal::Template> template_;
};

}  // namespace penumbra::openai
