// The OpenAI API's files and batches (docs/openai.md, "Batches"): uploads
// in the gateway's FileStore, batches as the coordinator's durable jobs
// (coordinator/openai/batch_api.h says how they map), output and error
// files rendered from a job's results page by page as they are read.
#include <glog/logging.h>

#include "coordinator/openai/batch_api.h"
#include "coordinator/server/openai_gateway.h"
#include "coordinator/server/openai_gateway_internal.h"

namespace penumbra::coordinator {
namespace {

using nlohmann::json;
using namespace openai_gateway;  // NOLINT(google-build-using-namespace): the gateway's own helpers

constexpr const char* kBatchPurpose = "batch";
constexpr int64_t kMaxFileList = 10000;
constexpr int64_t kMaxBatchList = 100;

// ?name=N in [1, hi], else `fallback`; false (and the error answered) when malformed.
bool LimitParam(const httplib::Request& req, httplib::Response& res, int64_t hi, int64_t fallback, int64_t* out) {
  *out = fallback;
  if (!req.has_param("limit")) return true;
  const std::string v = req.get_param_value("limit");
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || x < 1 || x > hi) {
    Fail(res, openai::ErrorOf(Status::InvalidArgument("'limit' must be an integer in [1, " + std::to_string(hi) +
                                                      "], got '" + v.substr(0, 32) + "'")));
    return false;
  }
  *out = x;
  return true;
}

}  // namespace

Result<std::string> OpenAiGateway::FilesTenant(const httplib::Request& req) const {
  PENUMBRA_ASSIGN_OR_RETURN(std::string tenant, c_->TenantOf(BearerKey(req)));
  if (!files_) {
    return Status::FailedPrecondition("files and batches need a coordinator with a data directory (--data-dir)");
  }
  return tenant;
}

Result<std::pair<rpc::JobInfo, openai::BatchRequest>> OpenAiGateway::Batch(const std::string& key,
                                                                           const std::string& batch_id) const {
  const std::optional<std::string> job_id = openai::JobIdOfBatch(batch_id);
  const Status missing = Status::NotFound("batch " + batch_id.substr(0, 64) + " not found");
  if (!job_id) return missing;
  rpc::JobInfo job;
  try {
    c_->GetJob(job, key, *job_id);
  } catch (const rpc::PenumbraError& e) {
    Status s = transport::FromRpcError(e);
    // A malformed id is one that does not exist.
    return s.code() == StatusCode::kInvalidArgument ? missing : s;
  }
  std::optional<openai::BatchRequest> b = openai::BatchOfJob(job.metadata);
  if (!b) return missing;  // a job of the Thrift API
  return std::make_pair(std::move(job), std::move(*b));
}

Result<std::string> OpenAiGateway::ResultPage(const std::string& key, const ResultFileView& f,
                                              std::string* after) const {
  rpc::JobResults page;
  try {
    c_->GetJobResults(page, key, f.job.id, *after, c_->request_limits().max_page_size);
  } catch (const rpc::PenumbraError& e) {
    return transport::FromRpcError(e);
  }
  std::string out;
  for (const rpc::JobItemResult& r : page.results) {
    if (openai::IsErrorLine(r) != f.errors) continue;
    out += openai::BatchResultLine(r, f.job.id, f.batch.endpoint, model_.id, f.job.finished_unix_s).dump();
    out += '\n';
  }
  *after = page.next_after;
  return out;
}

Result<OpenAiGateway::ResultFileView> OpenAiGateway::ResultFileOf(const std::string& key,
                                                                  const std::string& file_id) const {
  const std::optional<openai::ResultFile> f = openai::ResultFileOf(file_id);
  if (!f) return Status::NotFound("file " + file_id.substr(0, 64) + " not found");
  PENUMBRA_ASSIGN_OR_RETURN(auto batch, Batch(key, openai::BatchId(f->job_id)));
  const json j = openai::BatchJson(batch.first, batch.second);
  const json& announced = j[f->errors ? "error_file_id" : "output_file_id"];
  if (!announced.is_string()) {
    // Not (yet) there: a batch still running, or one with no line of this kind.
    return Status::NotFound("file " + file_id + " not found: the batch " + std::string(j["status"]) +
                            (j["status"] == "in_progress" || j["status"] == "cancelling"
                                 ? " has not finished"
                                 : std::string(" has no ") + (f->errors ? "failed" : "successful") + " requests"));
  }
  return ResultFileView{batch.first, std::move(batch.second), f->errors};  // (Thrift structs copy)
}

