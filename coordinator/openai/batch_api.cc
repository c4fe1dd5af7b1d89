#include "coordinator/openai/batch_api.h"

#include <cstdio>
#include <set>

#include "common/hash.h"
#include "coordinator/openai/json_fields.h"
#include "transport/thrift_util.h"

namespace penumbra::openai {
namespace {

using nlohmann::json;
using namespace json_fields;  // NOLINT(google-build-using-namespace): the shared field readers

constexpr std::string_view kJobPrefix = "job-";
constexpr std::string_view kBatchPrefix = "batch_";
constexpr std::string_view kResultFilePrefix = "file-batch_";
constexpr std::string_view kOutputSuffix = "-output";
constexpr std::string_view kErrorsSuffix = "-errors";
constexpr const char* kMetadataKey = "openai_batch";
constexpr size_t kMaxMetadataKeys = 16;
constexpr size_t kMaxMetadataKeyChars = 64;
constexpr size_t kMaxMetadataValueChars = 512;
constexpr int64_t kMaxWindowHours = 168;

Result<Endpoint> EndpointOf(const std::string& url) {
  if (url == "/v1/chat/completions") return Endpoint::kChat;
  if (url == "/v1/completions") return Endpoint::kCompletions;
  return Bad("the endpoint '" + url.substr(0, 64) +
             "' is not served in batches: use /v1/chat/completions or /v1/completions");
}

// "Nh", 1 <= N <= kMaxWindowHours: seconds.
Result<int64_t> WindowSeconds(const std::string& w) {
  int64_t hours = 0;
  bool ok = w.size() >= 2 && w.size() <= 4 && w.back() == 'h';
  for (size_t i = 0; ok && i + 1 < w.size(); ++i) {
    ok = w[i] >= '0' && w[i] <= '9';
    hours = hours * 10 + (w[i] - '0');
  }
  if (!ok || hours < 1 || hours > kMaxWindowHours) {
    return Bad("'completion_window' must be a number of hours from 1h to " + std::to_string(kMaxWindowHours) +
               "h (OpenAI's is 24h), got '" + w.substr(0, 16) + "'");
  }
  return hours * 3600;
}

Status CheckMetadata(const json& m) {
  if (m.is_null()) return Status::OK();
  if (!m.is_object()) return Bad("'metadata' must be an object of strings, got " + TypeName(m));
  if (m.size() > kMaxMetadataKeys) {
    return Bad("'metadata' has " + std::to_string(m.size()) + " keys, at most " + std::to_string(kMaxMetadataKeys));
  }
  for (auto it = m.begin(); it != m.end(); ++it) {
    if (it.key().size() > kMaxMetadataKeyChars) {
      return Bad("'metadata' keys are at most " + std::to_string(kMaxMetadataKeyChars) + " characters");
    }
    if (!it.value().is_string()) {
      return Bad("'metadata." + it.key() + "' must be a string, got " + TypeName(it.value()));
    }
    if (it.value().get_ref<const std::string&>().size() > kMaxMetadataValueChars) {
      return Bad("'metadata." + it.key() + "' is longer than " + std::to_string(kMaxMetadataValueChars) +
                 " characters");
    }
  }
  return Status::OK();
}

std::string HexId(uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

const char* StatusName(rpc::JobStatus::type s) {
  switch (s) {
    case rpc::JobStatus::VALIDATING:
      return "validating";
    case rpc::JobStatus::IN_PROGRESS:
      return "in_progress";
    case rpc::JobStatus::FINALIZING:
      return "finalizing";
    case rpc::JobStatus::COMPLETED:
      return "completed";
    case rpc::JobStatus::FAILED:
      return "failed";
    case rpc::JobStatus::CANCELLING:
      return "cancelling";
    case rpc::JobStatus::CANCELLED:
      return "cancelled";
    case rpc::JobStatus::EXPIRED:
      return "expired";
  }
  return "failed";
}

bool IsFinal(rpc::JobStatus::type s) {
  return s == rpc::JobStatus::COMPLETED || s == rpc::JobStatus::FAILED || s == rpc::JobStatus::CANCELLED ||
         s == rpc::JobStatus::EXPIRED;
}

json TimeOrNull(bool set, int64_t t) { return set ? json(t) : json(nullptr); }

}  // namespace

const char* EndpointUrl(Endpoint e) { return e == Endpoint::kChat ? "/v1/chat/completions" : "/v1/completions"; }

Result<BatchRequest> ParseCreateBatch(const json& body) {
  BatchRequest b;
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<std::string> input, String(body, "input_file_id"));
  if (!input || input->empty()) return Bad("'input_file_id' is required (POST /v1/files, purpose 'batch')");
  b.input_file_id = *input;
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<std::string> endpoint, String(body, "endpoint"));
  if (!endpoint) return Bad("'endpoint' is required: /v1/chat/completions or /v1/completions");
  PENUMBRA_ASSIGN_OR_RETURN(b.endpoint, EndpointOf(*endpoint));
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<std::string> window, String(body, "completion_window"));
  if (!window) return Bad("'completion_window' is required (\"24h\")");
  b.completion_window = *window;
  PENUMBRA_ASSIGN_OR_RETURN(b.completion_window_s, WindowSeconds(*window));
  if (const json* m = Field(body, "metadata")) {
    PENUMBRA_RETURN_IF_ERROR(CheckMetadata(*m));
    b.metadata = *m;
  }
  return b;
}

