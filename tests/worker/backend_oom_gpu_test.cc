// A decode-attention workspace that does not fit on the device is a
// ResourceExhausted error of that op (the worker's decode step fails, its
// requests end, the worker serves on), never a crash; the backend keeps
// working after it.
#include <gtest/gtest.h>

#include "tests/gpu_test_util.h"
#include "worker/engine/backend.h"

namespace penumbra {
namespace {

TEST(BackendOomGpuTest, AWorkspaceThatDoesNotFitIsAnError) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  BackendOptions bo;
  bo.device = "cuda";
  auto b = CreateBackend(bo);
  ASSERT_TRUE(b.ok()) << b.status();
  // Far more partials than any GPU holds; nothing is
  // launched, so the null tensors are never read.
  DecodeAttentionOp op;
  op.batch = 1 << 30;  // 4 B x batch x hq x (d + 2): ~36 TB
  op.hq = 64;
  op.hkv = 8;
  op.d = 128;
  op.max_length = 1 << 22;
  op.head_stride = 128;
  const Status s = (*b)->DecodeAttention(op);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("cannot allocate"), std::string::npos) << s;
  // Still usable.
  auto buf = (*b)->Allocate(1 << 20);
  EXPECT_TRUE(buf.ok()) << buf.status();
  EXPECT_TRUE((*b)->Synchronize().ok());
}

}  // namespace
}  // namespace penumbra
