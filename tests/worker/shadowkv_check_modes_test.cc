// The independent check's modes on the CPU backend (f32): a document taken,
// exported, imported and attached decodes exactly as the prompt it was
// (attached == direct, bit for bit); two context-parallel ranks with the
// global selection select what one sequence selects and attend to the same
// output up to float rounding (cp2 ~ direct, where sharding changes neither
// the factors nor the outliers); unknown modes and inputs cp2 cannot hold
// are clear InvalidArguments. Also the LockstepGroup the cp2 ranks exchange
// through.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/worker/shadowkv_check_test_util.h"
#include "worker/bench/lockstep_group.h"
#include "worker/bench/shadowkv_check.h"
#include "worker/model/safetensors.h"

namespace penumbra::shadowkv_check {
namespace {

using testing::MakeInputs;
using testing::SynthOptions;

Result<CheckResults> RunCpu(const CheckInputs& in, const std::string& mode) {
  BackendOptions bo;
  bo.device = "cpu";
  PENUMBRA_ASSIGN_OR_RETURN(auto backend, CreateBackend(bo));
  return RunShadowkvCheck(in, *backend, mode);
}

// Structured keys with planted outlier chunks, queries aimed at tokens.
SynthOptions Structured() {
  SynthOptions o;  // hkv 2, group 2, d 64, chunk 8, W 16
  o.seq = 400;     // 48 chunks, tail 16
  o.outliers = 2;
  o.odd_chunks = {5, 30};
  o.budget = 8 * 7;  // kslots 7
  o.steps = 4;
  o.structured = true;
  return o;
}

// The max over elements of |a - b| / (|b| + floor), and whether the
// non-finite entries agree.
double MaxRel(const std::vector<float>& a, const std::vector<float>& b, double floor) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(b[i])) {
      if (a[i] != b[i]) return INFINITY;
      continue;
    }
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]) / (std::abs(static_cast<double>(b[i])) + floor));
  }
  return worst;
}

// Low rank, a partial budget, outliers: the attached document's decode is
// the prompt's, bit for bit (the same values read through the prefix).
TEST(ShadowkvCheckModes, AttachedEqualsDirectExactly) {
  SynthOptions o = Structured();
  o.rank = 24;
  const CheckInputs in = MakeInputs(o);
  auto direct = RunCpu(in, "direct");
  ASSERT_TRUE(direct.ok()) << direct.status();
  auto attached = RunCpu(in, "attached");
  ASSERT_TRUE(attached.ok()) << attached.status();
  EXPECT_EQ(direct->mode, "direct");
  EXPECT_EQ(attached->mode, "attached");
  EXPECT_EQ(attached->landmarks, direct->landmarks);
  EXPECT_EQ(attached->outlier_ids, direct->outlier_ids);
  EXPECT_EQ(attached->selected, direct->selected);
  EXPECT_EQ(attached->scores, direct->scores);
  EXPECT_EQ(attached->out, direct->out);
  EXPECT_EQ(direct->outlier_ids, (std::vector<int32_t>{5, 30, 5, 30}));
}

// Full rank (rank = hkv*d: each shard's factors rebuild its keys as the
// whole sequence's do) and one planted outlier in each shard's half (each
// shard keeps round(share * 2) = 1): the ranks' global selection is the
// sequence's and the merged attention its output, up to rounding.
TEST(ShadowkvCheckModes, Cp2EqualsDirectUpToRounding) {
  const CheckInputs in = MakeInputs(Structured());  // rank 128 = hkv*d
  auto direct = RunCpu(in, "direct");
  ASSERT_TRUE(direct.ok()) << direct.status();
  auto cp = RunCpu(in, "cp2");
  ASSERT_TRUE(cp.ok()) << cp.status();
  EXPECT_EQ(cp->mode, "cp2");
  // Runtime::ShardOf: the boundary at 400 / 2 rounded down to 64 tokens.
  EXPECT_EQ(cp->shard_bounds, (std::vector<int64_t>{0, 192, 400}));
  EXPECT_EQ(cp->outlier_ids, direct->outlier_ids);
  EXPECT_EQ(cp->selected, direct->selected);
  EXPECT_LE(MaxRel(cp->landmarks, direct->landmarks, 1e-3), 1e-6);
  EXPECT_LE(MaxRel(cp->scores, direct->scores, 1e-6), 1e-5);
  double num = 0, den = 0;
  for (size_t i = 0; i < cp->out.size(); ++i) {
    num += std::pow(static_cast<double>(cp->out[i]) - direct->out[i], 2);
    den += std::pow(static_cast<double>(direct->out[i]), 2);
  }
  EXPECT_LE(std::sqrt(num / den), 1e-5) << "relative L2 error of the merged attention";

  // The results file names the mode and the shards (the comparator runs the
  // sharded reference for them).
  const std::string path = ::testing::TempDir() + "/skvmodes_cp2.safetensors";
  ASSERT_TRUE(WriteResults(*cp, path).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->metadata().at("mode"), "cp2");
  EXPECT_EQ(f->metadata().at("shards"), "0,192,400");
  EXPECT_EQ(f->Find("outliers")->shape, (std::vector<int64_t>{2, 2}));
  std::remove(path.c_str());
}