Result<std::vector<rpc::JobItem>> ParseBatchInput(std::string_view jsonl, Endpoint e, const ServedModel& model,
                                                  const std::function<int64_t()>& random_seed,
                                                  std::chrono::system_clock::time_point now, size_t max_items) {
  std::vector<rpc::JobItem> items;
  std::set<std::string> seen;
  size_t line_no = 0;
  size_t pos = 0;
  while (pos < jsonl.size()) {
    size_t end = jsonl.find('\n', pos);
    if (end == std::string_view::npos) end = jsonl.size();
    std::string_view line = jsonl.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    const std::string at = "line " + std::to_string(line_no);
    auto fail = [&](const Status& s, const std::string& custom_id) {
      const std::string where = custom_id.empty() ? at : at + " (custom_id '" + custom_id.substr(0, 64) + "')";
      return Status(s.code(), "the input file's " + where + ": " + s.message());
    };
    if (items.size() == max_items) {
      return fail(Bad("the file holds more than " + std::to_string(max_items) + " requests, a batch's limit"), "");
    }
    Result<json> parsed = ParseBody(line);
    if (!parsed.ok()) return fail(Bad("not a JSON object: " + parsed.status().message()), "");
    const json& j = *parsed;
    Result<std::optional<std::string>> custom_id = String(j, "custom_id");
    if (!custom_id.ok()) return fail(custom_id.status(), "");
    if (!*custom_id || (*custom_id)->empty()) return fail(Bad("'custom_id' is required"), "");
    const std::string& id = **custom_id;
    if (!seen.insert(id).second) return fail(Bad("'custom_id' is not unique in the file"), id);
    Result<std::optional<std::string>> method = String(j, "method");
    if (!method.ok()) return fail(method.status(), id);
    if (*method && **method != "POST") return fail(Bad("'method' must be POST, got '" + **method + "'"), id);
    Result<std::optional<std::string>> url = String(j, "url");
    if (!url.ok()) return fail(url.status(), id);
    if (!*url) return fail(Bad("'url' is required"), id);
    if (**url != EndpointUrl(e)) {
      return fail(Bad("'url' is '" + (**url).substr(0, 64) + "' but the batch's endpoint is " + EndpointUrl(e)), id);
    }
    const json* body = Field(j, "body");
    if (!body || !body->is_object()) return fail(Bad("'body' must be an object (the request)"), id);
    if (const json* stream = Field(*body, "stream"); stream && !(stream->is_boolean() && !stream->get<bool>())) {
      return fail(Bad("'body.stream' must be false or absent: a batch's answers are in its output file"), id);
    }
    Result<Parsed> p = e == Endpoint::kChat ? ParseChat(*body, model, random_seed(), now)
                                            : ParseCompletions(*body, model, random_seed());
    if (!p.ok()) return fail(p.status(), id);
    rpc::JobItem item;
    item.custom_id = id;
    item.request = p->generate;  // (Thrift structs copy)
    items.push_back(std::move(item));
  }
  if (items.empty()) return Bad("the input file holds no requests");
  return items;
}

std::string BatchJobMetadata(const BatchRequest& b) {
  json m = {{"input_file_id", b.input_file_id},
            {"endpoint", EndpointUrl(b.endpoint)},
            {"completion_window", b.completion_window},
            {"metadata", b.metadata}};
  return json{{kMetadataKey, std::move(m)}}.dump();
}

std::optional<BatchRequest> BatchOfJob(const std::string& job_metadata) {
  json j = json::parse(job_metadata, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains(kMetadataKey) || !j[kMetadataKey].is_object()) {
    return std::nullopt;
  }
  const json& m = j[kMetadataKey];
  BatchRequest b;
  if (!m.value("input_file_id", json()).is_string() || !m.value("endpoint", json()).is_string()) return std::nullopt;
  b.input_file_id = m["input_file_id"].get<std::string>();
  Result<Endpoint> e = EndpointOf(m["endpoint"].get<std::string>());
  if (!e.ok()) return std::nullopt;
  b.endpoint = *e;
  b.completion_window = m.value("completion_window", std::string("24h"));
  b.metadata = m.value("metadata", json());
  return b;
}

std::string BatchId(const std::string& job_id) {
  return std::string(kBatchPrefix) + job_id.substr(std::min(job_id.size(), kJobPrefix.size()));
}

