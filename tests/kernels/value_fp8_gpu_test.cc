// fp8 values on the GPU (kernels/value_fp8.cuh, ShadowkvFetchVArgs::
// values_fp8) against the format's reference codec (kernels/value_format.h),
// bit for bit: the encoder on bf16 and f32 rows (non-finite values, all-zero
// tokens, tokens of very different ranges among them), the decoder, and the
// dequantizing value fetch from pinned host memory (zero copy) into V slots.
// With PENUMBRA_KERNEL_BENCH=1: the fetch of bf16 rows beside fp8 rows at a
// decode step's shape (14 sequences x 8 KV heads x 256 missed chunks of 8 x
// 128), the time and the bytes that cross the host link.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/shadowkv_decode.cuh"
#include "kernels/value_format.h"
#include "kernels/value_fp8.cuh"
#include "tests/gpu_test_util.h"

namespace penumbra::kernels {
namespace {

using ::penumbra::testing::GpuBuffer;

// Values with what the codec must handle: ranges from 2^-14 to 2^12 by token,
// an all-zero token, NaN and +-Inf here and there, and values that round past
// 448 when scaled.
std::vector<float> TestValues(int64_t rows, int C, int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> x(static_cast<size_t>(rows) * C * d);
  for (int64_t t = 0; t < rows * C; ++t) {
    const float mag = std::ldexp(1.0f, -14 + static_cast<int>(rng() % 27));
    std::normal_distribution<float> n(0.0f, mag);
    for (int j = 0; j < d; ++j) x[t * d + j] = t % 13 == 5 ? 0.0f : n(rng);
    if (t % 7 == 3) x[t * d + rng() % d] = std::numeric_limits<float>::quiet_NaN();
    if (t % 11 == 4)
      x[t * d + rng() % d] =
          (rng() & 1) ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity();
  }
  return x;
}

std::vector<uint8_t> HostEncode(const std::vector<float>& x, int64_t rows, int C, int d) {
  const int64_t rb = ValueRowBytesFp8(C, d);
  std::vector<uint8_t> out(static_cast<size_t>(rows * rb));
  for (int64_t r = 0; r < rows; ++r) EncodeValueRowFp8(x.data() + r * C * d, C, d, out.data() + r * rb);
  return out;
}

// The bits of f32 values rounded to `dtype` (NaNs compared as NaN).
std::vector<uint32_t> Bits(const std::vector<float>& v, DType dtype) {
  std::vector<char> raw(v.size() * DTypeSize(dtype));
  ConvertFromF32(v.data(), raw.data(), dtype, v.size());
  std::vector<uint32_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    uint32_t b = 0;
    std::memcpy(&b, raw.data() + i * DTypeSize(dtype), DTypeSize(dtype));
    float f;
    ConvertToF32(raw.data() + i * DTypeSize(dtype), dtype, &f, 1);
    out[i] = std::isnan(f) ? 0x7fffffffu : b;
  }
  return out;
}

TEST(ValueFp8GpuTest, EncoderAndDecoderMatchTheReferenceBitForBit) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    for (auto [C, d] : {std::pair{8, 128}, std::pair{16, 64}, std::pair{4, 256}, std::pair{1, 16}}) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + " C " + std::to_string(C) + " d " + std::to_string(d));
      const int64_t rows = 37;
      std::vector<float> x = TestValues(rows, C, d, 100 + C + d);
      std::vector<float> rounded;
      GpuBuffer src = ::penumbra::testing::UploadAs(x, dtype, &rounded);
      const int64_t rb = ValueRowBytesFp8(C, d);
      GpuBuffer enc(static_cast<size_t>(rows * rb));
      PENUMBRA_CUDA_OK(cudaMemset(enc.get(), 0xcd, rows * rb));
      LaunchEncodeValuesFp8(src.get(), dtype, rows, C, d, enc.as<uint8_t>(), nullptr);
      std::vector<uint8_t> got(static_cast<size_t>(rows * rb));
      PENUMBRA_CUDA_OK(cudaMemcpy(got.data(), enc.get(), got.size(), cudaMemcpyDeviceToHost));
      const std::vector<uint8_t> want = HostEncode(rounded, rows, C, d);
      int64_t differ = 0;
      for (size_t i = 0; i < want.size(); ++i) differ += got[i] != want[i];
      EXPECT_EQ(differ, 0) << "bytes of the encoded rows differ from the reference";

      GpuBuffer dec(static_cast<size_t>(rows) * C * d * DTypeSize(dtype));
      LaunchDecodeValuesFp8(enc.as<uint8_t>(), rows, C, d, dec.get(), dtype, nullptr);
      std::vector<float> host_dec(static_cast<size_t>(rows) * C * d);
      for (int64_t r = 0; r < rows; ++r) DecodeValueRowFp8(want.data() + r * rb, C, d, host_dec.data() + r * C * d);
      const std::vector<float> gpu_dec = ::penumbra::testing::DownloadAs(dec, dtype, host_dec.size());
      EXPECT_EQ(Bits(gpu_dec, dtype), Bits(host_dec, dtype));
    }
  }
}

