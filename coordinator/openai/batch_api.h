// The OpenAI Batch API's translation (docs/openai.md, "Batches"): a batch
// is one of the coordinator's durable batch jobs (coordinator/jobs/), made
// from an uploaded JSONL file, and its output and error files are rendered
// from the job's results when read. Pure functions over JSON and the
// generated types; the routes are coordinator/server/openai_batches.cc.
//
// Ids: the batch of job "job-X" is "batch_X"; its output and error files
// are "file-batch_X-output" and "file-batch_X-errors". A job made through
// the Thrift API (SubmitJob) is not a batch: its metadata is the caller's,
// and /v1/batches neither lists nor shows it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "coordinator/openai/openai_api.h"
#include "gen-cpp/penumbra_types.h"

namespace penumbra::openai {

// The URL a batch's lines go to: "/v1/chat/completions" or "/v1/completions".
const char* EndpointUrl(Endpoint e);

// POST /v1/batches.
struct BatchRequest {
  std::string input_file_id;
  Endpoint endpoint = Endpoint::kChat;
  std::string completion_window = "24h";  // as the caller gave it
  int64_t completion_window_s = 86400;
  nlohmann::json metadata;  // null, or an object of at most 16 string values
};
// input_file_id, endpoint (the two above; /v1/embeddings and the rest are
// refused by name), completion_window ("Nh", 1 to 168 hours; OpenAI takes
// only "24h"), metadata (at most 16 keys of at most 64 characters, string
// values of at most 512). InvalidArgument names the field.
Result<BatchRequest> ParseCreateBatch(const nlohmann::json& body);

// The input file: one request per line, {"custom_id", "method": "POST",
// "url": the batch's endpoint, "body": what that endpoint takes, without
// "stream"}; blank lines are skipped. A line without a seed whose sampling is
// random gets one drawn here (random_seed()), kept with the job, so a line
// run again after a restart answers the same. InvalidArgument names the
// line and its custom_id; NotFound (another model) and FailedPrecondition
// (chat without a template) name the line too. At most max_items lines.
Result<std::vector<rpc::JobItem>> ParseBatchInput(std::string_view jsonl, Endpoint e, const ServedModel& model,
                                                  const std::function<int64_t()>& random_seed,
                                                  std::chrono::system_clock::time_point now, size_t max_items);

// What a batch's job keeps as its metadata, and that read back (nullopt:
// the job was not made by /v1/batches).
std::string BatchJobMetadata(const BatchRequest& b);
std::optional<BatchRequest> BatchOfJob(const std::string& job_metadata);

std::string BatchId(const std::string& job_id);
// The job of a batch id; nullopt when `batch_id` is not one.
std::optional<std::string> JobIdOfBatch(const std::string& batch_id);
struct ResultFile {
  std::string job_id;
  bool errors = false;  // the error file (else the output file)
};
std::string ResultFileId(const std::string& job_id, bool errors);
std::optional<ResultFile> ResultFileOf(const std::string& file_id);

// The batch object: status, timestamps, request_counts (failed counts
// cancelled and expired lines too), and output_file_id / error_file_id
// once the batch is final and has lines of that kind.
nlohmann::json BatchJson(const rpc::JobInfo& job, const BatchRequest& b);
// Whether a result goes to the error file (it did not succeed).
inline bool IsErrorLine(const rpc::JobItemResult& r) { return !r.ok; }
// One line of the output file ({"id", "custom_id", "response": {"status_code":
// 200, "request_id", "body": the endpoint's answer}, "error": null}) or of
// the error file (a failed request: its status and error body; a cancelled
// or expired one: "error": {"code": "batch_cancelled" | "batch_expired"}).
nlohmann::json BatchResultLine(const rpc::JobItemResult& r, const std::string& job_id, Endpoint e,
                               const std::string& model, int64_t created);
// A file object of /v1/files.
nlohmann::json FileJson(const std::string& id, const std::string& filename, const std::string& purpose, int64_t bytes,
                        int64_t created_at);

}  // namespace penumbra::openai
