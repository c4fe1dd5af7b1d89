#include "coordinator/cli/service_cli.h"

#include <limits.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "common/args.h"
#include "common/file.h"
#include "common/process.h"
#include "coordinator/cli/job_file.h"
#include "coordinator/client/client.h"
#include "coordinator/tenants/tenants.h"

namespace penumbra {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// ---- client commands -----------------------------------------------------------

void AddClientFlags(Args& a) { client::AddConnectionFlags(a); }

Result<std::unique_ptr<client::Client>> ConnectFromFlags(const Args& a) {
  PENUMBRA_ASSIGN_OR_RETURN(client::ClientOptions o, client::OptionsFromFlags(a));
  return client::Client::Connect(o);
}

const char* StateName(rpc::DocumentState::type s) {
  switch (s) {
    case rpc::DocumentState::FACTORING: return "factoring";
    case rpc::DocumentState::READY: return "ready";
    case rpc::DocumentState::FAILED: return "failed";
  }
  return "?";
}

nlohmann::json ToJson(const rpc::DocumentInfo& d) {
  nlohmann::json j = {{"id", d.id},           {"name", d.name},     {"tokens", d.tokens},
                      {"state", StateName(d.state)}, {"worker", d.worker}, {"factor_seconds", d.factor_seconds},
                      {"created_unix_ms", d.created_unix_ms}};
  if (d.__isset.error) j["error"] = d.error;
  return j;
}

nlohmann::json ToJson(const rpc::Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},       {"cached_prompt_tokens", u.cached_prompt_tokens},
          {"generated_tokens", u.generated_tokens}, {"queue_seconds", u.queue_seconds},
          {"ttft_seconds", u.ttft_seconds}};
}

// A one-line progress bar on stderr, redrawn in place on a terminal.
void ShowProgress(const rpc::DocumentInfo& d, Clock::time_point t0, bool tty) {
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  const double frac = d.tokens > 0 ? static_cast<double>(d.factored_tokens) / static_cast<double>(d.tokens) : 0;
  const int width = 30, filled = static_cast<int>(frac * width + 0.5);
  std::string bar(filled, '#');
  bar.resize(width, '.');
  if (tty || d.state != rpc::DocumentState::FACTORING) {
    std::fprintf(stderr, "%sfactoring %s [%s] %lld/%lld tokens %.1f s%s", tty ? "\r" : "", d.name.c_str(), bar.c_str(),
                 static_cast<long long>(d.factored_tokens), static_cast<long long>(d.tokens), secs,
                 d.state == rpc::DocumentState::FACTORING ? "" : "\n");
    std::fflush(stderr);
  }
}

// `penumbra CMD SUB [ARG] --flags`: ARG (argv[3] when it is not a flag) into
// *arg; returns where the flags start.
int Positional(int argc, char** argv, std::string* arg) {
  if (argc > 3 && std::string(argv[3]).rfind("--", 0) != 0) {
    *arg = argv[3];
    return 4;
  }
  return 3;
}

Status DocPut(int argc, char** argv) {
  Args a;
  a.Flag("name", "the document's name (default: the file's name)")
      .Flag("ids", "the document as comma-separated token ids instead of a file")
      .Switch("no-wait", "return at once (state factoring); see `penumbra doc get`")
      .Switch("json", "print the document as JSON");
  AddClientFlags(a);
  std::string file;
  PENUMBRA_RETURN_IF_ERROR(a.Parse(argc, argv, Positional(argc, argv, &file)));
  if (file.empty() == !a.Has("ids")) return Status::InvalidArgument("doc put: give a FILE or --ids, not both");
  std::string text;
  std::vector<int32_t> ids;
  if (!file.empty()) {
    PENUMBRA_ASSIGN_OR_RETURN(text, ReadFileToString(file));
  } else {
    PENUMBRA_ASSIGN_OR_RETURN(auto list, a.GetIntList("ids"));
    for (int64_t id : list) {
      if (id < 0 || id > INT32_MAX) return Status::InvalidArgument("--ids: id " + std::to_string(id) + " is out of range");
      ids.push_back(static_cast<int32_t>(id));
    }
  }
  const std::string name = a.Get("name", file.empty() ? "ids" : std::filesystem::path(file).filename().string());
  PENUMBRA_ASSIGN_OR_RETURN(auto c, ConnectFromFlags(a));
  const Clock::time_point t0 = Clock::now();
  const bool tty = isatty(2);
  std::function<void(const rpc::DocumentInfo&)> progress;
  if (!a.Has("json") && !a.Has("no-wait")) progress = [&](const rpc::DocumentInfo& d) { ShowProgress(d, t0, tty); };
  PENUMBRA_ASSIGN_OR_RETURN(rpc::DocumentInfo d, c->PutDocument(name, file.empty() ? nullptr : &text,
                                                               file.empty() ? &ids : nullptr, !a.Has("no-wait"),
                                                               milliseconds(0), progress));
  if (a.Has("json")) {
    std::cout << ToJson(d).dump() << std::endl;
  } else if (d.state == rpc::DocumentState::FAILED) {
    return Status::Internal("document " + d.id + " failed to factor: " + (d.__isset.error ? d.error : ""));
  } else {
    std::printf("%s\t%s\t%lld tokens\t%s%s\n", d.id.c_str(), d.name.c_str(), static_cast<long long>(d.tokens),
                StateName(d.state),
                d.factor_seconds >= 0 ? (" in " + std::to_string(d.factor_seconds).substr(0, 5) + " s").c_str() : "");
  }
  return Status::OK();
}

}  // namespace

