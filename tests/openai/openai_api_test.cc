// The OpenAI API's translation (coordinator/openai/openai_api.h): bodies to
// GenerateRequests with OpenAI's defaults, every refusal naming its field,
// answers and errors in OpenAI's shapes.
#include "coordinator/openai/openai_api.h"

#include <gtest/gtest.h>

namespace penumbra::openai {
namespace {

using nlohmann::json;

constexpr const char* kTemplate =
    "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}";

class OpenAiApi : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<ChatTemplate> t = ChatTemplate::Parse(kTemplate);
    ASSERT_TRUE(t.ok()) << t.status();
    chat_ = std::make_unique<ChatTemplate>(std::move(*t));
    model_.id = "m";
    model_.max_new_tokens = 1000;
    model_.chat = chat_.get();
    model_.bos_token = "<s>";
    model_.eos_token = "</s>";
  }
  Result<Parsed> Completions(json body) { return ParseCompletions(body, model_, 1234); }
  Result<Parsed> Chat(json body) { return ParseChat(body, model_, 1234, std::chrono::system_clock::now()); }
  // The refusal's message, which must name `field`.
  void ExpectRefused(const Result<Parsed>& r, const std::string& field,
                     StatusCode code = StatusCode::kInvalidArgument) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status();
  }
  std::unique_ptr<ChatTemplate> chat_;
  ServedModel model_;
};

