// The Batch API's translation (coordinator/openai/batch_api.h): POST
// /v1/batches bodies, input files turned into job items (every refusal
// naming its line and custom_id), ids that map back, the batch object in
// each job state, and output and error lines in OpenAI's shapes.
#include "coordinator/openai/batch_api.h"

#include <gtest/gtest.h>

namespace penumbra::openai {
namespace {

using nlohmann::json;

class BatchApi : public ::testing::Test {
 protected:
  void SetUp() override {
    model_.id = "m";
    model_.max_new_tokens = 100;
  }
  Result<std::vector<rpc::JobItem>> Input(const std::string& jsonl, Endpoint e = Endpoint::kCompletions,
                                          size_t max_items = 10) {
    return ParseBatchInput(
        jsonl, e, model_, [this] { return ++seeds_; }, std::chrono::system_clock::now(), max_items);
  }
  static std::string Line(const std::string& id, json body, const std::string& url = "/v1/completions") {
    return json{{"custom_id", id}, {"method", "POST"}, {"url", url}, {"body", std::move(body)}}.dump() + "\n";
  }
  void ExpectRefused(const Result<std::vector<rpc::JobItem>>& r, const std::string& words,
                     StatusCode code = StatusCode::kInvalidArgument) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_NE(r.status().message().find(words), std::string::npos) << r.status();
  }
  ServedModel model_;
  int64_t seeds_ = 100;
};

TEST_F(BatchApi, CreateBodiesAreCheckedByField) {
  Result<BatchRequest> b = ParseCreateBatch({{"input_file_id", "file-1"},
                                             {"endpoint", "/v1/chat/completions"},
                                             {"completion_window", "24h"},
                                             {"metadata", {{"k", "v"}}}});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->endpoint, Endpoint::kChat);
  EXPECT_EQ(b->completion_window_s, 86400);
  EXPECT_TRUE(
      ParseCreateBatch({{"input_file_id", "f"}, {"endpoint", "/v1/completions"}, {"completion_window", "2h"}}).ok());
  auto refused = [](json body, const std::string& field) {
    Result<BatchRequest> r = ParseCreateBatch(body);
    ASSERT_FALSE(r.ok()) << body.dump();
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status();
  };
  const json ok = {{"input_file_id", "f"}, {"endpoint", "/v1/completions"}, {"completion_window", "24h"}};
  refused(json{{"endpoint", "/v1/completions"}, {"completion_window", "24h"}}, "input_file_id");
  refused(json{{"input_file_id", "f"}, {"endpoint", "/v1/embeddings"}, {"completion_window", "24h"}}, "/v1/embeddings");
  for (const char* w : {"0h", "169h", "24", "h", "1d", "99999h", "-1h"}) {
    json body = ok;
    body["completion_window"] = w;
    refused(body, "completion_window");
  }
  json meta = ok;
  meta["metadata"] = {{"k", 1}};
  refused(meta, "metadata.k");
  meta["metadata"] = json::object();
  for (int i = 0; i < 17; ++i) meta["metadata"]["k" + std::to_string(i)] = "v";
  refused(meta, "17 keys");
  meta["metadata"] = {{"k", std::string(513, 'x')}};
  refused(meta, "512");
}

