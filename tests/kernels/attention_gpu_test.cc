// CUDA attention (prefill and decode) against the CPU reference run on the same
// dtype-rounded inputs. Every output element is compared; outputs are poisoned
// with NaN first and the unused tail of each KV head is NaN, so unwritten
// outputs and reads past a sequence's keys both fail. Decode with a slot mask
// also holds NaN in the masked (empty-slot) rows, so reading one fails too.
//
// With PENUMBRA_KERNEL_BENCH=1, AttentionGpuBench prints prefill TFLOP/s and
// decode GB/s at the Llama-3.1-8B shape (hq=32, hkv=8, d=128, bf16).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "common/dtype.h"
#include "kernels/attention_decode.cuh"
#include "kernels/attention_merge.cuh"
#include "kernels/attention_prefill.cuh"
#include "kernels/attention_prefix.cuh"
#include "kernels/cpu/ops.h"
#include "tests/gpu_test_util.h"
#include "tests/test_util.h"

namespace penumbra::kernels {
namespace {

using ::penumbra::testing::AllClose;
using ::penumbra::testing::KernelBenchEnabled;
using ::penumbra::testing::TimeMs;

// Device buffer freed on scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&ptr_, std::max<size_t>(bytes, 1)) != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

// Fast deterministic uniform [-1, 1) (splitmix64).
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  float Next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
  }

 private:
  uint64_t s_;
};

// A tensor of random values held as f32 already rounded to `dtype`, plus its
// bytes in `dtype`.
struct HostTensor {
  std::vector<float> f32;
  std::vector<uint8_t> raw;
};

HostTensor MakeTensor(size_t n, DType dtype, Rng& rng) {
  HostTensor t;
  t.f32.resize(n);
  for (auto& x : t.f32) x = rng.Next();
  t.raw.resize(n * DTypeSize(dtype));
  ConvertFromF32(t.f32.data(), t.raw.data(), dtype, n);
  ConvertToF32(t.raw.data(), dtype, t.f32.data(), n);
  return t;
}

// KV cache of one sequence: [hkv][capacity][d], keys past `keys` set to NaN.
HostTensor MakeCache(int hkv, int capacity, int keys, int d, DType dtype, Rng& rng) {
  const size_t n = static_cast<size_t>(hkv) * capacity * d;
  HostTensor t;
  t.f32.resize(n);
  for (int h = 0; h < hkv; ++h)
    for (int64_t i = 0; i < static_cast<int64_t>(capacity) * d; ++i)
      t.f32[h * static_cast<size_t>(capacity) * d + i] = i < static_cast<int64_t>(keys) * d ? rng.Next() : NAN;
  t.raw.resize(n * DTypeSize(dtype));
  ConvertFromF32(t.f32.data(), t.raw.data(), dtype, n);
  ConvertToF32(t.raw.data(), dtype, t.f32.data(), n);
  return t;
}

