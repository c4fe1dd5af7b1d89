// The skinny linear kernel (decode-sized batches) against a double-precision
// CPU reference on the same bf16 inputs, at awkward sizes (row tails, k tails,
// every batch size 1..16, k split across warps or not), with and without
// accumulation; the output is poisoned beforehand and followed by a guard
// region that must stay untouched. Its SwiGLU epilogue gives the bits of the
// unfused kernels (the kernel on the [2F, in] weight, then LaunchSwiGLU). With
// PENUMBRA_KERNEL_BENCH=1 the Bench cases print GB/s of weights read against
// cuBLAS, and fused against unfused, at the Llama-3.1-8B shapes.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "common/dtype.h"
#include "kernels/linear_skinny.cuh"
#include "kernels/swiglu.cuh"
#include "tests/gpu_test_util.h"

namespace penumbra::kernels {
namespace {

using ::penumbra::testing::AllClose;
using ::penumbra::testing::GpuBuffer;
using ::penumbra::testing::KernelBenchEnabled;
using ::penumbra::testing::RandomUniform;
using ::penumbra::testing::TimeMs;
using ::penumbra::testing::UploadAs;

struct Case {
  int n, out, in;
  bool accumulate;
};

void RunCase(const Case& c) {
  SCOPED_TRACE(::testing::Message() << "n=" << c.n << " out=" << c.out << " in=" << c.in << " acc=" << c.accumulate);
  std::vector<float> xr, wr;
  GpuBuffer dx = UploadAs(RandomUniform(static_cast<size_t>(c.n) * c.in, 1 + c.n), DType::kBF16, &xr);
  GpuBuffer dw = UploadAs(RandomUniform(static_cast<size_t>(c.out) * c.in, 7 + c.out), DType::kBF16, &wr);
  const size_t ny = static_cast<size_t>(c.n) * c.out, guard = 64;
  std::vector<float> y0 = RandomUniform(ny, 99);
  std::vector<float> y_init(ny + guard, std::nanf(""));
  if (c.accumulate) std::copy(y0.begin(), y0.end(), y_init.begin());
  GpuBuffer dy((ny + guard) * sizeof(float));
  PENUMBRA_CUDA_OK(cudaMemcpy(dy.get(), y_init.data(), y_init.size() * sizeof(float), cudaMemcpyHostToDevice));

  SkinnyLinearArgs a;
  a.x = dx.get();
  a.w = dw.get();
  a.n = c.n;
  a.out = c.out;
  a.in = c.in;
  a.y = dy.as<float>();
  a.accumulate = c.accumulate;
  ASSERT_TRUE(SkinnyLinearSupported(a, DType::kBF16));
  LaunchSkinnyLinear(a, nullptr);
  PENUMBRA_CUDA_OK(cudaGetLastError());
  std::vector<float> got(ny + guard);
  PENUMBRA_CUDA_OK(cudaMemcpy(got.data(), dy.get(), got.size() * sizeof(float), cudaMemcpyDeviceToHost));

  std::vector<float> want(ny);
  for (int b = 0; b < c.n; ++b) {
    for (int o = 0; o < c.out; ++o) {
      double s = c.accumulate ? y0[static_cast<size_t>(b) * c.out + o] : 0.0;
      for (int k = 0; k < c.in; ++k) {
        s += static_cast<double>(xr[static_cast<size_t>(b) * c.in + k]) * wr[static_cast<size_t>(o) * c.in + k];
      }
      want[static_cast<size_t>(b) * c.out + o] = static_cast<float>(s);
    }
  }
  const float atol = 2e-5f * std::sqrt(static_cast<float>(c.in)) + 1e-6f;
  EXPECT_TRUE(AllClose(got.data(), want.data(), ny, atol, 1e-5f));
  for (size_t i = ny; i < ny + guard; ++i) ASSERT_TRUE(std::isnan(got[i])) << "guard element " << i - ny << " written";
}

TEST(SkinnyLinearGpuTest, MatchesReference) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  // Every batch size, a k tail (in % 32 != 0), a row tail (out % 16 != 0).
  for (int n = 1; n <= kSkinnyLinearMaxRows; ++n) RunCase({n, 40, 136, n % 2 == 0});
  // Few rows (k split over 8 warps, some with no k at all), long k.
  RunCase({7, 16, 8, false});
  RunCase({3, 24, 4104, true});
  RunCase({16, 100, 2056, false});
  // Many rows: the row-tile-per-block choice grows (RT up to 8, KS down to 1).
  RunCase({9, 8200, 64, false});
  RunCase({8, 20000, 264, true});
  RunCase({1, 70001, 32, false});
}

// ---- SwiGLU epilogue --------------------------------------------------------------

// The fused launch (act_out = SwiGLU(x . W^T)) and the unfused kernel's on
// the same [2 features, in] W (into gu, f32 [n, 2 features]).
std::pair<SkinnyLinearArgs, SkinnyLinearArgs> SwiGLUArgs(const void* x, const void* w, int n, int features, int in,
                                                         void* act, float* gu) {
  SkinnyLinearArgs f;
  f.x = x;
  f.w = w;
  f.n = n;
  f.out = features;
  f.in = in;
  f.act_out = act;
  SkinnyLinearArgs u = f;
  u.act_out = nullptr;
  u.out = 2 * features;
  u.y = gu;
  return {f, u};
}

// Runs the fused kernel (act_out) and the unfused sequence on the same inputs:
// the outputs must be the same bits, and the guard past them untouched.
void RunSwiGLU(int n, int features, int in) {
  SCOPED_TRACE(::testing::Message() << "n=" << n << " features=" << features << " in=" << in);
  GpuBuffer dx = UploadAs(RandomUniform(static_cast<size_t>(n) * in, 3 + n), DType::kBF16, nullptr);
  GpuBuffer dw = UploadAs(RandomUniform(static_cast<size_t>(2) * features * in, 5 + features), DType::kBF16, nullptr);
  const size_t bytes = static_cast<size_t>(n) * features * 2, guard = 64;
  const std::vector<uint8_t> poison(bytes + guard, 0xff);
  GpuBuffer fused(poison.size()), unfused(poison.size()), gu(static_cast<size_t>(n) * 2 * features * sizeof(float));
  PENUMBRA_CUDA_OK(cudaMemcpy(fused.get(), poison.data(), poison.size(), cudaMemcpyHostToDevice));
  PENUMBRA_CUDA_OK(cudaMemcpy(unfused.get(), poison.data(), poison.size(), cudaMemcpyHostToDevice));

  const auto [f, u] = SwiGLUArgs(dx.get(), dw.get(), n, features, in, fused.get(), gu.as<float>());
  ASSERT_TRUE(SkinnyLinearSupported(f, DType::kBF16));
  LaunchSkinnyLinear(f, nullptr);
  ASSERT_TRUE(SkinnyLinearSupported(u, DType::kBF16));
  LaunchSkinnyLinear(u, nullptr);
  LaunchSwiGLU(gu.as<float>(), n, features, unfused.get(), DType::kBF16, nullptr);
  PENUMBRA_CUDA_OK(cudaDeviceSynchronize());

  std::vector<uint8_t> got(poison.size()), want(poison.size());
  PENUMBRA_CUDA_OK(cudaMemcpy(got.data(), fused.get(), got.size(), cudaMemcpyDeviceToHost));
  PENUMBRA_CUDA_OK(cudaMemcpy(want.data(), unfused.get(), want.size(), cudaMemcpyDeviceToHost));
  size_t differ = 0;
  for (size_t k = 0; k < bytes; ++k) differ += got[k] != want[k];
  EXPECT_EQ(differ, 0u) << "bytes of the fused output differing from the unfused sequence's";
  for (size_t k = bytes; k < got.size(); ++k) ASSERT_EQ(got[k], 0xff) << "guard byte " << k - bytes;
  // Not all zeros or NaN: the comparison compared something.
  std::vector<float> vals(static_cast<size_t>(n) * features);
  ConvertToF32(got.data(), DType::kBF16, vals.data(), vals.size());
  size_t finite_nonzero = 0;
  for (float v : vals) finite_nonzero += std::isfinite(v) && v != 0.0f;
  EXPECT_GT(finite_nonzero, vals.size() / 2);
}

TEST(SkinnyLinearGpuTest, FusedSwiGLUGivesTheUnfusedBits) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  for (int n = 1; n <= kSkinnyLinearMaxRows; ++n) RunSwiGLU(n, 20, 136);  // feature tail (20 % 8), k tail
  RunSwiGLU(7, 36, 4104);                                                 // k split over warps
  RunSwiGLU(7, 1000, 4096);
  RunSwiGLU(5, 9000, 64);  // many features: 8 row tiles per block
}

