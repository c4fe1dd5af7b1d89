#include "coordinator/openai/openai_api.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include "coordinator/openai/json_fields.h"
#include "transport/thrift_util.h"

namespace penumbra::openai {
namespace {

using nlohmann::json;
using namespace json_fields;  // NOLINT(google-build-using-namespace): this file's own readers

Result<std::vector<int32_t>> TokenIds(const json& v, const std::string& name) {
  std::vector<int32_t> out;
  out.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const json& t = v[i];
    if (!t.is_number_integer() || (!t.is_number_unsigned() && t.get<int64_t>() < 0) ||
        t.get<uint64_t>() > static_cast<uint64_t>(INT32_MAX)) {
      return Bad("'" + name + "[" + std::to_string(i) + "]' must be a token id (an integer >= 0), got " + t.dump());
    }
    out.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  return out;
}

// A field we do not serve: refused when it asks for anything but the
// default (`is_default` says what the default looks like).
template <typename Pred>
Status Unsupported(const json& body, const char* name, Pred is_default, const std::string& why) {
  const json* v = Field(body, name);
  if (v && !is_default(*v)) return Bad(std::string("'") + name + "' is not supported: " + why);
  return Status::OK();
}

// What completions and chat share: the model, sampling, limits, stop,
// streaming, and our extensions.
Status ParseCommon(const json& body, const ServedModel& model, Endpoint endpoint, int64_t random_seed, Parsed* p) {
  if (!body.is_object()) return Bad("the body must be a JSON object, got " + TypeName(body));
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<std::string> name, String(body, "model"));
  if (!name) return Bad("'model' is required (GET /v1/models lists it)");
  if (*name != model.id) {
    return Status::NotFound("the model '" + *name + "' does not exist: this service serves '" + model.id + "'");
  }
  p->endpoint = endpoint;
  rpc::GenerateRequest& g = p->generate;

  // Limits: max_tokens (or, in chat, max_completion_tokens, its new name).
  // Unset: OpenAI's defaults, 16 for completions and what the context
  // leaves for chat.
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<int64_t> max_tokens, Integer(body, "max_tokens", 1, model.max_new_tokens));
  if (endpoint == Endpoint::kChat) {
    PENUMBRA_ASSIGN_OR_RETURN(std::optional<int64_t> mct,
                              Integer(body, "max_completion_tokens", 1, model.max_new_tokens));
    if (mct && max_tokens && *mct != *max_tokens) {
      return Bad("'max_tokens' and 'max_completion_tokens' differ: give one");
    }
    if (mct) max_tokens = mct;
  }
  if (max_tokens) {
    g.max_new_tokens = static_cast<int32_t>(*max_tokens);
  } else if (endpoint == Endpoint::kCompletions) {
    g.max_new_tokens = std::min<int32_t>(16, model.max_new_tokens);
  } else {
    g.max_new_tokens = model.max_new_tokens;
    g.fit_context = true;
  }

