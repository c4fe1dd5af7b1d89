// fp8 landmarks (kernels/landmark_format.h): the e4m3 codec against a
// brute-force nearest-value search, a record's scale and padding, and the CPU
// kernels that write (ChunkLandmarks) and read (ShadowkvScore) the records.
#include "kernels/landmark_format.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cpu/shadowkv_decode.h"
#include "kernels/cpu/shadowkv_prefill.h"

namespace penumbra::kernels {
namespace {

// The finite e4m3 values by code (0x7f and 0xff are NaN), from the format's
// definition: exponent bias 7, 3 mantissa bits, subnormals below 2^-6.
double DefinedValue(int code) {
  const int e = (code >> 3) & 15, m = code & 7;
  const double v = e == 0 ? m * std::pow(2.0, -9) : (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return (code & 0x80) ? -v : v;
}

// Nearest finite code by search; ties to the even code (the even mantissa);
// beyond 448 the largest finite value (saturation).
uint8_t NearestCode(float x) {
  int best = -1;
  double best_err = 0;
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    if ((c & 0x80) != (std::signbit(x) ? 0x80 : 0)) continue;
    const double err = std::fabs(DefinedValue(c) - x);
    if (best < 0 || err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return static_cast<uint8_t>(best);
}

TEST(LandmarkFormatTest, E4M3DecodesEveryCodeAsDefined) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(E4M3ToF32(static_cast<uint8_t>(c))));
      continue;
    }
    EXPECT_EQ(E4M3ToF32(static_cast<uint8_t>(c)), static_cast<float>(DefinedValue(c))) << "code " << c;
    EXPECT_EQ(E4M3Table()[c], E4M3ToF32(static_cast<uint8_t>(c)));
    // Every finite code's value encodes back to the code (-0 to 0x80).
    EXPECT_EQ(F32ToE4M3(E4M3ToF32(static_cast<uint8_t>(c))), c) << "code " << c;
  }
  EXPECT_EQ(E4M3ToF32(0x7e), 448.0f);
  EXPECT_EQ(E4M3ToF32(0x01), std::ldexp(1.0f, -9));
}

TEST(LandmarkFormatTest, E4M3EncodesToTheNearestValueTiesToEvenAndSaturates) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> expo(-12.0f, 9.5f);
  for (int i = 0; i < 20000; ++i) {
    const float x = (i & 1 ? -1.0f : 1.0f) * std::exp2(expo(rng));
    ASSERT_EQ(F32ToE4M3(x), NearestCode(x)) << "x = " << x;
  }
  // Midpoints between neighbours: to the even mantissa.
  for (int c = 0; c < 0x7e; ++c) {
    const float mid = static_cast<float>((DefinedValue(c) + DefinedValue(c + 1)) / 2);
    EXPECT_EQ(F32ToE4M3(mid), (c & 1) ? c + 1 : c) << "between codes " << c << " and " << c + 1;
  }
  EXPECT_EQ(F32ToE4M3(464.0f), 0x7e);  // the midpoint of 448 and (absent) 480: even, 448
  EXPECT_EQ(F32ToE4M3(1e6f), 0x7e);
  EXPECT_EQ(F32ToE4M3(-1e6f), 0xfe);
  EXPECT_EQ(F32ToE4M3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(F32ToE4M3(std::nanf("")), 0x7f);
  EXPECT_EQ(F32ToE4M3(1e-30f), 0x00);
}

TEST(LandmarkFormatTest, ARecordKeepsItsLargestValueAtFullPrecision) {
  std::vector<float> v = {0.5f, -3.25f, 1e-3f, 2.0f, 0.0f, -0.75f, 3.0f, 0.125f};
  std::vector<uint8_t> rec(v.size() + kLandmarkFp8Tail, 0xaa);
  EncodeLandmarkFp8(v.data(), static_cast<int64_t>(v.size()), rec.data());
  float scale;
  std::memcpy(&scale, rec.data() + v.size(), 4);
  EXPECT_EQ(scale, 3.25f / kE4M3Max);
  EXPECT_EQ(rec[1], 0xfe);  // -3.25 is the largest |value|: -448
  for (size_t i = 0; i < v.size(); ++i) {
    const float got = E4M3ToF32(rec[i]) * scale;
    EXPECT_NEAR(got, v[i], std::fabs(v[i]) / 16 + 3.25f / kE4M3Max * std::ldexp(1.0f, -9)) << i;
  }
  for (int i = 4; i < kLandmarkFp8Tail; ++i) EXPECT_EQ(rec[v.size() + i], 0) << "padding byte " << i;
  // All zero: scale 1, codes 0.
  std::vector<float> z(8, 0.0f);
  EncodeLandmarkFp8(z.data(), 8, rec.data());
  std::memcpy(&scale, rec.data() + 8, 4);
  EXPECT_EQ(scale, 1.0f);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(rec[i], 0);
}