TEST_F(BatchApi, InputFilesBecomeItemsWithSeedsDrawnOnce) {
  const std::string file = Line("a", {{"model", "m"}, {"prompt", "hi"}, {"max_tokens", 5}, {"temperature", 0.7}}) +
                           "\n  \r\n" + Line("b", {{"model", "m"}, {"prompt", {1, 2, 3}}, {"seed", 9}});
  Result<std::vector<rpc::JobItem>> items = Input(file);
  ASSERT_TRUE(items.ok()) << items.status();
  ASSERT_EQ(items->size(), 2u);
  EXPECT_EQ((*items)[0].custom_id, "a");
  EXPECT_EQ((*items)[0].request.text, "hi");
  EXPECT_EQ((*items)[0].request.max_new_tokens, 5);
  EXPECT_EQ((*items)[0].request.sampling.seed, 101);  // drawn for the line, kept with the job
  EXPECT_EQ((*items)[1].request.token_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ((*items)[1].request.sampling.seed, 9);
  // The last line may lack its newline; CRLF files are read too.
  EXPECT_TRUE(
      Input(Line("a", {{"model", "m"}, {"prompt", "x"}}) + "\r\n" +
            json{{"custom_id", "z"}, {"url", "/v1/completions"}, {"body", {{"model", "m"}, {"prompt", "y"}}}}.dump())
          .ok());
}

TEST_F(BatchApi, BadLinesAreRefusedNamingTheLineAndCustomId) {
  const std::string good = Line("a", {{"model", "m"}, {"prompt", "x"}});
  ExpectRefused(Input(""), "no requests");
  ExpectRefused(Input("\n\n"), "no requests");
  ExpectRefused(Input(good + "{not json\n"), "line 2: not a JSON object");
  ExpectRefused(Input(good + "[1]\n"), "line 2");
  ExpectRefused(Input(good + good), "line 2 (custom_id 'a'): 'custom_id' is not unique");
  ExpectRefused(Input(good + Line("", {{"model", "m"}, {"prompt", "x"}})), "line 2: 'custom_id' is required");
  ExpectRefused(Input(good + Line("b", {{"model", "m"}, {"prompt", "x"}}, "/v1/chat/completions")),
                "line 2 (custom_id 'b'): 'url' is '/v1/chat/completions' but the batch's endpoint is /v1/completions");
  ExpectRefused(
      Input(json{{"custom_id", "g"}, {"method", "GET"}, {"url", "/v1/completions"}, {"body", json::object()}}.dump()),
      "'method' must be POST");
  ExpectRefused(Input(json{{"custom_id", "n"}, {"url", "/v1/completions"}}.dump()), "line 1 (custom_id 'n'): 'body'");
  ExpectRefused(Input(Line("s", {{"model", "m"}, {"prompt", "x"}, {"stream", true}})), "'body.stream'");
  ExpectRefused(Input(Line("t", {{"model", "m"}, {"prompt", "x"}, {"max_tokens", "five"}})),
                "line 1 (custom_id 't'): 'max_tokens' must be an integer");
  ExpectRefused(Input(Line("o", {{"model", "other"}, {"prompt", "x"}})), "line 1 (custom_id 'o'): the model 'other'",
                StatusCode::kNotFound);
  ExpectRefused(
      Input(Line("c", {{"model", "m"}, {"messages", {{{"role", "user"}, {"content", "q"}}}}}, "/v1/chat/completions"),
            Endpoint::kChat),
      "line 1 (custom_id 'c'): the model 'm' has no chat template", StatusCode::kFailedPrecondition);
  std::string many;
  for (int i = 0; i < 4; ++i) many += Line("i" + std::to_string(i), {{"model", "m"}, {"prompt", "x"}});
  ExpectRefused(Input(many, Endpoint::kCompletions, 3), "line 4: the file holds more than 3 requests");
}

TEST_F(BatchApi, IdsMapToJobsAndBack) {
  EXPECT_EQ(BatchId("job-0123456789abcdef"), "batch_0123456789abcdef");
  EXPECT_EQ(JobIdOfBatch("batch_0123456789abcdef"), "job-0123456789abcdef");
  EXPECT_FALSE(JobIdOfBatch("job-0123456789abcdef"));
  EXPECT_FALSE(JobIdOfBatch("batch_"));
  EXPECT_EQ(ResultFileId("job-0123456789abcdef", false), "file-batch_0123456789abcdef-output");
  std::optional<ResultFile> f = ResultFileOf("file-batch_0123456789abcdef-errors");
  ASSERT_TRUE(f);
  EXPECT_EQ(f->job_id, "job-0123456789abcdef");
  EXPECT_TRUE(f->errors);
  EXPECT_FALSE(ResultFileOf("file-0123456789abcdef"));
  EXPECT_FALSE(ResultFileOf("file-batch_-output"));
  BatchRequest b;
  b.input_file_id = "file-9";
  b.endpoint = Endpoint::kChat;
  b.completion_window = "2h";
  b.metadata = {{"k", "v"}};
  std::optional<BatchRequest> back = BatchOfJob(BatchJobMetadata(b));
  ASSERT_TRUE(back);
  EXPECT_EQ(back->input_file_id, "file-9");
  EXPECT_EQ(back->endpoint, Endpoint::kChat);
  EXPECT_EQ(back->completion_window, "2h");
  EXPECT_EQ(back->metadata, b.metadata);
  EXPECT_FALSE(BatchOfJob("a Thrift job's own metadata"));
  EXPECT_FALSE(BatchOfJob(R"({"openai_batch": 3})"));
}

TEST_F(BatchApi, TheBatchObjectFollowsItsJob) {
  BatchRequest b;
  b.input_file_id = "file-1";
  rpc::JobInfo j;
  j.id = "job-0123456789abcdef";
  j.status = rpc::JobStatus::IN_PROGRESS;
  j.created_unix_s = 100;
  j.expires_unix_s = 200;
  j.total = 5;
  j.completed = 2;
  json o = BatchJson(j, b);
  EXPECT_EQ(o["id"], "batch_0123456789abcdef");
  EXPECT_EQ(o["status"], "in_progress");
  EXPECT_TRUE(o["output_file_id"].is_null());  // not before the batch ends
  EXPECT_TRUE(o["completed_at"].is_null());
  EXPECT_EQ(o["request_counts"], json({{"total", 5}, {"completed", 2}, {"failed", 0}}));
  j.status = rpc::JobStatus::COMPLETED;
  j.finished_unix_s = 150;
  j.completed = 3;
  j.failed = 2;
  o = BatchJson(j, b);
  EXPECT_EQ(o["output_file_id"], "file-batch_0123456789abcdef-output");
  EXPECT_EQ(o["error_file_id"], "file-batch_0123456789abcdef-errors");
  EXPECT_EQ(o["completed_at"], 150);
  j.status = rpc::JobStatus::CANCELLED;
  j.completed = 0;
  j.failed = 0;
  j.cancelled = 5;
  o = BatchJson(j, b);
  EXPECT_EQ(o["status"], "cancelled");
  EXPECT_TRUE(o["output_file_id"].is_null());  // nothing succeeded
  EXPECT_EQ(o["cancelled_at"], 150);
  EXPECT_EQ(o["request_counts"]["failed"], 5);
  j.status = rpc::JobStatus::EXPIRED;
  EXPECT_EQ(BatchJson(j, b)["expired_at"], 150);
}

TEST_F(BatchApi, ResultLinesInOpenAisShapes) {
  rpc::JobItemResult ok;
  ok.custom_id = "a";
  ok.ok = true;
  ok.state = "succeeded";
  ok.text = "hello";
  ok.finish_reason = "length";
  ok.usage.prompt_tokens = 7;
  ok.usage.generated_tokens = 2;
  json line = BatchResultLine(ok, "job-1", Endpoint::kChat, "m", 123);
  EXPECT_FALSE(IsErrorLine(ok));
  EXPECT_EQ(line["custom_id"], "a");
  EXPECT_TRUE(line["error"].is_null());
  EXPECT_EQ(line["response"]["status_code"], 200);
  EXPECT_EQ(line["response"]["body"]["object"], "chat.completion");
  EXPECT_EQ(line["response"]["body"]["choices"][0]["message"]["content"], "hello");
  EXPECT_EQ(line["response"]["body"]["usage"]["total_tokens"], 9);
  EXPECT_EQ(line["id"], BatchResultLine(ok, "job-1", Endpoint::kChat, "m", 123)["id"]);  // stable
  EXPECT_NE(line["id"], BatchResultLine(ok, "job-2", Endpoint::kChat, "m", 123)["id"]);

  rpc::JobItemResult failed;
  failed.custom_id = "b";
  failed.state = "failed";
  failed.error = "document doc-1 not found";
  failed.__set_error_code(rpc::ErrorCode::NOT_FOUND);
  line = BatchResultLine(failed, "job-1", Endpoint::kCompletions, "m", 123);
  EXPECT_TRUE(IsErrorLine(failed));
  EXPECT_EQ(line["response"]["status_code"], 404);
  EXPECT_EQ(line["response"]["body"]["error"]["message"], "document doc-1 not found");

  rpc::JobItemResult cancelled;
  cancelled.custom_id = "c";
  cancelled.state = "cancelled";
  cancelled.error = "cancelled";
  line = BatchResultLine(cancelled, "job-1", Endpoint::kCompletions, "m", 123);
  EXPECT_TRUE(line["response"].is_null());
  EXPECT_EQ(line["error"]["code"], "batch_cancelled");

  rpc::JobItemResult expired;
  expired.custom_id = "d";
  expired.state = "failed";
  expired.error = "expired";
  EXPECT_EQ(BatchResultLine(expired, "job-1", Endpoint::kCompletions, "m", 123)["error"]["code"], "batch_expired");
}

}  // namespace
}  // namespace penumbra::openai