Status TenantCommand(int argc, char** argv) {
  const std::string usage =
      "usage: penumbra tenant new-key     a new random API key and its sha256: hash (for tenants.yaml)\n"
      "       penumbra tenant hash-key    the sha256: hash of the key read from stdin (at least " +
      std::to_string(tenants::kMinApiKeyBytes) + " bytes; a key is never given on the command line)";
  const std::string sub = argc > 2 ? argv[2] : "";
  if (sub == "new-key" && argc == 3) {
    // The key is printed once, here; only its hash goes into tenants.yaml.
    const std::string key = tenants::NewApiKey();
    PENUMBRA_ASSIGN_OR_RETURN(std::string hash, tenants::HashApiKey(key));
    std::printf("%s\n%s\n", key.c_str(), hash.c_str());
    std::fflush(stdout);
    std::fprintf(stderr, "line 1: the key (give it to the tenant, e.g. in a file for --api-key-file; it is not "
                         "kept anywhere); line 2: its hash, for the tenant's api_keys in tenants.yaml\n");
    return Status::OK();
  }
  if (sub == "hash-key" && argc == 3) {
    // From stdin: a key in argv would be in the shell's history and in ps.
    std::string key((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    if (!std::cin.eof() && std::cin.fail()) return Status::IOError("penumbra tenant hash-key: reading stdin failed");
    // One trailing line end (echo, a file) is not part of the key.
    if (!key.empty() && key.back() == '\n') key.pop_back();
    if (!key.empty() && key.back() == '\r') key.pop_back();
    PENUMBRA_ASSIGN_OR_RETURN(std::string hash, tenants::HashApiKey(key));
    std::printf("%s\n", hash.c_str());
    return Status::OK();
  }
  if (sub == "hash-key") {
    // Not echoed: the argument may be a key.
    return Status::InvalidArgument("penumbra tenant hash-key takes the key on stdin, not as an argument "
                                   "(e.g. `penumbra tenant hash-key < key.txt`)\n" + usage);
  }
  return Status::InvalidArgument(usage);
}

Status DocCommand(int argc, char** argv) {
  const std::string sub = argc > 2 ? argv[2] : "";
  if (sub == "put") return DocPut(argc, argv);
  Args a;
  a.Switch("json", "print JSON");
  AddClientFlags(a);
  std::string id;
  int first = 3;
  if ((sub == "get" || sub == "rm") && argc > 3) {
    id = argv[3];
    first = 4;
  }
  if (sub != "ls" && sub != "get" && sub != "rm") {
    return Status::InvalidArgument("usage: penumbra doc put FILE [--name N] | ls | get ID | rm ID [--address A] [--api-key-file F] [--tls-ca CA]");
  }
  if (sub != "ls" && id.empty()) return Status::InvalidArgument("penumbra doc " + sub + " ID");
  PENUMBRA_RETURN_IF_ERROR(a.Parse(argc, argv, first));
  PENUMBRA_ASSIGN_OR_RETURN(auto c, ConnectFromFlags(a));
  if (sub == "rm") {
    PENUMBRA_RETURN_IF_ERROR(c->DeleteDocument(id));
    std::printf("deleted %s\n", id.c_str());
    return Status::OK();
  }
  std::vector<rpc::DocumentInfo> docs;
  if (sub == "get") {
    PENUMBRA_ASSIGN_OR_RETURN(rpc::DocumentInfo d, c->GetDocument(id));
    docs.push_back(d);
  } else {
    PENUMBRA_ASSIGN_OR_RETURN(docs, c->ListDocuments());
  }
  for (const auto& d : docs) {
    if (a.Has("json")) {
      std::cout << ToJson(d).dump() << "\n";
    } else {
      std::printf("%s\t%s\t%lld tokens\t%s\t%s\n", d.id.c_str(), d.name.c_str(), static_cast<long long>(d.tokens),
                  StateName(d.state), d.worker.c_str());
    }
  }
  return Status::OK();
}

Status AskCommand(int argc, char** argv) {
  Args a;
  a.Flag("docs", "comma-separated document ids the question is about")
      .Flag("question", "the question's text (\\n for a newline)")
      .Flag("question-ids", "the question as comma-separated token ids")
      .Flag("max-new-tokens", "tokens to generate at most (default 256)")
      .Flag("temperature", "sampling temperature (default 0 = greedy)")
      .Flag("top-k", "top-k cut (default 0 = off)")
      .Flag("top-p", "nucleus cut (default 1 = off)")
      .Flag("seed", "sampling seed (default 0)")
      .Flag("stop", "a string that ends the answer (\\n for a newline)")
      .Flag("stop-ids", "comma-separated ids that end the answer")
      .Switch("ignore-eos", "do not stop at the model's end-of-text ids")
      .Flag("kv-policy", "run on workers of this KV policy only: full or shadowkv")
      .Flag("deadline-ms", "give up after this long (default none)")
      .Switch("json", "print one JSON object at the end instead of streaming text");
  AddClientFlags(a);
  PENUMBRA_RETURN_IF_ERROR(a.Parse(argc, argv, 2));
  if (a.Has("question") == a.Has("question-ids")) return Status::InvalidArgument("give --question or --question-ids");
  rpc::GenerateRequest r;
  if (a.Has("docs")) {
    std::stringstream s(a.Get("docs"));
    std::string id;
    while (std::getline(s, id, ',')) {
      if (!id.empty()) r.document_ids.push_back(id);
    }
  }
  if (a.Has("question")) {
    r.__set_text(Unescape(a.Get("question")));
  } else {
    PENUMBRA_ASSIGN_OR_RETURN(auto list, a.GetIntList("question-ids"));
    std::vector<int32_t> ids;
    for (int64_t id : list) {
      if (id < 0 || id > INT32_MAX) return Status::InvalidArgument("--question-ids: id " + std::to_string(id) + " is out of range");
      ids.push_back(static_cast<int32_t>(id));
    }
    r.__set_token_ids(ids);
  }
  PENUMBRA_ASSIGN_OR_RETURN(int64_t max_new, a.GetIntIn("max-new-tokens", 256, 1, 1 << 20));
  r.max_new_tokens = static_cast<int32_t>(max_new);
  PENUMBRA_ASSIGN_OR_RETURN(r.sampling.temperature, a.GetDoubleIn("temperature", 0.0, 0.0, 100.0));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t top_k, a.GetIntIn("top-k", 0, 0, INT32_MAX));
  r.sampling.top_k = static_cast<int32_t>(top_k);
  PENUMBRA_ASSIGN_OR_RETURN(r.sampling.top_p, a.GetDoubleIn("top-p", 1.0, 0.0, 1.0, /*lo_open=*/true));
  PENUMBRA_ASSIGN_OR_RETURN(r.sampling.seed, a.GetIntIn("seed", 0, 0, INT64_MAX));
  if (a.Has("stop")) r.stop.push_back(Unescape(a.Get("stop")));
  if (a.Has("stop-ids")) {
    PENUMBRA_ASSIGN_OR_RETURN(auto list, a.GetIntList("stop-ids"));
    for (int64_t id : list) {
      if (id < 0 || id > INT32_MAX) return Status::InvalidArgument("--stop-ids: id " + std::to_string(id) + " is out of range");
      r.stop_ids.push_back(static_cast<int32_t>(id));
    }
  }
  r.ignore_eos = a.Has("ignore-eos");
  r.kv_policy = a.Get("kv-policy", "");
  PENUMBRA_ASSIGN_OR_RETURN(r.deadline_ms, a.GetIntIn("deadline-ms", 0, 0, INT64_MAX / 2));
  PENUMBRA_ASSIGN_OR_RETURN(auto c, ConnectFromFlags(a));
  const Clock::time_point t0 = Clock::now();
  double first_text = -1;
  Result<rpc::GenerateChunk> last = c->Stream(r, [&](const std::string& delta) {
    if (first_text < 0) first_text = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!a.Has("json")) {
      std::cout << delta << std::flush;
    }
  });
  PENUMBRA_RETURN_IF_ERROR(last.status());
  const double total = std::chrono::duration<double>(Clock::now() - t0).count();
  const rpc::GenerateChunk& g = *last;
  if (g.finish_reason == "error" || g.finish_reason == "deadline") {
    if (!a.Has("json")) std::cout << "\n";
    rpc::PenumbraError e;
    e.code = g.__isset.error_code ? g.error_code : rpc::ErrorCode::INTERNAL;
    e.message = g.__isset.error_message ? g.error_message : g.finish_reason;
    return transport::FromRpcError(e);
  }
  const double decode_tps = g.usage.generated_tokens > 1 && total > g.usage.ttft_seconds && g.usage.ttft_seconds >= 0
                                ? (g.usage.generated_tokens - 1) / (total - g.usage.ttft_seconds)
                                : 0;
  if (a.Has("json")) {
    nlohmann::json j = {{"request_id", g.request_id}, {"text", g.text}, {"finish_reason", g.finish_reason},
                        {"usage", ToJson(g.usage)}, {"seconds", total}, {"tokens_per_s", decode_tps}};
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
  } else {
    std::cout << "\n";
    std::fprintf(stderr,
                 "[%lld prompt tokens, %lld from the document cache; %lld generated (%s); first token %.3f s, "
                 "%.1f tokens/s]\n",
                 static_cast<long long>(g.usage.prompt_tokens), static_cast<long long>(g.usage.cached_prompt_tokens),
                 static_cast<long long>(g.usage.generated_tokens), g.finish_reason.c_str(), g.usage.ttft_seconds,
                 decode_tps);
  }
  return Status::OK();
}