void Upload(const DeviceBuffer& dst, const void* src, size_t bytes) {
  ASSERT_EQ(cudaMemcpy(dst.get(), src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
}

// Fills a device buffer with NaN in `dtype` (bf16 0x7fc0, f32 0x7fc00000).
void PoisonNaN(const DeviceBuffer& buf, size_t n, DType dtype) {
  std::vector<float> nan(n, NAN);
  std::vector<uint8_t> raw(n * DTypeSize(dtype));
  ConvertFromF32(nan.data(), raw.data(), dtype, n);
  Upload(buf, raw.data(), raw.size());
}

std::vector<float> Download(const DeviceBuffer& src, size_t n, DType dtype) {
  std::vector<uint8_t> raw(n * DTypeSize(dtype));
  EXPECT_EQ(cudaMemcpy(raw.data(), src.get(), raw.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<float> out(n);
  ConvertToF32(raw.data(), dtype, out.data(), n);
  return out;
}

float Tolerance(DType dtype) { return dtype == DType::kF32 ? 1e-4f : 2e-2f; }

// ---- prefill -------------------------------------------------------------------

struct PrefillCase {
  int q_start, nq, hq, hkv, d;
  DType dtype;
};

const char* PathName(PrefillPath p) {
  switch (p) {
    case PrefillPath::kAuto:
      return "auto";
    case PrefillPath::kWgmma:
      return "wgmma";
    case PrefillPath::kMma:
      return "mma.sync";
    case PrefillPath::kGeneric:
      return "generic";
  }
  return "?";
}

void RunPrefillCase(const PrefillCase& c, uint64_t seed, PrefillPath path = PrefillPath::kAuto) {
  SCOPED_TRACE(::testing::Message() << "prefill path " << PathName(path) << " q_start " << c.q_start << " nq " << c.nq
                                    << " keys " << c.q_start + c.nq << " hq " << c.hq << " hkv " << c.hkv << " d "
                                    << c.d << " dtype " << DTypeName(c.dtype));
  Rng rng(seed);
  const int keys = c.q_start + c.nq, capacity = keys + 3;
  const int64_t head_stride = static_cast<int64_t>(capacity) * c.d;
  const size_t nq_elems = static_cast<size_t>(c.nq) * c.hq * c.d;
  HostTensor q = MakeTensor(nq_elems, c.dtype, rng);
  HostTensor k = MakeCache(c.hkv, capacity, keys, c.d, c.dtype, rng);
  HostTensor v = MakeCache(c.hkv, capacity, keys, c.d, c.dtype, rng);
  DeviceBuffer dq(q.raw.size()), dk(k.raw.size()), dv(v.raw.size()), dout(q.raw.size());
  ASSERT_NE(dq.get(), nullptr);
  ASSERT_NE(dk.get(), nullptr);
  ASSERT_NE(dv.get(), nullptr);
  ASSERT_NE(dout.get(), nullptr);
  Upload(dq, q.raw.data(), q.raw.size());
  Upload(dk, k.raw.data(), k.raw.size());
  Upload(dv, v.raw.data(), v.raw.size());
  PoisonNaN(dout, nq_elems, c.dtype);
  const size_t lse_n = static_cast<size_t>(c.nq) * c.hq;
  DeviceBuffer dlse(lse_n * sizeof(float));
  PoisonNaN(dlse, lse_n, DType::kF32);

  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  PrefillAttentionArgs a;
  a.q = dq.get();
  a.k = dk.get();
  a.v = dv.get();
  a.out = dout.get();
  a.dtype = c.dtype;
  a.head_stride = head_stride;
  a.q_start = c.q_start;
  a.nq = c.nq;
  a.hq = c.hq;
  a.hkv = c.hkv;
  a.d = c.d;
  a.scale = scale;
  a.path = path;
  a.lse = static_cast<float*>(dlse.get());
  LaunchPrefillAttention(a, nullptr);
  PENUMBRA_CUDA_OK(cudaGetLastError());
  PENUMBRA_CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> got = Download(dout, nq_elems, c.dtype);
  std::vector<float> got_lse = Download(dlse, lse_n, DType::kF32);

  std::vector<float> expect(nq_elems);
  cpu::PrefillAttentionArgs r;
  r.q = q.f32.data();
  r.k = k.f32.data();
  r.v = v.f32.data();
  r.out = expect.data();
  r.head_stride = head_stride;
  r.q_start = c.q_start;
  r.nq = c.nq;
  r.hq = c.hq;
  r.hkv = c.hkv;
  r.d = c.d;
  r.scale = scale;
  std::vector<float> expect_lse(lse_n);
  r.lse = expect_lse.data();
  cpu::PrefillAttention(r);
  EXPECT_TRUE(AllClose(got_lse, expect_lse, 1e-3f, 1e-4f)) << "log-sum-exp";
  if (c.dtype != DType::kF32) {  // the reference output rounded like the kernel's
    std::vector<uint8_t> raw(nq_elems * DTypeSize(c.dtype));
    ConvertFromF32(expect.data(), raw.data(), c.dtype, nq_elems);
    ConvertToF32(raw.data(), c.dtype, expect.data(), nq_elems);
  }
  EXPECT_TRUE(AllClose(got, expect, Tolerance(c.dtype), Tolerance(c.dtype)));
}

TEST(AttentionGpuTest, PrefillBf16FastPath) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  const PrefillCase cases[] = {
      // keys 1, 7, 129, 1000, 4097; nq 1, 17, 200, 640; GQA 1..8.
      {0, 1, 1, 1, 128, DType::kBF16},    {0, 7, 4, 1, 128, DType::kBF16},      {112, 17, 8, 2, 128, DType::kBF16},
      {0, 129, 8, 8, 128, DType::kBF16},  {800, 200, 32, 8, 128, DType::kBF16}, {3457, 640, 32, 8, 128, DType::kBF16},
      {4096, 1, 8, 1, 128, DType::kBF16}, {0, 640, 6, 3, 128, DType::kBF16},    {360, 640, 14, 2, 128, DType::kBF16},
      {0, 1000, 5, 5, 128, DType::kBF16}, {0, 1, 2, 1, 64, DType::kBF16},       {0, 200, 16, 2, 64, DType::kBF16},
      {983, 17, 4, 4, 64, DType::kBF16},  {3457, 640, 8, 1, 64, DType::kBF16},  {64, 129, 6, 2, 64, DType::kBF16},
      {0, 300, 4, 1, 128, DType::kBF16},  {5000, 300, 8, 2, 64, DType::kBF16},
  };
  // Both tensor-core kernels (wgmma falls back to mma.sync off Hopper).
  for (PrefillPath path : {PrefillPath::kWgmma, PrefillPath::kMma}) {
    uint64_t seed = 11;
    for (const auto& c : cases) RunPrefillCase(c, seed++, path);
  }
}

TEST(AttentionGpuTest, PrefillGenericPath) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  const PrefillCase cases[] = {
      {0, 1, 1, 1, 8, DType::kF32},      {0, 7, 2, 1, 8, DType::kF32},       {5, 17, 4, 2, 8, DType::kF32},
      {983, 17, 8, 1, 8, DType::kF32},   {0, 200, 6, 6, 8, DType::kF32},     {0, 129, 4, 4, 64, DType::kF32},
      {800, 200, 8, 2, 64, DType::kF32}, {3457, 640, 2, 1, 64, DType::kF32}, {7, 17, 4, 1, 128, DType::kF32},
      {0, 17, 4, 2, 8, DType::kBF16},    {112, 17, 3, 1, 96, DType::kBF16},
  };
  uint64_t seed = 101;
  for (const auto& c : cases) RunPrefillCase(c, seed++);
}

// ---- decode --------------------------------------------------------------------

// A decode case's slot mask (DecodeAttentionArgs::slot_maps): keys [row0,
// row0 + count * rows) form `count` slots of `rows` keys; slot s of sequence
// b, KV head h is empty when empty(b, h, s). count 0: no mask.
struct DecodeMask {
  int row0 = 0, count = 0, rows = 0;
  bool (*empty)(int b, int h, int s) = nullptr;
  // DecodeAttentionArgs::slot_values: slot s holds chunk count - 1 - s, and
  // the chunks below count / 2 + 1 have their V rows in a document's values
  // ([hkv][count + 3][rows * d]), NaN in the sequence's V; the reference
  // attends to the rows where they were.
  bool in_place = false;
};

struct DecodeCase {
  std::vector<int32_t> lengths;
  int hq, hkv, d;
  DType dtype;
  int extra_max_length = 0;       // max_length = max(lengths) + this
  double workspace_fraction = 1;  // < 1: a smaller workspace than asked for
  DecodeMask mask = {};
};

// Sets the rows of empty slots of one sequence's cache ([hkv][capacity][d])
// to NaN: a kernel that reads one into the result fails the comparison.
void PoisonEmptySlots(HostTensor& t, const DecodeMask& m, int b, int hkv, int capacity, int d, DType dtype) {
  for (int h = 0; h < hkv; ++h)
    for (int s = 0; s < m.count; ++s) {
      if (!m.empty(b, h, s)) continue;
      const int64_t r0 = m.row0 + static_cast<int64_t>(s) * m.rows, r1 = std::min<int64_t>(r0 + m.rows, capacity);
      for (int64_t r = r0; r < r1; ++r)
        std::fill_n(t.f32.begin() + (static_cast<int64_t>(h) * capacity + r) * d, d, NAN);
    }
  ConvertFromF32(t.f32.data(), t.raw.data(), dtype, t.f32.size());
}

void RunDecodeCase(const DecodeCase& c, uint64_t seed) {
  const int batch = static_cast<int>(c.lengths.size());
  const int max_len = *std::max_element(c.lengths.begin(), c.lengths.end());
  SCOPED_TRACE(::testing::Message() << "decode batch " << batch << " max length " << max_len << " hq " << c.hq
                                    << " hkv " << c.hkv << " d " << c.d << " dtype " << DTypeName(c.dtype)
                                    << " workspace fraction " << c.workspace_fraction << " slots " << c.mask.count
                                    << " x " << c.mask.rows << " from row " << c.mask.row0);
  Rng rng(seed);
  const int capacity = max_len + 5;
  const int64_t head_stride = static_cast<int64_t>(capacity) * c.d;
  const size_t q_elems = static_cast<size_t>(batch) * c.hq * c.d;
  HostTensor q = MakeTensor(q_elems, c.dtype, rng);
  std::vector<HostTensor> k, v;
  std::vector<std::unique_ptr<DeviceBuffer>> dk, dv;
  std::vector<const void*> kp, vp;
  std::vector<const float*> kp_host, vp_host;
  // Slot maps: an empty slot -1, else any chunk id (its own index).
  std::vector<std::vector<int32_t>> maps;
  std::vector<std::unique_ptr<DeviceBuffer>> dmaps;
  std::vector<const int32_t*> mp, mp_host;
  const int doc_stride = c.mask.count + 3, doc_chunks = c.mask.count / 2 + 1;
  std::vector<std::vector<float>> v_ref;  // in place: each sequence's V as the reference reads it
  std::vector<std::unique_ptr<DeviceBuffer>> ddoc;
  std::vector<const void*> docp;
  for (int b = 0; b < batch; ++b) {
    k.push_back(MakeCache(c.hkv, capacity, c.lengths[b], c.d, c.dtype, rng));
    v.push_back(MakeCache(c.hkv, capacity, c.lengths[b], c.d, c.dtype, rng));
    if (c.mask.count > 0) {
      PoisonEmptySlots(k.back(), c.mask, b, c.hkv, capacity, c.d, c.dtype);
      PoisonEmptySlots(v.back(), c.mask, b, c.hkv, capacity, c.d, c.dtype);
      maps.emplace_back(static_cast<size_t>(c.hkv) * c.mask.count);
      for (int h = 0; h < c.hkv; ++h)
        for (int s = 0; s < c.mask.count; ++s)
          maps.back()[h * c.mask.count + s] = c.mask.empty(b, h, s) ? -1 : c.mask.in_place ? c.mask.count - 1 - s : s;
      if (c.mask.in_place) {
        v_ref.push_back(v.back().f32);
        std::vector<float> doc(static_cast<size_t>(c.hkv) * doc_stride * c.mask.rows * c.d, NAN);
        for (int h = 0; h < c.hkv; ++h)
          for (int s = 0; s < c.mask.count; ++s) {
            const int chunk = maps.back()[h * c.mask.count + s];
            if (chunk < 0 || chunk >= doc_chunks) continue;
            for (int i = 0; i < c.mask.rows; ++i) {
              const int64_t key = c.mask.row0 + static_cast<int64_t>(s) * c.mask.rows + i;
              if (key >= capacity) break;
              float* att = v.back().f32.data() + (static_cast<int64_t>(h) * capacity + key) * c.d;
              std::copy_n(att, c.d,
                          doc.begin() + ((static_cast<int64_t>(h) * doc_stride + chunk) * c.mask.rows + i) * c.d);
              std::fill_n(att, c.d, NAN);
            }
          }
        ConvertFromF32(v.back().f32.data(), v.back().raw.data(), c.dtype, v.back().f32.size());
        std::vector<uint8_t> raw(doc.size() * DTypeSize(c.dtype));
        ConvertFromF32(doc.data(), raw.data(), c.dtype, doc.size());
        ddoc.push_back(std::make_unique<DeviceBuffer>(raw.size()));
        Upload(*ddoc.back(), raw.data(), raw.size());
        docp.push_back(ddoc.back()->get());
      }
      dmaps.push_back(std::make_unique<DeviceBuffer>(maps.back().size() * sizeof(int32_t)));
      Upload(*dmaps.back(), maps.back().data(), maps.back().size() * sizeof(int32_t));
      mp.push_back(static_cast<const int32_t*>(dmaps.back()->get()));
      mp_host.push_back(maps.back().data());
    }
    dk.push_back(std::make_unique<DeviceBuffer>(k.back().raw.size()));
    dv.push_back(std::make_unique<DeviceBuffer>(v.back().raw.size()));
    ASSERT_NE(dk.back()->get(), nullptr);
    ASSERT_NE(dv.back()->get(), nullptr);
    Upload(*dk.back(), k.back().raw.data(), k.back().raw.size());
    Upload(*dv.back(), v.back().raw.data(), v.back().raw.size());
    kp.push_back(dk.back()->get());
    vp.push_back(dv.back()->get());
    kp_host.push_back(k.back().f32.data());
    vp_host.push_back(c.mask.in_place ? v_ref.back().data() : v.back().f32.data());
  }
  DeviceBuffer dq(q.raw.size()), dout(q.raw.size());
  DeviceBuffer dkp(sizeof(void*) * batch), dvp(sizeof(void*) * batch), dlen(sizeof(int32_t) * batch);
  DeviceBuffer dmp(sizeof(void*) * batch), ddocp(sizeof(void*) * batch);
  if (c.mask.in_place) Upload(ddocp, docp.data(), sizeof(void*) * batch);
  Upload(dq, q.raw.data(), q.raw.size());
  Upload(dkp, kp.data(), sizeof(void*) * batch);
  Upload(dvp, vp.data(), sizeof(void*) * batch);
  if (c.mask.count > 0) Upload(dmp, mp.data(), sizeof(void*) * batch);
  Upload(dlen, c.lengths.data(), sizeof(int32_t) * batch);
  PoisonNaN(dout, q_elems, c.dtype);
  const int max_length = max_len + c.extra_max_length;
  const size_t ws_bytes = static_cast<size_t>(
      static_cast<double>(DecodeAttentionWorkspaceBytes(batch, c.hq, c.d, max_length)) * c.workspace_fraction);
  DeviceBuffer ws(ws_bytes);
  ASSERT_NE(ws.get(), nullptr);
  PENUMBRA_CUDA_OK(cudaMemset(ws.get(), 0xff, ws_bytes));  // NaN pattern
  const size_t lse_n = static_cast<size_t>(batch) * c.hq;
  DeviceBuffer dlse(lse_n * sizeof(float));
  PoisonNaN(dlse, lse_n, DType::kF32);

  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  DecodeAttentionArgs a;
  a.q = dq.get();
  a.k = static_cast<const void* const*>(dkp.get());
  a.v = static_cast<const void* const*>(dvp.get());
  a.lengths = static_cast<const int32_t*>(dlen.get());
  a.out = dout.get();
  a.dtype = c.dtype;
  a.head_stride = head_stride;
  a.batch = batch;
  a.hq = c.hq;
  a.hkv = c.hkv;
  a.d = c.d;
  a.max_length = max_length;
  a.scale = scale;
  a.workspace = ws.get();
  a.workspace_bytes = ws_bytes;
  a.lse = static_cast<float*>(dlse.get());
  if (c.mask.count > 0) {
    a.slot_maps = static_cast<const int32_t* const*>(dmp.get());
    a.slot_row0 = c.mask.row0;
    a.slot_count = c.mask.count;
    a.slot_rows = c.mask.rows;
    if (c.mask.in_place) {
      a.slot_values = static_cast<const void* const*>(ddocp.get());
      a.slot_values_stride = doc_stride;
      a.slot_values_chunks = doc_chunks;
    }
  }
  LaunchDecodeAttention(a, nullptr);
  PENUMBRA_CUDA_OK(cudaGetLastError());
  PENUMBRA_CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> got = Download(dout, q_elems, c.dtype);
  std::vector<float> got_lse = Download(dlse, lse_n, DType::kF32);

  std::vector<float> expect(q_elems);
  cpu::DecodeAttentionArgs r;
  r.q = q.f32.data();
  r.k = kp_host.data();
  r.v = vp_host.data();
  r.lengths = c.lengths.data();
  r.out = expect.data();
  r.head_stride = head_stride;
  r.batch = batch;
  r.hq = c.hq;
  r.hkv = c.hkv;
  r.d = c.d;
  r.scale = scale;
  std::vector<float> expect_lse(lse_n);
  r.lse = expect_lse.data();
  if (c.mask.count > 0) {
    r.slot_maps = mp_host.data();
    r.slot_row0 = c.mask.row0;
    r.slot_count = c.mask.count;
    r.slot_rows = c.mask.rows;
  }
  cpu::DecodeAttention(r);
  EXPECT_TRUE(AllClose(got_lse, expect_lse, 1e-3f, 1e-4f)) << "log-sum-exp";
  if (c.dtype != DType::kF32) {
    std::vector<uint8_t> raw(q_elems * DTypeSize(c.dtype));
    ConvertFromF32(expect.data(), raw.data(), c.dtype, q_elems);
    ConvertToF32(raw.data(), c.dtype, expect.data(), q_elems);
  }
  EXPECT_TRUE(AllClose(got, expect, Tolerance(c.dtype), Tolerance(c.dtype)));
}

TEST(AttentionGpuTest, DecodeBf16FastPath) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  const DecodeCase cases[] = {
      {{1, 70000, 129, 4097}, 32, 8, 128, DType::kBF16},
      {{7, 1000}, 8, 1, 128, DType::kBF16},
      {{1}, 2, 1, 128, DType::kBF16},
      {{4097, 1, 300, 256, 257}, 4, 4, 128, DType::kBF16, 100},
      {{1000, 7, 1, 129}, 16, 8, 128, DType::kBF16},
      {{70000, 3}, 32, 8, 128, DType::kBF16, 0, 0.05},  // reduced workspace: fewer splits
      {{6000, 6001, 1, 17, 5999, 4096, 2, 3, 9000}, 32, 4, 128, DType::kBF16},
      // head_dim 64 (the evaluation model's shape), every supported group.
      {{16384, 1, 63, 65, 4097}, 8, 4, 64, DType::kBF16},
      {{3000, 15, 16, 17}, 8, 1, 64, DType::kBF16},
      {{129, 70000}, 4, 4, 64, DType::kBF16},
      {{1, 2, 255, 257}, 16, 2, 64, DType::kBF16},
  };
  uint64_t seed = 1001;
  for (const auto& c : cases) RunDecodeCase(c, seed++);
}

TEST(AttentionGpuTest, DecodeGenericPath) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  const DecodeCase cases[] = {
      {{1, 7, 129}, 4, 2, 8, DType::kF32},       {{1000, 1, 4097}, 8, 2, 64, DType::kF32},
      {{70000, 5}, 4, 1, 64, DType::kF32},       {{129, 1}, 8, 8, 128, DType::kF32},
      {{300, 1, 4097}, 6, 2, 128, DType::kBF16},  // group 3: generic bf16
      {{77, 1}, 4, 2, 64, DType::kBF16},         {{513}, 2, 1, 8, DType::kBF16, 50},
  };
  uint64_t seed = 2001;
  for (const auto& c : cases) RunDecodeCase(c, seed++);
}