// Low rank (each shard's factors differ from the sequence's): cp2 still
// keeps each shard's planted outliers, selects the budget from both shards
// and writes finite outputs (the GPU test's inputs).
TEST(ShadowkvCheckModes, Cp2AtLowRankKeepsEachShardsOutliers) {
  SynthOptions o;
  o.seq = 1200;  // split at 576 (chunk 72); 146 chunks
  o.group = 4;
  o.d = 128;
  o.rank = 96;
  o.local_window = 32;
  o.outliers = 4;
  o.odd_chunks = {0, 17, 101, 130};
  o.budget = 256;
  o.steps = 3;
  o.structured = true;
  const CheckInputs in = MakeInputs(o);
  auto direct = RunCpu(in, "direct");
  ASSERT_TRUE(direct.ok()) << direct.status();
  auto cp = RunCpu(in, "cp2");
  ASSERT_TRUE(cp.ok()) << cp.status();
  EXPECT_EQ(cp->shard_bounds, (std::vector<int64_t>{0, 576, 1200}));
  EXPECT_EQ(cp->outlier_ids, (std::vector<int32_t>{0, 17, 101, 130, 0, 17, 101, 130}));
  EXPECT_EQ(cp->outlier_ids, direct->outlier_ids);
  const int K = in.kslots();
  bool both = false;
  for (int s = 0; s < in.steps; ++s) {
    for (int h = 0; h < in.hkv; ++h) {
      const int32_t* sel = cp->selected.data() + (static_cast<size_t>(s) * in.hkv + h) * K;
      EXPECT_TRUE(std::is_sorted(sel, sel + K));
      both = both || (sel[0] < 72 && sel[K - 1] >= 72);
    }
  }
  EXPECT_TRUE(both) << "some step selects from both shards";
  // The outputs differ from direct's by more than rounding (each shard's
  // rank-96 factors are not the sequence's); the comparator's sharded
  // reference judges them.
  for (float x : cp->out) ASSERT_TRUE(std::isfinite(x));
}

TEST(ShadowkvCheckModes, UnknownModeIsInvalidArgument) {
  const CheckInputs in = MakeInputs(Structured());
  auto r = RunCpu(in, "cp3");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("'cp3'"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("direct, attached or cp2"), std::string::npos) << r.status();
  EXPECT_TRUE(ValidateMode("attached").ok());
  EXPECT_EQ(ValidateMode("").code(), StatusCode::kInvalidArgument);
}

// Two equal shards each keep round(0.5 * 3) = 2 outliers: 4, not the
// inputs' 3, so the results cannot be the sequence's.
TEST(ShadowkvCheckModes, Cp2RefusesInputsItsShardsCannotHold) {
  SynthOptions o = Structured();
  o.seq = 256;
  o.outliers = 3;
  o.odd_chunks = {5, 20, 25};
  const CheckInputs in = MakeInputs(o);
  auto r = RunCpu(in, "cp2");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("outliers"), std::string::npos) << r.status();
}

TEST(LockstepGroup, AllGatherMovesWhenEveryRankCalled) {
  BackendOptions bo;
  bo.device = "cpu";
  auto backend = CreateBackend(bo);
  ASSERT_TRUE(backend.ok()) << backend.status();
  LockstepGroup g(**backend, 2);
  ASSERT_EQ(g.world(), 2);
  EXPECT_EQ(g.rank(1).rank(), 1);
  EXPECT_EQ(g.rank(1).world(), 2);
  const int32_t send0[2] = {1, 2}, send1[2] = {3, 4};
  int32_t recv0[4] = {0, 0, 0, 0}, recv1[4] = {0, 0, 0, 0};
  ASSERT_TRUE(g.rank(0).AllGather(send0, recv0, sizeof(send0)).ok());
  EXPECT_EQ(recv0[0], 0) << "nothing moves before the round is complete";
  ASSERT_TRUE(g.rank(1).AllGather(send1, recv1, sizeof(send1)).ok());
  EXPECT_EQ(std::vector<int32_t>(recv0, recv0 + 4), (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(std::vector<int32_t>(recv1, recv1 + 4), (std::vector<int32_t>{1, 2, 3, 4}));
  // Broadcast from rank 1.
  int32_t b0 = 7, b1 = 9;
  ASSERT_TRUE(g.rank(0).Broadcast(&b0, sizeof(b0), 1).ok());
  ASSERT_TRUE(g.rank(1).Broadcast(&b1, sizeof(b1), 1).ok());
  EXPECT_EQ(b0, 9);
  EXPECT_EQ(g.rank(0).Barrier().code(), StatusCode::kUnimplemented);
}

TEST(LockstepGroup, AMismatchBreaksTheGroup) {
  BackendOptions bo;
  bo.device = "cpu";
  auto backend = CreateBackend(bo);
  ASSERT_TRUE(backend.ok()) << backend.status();
  LockstepGroup g(**backend, 2);
  int32_t send[2] = {1, 2}, recv[4] = {};
  ASSERT_TRUE(g.rank(0).AllGather(send, recv, 8).ok());
  const Status twice = g.rank(0).AllGather(send, recv, 8);
  EXPECT_EQ(twice.code(), StatusCode::kFailedPrecondition) << twice;
  EXPECT_EQ(g.rank(1).AllGather(send, recv, 8).code(), StatusCode::kFailedPrecondition) << "broken for good";

  LockstepGroup h(**backend, 2);
  ASSERT_TRUE(h.rank(0).AllGather(send, recv, 8).ok());
  EXPECT_EQ(h.rank(1).AllGather(send, recv, 4).code(), StatusCode::kFailedPrecondition) << "another size";
}

}  // namespace
}  // namespace penumbra::shadowkv_check