std::optional<std::string> JobIdOfBatch(const std::string& batch_id) {
  if (batch_id.size() <= kBatchPrefix.size() || batch_id.compare(0, kBatchPrefix.size(), kBatchPrefix) != 0) {
    return std::nullopt;
  }
  return std::string(kJobPrefix) + batch_id.substr(kBatchPrefix.size());
}

std::string ResultFileId(const std::string& job_id, bool errors) {
  return std::string(kResultFilePrefix) + job_id.substr(std::min(job_id.size(), kJobPrefix.size())) +
         std::string(errors ? kErrorsSuffix : kOutputSuffix);
}

std::optional<ResultFile> ResultFileOf(const std::string& file_id) {
  if (file_id.compare(0, kResultFilePrefix.size(), kResultFilePrefix) != 0) return std::nullopt;
  for (bool errors : {false, true}) {
    const std::string_view suffix = errors ? kErrorsSuffix : kOutputSuffix;
    if (file_id.size() > kResultFilePrefix.size() + suffix.size() && file_id.ends_with(suffix)) {
      return ResultFile{
          std::string(kJobPrefix) +
              file_id.substr(kResultFilePrefix.size(), file_id.size() - kResultFilePrefix.size() - suffix.size()),
          errors};
    }
  }
  return std::nullopt;
}

json BatchJson(const rpc::JobInfo& job, const BatchRequest& b) {
  const bool final = IsFinal(job.status);
  const int64_t failed = job.failed + job.cancelled;
  const int64_t t = job.finished_unix_s;
  return json{{"id", BatchId(job.id)},
              {"object", "batch"},
              {"endpoint", EndpointUrl(b.endpoint)},
              {"errors", nullptr},
              {"input_file_id", b.input_file_id},
              {"completion_window", b.completion_window},
              {"status", StatusName(job.status)},
              {"output_file_id", final && job.completed > 0 ? json(ResultFileId(job.id, false)) : json(nullptr)},
              {"error_file_id", final && failed > 0 ? json(ResultFileId(job.id, true)) : json(nullptr)},
              {"created_at", job.created_unix_s},
              {"in_progress_at", job.created_unix_s},
              {"expires_at", job.expires_unix_s},
              {"finalizing_at", TimeOrNull(job.status == rpc::JobStatus::COMPLETED, t)},
              {"completed_at", TimeOrNull(job.status == rpc::JobStatus::COMPLETED, t)},
              {"failed_at", TimeOrNull(job.status == rpc::JobStatus::FAILED, t)},
              {"expired_at", TimeOrNull(job.status == rpc::JobStatus::EXPIRED, t)},
              {"cancelling_at", nullptr},
              {"cancelled_at", TimeOrNull(job.status == rpc::JobStatus::CANCELLED, t)},
              {"request_counts", {{"total", job.total}, {"completed", job.completed}, {"failed", failed}}},
              {"metadata", b.metadata}};
}

json BatchResultLine(const rpc::JobItemResult& r, const std::string& job_id, Endpoint e, const std::string& model,
                     int64_t created) {
  const std::string request_id = HexId(Hash64(r.custom_id, Hash64(job_id)));
  json line = {{"id", "batch_req_" + request_id}, {"custom_id", r.custom_id}};
  if (r.ok) {
    rpc::GenerateChunk done;
    done.text = r.text;
    done.finish_reason = r.finish_reason;
    done.usage = r.usage;
    done.request_id = request_id;
    line["response"] = {{"status_code", 200}, {"request_id", request_id}, {"body", Response(e, model, created, done)}};
    line["error"] = nullptr;
  } else if (r.state == "cancelled" || r.error == "cancelled") {
    line["response"] = nullptr;
    line["error"] = {{"code", "batch_cancelled"}, {"message", "the batch was cancelled before this request ran"}};
  } else if (r.error == "expired") {
    line["response"] = nullptr;
    line["error"] = {{"code", "batch_expired"},
                     {"message", "this request did not run before the batch's completion window ended"}};
  } else {
    rpc::PenumbraError pe;
    pe.code = r.__isset.error_code ? r.error_code : rpc::ErrorCode::INTERNAL;
    pe.message = r.error;
    const ApiError a = ErrorOf(pe);
    line["response"] = {{"status_code", a.http_status}, {"request_id", request_id}, {"body", a.Body()}};
    line["error"] = nullptr;
  }
  return line;
}

json FileJson(const std::string& id, const std::string& filename, const std::string& purpose, int64_t bytes,
              int64_t created_at) {
  return json{{"id", id},
              {"object", "file"},
              {"bytes", bytes},
              {"created_at", created_at},
              {"filename", filename},
              {"purpose", purpose},
              {"status", "processed"},
              {"status_details", nullptr}};
}

}  // namespace penumbra::openai