TEST_F(OpenAiApi, BodiesMustBeJsonObjectsOfBoundedDepth) {
  EXPECT_TRUE(ParseBody(R"({"a": [1, {"b": "[[[["}]})").ok());
  EXPECT_FALSE(ParseBody("{\"a\": ").ok());
  EXPECT_FALSE(ParseBody("[1, 2]").ok());
  EXPECT_FALSE(ParseBody("").ok());
  const Result<json> deep = ParseBody(std::string(100000, '['));
  ASSERT_FALSE(deep.ok());
  EXPECT_NE(deep.status().message().find("nested deeper than 64"), std::string::npos) << deep.status();
  std::string ok_depth;
  for (int i = 0; i < 63; ++i) ok_depth += "{\"a\":";
  ok_depth += "1" + std::string(63, '}');
  EXPECT_TRUE(ParseBody(ok_depth).ok());
  const ApiError e = MalformedBody("x");
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.Body()["error"]["type"], "invalid_request_error");
}

TEST_F(OpenAiApi, CompletionsTakeOpenAisDefaults) {
  Result<Parsed> p = Completions({{"model", "m"}, {"prompt", "hello"}});
  ASSERT_TRUE(p.ok()) << p.status();
  const rpc::GenerateRequest& g = p->generate;
  EXPECT_EQ(g.text, "hello");
  EXPECT_TRUE(g.add_special_tokens);
  EXPECT_EQ(g.max_new_tokens, 16);
  EXPECT_FALSE(g.fit_context);
  EXPECT_EQ(g.sampling.temperature, 1.0);
  EXPECT_EQ(g.sampling.top_p, 1.0);
  EXPECT_EQ(g.sampling.seed, 1234);  // sampled, no seed: the caller's random one
  EXPECT_FALSE(p->stream);
  EXPECT_TRUE(g.reuse_documents);  // prompt caching is automatic

  p = Completions({{"model", "m"},
                   {"prompt", json::array({json::array({1, 2, 3})})},
                   {"max_tokens", 7},
                   {"temperature", 0},
                   {"top_p", 0.5},
                   {"top_k", 4},
                   {"seed", -3},
                   {"stop", "\n"},
                   {"stream", true},
                   {"stream_options", {{"include_usage", true}}},
                   {"documents", {"doc-1"}},
                   {"ignore_eos", true},
                   {"stop_token_ids", {9}},
                   {"kv_policy", "full"},
                   {"user", "u"},
                   {"some_future_field", 1}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->generate.token_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_FALSE(p->generate.__isset.text);
  EXPECT_EQ(p->generate.max_new_tokens, 7);
  EXPECT_EQ(p->generate.sampling.temperature, 0.0);
  EXPECT_EQ(p->generate.sampling.top_k, 4);
  EXPECT_EQ(p->generate.sampling.seed, 2);  // -3 folded to a seed >= 0
  EXPECT_EQ(p->generate.stop, (std::vector<std::string>{"\n"}));
  EXPECT_EQ(p->generate.document_ids, (std::vector<std::string>{"doc-1"}));
  EXPECT_FALSE(p->generate.reuse_documents);  // named: nothing to find
  EXPECT_TRUE(p->generate.ignore_eos);
  EXPECT_EQ(p->generate.stop_ids, (std::vector<int32_t>{9}));
  EXPECT_EQ(p->generate.kv_policy, "full");
  EXPECT_TRUE(p->stream);
  EXPECT_TRUE(p->include_usage);
  // Greedy without a seed: seed 0 (the draws do not matter).
  p = Completions({{"model", "m"}, {"prompt", "x"}, {"temperature", 0}});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->generate.sampling.seed, 0);
  // A whole number sent as a float (JavaScript) is an integer.
  p = Completions({{"model", "m"}, {"prompt", "x"}, {"max_tokens", 5.0}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->generate.max_new_tokens, 5);
}

TEST_F(OpenAiApi, CompletionsRefuseNamingTheField) {
  ExpectRefused(Completions({{"prompt", "x"}}), "'model' is required");
  ExpectRefused(Completions({{"model", "gpt-4o"}, {"prompt", "x"}}), "serves 'm'", StatusCode::kNotFound);
  ExpectRefused(Completions({{"model", "m"}}), "'prompt' is required");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", 5}}), "'prompt'");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", ""}}), "'prompt' is empty");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", {"a", "b"}}}), "2 prompts");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", {1, -2}}}), "'prompt[1]'");
  ExpectRefused(Completions({{"model", 3}, {"prompt", "x"}}), "'model' must be a string");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", "x"}, {"max_tokens", 0}}), "'max_tokens'");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", "x"}, {"max_tokens", 1001}}), "'max_tokens'");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", "x"}, {"max_tokens", 1.5}}), "'max_tokens'");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", "x"}, {"temperature", 2.5}}), "'temperature'");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", "x"}, {"temperature", "hot"}}), "'temperature'");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", "x"}, {"top_p", 0}}), "'top_p'");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", "x"}, {"n", 3}}), "'n' must be 1");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", "x"}, {"stop", {"a", 1}}}), "'stop[1]'");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", "x"}, {"stream_options", {{"include_usage", true}}}}),
                "'stream_options'");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", "x"}, {"logprobs", 1}}), "'logprobs'");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", "x"}, {"echo", true}}), "'echo'");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", "x"}, {"best_of", 2}}), "'best_of'");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", "x"}, {"suffix", "end"}}), "'suffix'");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", "x"}, {"presence_penalty", 0.5}}), "'presence_penalty'");
  ExpectRefused(Completions({{"model", "m"}, {"prompt", "x"}, {"logit_bias", {{"5", 1}}}}), "'logit_bias'");
  // Their defaults are fine.
  EXPECT_TRUE(Completions({{"model", "m"},
                           {"prompt", "x"},
                           {"logprobs", nullptr},
                           {"echo", false},
                           {"best_of", 1},
                           {"presence_penalty", 0},
                           {"logit_bias", json::object()}})
                  .ok());
}

TEST_F(OpenAiApi, ChatRendersTheTemplate) {
  Result<Parsed> p = Chat(
      {{"model", "m"},
       {"messages",
        {{{"role", "developer"}, {"content", "be brief"}},
         {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "a"}}, {{"type", "text"}, {"text", "b"}}}}}}}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->endpoint, Endpoint::kChat);
  EXPECT_EQ(p->generate.text, "<s>system: be brief\nuser: a\nb\nassistant:");
  EXPECT_FALSE(p->generate.add_special_tokens);  // the template wrote the BOS
  // No max_tokens: what the context leaves.
  EXPECT_TRUE(p->generate.fit_context);
  EXPECT_EQ(p->generate.max_new_tokens, 1000);
  // After documents, no second BOS; max_completion_tokens is max_tokens.
  p = Chat({{"model", "m"},
            {"documents", {"d"}},
            {"max_completion_tokens", 9},
            {"messages", {{{"role", "user"}, {"content", "q"}}}}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->generate.text, "user: q\nassistant:");
  EXPECT_EQ(p->generate.max_new_tokens, 9);
  EXPECT_FALSE(p->generate.fit_context);
}