Status StatsCommand(int argc, char** argv) {
  Args a;
  a.Switch("json", "print JSON");
  AddClientFlags(a);
  PENUMBRA_RETURN_IF_ERROR(a.Parse(argc, argv, 2));
  PENUMBRA_ASSIGN_OR_RETURN(auto c, ConnectFromFlags(a));
  PENUMBRA_ASSIGN_OR_RETURN(rpc::StatsResponse s, c->Stats());
  nlohmann::json j = {{"requests", s.requests},           {"requests_failed", s.requests_failed},
                      {"requests_running", s.requests_running}, {"documents", s.documents},
                      {"prompt_tokens", s.prompt_tokens}, {"cached_prompt_tokens", s.cached_prompt_tokens},
                      {"generated_tokens", s.generated_tokens}};
  // The workers are shown to an admin tenant (or without authentication).
  if (!s.workers.empty()) {
    nlohmann::json workers = nlohmann::json::array();
    for (const auto& w : s.workers) {
      nlohmann::json o = {{"name", w.name},         {"address", w.address}, {"healthy", w.healthy},
                          {"kv_policy", w.kv_policy}, {"backend", w.backend}, {"running", w.running},
                          {"documents", w.documents}};
      if (w.__isset.error) o["error"] = w.error;
      workers.push_back(std::move(o));
    }
    j["workers"] = std::move(workers);
  }
  std::cout << (a.Has("json") ? j.dump() : j.dump(2)) << std::endl;
  return Status::OK();
}

// ---- batch jobs ----------------------------------------------------------------