// Slot-mask patterns (DecodeMask::empty).
// Every third slot, a run of 700 slots (whole splits of masked keys) and every
// slot of sequence 2's KV head 5 (only its rows below the slots remain).
bool EmptyThirdsAndRun(int b, int h, int s) { return s % 3 == 0 || (s >= 1000 && s < 1700) || (b == 2 && h == 5); }
// Every slot of sequence 0 (with row0 = 0 and length count * rows: no key
// left, out 0 and lse -inf), odd slots elsewhere.
bool EmptyAllOfFirst(int b, int h, int s) { return b == 0 || s % 2 == 1; }
// A few slots, and every slot of KV head 0 in sequence 1.
bool EmptySome(int b, int h, int s) { return s % 7 == 2 || s % 11 == 5 || (b == 1 && h == 0); }

TEST(AttentionGpuTest, DecodeSlotMaskBf16FastPath) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  const DecodeCase cases[] = {
      // Outlier rows [0, 24), 4096 slots of 8 keys, then the window.
      {{1, 70000, 4097, 300}, 32, 8, 128, DType::kBF16, 0, 1, {24, 4096, 8, EmptyThirdsAndRun}},
      {{64, 1000, 40}, 8, 2, 128, DType::kBF16, 0, 1, {0, 8, 8, EmptyAllOfFirst}},
      {{5000, 17, 129}, 16, 4, 128, DType::kBF16, 0, 1, {16, 300, 16, EmptySome}},
      {{5000, 17}, 16, 4, 64, DType::kBF16, 0, 1, {16, 300, 16, EmptySome}},
      {{64, 3}, 4, 1, 64, DType::kBF16, 0, 1, {0, 8, 8, EmptyAllOfFirst}},
  };
  uint64_t seed = 3001;
  for (const auto& c : cases) RunDecodeCase(c, seed++);
}