  // Sampling: OpenAI's defaults are temperature 1 and top_p 1.
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<double> temperature, Number(body, "temperature", 0, 2));
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<double> top_p, Number(body, "top_p", 0, 1));
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<int64_t> top_k, Integer(body, "top_k", -1, INT32_MAX));
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<int64_t> seed, Integer(body, "seed", INT64_MIN, INT64_MAX));
  g.sampling.temperature = temperature.value_or(1.0);
  g.sampling.top_p = top_p.value_or(1.0);
  if (g.sampling.top_p <= 0) return Bad("'top_p' must be in (0, 1], got 0");
  g.sampling.top_k = top_k && *top_k > 0 ? static_cast<int32_t>(*top_k) : 0;
  // Our seeds are >= 0: a negative one (OpenAI takes any integer) is folded.
  if (seed) {
    g.sampling.seed = *seed >= 0 ? *seed : -(*seed + 1);
  } else {
    g.sampling.seed = g.sampling.temperature > 0 ? random_seed : 0;
  }

  PENUMBRA_ASSIGN_OR_RETURN(std::optional<int64_t> n, Integer(body, "n", 1, INT32_MAX));
  if (n && *n != 1) return Bad("'n' must be 1: send one request per choice");
  PENUMBRA_ASSIGN_OR_RETURN(g.stop, Strings(body, "stop", /*one=*/true));
  if (const json* ids = Field(body, "stop_token_ids")) {
    if (!ids->is_array()) return Bad("'stop_token_ids' must be an array of token ids, got " + TypeName(*ids));
    PENUMBRA_ASSIGN_OR_RETURN(g.stop_ids, TokenIds(*ids, "stop_token_ids"));
  }
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<bool> ignore_eos, Boolean(body, "ignore_eos"));
  g.ignore_eos = ignore_eos.value_or(false);
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<std::string> policy, String(body, "kv_policy"));
  g.kv_policy = policy.value_or("");
  PENUMBRA_ASSIGN_OR_RETURN(g.document_ids, Strings(body, "documents", /*one=*/false));
  // Prompt caching is automatic, as OpenAI's: a prompt that starts with
  // documents the tenant has put is served from their cached state.
  g.reuse_documents = g.document_ids.empty();
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<std::string> user, String(body, "user"));
  (void)user;  // accepted, not used

  PENUMBRA_ASSIGN_OR_RETURN(std::optional<bool> token_ids, Boolean(body, "return_token_ids"));
  p->return_token_ids = token_ids.value_or(false);
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<bool> stream, Boolean(body, "stream"));
  p->stream = stream.value_or(false);
  if (const json* so = Field(body, "stream_options")) {
    if (!so->is_object()) return Bad("'stream_options' must be an object, got " + TypeName(*so));
    if (!p->stream) return Bad("'stream_options' is only allowed with 'stream': true");
    PENUMBRA_ASSIGN_OR_RETURN(std::optional<bool> usage, Boolean(*so, "include_usage"));
    p->include_usage = usage.value_or(false);
  }

  // What we do not serve: refused by name rather than ignored.
  const auto zero = [](const json& v) { return v.is_number() && v.get<double>() == 0; };
  const auto empty = [](const json& v) { return (v.is_object() || v.is_array()) && v.empty(); };
  PENUMBRA_RETURN_IF_ERROR(Unsupported(body, "presence_penalty", zero, "penalties are not applied; send 0"));
  PENUMBRA_RETURN_IF_ERROR(Unsupported(body, "frequency_penalty", zero, "penalties are not applied; send 0"));
  PENUMBRA_RETURN_IF_ERROR(Unsupported(body, "logit_bias", empty, "logit biases are not applied"));
  return Status::OK();
}

// The text of a message's content: a string, or an array of text parts
// (joined by newlines). Other parts (images, audio) are refused.
Result<std::string> ContentText(const json& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array())
    return Bad("'" + where + "' must be a string or an array of parts, got " + TypeName(content));
  std::string out;
  for (size_t i = 0; i < content.size(); ++i) {
    const json& part = content[i];
    const std::string at = where + "[" + std::to_string(i) + "]";
    if (!part.is_object()) return Bad("'" + at + "' must be an object, got " + TypeName(part));
    PENUMBRA_ASSIGN_OR_RETURN(std::optional<std::string> type, String(part, "type"));
    if (!type) return Bad("'" + at + ".type' is required");
    if (*type != "text") return Bad("'" + at + ".type' '" + *type + "' is not supported: this model reads text parts");
    PENUMBRA_ASSIGN_OR_RETURN(std::optional<std::string> text, String(part, "text"));
    if (!text) return Bad("'" + at + ".text' is required");
    if (!out.empty()) out += "\n";
    out += *text;
  }
  return out;
}

}  // namespace

nlohmann::json ApiError::Body() const {
  json e = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
  if (!code.empty()) e["code"] = code;
  return json{{"error", e}};
}

ApiError ErrorOf(const Status& s) {
  ApiError e;
  e.message = s.message();
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
      e.http_status = 422;
      e.type = "invalid_request_error";
      break;
    case StatusCode::kNotFound:
      e.http_status = 404;
      e.type = "invalid_request_error";
      e.code = "not_found";
      break;
    case StatusCode::kPermissionDenied:
      e.http_status = 401;
      e.type = "authentication_error";
      e.code = "invalid_api_key";
      break;
    case StatusCode::kResourceExhausted:
      e.http_status = 429;
      e.type = "rate_limit_error";
      e.code = "rate_limit_exceeded";
      e.retry_after_ms = s.retry_after_ms() > 0 ? s.retry_after_ms() : 1000;
      break;
    case StatusCode::kFailedPrecondition:
      e.http_status = 409;
      e.type = "invalid_request_error";
      break;
    case StatusCode::kUnavailable:
      e.http_status = 503;
      e.type = "server_error";
      if (s.retry_after_ms() > 0) e.retry_after_ms = s.retry_after_ms();
      break;
    case StatusCode::kDeadlineExceeded:
      e.http_status = 504;
      e.type = "timeout";
      break;
    case StatusCode::kCancelled:
      e.http_status = 499;
      e.type = "cancelled";
      break;
    default:
      e.http_status = 500;
      e.type = "server_error";
      break;
  }
  return e;
}

