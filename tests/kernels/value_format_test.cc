// fp8 values (kernels/value_format.h): the row layout and its size, each
// token's own scale, the round trip's error bound, saturation by rounding,
// and non-finite values encoded as NaN without touching their token's scale.
#include "kernels/value_format.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace penumbra::kernels {
namespace {

float ScaleOf(const std::vector<uint8_t>& row, int C, int d, int t) {
  float s;
  std::memcpy(&s, row.data() + static_cast<int64_t>(C) * d + 4 * t, 4);
  return s;
}

TEST(ValueFormatTest, RowsAreHalfTheBytesOfBf16AndAligned) {
  EXPECT_EQ(ValueRowBytesFp8(8, 128), 1056);  // 1024 codes + 8 scales
  EXPECT_EQ(ValueRowBytesFp8(8, 64), 544);
  EXPECT_EQ(ValueRowBytesFp8(1, 16), 32);  // 16 + 4, padded
  for (int C : {1, 2, 8, 16, 32}) {
    for (int d : {16, 64, 128, 256}) {
      EXPECT_EQ(ValueRowBytesFp8(C, d) % kValueRowAlign, 0);
      EXPECT_LT(ValueRowBytesFp8(C, d), static_cast<int64_t>(C) * d + 4 * C + kValueRowAlign) << C << " x " << d;
      if (C >= 8 && d >= 64) {  // the scales and the padding are small beside the codes
        EXPECT_LT(ValueRowBytesFp8(C, d), static_cast<int64_t>(C) * d * 2 * 0.6) << C << " x " << d;
      }
    }
  }
}

TEST(ValueFormatTest, EachTokenKeepsItsOwnRangeWithinE4M3sError) {
  constexpr int C = 8, d = 128;
  std::mt19937_64 rng(5);
  std::vector<float> x(C * d);
  for (int t = 0; t < C; ++t) {
    // Tokens of very different magnitudes: one scale per token keeps each.
    const float mag = std::ldexp(1.0f, -12 + 3 * t);
    std::normal_distribution<float> n(0.0f, mag);
    for (int j = 0; j < d; ++j) x[t * d + j] = n(rng);
  }
  std::vector<uint8_t> row(ValueRowBytesFp8(C, d), 0xcc);
  EncodeValueRowFp8(x.data(), C, d, row.data());
  for (size_t b = C * d + 4 * C; b < row.size(); ++b) EXPECT_EQ(row[b], 0) << "padding byte " << b;
  std::vector<float> y(C * d);
  DecodeValueRowFp8(row.data(), C, d, y.data());
  for (int t = 0; t < C; ++t) {
    float amax = 0;
    for (int j = 0; j < d; ++j) amax = std::max(amax, std::fabs(x[t * d + j]));
    EXPECT_EQ(ScaleOf(row, C, d, t), amax / kE4M3Max);
    for (int j = 0; j < d; ++j) {
      const float a = x[t * d + j], b = y[t * d + j];
      // e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal
      // codes, and at most half the smallest subnormal step (2^-10 of the
      // scale) below them.
      EXPECT_LE(std::fabs(a - b), std::max(std::fabs(a) / 16, ScaleOf(row, C, d, t) * std::ldexp(1.0f, -10)) * 1.0001f)
          << "token " << t << " element " << j;
    }
    // The token's largest value is exact up to rounding of its scale.
    int jmax = 0;
    for (int j = 0; j < d; ++j)
      if (std::fabs(x[t * d + j]) > std::fabs(x[t * d + jmax])) jmax = j;
    EXPECT_NEAR(std::fabs(y[t * d + jmax]), amax, amax * 1e-6f);
  }
}

TEST(ValueFormatTest, NonFiniteValuesBecomeNaNAndDoNotSetTheScale) {
  constexpr int C = 2, d = 16;
  std::vector<float> x(C * d, 0.5f);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  x[4] = std::numeric_limits<float>::infinity();
  x[5] = -std::numeric_limits<float>::infinity();
  x[6] = -std::numeric_limits<float>::quiet_NaN();
  x[7] = -2.0f;
  for (int j = 0; j < d; ++j) x[d + j] = 0.0f;  // an all-zero token: scale 1, codes 0
  std::vector<uint8_t> row(ValueRowBytesFp8(C, d));
  EncodeValueRowFp8(x.data(), C, d, row.data());
  EXPECT_EQ(ScaleOf(row, C, d, 0), 2.0f / kE4M3Max);
  EXPECT_EQ(ScaleOf(row, C, d, 1), 1.0f);
  for (int j : {3, 4, 5, 6}) EXPECT_EQ(row[j], kE4M3NaN) << j;
  EXPECT_EQ(row[7], 0xfe);  // -448: the token's largest
  for (int j = 0; j < d; ++j) EXPECT_EQ(row[d + j], 0);
  std::vector<float> y(C * d);
  DecodeValueRowFp8(row.data(), C, d, y.data());
  for (int j : {3, 4, 5, 6}) EXPECT_TRUE(std::isnan(y[j])) << j;
  EXPECT_EQ(y[7], -2.0f);
  EXPECT_EQ(y[0], 0.5f);
}

TEST(ValueFormatTest, AProductPastE4M3sLargestSaturates) {
  // x * (448 / amax) can round above 448 for the largest value; it encodes
  // as 448 (0x7e), never as NaN.
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(0.1f, 1000.0f);
  for (int i = 0; i < 20000; ++i) {
    std::vector<float> x(16);
    for (float& v : x) v = u(rng);
    std::vector<uint8_t> row(ValueRowBytesFp8(1, 16));
    EncodeValueRowFp8(x.data(), 1, 16, row.data());
    for (int j = 0; j < 16; ++j) ASSERT_NE(row[j] & 0x7f, 0x7f) << "a finite value encoded as NaN";
  }
}

}  // namespace
}  // namespace penumbra::kernels