// Pinned host memory the GPU reads in place.
struct HostMapped {
  explicit HostMapped(size_t bytes) { CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocMapped) == cudaSuccess); }
  ~HostMapped() { (void)cudaFreeHost(p); }
  void* p = nullptr;
};

template <typename T>
GpuBuffer ToDevice(const std::vector<T>& v) {
  GpuBuffer b(v.size() * sizeof(T));
  CHECK(cudaMemcpy(b.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  return b;
}

// A value store of `batch` sequences (hkv heads x chunk_cap rows each, in
// pinned host memory) and a miss list: each (sequence, head) misses
// `misses` distinct chunks into distinct slots.
struct FetchCase {
  int batch, hkv, d, C, chunk_cap, misses, att_cap;
  bool fp8;
  DType dtype;
  std::vector<std::unique_ptr<HostMapped>> stores;
  std::vector<std::vector<float>> values;  // per sequence: [hkv][chunk_cap][C*d] as stored (decoded for fp8)
  std::vector<int32_t> count, slot, chunk;
  std::unique_ptr<GpuBuffer> dstores, datt_ptrs, dcount, dslot, dchunk;
  std::vector<GpuBuffer> att;
  ShadowkvFetchVArgs args;

  FetchCase(int batch_, int hkv_, int d_, int C_, int chunk_cap_, int misses_, bool fp8_, DType dtype_)
      : batch(batch_),
        hkv(hkv_),
        d(d_),
        C(C_),
        chunk_cap(chunk_cap_),
        misses(misses_),
        att_cap(misses_ * C_ + 32),
        fp8(fp8_),
        dtype(dtype_) {
    const int64_t rb = fp8 ? ValueRowBytesFp8(C, d) : static_cast<int64_t>(C) * d * DTypeSize(dtype);
    std::vector<const void*> sp;
    for (int b = 0; b < batch; ++b) {
      const int64_t rows = static_cast<int64_t>(hkv) * chunk_cap;
      std::vector<float> x = TestValues(rows, C, d, 7 + b);
      stores.push_back(std::make_unique<HostMapped>(static_cast<size_t>(rows * rb)));
      auto* dst = static_cast<uint8_t*>(stores.back()->p);
      std::vector<float> held(x.size());
      if (fp8) {
        std::vector<char> raw(x.size() * DTypeSize(dtype));
        ConvertFromF32(x.data(), raw.data(), dtype, x.size());  // the model's values, as the encoder gets them
        ConvertToF32(raw.data(), dtype, x.data(), x.size());
        std::vector<uint8_t> enc = HostEncode(x, rows, C, d);
        std::memcpy(dst, enc.data(), enc.size());
        for (int64_t r = 0; r < rows; ++r) DecodeValueRowFp8(enc.data() + r * rb, C, d, held.data() + r * C * d);
      } else {
        ConvertFromF32(x.data(), dst, dtype, x.size());
        ConvertToF32(dst, dtype, held.data(), x.size());
      }
      values.push_back(std::move(held));
      sp.push_back(dst);
    }
    std::mt19937 rng(3);
    count.assign(static_cast<size_t>(batch) * hkv, misses);
    slot.resize(static_cast<size_t>(batch) * hkv * misses);
    chunk.resize(slot.size());
    for (int row = 0; row < batch * hkv; ++row) {
      std::vector<int32_t> cs(chunk_cap), ss(misses);
      for (int i = 0; i < chunk_cap; ++i) cs[i] = i;
      for (int i = 0; i < misses; ++i) ss[i] = i;
      std::shuffle(cs.begin(), cs.end(), rng);
      std::shuffle(ss.begin(), ss.end(), rng);
      for (int m = 0; m < misses; ++m) {
        chunk[row * misses + m] = cs[m];
        slot[row * misses + m] = ss[m];
      }
    }
    std::vector<void*> ap;
    for (int b = 0; b < batch; ++b) {
      att.emplace_back(static_cast<size_t>(hkv) * att_cap * d * DTypeSize(dtype));
      ap.push_back(att.back().get());
    }
    dstores = std::make_unique<GpuBuffer>(ToDevice(sp));
    datt_ptrs = std::make_unique<GpuBuffer>(ToDevice(ap));
    dcount = std::make_unique<GpuBuffer>(ToDevice(count));
    dslot = std::make_unique<GpuBuffer>(ToDevice(slot));
    dchunk = std::make_unique<GpuBuffer>(ToDevice(chunk));
    args.value_store = dstores->as<const void* const>();
    args.chunk_cap = chunk_cap;
    args.miss_count = dcount->as<int32_t>();
    args.miss_slot = dslot->as<int32_t>();
    args.miss_chunk = dchunk->as<int32_t>();
    args.miss_stride = misses;
    args.att_v = datt_ptrs->as<void* const>();
    args.att_head_stride = static_cast<int64_t>(att_cap) * d;
    args.outlier_rows = 16;
    args.dtype = dtype;
    args.values_fp8 = fp8;
    args.batch = batch;
    args.hkv = hkv;
    args.d = d;
    args.chunk_size = C;
    args.max_misses = misses;
  }
  double link_bytes() const {
    return static_cast<double>(batch) * hkv * misses *
           (fp8 ? ValueRowBytesFp8(C, d) : static_cast<double>(C) * d * DTypeSize(dtype));
  }
};

TEST(ValueFp8GpuTest, TheFetchDequantizesEachMissedChunkIntoItsSlot) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    SCOPED_TRACE(DTypeName(dtype));
    FetchCase f(3, 2, 128, 8, 40, 17, /*fp8=*/true, dtype);
    LaunchShadowkvFetchV(f.args, nullptr);
    PENUMBRA_CUDA_OK(cudaDeviceSynchronize());
    for (int b = 0; b < f.batch; ++b) {
      const std::vector<float> v =
          ::penumbra::testing::DownloadAs(f.att[b], dtype, static_cast<size_t>(f.hkv) * f.att_cap * f.d);
      for (int h = 0; h < f.hkv; ++h) {
        const int row = b * f.hkv + h;
        for (int m = 0; m < f.misses; ++m) {
          const int c = f.chunk[row * f.misses + m], s = f.slot[row * f.misses + m];
          std::vector<float> want(f.values[b].begin() + (static_cast<int64_t>(h) * f.chunk_cap + c) * f.C * f.d,
                                  f.values[b].begin() + (static_cast<int64_t>(h) * f.chunk_cap + c + 1) * f.C * f.d);
          std::vector<float> got(v.begin() + (static_cast<int64_t>(h) * f.att_cap + 16 + s * f.C) * f.d,
                                 v.begin() + (static_cast<int64_t>(h) * f.att_cap + 16 + (s + 1) * f.C) * f.d);
          ASSERT_EQ(Bits(got, dtype), Bits(want, dtype)) << "sequence " << b << " head " << h << " miss " << m;
        }
      }
    }
  }
}

