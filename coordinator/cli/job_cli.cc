// `penumbra job ...` (service_cli.h): submit a batch job (and wait for it with
// a progress line), status, results, cancel, ls, rm.
#include "coordinator/cli/service_cli.h"

#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/args.h"
#include "common/process.h"
#include "coordinator/cli/client_flags.h"
#include "coordinator/cli/job_file.h"
#include "coordinator/client/client.h"

namespace penumbra {
using cli::AddClientFlags;
using cli::ConnectFromFlags;
using cli::Positional;

namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

bool IsFinal(rpc::JobStatus::type s) {
  return s == rpc::JobStatus::COMPLETED || s == rpc::JobStatus::FAILED || s == rpc::JobStatus::CANCELLED ||
         s == rpc::JobStatus::EXPIRED;
}

// "in_progress", ...
std::string JobStatusName(rpc::JobStatus::type s) {
  std::string n = rpc::to_string(s);
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  return n;
}

int64_t Done(const rpc::JobInfo& j) { return j.completed + j.failed + j.cancelled; }

std::string UtcTime(int64_t unix_s) {
  if (unix_s <= 0) return "-";
  const time_t t = static_cast<time_t>(unix_s);
  tm parts{};
  gmtime_r(&t, &parts);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &parts);
  return buf;
}

nlohmann::ordered_json ToJson(const rpc::JobInfo& j) {
  return {{"id", j.id},
          {"status", JobStatusName(j.status)},
          {"total", j.total},
          {"pending", j.pending},
          {"running", j.running},
          {"completed", j.completed},
          {"failed", j.failed},
          {"cancelled", j.cancelled},
          {"created_unix_s", j.created_unix_s},
          {"expires_unix_s", j.expires_unix_s},
          {"finished_unix_s", j.finished_unix_s},
          {"metadata", j.metadata}};
}

nlohmann::ordered_json ToJson(const rpc::JobItemResult& r) {
  nlohmann::ordered_json j = {
      {"custom_id", r.custom_id},         {"ok", r.ok},      {"state", r.state}, {"text", r.text},
      {"finish_reason", r.finish_reason}, {"error", r.error}};
  if (r.__isset.error_code) j["error_code"] = rpc::to_string(r.error_code);
  j["usage"] = {{"prompt_tokens", r.usage.prompt_tokens},
                {"cached_prompt_tokens", r.usage.cached_prompt_tokens},
                {"generated_tokens", r.usage.generated_tokens},
                {"queue_seconds", r.usage.queue_seconds},
                {"ttft_seconds", r.usage.ttft_seconds}};
  return j;
}