void OpenAiGateway::BatchRoutes() {
  // ---- files ----
  http_->Post("/v1/files", [this](const httplib::Request& req, httplib::Response& res) {
    Result<std::string> tenant = FilesTenant(req);
    if (!tenant.ok()) return Fail(res, openai::ErrorOf(tenant.status()));
    if (!req.is_multipart_form_data()) {
      return Fail(res, openai::ErrorOf(Status::InvalidArgument(
                           "send the file as multipart/form-data with the fields 'file' and 'purpose'")));
    }
    if (!req.has_file("purpose")) return Fail(res, openai::ErrorOf(Status::InvalidArgument("'purpose' is required")));
    const std::string purpose = req.get_file_value("purpose").content;
    if (purpose != kBatchPurpose) {
      return Fail(res, openai::ErrorOf(Status::InvalidArgument("'purpose' '" + purpose.substr(0, 64) +
                                                               "' is not served: files here are batch inputs "
                                                               "(purpose 'batch')")));
    }
    if (!req.has_file("file")) return Fail(res, openai::ErrorOf(Status::InvalidArgument("'file' is required")));
    const httplib::MultipartFormData file = req.get_file_value("file");
    const std::string name = file.filename.empty() ? "upload.jsonl" : file.filename;
    Result<jobs::FileInfo> put = files_->Put(*tenant, name, purpose, file.content);
    if (!put.ok()) return Fail(res, openai::ErrorOf(put.status()));
    LOG(INFO) << "OpenAI API: tenant " << *tenant << " uploaded " << put->id << " (" << put->bytes << " bytes)";
    Reply(res, 200, openai::FileJson(put->id, put->filename, put->purpose, put->bytes, put->created_at));
  });
  http_->Get("/v1/files", [this](const httplib::Request& req, httplib::Response& res) {
    Result<std::string> tenant = FilesTenant(req);
    if (!tenant.ok()) return Fail(res, openai::ErrorOf(tenant.status()));
    int64_t limit = 0;
    if (!LimitParam(req, res, kMaxFileList, kMaxFileList, &limit)) return;
    Result<jobs::FilePage> page =
        files_->List(*tenant, req.get_param_value("after"), static_cast<size_t>(limit), req.get_param_value("purpose"));
    if (!page.ok()) return Fail(res, openai::ErrorOf(page.status()));
    json data = json::array();
    for (const jobs::FileInfo& f : page->files) {
      data.push_back(openai::FileJson(f.id, f.filename, f.purpose, f.bytes, f.created_at));
    }
    Reply(res, 200, ListJson(std::move(data), page->has_more));
  });
  http_->Get(R"(/v1/files/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
    Result<std::string> tenant = FilesTenant(req);
    if (!tenant.ok()) return Fail(res, openai::ErrorOf(tenant.status()));
    const std::string id = req.matches[1];
    if (openai::ResultFileOf(id)) {
      Result<ResultFileView> f = ResultFileOf(BearerKey(req), id);
      if (!f.ok()) return Fail(res, openai::ErrorOf(f.status()));
      int64_t bytes = 0;
      std::string after;
      do {
        Result<std::string> page = ResultPage(BearerKey(req), *f, &after);
        if (!page.ok()) return Fail(res, openai::ErrorOf(page.status()));
        bytes += static_cast<int64_t>(page->size());
      } while (!after.empty());
      return Reply(res, 200,
                   openai::FileJson(id, std::string(f->errors ? "batch_errors" : "batch_output") + ".jsonl",
                                    f->errors ? "batch_errors" : "batch_output", bytes, f->job.finished_unix_s));
    }
    Result<jobs::FileInfo> info = files_->Get(*tenant, id);
    if (!info.ok()) return Fail(res, openai::ErrorOf(info.status()));
    Reply(res, 200, openai::FileJson(info->id, info->filename, info->purpose, info->bytes, info->created_at));
  });
  http_->Get(R"(/v1/files/([^/]+)/content)", [this](const httplib::Request& req, httplib::Response& res) {
    Result<std::string> tenant = FilesTenant(req);
    if (!tenant.ok()) return Fail(res, openai::ErrorOf(tenant.status()));
    const std::string id = req.matches[1];
    if (!openai::ResultFileOf(id)) {
      Result<std::string> content = files_->Content(*tenant, id);
      if (!content.ok()) return Fail(res, openai::ErrorOf(content.status()));
      res.status = 200;
      return res.set_content(*content, "application/octet-stream");
    }
    Result<ResultFileView> f = ResultFileOf(BearerKey(req), id);
    if (!f.ok()) return Fail(res, openai::ErrorOf(f.status()));
    // Rendered page by page as the client reads: a 50000-line output is
    // never whole in memory.
    struct Cursor {
      std::string key, after;
      ResultFileView file;
      bool done = false;
    };
    auto cur = std::make_shared<Cursor>(Cursor{BearerKey(req), "", std::move(*f), false});
    res.status = 200;
    res.set_chunked_content_provider("application/octet-stream", [this, cur](size_t, httplib::DataSink& sink) {
      if (cur->done) {
        sink.done();
        return true;
      }
      Result<std::string> out = ResultPage(cur->key, cur->file, &cur->after);
      if (!out.ok()) {
        LOG(WARNING) << "OpenAI API: reading the results of " << cur->file.job.id << ": " << out.status();
        return false;  // the connection closes short: the client sees a truncated body, not a wrong one
      }
      cur->done = cur->after.empty();
      if (!out->empty() && !sink.write(out->data(), out->size())) return false;
      if (cur->done) sink.done();
      return true;
    });
  });
  http_->Delete(R"(/v1/files/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
    Result<std::string> tenant = FilesTenant(req);
    if (!tenant.ok()) return Fail(res, openai::ErrorOf(tenant.status()));
    const std::string id = req.matches[1];
    if (openai::ResultFileOf(id)) {
      // A batch's output or error file lives as long as its batch: deleting
      // either deletes the batch and its results.
      Result<ResultFileView> f = ResultFileOf(BearerKey(req), id);
      if (!f.ok()) return Fail(res, openai::ErrorOf(f.status()));
      try {
        c_->DeleteJob(BearerKey(req), f->job.id);
      } catch (const rpc::PenumbraError& e) {
        return Fail(res, openai::ErrorOf(e));
      }
    } else if (Status s = files_->Delete(*tenant, id); !s.ok()) {
      return Fail(res, openai::ErrorOf(s));
    }
    Reply(res, 200, json{{"id", id}, {"object", "file"}, {"deleted", true}});
  });

  // ---- batches ----
  http_->Post("/v1/batches", [this](const httplib::Request& req, httplib::Response& res) {
    Result<std::string> tenant = FilesTenant(req);
    if (!tenant.ok()) return Fail(res, openai::ErrorOf(tenant.status()));
    Result<json> body = openai::ParseBody(req.body);
    if (!body.ok()) return Fail(res, openai::MalformedBody(body.status().message()));
    Result<openai::BatchRequest> b = openai::ParseCreateBatch(*body);
    if (!b.ok()) return Fail(res, openai::ErrorOf(b.status()));
    Result<jobs::FileInfo> info = files_->Get(*tenant, b->input_file_id);
    if (!info.ok()) return Fail(res, openai::ErrorOf(info.status()));
    if (info->purpose != kBatchPurpose) {
      return Fail(res, openai::ErrorOf(Status::InvalidArgument("the file " + info->id + " has purpose '" +
                                                               info->purpose + "', not 'batch'")));
    }
    Result<std::string> content = files_->Content(*tenant, b->input_file_id);
    if (!content.ok()) return Fail(res, openai::ErrorOf(content.status()));
    Result<std::vector<rpc::JobItem>> items =
        openai::ParseBatchInput(*content, b->endpoint, model_, RandomSeed, std::chrono::system_clock::now(),
                                static_cast<size_t>(c_->request_limits().max_job_items));
    if (!items.ok()) return Fail(res, openai::ErrorOf(items.status()));
    rpc::SubmitJobRequest submit;
    submit.api_key = BearerKey(req);
    submit.items = std::move(*items);
    submit.completion_window_s = b->completion_window_s;
    submit.metadata = openai::BatchJobMetadata(*b);
    rpc::JobInfo job;
    try {
      c_->SubmitJob(job, submit);
    } catch (const rpc::PenumbraError& e) {
      return Fail(res, openai::ErrorOf(e));
    }
    LOG(INFO) << "OpenAI API: tenant " << *tenant << " created " << openai::BatchId(job.id) << " (" << job.total
              << " requests from " << b->input_file_id << ")";
    Reply(res, 200, openai::BatchJson(job, *b));
  });
  http_->Get(R"(/v1/batches/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
    Result<std::string> tenant = FilesTenant(req);
    if (!tenant.ok()) return Fail(res, openai::ErrorOf(tenant.status()));
    auto batch = Batch(BearerKey(req), req.matches[1]);
    if (!batch.ok()) return Fail(res, openai::ErrorOf(batch.status()));
    Reply(res, 200, openai::BatchJson(batch->first, batch->second));
  });
  http_->Post(R"(/v1/batches/([^/]+)/cancel)", [this](const httplib::Request& req, httplib::Response& res) {
    Result<std::string> tenant = FilesTenant(req);
    if (!tenant.ok()) return Fail(res, openai::ErrorOf(tenant.status()));
    auto batch = Batch(BearerKey(req), req.matches[1]);
    if (!batch.ok()) return Fail(res, openai::ErrorOf(batch.status()));
    rpc::JobInfo job;
    try {
      c_->CancelJob(job, BearerKey(req), batch->first.id);
    } catch (const rpc::PenumbraError& e) {
      return Fail(res, openai::ErrorOf(e));
    }
    Reply(res, 200, openai::BatchJson(job, batch->second));
  });
  http_->Get("/v1/batches", [this](const httplib::Request& req, httplib::Response& res) {
    Result<std::string> tenant = FilesTenant(req);
    if (!tenant.ok()) return Fail(res, openai::ErrorOf(tenant.status()));
    int64_t limit = 0;
    if (!LimitParam(req, res, kMaxBatchList, 20, &limit)) return;
    std::string token;
    if (req.has_param("after")) {
      const std::optional<std::string> job = openai::JobIdOfBatch(req.get_param_value("after"));
      if (!job) {
        return Fail(res, openai::ErrorOf(Status::InvalidArgument("'after' must be a batch id, got '" +
                                                                 req.get_param_value("after").substr(0, 64) + "'")));
      }
      token = *job;
    }
    // The tenant's jobs in creation order; those made by /v1/batches are
    // its batches.
    json data = json::array();
    bool more = false;
    do {
      rpc::JobList page;
      try {
        c_->ListJobs(page, BearerKey(req), token, c_->request_limits().max_page_size);
      } catch (const rpc::PenumbraError& e) {
        return Fail(res, openai::ErrorOf(e));
      }
      for (const rpc::JobInfo& j : page.jobs) {
        std::optional<openai::BatchRequest> b = openai::BatchOfJob(j.metadata);
        if (!b) continue;
        if (static_cast<int64_t>(data.size()) == limit) {
          more = true;
          break;
        }
        data.push_back(openai::BatchJson(j, *b));
      }
      token = page.next_page_token;
    } while (!more && !token.empty());
    Reply(res, 200, ListJson(std::move(data), more));
  });
}

}  // namespace penumbra::coordinator