ApiError ErrorOf(const rpc::PenumbraError& e) { return ErrorOf(transport::FromRpcError(e)); }

ApiError MalformedBody(const std::string& why) {
  ApiError e;
  e.http_status = 400;
  e.type = "invalid_request_error";
  e.message = "the body is not valid JSON: " + why;
  return e;
}

Result<nlohmann::json> ParseBody(std::string_view body) {
  // Depth first (nlohmann's parser recurses): brackets outside strings.
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth) {
        return Bad("nested deeper than " + std::to_string(kMaxJsonDepth) + " at byte " + std::to_string(i));
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad("it does not parse");
  if (!j.is_object()) return Bad("expected an object, got " + TypeName(j));
  return j;
}

Result<Parsed> ParseCompletions(const nlohmann::json& body, const ServedModel& model, int64_t random_seed) {
  Parsed p;
  PENUMBRA_RETURN_IF_ERROR(ParseCommon(body, model, Endpoint::kCompletions, random_seed, &p));
  const json* prompt = Field(body, "prompt");
  if (!prompt) return Bad("'prompt' is required");
  // A list of one prompt is that prompt; several are several requests.
  const json* one = prompt;
  if (prompt->is_array() && !prompt->empty() && (prompt->front().is_string() || prompt->front().is_array())) {
    if (prompt->size() != 1) return Bad("'prompt' holds " + std::to_string(prompt->size()) + " prompts: send one");
    one = &prompt->front();
  }
  if (one->is_string()) {
    if (one->get_ref<const std::string&>().empty() && p.generate.document_ids.empty()) {
      return Bad("'prompt' is empty");
    }
    if (!one->get_ref<const std::string&>().empty()) p.generate.__set_text(one->get<std::string>());
  } else if (one->is_array()) {
    if (one->empty()) return Bad("'prompt' is empty");
    PENUMBRA_ASSIGN_OR_RETURN(p.generate.token_ids, TokenIds(*one, "prompt"));
    p.generate.__isset.token_ids = true;
  } else {
    return Bad("'prompt' must be a string or an array of token ids, got " + TypeName(*one));
  }
  // A prompt that is only its documents: their last token starts the answer.
  if (!p.generate.__isset.text && !p.generate.__isset.token_ids) {
    return Bad("'prompt' is empty: with documents, send the question that follows them");
  }
  PENUMBRA_RETURN_IF_ERROR(Unsupported(
      body, "logprobs", [](const json&) { return false; }, "log probabilities are not returned"));
  PENUMBRA_RETURN_IF_ERROR(Unsupported(
      body, "echo", [](const json& v) { return v.is_boolean() && !v.get<bool>(); }, "the prompt is not echoed"));
  PENUMBRA_RETURN_IF_ERROR(Unsupported(
      body, "best_of", [](const json& v) { return v.is_number() && v.get<double>() == 1; }, "best_of must be 1"));
  PENUMBRA_RETURN_IF_ERROR(Unsupported(
      body, "suffix", [](const json& v) { return v.is_string() && v.get<std::string>().empty(); },
      "insertion (a suffix) is not served"));
  return p;
}