TEST(SkinnyLinearGpuTest, RefusesWhatItCannotTake) {
  SkinnyLinearArgs a;
  alignas(16) static uint8_t buf[64];
  float y = 0;
  a.x = buf;
  a.w = buf;
  a.y = &y;
  a.n = 4;
  a.out = 8;
  a.in = 64;
  EXPECT_TRUE(SkinnyLinearSupported(a, DType::kBF16));
  EXPECT_FALSE(SkinnyLinearSupported(a, DType::kF32));
  EXPECT_FALSE(SkinnyLinearSupported(a, DType::kF16));
  SkinnyLinearArgs b = a;
  b.n = kSkinnyLinearMaxRows + 1;
  EXPECT_FALSE(SkinnyLinearSupported(b, DType::kBF16));
  b = a;
  b.n = 0;
  EXPECT_FALSE(SkinnyLinearSupported(b, DType::kBF16));
  b = a;
  b.in = 60;
  EXPECT_FALSE(SkinnyLinearSupported(b, DType::kBF16));
  b = a;
  b.x = buf + 2;
  EXPECT_FALSE(SkinnyLinearSupported(b, DType::kBF16));
  // The SwiGLU epilogue writes act_out (y unused) and cannot accumulate.
  SkinnyLinearArgs act = a;
  act.y = nullptr;
  act.act_out = buf;
  EXPECT_TRUE(SkinnyLinearSupported(act, DType::kBF16));
  act.accumulate = true;
  EXPECT_FALSE(SkinnyLinearSupported(act, DType::kBF16));
  b = a;
  b.y = nullptr;
  EXPECT_FALSE(SkinnyLinearSupported(b, DType::kBF16));
}

