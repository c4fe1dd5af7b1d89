// penumbra: the command-line front end.
//   penumbra generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) ...   (offline, in this process)
//   penumbra eval --model DIR --tasks FILE.jsonl ...   (see coordinator/cli/eval.h)
//   penumbra serve | doc | ask | job | stats            (the service; coordinator/cli/service_cli.h)
// Errors (bad flags, bad model files, bad prompts) print one line naming what
// was wrong and exit with status 2 (usage) or 1 (everything else).
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/args.h"
#include "common/file.h"
#include "common/logging.h"
#include "coordinator/cli/eval.h"
#include "coordinator/cli/service_cli.h"
#include "coordinator/tokenizer/text_codec.h"
#include "transport/tls.h"
#include "worker/engine/engine.h"
#include "worker/engine/engine_flags.h"
#include "worker/parallel/context_group.h"

namespace penumbra {
namespace {

constexpr const char* kUsage =
    "usage: penumbra generate --model DIR (--prompt TEXT | --prompt-ids ID,...) [options]\n"
    "       penumbra eval --model DIR --tasks FILE.jsonl [options]\n"
    "       penumbra serve [--config configs/service.yaml]      a coordinator and its workers\n"
    "       penumbra doc put FILE [--name N] | doc ls | doc get ID | doc rm ID\n"
    "       penumbra ask --docs ID[,ID...] --question TEXT [options]   streams the answer\n"
    "       penumbra job submit FILE.jsonl [--detach] [--window-s N] [--metadata S]   a batch job\n"
    "       penumbra job status ID | job results ID [--out FILE] | job cancel ID | job ls | job rm ID\n"
    "       penumbra stats\n"
    "       penumbra cert init DIR [--topology F] [--hosts H,...]   a CA, a certificate per process, the cluster "
    "secret\n"
    "       penumbra cert issue DIR --role R --name N [--hosts H,...]   one more certificate from DIR's CA\n"
    "       penumbra tenant new-key                           a new API key and its sha256:... hash for tenants.yaml\n"
    "       penumbra tenant hash-key < KEYFILE                the sha256:... hash of a key read from stdin\n"
    "       (client commands: --address HOST:PORT, default $PENUMBRA_ADDRESS or 127.0.0.1:7700;\n"
    "        --api-key-file F or $PENUMBRA_API_KEY; --tls-ca CA for TLS)\n"
    "       penumbra help\n";

Status Generate(int argc, char** argv) {
  Args a;
  a.Flag("model", "Hugging Face model directory (config.json, *.safetensors, tokenizer.json)")
      .Flag("prompt", "prompt text (needs tokenizer.json)")
      .Flag("prompt-file", "read the prompt text from a file")
      .Flag("prompt-ids", "prompt as comma-separated token ids")
      .Flag("max-new-tokens", "tokens to generate (default 64)")
      .Switch("greedy", "greedy decoding (the default when no --temperature is given)")
      .Flag("temperature", "sampling temperature (default 0 = greedy)")
      .Flag("top-k", "top-k cut (default 0 = off)")
      .Flag("top-p", "nucleus cut (default 1 = off)")
      .Flag("seed", "sampling seed (default 0)")
      .Flag("stop-ids", "comma-separated ids that end generation (default: the model's eos ids)")
      .Switch("ignore-eos", "do not stop at the model's eos ids")
      .Switch("json", "print one JSON object instead of text");
  AddEngineFlags(a);
  // One sequence across processes (GPUs): docs/operations.md, "Context parallel";
  // the group's TLS certificates (role worker) and --insecure.
  AddContextGroupFlags(a);
  transport::AddSecurityFlags(a);
  Status ps = a.Parse(argc, argv, 2);
  if (!ps.ok()) return Status::InvalidArgument(ps.message() + "\n" + kUsage + "options:\n" + a.Help());
  PENUMBRA_ASSIGN_OR_RETURN(const transport::ProcessSecurity security, transport::SecurityFromFlags(a));
  if (!a.Has("model")) return Status::InvalidArgument(std::string("--model is required\n") + kUsage);
  const int given = a.Has("prompt") + a.Has("prompt-ids") + a.Has("prompt-file");
  if (given != 1) return Status::InvalidArgument("give exactly one of --prompt, --prompt-file, --prompt-ids");

  EngineOptions eo;
  PENUMBRA_RETURN_IF_ERROR(ApplyEngineFlags(a, &eo));
  GenerationRequest req;
  // Every sampling flag is range-checked here, naming the flag and its range;
  // the runtime checks the same ranges again for callers of the library.
  PENUMBRA_ASSIGN_OR_RETURN(int64_t max_new, a.GetIntIn("max-new-tokens", 64, 1, int64_t{1} << 30));
  req.max_new_tokens = static_cast<int>(max_new);
  PENUMBRA_ASSIGN_OR_RETURN(double temp, a.GetDoubleIn("temperature", 0.0, 0.0, SamplingOptions::kMaxTemperature));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t top_k, a.GetIntIn("top-k", 0, 0, INT32_MAX));
  PENUMBRA_ASSIGN_OR_RETURN(double top_p, a.GetDoubleIn("top-p", 1.0, 0.0, 1.0, /*lo_open=*/true));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t seed, a.GetIntIn("seed", 0, 0, INT64_MAX));
  if (a.Has("greedy") && a.Has("temperature"))
    return Status::InvalidArgument("--greedy and --temperature exclude each other");
  req.sampling = {a.Has("greedy") ? 0.0f : static_cast<float>(temp), static_cast<int>(top_k), static_cast<float>(top_p),
                  static_cast<uint64_t>(seed)};