Result<Parsed> ParseChat(const nlohmann::json& body, const ServedModel& model, int64_t random_seed,
                         std::chrono::system_clock::time_point now) {
  Parsed p;
  PENUMBRA_RETURN_IF_ERROR(ParseCommon(body, model, Endpoint::kChat, random_seed, &p));
  if (!model.chat) {
    return Status::FailedPrecondition("the model '" + model.id +
                                      "' has no chat template: use /v1/completions, or start the "
                                      "coordinator with --chat-template FILE");
  }
  const json* messages = Field(body, "messages");
  if (!messages) return Bad("'messages' is required");
  if (!messages->is_array() || messages->empty()) return Bad("'messages' must be a non-empty array of messages");
  json conversation = json::array();
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) return Bad("'" + at + "' must be an object, got " + TypeName(m));
    PENUMBRA_ASSIGN_OR_RETURN(std::optional<std::string> role, String(m, "role"));
    if (!role) return Bad("'" + at + ".role' is required");
    if (*role == "developer") role = "system";  // OpenAI's newer name for it
    if (*role != "system" && *role != "user" && *role != "assistant" && *role != "tool") {
      return Bad("'" + at + ".role' must be system, developer, user, assistant or tool, got '" + *role + "'");
    }
    if (Field(m, "tool_calls") || Field(m, "function_call")) {
      return Bad("'" + at + "': tool calls are not supported");
    }
    const json* content = Field(m, "content");
    if (!content) return Bad("'" + at + ".content' is required");
    PENUMBRA_ASSIGN_OR_RETURN(std::string text, ContentText(*content, at + ".content"));
    json out = {{"role", *role}, {"content", std::move(text)}};
    PENUMBRA_ASSIGN_OR_RETURN(std::optional<std::string> name, String(m, "name"));
    if (name) out["name"] = *name;
    conversation.push_back(std::move(out));
  }
  const auto none = [](const json& v) { return (v.is_array() || v.is_object()) && v.empty(); };
  PENUMBRA_RETURN_IF_ERROR(Unsupported(body, "tools", none, "tool calling is not served"));
  PENUMBRA_RETURN_IF_ERROR(Unsupported(body, "functions", none, "function calling is not served"));
  PENUMBRA_RETURN_IF_ERROR(Unsupported(
      body, "tool_choice", [](const json& v) { return v.is_string() && v.get<std::string>() == "none"; },
      "tool calling is not served"));
  PENUMBRA_RETURN_IF_ERROR(Unsupported(
      body, "logprobs", [](const json& v) { return v.is_boolean() && !v.get<bool>(); },
      "log probabilities are not returned"));
  PENUMBRA_RETURN_IF_ERROR(Unsupported(
      body, "top_logprobs", [](const json&) { return false; }, "log probabilities are not returned"));
  PENUMBRA_RETURN_IF_ERROR(Unsupported(
      body, "response_format", [](const json& v) { return v.is_object() && v.value("type", "") == "text"; },
      "structured output is not served; only {\"type\": \"text\"}"));
  // The conversation as the model's template writes it; after documents,
  // without a second BOS (the first document starts the prompt).
  const bool after_documents = !p.generate.document_ids.empty();
  json context = {{"messages", std::move(conversation)},
                  {"add_generation_prompt", true},
                  {"bos_token", after_documents ? std::string() : model.bos_token},
                  {"eos_token", model.eos_token}};
  PENUMBRA_ASSIGN_OR_RETURN(std::string prompt, model.chat->Render(context, now));
  if (prompt.empty()) return Bad("the chat template rendered an empty prompt");
  p.generate.text = std::move(prompt);
  p.generate.__isset.text = true;
  // The template wrote the special tokens it wants (its BOS included).
  p.generate.add_special_tokens = false;
  return p;
}

nlohmann::json UsageJson(const rpc::Usage& u) {
  return json{{"prompt_tokens", u.prompt_tokens},
              {"completion_tokens", u.generated_tokens},
              {"total_tokens", u.prompt_tokens + u.generated_tokens},
              {"prompt_tokens_details", {{"cached_tokens", u.cached_prompt_tokens}}}};
}

nlohmann::json FinishReason(const std::string& ours) {
  if (ours == "stop" || ours == "length") return ours;
  return nullptr;
}

std::string ResponseId(Endpoint e, const std::string& request_id) {
  return (e == Endpoint::kChat ? "chatcmpl-" : "cmpl-") + request_id;
}

nlohmann::json Response(Endpoint e, const std::string& model, int64_t created, const rpc::GenerateChunk& done,
                        bool return_token_ids) {
  json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", FinishReason(done.finish_reason)}};
  if (return_token_ids) choice["token_ids"] = done.ids;
  if (e == Endpoint::kChat) {
    choice["message"] = {{"role", "assistant"}, {"content", done.text}, {"refusal", nullptr}};
  } else {
    choice["text"] = done.text;
  }
  return json{{"id", ResponseId(e, done.request_id)},
              {"object", e == Endpoint::kChat ? "chat.completion" : "text_completion"},
              {"created", created},
              {"model", model},
              {"system_fingerprint", nullptr},
              {"choices", json::array({choice})},
              {"usage", UsageJson(done.usage)}};
}

nlohmann::json StreamChunk(Endpoint e, const std::string& id, const std::string& model, int64_t created,
                           const std::string& text, bool first, const nlohmann::json& finish_reason, bool include_usage,
                           const std::vector<int32_t>* token_ids) {
  json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish_reason}};
  if (token_ids) choice["token_ids"] = *token_ids;
  if (e == Endpoint::kChat) {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || (first && finish_reason.is_null())) delta["content"] = text;
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = text;
  }
  json c = {{"id", id},
            {"object", e == Endpoint::kChat ? "chat.completion.chunk" : "text_completion"},
            {"created", created},
            {"model", model},
            {"system_fingerprint", nullptr},
            {"choices", json::array({choice})}};
  // With include_usage every chunk carries "usage": null but the last.
  if (include_usage) c["usage"] = nullptr;
  return c;
}