namespace {

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
  nlohmann::ordered_json j = {{"custom_id", r.custom_id}, {"ok", r.ok},
                              {"state", r.state},         {"text", r.text},
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
    std::fprintf(stderr, "%sjob %s [%s] %lld/%lld done (%lld completed, %lld failed) %s %.1f s%s",
                 tty_ ? "\r" : "", j.id.c_str(), bar.c_str(), static_cast<long long>(done),
                 static_cast<long long>(j.total), static_cast<long long>(j.completed),
                 static_cast<long long>(j.failed), JobStatusName(j.status).c_str(),
                 std::chrono::duration<double>(now - t0_).count(), !tty_ ? "\n" : final ? "\033[K\n" : "\033[K");
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
                   progress && progress->tty() ? "\n" : "",
                   j.id.c_str(), next.status().ToString().c_str());
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
    case rpc::JobStatus::COMPLETED: return Status::OK();
    case rpc::JobStatus::CANCELLED: return Status::Cancelled("job " + j.id + " was cancelled");
    case rpc::JobStatus::EXPIRED:
      return Status::DeadlineExceeded("job " + j.id + " expired: its completion window passed");
    default: return Status::Internal("job " + j.id + " ended " + JobStatusName(j.status));
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

// ---- serve ---------------------------------------------------------------------

namespace {

// This executable's folder: penumbra-worker and penumbra-coordinator are its siblings.
std::string ExeDir() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  buf[n] = '\0';
  return std::filesystem::path(buf).parent_path().string();
}

// How `penumbra serve` restarts a child that died: after `initial`, doubling
// at each death up to `max`; a child that stayed up `stable` starts again
// from `initial`. A child that keeps dying is retried at `max` for as long
// as serve runs (each death on stderr with its count).
struct RestartPolicy {
  milliseconds initial{1000};  // Default: 1 s.
  milliseconds max{30000};     // Default: 30 s.
  milliseconds stable{60000};  // Default: 60 s.
};

// After this many deaths in a row (none staying up `stable`), a death's line
// says the child keeps crashing.
constexpr int kCrashLoopDeaths = 5;

// A process serve started and supervises.
struct Child {
  std::string name;
  std::string kind;               // "coordinator", "worker", "store node"
  std::string host;               // where it listens (for messages)
  std::vector<std::string> argv;  // what it is (re)started with, without --port-file
  pid_t pid = -1;                 // -1: not running (stopped, or waiting to restart)
  std::string log, port_file;
  int port = 0, metrics_port = -1;
  bool serving = false;           // its port file was read since its last start
  int restarts = 0;               // times serve restarted it
  int deaths_in_row = 0;          // deaths without staying up RestartPolicy::stable
  milliseconds backoff{0};        // the delay before the next restart
  Clock::time_point started, restart_at;
};

// Starts `c` (its argv plus --port-file); `append` keeps its log's earlier lines.
Status Spawn(Child& c, bool append) {
  std::filesystem::remove(c.port_file);
  std::vector<std::string> argv = c.argv;
  argv.insert(argv.end(), {"--port-file", c.port_file});
  PENUMBRA_ASSIGN_OR_RETURN(c.pid, SpawnProcess(argv, c.log, append));
  c.serving = false;
  c.started = Clock::now();
  return Status::OK();
}

Child MakeChild(const std::string& name, const std::string& kind, const std::string& host,
                std::vector<std::string> argv, const std::string& dir) {
  Child c;
  c.name = name;
  c.kind = kind;
  c.host = host;
  c.argv = std::move(argv);
  c.log = dir + "/" + name + ".log";
  c.port_file = dir + "/" + name + ".port";
  return c;
}

// Every value of `flag` in argv becomes `value` (a restart keeps the port
// the first start got).
void PinFlag(std::vector<std::string>& argv, const std::string& flag, int value) {
  for (size_t i = 0; i + 1 < argv.size(); ++i) {
    if (argv[i] == flag) argv[i + 1] = std::to_string(value);
  }
}

std::string Tail(const std::string& path, size_t bytes = 4000) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  std::string t = s.str();
  return t.size() > bytes ? "..." + t.substr(t.size() - bytes) : t;
}

// The last `lines` lines of a file, each indented.
std::string TailLines(const std::string& path, size_t lines = 12) {
  const std::string t = Tail(path, 16000);
  std::vector<std::string> all;
  std::stringstream in(t);
  for (std::string l; std::getline(in, l);) all.push_back(l);
  std::string out;
  for (size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i) out += "    " + all[i] + "\n";
  return out.empty() ? "    (empty)\n" : out;
}

