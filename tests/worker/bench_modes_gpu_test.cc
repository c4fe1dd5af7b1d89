// Every penumbra-bench mode that has a CPU test, run on the CUDA backend: the
// real binary (beside this one, as in build/bin and in the device bundle) with
// a small bf16 model, each run's exit status, its JSON line and the fields a
// measurement of that mode must carry. The benchmarks are run on the GPU only
// by hand otherwise, so a path that works on the CPU and aborts on CUDA (a
// cached full-attention document's question once did) would go unseen.
// Skips without a GPU.
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/gpu_test_util.h"

namespace penumbra {
namespace {

namespace fs = std::filesystem;

// A small Llama-shaped model (head_dim 128, GQA 2) with random weights.
constexpr const char* kShape =
    " --device cuda --dtype bf16 --layers 2 --hidden 512 --ffn 1024 --heads 4 --kv-heads 2 --head-dim 128"
    " --vocab 1000";
constexpr const char* kShadowKv = " --kv-policy shadowkv --rank 64 --budget 256 --outliers 4";
constexpr int64_t kContext = 4096;

struct Mode {
  const char* name;
  std::string args;  // the mode and its flags (the shape is added)
  // Fields one line of the output must have with these values.
  nlohmann::json expect;
};

std::string Ctx() { return " --context " + std::to_string(kContext); }

std::vector<Mode> Modes() {
  const std::string ttft = "ttft" + Ctx() + " --question 64";
  const nlohmann::json cached = {{"cached_prompt_tokens", kContext}};
  return {
      {"DecodeSweep",
       "decode" + Ctx() + " --batch 4 --steps 6 --lanes 2 --batch-sweep 2,4 --hit-rates natural,0.6" + kShadowKv,
       {{"mode", "decode"}, {"batch", 4}, {"force_hit_rate", 0.6}}},
      {"DecodeFp8Values",
       "decode" + Ctx() + " --batch 2 --steps 4 --value-format fp8" + kShadowKv,
       {{"mode", "decode"}, {"batch", 2}, {"value_format", "fp8"}}},
      {"DecodeFull",
       "decode" + Ctx() + " --batch 2 --steps 4 --kv-policy full",
       {{"mode", "decode"}, {"batch", 2}, {"kv_policy", "full"}}},
      {"DecodeSpindleKv",
       "decode" + Ctx() + " --batch 2 --steps 4 --kv-policy spindlekv --spindlekv-ratio 0.2",
       {{"mode", "decode"}, {"batch", 2}, {"kv_policy", "spindlekv"}, {"merge_window", 1024}}},
      {"Prefill", "prefill" + Ctx() + " --kv-policy full --prefill-chunk 1024", {{"mode", "prefill"}}},
      {"TtftFullOff", ttft + " --kv-policy full --cache off", {{"cached_prompt_tokens", 0}}},
      {"TtftFullHbm", ttft + " --kv-policy full --cache hbm", cached},
      {"TtftFullDisk", ttft + " --kv-policy full --cache disk --store-dir {dir}/store", cached},
      {"TtftShadowKvOff", ttft + " --cache off" + kShadowKv, {{"cached_prompt_tokens", 0}}},
      {"TtftShadowKvHbm",
       ttft + " --cache hbm" + kShadowKv,
       {{"cached_prompt_tokens", kContext}, {"continuation_used", "sparse"}}},  // auto, for a question
      {"TtftShadowKvDenseHbm",
       ttft + " --cache hbm --continuation dense" + kShadowKv,
       {{"cached_prompt_tokens", kContext}, {"continuation_used", "dense"}}},
      {"TtftShadowKvSparseHbm",
       ttft + " --cache hbm --continuation sparse" + kShadowKv,
       {{"cached_prompt_tokens", kContext}, {"continuation", "sparse"}}},
      {"TtftShadowKvDisk", ttft + " --cache disk --store-dir {dir}/store" + kShadowKv, cached},
      {"TtftShadowKvFp8Disk",
       ttft + " --cache disk --store-dir {dir}/store --value-format fp8" + kShadowKv,
       {{"cached_prompt_tokens", kContext}, {"value_format", "fp8"}}},
      {"SharedShadowKv",
       "shared" + Ctx() + " --batch 3 --question 16 --steps 4" + kShadowKv,
       {{"batch", 3}, {"shared_document", true}}},
      {"SharedFull",
       "shared" + Ctx() + " --batch 3 --question 16 --steps 4 --kv-policy full",
       {{"batch", 3}, {"shared_document", true}}},
  };
}

class BenchModesGpuTest : public ::testing::TestWithParam<Mode> {};

// Runs COMMAND through the shell; its stdout and stderr, and its exit status.
std::string RunCommand(const std::string& command, int* status) {
  std::string out;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) {
    *status = -1;
    return out;
  }
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int w = pclose(p);
  *status = WIFEXITED(w) ? WEXITSTATUS(w) : -1;
  return out;
}

// penumbra-bench, built beside this test (build/bin, the device bundle's bin/).
fs::path BenchPath() { return fs::read_symlink("/proc/self/exe").parent_path() / "penumbra-bench"; }

bool Has(const nlohmann::json& line, const nlohmann::json& expect) {
  for (const auto& [key, value] : expect.items()) {
    if (!line.contains(key) || line[key] != value) return false;
  }
  return true;
}

TEST_P(BenchModesGpuTest, RunsAndMeasures) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  const Mode& m = GetParam();
  const fs::path bench = BenchPath();
  ASSERT_TRUE(fs::exists(bench)) << bench << " (built beside this test)";
  const fs::path dir = fs::path(::testing::TempDir()) / ("bench_modes_" + std::string(m.name));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::string args = m.args;
  for (size_t at; (at = args.find("{dir}")) != std::string::npos;) args.replace(at, 5, dir.string());
  int status = 0;
  const std::string out = RunCommand(bench.string() + " " + args + kShape, &status);
  ASSERT_EQ(status, 0) << out;
  std::istringstream lines(out);
  bool found = false;
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != '{') continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    ASSERT_FALSE(j.is_discarded()) << line;
    EXPECT_FALSE(j.contains("error")) << line;
    EXPECT_NE(j.value("gpu", "cpu"), "cpu") << line;  // measured on the GPU
    found = found || Has(j, m.expect);
  }
  EXPECT_TRUE(found) << "no line with " << m.expect.dump() << " in:\n" << out;
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(EveryMode, BenchModesGpuTest, ::testing::ValuesIn(Modes()),
                         [](const ::testing::TestParamInfo<Mode>& i) { return std::string(i.param.name); });

// --kernel-trace on CUDA: the trace file gets the timed steps' (decode) or
// the timed question's (ttft) kernels, and the line names it.
TEST(BenchModesGpu, KernelTraceWritesKernels) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  const fs::path bench = BenchPath();
  const fs::path trace = fs::path(::testing::TempDir()) / "bench_modes_trace.jsonl";
  for (const std::string mode : {"decode --batch 2 --steps 2", "ttft --question 64 --cache hbm"}) {
    SCOPED_TRACE(mode);
    fs::remove(trace);
    int status = 0;
    const std::string out = RunCommand(
        bench.string() + " " + mode + Ctx() + kShadowKv + " --kernel-trace " + trace.string() + kShape, &status);
    ASSERT_EQ(status, 0) << out;
    EXPECT_NE(out.find("\"kernel_trace\":\"" + trace.string() + "\""), std::string::npos) << out;
    std::ifstream in(trace);
    int kernels = 0;
    for (std::string line; std::getline(in, line);) kernels += line.find("\"kind\":\"kernel\"") != std::string::npos;
    EXPECT_GT(kernels, 0) << "no kernel records in " << trace << "; the run said:\n" << out;
  }
  fs::remove(trace);
}

}  // namespace
}  // namespace penumbra
