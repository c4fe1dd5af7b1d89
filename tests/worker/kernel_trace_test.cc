// KernelTrace::Write (the file format ops/trace_summary.py reads) and the
// refusals that need no GPU.
#include "worker/bench/kernel_trace.h"

#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/worker/model_test_util.h"

namespace penumbra {
namespace {

TEST(KernelTrace, WritesOneJsonLinePerRecord) {
  testing::TempDir dir;
  std::vector<TraceRecord> recs(3);
  recs[0] = {TraceRecord::Kind::kKernel, "penumbra::kernels::FetchVKernel", 1000, 5000, 14, 0, 32, 256};
  recs[1] = {TraceRecord::Kind::kMemcpy, "HtoD", 2000, 2500, 13, 4096, 0, 0};
  recs[2] = {TraceRecord::Kind::kMemset, "memset", 6000, 6100, 13, 64, 0, 0};
  ASSERT_TRUE(KernelTrace::Write(recs, dir.File("t.jsonl")).ok());
  std::ifstream f(dir.File("t.jsonl"));
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(f, line);) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0]["kind"], "kernel");
  EXPECT_EQ(lines[0]["name"], "penumbra::kernels::FetchVKernel");
  EXPECT_EQ(lines[0]["start_ns"], 1000);
  EXPECT_EQ(lines[0]["end_ns"], 5000);
  EXPECT_EQ(lines[0]["stream"], 14);
  EXPECT_EQ(lines[0]["blocks"], 32);
  EXPECT_EQ(lines[0]["threads"], 256);
  EXPECT_FALSE(lines[0].contains("bytes"));
  EXPECT_EQ(lines[1]["kind"], "memcpy");
  EXPECT_EQ(lines[1]["bytes"], 4096);
  EXPECT_FALSE(lines[1].contains("blocks"));
  EXPECT_EQ(lines[2]["kind"], "memset");
}

TEST(KernelTrace, UnwritablePathIsAnError) {
  const Status st = KernelTrace::Write({}, "/nonexistent-dir/trace.jsonl");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("/nonexistent-dir/trace.jsonl"), std::string::npos) << st;
}

}  // namespace
}  // namespace penumbra
