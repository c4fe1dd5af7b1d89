// KernelTrace on the GPU: a kernel and a memset launched while the trace is on
// come back as records with their names, streams and ordered GPU times; one
// trace at a time.
#include "worker/bench/kernel_trace.h"

#include <algorithm>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/topk.cuh"
#include "tests/gpu_test_util.h"

namespace penumbra {
namespace {

TEST(KernelTraceGpu, RecordsKernelsAndSets) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  constexpr int kRows = 4, kN = 1000, kK = 16;
  testing::GpuBuffer values(sizeof(float) * kRows * kN), out(sizeof(int32_t) * kRows * kK);
  cudaStream_t s = nullptr;
  PENUMBRA_CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  PENUMBRA_CUDA_OK(cudaDeviceSynchronize());
  auto trace = KernelTrace::Start();
  ASSERT_TRUE(trace.ok()) << trace.status();
  EXPECT_EQ(KernelTrace::Start().status().code(), StatusCode::kFailedPrecondition);  // one at a time
  PENUMBRA_CUDA_OK(cudaMemsetAsync(values.get(), 0, sizeof(float) * kRows * kN, s));
  kernels::TopKArgs a;
  a.values = static_cast<const float*>(values.get());
  a.stride = kN;
  a.rows = kRows;
  a.uniform_count = kN;
  a.max_count = kN;
  a.k = kK;
  a.out = static_cast<int32_t*>(out.get());
  a.out_stride = kK;
  kernels::LaunchTopK(a, s);
  PENUMBRA_CUDA_OK(cudaStreamSynchronize(s));
  auto recs = (*trace)->Stop();
  ASSERT_TRUE(recs.ok()) << recs.status();
  EXPECT_EQ((*trace)->Stop().status().code(), StatusCode::kFailedPrecondition);
  const auto topk = std::find_if(recs->begin(), recs->end(), [](const TraceRecord& r) {
    return r.kind == TraceRecord::Kind::kKernel && r.name.find("TopKKernel") != std::string::npos;
  });
  ASSERT_NE(topk, recs->end());
  EXPECT_EQ(topk->name.find("anonymous"), std::string::npos) << topk->name;
  EXPECT_EQ(topk->blocks, static_cast<uint32_t>(kRows));
  EXPECT_GT(topk->threads, 0u);
  EXPECT_GT(topk->end_ns, topk->start_ns);
  const auto set = std::find_if(recs->begin(), recs->end(),
                                [](const TraceRecord& r) { return r.kind == TraceRecord::Kind::kMemset; });
  ASSERT_NE(set, recs->end());
  EXPECT_EQ(set->bytes, sizeof(float) * kRows * kN);
  EXPECT_EQ(set->stream, topk->stream);
  EXPECT_LE(set->end_ns, topk->start_ns);  // stream order
  EXPECT_TRUE(std::is_sorted(recs->begin(), recs->end(),
                             [](const TraceRecord& x, const TraceRecord& y) { return x.start_ns < y.start_ns; }));
  // A new trace can start once the last one stopped.
  auto again = KernelTrace::Start();
  EXPECT_TRUE(again.ok()) << again.status();
  PENUMBRA_CUDA_OK(cudaStreamDestroy(s));
}

}  // namespace
}  // namespace penumbra