  PENUMBRA_ASSIGN_OR_RETURN(auto codec, TextCodec::ForModel(a.Get("model")));
  if (a.Has("prompt-ids")) {
    PENUMBRA_ASSIGN_OR_RETURN(auto ids, a.GetIntList("prompt-ids"));
    for (int64_t id : ids) {
      if (id < 0 || id > INT32_MAX)
        return Status::InvalidArgument("--prompt-ids: id " + std::to_string(id) + " is out of range");
      req.prompt.push_back(static_cast<int32_t>(id));
    }
  } else {
    std::string text = a.Get("prompt");
    if (a.Has("prompt-file")) {
      PENUMBRA_ASSIGN_OR_RETURN(text, ReadFileToString(a.Get("prompt-file")));
    }
    PENUMBRA_ASSIGN_OR_RETURN(req.prompt, codec->Encode(text));
  }

  PENUMBRA_ASSIGN_OR_RETURN(auto engine, Engine::Open(a.Get("model"), eo));
  if (a.Has("stop-ids")) {
    PENUMBRA_ASSIGN_OR_RETURN(auto ids, a.GetIntList("stop-ids"));
    for (int64_t id : ids) {
      if (id < 0 || id > INT32_MAX)
        return Status::InvalidArgument("--stop-ids: id " + std::to_string(id) + " is out of range");
      req.stop_ids.push_back(static_cast<int32_t>(id));
    }
  } else if (!a.Has("ignore-eos")) {
    req.stop_ids = engine->config().eos_token_ids;
  }
  Runtime& rt = engine->runtime();
  PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<Collective> group, JoinContextGroup(a, &engine->backend(), security));
  if (group) PENUMBRA_RETURN_IF_ERROR(rt.SetContextGroup(group.get()));
  PENUMBRA_ASSIGN_OR_RETURN(auto results, rt.Generate({req}));
  const GenerationResult& g = results[0];
  PENUMBRA_ASSIGN_OR_RETURN(std::string text, codec->Decode(g.ids));
  const RunStats& st = rt.stats();
  // Decode throughput: tokens after the first (which comes from the prefill).
  const double decode_tps = st.decode_seconds > 0 ? (st.generated_tokens - 1) / st.decode_seconds : 0.0;
  if (a.Has("json")) {
    nlohmann::json j;
    j["ids"] = g.ids;
    j["text"] = text;
    j["finish_reason"] = g.finish_reason;
    j["prompt_tokens"] = st.prompt_tokens;
    j["generated_tokens"] = st.generated_tokens;
    j["prefill_seconds"] = st.prefill_seconds;
    j["decode_seconds"] = st.decode_seconds;
    j["tokens_per_s"] = decode_tps;
    j["device"] = engine->backend().name();
    j["dtype"] = std::string(DTypeName(engine->backend().act_dtype()));
    j["kv_policy"] = engine->options().kv_policy;
    if (group) {
      j["cp_rank"] = group->rank();
      j["cp_world"] = group->world();
    }
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
  } else {
    std::cout << text << "\n";
    std::fprintf(stderr,
                 "[%lld prompt tokens, %lld generated, prefill %.3f s, decode %.1f tokens/s on %s, kv policy %s]\n",
                 static_cast<long long>(st.prompt_tokens), static_cast<long long>(st.generated_tokens),
                 st.prefill_seconds, decode_tps, engine->backend().name().c_str(), engine->options().kv_policy.c_str());
  }
  return Status::OK();
}