// Reads `c`'s port file; true once it is there and whole.
bool ReadPortFile(Child& c) {
  std::ifstream f(c.port_file);
  if (!f) return false;
  try {
    nlohmann::json j = nlohmann::json::parse(f);
    c.port = j.at("port").get<int>();
    c.metrics_port = j.at("metrics_port").get<int>();
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// Waits until `c` wrote its port file; fails with its log when it exits first.
Status WaitServing(Child& c, milliseconds timeout) {
  const Clock::time_point until = Clock::now() + timeout;
  while (Clock::now() < until) {
    if (ReadPortFile(c)) {
      c.serving = true;
      return Status::OK();
    }
    int st = 0;
    if (waitpid(c.pid, &st, WNOHANG) == c.pid) {
      c.pid = -1;
      return Status::Unavailable(c.name + " exited before serving (" + DescribeWaitStatus(st) + "); its log (" +
                                 c.log + "):\n" + Tail(c.log));
    }
    std::this_thread::sleep_for(milliseconds(50));
  }
  return Status::DeadlineExceeded(c.name + " not serving after " + std::to_string(timeout.count() / 1000) +
                                  " s; its log: " + c.log);
}

// SIGTERM, then SIGKILL after `grace`.
void StopChild(Child& c, milliseconds grace) {
  if (c.pid <= 0) return;
  kill(c.pid, SIGTERM);
  const Clock::time_point until = Clock::now() + grace;
  int st = 0;
  while (Clock::now() < until) {
    if (waitpid(c.pid, &st, WNOHANG) == c.pid) {
      c.pid = -1;
      return;
    }
    std::this_thread::sleep_for(milliseconds(20));
  }
  kill(c.pid, SIGKILL);
  waitpid(c.pid, &st, 0);
  c.pid = -1;
}

std::string Seconds(Clock::duration d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", std::chrono::duration<double>(d).count());
  return buf;
}

std::string UtcNow() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// `c` died with wait status `st`: says so on stderr (its status, how long it
// was up, the end of its log) and schedules its restart by `policy`.
void OnChildDeath(Child& c, int st, const RestartPolicy& policy) {
  const Clock::time_point now = Clock::now();
  const Clock::duration up = now - c.started;
  const pid_t pid = c.pid;
  c.pid = -1;
  if (up >= policy.stable || c.backoff.count() == 0) {
    c.backoff = policy.initial;
    if (up >= policy.stable) c.deaths_in_row = 0;
  }
  ++c.deaths_in_row;
  const milliseconds delay = c.backoff;
  c.restart_at = now + delay;
  c.backoff = std::min(policy.max, c.backoff * 2);
  std::string port = c.port > 0 ? ", port " + std::to_string(c.port) : "";
  std::fprintf(stderr, "serve: %s %s (pid %d) died: %s after %s up (%s); restart %d in %s (same arguments%s)\n",
               c.kind.c_str(), c.name.c_str(), static_cast<int>(pid), DescribeWaitStatus(st).c_str(),
               Seconds(up).c_str(), c.serving ? "it was serving" : "before it served", c.restarts + 1,
               Seconds(delay).c_str(), port.c_str());
  if (c.deaths_in_row >= kCrashLoopDeaths) {
    std::fprintf(stderr,
                 "serve: %s %s keeps crashing (%d deaths in a row, none up %lld s): retried every %s at most, for "
                 "as long as serve runs\n",
                 c.kind.c_str(), c.name.c_str(), c.deaths_in_row,
                 static_cast<long long>(policy.stable.count() / 1000), Seconds(policy.max).c_str());
  }
  std::fprintf(stderr, "serve: the end of %s's log (%s):\n%s", c.name.c_str(), c.log.c_str(), TailLines(c.log).c_str());
}

// serve's own port file: the coordinator's ports, serve's pid and each
// child's state (pid, port, restarts: the crash-loop counter operators watch).
Status WriteServePortFile(const std::string& path, const Child& coordinator, const std::vector<Child*>& all) {
  nlohmann::json children = nlohmann::json::object();
  int64_t restarts = 0;
  for (const Child* c : all) {
    const char* state = c->pid <= 0 ? "down" : c->serving ? "serving" : "starting";
    children[c->name] = {{"kind", c->kind}, {"pid", static_cast<int64_t>(c->pid)}, {"port", c->port},
                         {"state", state},  {"restarts", c->restarts}, {"deaths_in_row", c->deaths_in_row}};
    restarts += c->restarts;
  }
  nlohmann::json j = {{"port", coordinator.port},
                      {"metrics_port", coordinator.metrics_port},
                      {"pid", static_cast<int64_t>(getpid())},
                      {"restarts", restarts},
                      {"children", children}};
  return WriteFileAtomically(path, j.dump() + "\n");
}

}  // namespace

std::string Unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size()) {
      const char n = s[i + 1];
      if (n == 'n' || n == 't' || n == '\\') {
        out += n == 'n' ? '\n' : n == 't' ? '\t' : '\\';
        ++i;
        continue;
      }
    }
    out += s[i];
  }
  return out;
}

namespace {

// Unknown keys are errors naming them (a typo must not be ignored).
Status CheckKeys(const YAML::Node& n, const std::vector<std::string>& allowed, const std::string& where) {
  if (!n.IsMap()) return Status::InvalidArgument(where + " must be a map");
  for (const auto& kv : n) {
    const std::string key = kv.first.as<std::string>();
    if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
      return Status::InvalidArgument(where + ": unknown key '" + key + "'");
    }
  }
  return Status::OK();
}

template <typename T>
Status ReadKey(const YAML::Node& n, const std::string& key, const std::string& where, T* out) {
  if (!n[key]) return Status::OK();
  try {
    *out = n[key].as<T>();
  } catch (const YAML::Exception&) {
    return Status::InvalidArgument(where + "." + key + ": not a valid value");
  }
  return Status::OK();
}

Status ReadPort(const YAML::Node& n, const std::string& key, const std::string& where, int lo, int* out) {
  PENUMBRA_RETURN_IF_ERROR(ReadKey(n, key, where, out));
  if (*out < lo || *out > 65535) {
    return Status::InvalidArgument(where + "." + key + " must be in [" + std::to_string(lo) + ", 65535], got " +
                                   std::to_string(*out));
  }
  return Status::OK();
}

// A process's name (its log, port file and metrics label): non-empty,
// without separators, and not another worker's or node's.
Status CheckProcessName(const ServiceTopology& t, const std::string& where, const std::string& name) {
  if (name.empty() || name.find_first_of(",=: /") != std::string::npos) {
    return Status::InvalidArgument(where + ".name '" + name + "' must be non-empty, without , = : / or spaces");
  }
  // Certificates are named after processes (penumbra cert init).
  for (const char* reserved : {"coordinator", "admin", "client", "ca", "cluster"}) {
    if (name == reserved) return Status::InvalidArgument(where + ".name '" + name + "' is reserved");
  }
  for (const auto& w : t.workers) {
    if (w.name == name) return Status::InvalidArgument(where + ": two processes named " + name);
  }
  for (const auto& n : t.store_nodes) {
    if (n.name == name) return Status::InvalidArgument(where + ": two processes named " + name);
  }
  return Status::OK();
}

}  // namespace