TEST_F(OpenAiApi, ChatRefusesNamingTheField) {
  const json user = {{{"role", "user"}, {"content", "q"}}};
  ExpectRefused(Chat({{"model", "m"}}), "'messages' is required");
  ExpectRefused(Chat({{"model", "m"}, {"messages", json::array()}}), "'messages'");
  ExpectRefused(Chat({{"model", "m"}, {"messages", {{{"role", "robot"}, {"content", "q"}}}}}), "'messages[0].role'");
  ExpectRefused(Chat({{"model", "m"}, {"messages", {{{"role", "user"}}}}}), "'messages[0].content' is required");
  ExpectRefused(Chat({{"model", "m"}, {"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}}}}}}}}),
                "'messages[0].content[0].type' 'image_url'");
  ExpectRefused(Chat({{"model", "m"}, {"messages", user}, {"tools", {{{"type", "function"}}}}}), "'tools'");
  ExpectRefused(Chat({{"model", "m"}, {"messages", user}, {"logprobs", true}}), "'logprobs'");
  ExpectRefused(Chat({{"model", "m"}, {"messages", user}, {"response_format", {{"type", "json_object"}}}}),
                "'response_format'");
  ExpectRefused(Chat({{"model", "m"}, {"messages", user}, {"max_tokens", 3}, {"max_completion_tokens", 4}}), "differ");
  // A template that raises: its message.
  Result<ChatTemplate> raising = ChatTemplate::Parse("{{ raise_exception('roles must alternate') }}");
  ASSERT_TRUE(raising.ok()) << raising.status();
  model_.chat = &*raising;
  ExpectRefused(Chat({{"model", "m"}, {"messages", user}}), "roles must alternate");
  // No template: chat is refused, saying how to give one.
  model_.chat = nullptr;
  ExpectRefused(Chat({{"model", "m"}, {"messages", user}}), "--chat-template", StatusCode::kFailedPrecondition);
}

TEST_F(OpenAiApi, ErrorsMapToOpenAisStatuses) {
  EXPECT_EQ(ErrorOf(Status::InvalidArgument("x")).http_status, 422);
  EXPECT_EQ(ErrorOf(Status::NotFound("x")).http_status, 404);
  EXPECT_EQ(ErrorOf(Status::PermissionDenied("x")).http_status, 401);
  EXPECT_EQ(ErrorOf(Status::FailedPrecondition("x")).http_status, 409);
  EXPECT_EQ(ErrorOf(Status::Unavailable("x")).http_status, 503);
  EXPECT_EQ(ErrorOf(Status::DeadlineExceeded("x")).http_status, 504);
  EXPECT_EQ(ErrorOf(Status::Internal("x")).http_status, 500);
  rpc::PenumbraError quota;
  quota.code = rpc::ErrorCode::RESOURCE_EXHAUSTED;
  quota.message = "tenant t: generated_tokens_per_minute";
  quota.__set_retry_after_ms(2500);
  const ApiError e = ErrorOf(quota);
  EXPECT_EQ(e.http_status, 429);
  EXPECT_EQ(e.retry_after_ms, 2500);
  const json body = e.Body();
  EXPECT_EQ(body["error"]["message"], quota.message);
  EXPECT_EQ(body["error"]["type"], "rate_limit_error");
  EXPECT_EQ(body["error"]["code"], "rate_limit_exceeded");
  EXPECT_TRUE(body["error"]["param"].is_null());
}

TEST_F(OpenAiApi, AnswersAndChunksAreOpenAis) {
  rpc::GenerateChunk done;
  done.request_id = "r1";
  done.text = "A red ball.";
  done.finish_reason = "stop";
  done.usage.prompt_tokens = 100;
  done.usage.cached_prompt_tokens = 80;
  done.usage.generated_tokens = 5;
  json r = Response(Endpoint::kChat, "m", 42, done);
  EXPECT_EQ(r["id"], "chatcmpl-r1");
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["created"], 42);
  EXPECT_EQ(r["choices"][0]["message"]["content"], "A red ball.");
  EXPECT_EQ(r["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r["usage"]["total_tokens"], 105);
  EXPECT_EQ(r["usage"]["prompt_tokens_details"]["cached_tokens"], 80);
  r = Response(Endpoint::kCompletions, "m", 42, done);
  EXPECT_EQ(r["id"], "cmpl-r1");
  EXPECT_EQ(r["choices"][0]["text"], "A red ball.");
  EXPECT_FALSE(r["choices"][0].contains("token_ids"));
  done.ids = {5, 6, 7};
  EXPECT_EQ(Response(Endpoint::kCompletions, "m", 42, done, /*return_token_ids=*/true)["choices"][0]["token_ids"],
            json({5, 6, 7}));
  const std::vector<int32_t> fresh = {8};
  EXPECT_EQ(StreamChunk(Endpoint::kCompletions, "cmpl-r1", "m", 42, "", false, nullptr, false,
                        &fresh)["choices"][0]["token_ids"],
            json({8}));
  EXPECT_TRUE(Completions({{"model", "m"}, {"prompt", "x"}, {"return_token_ids", true}})->return_token_ids);
  EXPECT_FALSE(Completions({{"model", "m"}, {"prompt", "x"}})->return_token_ids);
  EXPECT_FALSE(Completions({{"model", "m"}, {"prompt", "x"}, {"return_token_ids", 1}}).ok());

  json c = StreamChunk(Endpoint::kChat, "chatcmpl-r1", "m", 42, "", /*first=*/true, nullptr, true);
  EXPECT_EQ(c["choices"][0]["delta"], (json{{"role", "assistant"}, {"content", ""}}));
  EXPECT_TRUE(c["usage"].is_null());
  EXPECT_TRUE(c.contains("usage"));
  c = StreamChunk(Endpoint::kChat, "chatcmpl-r1", "m", 42, "", false, "length", false);
  EXPECT_EQ(c["choices"][0]["delta"], json::object());
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
  EXPECT_FALSE(c.contains("usage"));
  c = UsageChunk(Endpoint::kCompletions, "cmpl-r1", "m", 42, done.usage);
  EXPECT_EQ(c["choices"], json::array());
  EXPECT_EQ(c["usage"]["completion_tokens"], 5);
  EXPECT_EQ(FinishReason("deadline"), nullptr);
  EXPECT_EQ(ModelList("m", 1)["data"][0]["id"], "m");
}

TEST_F(OpenAiApi, DocumentsArePutAndShown) {
  Result<rpc::PutDocumentRequest> put = ParsePutDocument({{"name", "n"}, {"text", "t"}});
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->text, "t");
  EXPECT_TRUE(put->wait);
  EXPECT_FALSE(ParsePutDocument({{"name", "n"}}).ok());
  EXPECT_FALSE(ParsePutDocument({{"name", "n"}, {"text", "t"}, {"token_ids", {1}}}).ok());
  EXPECT_FALSE(ParsePutDocument({{"text", "t"}}).ok());
  put = ParsePutDocument({{"name", "n"}, {"token_ids", {1, 2}}, {"wait", false}});
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_FALSE(put->wait);
  rpc::DocumentInfo d;
  d.id = "doc-1";
  d.state = rpc::DocumentState::FACTORING;
  d.factor_seconds = -1;
  json j = DocumentJson(d);
  EXPECT_EQ(j["state"], "factoring");
  EXPECT_TRUE(j["factor_seconds"].is_null());
}

}  // namespace
}  // namespace penumbra::openai