std::vector<std::string> SplitCommaList(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    item = StripPythonWhitespace(item);
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

Status Eval(int argc, char** argv) {
  Args a;
  a.Flag("model", "Hugging Face model directory (config.json, *.safetensors, tokenizer.json)")
      .Flag("tasks", "task set, JSONL (docs/evalmodel.md, \"Records\")")
      .Flag("limit", "records per (task, length), the first in file order (default 0 = all)")
      .Flag("only-tasks", "comma-separated tasks to run (default: all)")
      .Flag("only-lengths", "comma-separated lengths to run (default: all)")
      .Flag("max-new-tokens", "override the records' max_new_tokens")
      .Flag("predictions", "write one JSON line per turn here (eval_hf.py's format)")
      .Switch("json", "print JSON lines (one per (task, length), then a summary) instead of a table")
      .Switch("segmented",
              "prefill each record's context first and continue it with the question "
              "(as a question about a cached document is served)");
  AddEngineFlags(a);
  Status ps = a.Parse(argc, argv, 2);
  if (!ps.ok()) return Status::InvalidArgument(ps.message() + "\n" + kUsage + "options:\n" + a.Help());
  if (!a.Has("model") || !a.Has("tasks")) {
    return Status::InvalidArgument(std::string("--model and --tasks are required\n") + kUsage);
  }
  EngineOptions eo;
  PENUMBRA_RETURN_IF_ERROR(ApplyEngineFlags(a, &eo));
  EvalSelection sel;
  PENUMBRA_ASSIGN_OR_RETURN(sel.limit, a.GetIntIn("limit", 0, 0, INT64_MAX));
  if (a.Has("only-tasks")) sel.tasks = SplitCommaList(a.Get("only-tasks"));
  if (a.Has("only-lengths")) {
    PENUMBRA_ASSIGN_OR_RETURN(sel.lengths, a.GetIntList("only-lengths"));
  }
  EvalRunOptions ro;
  ro.progress = true;
  PENUMBRA_ASSIGN_OR_RETURN(int64_t max_new, a.GetIntIn("max-new-tokens", 0, 1, 1 << 20));
  ro.max_new_tokens = static_cast<int>(max_new);

  // The whole task file is validated before the model is loaded.
  PENUMBRA_ASSIGN_OR_RETURN(auto all_records, LoadEvalRecords(a.Get("tasks")));
  const std::vector<EvalRecord> records = SelectEvalRecords(all_records, sel);
  if (records.empty()) return Status::InvalidArgument(a.Get("tasks") + ": no records selected");
  const std::string tok_path = JoinPath(a.Get("model"), "tokenizer.json");
  if (!FileExists(tok_path)) return Status::InvalidArgument("penumbra eval needs " + tok_path);
  PENUMBRA_ASSIGN_OR_RETURN(auto tokenizer, Tokenizer::FromFile(tok_path));
  PENUMBRA_ASSIGN_OR_RETURN(auto engine, Engine::Open(a.Get("model"), eo));
  Runtime& rt = engine->runtime();
  PENUMBRA_ASSIGN_OR_RETURN(auto runner, EvalRunner::Create(&rt, tokenizer.get(), engine->config().eos_token_ids));
  runner->SetSegmented(a.Has("segmented"));
  PENUMBRA_ASSIGN_OR_RETURN(auto encoded, EncodeEvalRecords(*runner, records));

  std::ofstream pred;
  if (a.Has("predictions")) {
    pred.open(a.Get("predictions"), std::ios::out | std::ios::trunc);
    if (!pred) return Status::IOError("cannot write " + a.Get("predictions"));
  }
  PENUMBRA_ASSIGN_OR_RETURN(EvalSummary sum, RunEval(*runner, encoded, ro, a.Has("predictions") ? &pred : nullptr));
  if (pred.is_open()) {
    pred.close();
    if (!pred) return Status::IOError("writing " + a.Get("predictions") + " failed");
  }

  const std::string policy = engine->options().kv_policy;
  const bool sparse = policy == "shadowkv";
  // Policies whose selected rows stay in slots across steps: their hit rate
  // (specontext's: the overlap of adjacent steps' selections).
  const bool slots = sparse || policy == "specontext";
  const ShadowKvOptions& so = engine->options().shadowkv;
  const PolicyStats ps_stats = rt.policy().stats();
  const std::string device = engine->backend().name();
  const std::string dtype(DTypeName(engine->backend().act_dtype()));
  if (a.Has("json")) {
    for (const EvalGroup& g : sum.groups) std::cout << GroupLineJson(g, policy) << "\n";
    // The overall accuracy and what was run: one line names a comparison's run.
    const EvalOverall overall = OverallOf(sum);
    nlohmann::ordered_json j;
    j["summary"] = true;
    j["accuracy"] = overall.accuracy_percent;
    nlohmann::ordered_json per_task = nlohmann::ordered_json::object();
    for (const auto& [task, pct] : overall.per_task_percent) per_task[task] = pct;
    j["per_task"] = per_task;
    j["model"] = a.Get("model");
    j["lengths"] = overall.lengths;
    j["tasks_file"] = a.Get("tasks");
    j["records"] = sum.records;
    j["turns"] = sum.turns;
    j["seconds"] = sum.seconds;
    j["device"] = device;
    j["dtype"] = dtype;
    j["kv_policy"] = policy;
    // ShadowKV settings (null under full attention).
    auto opt = [&](auto v) { return sparse ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr); };
    j["rank"] = opt(so.rank);
    j["chunk_size"] = opt(so.chunk_size);
    j["budget_tokens"] = opt(so.budget_tokens);
    j["budget_fraction"] = opt(so.budget_fraction);
    j["outliers"] = opt(so.outlier_chunks);
    j["outlier_fraction"] = opt(so.outlier_fraction);
    j["local_window"] = opt(so.local_window);
    j["successor_chunks"] = opt(so.successor_chunks);
    j["landmarks_per_chunk"] = opt(so.landmarks_per_chunk);
    j["landmark_format"] = opt(so.landmark_format);
    j["value_format"] = opt(so.value_format);
    j["min_prompt"] = opt(so.min_prompt_tokens);
    j["segmented"] = a.Has("segmented");
    j["continuation"] = opt(so.continuation);
    j["continuation_budget_tokens"] = opt(so.continuation_budget_tokens);
    j["continuation_auto_max_tokens"] = opt(so.continuation_auto_max_tokens);
    j["hit_rate"] = slots && ps_stats.selected_chunks > 0 ? nlohmann::ordered_json(ps_stats.hit_rate())
                                                          : nlohmann::ordered_json(nullptr);
    j["selected_chunks"] = ps_stats.selected_chunks;
    j["hit_chunks"] = ps_stats.hit_chunks;
    j["sparse_continuations"] = ps_stats.sparse_continuations;
    j["dense_continuations"] = ps_stats.dense_continuations;
    // SpindleKV settings (null under the other policies).
    const SpindleKvOptions& sk = engine->options().spindlekv;
    const bool spindle = policy == "spindlekv";
    auto sopt = [&](auto v) { return spindle ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr); };
    j["reserve_ratio"] = sopt(sk.reserve_ratio);
    j["min_ratio"] = sopt(sk.min_ratio);
    j["window"] = sopt(sk.window);
    j["pool"] = sopt(sk.pool);
    j["key_threshold"] = sopt(sk.key_threshold);
    j["value_threshold"] = sopt(sk.value_threshold);
    j["codebook_block"] = sopt(sk.codebook_block);
    j["merge_window"] = sopt(sk.merge_window);
    // SpeContext settings (null under the other policies).
    const SpeContextOptions& sc = engine->options().specontext;
    const bool spe = policy == "specontext";
    auto copt = [&](auto v) { return spe ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr); };
    j["specontext_budget"] = copt(sc.budget);
    j["specontext_local"] = copt(sc.local);
    j["specontext_observe"] = copt(sc.observe);
    j["specontext_successors"] = copt(sc.successors);
    j["specontext_head"] = copt(sc.head.empty() ? std::string("model") : sc.head);
    j["specontext_device_layers"] = copt(sc.device_layers);
    j["specontext_yarn_factor"] = copt(sc.yarn_factor);
    j["kv_bytes_ratio"] =
        ps_stats.kv_exact_bytes > 0
            ? nlohmann::ordered_json(static_cast<double>(ps_stats.kv_kept_bytes) / ps_stats.kv_exact_bytes)
            : nlohmann::ordered_json(nullptr);
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
  } else {
    std::printf("%-18s %8s %6s %9s %8s\n", "task", "length", "n", "accuracy", "partial");
    for (const EvalGroup& g : sum.groups) {
      const double n = static_cast<double>(g.n);
      std::printf("%-18s %8lld %6lld %9.4f %8.4f\n", g.task.c_str(), static_cast<long long>(g.length),
                  static_cast<long long>(g.n), g.correct / n, g.partial_sum / n);
    }
    std::printf("%lld records, %lld turns in %.1f s on %s (%s), kv policy %s", static_cast<long long>(sum.records),
                static_cast<long long>(sum.turns), sum.seconds, device.c_str(), dtype.c_str(), policy.c_str());
    if (slots && ps_stats.selected_chunks > 0) {
      std::printf(", %s hit rate %.4f (%lld of %lld)", sparse ? "chunk" : "row", ps_stats.hit_rate(),
                  static_cast<long long>(ps_stats.hit_chunks), static_cast<long long>(ps_stats.selected_chunks));
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  return Status::OK();
}

}  // namespace
}  // namespace penumbra