std::string JsonLine(const nlohmann::ordered_json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// ID  STATUS  D/T done (C completed, F failed, X cancelled)  created  [metadata]
void PrintJobRow(const rpc::JobInfo& j) {
  std::printf("%s\t%s\t%lld/%lld done (%lld completed, %lld failed, %lld cancelled)\tcreated %s%s%s\n", j.id.c_str(),
              JobStatusName(j.status).c_str(), static_cast<long long>(Done(j)), static_cast<long long>(j.total),
              static_cast<long long>(j.completed), static_cast<long long>(j.failed),
              static_cast<long long>(j.cancelled), UtcTime(j.created_unix_s).c_str(), j.metadata.empty() ? "" : "\t",
              j.metadata.c_str());
}

// A job's progress on stderr: a bar redrawn in place on a terminal; else a
// plain line when the counts or the status change (at most one each 2 s)
// and the final one.
class JobProgress {
 public:
  explicit JobProgress(bool tty) : tty_(tty), t0_(Clock::now()) {}

  void Show(const rpc::JobInfo& j) {
    const Clock::time_point now = Clock::now();
    const bool final = IsFinal(j.status);
    const int64_t done = Done(j);
    const bool changed = done != last_done_ || j.status != last_status_;
    if (!tty_ && !final && (!changed || now - last_line_ < std::chrono::seconds(2))) {
      return;
    }
    last_done_ = done;
    last_status_ = j.status;
    last_line_ = now;
    const double frac = j.total > 0 ? static_cast<double>(done) / static_cast<double>(j.total) : 0;
    const int width = 30, filled = static_cast<int>(frac * width + 0.5);
    std::string bar(filled, '#');
    bar.resize(width, '.');
    std::fprintf(stderr, "%sjob %s [%s] %lld/%lld done (%lld completed, %lld failed) %s %.1f s%s", tty_ ? "\r" : "",
                 j.id.c_str(), bar.c_str(), static_cast<long long>(done), static_cast<long long>(j.total),
                 static_cast<long long>(j.completed), static_cast<long long>(j.failed), JobStatusName(j.status).c_str(),
                 std::chrono::duration<double>(now - t0_).count(),
                 !tty_   ? "\n"
                 : final ? "\033[K\n"
                         : "\033[K");
    std::fflush(stderr);
  }

  double seconds() const { return std::chrono::duration<double>(Clock::now() - t0_).count(); }
  bool tty() const { return tty_; }

 private:
  bool tty_;
  Clock::time_point t0_, last_line_{};
  int64_t last_done_ = -1;
  rpc::JobStatus::type last_status_{};
};

// How long `job submit` keeps polling an unreachable coordinator (a restart
// resumes the job) before it gives up waiting.
constexpr std::chrono::seconds kJobWaitUnreachable{300};

// Polls until the job is final; the job is left running when this fails.
Result<rpc::JobInfo> WaitForJob(client::Client& c, rpc::JobInfo j, JobProgress* progress) {
  Clock::time_point unreachable_since{};
  while (true) {
    if (progress) progress->Show(j);
    if (IsFinal(j.status)) return j;
    std::this_thread::sleep_for(milliseconds(500));
    Result<rpc::JobInfo> next = c.GetJob(j.id);
    if (next.ok()) {
      j = *next;
      unreachable_since = {};
      continue;
    }
    const StatusCode code = next.status().code();
    if (code != StatusCode::kUnavailable && code != StatusCode::kDeadlineExceeded) return next.status();
    if (unreachable_since == Clock::time_point{}) {
      unreachable_since = Clock::now();
      std::fprintf(stderr, "%sjob %s: coordinator unreachable (%s); still waiting\n",
                   progress && progress->tty() ? "\n" : "", j.id.c_str(), next.status().ToString().c_str());
    } else if (Clock::now() - unreachable_since > kJobWaitUnreachable) {
      return next.status().WithContext("waiting for job " + j.id + " (it may still run; see `penumbra job status " +
                                       j.id + "`)");
    }
  }
}

constexpr const char* kJobUsage =
    "usage: penumbra job submit FILE.jsonl [--detach] [--window-s N] [--metadata S] [--json]\n"
    "       penumbra job status ID | results ID [--out FILE] | cancel ID | ls | rm ID   [--json]\n"
    "       (and --address HOST:PORT, --api-key-file F, --tls-ca CA; FILE.jsonl: see coordinator/cli/job_file.h)";

// The server names a refused item "items[I] ..."; this adds the file's name
// and the item's line in front.
Status WithJobFileLine(const Status& s, const std::string& file, const std::vector<int64_t>& lines) {
  const std::string& m = s.message();
  if (m.rfind("items[", 0) != 0) return s;
  const size_t index = std::strtoull(m.c_str() + 6, nullptr, 10);
  if (index >= lines.size()) return s;
  return s.WithContext(file + ":" + std::to_string(lines[index]));
}

Status JobSubmit(int argc, char** argv) {
  Args a;
  a.Switch("detach", "print the job's id and return at once; follow it with `penumbra job status ID`")
      .Flag("window-s", "the completion window: items unfinished after it fail (default: the server's, 24 h)")
      .Flag("metadata", "a string kept with the job, shown by status and ls")
      .Switch("json", "print the job as JSON");
  AddClientFlags(a);
  std::string file;
  PENUMBRA_RETURN_IF_ERROR(a.Parse(argc, argv, Positional(argc, argv, &file)));
  if (file.empty()) return Status::InvalidArgument(kJobUsage);
  rpc::SubmitJobRequest r;
  // The whole file is checked before anything is sent.
  PENUMBRA_ASSIGN_OR_RETURN(JobFile job_file, ReadJobFile(file));
  r.items = std::move(job_file.items);
  PENUMBRA_ASSIGN_OR_RETURN(r.completion_window_s, a.GetIntIn("window-s", 0, 1, int64_t{10} * 365 * 86400));
  r.metadata = a.Get("metadata", "");
  PENUMBRA_ASSIGN_OR_RETURN(auto c, ConnectFromFlags(a));
  Result<rpc::JobInfo> submitted = c->SubmitJob(r);
  if (!submitted.ok()) return WithJobFileLine(submitted.status(), file, job_file.lines);
  rpc::JobInfo j = *submitted;
  if (a.Has("detach")) {
    if (a.Has("json")) {
      std::cout << JsonLine(ToJson(j)) << std::endl;
    } else {
      std::printf("%s\n", j.id.c_str());
    }
    return Status::OK();
  }
  std::fprintf(stderr, "job %s: %lld items submitted (Ctrl-C stops waiting, not the job)\n", j.id.c_str(),
               static_cast<long long>(j.total));
  JobProgress progress(isatty(2));
  PENUMBRA_ASSIGN_OR_RETURN(j, WaitForJob(*c, j, a.Has("json") ? nullptr : &progress));
  if (a.Has("json")) {
    std::cout << JsonLine(ToJson(j)) << std::endl;
  } else {
    std::printf("%s\t%s\t%lld items: %lld completed, %lld failed, %lld cancelled\t%.1f s\n", j.id.c_str(),
                JobStatusName(j.status).c_str(), static_cast<long long>(j.total), static_cast<long long>(j.completed),
                static_cast<long long>(j.failed), static_cast<long long>(j.cancelled), progress.seconds());
    std::fflush(stdout);
    std::fprintf(stderr, "results: penumbra job results %s [--out FILE]\n", j.id.c_str());
  }
  switch (j.status) {
    case rpc::JobStatus::COMPLETED:
      return Status::OK();
    case rpc::JobStatus::CANCELLED:
      return Status::Cancelled("job " + j.id + " was cancelled");
    case rpc::JobStatus::EXPIRED:
      return Status::DeadlineExceeded("job " + j.id + " expired: its completion window passed");
    default:
      return Status::Internal("job " + j.id + " ended " + JobStatusName(j.status));
  }
}

Status JobResultsCommand(client::Client& c, const std::string& id, const Args& a) {
  PENUMBRA_ASSIGN_OR_RETURN(rpc::JobInfo j, c.GetJob(id));
  PENUMBRA_ASSIGN_OR_RETURN(std::vector<rpc::JobItemResult> results, c.JobResults(id));
  if (!IsFinal(j.status)) {
    std::fprintf(stderr, "job %s is %s: %zu of %lld items have results so far\n", id.c_str(),
                 JobStatusName(j.status).c_str(), results.size(), static_cast<long long>(j.total));
  }
  std::string out;
  for (const rpc::JobItemResult& r : results) out += JsonLine(ToJson(r)) + "\n";
  if (!a.Has("out")) {
    std::cout << out << std::flush;
    return Status::OK();
  }
  PENUMBRA_RETURN_IF_ERROR(WriteFileAtomically(a.Get("out"), out));
  std::fprintf(stderr, "%zu results written to %s\n", results.size(), a.Get("out").c_str());
  return Status::OK();
}

}  // namespace