TEST(ValueFp8GpuTest, BenchFetchBf16BesideFp8) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  if (!::penumbra::testing::KernelBenchEnabled()) GTEST_SKIP() << "set PENUMBRA_KERNEL_BENCH=1";
  cudaStream_t s;
  PENUMBRA_CUDA_OK(cudaStreamCreate(&s));
  for (int round = 0; round < 2; ++round) {
    for (bool fp8 : {false, true}) {
      FetchCase f(14, 8, 128, 8, 2048, 256, fp8, DType::kBF16);
      cudaEvent_t e0, e1;
      PENUMBRA_CUDA_OK(cudaEventCreate(&e0));
      PENUMBRA_CUDA_OK(cudaEventCreate(&e1));
      LaunchShadowkvFetchV(f.args, s);  // warm
      constexpr int kIters = 20;
      PENUMBRA_CUDA_OK(cudaEventRecord(e0, s));
      for (int i = 0; i < kIters; ++i) LaunchShadowkvFetchV(f.args, s);
      PENUMBRA_CUDA_OK(cudaEventRecord(e1, s));
      PENUMBRA_CUDA_OK(cudaEventSynchronize(e1));
      float ms = 0;
      PENUMBRA_CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
      ms /= kIters;
      const double chunks = 14.0 * 8 * 256;
      std::printf(
          "{\"bench\": \"value-fetch\", \"value_format\": \"%s\", \"round\": %d, \"batch\": 14, \"hkv\": 8, "
          "\"misses_per_head\": 256, \"chunk_tokens\": 8, \"d\": 128, \"ms\": %.4f, \"link_gb_per_s\": %.2f, "
          "\"chunks_per_ms\": %.1f, \"bf16_gb_per_s_equivalent\": %.2f}\n",
          fp8 ? "fp8" : "bf16", round, ms, f.link_bytes() / (ms * 1e-3) / 1e9, chunks / ms,
          chunks * 8 * 128 * 2 / (ms * 1e-3) / 1e9);
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
    }
  }
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace penumbra::kernels
