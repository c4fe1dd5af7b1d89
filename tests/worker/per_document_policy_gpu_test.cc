// The per-document KV policy's cases (per_document_policy_cases.h) on the
// CUDA backend, f32 and bf16.
#include "tests/gpu_test_util.h"
#include "tests/worker/per_document_policy_cases.h"

namespace penumbra {
namespace {

void PerDocumentPolicyTest::SkipWithoutGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    GTEST_SKIP() << "no CUDA device";
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, PerDocumentPolicyTest, ::testing::Values("f32", "bf16"));

}  // namespace
}  // namespace penumbra
