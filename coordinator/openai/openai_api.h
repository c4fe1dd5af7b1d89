// The OpenAI-compatible HTTP API's translation (docs/openai.md): a
// /v1/completions or /v1/chat/completions body checked and turned into the
// public API's GenerateRequest, and the public API's answers (GenerateChunk,
// PenumbraError) turned into OpenAI's JSON: responses, stream chunks, usage
// and error objects. Pure functions over JSON and the generated types; the
// HTTP server that uses them is coordinator/server/openai_gateway.h.
//
// What is taken as OpenAI documents it: model, max_tokens (and
// max_completion_tokens), temperature (default 1), top_p, seed, stop (a
// string or up to 16 strings), stream, stream_options.include_usage, n (1),
// user (ignored); logprobs, echo, best_of > 1, suffix, penalties, logit_bias,
// tools and response_format other than text are refused by name (INVALID
// ARGUMENT: HTTP 422). Penumbra's own fields: documents (ids of documents
// put, whose cached state the prompt follows), top_k, ignore_eos,
// stop_token_ids, kv_policy, return_token_ids. A request without documents asks for
// automatic reuse (GenerateRequest.reuse_documents): a prompt that starts
// with documents the tenant has put is served from their cached state.
// Fields neither knows are ignored, as OpenAI's
// own server does with fields of newer clients.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "coordinator/openai/chat_template.h"
#include "gen-cpp/penumbra_types.h"

namespace penumbra::openai {

// An error as OpenAI's clients read it: the HTTP status and
// {"error": {"message", "type", "param", "code"}}.
struct ApiError {
  int http_status = 500;
  std::string message;
  std::string type = "server_error";  // invalid_request_error, authentication_error, rate_limit_error, ...
  std::string code;                   // "" -> null
  int64_t retry_after_ms = -1;        // >= 0: a Retry-After header (429, 503)
  nlohmann::json Body() const;
};
// Our status -> OpenAI's: InvalidArgument 422, NotFound 404, PermissionDenied
// 401, ResourceExhausted 429 (Retry-After: the status's retry_after_ms, else
// 1 s), FailedPrecondition 409, Unavailable 503, DeadlineExceeded 504,
// Cancelled 499, the rest 500.
ApiError ErrorOf(const Status& s);
// The public API's error, through transport::FromRpcError.
ApiError ErrorOf(const rpc::PenumbraError& e);
// A body that is not JSON (400), or JSON nested deeper than kMaxJsonDepth.
ApiError MalformedBody(const std::string& why);

// How deep a request body's JSON may nest (parsing recurses). Default: 64.
inline constexpr int kMaxJsonDepth = 64;
// Parses a request body: an object, nested at most kMaxJsonDepth (checked
// before parsing). InvalidArgument says what is wrong and where.
Result<nlohmann::json> ParseBody(std::string_view body);

// What the served model allows a request (the gateway's, from the
// coordinator's limits).
struct ServedModel {
  std::string id;                      // the model's name: requests must name it
  int32_t max_new_tokens = 1 << 20;    // the coordinator's max_new_tokens limit
  const ChatTemplate* chat = nullptr;  // null: /v1/chat/completions refused (the model has no chat template)
  std::string bos_token, eos_token;    // the template's variables
};

enum class Endpoint { kCompletions, kChat };

// A request checked: what to ask the public API (api_key unset) and how to
// answer.
struct Parsed {
  Endpoint endpoint = Endpoint::kCompletions;
  rpc::GenerateRequest generate;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // Ours (vLLM's name): the answer's token ids in each choice ("token_ids"),
  // and in a stream each chunk's new ones (a chunk is sent when tokens come,
  // even before they make text).
  bool return_token_ids = false;
};

// The body of POST /v1/completions (prompt: a string, a list of token ids,
// or a list of one of either). `random_seed` seeds a sampled request that
// names no seed (each call then draws differently, as OpenAI's do).
// InvalidArgument names the field; NotFound for another model.
Result<Parsed> ParseCompletions(const nlohmann::json& body, const ServedModel& model, int64_t random_seed);
// The body of POST /v1/chat/completions: messages (roles system, developer
// (as system), user, assistant, tool; content a string or text parts)
// rendered by the model's chat template with add_generation_prompt, at
// `now` (strftime_now). With documents, the conversation follows them
// without a second BOS.
Result<Parsed> ParseChat(const nlohmann::json& body, const ServedModel& model, int64_t random_seed,
                         std::chrono::system_clock::time_point now);

// OpenAI's usage object, with prompt_tokens_details.cached_tokens.
nlohmann::json UsageJson(const rpc::Usage& u);
// OpenAI's finish_reason for ours (stop, length; anything else null).
nlohmann::json FinishReason(const std::string& ours);

// "cmpl-" or "chatcmpl-" + the request id.
std::string ResponseId(Endpoint e, const std::string& request_id);
// A whole answer (stream false).
nlohmann::json Response(Endpoint e, const std::string& model, int64_t created, const rpc::GenerateChunk& done,
                        bool return_token_ids = false);
// One stream chunk of `text` (the chat's first carries the role), or the
// last (`finish_reason` set), or the usage chunk (choices empty).
nlohmann::json StreamChunk(Endpoint e, const std::string& id, const std::string& model, int64_t created,
                           const std::string& text, bool first, const nlohmann::json& finish_reason, bool include_usage,
                           const std::vector<int32_t>* token_ids = nullptr);
nlohmann::json UsageChunk(Endpoint e, const std::string& id, const std::string& model, int64_t created,
                          const rpc::Usage& u);
// Penumbra's documents (our extension, /v1/documents): POST's body
// {name, text | token_ids, wait (default true)} as a PutDocumentRequest
// (api_key unset), and a document as JSON ({"object": "document", id, name,
// tokens, state: factoring | ready | failed, created_at, ...}).
Result<rpc::PutDocumentRequest> ParsePutDocument(const nlohmann::json& body);
nlohmann::json DocumentJson(const rpc::DocumentInfo& d);

// GET /v1/models.
nlohmann::json ModelList(const std::string& model, int64_t created);
nlohmann::json ModelObject(const std::string& model, int64_t created);

// The model's chat template: tokenizer_config.json's chat_template (a
// string, or a list of {name, template} of which "default" is taken) with
// its bos_token and eos_token, or `template_file` when given (a model
// without one). NotFound when neither has one; InvalidArgument for a
// template that does not parse (naming the file).
struct LoadedChat {
  std::shared_ptr<const ChatTemplate> chat;
  std::string bos_token, eos_token;
  std::string source;  // where it came from, for logs
};
Result<LoadedChat> LoadChatTemplate(const std::string& model_dir, const std::string& template_file);

}  // namespace penumbra::openai