// V rows of a document's chunks read in place (DecodeAttentionArgs::
// slot_values), beside empty slots, on both paths.
TEST(AttentionGpuTest, DecodeSlotValuesInPlace) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  const DecodeCase cases[] = {
      {{1, 70000, 4097, 300}, 32, 8, 128, DType::kBF16, 0, 1, {24, 4096, 8, EmptyThirdsAndRun, true}},
      {{5000, 17, 129}, 16, 4, 128, DType::kBF16, 0, 1, {16, 300, 16, EmptySome, true}},
      {{5000, 17}, 16, 4, 64, DType::kBF16, 0, 1, {16, 300, 16, EmptySome, true}},
      {{1000, 129, 4097}, 8, 2, 64, DType::kF32, 0, 1, {8, 100, 8, EmptySome, true}},  // generic
      {{300, 77}, 6, 2, 128, DType::kBF16, 0, 1, {5, 30, 8, EmptySome, true}},         // group 3: generic bf16
  };
  uint64_t seed = 5001;
  for (const auto& c : cases) RunDecodeCase(c, seed++);
}

TEST(AttentionGpuTest, DecodeSlotMaskGenericPath) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  const DecodeCase cases[] = {
      {{1000, 129, 4097}, 8, 2, 64, DType::kF32, 0, 1, {8, 100, 8, EmptySome}},
      {{64, 300}, 4, 2, 8, DType::kF32, 0, 1, {0, 8, 8, EmptyAllOfFirst}},
      {{20000, 5, 9000}, 4, 1, 64, DType::kF32, 0, 1, {8, 2000, 8, EmptyThirdsAndRun}},
      {{300, 77}, 6, 2, 128, DType::kBF16, 0, 1, {5, 30, 8, EmptySome}},  // group 3: generic bf16
      {{64, 2000}, 6, 2, 128, DType::kBF16, 0, 1, {0, 8, 8, EmptyAllOfFirst}},
  };
  uint64_t seed = 4001;
  for (const auto& c : cases) RunDecodeCase(c, seed++);
}

