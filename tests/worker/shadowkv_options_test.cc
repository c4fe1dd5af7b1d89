// ShadowKV's options from the command line (ApplyShadowKvFlags) and YAML
// (LoadShadowKvOptions): values reach the options, a flag that is not given
// leaves its option as it was, and an out-of-range or unknown value is an
// InvalidArgument naming the flag or key.
#include "worker/engine/shadowkv_options.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/docs_util.h"

namespace penumbra {
namespace {

Status Apply(std::vector<std::string> flags, ShadowKvOptions* o) {
  Args a;
  AddShadowKvFlags(a);
  flags.insert(flags.begin(), {"penumbra", "eval"});
  std::vector<char*> argv;
  for (std::string& f : flags) argv.push_back(f.data());
  PENUMBRA_RETURN_IF_ERROR(a.Parse(static_cast<int>(argv.size()), argv.data(), 2));
  return ApplyShadowKvFlags(a, o);
}

Status Load(const std::string& yaml, ShadowKvOptions* o) {
  PENUMBRA_ASSIGN_OR_RETURN(ConfigReader r, ConfigReader::FromString(yaml, "test.yaml"));
  return LoadShadowKvOptions(r, o);
}

TEST(ShadowKvOptionsTest, FlagsSetTheirOptionsAndLeaveTheOthers) {
  ShadowKvOptions o;
  o.budget_tokens = 1024;
  ASSERT_TRUE(Apply({"--chunk-size", "4", "--successor-chunks", "2", "--shard-selection", "local",
                     "--landmarks-per-chunk", "2", "--landmark-format", "model"},
                    &o)
                  .ok());
  EXPECT_EQ(o.landmark_format, "model");
  EXPECT_FALSE(o.landmark_fp8());
  EXPECT_EQ(o.chunk_size, 4);
  EXPECT_EQ(o.successor_chunks, 2);
  EXPECT_EQ(o.landmarks_per_chunk, 2);
  EXPECT_EQ(o.shard_selection, "local");
  EXPECT_EQ(o.budget_tokens, 1024);  // not given: unchanged
  EXPECT_EQ(o.rank, ShadowKvOptions{}.rank);
}

TEST(ShadowKvOptionsTest, BadFlagsAreRefusedNamingTheFlag) {
  for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{{"--shard-selection", "everywhere"},
                                                                                    {"--successor-chunks", "-1"},
                                                                                    {"--successor-chunks", "65"},
                                                                                    {"--continuation", "maybe"},
                                                                                    {"--micro-batches", "0"},
                                                                                    {"--landmarks-per-chunk", "3"},
                                                                                    {"--landmarks-per-chunk", "0"},
                                                                                    {"--landmarks-per-chunk", "32"},
                                                                                    {"--landmark-format", "fp4"}}) {
    ShadowKvOptions o;
    const Status st = Apply({flag, value}, &o);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << flag << " " << value << ": " << st;
    EXPECT_NE(st.message().find(flag), std::string::npos) << st;
  }
}

TEST(ShadowKvOptionsTest, YamlKeysAreReadAndCheckedAgainstTheModel) {
  ShadowKvOptions o;
  EXPECT_EQ(o.landmark_format, "fp8");  // the default
  EXPECT_TRUE(o.landmark_fp8());
  ASSERT_TRUE(Load("successor_chunks: 1\nshard_selection: local\nchunk_size: 4\nlandmarks_per_chunk: 4\n"
                   "landmark_format: model\n",
                   &o)
                  .ok());
  EXPECT_EQ(o.landmark_format, "model");
  EXPECT_EQ(o.successor_chunks, 1);
  EXPECT_EQ(o.landmarks_per_chunk, 4);
  EXPECT_EQ(o.shard_selection, "local");
  EXPECT_EQ(o.chunk_size, 4);
  EXPECT_TRUE(ValidateShadowKvOptions(o, 8, 128).ok());
  for (const std::string bad : {"shard_selection: sideways\n", "successor_chunks: 100\n", "landmarks_per_chunk: 17\n",
                                "no_such_key: 1\n", "landmark_format: int8\n"}) {
    ShadowKvOptions b;
    const Status st = Load(bad, &b);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find(bad.substr(0, bad.find(':'))), std::string::npos) << st;
  }
  ShadowKvOptions f;  // fp8 records take any head size on the CPU (CUDA: head_dim % 8, as for all of ShadowKV)
  f.landmark_format = "fp8";
  f.rank = 8;
  EXPECT_TRUE(ValidateShadowKvOptions(f, 8, 128).ok());
  EXPECT_TRUE(ValidateShadowKvOptions(f, 2, 4).ok());
  EXPECT_EQ(ValidateShadowKvOnDevice(f, 4, 2, 4, Device::kCUDA).code(), StatusCode::kInvalidArgument);
  ShadowKvOptions r;
  r.rank = 2000;  // over hkv * d = 1024
  EXPECT_EQ(ValidateShadowKvOptions(r, 8, 128).code(), StatusCode::kInvalidArgument);
  for (int lpc : {3, 16}) {  // not a power of two; more landmarks than the chunk's 8 keys
    ShadowKvOptions l;
    l.landmarks_per_chunk = lpc;
    const Status st = ValidateShadowKvOptions(l, 8, 128);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << lpc;
    EXPECT_NE(st.message().find("landmarks_per_chunk"), std::string::npos) << st;
  }
}