int main(int argc, char** argv) {
  penumbra::InitLogging(argv[0]);
  if (argc < 2 || std::string(argv[1]) == "help" || std::string(argv[1]) == "--help") {
    std::cout << penumbra::kUsage;
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  penumbra::Status s;
  if (cmd == "generate") {
    s = penumbra::Generate(argc, argv);
  } else if (cmd == "eval") {
    s = penumbra::Eval(argc, argv);
  } else if (cmd == "serve") {
    s = penumbra::ServeCommand(argc, argv);
  } else if (cmd == "doc") {
    s = penumbra::DocCommand(argc, argv);
  } else if (cmd == "ask") {
    s = penumbra::AskCommand(argc, argv);
  } else if (cmd == "job") {
    s = penumbra::JobCommand(argc, argv);
  } else if (cmd == "stats") {
    s = penumbra::StatsCommand(argc, argv);
  } else if (cmd == "cert") {
    s = penumbra::CertCommand(argc, argv);
  } else if (cmd == "tenant") {
    s = penumbra::TenantCommand(argc, argv);
  } else {
    std::cerr << "penumbra: unknown command '" << cmd << "'\n" << penumbra::kUsage;
    return 2;
  }
  if (!s.ok()) {
    std::cerr << "penumbra: " << s.ToString() << std::endl;
    return s.code() == penumbra::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}
