#include "common/status.h"

#include <gtest/gtest.h>

#include "common/config.h"
#include "common/dtype.h"
#include "common/hash.h"

namespace penumbra {
namespace {

Result<int> Half(int x) {
  if (x % 2) return Status::InvalidArgument("odd: " + std::to_string(x));
  return x / 2;
}

Status UseHalf(int x, int* out) {
  PENUMBRA_ASSIGN_OR_RETURN(*out, Half(x));
  return Status::OK();
}

TEST(StatusTest, OkAndErrors) {
  EXPECT_TRUE(Status::OK().ok());
  Status s = Status::Unavailable("worker down");
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(s.retryable());
  EXPECT_FALSE(Status::InvalidArgument("x").retryable());
  EXPECT_EQ(s.ToString(), "Unavailable: worker down");
  EXPECT_EQ(s.WithContext("layer 3").message(), "layer 3: worker down");
}

TEST(StatusTest, ResultPropagates) {
  int v = 0;
  EXPECT_TRUE(UseHalf(8, &v).ok());
  EXPECT_EQ(v, 4);
  Status s = UseHalf(3, &v);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "odd: 3");
}

TEST(DTypeTest, Bf16AndF16RoundTrip) {
  for (float f : {0.0f, 1.0f, -2.5f, 3.14159f, 1e-3f, 65504.0f, 6.1e-5f, 5.96e-8f, -1e-6f}) {
    EXPECT_NEAR(BF16ToF32(F32ToBF16(f)), f, std::fabs(f) * 8e-3f) << f;
    EXPECT_NEAR(F16ToF32(F32ToF16(f)), f, std::fabs(f) * 1e-3f + 6e-8f) << f;
  }
  EXPECT_EQ(F32ToBF16(1.0f), 0x3f80);
  EXPECT_EQ(F32ToF16(1.0f), 0x3c00);
  EXPECT_EQ(F32ToF16(-2.0f), 0xc000);
  EXPECT_EQ(F16ToF32(0x0001), 5.960464477539063e-08f);  // smallest subnormal
  EXPECT_EQ(F32ToF16(5.960464477539063e-08f), 0x0001);
  EXPECT_TRUE(std::isinf(F16ToF32(F32ToF16(1e6f))));
}

TEST(HashTest, StableAndIncremental) {
  EXPECT_EQ(Hash64("abc"), Hash64("abc"));
  EXPECT_NE(Hash64("abc"), Hash64("abd"));
  Hasher128 h;
  h.Update("ab").Update("c");
  EXPECT_EQ(h.Digest(), HashBytes128("abc", 3));
  EXPECT_EQ(h.Digest().Hex().size(), 32u);
}

TEST(ConfigTest, ReadsAndValidates) {
  auto r = ConfigReader::FromString("rank: 160\nchunk: 8\nmode: shadowkv\nnested: {a: true}\n", "t.yaml");
  ASSERT_TRUE(r.ok());
  int rank = 0, chunk = 0;
  std::string mode;
  r->Read("rank", &rank, 1, 4096);
  r->Read("chunk", &chunk, 1, 64);
  r->ReadEnum("mode", &mode, {"full", "shadowkv"});
  ConfigReader child = r->Child("nested");
  bool a = false;
  child.Read("a", &a);
  EXPECT_TRUE(child.Finish().ok());
  EXPECT_TRUE(r->Finish().ok());
  EXPECT_EQ(rank, 160);
  EXPECT_EQ(mode, "shadowkv");
  EXPECT_TRUE(a);
}

TEST(ConfigTest, NamesBadKey) {
  auto r = ConfigReader::FromString("engine:\n  rank: 0\n", "e.yaml");
  ASSERT_TRUE(r.ok());
  ConfigReader e = r->Child("engine");
  int rank = 160;
  e.Read("rank", &rank, 1, 4096);
  Status s = e.Finish();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("engine.rank"), std::string::npos) << s;
  EXPECT_EQ(rank, 160);

  auto u = ConfigReader::FromString("rnak: 3\n", "u.yaml");
  ASSERT_TRUE(u.ok());
  u->Read("rank", &rank, 1, 4096);
  Status su = u->Finish();
  EXPECT_NE(su.message().find("rnak: unknown key"), std::string::npos) << su;

  auto bad = ConfigReader::FromString("a: [1, 2\n", "b.yaml");
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("b.yaml"), std::string::npos);
}

}  // namespace
}  // namespace penumbra