// A value that is not finite becomes the NaN code and takes no part in the
// scale: the other values' codes are what they are without it (the GPU's
// encoder does the same: ShadowKvPrefillGpuTest.Fp8LandmarkRecordsMatchCpu).
TEST(LandmarkFormatTest, NonFiniteValuesBecomeNaNCodesAndLeaveTheScaleAlone) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> clean = {0.5f, -3.25f, 1e-3f, 2.0f, 0.0f, -0.75f, 3.0f, 0.125f};
  std::vector<uint8_t> want(clean.size() + kLandmarkFp8Tail), got(want.size());
  EncodeLandmarkFp8(clean.data(), static_cast<int64_t>(clean.size()), want.data());
  std::vector<float> dirty = clean;
  dirty[0] = std::nanf("");
  dirty[2] = inf;
  dirty[5] = -inf;
  dirty[7] = -std::nanf("");
  EncodeLandmarkFp8(dirty.data(), static_cast<int64_t>(dirty.size()), got.data());
  for (size_t i = 0; i < dirty.size(); ++i) {
    if (std::isfinite(dirty[i])) {
      EXPECT_EQ(got[i], want[i]) << i;
    } else {
      EXPECT_EQ(got[i], kE4M3NaN) << i;
      EXPECT_TRUE(std::isnan(E4M3ToF32(got[i])));
    }
  }
  EXPECT_EQ(std::memcmp(got.data() + clean.size(), want.data() + clean.size(), kLandmarkFp8Tail), 0) << "scale";
  // Nothing finite: scale 1, every code NaN.
  std::vector<float> none = {inf, std::nanf(""), -inf, inf, inf, inf, inf, inf};
  EncodeLandmarkFp8(none.data(), 8, got.data());
  float scale;
  std::memcpy(&scale, got.data() + 8, 4);
  EXPECT_EQ(scale, 1.0f);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(got[i], kE4M3NaN) << i;
}

// ChunkLandmarks with fp8 writes, per chunk, the record of the f32 rows it
// writes without (S rows), at c * (S*d + 16) bytes; min_cos is unchanged.
TEST(LandmarkFormatTest, CpuChunkLandmarksWritesTheRecordsOfTheF32Rows) {
  const int hkv = 2, d = 16, C = 8, n = 5;
  const int64_t first = 8, k_stride = (first + n * C) * d;
  std::mt19937_64 rng(7);
  std::normal_distribution<float> n01;
  std::vector<float> k(hkv * k_stride);
  for (auto& v : k) v = 3 * n01(rng);
  for (int S : {1, 4}) {
    SCOPED_TRACE("S " + std::to_string(S));
    cpu::ChunkLandmarksArgs a;
    a.k = k.data();
    a.k_head_stride = k_stride;
    a.first_token = first;
    a.n_chunks = n;
    a.chunk_tokens = C;
    a.hkv = hkv;
    a.d = d;
    a.min_cos_head_stride = n;
    a.landmarks_per_chunk = S;
    std::vector<float> lm(static_cast<size_t>(hkv) * n * S * d), mc(hkv * n), mc8(hkv * n);
    a.landmarks = lm.data();
    a.landmark_head_stride = static_cast<int64_t>(n) * S * d;
    a.min_cos = mc.data();
    cpu::ChunkLandmarks(a);
    const int64_t rec = LandmarkChunkElems(S, d, true);
    std::vector<uint8_t> lm8(static_cast<size_t>(hkv) * n * rec, 0xaa);
    a.landmarks = nullptr;
    a.landmarks_fp8 = lm8.data();
    a.landmark_head_stride = n * rec;
    a.min_cos = mc8.data();
    cpu::ChunkLandmarks(a);
    EXPECT_EQ(mc8, mc);
    for (int h = 0; h < hkv; ++h)
      for (int c = 0; c < n; ++c) {
        std::vector<uint8_t> want(rec);
        EncodeLandmarkFp8(lm.data() + (static_cast<int64_t>(h) * n + c) * S * d, static_cast<int64_t>(S) * d,
                          want.data());
        const uint8_t* got = lm8.data() + (static_cast<int64_t>(h) * n + c) * rec;
        EXPECT_TRUE(std::equal(want.begin(), want.end(), got)) << "head " << h << " chunk " << c;
      }
  }
}