Result<ServiceTopology> LoadServiceTopology(const std::string& path) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(path + ": " + e.what());
  }
  ServiceTopology t;
  PENUMBRA_RETURN_IF_ERROR(
      CheckKeys(root, {"model", "api_keys", "tenants", "data_dir", "security", "coordinator", "workers", "store_nodes"},
                path));
  PENUMBRA_RETURN_IF_ERROR(ReadKey(root, "model", path, &t.model));
  PENUMBRA_RETURN_IF_ERROR(ReadKey(root, "api_keys", path, &t.api_keys));
  PENUMBRA_RETURN_IF_ERROR(ReadKey(root, "tenants", path, &t.tenants));
  PENUMBRA_RETURN_IF_ERROR(ReadKey(root, "data_dir", path, &t.data_dir));
  if (!t.api_keys.empty() && !t.tenants.empty()) {
    return Status::InvalidArgument(path + ": api_keys and tenants are exclusive: give one of them");
  }
  if (const YAML::Node sec = root["security"]) {
    const std::string where = path + ": security";
    PENUMBRA_RETURN_IF_ERROR(CheckKeys(sec, {"certs", "insecure"}, where));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(sec, "certs", where, &t.certs));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(sec, "insecure", where, &t.insecure));
  }
  if (root["coordinator"]) {
    const YAML::Node c = root["coordinator"];
    const std::string where = path + ": coordinator";
    PENUMBRA_RETURN_IF_ERROR(CheckKeys(c, {"host", "port", "metrics_port", "admin_host", "args"}, where));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(c, "host", where, &t.host));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(c, "admin_host", where, &t.admin_host));
    PENUMBRA_RETURN_IF_ERROR(ReadPort(c, "port", where, 0, &t.port));
    PENUMBRA_RETURN_IF_ERROR(ReadPort(c, "metrics_port", where, -1, &t.metrics_port));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(c, "args", where, &t.coordinator_args));
  }
  const YAML::Node ws = root["workers"];
  if (!ws || !ws.IsSequence() || ws.size() == 0) return Status::InvalidArgument(path + ": workers must be a non-empty list");
  for (size_t i = 0; i < ws.size(); ++i) {
    const std::string where = path + ": workers[" + std::to_string(i) + "]";
    WorkerProcessSpec s;
    s.name = "w" + std::to_string(i);
    PENUMBRA_RETURN_IF_ERROR(CheckKeys(ws[i], {"name", "host", "port", "metrics_port", "admin_host", "args"}, where));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(ws[i], "name", where, &s.name));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(ws[i], "host", where, &s.host));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(ws[i], "admin_host", where, &s.admin_host));
    PENUMBRA_RETURN_IF_ERROR(ReadPort(ws[i], "port", where, 0, &s.port));
    PENUMBRA_RETURN_IF_ERROR(ReadPort(ws[i], "metrics_port", where, -1, &s.metrics_port));
    PENUMBRA_RETURN_IF_ERROR(ReadKey(ws[i], "args", where, &s.args));
    PENUMBRA_RETURN_IF_ERROR(CheckProcessName(t, where, s.name));
    t.workers.push_back(std::move(s));
  }
  if (const YAML::Node ns = root["store_nodes"]) {
    if (!ns.IsSequence()) return Status::InvalidArgument(path + ": store_nodes must be a list");
    for (size_t i = 0; i < ns.size(); ++i) {
      const std::string where = path + ": store_nodes[" + std::to_string(i) + "]";
      StoreNodeSpec s;
      s.name = "s" + std::to_string(i);
      PENUMBRA_RETURN_IF_ERROR(CheckKeys(ns[i], {"name", "host", "port", "path", "args"}, where));
      PENUMBRA_RETURN_IF_ERROR(ReadKey(ns[i], "name", where, &s.name));
      PENUMBRA_RETURN_IF_ERROR(ReadKey(ns[i], "host", where, &s.host));
      PENUMBRA_RETURN_IF_ERROR(ReadPort(ns[i], "port", where, 0, &s.port));
      PENUMBRA_RETURN_IF_ERROR(ReadKey(ns[i], "path", where, &s.path));
      PENUMBRA_RETURN_IF_ERROR(ReadKey(ns[i], "args", where, &s.args));
      if (s.path.empty()) return Status::InvalidArgument(where + ".path is required (the node's RocksDB directory)");
      PENUMBRA_RETURN_IF_ERROR(CheckProcessName(t, where, s.name));
      t.store_nodes.push_back(std::move(s));
    }
  }
  return t;
}

std::vector<std::string> SecurityArgs(const ServiceTopology& t, const std::string& name) {
  std::vector<std::string> args;
  if (!t.certs.empty()) {
    args = {"--tls-ca",  JoinPath(t.certs, "ca.pem"),   "--tls-cert",           JoinPath(t.certs, name + ".pem"),
            "--tls-key", JoinPath(t.certs, name + ".key"), "--cluster-secret-file", JoinPath(t.certs, "cluster.secret")};
  }
  if (t.insecure) args.push_back("--insecure");
  return args;
}