// ---- prefix attention (cascade) ------------------------------------------------

struct PrefixCase {
  int batch, keys;            // sequences in the batch, prefix keys
  std::vector<int32_t> rows;  // attached rows
  int hq, hkv, d;
  DType dtype;
  bool own = true;  // merge into an own part (decode with lse) or overwrite
  PrefixPath path = PrefixPath::kAuto;
};

// Runs the own part (decode over each sequence's own keys, with its lse) and
// PrefixAttention on the GPU and the same two CPU reference ops, and compares
// every output row (rows not attached keep their own part).
void RunPrefixCase(const PrefixCase& c, uint64_t seed) {
  const int n = static_cast<int>(c.rows.size());
  SCOPED_TRACE(::testing::Message() << "prefix batch " << c.batch << " attached " << n << " keys " << c.keys << " hq "
                                    << c.hq << " hkv " << c.hkv << " d " << c.d << " dtype " << DTypeName(c.dtype)
                                    << " own " << c.own << " path "
                                    << (c.path == PrefixPath::kGeneric ? "generic" : "auto"));
  Rng rng(seed);
  const int own_cap = 40;
  const int64_t own_stride = static_cast<int64_t>(own_cap) * c.d, pre_stride = static_cast<int64_t>(c.keys + 3) * c.d;
  const size_t q_elems = static_cast<size_t>(c.batch) * c.hq * c.d;
  HostTensor q = MakeTensor(q_elems, c.dtype, rng);
  HostTensor pk = MakeCache(c.hkv, c.keys + 3, c.keys, c.d, c.dtype, rng);
  HostTensor pv = MakeCache(c.hkv, c.keys + 3, c.keys, c.d, c.dtype, rng);
  std::vector<int32_t> lengths(c.batch);
  std::vector<HostTensor> k, v;
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  std::vector<const void*> kp, vp;
  std::vector<const float*> kp_host, vp_host;
  for (int b = 0; b < c.batch; ++b) {
    lengths[b] = 1 + static_cast<int>((rng.Next() + 1.0f) * 0.5f * (own_cap - 1));
    k.push_back(MakeCache(c.hkv, own_cap, lengths[b], c.d, c.dtype, rng));
    v.push_back(MakeCache(c.hkv, own_cap, lengths[b], c.d, c.dtype, rng));
    for (HostTensor* t : {&k.back(), &v.back()}) {
      bufs.push_back(std::make_unique<DeviceBuffer>(t->raw.size()));
      Upload(*bufs.back(), t->raw.data(), t->raw.size());
    }
    kp.push_back(bufs[bufs.size() - 2]->get());
    vp.push_back(bufs.back()->get());
    kp_host.push_back(k.back().f32.data());
    vp_host.push_back(v.back().f32.data());
  }
  DeviceBuffer dq(q.raw.size()), dout(q.raw.size()), dpk(pk.raw.size()), dpv(pv.raw.size());
  DeviceBuffer dkp(sizeof(void*) * c.batch), dvp(sizeof(void*) * c.batch), dlen(sizeof(int32_t) * c.batch);
  DeviceBuffer drows(sizeof(int32_t) * n), dlse(sizeof(float) * c.batch * c.hq);
  Upload(dq, q.raw.data(), q.raw.size());
  Upload(dpk, pk.raw.data(), pk.raw.size());
  Upload(dpv, pv.raw.data(), pv.raw.size());
  Upload(dkp, kp.data(), sizeof(void*) * c.batch);
  Upload(dvp, vp.data(), sizeof(void*) * c.batch);
  Upload(dlen, lengths.data(), sizeof(int32_t) * c.batch);
  Upload(drows, c.rows.data(), sizeof(int32_t) * n);
  PoisonNaN(dout, q_elems, c.dtype);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));

  std::vector<float> expect(q_elems, 0.0f), expect_lse(static_cast<size_t>(c.batch) * c.hq);
  if (c.own) {
    DecodeAttentionArgs a;
    a.q = dq.get();
    a.k = static_cast<const void* const*>(dkp.get());
    a.v = static_cast<const void* const*>(dvp.get());
    a.lengths = static_cast<const int32_t*>(dlen.get());
    a.out = dout.get();
    a.lse = static_cast<float*>(dlse.get());
    a.dtype = c.dtype;
    a.head_stride = own_stride;
    a.batch = c.batch;
    a.hq = c.hq;
    a.hkv = c.hkv;
    a.d = c.d;
    a.max_length = own_cap;
    a.scale = scale;
    const size_t ws_bytes = DecodeAttentionWorkspaceBytes(c.batch, c.hq, c.d, own_cap);
    DeviceBuffer ws(ws_bytes);
    a.workspace = ws.get();
    a.workspace_bytes = ws_bytes;
    LaunchDecodeAttention(a, nullptr);
    PENUMBRA_CUDA_OK(cudaDeviceSynchronize());
    cpu::DecodeAttentionArgs r;
    r.q = q.f32.data();
    r.k = kp_host.data();
    r.v = vp_host.data();
    r.lengths = lengths.data();
    r.out = expect.data();
    r.lse = expect_lse.data();
    r.head_stride = own_stride;
    r.batch = c.batch;
    r.hq = c.hq;
    r.hkv = c.hkv;
    r.d = c.d;
    r.scale = scale;
    cpu::DecodeAttention(r);
    // The GPU's own part is rounded to the dtype before the merge.
    std::vector<uint8_t> raw(q_elems * DTypeSize(c.dtype));
    ConvertFromF32(expect.data(), raw.data(), c.dtype, q_elems);
    ConvertToF32(raw.data(), c.dtype, expect.data(), q_elems);
  }
  PrefixAttentionArgs a;
  a.q = dq.get();
  a.rows = static_cast<const int32_t*>(drows.get());
  a.n = n;
  a.k = dpk.get();
  a.v = dpv.get();
  a.head_stride = pre_stride;
  a.keys = c.keys;
  a.out = dout.get();
  a.own_lse = c.own ? static_cast<const float*>(dlse.get()) : nullptr;
  DeviceBuffer dlse_out(sizeof(float) * c.batch * c.hq);
  a.lse_out = static_cast<float*>(dlse_out.get());
  a.dtype = c.dtype;
  a.hq = c.hq;
  a.hkv = c.hkv;
  a.d = c.d;
  a.scale = scale;
  a.path = c.path;
  const size_t ws_bytes = PrefixAttentionWorkspaceBytes(n, c.hq, c.hkv, c.d, c.keys);
  DeviceBuffer ws(ws_bytes);
  ASSERT_NE(ws.get(), nullptr);
  PENUMBRA_CUDA_OK(cudaMemset(ws.get(), 0xff, ws_bytes));
  a.workspace = ws.get();
  a.workspace_bytes = ws_bytes;
  LaunchPrefixAttention(a, nullptr);
  PENUMBRA_CUDA_OK(cudaGetLastError());
  PENUMBRA_CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> got = Download(dout, q_elems, c.dtype);

  cpu::PrefixAttentionArgs r;
  r.q = q.f32.data();
  r.rows = c.rows.data();
  r.n = n;
  r.k = pk.f32.data();
  r.v = pv.f32.data();
  r.head_stride = pre_stride;
  r.keys = c.keys;
  r.out = expect.data();
  r.own_lse = c.own ? expect_lse.data() : nullptr;
  std::vector<float> expect_lse_out(static_cast<size_t>(c.batch) * c.hq, 0.0f);
  r.lse_out = expect_lse_out.data();
  r.hq = c.hq;
  r.hkv = c.hkv;
  r.d = c.d;
  r.scale = scale;
  cpu::PrefixAttention(r);
  {
    // The attached rows' log-sum-exp of what out holds (prefix, or merged).
    std::vector<float> lse_got(expect_lse_out.size());
    PENUMBRA_CUDA_OK(
        cudaMemcpy(lse_got.data(), dlse_out.get(), lse_got.size() * sizeof(float), cudaMemcpyDeviceToHost));
    std::vector<float> g, e;
    for (int32_t row : c.rows)
      for (int h = 0; h < c.hq; ++h) {
        g.push_back(lse_got[static_cast<size_t>(row) * c.hq + h]);
        e.push_back(expect_lse_out[static_cast<size_t>(row) * c.hq + h]);
      }
    EXPECT_TRUE(AllClose(g, e, 2e-3f, 2e-3f)) << "lse_out";
  }
  if (!c.own) {  // rows not attached were never written: compare the attached ones only
    std::vector<float> g2, e2;
    for (int32_t row : c.rows) {
      const size_t off = static_cast<size_t>(row) * c.hq * c.d;
      g2.insert(g2.end(), got.begin() + off, got.begin() + off + static_cast<size_t>(c.hq) * c.d);
      e2.insert(e2.end(), expect.begin() + off, expect.begin() + off + static_cast<size_t>(c.hq) * c.d);
    }
    got.swap(g2);
    expect.swap(e2);
  }
  if (c.dtype != DType::kF32) {
    std::vector<uint8_t> raw(expect.size() * DTypeSize(c.dtype));
    ConvertFromF32(expect.data(), raw.data(), c.dtype, expect.size());
    ConvertToF32(raw.data(), c.dtype, expect.data(), expect.size());
  }
  EXPECT_TRUE(AllClose(got, expect, Tolerance(c.dtype), Tolerance(c.dtype)));
}