// What the kernels take, per device: a configuration the CUDA kernels cannot
// run is a typed error naming the limit when the engine starts, not a kernel's
// check failure (a rank of 1024 took an eval process down that way).
TEST(ShadowKvOptionsTest, DeviceLimitsAreTypedErrors) {
  const auto on = [](const ShadowKvOptions& o, Device dev, int hq = 32, int hkv = 8, int d = 128) {
    return ValidateShadowKvOnDevice(o, hq, hkv, d, dev);
  };
  const auto refused = [](const Status& st, const std::string& what) {
    return st.code() == StatusCode::kInvalidArgument && st.message().find(what) != std::string::npos;
  };
  ShadowKvOptions o;  // the defaults run everywhere
  EXPECT_TRUE(on(o, Device::kCPU).ok());
  EXPECT_TRUE(on(o, Device::kCUDA).ok());
  ShadowKvOptions r;
  r.rank = 1024;  // full rank: fine on the CPU, above the CUDA key rebuild's 512
  EXPECT_TRUE(ValidateShadowKvOptions(r, 8, 128).ok());
  EXPECT_TRUE(on(r, Device::kCPU).ok());
  EXPECT_TRUE(refused(on(r, Device::kCUDA), "shadowkv.rank 1024")) << on(r, Device::kCUDA);
  r.rank = 512;
  EXPECT_TRUE(on(r, Device::kCUDA).ok());
  ShadowKvOptions c;
  c.chunk_size = 128;
  c.landmarks_per_chunk = 1;
  EXPECT_TRUE(on(c, Device::kCPU).ok());
  EXPECT_TRUE(refused(on(c, Device::kCUDA), "shadowkv.chunk_size 128"));
  // The selection's 4096 chunks hold on both devices.
  ShadowKvOptions b;
  b.budget_tokens = 8 * kShadowKvMaxSelectedChunks;
  EXPECT_TRUE(on(b, Device::kCUDA).ok());
  b.budget_tokens += 8;
  EXPECT_TRUE(refused(on(b, Device::kCPU), "shadowkv.budget_tokens"));
  EXPECT_TRUE(refused(on(b, Device::kCUDA), "shadowkv.budget_tokens"));
  // Model geometry the CUDA scores do not take.
  EXPECT_TRUE(on(o, Device::kCPU, 128, 8).ok());
  EXPECT_TRUE(refused(on(o, Device::kCUDA, 128, 8), "128 over 8"));  // 16 query heads per KV head
  EXPECT_TRUE(refused(on(o, Device::kCUDA, 32, 8, 512), "head_dim"));
  EXPECT_TRUE(refused(on(o, Device::kCUDA, 32, 8, 100), "head_dim"));
}

// The operator's table of the options (docs/operations.md) is the option
// table's own Markdown: it cannot drift from what the flags and YAML take.
TEST(ShadowKvOptionsTest, TheDocsTableIsTheOptionTable) {
  EXPECT_TRUE(
      testing::GeneratedDocSectionIs("docs/operations.md", "shadowkv options", ShadowKvOptionTable().Markdown()));
}

}  // namespace
}  // namespace penumbra