Status JobCommand(int argc, char** argv) {
  const std::string sub = argc > 2 ? argv[2] : "";
  if (sub == "submit") return JobSubmit(argc, argv);
  if (sub != "status" && sub != "results" && sub != "cancel" && sub != "ls" && sub != "rm") {
    return Status::InvalidArgument(kJobUsage);
  }
  Args a;
  if (sub == "results") {
    a.Flag("out", "write the JSON lines here (atomically) instead of to stdout");
  } else {
    a.Switch("json", "print JSON");
  }
  AddClientFlags(a);
  std::string id;
  const int first = sub == "ls" ? 3 : Positional(argc, argv, &id);
  if (sub != "ls" && id.empty()) return Status::InvalidArgument("usage: penumbra job " + sub + " ID");
  PENUMBRA_RETURN_IF_ERROR(a.Parse(argc, argv, first));
  PENUMBRA_ASSIGN_OR_RETURN(auto c, ConnectFromFlags(a));
  if (sub == "results") return JobResultsCommand(*c, id, a);
  if (sub == "rm") {
    PENUMBRA_RETURN_IF_ERROR(c->DeleteJob(id));
    std::printf("deleted %s\n", id.c_str());
    return Status::OK();
  }
  std::vector<rpc::JobInfo> jobs;
  if (sub == "ls") {
    PENUMBRA_ASSIGN_OR_RETURN(jobs, c->ListJobs());
  } else {
    PENUMBRA_ASSIGN_OR_RETURN(rpc::JobInfo j, sub == "cancel" ? c->CancelJob(id) : c->GetJob(id));
    jobs.push_back(j);
  }
  for (const rpc::JobInfo& j : jobs) {
    if (a.Has("json")) {
      std::cout << JsonLine(ToJson(j)) << "\n";
    } else {
      PrintJobRow(j);
    }
  }
  std::cout << std::flush;
  return Status::OK();
}

}  // namespace penumbra
