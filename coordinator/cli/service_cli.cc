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

struct Child {
  std::string name;
  pid_t pid = -1;
  std::string log, port_file;
  int port = 0, metrics_port = -1;
};

Result<Child> Spawn(const std::string& name, std::vector<std::string> argv, const std::string& dir) {
  Child c;
  c.name = name;
  c.log = dir + "/" + name + ".log";
  c.port_file = dir + "/" + name + ".port";
  std::filesystem::remove(c.port_file);
  argv.insert(argv.end(), {"--port-file", c.port_file});
  PENUMBRA_ASSIGN_OR_RETURN(c.pid, SpawnProcess(argv, c.log));
  return c;
}

std::string Tail(const std::string& path, size_t bytes = 4000) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  std::string t = s.str();
  return t.size() > bytes ? "..." + t.substr(t.size() - bytes) : t;
}

// Waits until `c` wrote its port file; fails with its log when it exits first.
Status WaitServing(Child& c, milliseconds timeout) {
  const Clock::time_point until = Clock::now() + timeout;
  while (Clock::now() < until) {
    std::ifstream f(c.port_file);
    if (f) {
      try {
        nlohmann::json j = nlohmann::json::parse(f);
        c.port = j.at("port").get<int>();
        c.metrics_port = j.at("metrics_port").get<int>();
        return Status::OK();
      } catch (const std::exception&) {
      }
    }
    int st = 0;
    if (waitpid(c.pid, &st, WNOHANG) == c.pid) {
      c.pid = -1;
      return Status::Unavailable(c.name + " exited before serving; its log (" + c.log + "):\n" + Tail(c.log));
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
      .Flag("port-file", "write {\"port\": P, \"metrics_port\": M, \"pid\": N} of the coordinator here once serving")
      .Flag("run-dir", "logs and port files of the processes (default build/run/serve-PID)")
      .Flag("start-timeout-s", "how long each process may take to start (default 300)");
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

  BlockTerminationSignals();  // the children start with a clean mask (Spawn)
  std::vector<Child> workers, nodes;
  Child coordinator;
  auto stop_all = [&] {
    StopChild(coordinator, milliseconds(35000));
    for (auto& w : workers) StopChild(w, milliseconds(35000));
    for (auto& n : nodes) StopChild(n, milliseconds(35000));
  };
  // Value-store nodes first: the workers connect to them.
  std::string store_list;
  for (const StoreNodeSpec& s : t.store_nodes) {
    std::vector<std::string> argv = {bin + "/penumbra-store", "--path", s.path, "--host", s.host,
                                     "--port", std::to_string(s.port)};
    for (const std::string& f : SecurityArgs(t, s.name)) argv.push_back(f);
    argv.insert(argv.end(), s.args.begin(), s.args.end());
    Result<Child> c = Spawn(s.name, argv, dir);
    if (!c.ok()) {
      stop_all();
      return c.status();
    }
    nodes.push_back(*c);
    if (Status st = WaitServing(nodes.back(), std::chrono::seconds(start_s)); !st.ok()) {
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
    Result<Child> c = Spawn(s.name, argv, dir);
    if (!c.ok()) {
      stop_all();
      return c.status();
    }
    workers.push_back(*c);
  }
  std::string list;
  for (auto& w : workers) {
    Status s = WaitServing(w, std::chrono::seconds(start_s));
    if (!s.ok()) {
      stop_all();
      return s;
    }
    const auto& spec = t.workers[&w - workers.data()];
    list += (list.empty() ? "" : ",") + w.name + "=" + spec.host + ":" + std::to_string(w.port);
    std::fprintf(stderr, "serve: worker %s on %s:%d (metrics %d), log %s\n", w.name.c_str(), spec.host.c_str(), w.port,
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
  Result<Child> c = Spawn("coordinator", cargv, dir);
  if (!c.ok()) {
    stop_all();
    return c.status();
  }
  coordinator = *c;
  if (Status s = WaitServing(coordinator, std::chrono::seconds(60)); !s.ok()) {
    stop_all();
    return s;
  }
  if (a.Has("port-file")) {
    nlohmann::json j = {{"port", coordinator.port}, {"metrics_port", coordinator.metrics_port},
                        {"pid", static_cast<int64_t>(getpid())}};
    if (Status s = WriteFileAtomically(a.Get("port-file"), j.dump() + "\n"); !s.ok()) {
      stop_all();
      return s;
    }
  }
  std::fprintf(stderr, "serve: coordinator on %s:%d (metrics %d), log %s; Ctrl-C or SIGTERM stops everything\n",
               t.host.c_str(), coordinator.port, coordinator.metrics_port, coordinator.log.c_str());

  // Until a signal, or until a child dies (then everything stops: exit 1).
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  Status result = Status::OK();
  for (;;) {
    timespec tick{0, 200 * 1000 * 1000};
    if (sigtimedwait(&set, nullptr, &tick) > 0) break;
    bool died = false;
    for (Child* ch : [&] {
           std::vector<Child*> v{&coordinator};
           for (auto& w : workers) v.push_back(&w);
           for (auto& n : nodes) v.push_back(&n);
           return v;
         }()) {
      int st = 0;
      if (ch->pid > 0 && waitpid(ch->pid, &st, WNOHANG) == ch->pid) {
        ch->pid = -1;
        result = Status::Unavailable(ch->name + " exited unexpectedly; its log (" + ch->log + "):\n" + Tail(ch->log));
        died = true;
      }
    }
    if (died) break;
  }
  std::fprintf(stderr, "serve: stopping (the coordinator, then the workers, each draining, then the store nodes)\n");
  stop_all();
  return result;
}

}  // namespace penumbra
