// `penumbra doc|tenant|ask|stats` (service_cli.h); `penumbra job` is in
// job_cli.cc, `penumbra serve` in serve_cli.cc.
#include "coordinator/cli/service_cli.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "common/args.h"
#include "common/file.h"
#include "coordinator/cli/client_flags.h"
#include "coordinator/client/client.h"
#include "coordinator/tenants/tenants.h"

namespace penumbra {
using cli::AddClientFlags;
using cli::ConnectFromFlags;
using cli::Positional;

namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

const char* StateName(rpc::DocumentState::type s) {
  switch (s) {
    case rpc::DocumentState::FACTORING:
      return "factoring";
    case rpc::DocumentState::READY:
      return "ready";
    case rpc::DocumentState::FAILED:
      return "failed";
  }
  return "?";
}

nlohmann::json ToJson(const rpc::DocumentInfo& d) {
  nlohmann::json j = {{"id", d.id},
                      {"name", d.name},
                      {"tokens", d.tokens},
                      {"state", StateName(d.state)},
                      {"worker", d.worker},
                      {"factor_seconds", d.factor_seconds},
                      {"created_unix_ms", d.created_unix_ms}};
  if (d.__isset.error) j["error"] = d.error;
  if (!d.kv_policy.empty()) j["kv_policy"] = d.kv_policy;
  return j;
}

nlohmann::json ToJson(const rpc::Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"cached_prompt_tokens", u.cached_prompt_tokens},
          {"generated_tokens", u.generated_tokens},
          {"queue_seconds", u.queue_seconds},
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

Status DocPut(int argc, char** argv) {
  Args a;
  a.Flag("name", "the document's name (default: the file's name)")
      .Flag("ids", "the document as comma-separated token ids instead of a file")
      .Flag("kv-policy",
            "hold the document (and its questions) under this KV policy: full, shadowkv, spindlekv or specontext")
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
      if (id < 0 || id > INT32_MAX)
        return Status::InvalidArgument("--ids: id " + std::to_string(id) + " is out of range");
      ids.push_back(static_cast<int32_t>(id));
    }
  }
  const std::string name = a.Get("name", file.empty() ? "ids" : std::filesystem::path(file).filename().string());
  PENUMBRA_ASSIGN_OR_RETURN(auto c, ConnectFromFlags(a));
  const Clock::time_point t0 = Clock::now();
  const bool tty = isatty(2);
  std::function<void(const rpc::DocumentInfo&)> progress;
  if (!a.Has("json") && !a.Has("no-wait")) progress = [&](const rpc::DocumentInfo& d) { ShowProgress(d, t0, tty); };
  PENUMBRA_ASSIGN_OR_RETURN(rpc::DocumentInfo d,
                            c->PutDocument(name, file.empty() ? nullptr : &text, file.empty() ? &ids : nullptr,
                                           !a.Has("no-wait"), milliseconds(0), progress, a.Get("kv-policy", "")));
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
    std::fprintf(stderr,
                 "line 1: the key (give it to the tenant, e.g. in a file for --api-key-file; it is not "
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
    return Status::InvalidArgument(
        "penumbra tenant hash-key takes the key on stdin, not as an argument "
        "(e.g. `penumbra tenant hash-key < key.txt`)\n" +
        usage);
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
    return Status::InvalidArgument(
        "usage: penumbra doc put FILE [--name N] | ls | get ID | rm ID [--address A] [--api-key-file F] [--tls-ca CA]");
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
      .Flag("kv-policy", "run on workers of this KV policy only: full, shadowkv, spindlekv or specontext")
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
      if (id < 0 || id > INT32_MAX)
        return Status::InvalidArgument("--question-ids: id " + std::to_string(id) + " is out of range");
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
      if (id < 0 || id > INT32_MAX)
        return Status::InvalidArgument("--stop-ids: id " + std::to_string(id) + " is out of range");
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
    nlohmann::json j = {{"request_id", g.request_id}, {"text", g.text},   {"finish_reason", g.finish_reason},
                        {"usage", ToJson(g.usage)},   {"seconds", total}, {"tokens_per_s", decode_tps}};
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
  nlohmann::json j = {{"requests", s.requests},
                      {"requests_failed", s.requests_failed},
                      {"requests_running", s.requests_running},
                      {"documents", s.documents},
                      {"prompt_tokens", s.prompt_tokens},
                      {"cached_prompt_tokens", s.cached_prompt_tokens},
                      {"generated_tokens", s.generated_tokens}};
  // The workers are shown to an admin tenant (or without authentication).
  if (!s.workers.empty()) {
    nlohmann::json workers = nlohmann::json::array();
    for (const auto& w : s.workers) {
      nlohmann::json o = {{"name", w.name},           {"address", w.address}, {"healthy", w.healthy},
                          {"kv_policy", w.kv_policy}, {"backend", w.backend}, {"running", w.running},
                          {"documents", w.documents}};
      if (w.__isset.error) o["error"] = w.error;
      if (w.__isset.capacity_limit) {
        o["capacity"] = {{"context_tokens", w.capacity_context_tokens},
                         {"sequences", w.capacity_sequences},
                         {"limit", w.capacity_limit}};
      }
      if (w.__isset.last_wait_reason) o["last_wait_reason"] = w.last_wait_reason;
      if (w.__isset.group) {
        o["group"] = w.group;
        o["group_rank"] = w.group_rank;
        o["group_state"] = w.group_state;
      }
      workers.push_back(std::move(o));
    }
    j["workers"] = std::move(workers);
  }
  std::cout << (a.Has("json") ? j.dump() : j.dump(2)) << std::endl;
  return Status::OK();
}

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

}  // namespace penumbra