Status ServeCommand(int argc, char** argv) {
  Args a;
  a.Flag("config", "the service topology YAML (default configs/service.yaml)")
      .Flag("model", "override the topology's model")
      .Flag("data-dir", "override the topology's data_dir (batch jobs; \"\" = off)")
      .Flag("port", "override the coordinator's port (0: the OS picks)")
      .Flag("metrics-port", "override the coordinator's metrics port (0: the OS picks, -1: off)")
      .Flag("worker-args", "more flags for every worker, space-separated (e.g. \"--kv-policy shadowkv\"); "
                           "they replace the topology's same flags")
      .Flag("port-file", "write {\"port\": P, \"metrics_port\": M, \"pid\": N, \"restarts\": R, \"children\": "
                         "{NAME: {pid, port, state, restarts, ...}}} here once serving (P, M: the coordinator's; "
                         "rewritten whenever a process dies or comes back)")
      .Flag("run-dir", "logs and port files of the processes (default build/run/serve-PID)")
      .Flag("start-timeout-s", "how long each process may take to start (default 300)")
      .Flag("restart-backoff-ms", "a process that dies is restarted after this long, doubling at each death "
                                  "(default 1000)")
      .Flag("restart-backoff-max-ms", "the restart delay's cap: a process that keeps dying is retried this often "
                                      "(default 30000)")
      .Flag("restart-stable-s", "a process up this long restarts after --restart-backoff-ms again when it dies "
                                "(default 60)");
  PENUMBRA_RETURN_IF_ERROR(a.Parse(argc, argv, 2));
  PENUMBRA_ASSIGN_OR_RETURN(ServiceTopology t, LoadServiceTopology(a.Get("config", "configs/service.yaml")));
  if (a.Has("model")) t.model = a.Get("model");
  if (a.Has("data-dir")) t.data_dir = a.Get("data-dir");
  if (a.Has("port")) {
    PENUMBRA_ASSIGN_OR_RETURN(int64_t p, a.GetIntIn("port", 0, 0, 65535));
    t.port = static_cast<int>(p);
  }
  if (a.Has("metrics-port")) {
    PENUMBRA_ASSIGN_OR_RETURN(int64_t p, a.GetIntIn("metrics-port", 0, -1, 65535));
    t.metrics_port = static_cast<int>(p);
  }
  if (a.Has("worker-args")) {
    std::stringstream words(a.Get("worker-args"));
    std::string w;
    std::vector<std::string> extra;
    while (words >> w) extra.push_back(w);
    for (auto& spec : t.workers) spec.args = OverrideFlags(spec.args, extra);
  }
  PENUMBRA_ASSIGN_OR_RETURN(int64_t start_s, a.GetIntIn("start-timeout-s", 300, 1, 86400));
  const std::string dir = a.Get("run-dir", "build/run/serve-" + std::to_string(getpid()));
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IOError("cannot create " + dir + ": " + ec.message());
  const std::string bin = ExeDir();

  RestartPolicy policy;
  {
    PENUMBRA_ASSIGN_OR_RETURN(int64_t initial, a.GetIntIn("restart-backoff-ms", policy.initial.count(), 10, 3600000));
    PENUMBRA_ASSIGN_OR_RETURN(int64_t max, a.GetIntIn("restart-backoff-max-ms", policy.max.count(), initial, 3600000));
    PENUMBRA_ASSIGN_OR_RETURN(int64_t stable, a.GetIntIn("restart-stable-s", policy.stable.count() / 1000, 1, 86400));
    policy.initial = milliseconds(initial);
    policy.max = milliseconds(max);
    policy.stable = std::chrono::seconds(stable);
  }

  BlockTerminationSignals();  // the children start with a clean mask (Spawn)
  std::vector<Child> workers, nodes;
  workers.reserve(t.workers.size());
  nodes.reserve(t.store_nodes.size());
  Child coordinator;
  auto stop_all = [&] {
    StopChild(coordinator, milliseconds(35000));
    for (auto& w : workers) StopChild(w, milliseconds(35000));
    for (auto& n : nodes) StopChild(n, milliseconds(35000));
  };
  // Starts `c` the first time and waits until it serves; a restart reuses its
  // ports (what the OS picked now), which the others were given.
  auto first_start = [&](Child& c, milliseconds timeout) -> Status {
    PENUMBRA_RETURN_IF_ERROR(Spawn(c, false));
    PENUMBRA_RETURN_IF_ERROR(WaitServing(c, timeout));
    PinFlag(c.argv, "--port", c.port);
    if (c.metrics_port > 0) PinFlag(c.argv, "--metrics-port", c.metrics_port);
    return Status::OK();
  };
  // Value-store nodes first: the workers connect to them.
  std::string store_list;
  for (const StoreNodeSpec& s : t.store_nodes) {
    std::vector<std::string> argv = {bin + "/penumbra-store", "--path", s.path, "--host", s.host,
                                     "--port", std::to_string(s.port)};
    for (const std::string& f : SecurityArgs(t, s.name)) argv.push_back(f);
    argv.insert(argv.end(), s.args.begin(), s.args.end());
    nodes.push_back(MakeChild(s.name, "store node", s.host, std::move(argv), dir));
    if (Status st = first_start(nodes.back(), std::chrono::seconds(start_s)); !st.ok()) {
      stop_all();
      return st;
    }
    store_list += (store_list.empty() ? "" : ",") + s.host + ":" + std::to_string(nodes.back().port);
    std::fprintf(stderr, "serve: store node %s on %s:%d (%s), log %s\n", s.name.c_str(), s.host.c_str(),
                 nodes.back().port, s.path.c_str(), nodes.back().log.c_str());
  }
  for (const WorkerProcessSpec& s : t.workers) {
    std::vector<std::string> argv = {bin + "/penumbra-worker", "--model", t.model, "--name", s.name, "--host", s.host,
                                     "--port", std::to_string(s.port), "--metrics-port", std::to_string(s.metrics_port),
                                     "--admin-host", s.admin_host};
    if (!store_list.empty()) argv.insert(argv.end(), {"--store-node", store_list});
    for (const std::string& f : SecurityArgs(t, s.name)) argv.push_back(f);
    argv.insert(argv.end(), s.args.begin(), s.args.end());
    workers.push_back(MakeChild(s.name, "worker", s.host, std::move(argv), dir));
    if (Status st = Spawn(workers.back(), false); !st.ok()) {
      stop_all();
      return st;
    }
  }
  std::string list;
  for (auto& w : workers) {
    Status s = WaitServing(w, std::chrono::seconds(start_s));
    if (!s.ok()) {
      stop_all();
      return s;
    }
    PinFlag(w.argv, "--port", w.port);
    if (w.metrics_port > 0) PinFlag(w.argv, "--metrics-port", w.metrics_port);
    list += (list.empty() ? "" : ",") + w.name + "=" + w.host + ":" + std::to_string(w.port);
    std::fprintf(stderr, "serve: worker %s on %s:%d (metrics %d), log %s\n", w.name.c_str(), w.host.c_str(), w.port,
                 w.metrics_port, w.log.c_str());
  }
  std::vector<std::string> cargv = {bin + "/penumbra-coordinator", "--model", t.model, "--workers", list,
                                    "--host", t.host, "--port", std::to_string(t.port), "--metrics-port",
                                    std::to_string(t.metrics_port), "--admin-host", t.admin_host};
  if (!t.api_keys.empty()) cargv.insert(cargv.end(), {"--api-keys", t.api_keys});
  if (!t.tenants.empty()) cargv.insert(cargv.end(), {"--tenants", t.tenants});
  if (!t.data_dir.empty()) cargv.insert(cargv.end(), {"--data-dir", t.data_dir});
  for (const std::string& f : SecurityArgs(t, "coordinator")) cargv.push_back(f);
  cargv.insert(cargv.end(), t.coordinator_args.begin(), t.coordinator_args.end());
  coordinator = MakeChild("coordinator", "coordinator", t.host, std::move(cargv), dir);
  if (Status s = first_start(coordinator, milliseconds(60000)); !s.ok()) {
    stop_all();
    return s;
  }
  std::vector<Child*> all{&coordinator};
  for (auto& w : workers) all.push_back(&w);
  for (auto& n : nodes) all.push_back(&n);
  auto write_port_file = [&]() -> Status {
    if (!a.Has("port-file")) return Status::OK();
    return WriteServePortFile(a.Get("port-file"), coordinator, all);
  };
  if (Status s = write_port_file(); !s.ok()) {
    stop_all();
    return s;
  }
  std::fprintf(stderr,
               "serve: coordinator on %s:%d (metrics %d), log %s; SIGHUP reloads every process's configuration, "
               "Ctrl-C or SIGTERM stops everything; a process that dies is restarted (after %s, doubling up to %s)\n",
               t.host.c_str(), coordinator.port, coordinator.metrics_port, coordinator.log.c_str(),
               Seconds(policy.initial).c_str(), Seconds(policy.max).c_str());

  // Supervision, until SIGTERM or SIGINT: SIGHUP is passed to every child; a
  // child that dies is restarted by `policy` with the same arguments (ports
  // pinned), its log appended to.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  int stop_signal = 0;
  while (stop_signal == 0) {
    timespec tick{0, 100 * 1000 * 1000};
    const int sig = sigtimedwait(&set, nullptr, &tick);
    if (sig == SIGTERM || sig == SIGINT) {
      stop_signal = sig;
      break;
    }
    if (sig == SIGHUP) {
      std::string to;
      for (Child* c : all) {
        if (c->pid > 0 && kill(c->pid, SIGHUP) == 0) {
          to += (to.empty() ? "" : ", ") + c->name + " (pid " + std::to_string(c->pid) + ")";
        }
      }
      std::fprintf(stderr, "serve: SIGHUP: passed to %s; each rereads its configuration (see its log), nothing "
                   "stops; the topology itself is read only when serve starts\n",
                   to.empty() ? "no process (none running)" : to.c_str());
    }
    bool changed = false;
    const Clock::time_point now = Clock::now();
    for (Child* c : all) {
      if (c->pid > 0) {
        int st = 0;
        if (waitpid(c->pid, &st, WNOHANG) == c->pid) {
          OnChildDeath(*c, st, policy);
          changed = true;
        } else if (!c->serving) {
          const int pinned = c->port;
          if (ReadPortFile(*c)) {
            c->serving = true;
            changed = true;
            std::fprintf(stderr, "serve: %s %s serving again on %s:%d (pid %d, restart %d)%s\n", c->kind.c_str(),
                         c->name.c_str(), c->host.c_str(), c->port, static_cast<int>(c->pid), c->restarts,
                         pinned > 0 && pinned != c->port ? " -- NOT on its old port: the others still name that one"
                                                         : "");
          }
        }
      } else if (now >= c->restart_at) {
        ++c->restarts;
        std::ofstream(c->log, std::ios::app) << "---- penumbra serve: restart " << c->restarts << " of " << c->name
                                             << " at " << UtcNow() << " ----\n";
        if (Status s = Spawn(*c, true); !s.ok()) {
          std::fprintf(stderr, "serve: cannot restart %s %s: %s; trying again in %s\n", c->kind.c_str(),
                       c->name.c_str(), s.ToString().c_str(), Seconds(c->backoff).c_str());
          c->restart_at = now + c->backoff;
          c->backoff = std::min(policy.max, c->backoff * 2);
          continue;
        }
        std::fprintf(stderr, "serve: %s %s restarted (pid %d, restart %d), log %s\n", c->kind.c_str(),
                     c->name.c_str(), static_cast<int>(c->pid), c->restarts, c->log.c_str());
        changed = true;
      }
    }
    if (changed) {
      if (Status s = write_port_file(); !s.ok()) std::fprintf(stderr, "serve: %s\n", s.ToString().c_str());
    }
  }
  std::fprintf(stderr, "serve: signal %d: stopping (the coordinator, then the workers, each draining, then the store "
               "nodes)\n", stop_signal);
  stop_all();
  std::fprintf(stderr, "serve: stopped\n");
  return Status::OK();
}

}  // namespace penumbra