TEST(AttentionGpuTest, PrefixAttention) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  const std::vector<PrefixCase> cases = {
      // Tensor-core path (Hopper): Llama-8B and evaluation-model shapes, row
      // tiles part full, keys not a multiple of the tile, a subset of rows.
      {64, 20000, {}, 32, 8, 128, DType::kBF16},
      {5, 1, {4, 0, 2}, 8, 2, 128, DType::kBF16},
      {3, 129, {2, 1, 0}, 4, 4, 64, DType::kBF16},
      {40, 5000, {}, 8, 4, 64, DType::kBF16},
      {9, 70000, {8, 7, 1}, 16, 2, 128, DType::kBF16, false},
      // Generic: f32, other head dims, forced.
      {6, 300, {5, 3, 1}, 4, 2, 8, DType::kF32},
      {4, 2000, {}, 8, 8, 64, DType::kF32},
      {7, 777, {6, 0}, 6, 3, 96, DType::kBF16},
      {12, 3000, {}, 32, 8, 128, DType::kBF16, true, PrefixPath::kGeneric},
  };
  uint64_t seed = 3001;
  for (PrefixCase c : cases) {
    if (c.rows.empty())
      for (int b = 0; b < c.batch; ++b) c.rows.push_back(b);
    RunPrefixCase(c, seed++);
  }
}