nlohmann::json UsageChunk(Endpoint e, const std::string& id, const std::string& model, int64_t created,
                          const rpc::Usage& u) {
  return json{{"id", id},
              {"object", e == Endpoint::kChat ? "chat.completion.chunk" : "text_completion"},
              {"created", created},
              {"model", model},
              {"system_fingerprint", nullptr},
              {"choices", json::array()},
              {"usage", UsageJson(u)}};
}

Result<rpc::PutDocumentRequest> ParsePutDocument(const nlohmann::json& body) {
  rpc::PutDocumentRequest r;
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<std::string> name, String(body, "name"));
  if (!name) return Bad("'name' is required");
  r.name = *name;
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<std::string> text, String(body, "text"));
  const json* ids = Field(body, "token_ids");
  if (text.has_value() == (ids != nullptr)) return Bad("give exactly one of 'text' and 'token_ids'");
  if (text) r.__set_text(*text);
  if (ids) {
    if (!ids->is_array()) return Bad("'token_ids' must be an array of token ids, got " + TypeName(*ids));
    PENUMBRA_ASSIGN_OR_RETURN(std::vector<int32_t> v, TokenIds(*ids, "token_ids"));
    r.token_ids = std::move(v);
    r.__isset.token_ids = true;
  }
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<bool> wait, Boolean(body, "wait"));
  r.wait = wait.value_or(true);
  return r;
}

nlohmann::json DocumentJson(const rpc::DocumentInfo& d) {
  const char* state = d.state == rpc::DocumentState::READY    ? "ready"
                      : d.state == rpc::DocumentState::FAILED ? "failed"
                                                              : "factoring";
  json j = {{"id", d.id},
            {"object", "document"},
            {"name", d.name},
            {"tokens", d.tokens},
            {"state", state},
            {"created_at", d.created_unix_ms / 1000},
            {"factored_tokens", d.factored_tokens},
            {"factor_seconds", d.factor_seconds >= 0 ? json(d.factor_seconds) : json(nullptr)}};
  if (d.__isset.error) j["error"] = d.error;
  return j;
}

nlohmann::json ModelObject(const std::string& model, int64_t created) {
  return json{{"id", model}, {"object", "model"}, {"created", created}, {"owned_by", "penumbra"}};
}

nlohmann::json ModelList(const std::string& model, int64_t created) {
  return json{{"object", "list"}, {"data", json::array({ModelObject(model, created)})}};
}

namespace {

// tokenizer_config.json's "bos_token": "<s>" or {"content": "<s>", ...}.
std::string TokenText(const json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return "";
}

Result<std::string> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status::NotFound(path + ": cannot be read");
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace

Result<LoadedChat> LoadChatTemplate(const std::string& model_dir, const std::string& template_file) {
  LoadedChat out;
  std::string source;
  json config = json::object();
  const std::string config_path = model_dir + "/tokenizer_config.json";
  if (Result<std::string> text = ReadFile(config_path); text.ok()) {
    config = json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (config.is_discarded() || !config.is_object()) {
      return Status::InvalidArgument(config_path + ": not a JSON object");
    }
  }
  out.bos_token = TokenText(config, "bos_token");
  out.eos_token = TokenText(config, "eos_token");
  if (!template_file.empty()) {
    PENUMBRA_ASSIGN_OR_RETURN(source, ReadFile(template_file));
    out.source = template_file;
  } else if (auto it = config.find("chat_template"); it != config.end() && !it->is_null()) {
    if (it->is_string()) {
      source = it->get<std::string>();
    } else if (it->is_array()) {
      for (const json& t : *it) {
        if (t.is_object() && t.value("name", "") == "default" && t.contains("template") && t["template"].is_string()) {
          source = t["template"].get<std::string>();
        }
      }
      if (source.empty()) return Status::InvalidArgument(config_path + ": chat_template has no \"default\" template");
    } else {
      return Status::InvalidArgument(config_path + ": chat_template must be a string or a list of named templates");
    }
    out.source = config_path;
  } else {
    return Status::NotFound("the model in " + model_dir + " has no chat template (tokenizer_config.json)");
  }
  Result<ChatTemplate> parsed = ChatTemplate::Parse(source);
  if (!parsed.ok()) return Status::InvalidArgument(out.source + ": the chat template: " + parsed.status().message());
  out.chat = std::make_shared<const ChatTemplate>(std::move(*parsed));
  return out;
}

}  // namespace penumbra::openai