// ---- benchmark (PENUMBRA_KERNEL_BENCH=1) ------------------------------------------

TEST(SkinnyLinearGpuTest, Bench) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  if (!KernelBenchEnabled()) GTEST_SKIP() << "set PENUMBRA_KERNEL_BENCH=1";
  cudaDeviceProp prop;
  PENUMBRA_CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  cublasHandle_t h = nullptr;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  struct Shape {
    const char* name;
    int out, in;
  };
  // Llama-3.1-8B: fused QKV, O, fused gate/up, down, LM head. Each weight is
  // its own allocation larger than L2, so every call reads it from HBM.
  const Shape shapes[] = {{"qkv", 6144, 4096},
                          {"o", 4096, 4096},
                          {"gate_up", 28672, 4096},
                          {"down", 4096, 14336},
                          {"lm_head", 128256, 4096}};
  for (const Shape& s : shapes) {
    const size_t wn = static_cast<size_t>(s.out) * s.in;
    GpuBuffer dw(wn * 2), dx(static_cast<size_t>(kSkinnyLinearMaxRows) * s.in * 2),
        dy(static_cast<size_t>(kSkinnyLinearMaxRows) * s.out * 4),
        dy2(static_cast<size_t>(kSkinnyLinearMaxRows) * s.out * 4);
    PENUMBRA_CUDA_OK(cudaMemset(dw.get(), 0x3c, wn * 2));  // bf16 0x3c3c ~ 0.0115
    PENUMBRA_CUDA_OK(cudaMemset(dx.get(), 0x3c, static_cast<size_t>(kSkinnyLinearMaxRows) * s.in * 2));
    for (int n : {1, 4, 7, 8, 14, 16}) {
      SkinnyLinearArgs a;
      a.x = dx.get();
      a.w = dw.get();
      a.n = n;
      a.out = s.out;
      a.in = s.in;
      a.y = dy.as<float>();
      const float ms = TimeMs([&] { LaunchSkinnyLinear(a, nullptr); }, 20);
      const float alpha = 1.0f, beta = 0.0f;
      const float ms_cublas = TimeMs(
          [&] {
            cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, s.out, n, s.in, &alpha, dw.get(), CUDA_R_16BF, s.in, dx.get(),
                         CUDA_R_16BF, s.in, &beta, dy2.get(), CUDA_R_32F, s.out, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT);
          },
          20);
      PENUMBRA_CUDA_OK(cudaDeviceSynchronize());
      std::vector<float> y1(static_cast<size_t>(n) * s.out), y2(y1.size());
      PENUMBRA_CUDA_OK(cudaMemcpy(y1.data(), dy.get(), y1.size() * 4, cudaMemcpyDeviceToHost));
      PENUMBRA_CUDA_OK(cudaMemcpy(y2.data(), dy2.get(), y2.size() * 4, cudaMemcpyDeviceToHost));
      EXPECT_TRUE(AllClose(y1, y2, 1e-3f, 1e-3f)) << s.name << " n=" << n;
      const double gb = wn * 2.0 / 1e9;
      std::printf(
          "{\"bench\":\"skinny_linear\",\"shape\":\"%s\",\"out\":%d,\"in\":%d,\"n\":%d,\"skinny_ms\":%.4f,"
          "\"skinny_gbps\":%.0f,\"cublas_ms\":%.4f,\"cublas_gbps\":%.0f,\"speedup\":%.3f}\n",
          s.name, s.out, s.in, n, ms, gb / (ms / 1e3), ms_cublas, gb / (ms_cublas / 1e3), ms_cublas / ms);
    }
  }
  cublasDestroy(h);
}