// The workspace size covers every hkv for the same (batch, hq, d, max_length).
// The context-parallel merge on the GPU against the CPU reference: parts
// laid out as messages (outputs, then log-sum-exps), one part empty for a
// row (-inf), out aliasing part 0, f32 and bf16.
TEST(AttentionGpuTest, MergeAttentionMatchesCpu) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  const int parts = 3, rows = 70, d = 128;
  const int64_t stride = static_cast<int64_t>(rows) * d + rows;  // floats per part (f32 layout)
  std::vector<float> msg(static_cast<size_t>(parts) * stride);
  uint32_t seed = 5;
  for (int p = 0; p < parts; ++p) {
    auto x = ::penumbra::testing::RandomUniform(static_cast<size_t>(rows) * d, seed++);
    std::copy(x.begin(), x.end(), msg.begin() + p * stride);
    for (int r = 0; r < rows; ++r) msg[p * stride + static_cast<int64_t>(rows) * d + r] = (r % 7) * 1.5f - 3.0f + p;
  }
  msg[1 * stride + static_cast<int64_t>(rows) * d + 3] = -INFINITY;  // part 1 saw no key of row 3
  std::vector<float> want(static_cast<size_t>(rows) * d), want_lse(rows);
  cpu::MergeAttention(msg.data(), stride, msg.data() + static_cast<int64_t>(rows) * d, stride, parts, rows, d,
                      want.data(), want_lse.data());
  for (DType dt : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dt));
    const size_t es = DTypeSize(dt);
    // The device message: outputs in dt, then f32 log-sum-exps, per part.
    const size_t part_bytes = static_cast<size_t>(rows) * d * es + rows * sizeof(float);
    std::vector<uint8_t> host(parts * part_bytes);
    for (int p = 0; p < parts; ++p) {
      ConvertFromF32(msg.data() + p * stride, host.data() + p * part_bytes, dt, static_cast<size_t>(rows) * d);
      std::memcpy(host.data() + p * part_bytes + static_cast<size_t>(rows) * d * es,
                  msg.data() + p * stride + static_cast<int64_t>(rows) * d, rows * sizeof(float));
    }
    ::penumbra::testing::GpuBuffer dev(host.size()), lse_out(rows * sizeof(float));
    PENUMBRA_CUDA_OK(cudaMemcpy(dev.get(), host.data(), host.size(), cudaMemcpyHostToDevice));
    MergeAttentionArgs a;
    a.x = dev.get();
    a.x_part_stride = static_cast<int64_t>(part_bytes / es);
    a.lse = reinterpret_cast<const float*>(static_cast<char*>(dev.get()) + static_cast<size_t>(rows) * d * es);
    a.lse_part_stride = static_cast<int64_t>(part_bytes / sizeof(float));
    a.parts = parts;
    a.rows = rows;
    a.d = d;
    a.out = dev.get();  // aliases part 0
    a.lse_out = static_cast<float*>(lse_out.get());
    a.dtype = dt;
    LaunchMergeAttention(a, nullptr);
    PENUMBRA_CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> back(static_cast<size_t>(rows) * d * es);
    std::vector<float> got(static_cast<size_t>(rows) * d), got_lse(rows);
    PENUMBRA_CUDA_OK(cudaMemcpy(back.data(), dev.get(), back.size(), cudaMemcpyDeviceToHost));
    PENUMBRA_CUDA_OK(cudaMemcpy(got_lse.data(), lse_out.get(), rows * sizeof(float), cudaMemcpyDeviceToHost));
    ConvertToF32(back.data(), dt, got.data(), got.size());
    const float tol = dt == DType::kF32 ? 1e-5f : 2e-2f;
    EXPECT_TRUE(AllClose(got, want, tol, tol));
    EXPECT_TRUE(AllClose(got_lse, want_lse, 1e-5f, 1e-4f));
  }
}

TEST(AttentionGpuTest, WorkspaceBytesGrowWithSize) {
  EXPECT_GT(DecodeAttentionWorkspaceBytes(1, 32, 128, 1), 0u);
  EXPECT_GE(DecodeAttentionWorkspaceBytes(1, 32, 128, 124928), DecodeAttentionWorkspaceBytes(1, 32, 128, 4096));
  EXPECT_GE(DecodeAttentionWorkspaceBytes(4, 32, 128, 61440), DecodeAttentionWorkspaceBytes(4, 16, 128, 61440));
}

// ---- benchmark (PENUMBRA_KERNEL_BENCH=1) ------------------------------------------

// Fills a device bf16 buffer with random values.
void FillRandomBf16(const DeviceBuffer& buf, size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<uint16_t> h(n);
  for (auto& x : h) x = F32ToBF16(rng.Next());
  Upload(buf, h.data(), n * 2);
}

