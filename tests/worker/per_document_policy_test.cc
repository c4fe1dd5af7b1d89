// The per-document KV policy's cases (per_document_policy_cases.h) on the
// CPU backend (f32).
#include "tests/worker/per_document_policy_cases.h"

namespace penumbra {
namespace {

void PerDocumentPolicyTest::SkipWithoutGpu() {}

INSTANTIATE_TEST_SUITE_P(Cpu, PerDocumentPolicyTest, ::testing::Values("cpu"));

}  // namespace
}  // namespace penumbra