// Fused against unfused at the Llama-3.1-8B gate/up shape (7 rows, a lane of
// the 124928 x 14 pipeline). Kernels alone, back to back; in the pipeline a
// kernel fewer also removes a dependent wait.
TEST(SkinnyLinearGpuTest, BenchSwiGLU) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  if (!KernelBenchEnabled()) GTEST_SKIP() << "set PENUMBRA_KERNEL_BENCH=1";
  const int n = 7, features = 14336, in = 4096;
  GpuBuffer dw(static_cast<size_t>(2) * features * in * 2), dx(static_cast<size_t>(n) * in * 2),
      gu(static_cast<size_t>(n) * 2 * features * 4), act(static_cast<size_t>(n) * features * 2);
  PENUMBRA_CUDA_OK(cudaMemset(dw.get(), 0x3c, static_cast<size_t>(2) * features * in * 2));
  PENUMBRA_CUDA_OK(cudaMemset(dx.get(), 0x3c, static_cast<size_t>(n) * in * 2));
  const auto [f, u] = SwiGLUArgs(dx.get(), dw.get(), n, features, in, act.get(), gu.as<float>());
  const float fused = TimeMs([&] { LaunchSkinnyLinear(f, nullptr); }, 20);
  const float unfused = TimeMs(
      [&] {
        LaunchSkinnyLinear(u, nullptr);
        LaunchSwiGLU(gu.as<float>(), n, features, act.get(), DType::kBF16, nullptr);
      },
      20);
  PENUMBRA_CUDA_OK(cudaDeviceSynchronize());
  std::printf(
      "{\"bench\":\"skinny_swiglu\",\"n\":%d,\"features\":%d,\"in\":%d,\"fused_ms\":%.4f,\"unfused_ms\":%.4f,"
      "\"speedup\":%.3f}\n",
      n, features, in, fused, unfused, unfused / fused);
}

}  // namespace
}  // namespace penumbra::kernels