TEST(AttentionGpuTest, Bench) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  if (!KernelBenchEnabled()) GTEST_SKIP() << "set PENUMBRA_KERNEL_BENCH=1";
  const int hq = 32, hkv = 8;
  cudaDeviceProp prop;
  PENUMBRA_CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

  struct P {
    int keys, nq, d;
  };
  for (const P& p : {P{16384, 8192, 128}, P{32768, 8192, 128}, P{8192, 8192, 128}, P{32768, 8192, 64}}) {
    const int q_start = p.keys - p.nq;
    const int64_t head_stride = static_cast<int64_t>(p.keys) * p.d;
    const size_t q_elems = static_cast<size_t>(p.nq) * hq * p.d, kv_elems = static_cast<size_t>(hkv) * head_stride;
    DeviceBuffer dq(q_elems * 2), dout(q_elems * 2), dk(kv_elems * 2), dv(kv_elems * 2);
    ASSERT_NE(dk.get(), nullptr);
    FillRandomBf16(dq, q_elems, 1);
    FillRandomBf16(dk, kv_elems, 2);
    FillRandomBf16(dv, kv_elems, 3);
    PrefillAttentionArgs a;
    a.q = dq.get();
    a.k = dk.get();
    a.v = dv.get();
    a.out = dout.get();
    a.dtype = DType::kBF16;
    a.head_stride = head_stride;
    a.q_start = q_start;
    a.nq = p.nq;
    a.hq = hq;
    a.hkv = hkv;
    a.d = p.d;
    a.scale = 1.0f / std::sqrt(static_cast<float>(p.d));
    for (PrefillPath path : {PrefillPath::kWgmma, PrefillPath::kMma}) {
      a.path = path;
      const float ms = TimeMs([&] { LaunchPrefillAttention(a, nullptr); }, 10);
      PENUMBRA_CUDA_OK(cudaGetLastError());
      // Attended (query, key) pairs: sum over queries of q_start + i + 1.
      const double pairs = static_cast<double>(p.nq) * q_start + 0.5 * p.nq * (p.nq + 1.0);
      const double flops = 4.0 * pairs * p.d * hq;
      std::printf("prefill %-8s keys %6d nq %5d d %3d: %8.3f ms  %6.1f TFLOP/s\n", PathName(path), p.keys, p.nq, p.d,
                  ms, flops / (ms * 1e-3) / 1e12);
    }
  }

  struct D {
    int batch, length;
  };
  for (const D& p : {D{4, 61440}, D{15, 61440}, D{1, 124928}, D{7, 124928}, D{32, 8192}, D{64, 4096}}) {
    const int d = 128;
    const int64_t head_stride = static_cast<int64_t>(p.length) * d;
    const size_t kv_elems = static_cast<size_t>(hkv) * head_stride;
    std::vector<std::unique_ptr<DeviceBuffer>> bufs;
    std::vector<const void*> kp, vp;
    for (int b = 0; b < p.batch; ++b) {
      bufs.push_back(std::make_unique<DeviceBuffer>(kv_elems * 2));
      FillRandomBf16(*bufs.back(), kv_elems, 10 + 2 * b);
      kp.push_back(bufs.back()->get());
      bufs.push_back(std::make_unique<DeviceBuffer>(kv_elems * 2));
      FillRandomBf16(*bufs.back(), kv_elems, 11 + 2 * b);
      vp.push_back(bufs.back()->get());
    }
    const size_t q_elems = static_cast<size_t>(p.batch) * hq * d;
    DeviceBuffer dq(q_elems * 2), dout(q_elems * 2), dkp(8 * p.batch), dvp(8 * p.batch), dlen(4 * p.batch);
    FillRandomBf16(dq, q_elems, 5);
    std::vector<int32_t> lengths(p.batch, p.length);
    Upload(dkp, kp.data(), 8 * p.batch);
    Upload(dvp, vp.data(), 8 * p.batch);
    Upload(dlen, lengths.data(), 4 * p.batch);
    const size_t ws_bytes = DecodeAttentionWorkspaceBytes(p.batch, hq, d, p.length);
    DeviceBuffer ws(ws_bytes);
    DecodeAttentionArgs a;
    a.q = dq.get();
    a.k = static_cast<const void* const*>(dkp.get());
    a.v = static_cast<const void* const*>(dvp.get());
    a.lengths = static_cast<const int32_t*>(dlen.get());
    a.out = dout.get();
    a.dtype = DType::kBF16;
    a.head_stride = head_stride;
    a.batch = p.batch;
    a.hq = hq;
    a.hkv = hkv;
    a.d = d;
    a.max_length = p.length;
    a.scale = 1.0f / std::sqrt(static_cast<float>(d));
    a.workspace = ws.get();
    a.workspace_bytes = ws_bytes;
    const float ms = TimeMs([&] { LaunchDecodeAttention(a, nullptr); }, 20);
    PENUMBRA_CUDA_OK(cudaGetLastError());
    const double bytes = 2.0 * p.batch * static_cast<double>(p.length) * hkv * d * 2;
    std::printf("decode batch %3d x %6d: %8.3f ms  %7.1f GB/s (K+V bytes)\n", p.batch, p.length, ms,
                bytes / (ms * 1e-3) / 1e9);
  }
  // Prefix attention: `batch` sequences over one shared prefix (the shared-
  // document decode's attention), beside decode over `batch` separate copies.
  for (const D& p : {D{64, 124928}, D{16, 124928}, D{64, 32768}}) {
    const int d = 128;
    const int64_t head_stride = static_cast<int64_t>(p.length) * d;
    const size_t kv_elems = static_cast<size_t>(hkv) * head_stride;
    DeviceBuffer dk(kv_elems * 2), dv(kv_elems * 2);
    ASSERT_NE(dv.get(), nullptr);
    FillRandomBf16(dk, kv_elems, 40);
    FillRandomBf16(dv, kv_elems, 41);
    const size_t q_elems = static_cast<size_t>(p.batch) * hq * d;
    DeviceBuffer dq(q_elems * 2), dout(q_elems * 2), drows(4 * p.batch);
    FillRandomBf16(dq, q_elems, 42);
    std::vector<int32_t> rows(p.batch);
    std::iota(rows.begin(), rows.end(), 0);
    Upload(drows, rows.data(), 4 * p.batch);
    const size_t ws_bytes = PrefixAttentionWorkspaceBytes(p.batch, hq, hkv, d, p.length);
    DeviceBuffer ws(ws_bytes);
    PrefixAttentionArgs a;
    a.q = dq.get();
    a.rows = static_cast<const int32_t*>(drows.get());
    a.n = p.batch;
    a.k = dk.get();
    a.v = dv.get();
    a.head_stride = head_stride;
    a.keys = p.length;
    a.out = dout.get();
    a.dtype = DType::kBF16;
    a.hq = hq;
    a.hkv = hkv;
    a.d = d;
    a.scale = 1.0f / std::sqrt(static_cast<float>(d));
    a.workspace = ws.get();
    a.workspace_bytes = ws_bytes;
    const float ms = TimeMs([&] { LaunchPrefixAttention(a, nullptr); }, 20);
    PENUMBRA_CUDA_OK(cudaGetLastError());
    const double flops = 4.0 * p.batch * static_cast<double>(p.length) * hq * d;
    std::printf("prefix batch %3d x %6d: %8.3f ms  %6.1f TFLOP/s  (x 32 layers: %.1f ms per step)\n", p.batch, p.length,
                ms, flops / (ms * 1e-3) / 1e12, 32 * ms);
  }
}

}  // namespace
}  // namespace penumbra::kernels
