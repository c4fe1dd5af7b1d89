// GPU ShadowKV prefill kernels against the CPU reference: landmarks and
// min_cos element by element, outlier sets exactly (same input, ties and NaN
// included), and the whole landmarks -> select -> gather chain on keys built
// without near-ties.
#include "kernels/landmark_format.h"
#include "kernels/shadowkv_prefill.cuh"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <glog/logging.h>
#include <gtest/gtest.h>

#include "common/dtype.h"
#include "kernels/cpu/shadowkv_prefill.h"
#include "tests/gpu_test_util.h"

namespace penumbra::kernels {
namespace {

using penumbra::testing::AllClose;
using DeviceBuffer = penumbra::testing::GpuBuffer;
using penumbra::testing::DownloadAs;
using penumbra::testing::UploadAs;

template <typename T>
DeviceBuffer UploadRaw(const std::vector<T>& x) {
  DeviceBuffer buf(x.size() * sizeof(T));
  CHECK(cudaMemcpy(buf.get(), x.data(), x.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  return buf;
}

template <typename T>
std::vector<T> DownloadRaw(const DeviceBuffer& buf, size_t n) {
  std::vector<T> out(n);
  CHECK(cudaMemcpy(out.data(), buf.get(), n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
  return out;
}

struct LCase {
  int hkv, d, C, n_chunks;
  int64_t first_token;
  DType kv_dtype, landmark_dtype;
  int batch = 1;      // problems in one launch (the decode path batches layers)
  int per_chunk = 1;  // landmarks per chunk
};

// Strides of a case's buffers (elements of each buffer's type): per head
// (k, l, m) and per problem (kb, lb, mb) of the keys, landmarks, min_cos.
struct LStrides {
  int64_t k, l, m, kb, lb, mb;
};

ChunkLandmarksArgs GpuLandmarkArgs(const LCase& c, const LStrides& st, const void* k, void* lm, float* mc) {
  ChunkLandmarksArgs a;
  a.k = k;
  a.kv_dtype = c.kv_dtype;
  a.k_head_stride = st.k;
  a.first_token = c.first_token;
  a.n_chunks = c.n_chunks;
  a.chunk_tokens = c.C;
  a.hkv = c.hkv;
  a.d = c.d;
  a.landmarks = lm;
  a.landmark_dtype = c.landmark_dtype;
  a.landmark_head_stride = st.l;
  a.min_cos = mc;
  a.min_cos_head_stride = st.m;
  a.batch = c.batch;
  a.k_batch_stride = st.kb;
  a.landmark_batch_stride = st.lb;
  a.min_cos_batch_stride = st.mb;
  a.landmarks_per_chunk = c.per_chunk;
  return a;
}

// The CPU reference's arguments for problem p (the caller sets the landmarks).
cpu::ChunkLandmarksArgs CpuLandmarkArgs(const LCase& c, const LStrides& st, const float* k, float* mc, int p) {
  cpu::ChunkLandmarksArgs ca;
  ca.k = k + p * st.kb;
  ca.k_head_stride = st.k;
  ca.first_token = c.first_token;
  ca.n_chunks = c.n_chunks;
  ca.chunk_tokens = c.C;
  ca.hkv = c.hkv;
  ca.d = c.d;
  ca.landmark_head_stride = st.l;
  ca.min_cos = mc + p * st.mb;
  ca.min_cos_head_stride = st.m;
  ca.landmarks_per_chunk = c.per_chunk;
  return ca;
}

TEST(ShadowKvPrefillGpuTest, LandmarksMatchCpu) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  const DType f32 = DType::kF32, bf16 = DType::kBF16;
  const LCase cases[] = {{1, 64, 8, 1, 0, f32, f32},        {2, 128, 16, 7, 16, bf16, bf16},
                         {3, 64, 8, 129, 8, bf16, f32},     {8, 128, 8, 4100, 0, bf16, bf16},
                         {4, 256, 16, 33, 24, f32, bf16},   {5, 64, 16, 1000, 0, f32, f32},
                         {7, 96, 8, 65, 0, bf16, bf16},     {8, 128, 8, 1, 0, bf16, bf16, 32},
                         {3, 64, 16, 5, 16, f32, f32, 3},   {8, 128, 8, 300, 8, bf16, bf16, 1, 2},
                         {2, 64, 8, 33, 0, f32, f32, 2, 4}, {4, 128, 16, 17, 16, bf16, f32, 1, 16},
                         {3, 64, 8, 9, 0, f32, bf16, 3, 8}};
  for (const LCase& c : cases) {
    SCOPED_TRACE("hkv " + std::to_string(c.hkv) + " d " + std::to_string(c.d) + " C " + std::to_string(c.C) +
                 " chunks " + std::to_string(c.n_chunks) + " kv " + std::string(DTypeName(c.kv_dtype)) + " landmarks " +
                 std::string(DTypeName(c.landmark_dtype)) + " batch " + std::to_string(c.batch) + " per chunk " +
                 std::to_string(c.per_chunk));
    const int64_t k_stride = (c.first_token + int64_t(c.n_chunks) * c.C + 3) * c.d;
    const int64_t l_stride = int64_t(c.n_chunks + 2) * c.per_chunk * c.d, m_stride = c.n_chunks + 5;
    // Padded problem strides, so a launch that ignored them would be caught.
    const int64_t kb_stride = c.hkv * k_stride + 2 * c.d, lb_stride = c.hkv * l_stride + c.d,
                  mb_stride = c.hkv * m_stride + 3;
    std::mt19937_64 rng(c.n_chunks * 31 + c.d);
    std::normal_distribution<float> n01;
    std::vector<float> k(c.batch * kb_stride);
    for (auto& v : k) v = n01(rng) + 0.3f;
    // A zero chunk exercises the both-zero cosine.
    for (int p = 0; p < c.batch; ++p)
      for (int h = 0; h < c.hkv; ++h)
        std::fill_n(k.begin() + p * kb_stride + h * k_stride + c.first_token * c.d, c.C * c.d, 0.0f);
    std::vector<float> k_ref;
    DeviceBuffer k_dev = UploadAs(k, c.kv_dtype, &k_ref);
    const std::vector<float> lm_init(c.batch * lb_stride, -3.0f), mc_init(c.batch * mb_stride, -3.0f);
    DeviceBuffer lm_dev = UploadAs(lm_init, c.landmark_dtype, nullptr);
    DeviceBuffer mc_dev = UploadAs(mc_init, f32, nullptr);

    const LStrides st{k_stride, l_stride, m_stride, kb_stride, lb_stride, mb_stride};
    LaunchChunkLandmarks(GpuLandmarkArgs(c, st, k_dev.get(), lm_dev.get(), mc_dev.as<float>()), nullptr);
    PENUMBRA_CUDA_OK(cudaGetLastError());
    PENUMBRA_CUDA_OK(cudaDeviceSynchronize());

    std::vector<float> lm_ref(lm_init), mc_ref(mc_init);
    for (int p = 0; p < c.batch; ++p) {
      cpu::ChunkLandmarksArgs ca = CpuLandmarkArgs(c, st, k_ref.data(), mc_ref.data(), p);
      ca.landmarks = lm_ref.data() + p * lb_stride;
      cpu::ChunkLandmarks(ca);
    }
    if (c.landmark_dtype == DType::kBF16) {  // the GPU rounds the f32 mean once
      std::vector<uint16_t> tmp(lm_ref.size());
      ConvertFromF32(lm_ref.data(), tmp.data(), DType::kBF16, lm_ref.size());
      ConvertToF32(tmp.data(), DType::kBF16, lm_ref.data(), lm_ref.size());
    }
    const auto lm = DownloadAs(lm_dev, c.landmark_dtype, lm_ref.size());
    const auto mc = DownloadAs(mc_dev, f32, mc_ref.size());
    // Means are summed in the same order on both sides; bf16 may differ by one
    // ulp where the f32 means straddle a rounding boundary.
    const bool low = c.landmark_dtype == DType::kBF16;
    EXPECT_TRUE(AllClose(lm, lm_ref, 1e-6f, low ? 8e-3f : 1e-6f)) << "landmarks";
    EXPECT_TRUE(AllClose(mc, mc_ref, 2e-5f, 0.0f)) << "min_cos";
  }
}

// fp8 records (kernels/landmark_format.h): the GPU's codes, scales and
// padding as the CPU's, from the same keys (means summed in the same order;
// a mean on a rounding boundary may move one code).
TEST(ShadowKvPrefillGpuTest, Fp8LandmarkRecordsMatchCpu) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  const DType f32 = DType::kF32, bf16 = DType::kBF16;
  const LCase cases[] = {{8, 128, 8, 300, 8, bf16, bf16, 2, 4},
                         {2, 64, 8, 33, 0, f32, f32, 1, 1},
                         {3, 136, 16, 17, 16, bf16, bf16, 1, 8},
                         {4, 128, 8, 1000, 0, bf16, bf16, 1, 8}};
  for (const LCase& c : cases) {
    SCOPED_TRACE("hkv " + std::to_string(c.hkv) + " d " + std::to_string(c.d) + " chunks " +
                 std::to_string(c.n_chunks) + " per chunk " + std::to_string(c.per_chunk));
    const int64_t rec = LandmarkChunkElems(c.per_chunk, c.d, true);
    const int64_t k_stride = (c.first_token + int64_t(c.n_chunks) * c.C) * c.d;
    const int64_t l_stride = (c.n_chunks + 1) * rec, m_stride = c.n_chunks;
    const int64_t kb_stride = c.hkv * k_stride, lb_stride = c.hkv * l_stride + 16, mb_stride = c.hkv * m_stride;
    std::mt19937_64 rng(c.n_chunks * 7 + c.d);
    std::normal_distribution<float> n01;
    std::vector<float> k(c.batch * kb_stride);
    for (auto& v : k) v = 4 * n01(rng);
    // Keys that overflowed (NaN, +-Inf) in a few chunks: their landmark
    // elements are NaN codes on both sides, the rest of the record as if
    // they were not there.
    const float inf = std::numeric_limits<float>::infinity();
    for (int i = 0; i < 6; ++i) k[(i * 7919 + 13) % k.size()] = i % 3 == 0 ? std::nanf("") : i % 3 == 1 ? inf : -inf;
    std::vector<float> k_ref;
    DeviceBuffer k_dev = UploadAs(k, c.kv_dtype, &k_ref);
    const std::vector<uint8_t> lm_init(c.batch * lb_stride, 0xaa);
    DeviceBuffer lm_dev = UploadRaw(lm_init);
    DeviceBuffer mc_dev = UploadAs(std::vector<float>(c.batch * mb_stride, -3.0f), f32, nullptr);
    const LStrides st{k_stride, l_stride, m_stride, kb_stride, lb_stride, mb_stride};
    ChunkLandmarksArgs a = GpuLandmarkArgs(c, st, k_dev.get(), lm_dev.get(), mc_dev.as<float>());
    a.landmark_fp8 = true;
    LaunchChunkLandmarks(a, nullptr);
    PENUMBRA_CUDA_OK(cudaGetLastError());
    PENUMBRA_CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> want(lm_init);
    std::vector<float> mc_ref(c.batch * mb_stride);
    for (int p = 0; p < c.batch; ++p) {
      cpu::ChunkLandmarksArgs ca = CpuLandmarkArgs(c, st, k_ref.data(), mc_ref.data(), p);
      ca.landmarks_fp8 = want.data() + p * lb_stride;
      cpu::ChunkLandmarks(ca);
    }
    const auto got = DownloadRaw<uint8_t>(lm_dev, want.size());
    size_t differ = 0, codes = 0, nan_codes = 0;
    for (int p = 0; p < c.batch; ++p)
      for (int h = 0; h < c.hkv; ++h)
        for (int ch = 0; ch <= c.n_chunks; ++ch) {
          const size_t r0 = p * lb_stride + h * l_stride + ch * rec;
          if (ch == c.n_chunks) {  // past the last chunk: untouched
            for (int64_t i = 0; i < rec; ++i) ASSERT_EQ(got[r0 + i], 0xaa);
            continue;
          }
          float gs, ws;
          std::memcpy(&gs, &got[r0 + rec - kLandmarkFp8Tail], 4);
          std::memcpy(&ws, &want[r0 + rec - kLandmarkFp8Tail], 4);
          ASSERT_NEAR(gs, ws, 1e-6f * ws) << "scale of head " << h << " chunk " << ch;
          for (int i = 4; i < kLandmarkFp8Tail; ++i) ASSERT_EQ(got[r0 + rec - kLandmarkFp8Tail + i], 0);
          for (int64_t i = 0; i < rec - kLandmarkFp8Tail; ++i, ++codes) {
            const uint8_t g = got[r0 + i], w = want[r0 + i];
            if (w == kE4M3NaN || g == kE4M3NaN) ++nan_codes;
            ASSERT_TRUE(g == w || (w != kE4M3NaN && g != kE4M3NaN)) << "head " << h << " chunk " << ch << " code " << i;
            if (g == w) continue;
            ++differ;
            ASSERT_EQ(g & 0x80, w & 0x80);
            ASSERT_LE(std::abs(int(g & 0x7f) - int(w & 0x7f)), 1) << "head " << h << " chunk " << ch << " code " << i;
          }
        }
    EXPECT_LE(differ, codes / 1000) << differ << " of " << codes << " codes differ";
    EXPECT_GT(nan_codes, 0u) << "no record held a non-finite key";
  }
}

std::vector<int32_t> SelectOnGpu(const std::vector<float>& s, int64_t stride, int hkv, int n, int O) {
  DeviceBuffer s_dev = UploadRaw(s);
  DeviceBuffer out_dev(sizeof(int32_t) * std::max(hkv * O, 1));
  SelectOutliersArgs a;
  a.min_cos = s_dev.as<float>();
  a.min_cos_head_stride = stride;
  a.hkv = hkv;
  a.n_chunks = n;
  a.num_outliers = O;
  a.out = out_dev.as<int32_t>();
  LaunchSelectOutlierChunks(a, nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return DownloadRaw<int32_t>(out_dev, hkv * O);
}

TEST(ShadowKvPrefillGpuTest, OutlierSelectionMatchesCpuExactly) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  for (int n : {1, 7, 129, 1024, 4100, 131072}) {
    for (int O : {1, 5, 48, 1000, 1024, n}) {
      if (O > n || O > 1024) continue;
      for (int mode = 0; mode < 3; ++mode) {  // 0: distinct, 1: heavy ties + NaN + -0, 2: all equal
        SCOPED_TRACE("n " + std::to_string(n) + " O " + std::to_string(O) + " mode " + std::to_string(mode));
        const int hkv = 3;
        const int64_t stride = n + 7;
        std::vector<float> s(hkv * stride, 5.0f);
        for (int h = 0; h < hkv; ++h)
          for (int i = 0; i < n; ++i) {
            float& v = s[h * stride + i];
            if (mode == 0) {
              v = uni(rng);
            } else if (mode == 1) {
              const int roll = static_cast<int>(rng() % 50);
              v = roll == 0   ? NAN
                  : roll == 1 ? -0.0f
                  : roll == 2 ? 0.0f
                  : roll == 3 ? -INFINITY
                              : float(int(rng() % 9) - 4) / 4;
            } else {
              v = 0.25f;
            }
          }
        std::vector<int32_t> want(hkv * O);
        cpu::SelectOutlierChunks(s.data(), stride, hkv, n, O, want.data());
        const auto got = SelectOnGpu(s, stride, hkv, n, O);
        for (size_t i = 0; i < want.size(); ++i)
          ASSERT_EQ(got[i], want[i]) << "first mismatch at head " << i / O << " slot " << i % O;
      }
    }
  }
}

struct ECase {
  int hkv, d, C, n_chunks, O;
  DType dtype;
};

// Keys with clearly separated chunk scores: per head a base direction b with
// tiny noise; the q-th of 2*O chosen chunks gets one key at an exact angle
// theta_q = (q + 1) * pi / (2 * (2*O + 1)) from b. Its chunk's min_cos is then
// cos(mean, that key), decreasing in q with gaps far above rounding.
std::vector<float> OutlierKeys(const ECase& c, int64_t stride, int64_t first_token, std::mt19937_64& rng) {
  std::normal_distribution<float> n01;
  std::vector<float> k(c.hkv * stride, 0.0f);
  const double kPi = 3.14159265358979323846;
  for (int h = 0; h < c.hkv; ++h) {
    std::vector<double> base(c.d);
    double bb = 0;
    for (auto& b : base) b = n01(rng), bb += b * b;
    for (int64_t t = first_token; t < first_token + int64_t(c.n_chunks) * c.C; ++t)
      for (int j = 0; j < c.d; ++j) k[h * stride + t * c.d + j] = static_cast<float>(base[j] + 1e-3 * n01(rng));
    std::vector<int> chunks(c.n_chunks);
    std::iota(chunks.begin(), chunks.end(), 0);
    std::shuffle(chunks.begin(), chunks.end(), rng);
    const int special = std::min(c.n_chunks, 2 * c.O);
    for (int q = 0; q < special; ++q) {
      // u: unit vector orthogonal to b, scaled to |b|.
      std::vector<double> u(c.d);
      double ub = 0, uu = 0;
      for (auto& x : u) x = n01(rng);
      for (int j = 0; j < c.d; ++j) ub += u[j] * base[j];
      for (int j = 0; j < c.d; ++j) u[j] -= ub / bb * base[j], uu += u[j] * u[j];
      const double theta = (q + 1) * kPi / (2.0 * (2 * c.O + 1));
      float* key = k.data() + h * stride + (first_token + int64_t(chunks[q]) * c.C + q % c.C) * c.d;
      for (int j = 0; j < c.d; ++j)
        key[j] = static_cast<float>(std::cos(theta) * base[j] + std::sin(theta) * std::sqrt(bb / uu) * u[j]);
    }
  }
  return k;
}

TEST(ShadowKvPrefillGpuTest, LandmarksSelectGatherChainMatchesCpu) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  const ECase cases[] = {{2, 128, 8, 4100, 48, DType::kBF16},
                         {8, 64, 16, 129, 5, DType::kF32},
                         {1, 64, 8, 7, 7, DType::kBF16},
                         {4, 128, 8, 2000, 96, DType::kF32},
                         {3, 64, 16, 1, 1, DType::kBF16}};
  std::mt19937_64 rng(2024);
  for (const ECase& c : cases) {
    SCOPED_TRACE("hkv " + std::to_string(c.hkv) + " d " + std::to_string(c.d) + " C " + std::to_string(c.C) +
                 " chunks " + std::to_string(c.n_chunks) + " O " + std::to_string(c.O));
    const int64_t first_token = 8;
    const int64_t stride = (first_token + int64_t(c.n_chunks) * c.C + 4) * c.d;
    const auto k = OutlierKeys(c, stride, first_token, rng);
    std::vector<float> v(k.size());
    std::normal_distribution<float> n01;
    for (auto& x : v) x = n01(rng);
    std::vector<float> k_ref, v_ref;
    DeviceBuffer k_dev = UploadAs(k, c.dtype, &k_ref), v_dev = UploadAs(v, c.dtype, &v_ref);

    // CPU chain.
    const int64_t m_stride = c.n_chunks + 3, l_stride = int64_t(c.n_chunks) * c.d;
    std::vector<float> lm_ref(c.hkv * l_stride), mc_ref(c.hkv * m_stride, 0.0f);
    cpu::ChunkLandmarksArgs cl;
    cl.k = k_ref.data();
    cl.k_head_stride = stride;
    cl.first_token = first_token;
    cl.n_chunks = c.n_chunks;
    cl.chunk_tokens = c.C;
    cl.hkv = c.hkv;
    cl.d = c.d;
    cl.landmarks = lm_ref.data();
    cl.landmark_head_stride = l_stride;
    cl.min_cos = mc_ref.data();
    cl.min_cos_head_stride = m_stride;
    cpu::ChunkLandmarks(cl);
    // Precondition of an exact comparison: no near-tie at the selection edge.
    for (int h = 0; h < c.hkv && c.O < c.n_chunks; ++h) {
      std::vector<float> sorted(mc_ref.begin() + h * m_stride, mc_ref.begin() + h * m_stride + c.n_chunks);
      std::sort(sorted.begin(), sorted.end());
      ASSERT_GT(sorted[c.O] - sorted[c.O - 1], 1e-4f) << "test input has a near-tie, head " << h;
    }
    std::vector<int32_t> out_ref(c.hkv * c.O);
    cpu::SelectOutlierChunks(mc_ref.data(), m_stride, c.hkv, c.n_chunks, c.O, out_ref.data());
    const int64_t att_stride = (int64_t(c.O) * c.C + 2) * c.d, mask_stride = c.n_chunks + 9;
    std::vector<float> ak_ref(c.hkv * att_stride, 0.0f), av_ref(c.hkv * att_stride, 0.0f);
    std::vector<uint8_t> mask_ref(c.hkv * mask_stride, 7);
    cpu::GatherOutliersArgs cg;
    cg.k = k_ref.data();
    cg.v = v_ref.data();
    cg.kv_head_stride = stride;
    cg.first_token = first_token;
    cg.chunk_tokens = c.C;
    cg.hkv = c.hkv;
    cg.d = c.d;
    cg.n_chunks = c.n_chunks;
    cg.outliers = out_ref.data();
    cg.num_outliers = c.O;
    cg.att_k = ak_ref.data();
    cg.att_v = av_ref.data();
    cg.att_head_stride = att_stride;
    cg.excluded = mask_ref.data();
    cg.mask_head_stride = mask_stride;
    cpu::GatherOutliers(cg);

    // GPU chain.
    DeviceBuffer lm_dev(sizeof(float) * lm_ref.size()), mc_dev(sizeof(float) * mc_ref.size()),
        out_dev(sizeof(int32_t) * out_ref.size());
    DeviceBuffer ak_dev = UploadAs(std::vector<float>(ak_ref.size(), 0.0f), c.dtype, nullptr);
    DeviceBuffer av_dev = UploadAs(std::vector<float>(av_ref.size(), 0.0f), c.dtype, nullptr);
    DeviceBuffer mask_dev = UploadRaw(std::vector<uint8_t>(mask_ref.size(), 7));
    ChunkLandmarksArgs gl;
    gl.k = k_dev.get();
    gl.kv_dtype = c.dtype;
    gl.k_head_stride = stride;
    gl.first_token = first_token;
    gl.n_chunks = c.n_chunks;
    gl.chunk_tokens = c.C;
    gl.hkv = c.hkv;
    gl.d = c.d;
    gl.landmarks = lm_dev.get();
    gl.landmark_dtype = DType::kF32;
    gl.landmark_head_stride = l_stride;
    gl.min_cos = mc_dev.as<float>();
    gl.min_cos_head_stride = m_stride;
    LaunchChunkLandmarks(gl, nullptr);
    SelectOutliersArgs gs;
    gs.min_cos = mc_dev.as<float>();
    gs.min_cos_head_stride = m_stride;
    gs.hkv = c.hkv;
    gs.n_chunks = c.n_chunks;
    gs.num_outliers = c.O;
    gs.out = out_dev.as<int32_t>();
    LaunchSelectOutlierChunks(gs, nullptr);
    GatherOutliersArgs gg;
    gg.k = k_dev.get();
    gg.v = v_dev.get();
    gg.kv_dtype = c.dtype;
    gg.kv_head_stride = stride;
    gg.first_token = first_token;
    gg.chunk_tokens = c.C;
    gg.hkv = c.hkv;
    gg.d = c.d;
    gg.n_chunks = c.n_chunks;
    gg.outliers = out_dev.as<int32_t>();
    gg.num_outliers = c.O;
    gg.att_k = ak_dev.get();
    gg.att_v = av_dev.get();
    gg.att_head_stride = att_stride;
    gg.excluded = mask_dev.as<uint8_t>();
    gg.mask_head_stride = mask_stride;
    LaunchGatherOutliers(gg, nullptr);
    PENUMBRA_CUDA_OK(cudaGetLastError());
    PENUMBRA_CUDA_OK(cudaDeviceSynchronize());

    const auto out = DownloadRaw<int32_t>(out_dev, out_ref.size());
    for (size_t i = 0; i < out.size(); ++i)
      ASSERT_EQ(out[i], out_ref[i]) << "outlier set differs at head " << i / c.O << " slot " << i % c.O;
    EXPECT_TRUE(AllClose(DownloadAs(ak_dev, c.dtype, ak_ref.size()), ak_ref, 0.0f, 0.0f)) << "att_k";
    EXPECT_TRUE(AllClose(DownloadAs(av_dev, c.dtype, av_ref.size()), av_ref, 0.0f, 0.0f)) << "att_v";
    const auto mask = DownloadRaw<uint8_t>(mask_dev, mask_ref.size());
    for (size_t i = 0; i < mask.size(); ++i)
      ASSERT_EQ(int(mask[i]), int(mask_ref[i]))
          << "mask differs at head " << i / mask_stride << " chunk " << i % mask_stride;
  }
}

}  // namespace
}  // namespace penumbra::kernels