// ShadowkvScore on fp8 records scores exactly as on the f32 landmarks they
// decode to (code value * scale), with an attached prefix's records too.
TEST(LandmarkFormatTest, CpuScoreOnRecordsEqualsScoreOnTheirDecodedValues) {
  std::mt19937 rng(12);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int hkv = 2, group = 2, hq = hkv * group, d = 16, n = 29, cap = 33, shared = 7, S = 4;
  const int64_t rec = LandmarkChunkElems(S, d, true);
  std::vector<float> q(static_cast<size_t>(hq) * d);
  for (auto& x : q) x = nd(rng);
  // Records for the prefix's chunks and the sequence's own, and their decoded values.
  auto make = [&](int chunks, std::vector<uint8_t>* r, std::vector<float>* f) {
    r->assign(static_cast<size_t>(hkv) * chunks * rec, 0);
    f->assign(static_cast<size_t>(hkv) * chunks * S * d, 0.0f);
    std::vector<float> vals(static_cast<size_t>(S) * d);
    for (int i = 0; i < hkv * chunks; ++i) {
      for (auto& x : vals) x = 5 * nd(rng);
      EncodeLandmarkFp8(vals.data(), S * d, r->data() + i * rec);
      float scale;
      std::memcpy(&scale, r->data() + i * rec + S * d, 4);
      for (int j = 0; j < S * d; ++j) (*f)[static_cast<size_t>(i) * S * d + j] = E4M3ToF32((*r)[i * rec + j]) * scale;
    }
  };
  std::vector<uint8_t> pre8, own8;
  std::vector<float> pre, own;
  make(shared, &pre8, &pre);
  make(cap - shared, &own8, &own);
  std::vector<uint8_t> excl(static_cast<size_t>(hkv) * cap, 0);
  excl[5] = excl[cap + 12] = 1;
  const float* pre_p = pre.data();
  const float* own_p = own.data();
  const uint8_t* pre8_p = pre8.data();
  const uint8_t* own8_p = own8.data();
  const uint8_t* e_p = excl.data();
  const int32_t chunks = n;
  auto args = [&](bool fp8, float* out) {
    cpu::ShadowkvScoreArgs a;
    a.q = q.data();
    if (fp8) {
      a.landmarks_fp8 = &own8_p;
      a.shared_landmarks_fp8 = &pre8_p;
    } else {
      a.landmarks = &own_p;
      a.shared_landmarks = &pre_p;
    }
    a.excluded = &e_p;
    a.n_chunks = &chunks;
    a.batch = 1;
    a.hq = hq;
    a.hkv = hkv;
    a.d = d;
    a.chunk_cap = cap;
    a.landmark_cap = cap - shared;
    a.shared_chunks = shared;
    a.max_chunks = cap;
    a.landmarks_per_chunk = S;
    a.scale = 0.25f;
    a.scores = out;
    a.score_stride = cap;
    return a;
  };
  std::vector<float> got(static_cast<size_t>(hkv) * cap), want(got.size());
  cpu::ShadowkvScore(args(true, got.data()));
  cpu::ShadowkvScore(args(false, want.data()));
  EXPECT_EQ(got, want);
  EXPECT_EQ(got[5], -std::numeric_limits<float>::infinity());
  EXPECT_GT(got[6], 0.0f);
}

}  // namespace
}  // namespace penumbra::kernels
