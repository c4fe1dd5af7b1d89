// CUDA ShadowKV decode kernels and top-k against the CPU references
// (kernels/cpu/shadowkv_decode.h) on the same dtype-rounded inputs. Every
// output element is compared; outputs are poisoned first (NaN for floats,
// 0x7f7f7f7f for ints), so unwritten outputs fail, and rows a kernel must not
// touch are checked to still hold the poison.
//
// With PENUMBRA_KERNEL_BENCH=1, ShadowkvDecodeGpuBench prints times at the
// Llama-3.1-8B shape (hq=32, hkv=8, d=128, bf16, C=8, r=160, 15616 chunks).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/dtype.h"
#include "kernels/cpu/shadowkv_decode.h"
#include "kernels/landmark_format.h"
#include "kernels/shadowkv_decode.cuh"
#include "kernels/topk.cuh"
#include "tests/gpu_test_util.h"
#include "tests/test_util.h"

namespace penumbra::kernels {
namespace {

using ::penumbra::testing::TimeMs;

#define SKV_CUDA(expr)                                          \
  do {                                                          \
    cudaError_t _e = (expr);                                    \
    if (_e != cudaSuccess) {                                    \
      ADD_FAILURE() << #expr << ": " << cudaGetErrorString(_e); \
      std::abort();                                             \
    }                                                           \
  } while (0)

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int32_t kIntPoison = 0x7f7f7f7f;

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) { SKV_CUDA(cudaMalloc(&ptr_, std::max<size_t>(bytes, 16))); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }
  void Upload(const void* src, size_t n) { SKV_CUDA(cudaMemcpy(ptr_, src, n, cudaMemcpyHostToDevice)); }
  template <typename T>
  void Upload(const std::vector<T>& v) {
    Upload(v.data(), v.size() * sizeof(T));
  }
  template <typename T>
  std::vector<T> Download(size_t n) const {
    std::vector<T> v(n);
    SKV_CUDA(cudaMemcpy(v.data(), ptr_, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

// Mapped pinned host memory (zero copy) freed on scope exit.
class MappedHostBuffer {
 public:
  explicit MappedHostBuffer(size_t bytes) {
    SKV_CUDA(cudaHostAlloc(&host_, std::max<size_t>(bytes, 16), cudaHostAllocMapped));
    SKV_CUDA(cudaHostGetDevicePointer(&dev_, host_, 0));
  }
  ~MappedHostBuffer() { cudaFreeHost(host_); }
  MappedHostBuffer(const MappedHostBuffer&) = delete;
  MappedHostBuffer& operator=(const MappedHostBuffer&) = delete;
  void* host() const { return host_; }
  void* device() const { return dev_; }

 private:
  void* host_ = nullptr;
  void* dev_ = nullptr;
};

template <typename T>
std::unique_ptr<DeviceBuffer> ToDevice(const std::vector<T>& v) {
  auto d = std::make_unique<DeviceBuffer>(v.size() * sizeof(T));
  d->Upload(v);
  return d;
}

// Fast deterministic uniform [-1, 1) (splitmix64).
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t Bits() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float Next() { return static_cast<float>(Bits() >> 40) * (2.0f / 16777216.0f) - 1.0f; }
  int Int(int n) { return static_cast<int>(Bits() % static_cast<uint64_t>(n)); }

 private:
  uint64_t s_;
};

// Random values as f32 already rounded to `dtype`, and the same in `dtype`.
struct HostTensor {
  std::vector<float> f32;
  std::vector<uint8_t> raw;
};
HostTensor MakeTensor(size_t n, DType dtype, Rng& rng, float scale = 1.0f) {
  HostTensor t;
  t.f32.resize(n);
  for (auto& x : t.f32) x = rng.Next() * scale;
  t.raw.resize(n * DTypeSize(dtype));
  ConvertFromF32(t.f32.data(), t.raw.data(), dtype, n);
  ConvertToF32(t.raw.data(), dtype, t.f32.data(), n);
  return t;
}
std::vector<float> DownloadF32(const DeviceBuffer& buf, size_t n, DType dtype) {
  const auto raw = buf.Download<uint8_t>(n * DTypeSize(dtype));
  std::vector<float> out(n);
  ConvertToF32(raw.data(), dtype, out.data(), n);
  return out;
}
std::vector<uint8_t> Poisoned(size_t n, DType dtype) {
  std::vector<float> f(n, kNaN);
  std::vector<uint8_t> raw(n * DTypeSize(dtype));
  ConvertFromF32(f.data(), raw.data(), dtype, n);
  return raw;
}

// Every element: NaN expected (untouched poison) needs NaN; otherwise
// |a - e| <= atol + rtol |e|. Reports the first bad index.
::testing::AssertionResult CloseOrPoison(const std::vector<float>& got, const std::vector<float>& want, float atol,
                                         float rtol) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  size_t bad = 0, first = got.size();
  for (size_t i = 0; i < got.size(); ++i) {
    bool ok;
    if (std::isnan(want[i]))
      ok = std::isnan(got[i]);
    else
      ok =
          !std::isnan(got[i]) && (got[i] == want[i] || std::fabs(got[i] - want[i]) <= atol + rtol * std::fabs(want[i]));
    if (!ok) {
      if (first == got.size()) first = i;
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " differ; first at " << first << ": got "
                                       << got[first] << " want " << want[first];
}

::testing::AssertionResult SameInts(const std::vector<int32_t>& got, const std::vector<int32_t>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i])
      return ::testing::AssertionFailure() << "first difference at " << i << ": got " << got[i] << " want " << want[i];
  return ::testing::AssertionSuccess();
}

// ============================================================================
// Top-k
// ============================================================================

struct TopKCase {
  int rows, n, k;
  bool smallest;
  int ties;  // 0: distinct random, 1: few distinct values, 2: with NaN / +-inf / -0
  bool skip = false;
  bool split = false;  // give the kernel a split workspace (TopKArgs::split_workspace)
};

void RunTopK(const TopKCase& c) {
  SCOPED_TRACE(::testing::Message() << "rows " << c.rows << " n " << c.n << " k " << c.k << " smallest " << c.smallest
                                    << " ties " << c.ties << " skip " << c.skip << " split " << c.split);
  Rng rng(1000 + c.n + c.k);
  const int64_t stride = c.n + 5;
  std::vector<float> v(static_cast<size_t>(c.rows) * stride);
  for (auto& x : v) {
    if (c.ties == 1)
      x = static_cast<float>(rng.Int(5));
    else if (c.ties == 2) {
      const int s = rng.Int(8);
      const float inf = std::numeric_limits<float>::infinity();
      x = s == 0 ? kNaN : s == 1 ? -inf : s == 2 ? -0.0f : s == 3 ? 0.0f : s == 4 ? inf : rng.Next();
    } else
      x = rng.Next();
  }
  // Two rows share a count; the second group of rows is shorter.
  const int groups = (c.rows + 1) / 2;
  std::vector<int32_t> counts(groups);
  for (int gi = 0; gi < groups; ++gi) counts[gi] = gi % 2 ? std::max(1, c.n - 1 - rng.Int(std::max(1, c.n / 3))) : c.n;
  const int64_t out_stride = c.k + 3;

  cpu::TopKArgs ca;
  ca.values = v.data();
  ca.stride = stride;
  ca.rows = c.rows;
  ca.counts = counts.data();
  ca.rows_per_count = 2;
  ca.k = c.k;
  ca.smallest = c.smallest;
  ca.skip_worst_inf = c.skip;
  std::vector<int32_t> want(static_cast<size_t>(c.rows) * out_stride, kIntPoison);
  ca.out = want.data();
  ca.out_stride = out_stride;
  cpu::TopK(ca);

  auto dv = ToDevice(v);
  auto dc = ToDevice(counts);
  auto dout = ToDevice(std::vector<int32_t>(want.size(), kIntPoison));
  TopKArgs ga;
  ga.values = dv->get<float>();
  ga.stride = stride;
  ga.rows = c.rows;
  ga.counts = dc->get<int32_t>();
  ga.rows_per_count = 2;
  ga.max_count = c.n;
  ga.k = c.k;
  ga.smallest = c.smallest;
  ga.skip_worst_inf = c.skip;
  ga.out = dout->get<int32_t>();
  ga.out_stride = out_stride;
  std::unique_ptr<DeviceBuffer> dws;
  if (c.split) {
    ga.split_workspace_ints = TopKSplitWorkspaceInts(c.rows, c.n, c.k);
    EXPECT_LE(ga.split_workspace_ints, c.rows * TopKSplitWorkspaceIntsPerRow(c.n));
    dws = ToDevice(std::vector<int32_t>(static_cast<size_t>(std::max<int64_t>(ga.split_workspace_ints, 1)), 7));
    ga.split_workspace = dws->get<int32_t>();
  }
  LaunchTopK(ga, nullptr);
  SKV_CUDA(cudaDeviceSynchronize());
  EXPECT_TRUE(SameInts(dout->Download<int32_t>(want.size()), want));
}

TEST(TopKGpu, MatchesCpuExactly) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  for (int n : {1, 7, 129, 5000, 40000, 131072})
    for (int k : {1, 7, 64, 256, 1024})
      for (bool smallest : {false, true})
        for (int ties : {0, 1, 2}) {
          if (n >= 40000 && ties == 2 && k != 256) continue;  // keep the sweep short
          RunTopK({5, n, k, smallest, ties});
          if (ties == 2) RunTopK({5, n, k, smallest, ties, true});
        }
  RunTopK({3, 300, 1024, false, 2, true});  // k > n with skipped values: -1 padded
  RunTopK({3, 300, 4096, false, 0});        // k > n: all, then -1
  RunTopK({2, 9000, 4096, true, 1});        // largest k
}

// Long rows with a split workspace: segments select in parallel, then one
// pass over their candidates; the same output as the one-block selection
// (the CPU's), ties, skipped values and shorter rows included.
TEST(TopKGpu, SplitRowsMatchCpuExactly) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  for (int n : {32769, 40000, 131072, 200000})
    for (int k : {1, 7, 256, 1024})
      for (int ties : {0, 1, 2}) {
        RunTopK({5, n, k, false, ties, true, true});
        if (n == 131072) RunTopK({3, n, k, true, ties, true, true});
      }
  RunTopK({4, 300000, 4096, false, 1, true, true});  // largest k: 32768-element segments
  RunTopK({16, 131072, 256, false, 0, true, true});  // a decode step's rows (batch 2 x 8 KV heads)
}

TEST(TopKGpu, UniformCount) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  Rng rng(7);
  const int rows = 4, n = 1000, k = 33;
  std::vector<float> v(static_cast<size_t>(rows) * n);
  for (auto& x : v) x = rng.Next();
  std::vector<int32_t> want(static_cast<size_t>(rows) * k);
  cpu::TopKArgs ca;
  ca.values = v.data();
  ca.stride = n;
  ca.rows = rows;
  ca.uniform_count = n - 10;
  ca.k = k;
  ca.out = want.data();
  ca.out_stride = k;
  cpu::TopK(ca);
  auto dv = ToDevice(v);
  auto dout = ToDevice(std::vector<int32_t>(want.size(), kIntPoison));
  TopKArgs ga;
  ga.values = dv->get<float>();
  ga.stride = n;
  ga.rows = rows;
  ga.uniform_count = n - 10;
  ga.max_count = n - 10;
  ga.k = k;
  ga.out = dout->get<int32_t>();
  ga.out_stride = k;
  LaunchTopK(ga, nullptr);
  SKV_CUDA(cudaDeviceSynchronize());
  EXPECT_TRUE(SameInts(dout->Download<int32_t>(want.size()), want));
}

// ============================================================================
// Scores
// ============================================================================

struct ScoreCase {
  int batch, hkv, group, d, n;  // n: max_chunks; sequence b has n - b*(n/5) chunks
  DType dtype, q_dtype;
  bool with_excluded;
  int successors = 0;  // ShadowkvScoreArgs::successors
  int per_chunk = 1;   // ShadowkvScoreArgs::landmarks_per_chunk
  bool fp8 = false;    // ShadowkvScoreArgs::landmark_fp8 (dtype unused)
};

void RunScore(const ScoreCase& c) {
  SCOPED_TRACE(::testing::Message() << "batch " << c.batch << " hkv " << c.hkv << " group " << c.group << " d " << c.d
                                    << " n " << c.n << " dtype " << DTypeName(c.dtype) << " q " << DTypeName(c.q_dtype)
                                    << " excluded " << c.with_excluded << " successors " << c.successors
                                    << " landmarks per chunk " << c.per_chunk << " fp8 " << c.fp8);
  Rng rng(77 + c.n + c.d + c.group);
  const int hq = c.hkv * c.group, cap = c.n + 3, max_chunks = c.n;
  const int64_t stride = max_chunks + 2;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  // Scaled so that logits spread over a few units (softmax far from uniform).
  HostTensor q = MakeTensor(static_cast<size_t>(c.batch) * hq * c.d, c.q_dtype, rng, 2.0f);
  std::vector<HostTensor> land;
  std::vector<std::vector<uint8_t>> land8(c.batch);  // fp8: the records of land's values
  const int64_t rec8 = LandmarkChunkElems(c.per_chunk, c.d, true);
  std::vector<std::vector<uint8_t>> excl(c.batch);
  std::vector<int32_t> n_chunks(c.batch);
  for (int b = 0; b < c.batch; ++b) {
    land.push_back(
        MakeTensor(static_cast<size_t>(c.hkv) * cap * c.per_chunk * c.d, c.fp8 ? DType::kF32 : c.dtype, rng, 2.0f));
    if (c.fp8) {
      land8[b].resize(static_cast<size_t>(c.hkv) * cap * rec8);
      for (int i = 0; i < c.hkv * cap; ++i)
        EncodeLandmarkFp8(land[b].f32.data() + static_cast<size_t>(i) * c.per_chunk * c.d,
                          static_cast<int64_t>(c.per_chunk) * c.d, land8[b].data() + i * rec8);
    }
    excl[b].assign(static_cast<size_t>(c.hkv) * cap, 0);
    if (c.with_excluded)
      for (auto& e : excl[b]) e = rng.Int(7) == 0;
    n_chunks[b] = std::max(1, c.n - b * (c.n / 5));
  }
  // CPU reference.
  std::vector<const float*> lp;
  std::vector<const uint8_t*> lp8, ep;
  for (int b = 0; b < c.batch; ++b) {
    lp.push_back(land[b].f32.data());
    lp8.push_back(land8[b].data());
    ep.push_back(excl[b].data());
  }
  std::vector<float> want(static_cast<size_t>(c.batch) * c.hkv * stride, kNaN);
  cpu::ShadowkvScoreArgs ca;
  ca.q = q.f32.data();
  if (c.fp8)
    ca.landmarks_fp8 = lp8.data();
  else
    ca.landmarks = lp.data();
  ca.excluded = c.with_excluded ? ep.data() : nullptr;
  ca.n_chunks = n_chunks.data();
  ca.batch = c.batch;
  ca.hq = hq;
  ca.hkv = c.hkv;
  ca.d = c.d;
  ca.chunk_cap = cap;
  ca.max_chunks = max_chunks;
  ca.scale = scale;
  ca.successors = c.successors;
  ca.landmarks_per_chunk = c.per_chunk;
  ca.scores = want.data();
  ca.score_stride = stride;
  cpu::ShadowkvScore(ca);

  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  std::vector<const void*> dl;
  std::vector<const uint8_t*> de;
  for (int b = 0; b < c.batch; ++b) {
    keep.push_back(c.fp8 ? ToDevice(land8[b]) : ToDevice(land[b].raw));
    dl.push_back(keep.back()->get());
    keep.push_back(ToDevice(excl[b]));
    de.push_back(keep.back()->get<uint8_t>());
  }
  auto dlp = ToDevice(dl);
  auto dep = ToDevice(de);
  auto dq = ToDevice(q.raw);
  auto dn = ToDevice(n_chunks);
  auto dscores = ToDevice(std::vector<float>(want.size(), kNaN));
  DeviceBuffer ws(ShadowkvScoreWorkspaceBytes(c.batch, hq, max_chunks, c.per_chunk));
  ShadowkvScoreArgs ga;
  ga.q = dq->get();
  ga.q_dtype = c.q_dtype;
  ga.landmarks = dlp->get<const void* const>();
  ga.excluded = c.with_excluded ? dep->get<const uint8_t* const>() : nullptr;
  ga.dtype = c.dtype;
  ga.landmark_fp8 = c.fp8;
  ga.n_chunks = dn->get<int32_t>();
  ga.batch = c.batch;
  ga.hq = hq;
  ga.hkv = c.hkv;
  ga.d = c.d;
  ga.chunk_cap = cap;
  ga.max_chunks = max_chunks;
  ga.scale = scale;
  ga.successors = c.successors;
  ga.landmarks_per_chunk = c.per_chunk;
  ga.scores = dscores->get<float>();
  ga.score_stride = stride;
  ga.workspace = ws.get();
  ga.workspace_bytes = ws.bytes();
  LaunchShadowkvScore(ga, nullptr);
  SKV_CUDA(cudaDeviceSynchronize());
  const auto got = dscores->Download<float>(want.size());
  EXPECT_TRUE(CloseOrPoison(got, want, 1e-30f, 1e-5f));

  // With a selection: the same indices as the top-k (skip_worst_inf) of the
  // scores just checked, exactly (the fused kernel must compute the same bits;
  // rows beyond kTopKSharedKeys chunks take the unfused path).
  const int rows = c.batch * c.hkv;
  for (int k : {1, 37, std::min(max_chunks + 3, kTopKMaxK)}) {
    SCOPED_TRACE(::testing::Message() << "select_k " << k);
    const int64_t sel_stride = k + 2;
    auto dwant = ToDevice(std::vector<int32_t>(static_cast<size_t>(rows) * sel_stride, kIntPoison));
    TopKArgs ta;
    ta.values = dscores->get<float>();
    ta.stride = stride;
    ta.rows = rows;
    ta.counts = dn->get<int32_t>();
    ta.rows_per_count = c.hkv;
    ta.max_count = max_chunks;
    ta.k = k;
    ta.skip_worst_inf = true;
    ta.out = dwant->get<int32_t>();
    ta.out_stride = sel_stride;
    LaunchTopK(ta, nullptr);
    auto dsel = ToDevice(std::vector<int32_t>(static_cast<size_t>(rows) * sel_stride, kIntPoison));
    auto scratch = ToDevice(std::vector<float>(want.size(), kNaN));
    ShadowkvScoreArgs gs = ga;
    gs.scores = scratch->get<float>();
    gs.select_k = k;
    gs.selection = dsel->get<int32_t>();
    gs.selection_stride = sel_stride;
    LaunchShadowkvScore(gs, nullptr);
    SKV_CUDA(cudaDeviceSynchronize());
    EXPECT_TRUE(SameInts(dsel->Download<int32_t>(static_cast<size_t>(rows) * sel_stride),
                         dwant->Download<int32_t>(static_cast<size_t>(rows) * sel_stride)));

    // With the slot update after the selection (in the selection's blocks
    // where fused): the same maps and miss lists as the two launches.
    for (float keep : {-1.0f, 0.6f}) {
      SCOPED_TRACE(::testing::Message() << "slot update, force_keep " << keep);
      const int ks = k;
      const size_t miss_words = static_cast<size_t>(rows) * (1 + 2 * ks);
      std::vector<std::unique_ptr<DeviceBuffer>> maps[2];
      std::vector<int32_t*> map_ptrs[2];
      for (int b = 0; b < c.batch; ++b) {
        std::vector<int32_t> map0(static_cast<size_t>(c.hkv) * ks, -1);  // half full: chunks n-1, n-2, ...
        for (int h = 0; h < c.hkv; ++h)
          for (int j = 0; j < std::min(ks / 2, n_chunks[b]); ++j)
            map0[static_cast<size_t>(h) * ks + j] = n_chunks[b] - 1 - j;
        for (int v = 0; v < 2; ++v) {
          maps[v].push_back(ToDevice(map0));
          map_ptrs[v].push_back(maps[v].back()->get<int32_t>());
        }
      }
      std::unique_ptr<DeviceBuffer> dmaps[2], dmiss[2];
      ShadowkvSlotUpdateArgs ua[2];
      for (int v = 0; v < 2; ++v) {
        dmaps[v] = ToDevice(map_ptrs[v]);
        dmiss[v] = ToDevice(std::vector<int32_t>(miss_words, kIntPoison));
        int32_t* m = dmiss[v]->get<int32_t>();
        ua[v].selection = dsel->get<int32_t>();
        ua[v].selection_stride = sel_stride;
        ua[v].slot_maps = dmaps[v]->get<int32_t* const>();
        ua[v].miss_count = m;
        ua[v].miss_slot = m + rows;
        ua[v].miss_chunk = m + rows + static_cast<size_t>(rows) * ks;
        ua[v].batch = c.batch;
        ua[v].hkv = c.hkv;
        ua[v].kslots = ks;
        ua[v].chunk_cap = cap;
        ua[v].force_keep = keep;
      }
      LaunchShadowkvScore(gs, nullptr, &ua[0]);
      LaunchShadowkvScore(gs, nullptr);
      LaunchShadowkvSlotUpdate(ua[1], nullptr);
      SKV_CUDA(cudaDeviceSynchronize());
      EXPECT_TRUE(SameInts(dmiss[0]->Download<int32_t>(miss_words), dmiss[1]->Download<int32_t>(miss_words)));
      for (int b = 0; b < c.batch; ++b)
        EXPECT_TRUE(SameInts(maps[0][b]->Download<int32_t>(static_cast<size_t>(c.hkv) * ks),
                             maps[1][b]->Download<int32_t>(static_cast<size_t>(c.hkv) * ks)))
            << "sequence " << b;
    }
  }
}

TEST(ShadowkvScoreGpu, MatchesCpu) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  for (int n : {1, 7, 129, 5000})
    for (int group : {1, 3, 4, 8})
      for (int d : {64, 128}) RunScore({3, 2, group, d, n, DType::kBF16, DType::kBF16, true});
  RunScore({2, 3, 4, 128, 129, DType::kF32, DType::kF32, true});
  RunScore({2, 3, 2, 128, 5000, DType::kF32, DType::kBF16, false});
  RunScore({2, 1, 5, 136, 700, DType::kBF16, DType::kF32, true});  // d not a power of two
  RunScore({1, 2, 4, 256, 300, DType::kBF16, DType::kBF16, true});
  RunScore({1, 2, 4, 128, 131072, DType::kBF16, DType::kBF16, true});
  // Successors: fused (tensor-core logits, then SIMT) and unfused (beyond
  // kTopKSharedKeys chunks), scores and selections.
  RunScore({3, 2, 4, 128, 5000, DType::kBF16, DType::kBF16, true, 2});
  RunScore({2, 3, 4, 128, 129, DType::kF32, DType::kF32, true, 1});
  RunScore({1, 2, 4, 128, 40000, DType::kBF16, DType::kBF16, true, 3});
  // Several landmarks per chunk: tensor-core and SIMT logits, fused and
  // unfused selection, with successors too.
  RunScore({3, 2, 4, 128, 5000, DType::kBF16, DType::kBF16, true, 0, 2});
  RunScore({3, 2, 4, 64, 129, DType::kBF16, DType::kBF16, true, 0, 4});
  RunScore({2, 3, 4, 128, 129, DType::kF32, DType::kF32, true, 0, 2});
  RunScore({2, 1, 5, 136, 700, DType::kBF16, DType::kF32, true, 0, 8});
  RunScore({1, 2, 4, 128, 40000, DType::kBF16, DType::kBF16, true, 0, 2});
  RunScore({2, 2, 4, 128, 3000, DType::kBF16, DType::kBF16, true, 1, 2});
  // fp8 landmarks (records of e4m3 codes and a scale): tensor-core logits (bf16
  // q, d 64 and 128), SIMT (f32 q; d 136), fused and unfused selection.
  for (int S : {1, 4})
    for (int d : {64, 128}) RunScore({3, 2, 4, d, 5000, DType::kBF16, DType::kBF16, true, 0, S, true});
  RunScore({2, 2, 8, 128, 129, DType::kBF16, DType::kBF16, true, 0, 8, true});
  RunScore({2, 3, 4, 128, 700, DType::kBF16, DType::kF32, true, 0, 4, true});
  RunScore({2, 1, 5, 136, 700, DType::kBF16, DType::kF32, true, 0, 2, true});
  RunScore({1, 2, 4, 128, 40000, DType::kBF16, DType::kBF16, true, 1, 4, true});
}

// ============================================================================
// Scores in two calls (context parallel): each shard's statistics, then one
// shard's scores normalized over every shard's
// ============================================================================

struct ScorePartsCase {
  int parts, batch, hkv, group, d, n;  // n: max_chunks of every part
  DType dtype;                         // landmarks and q
  int per_chunk = 1;                   // landmarks per chunk
};

// One shard (part) of the sequences: its landmarks, exclusions and chunk
// counts, on the host and the device, and its own score workspace (which
// keeps the first call's logits for the second).
struct ScorePart {
  std::vector<HostTensor> land;
  std::vector<std::vector<uint8_t>> excl;
  std::vector<int32_t> n_chunks;
  std::vector<const float*> land_ptrs;
  std::vector<const uint8_t*> excl_ptrs;
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  std::unique_ptr<DeviceBuffer> dland, dexcl, dn, ws;
};

void RunScoreParts(const ScorePartsCase& c) {
  SCOPED_TRACE(::testing::Message() << "parts " << c.parts << " batch " << c.batch << " hkv " << c.hkv << " group "
                                    << c.group << " d " << c.d << " n " << c.n << " dtype " << DTypeName(c.dtype)
                                    << " landmarks per chunk " << c.per_chunk);
  Rng rng(501 + c.parts + c.n + c.d + c.group);
  const int hq = c.hkv * c.group, cap = c.n + 3, rows = c.batch * c.hkv;
  const int64_t stride = c.n + 2;
  const size_t score_n = static_cast<size_t>(rows) * stride;
  // Poison between the parts' statistics: a write past a part's heads fails.
  const int64_t stats_stride = 2 * static_cast<int64_t>(c.batch) * hq + 6;
  const size_t stats_n = static_cast<size_t>(c.parts) * stats_stride;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  // One query, attending to every shard.
  HostTensor q = MakeTensor(static_cast<size_t>(c.batch) * hq * c.d, c.dtype, rng, 2.0f);
  auto dq = ToDevice(q.raw);
  std::vector<ScorePart> part(c.parts);
  for (int p = 0; p < c.parts; ++p) {
    ScorePart& s = part[p];
    std::vector<const void*> dl;
    std::vector<const uint8_t*> de;
    for (int b = 0; b < c.batch; ++b) {
      s.land.push_back(MakeTensor(static_cast<size_t>(c.hkv) * cap * c.per_chunk * c.d, c.dtype, rng, 2.0f));
      s.excl.emplace_back(static_cast<size_t>(c.hkv) * cap, 0);
      for (auto& e : s.excl[b]) e = rng.Int(7) == 0;
      // Sequence 1 has no chunks in part 1 (its statistics (-inf, 0) are left
      // out of the combination); KV head 0 of sequence 2 has no selectable
      // chunk in any part (scores -inf, selection -1).
      if (b == 2) std::fill(s.excl[b].begin(), s.excl[b].begin() + cap, 1);
      s.n_chunks.push_back(b == 1 && p == 1 ? 0 : std::max(1, c.n - (p + b) * (c.n / 7)));
      s.land_ptrs.push_back(s.land[b].f32.data());
      s.excl_ptrs.push_back(s.excl[b].data());
      s.keep.push_back(ToDevice(s.land[b].raw));
      dl.push_back(s.keep.back()->get());
      s.keep.push_back(ToDevice(s.excl[b]));
      de.push_back(s.keep.back()->get<uint8_t>());
    }
    s.dland = ToDevice(dl);
    s.dexcl = ToDevice(de);
    s.dn = ToDevice(s.n_chunks);
    s.ws = std::make_unique<DeviceBuffer>(ShadowkvScoreWorkspaceBytes(c.batch, hq, c.n, c.per_chunk));
  }
  const auto gpu_args = [&](int p) {
    ShadowkvScoreArgs a;
    a.q = dq->get();
    a.q_dtype = c.dtype;
    a.landmarks = part[p].dland->get<const void* const>();
    a.excluded = part[p].dexcl->get<const uint8_t* const>();
    a.dtype = c.dtype;
    a.n_chunks = part[p].dn->get<int32_t>();
    a.batch = c.batch;
    a.hq = hq;
    a.hkv = c.hkv;
    a.d = c.d;
    a.chunk_cap = cap;
    a.max_chunks = c.n;
    a.landmarks_per_chunk = c.per_chunk;
    a.scale = scale;
    a.score_stride = stride;
    a.workspace = part[p].ws->get();
    a.workspace_bytes = part[p].ws->bytes();
    return a;
  };
  const auto cpu_args = [&](int p) {
    cpu::ShadowkvScoreArgs a;
    a.q = q.f32.data();
    a.landmarks = part[p].land_ptrs.data();
    a.excluded = part[p].excl_ptrs.data();
    a.n_chunks = part[p].n_chunks.data();
    a.batch = c.batch;
    a.hq = hq;
    a.hkv = c.hkv;
    a.d = c.d;
    a.chunk_cap = cap;
    a.max_chunks = c.n;
    a.landmarks_per_chunk = c.per_chunk;
    a.scale = scale;
    a.score_stride = stride;
    return a;
  };

  // First calls: every part's statistics, and nothing else (the outputs of a
  // selection are passed and must keep their poison).
  auto dstats = ToDevice(std::vector<float>(stats_n, kNaN));
  std::vector<float> want_stats(stats_n, kNaN);
  {
    const int64_t sel_stride = 40;
    const size_t sel_n = static_cast<size_t>(rows) * sel_stride;
    auto dscores = ToDevice(std::vector<float>(score_n, kNaN));
    auto dsel = ToDevice(std::vector<int32_t>(sel_n, kIntPoison));
    auto dsel_scores = ToDevice(std::vector<float>(sel_n, kNaN));
    std::vector<float> cpu_scores(score_n);
    for (int p = 0; p < c.parts; ++p) {
      ShadowkvScoreArgs ga = gpu_args(p);
      ga.scores = dscores->get<float>();
      ga.select_k = 37;
      ga.selection = dsel->get<int32_t>();
      ga.selection_stride = sel_stride;
      ga.selection_scores = dsel_scores->get<float>();
      ga.stats_out = dstats->get<float>() + p * stats_stride;
      LaunchShadowkvScore(ga, nullptr);
      cpu::ShadowkvScoreArgs ca = cpu_args(p);
      ca.scores = cpu_scores.data();
      ca.stats_out = want_stats.data() + p * stats_stride;
      cpu::ShadowkvScore(ca);
    }
    SKV_CUDA(cudaDeviceSynchronize());
    EXPECT_TRUE(CloseOrPoison(dscores->Download<float>(score_n), std::vector<float>(score_n, kNaN), 0.0f, 0.0f))
        << "scores of a statistics-only call";
    EXPECT_TRUE(SameInts(dsel->Download<int32_t>(sel_n), std::vector<int32_t>(sel_n, kIntPoison)))
        << "selection of a statistics-only call";
    EXPECT_TRUE(CloseOrPoison(dsel_scores->Download<float>(sel_n), std::vector<float>(sel_n, kNaN), 0.0f, 0.0f))
        << "selection scores of a statistics-only call";
  }
  const std::vector<float> stats = dstats->Download<float>(stats_n);
  EXPECT_TRUE(CloseOrPoison(stats, want_stats, 1e-5f, 1e-5f)) << "statistics (max, sum exp) per part";

  // Second calls, by each part in turn, with every part's statistics (the
  // GPU's: the exchange hands every shard the same bytes).
  for (int p = 0; p < c.parts; ++p) {
    SCOPED_TRACE(::testing::Message() << "second call of part " << p);
    std::vector<float> want(score_n, kNaN);
    cpu::ShadowkvScoreArgs ca = cpu_args(p);
    ca.scores = want.data();
    ca.stats_in = stats.data();
    ca.stats_parts = c.parts;
    ca.stats_part_stride = stats_stride;
    cpu::ShadowkvScore(ca);
    // The scores alone (no selection: always written), from the logits the
    // first call left in the part's workspace.
    ShadowkvScoreArgs ga = gpu_args(p);
    ga.stats_in = dstats->get<float>();
    ga.stats_parts = c.parts;
    ga.stats_part_stride = stats_stride;
    auto dscores = ToDevice(std::vector<float>(score_n, kNaN));
    ga.scores = dscores->get<float>();
    LaunchShadowkvScore(ga, nullptr);
    SKV_CUDA(cudaDeviceSynchronize());
    const std::vector<float> scores = dscores->Download<float>(score_n);
    EXPECT_TRUE(CloseOrPoison(scores, want, 1e-30f, 1e-5f));

    // With a selection and its scores (fused where max_chunks <=
    // kTopKSharedKeys): the top-k of the scores just checked, and those
    // scores, exactly; with the slot update in the same call, the maps and
    // miss lists of a separate update of that selection.
    for (int k : {1, 37, std::min(c.n + 3, kTopKMaxK)}) {
      SCOPED_TRACE(::testing::Message() << "select_k " << k);
      const int64_t sel_stride = k + 2;
      const size_t sel_n = static_cast<size_t>(rows) * sel_stride;
      auto dwant = ToDevice(std::vector<int32_t>(sel_n, kIntPoison));
      TopKArgs ta = ShadowkvSelectionTopK(ga);
      ta.k = k;
      ta.out = dwant->get<int32_t>();
      ta.out_stride = sel_stride;
      LaunchTopK(ta, nullptr);
      SKV_CUDA(cudaDeviceSynchronize());
      const std::vector<int32_t> want_sel = dwant->Download<int32_t>(sel_n);
      std::vector<float> want_sel_scores(sel_n);
      cpu::SelectionScores(scores.data(), stride, want_sel.data(), sel_stride, rows, k, want_sel_scores.data());

      const std::vector<int32_t> map0(static_cast<size_t>(c.hkv) * k, -1);  // every slot empty: all misses
      std::vector<std::unique_ptr<DeviceBuffer>> maps[2];
      std::vector<int32_t*> map_ptrs[2];
      std::unique_ptr<DeviceBuffer> dmaps[2], dmiss[2];
      const size_t miss_words = static_cast<size_t>(rows) * (1 + 2 * k);
      ShadowkvSlotUpdateArgs ua[2];
      for (int v = 0; v < 2; ++v) {
        for (int b = 0; b < c.batch; ++b) {
          maps[v].push_back(ToDevice(map0));
          map_ptrs[v].push_back(maps[v].back()->get<int32_t>());
        }
        dmaps[v] = ToDevice(map_ptrs[v]);
        dmiss[v] = ToDevice(std::vector<int32_t>(miss_words, kIntPoison));
        int32_t* m = dmiss[v]->get<int32_t>();
        ua[v].slot_maps = dmaps[v]->get<int32_t* const>();
        ua[v].miss_count = m;
        ua[v].miss_slot = m + rows;
        ua[v].miss_chunk = m + rows + static_cast<size_t>(rows) * k;
        ua[v].batch = c.batch;
        ua[v].hkv = c.hkv;
        ua[v].kslots = k;
        ua[v].chunk_cap = cap;
        ua[v].selection_stride = sel_stride;
      }
      auto dsel = ToDevice(std::vector<int32_t>(sel_n, kIntPoison));
      auto dsel_scores = ToDevice(std::vector<float>(sel_n, kNaN));
      auto scratch = ToDevice(std::vector<float>(score_n, kNaN));
      ShadowkvScoreArgs gs = ga;
      gs.scores = scratch->get<float>();
      gs.select_k = k;
      gs.selection = dsel->get<int32_t>();
      gs.selection_stride = sel_stride;
      gs.selection_scores = dsel_scores->get<float>();
      ua[0].selection = dsel->get<int32_t>();
      ua[1].selection = dwant->get<int32_t>();
      LaunchShadowkvScore(gs, nullptr, &ua[0]);
      LaunchShadowkvSlotUpdate(ua[1], nullptr);
      SKV_CUDA(cudaDeviceSynchronize());
      EXPECT_TRUE(SameInts(dsel->Download<int32_t>(sel_n), want_sel)) << "selection";
      EXPECT_TRUE(CloseOrPoison(dsel_scores->Download<float>(sel_n), want_sel_scores, 0.0f, 0.0f))
          << "selection scores";
      EXPECT_TRUE(SameInts(dmiss[0]->Download<int32_t>(miss_words), dmiss[1]->Download<int32_t>(miss_words)))
          << "miss lists";
      for (int b = 0; b < c.batch; ++b)
        EXPECT_TRUE(SameInts(maps[0][b]->Download<int32_t>(map0.size()), maps[1][b]->Download<int32_t>(map0.size())))
            << "slot map of sequence " << b;
    }
  }
}

TEST(ShadowkvScoreGpu, TwoCallsMatchCpu) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  // Tensor-core phase 1 (bf16, d 128, GQA 4) and the SIMT one (f32); fused
  // selection (max_chunks <= kTopKSharedKeys) and unfused (40000 chunks).
  RunScoreParts({3, 3, 8, 4, 128, 5000, DType::kBF16});
  RunScoreParts({2, 3, 8, 4, 128, 129, DType::kBF16});
  RunScoreParts({2, 1, 8, 4, 128, 40000, DType::kBF16});
  RunScoreParts({3, 3, 2, 4, 128, 3000, DType::kF32});
  RunScoreParts({3, 1, 2, 4, 128, 40000, DType::kF32});
  RunScoreParts({3, 3, 8, 4, 128, 3000, DType::kBF16, 2});
  RunScoreParts({2, 1, 2, 4, 128, 20000, DType::kF32, 4});
}

// ============================================================================
// Landmarks of sequences attached to one prefix, as both backends take them
// ============================================================================

// Records (f32, or fp8: LandmarkChunkElems each) of `chunks` chunks per head
// of random landmarks.
std::vector<uint8_t> RandomLandmarkRecords(Rng& rng, int hkv, int chunks, int per_chunk, int d, bool fp8) {
  const size_t rec_bytes = static_cast<size_t>(LandmarkChunkElems(per_chunk, d, fp8)) * (fp8 ? 1 : sizeof(float));
  HostTensor v = MakeTensor(static_cast<size_t>(hkv) * chunks * per_chunk * d, DType::kBF16, rng, 2.0f);
  std::vector<uint8_t> out(static_cast<size_t>(hkv) * chunks * rec_bytes);
  for (int i = 0; i < hkv * chunks; ++i) {
    const float* src = v.f32.data() + static_cast<size_t>(i) * per_chunk * d;
    if (fp8)
      EncodeLandmarkFp8(src, static_cast<int64_t>(per_chunk) * d, out.data() + i * rec_bytes);
    else
      std::memcpy(out.data() + i * rec_bytes, src, rec_bytes);
  }
  return out;
}

// Batch entries attached to one prefix: its records [hkv][shared_chunks],
// each entry's own [hkv][own_cap] and exclusions [hkv][cap] (entries may
// share them), its chunk count.
struct PrefixedLandmarks {
  int hkv = 0, hq = 0, d = 0, per_chunk = 1, shared_chunks = 0, own_cap = 0, cap = 0, max_chunks = 0;
  bool fp8 = false;
  float scale = 1.0f;
  std::vector<uint8_t> shared;
  std::vector<const std::vector<uint8_t>*> own, excl;
  std::vector<int32_t> n_chunks;

  // The shape, and the prefix's random records (no entries yet).
  PrefixedLandmarks(Rng& rng, int hkv_, int group, int d_, int per_chunk_, bool fp8_, int shared_chunks_, int own_cap_)
      : hkv(hkv_),
        hq(hkv_ * group),
        d(d_),
        per_chunk(per_chunk_),
        shared_chunks(shared_chunks_),
        own_cap(own_cap_),
        cap(shared_chunks_ + own_cap_),
        fp8(fp8_),
        scale(1.0f / std::sqrt(static_cast<float>(d_))),
        shared(RandomLandmarkRecords(rng, hkv_, std::max(shared_chunks_, 1), per_chunk_, d_, fp8_)) {}

  // The CPU's ShadowkvScore of every entry into scores (stride per row).
  void CpuScores(const float* q, float* scores, int64_t stride) const {
    const auto as_f32 = [](const std::vector<uint8_t>* v) { return reinterpret_cast<const float*>(v->data()); };
    const int batch = static_cast<int>(own.size());
    std::vector<const float*> lp, sp(batch, as_f32(&shared));
    std::vector<const uint8_t*> lp8, sp8(batch, shared.data()), ep;
    for (int b = 0; b < batch; ++b) {
      lp.push_back(as_f32(own[b]));
      lp8.push_back(own[b]->data());
      ep.push_back(excl[b]->data());
    }
    cpu::ShadowkvScoreArgs ca;
    ca.q = q;
    if (fp8) {
      ca.landmarks_fp8 = lp8.data();
      ca.shared_landmarks_fp8 = sp8.data();
    } else {
      ca.landmarks = lp.data();
      ca.shared_landmarks = sp.data();
    }
    ca.excluded = ep.data();
    ca.n_chunks = n_chunks.data();
    ca.batch = batch;
    ca.hq = hq;
    ca.hkv = hkv;
    ca.d = d;
    ca.chunk_cap = cap;
    ca.max_chunks = max_chunks;
    ca.shared_chunks = shared_chunks;
    ca.landmark_cap = own_cap;
    ca.scale = scale;
    ca.landmarks_per_chunk = per_chunk;
    ca.scores = scores;
    ca.score_stride = stride;
    cpu::ShadowkvScore(ca);
  }

  // The first `entries` entries on the device (bf16 records, or the fp8 ones
  // as they are) and a ShadowkvScoreArgs naming them (bf16 q; no scores,
  // selection or workspace yet).
  struct Device {
    std::vector<std::unique_ptr<DeviceBuffer>> keep;
    ShadowkvScoreArgs args;
  };
  std::unique_ptr<Device> Upload(const HostTensor& q, int entries) const {
    auto dev = std::make_unique<Device>();
    auto keep = [&](std::unique_ptr<DeviceBuffer> b) {
      dev->keep.push_back(std::move(b));
      return dev->keep.back().get();
    };
    auto records = [&](const std::vector<uint8_t>& recs) {
      if (fp8) return keep(ToDevice(recs));
      std::vector<uint8_t> raw(recs.size() / sizeof(float) * 2);
      ConvertFromF32(reinterpret_cast<const float*>(recs.data()), raw.data(), DType::kBF16,
                     recs.size() / sizeof(float));
      return keep(ToDevice(raw));
    };
    const void* dshared = records(shared)->get();
    std::vector<const void*> dl, ds(entries, dshared);
    std::vector<const uint8_t*> de;
    for (int b = 0; b < entries; ++b) {
      dl.push_back(records(*own[b])->get());
      de.push_back(keep(ToDevice(*excl[b]))->get<uint8_t>());
    }
    ShadowkvScoreArgs& g = dev->args;
    g.q = keep(ToDevice(q.raw))->get();
    g.q_dtype = DType::kBF16;
    g.landmarks = keep(ToDevice(dl))->get<const void* const>();
    g.shared_landmarks = keep(ToDevice(ds))->get<const void* const>();
    g.excluded = keep(ToDevice(de))->get<const uint8_t* const>();
    g.dtype = DType::kBF16;
    g.landmark_fp8 = fp8;
    g.n_chunks = keep(ToDevice(std::vector<int32_t>(n_chunks.begin(), n_chunks.begin() + entries)))->get<int32_t>();
    g.batch = entries;
    g.hq = hq;
    g.hkv = hkv;
    g.d = d;
    g.chunk_cap = cap;
    g.landmark_cap = own_cap;
    g.shared_chunks = shared_chunks;
    g.max_chunks = max_chunks;
    g.scale = scale;
    g.landmarks_per_chunk = per_chunk;
    return dev;
  }
};

// ============================================================================
// Many queries over one sequence (a sparse continuation's selection): the
// tensor-core path against its definition, the CPU's per-row scores' maximum
// ============================================================================

struct QueryScoresCase {
  int rows, hkv, group, d, n;  // n: max_chunks; the sequence has n - n/7 chunks
  int per_chunk;
  bool fp8;
  int shared_chunks;  // chunks read from the "prefix's" landmarks
};

void RunQueryScores(const QueryScoresCase& c) {
  SCOPED_TRACE(::testing::Message() << "rows " << c.rows << " hkv " << c.hkv << " group " << c.group << " d " << c.d
                                    << " n " << c.n << " landmarks per chunk " << c.per_chunk << " fp8 " << c.fp8
                                    << " shared " << c.shared_chunks);
  Rng rng(991 + c.rows + c.n + c.d + c.group + c.per_chunk);
  PrefixedLandmarks p(rng, c.hkv, c.group, c.d, c.per_chunk, c.fp8, c.shared_chunks, c.n + 3 - c.shared_chunks);
  p.max_chunks = c.n;
  const int max_chunks = c.n, n_chunks = std::max(1, c.n - c.n / 7);
  HostTensor q = MakeTensor(static_cast<size_t>(c.rows) * p.hq * c.d, DType::kBF16, rng, 2.0f);
  const std::vector<uint8_t> own = RandomLandmarkRecords(rng, c.hkv, p.own_cap, c.per_chunk, c.d, c.fp8);
  std::vector<uint8_t> excl(static_cast<size_t>(c.hkv) * p.cap, 0);
  for (auto& e : excl) e = rng.Int(7) == 0;
  for (int h = 0; h < c.hkv; ++h) excl[static_cast<size_t>(h) * p.cap] = 1;  // chunk 0: excluded for every head
  // Every query row is an entry of the one sequence (the CPU's definition).
  p.own.assign(c.rows, &own);
  p.excl.assign(c.rows, &excl);
  p.n_chunks.assign(c.rows, n_chunks);

  // The definition on the CPU: every row's ShadowkvScore, the maximum over
  // rows and KV heads.
  std::vector<float> scores(static_cast<size_t>(c.rows) * c.hkv * max_chunks);
  p.CpuScores(q.f32.data(), scores.data(), max_chunks);
  std::vector<float> want(max_chunks);
  cpu::MaxRows(scores.data(), c.rows * c.hkv, max_chunks, max_chunks, want.data(), false);

  auto dev = p.Upload(q, /*entries=*/1);
  auto dbest = ToDevice(std::vector<float>(max_chunks, kNaN));
  DeviceBuffer ws(ShadowkvQueryScoresWorkspaceBytes(c.rows, p.hq, c.hkv, max_chunks, c.per_chunk));
  ShadowkvQueryScoresArgs a;
  a.score = dev->args;
  a.rows = c.rows;
  a.best = dbest->get<float>();
  a.workspace = ws.get();
  a.workspace_bytes = ws.bytes();
  ASSERT_TRUE(LaunchShadowkvQueryScores(a, nullptr));
  SKV_CUDA(cudaDeviceSynchronize());
  const auto got = dbest->Download<float>(max_chunks);
  EXPECT_TRUE(CloseOrPoison(got, want, 1e-30f, 1e-4f));
  EXPECT_EQ(got[0], -std::numeric_limits<float>::infinity());  // excluded for every head
  for (int ch = n_chunks; ch < max_chunks; ++ch) ASSERT_EQ(got[ch], -std::numeric_limits<float>::infinity()) << ch;
}

TEST(ShadowkvQueryScoresGpu, MatchesRowByRowCpu) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  for (bool fp8 : {false, true})
    for (int per_chunk : {1, 4})
      for (int d : {64, 128}) {
        RunQueryScores({64, 2, 4, d, 5000, per_chunk, fp8, 0});
        RunQueryScores({5, 2, 4, d, 129, per_chunk, fp8, 40});
      }
  RunQueryScores({1, 1, 1, 128, 7, 1, true, 0});
  RunQueryScores({37, 3, 3, 128, 700, 2, true, 100});      // a group of 3, rows not a multiple of 16
  RunQueryScores({40, 2, 8, 128, 3000, 4, true, 0});       // 320 query-head rows: three row blocks
  RunQueryScores({600, 2, 4, 128, 2000, 4, true, 500});    // two passes (the second accumulates)
  RunQueryScores({64, 8, 4, 128, 15616, 4, true, 15000});  // the Llama-3.1-8B shape, a question
}

// ============================================================================
// Sequences attached to one prefix (ShadowkvScoreArgs::one_prefix): the GPU's
// one pass over the prefix's landmarks against the CPU's per-sequence scores
// ============================================================================

struct OnePrefixCase {
  int batch, hkv, group, d;
  int shared_chunks;  // the prefix's chunks
  int max_own;        // sequence b has (b * 7) % (max_own + 1) chunks of its own
  int per_chunk;
  bool fp8;
};

void RunOnePrefixScore(const OnePrefixCase& c) {
  SCOPED_TRACE(::testing::Message() << "batch " << c.batch << " hkv " << c.hkv << " group " << c.group << " d " << c.d
                                    << " shared " << c.shared_chunks << " own <= " << c.max_own
                                    << " landmarks per chunk " << c.per_chunk << " fp8 " << c.fp8);
  Rng rng(4242 + c.batch + c.shared_chunks + c.d + c.group + c.per_chunk);
  PrefixedLandmarks p(rng, c.hkv, c.group, c.d, c.per_chunk, c.fp8, c.shared_chunks, c.max_own + 3);
  HostTensor q = MakeTensor(static_cast<size_t>(c.batch) * p.hq * c.d, DType::kBF16, rng, 2.0f);
  // The prefix's exclusions (every sequence's copy the same), then each
  // sequence's own; chunk 0 excluded for every head.
  std::vector<uint8_t> prefix_excl(static_cast<size_t>(c.hkv) * c.shared_chunks);
  for (auto& e : prefix_excl) e = rng.Int(7) == 0;
  for (int h = 0; h < c.hkv; ++h) prefix_excl[static_cast<size_t>(h) * c.shared_chunks] = 1;
  std::vector<std::vector<uint8_t>> own(c.batch), excl(c.batch);
  for (int b = 0; b < c.batch; ++b) {
    own[b] = RandomLandmarkRecords(rng, c.hkv, p.own_cap, c.per_chunk, c.d, c.fp8);
    excl[b].assign(static_cast<size_t>(c.hkv) * p.cap, 0);
    for (int h = 0; h < c.hkv; ++h)
      for (int ch = 0; ch < p.cap; ++ch)
        excl[b][static_cast<size_t>(h) * p.cap + ch] =
            ch < c.shared_chunks ? prefix_excl[static_cast<size_t>(h) * c.shared_chunks + ch] : rng.Int(5) == 0;
    p.own.push_back(&own[b]);
    p.excl.push_back(&excl[b]);
    p.n_chunks.push_back(c.shared_chunks + (b * 7) % (c.max_own + 1));
    p.max_chunks = std::max(p.max_chunks, p.n_chunks.back());
  }
  const int max_chunks = p.max_chunks;
  const int64_t stride = max_chunks + 2;
  std::vector<float> want(static_cast<size_t>(c.batch) * c.hkv * stride, kNaN);
  p.CpuScores(q.f32.data(), want.data(), stride);

  auto dev = p.Upload(q, c.batch);
  const int rows = c.batch * c.hkv;
  const int k = std::min(256, max_chunks);
  const int64_t sel_stride = k + 1;
  auto dscores = ToDevice(std::vector<float>(want.size(), kNaN));
  auto dsel = ToDevice(std::vector<int32_t>(static_cast<size_t>(rows) * sel_stride, kIntPoison));
  ShadowkvScoreArgs g = dev->args;
  g.scores = dscores->get<float>();
  g.score_stride = stride;
  g.select_k = k;
  g.selection = dsel->get<int32_t>();
  g.selection_stride = sel_stride;
  g.one_prefix = true;
  // The call's own workspace: the one-prefix path's, a quarter of the
  // row-by-row logits at 4 landmark rows a chunk.
  const size_t ws_bytes = ShadowkvScoreWorkspaceBytes(g);
  EXPECT_LE(ws_bytes, ShadowkvScoreWorkspaceBytes(c.batch, p.hq, max_chunks, c.per_chunk));
  if (c.per_chunk >= 4) {
    g.one_prefix = false;
    EXPECT_LT(ws_bytes, ShadowkvScoreWorkspaceBytes(g));
    g.one_prefix = true;
  }
  DeviceBuffer ws(ws_bytes);
  g.workspace = ws.get();
  g.workspace_bytes = ws.bytes();
  LaunchShadowkvScore(g, nullptr);
  SKV_CUDA(cudaDeviceSynchronize());
  // The one-pass path writes the scores it selects from: every entry below
  // max_chunks (the rest untouched, NaN here and in want).
  const auto got = dscores->Download<float>(want.size());
  EXPECT_TRUE(CloseOrPoison(got, want, 1e-30f, 1e-4f));
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.hkv; ++h) {
      const float* row = got.data() + (static_cast<int64_t>(b) * c.hkv + h) * stride;
      ASSERT_EQ(row[0], -std::numeric_limits<float>::infinity()) << "chunk 0 is excluded";
      for (int ch = p.n_chunks[b]; ch < max_chunks; ++ch)
        ASSERT_EQ(row[ch], -std::numeric_limits<float>::infinity()) << "sequence " << b << " chunk " << ch;
    }
  // The selection: exactly the top-k (skip_worst_inf) of those scores.
  auto dwant = ToDevice(std::vector<int32_t>(static_cast<size_t>(rows) * sel_stride, kIntPoison));
  TopKArgs ta;
  ta.values = dscores->get<float>();
  ta.stride = stride;
  ta.rows = rows;
  ta.counts = g.n_chunks;
  ta.rows_per_count = c.hkv;
  ta.max_count = max_chunks;
  ta.k = k;
  ta.skip_worst_inf = true;
  ta.out = dwant->get<int32_t>();
  ta.out_stride = sel_stride;
  LaunchTopK(ta, nullptr);
  SKV_CUDA(cudaDeviceSynchronize());
  EXPECT_TRUE(SameInts(dsel->Download<int32_t>(static_cast<size_t>(rows) * sel_stride),
                       dwant->Download<int32_t>(static_cast<size_t>(rows) * sel_stride)));
}

// The score workspace a call asks for (host arithmetic: runs without a GPU).
// A one-prefix call of 64 questions over a 124928-token document (Llama-8B
// heads, 4 landmark rows a chunk) needs its chunk maxima and statistics, not
// the row-by-row logits; a call the one-prefix path does not take (context
// parallel's first call, one sequence, f32 queries) asks for the logits.
TEST(ShadowkvScoreWorkspace, AOnePrefixCallAsksForItsOwnPart) {
  constexpr size_t kMB = 1000000;
  ShadowkvScoreArgs a;
  a.batch = 64;
  a.hq = 32;
  a.hkv = 8;
  a.d = 128;
  a.q_dtype = DType::kBF16;
  a.dtype = DType::kBF16;
  a.landmark_fp8 = true;
  a.landmarks_per_chunk = 4;
  a.max_chunks = 124928 / 8 + 8;  // the document's chunks and the question's
  a.shared_chunks = 124928 / 8;
  a.select_k = 256;
  a.one_prefix = true;
  const size_t one_prefix = ShadowkvScoreWorkspaceBytes(a);
  const size_t any = ShadowkvScoreWorkspaceBytes(a.batch, a.hq, a.max_chunks, a.landmarks_per_chunk);
  EXPECT_GT(one_prefix, 128 * kMB);  // the chunk maxima: 64 x 32 x 15624 f32 (136.0 MB in all)
  EXPECT_LT(one_prefix, 140 * kMB);
  EXPECT_GT(any, 512 * kMB);  // the logits: 4 rows a chunk (514.0 MB in all)
  auto row_by_row = [&](auto change) {
    ShadowkvScoreArgs b = a;
    change(b);
    return ShadowkvScoreWorkspaceBytes(b);
  };
  EXPECT_EQ(row_by_row([](ShadowkvScoreArgs& b) { b.one_prefix = false; }), any);
  EXPECT_EQ(row_by_row([](ShadowkvScoreArgs& b) { b.stats_out = reinterpret_cast<float*>(16); }), any);
  EXPECT_EQ(row_by_row([](ShadowkvScoreArgs& b) { b.q_dtype = DType::kF32; }), any);
  EXPECT_LT(row_by_row([](ShadowkvScoreArgs& b) { b.batch = 1; }), any);  // one sequence: its own logits
  EXPECT_GT(row_by_row([](ShadowkvScoreArgs& b) { b.batch = 1; }), one_prefix / 64);
}

TEST(ShadowkvScoreGpu, OnePrefixMatchesCpu) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  for (bool fp8 : {false, true})
    for (int per_chunk : {1, 4})
      for (int d : {64, 128}) {
        RunOnePrefixScore({6, 2, 4, d, 1000, 20, per_chunk, fp8});
        RunOnePrefixScore({3, 2, 4, d, 40, 9, per_chunk, fp8});  // no tile wholly in the prefix
      }
  for (int group : {1, 2, 8}) RunOnePrefixScore({37, 2, group, 128, 777, 40, 4, true});  // rows not a multiple of 16
  RunOnePrefixScore({2, 1, 4, 128, 256, 0, 1, false});     // tile-aligned prefix, nothing of their own
  RunOnePrefixScore({64, 8, 4, 128, 15616, 30, 4, true});  // 64 questions about a Llama-3.1-8B document
}

// ============================================================================
// Slot update: a run of steps, CPU and GPU maps and miss lists compared exactly
// ============================================================================

void RunSlotUpdate(int batch, int hkv, int ks, int cap, float force_keep, int steps) {
  SCOPED_TRACE(::testing::Message() << "batch " << batch << " hkv " << hkv << " kslots " << ks << " cap " << cap
                                    << " force_keep " << force_keep);
  Rng rng(5 + ks + cap);
  const int rows = batch * hkv;
  std::vector<std::vector<int32_t>> maps(batch, std::vector<int32_t>(static_cast<size_t>(hkv) * ks, -1));
  std::vector<std::unique_ptr<DeviceBuffer>> dmaps;
  std::vector<int32_t*> dmp;
  for (int b = 0; b < batch; ++b) {
    dmaps.push_back(ToDevice(maps[b]));
    dmp.push_back(dmaps.back()->get<int32_t>());
  }
  auto dmapp = ToDevice(dmp);
  const int64_t sel_stride = ks + 1;
  std::vector<int32_t> prev_sel(static_cast<size_t>(rows) * sel_stride, -1);
  for (int step = 0; step < steps; ++step) {
    // Selection: about half of the previous selection kept, rest random;
    // ascending, distinct, sometimes fewer than kslots (-1 padded).
    std::vector<int32_t> sel(static_cast<size_t>(rows) * sel_stride, -1);
    for (int row = 0; row < rows; ++row) {
      std::set<int32_t> s;
      const int n = (step + row) % 5 == 4 ? std::max(1, ks / 3) : ks;
      for (int i = 0; i < ks; ++i) {
        const int32_t c = prev_sel[row * sel_stride + i];
        if (c >= 0 && static_cast<int>(s.size()) < n && rng.Int(2)) s.insert(c);
      }
      while (static_cast<int>(s.size()) < std::min(n, cap)) s.insert(rng.Int(cap));
      int i = 0;
      for (int32_t c : s) sel[row * sel_stride + i++] = c;
    }
    prev_sel = sel;
    std::vector<int32_t> count(rows, kIntPoison), mslot(static_cast<size_t>(rows) * ks, kIntPoison),
        mchunk(static_cast<size_t>(rows) * ks, kIntPoison);
    std::vector<int32_t*> mp;
    for (auto& m : maps) mp.push_back(m.data());
    cpu::ShadowkvSlotUpdateArgs ca;
    ca.selection = sel.data();
    ca.selection_stride = sel_stride;
    ca.slot_maps = mp.data();
    ca.miss_count = count.data();
    ca.miss_slot = mslot.data();
    ca.miss_chunk = mchunk.data();
    ca.batch = batch;
    ca.hkv = hkv;
    ca.kslots = ks;
    ca.chunk_cap = cap;
    ca.force_keep = force_keep;
    cpu::ShadowkvSlotUpdate(ca);

    auto dsel = ToDevice(sel);
    auto dcount = ToDevice(std::vector<int32_t>(rows, kIntPoison));
    auto dslot = ToDevice(std::vector<int32_t>(mslot.size(), kIntPoison));
    auto dchunk = ToDevice(std::vector<int32_t>(mchunk.size(), kIntPoison));
    ShadowkvSlotUpdateArgs ga;
    ga.selection = dsel->get<int32_t>();
    ga.selection_stride = sel_stride;
    ga.slot_maps = dmapp->get<int32_t* const>();
    ga.miss_count = dcount->get<int32_t>();
    ga.miss_slot = dslot->get<int32_t>();
    ga.miss_chunk = dchunk->get<int32_t>();
    ga.batch = batch;
    ga.hkv = hkv;
    ga.kslots = ks;
    ga.chunk_cap = cap;
    ga.force_keep = force_keep;
    LaunchShadowkvSlotUpdate(ga, nullptr);
    SKV_CUDA(cudaDeviceSynchronize());
    SCOPED_TRACE(::testing::Message() << "step " << step);
    ASSERT_TRUE(SameInts(dcount->Download<int32_t>(rows), count));
    ASSERT_TRUE(SameInts(dslot->Download<int32_t>(mslot.size()), mslot));
    ASSERT_TRUE(SameInts(dchunk->Download<int32_t>(mchunk.size()), mchunk));
    for (int b = 0; b < batch; ++b) ASSERT_TRUE(SameInts(dmaps[b]->Download<int32_t>(maps[b].size()), maps[b]));
  }
}

TEST(ShadowkvSlotUpdateGpu, MatchesCpuOverSteps) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  RunSlotUpdate(2, 3, 16, 100, -1.0f, 12);
  RunSlotUpdate(3, 2, 256, 15616, -1.0f, 8);
  RunSlotUpdate(2, 2, 256, 15616, 0.6f, 8);
  RunSlotUpdate(1, 4, 105, 131072, 0.6f, 6);
  RunSlotUpdate(1, 2, 1024, 131072, 0.25f, 5);
  RunSlotUpdate(1, 1, 33, 40, 1.0f, 6);
  RunSlotUpdate(1, 1, 7, 7, 0.0f, 6);  // selection = all chunks
}

// ============================================================================
// Global selection (context parallel): winners and this rank's selection
// exactly as the CPU's, then the slot update of that selection
// ============================================================================

struct GlobalSelectCase {
  int parts, rank, batch, hkv, cand_stride, k;
  bool update;
};

void RunGlobalSelect(const GlobalSelectCase& c) {
  SCOPED_TRACE(::testing::Message() << "parts " << c.parts << " rank " << c.rank << " rows " << c.batch << " x "
                                    << c.hkv << " cand_stride " << c.cand_stride << " k " << c.k << " update "
                                    << c.update);
  Rng rng(900 + 31 * c.parts + 7 * c.rank + c.cand_stride + c.k);
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int rows = c.batch * c.hkv, cs = c.cand_stride;
  const int chunk_cap = 4 * cs + 50;
  // +inf between the parts: a candidate read past a part's rows would win.
  const int64_t part_stride = static_cast<int64_t>(rows) * cs + 5;
  std::vector<float> cand(static_cast<size_t>(c.parts) * part_stride, kInf);
  std::vector<int32_t> prop(static_cast<size_t>(rows) * cs, -1);
  for (int row = 0; row < rows; ++row) {
    for (int p = 0; p < c.parts; ++p) {
      // Each part proposes `count` chunks, then -inf. Row 1: none from this
      // rank (it wins nothing); row 2: few from every part (fewer than k in
      // all: the winners end in -1); row 3: all equal (ties to the lower part,
      // then the lower index); row 4: this rank's best; even rows: few
      // distinct values (ties across parts).
      int count = cs - rng.Int(cs / 4 + 1);
      if (row == 1 && p == c.rank) count = 0;
      if (row == 2) count = std::min(count, std::max(1, c.k / (2 * c.parts)));
      float* v = cand.data() + p * part_stride + static_cast<int64_t>(row) * cs;
      for (int i = 0; i < cs; ++i) {
        float x = -kInf;
        if (i < count) {
          if (row == 3)
            x = 0.5f;
          else if (row % 2 == 0)
            x = 0.125f * static_cast<float>(rng.Int(5));
          else
            x = 0.01f * (rng.Next() + 1.0f);
          if (row == 4 && p == c.rank) x += 1.0f;
        }
        v[i] = x;
      }
      if (p == c.rank) {  // its chunk ids: distinct and ascending (a selection), then -1
        std::set<int32_t> ids;
        while (static_cast<int>(ids.size()) < count) ids.insert(rng.Int(chunk_cap));
        int i = 0;
        for (int32_t id : ids) prop[static_cast<size_t>(row) * cs + i++] = id;
      }
    }
  }
  const int sel_len = cs;                  // this rank's proposals per row, at most
  const int64_t sel_stride = sel_len + 3;  // entries past selection_len keep their poison
  const size_t win_n = static_cast<size_t>(rows) * c.k, sel_n = static_cast<size_t>(rows) * sel_stride;

  std::vector<int32_t> want_win(win_n, kIntPoison), want_sel(sel_n, kIntPoison);
  cpu::ShadowkvGlobalSelectArgs ca;
  ca.candidates = cand.data();
  ca.parts = c.parts;
  ca.rank = c.rank;
  ca.part_stride = part_stride;
  ca.rows = rows;
  ca.cand_stride = cs;
  ca.k = c.k;
  ca.proposals = prop.data();
  ca.winners = want_win.data();
  ca.selection = want_sel.data();
  ca.selection_stride = sel_stride;
  ca.selection_len = sel_len;
  cpu::ShadowkvGlobalSelect(ca);

  auto dcand = ToDevice(cand), dprop = ToDevice(prop);
  auto dwin = ToDevice(std::vector<int32_t>(win_n, kIntPoison));
  auto dsel = ToDevice(std::vector<int32_t>(sel_n, kIntPoison));
  ShadowkvGlobalSelectArgs ga;
  ga.candidates = dcand->get<float>();
  ga.parts = c.parts;
  ga.rank = c.rank;
  ga.part_stride = part_stride;
  ga.rows = rows;
  ga.cand_stride = cs;
  ga.k = c.k;
  ga.proposals = dprop->get<int32_t>();
  ga.winners = dwin->get<int32_t>();
  ga.selection = dsel->get<int32_t>();
  ga.selection_stride = sel_stride;
  ga.selection_len = sel_len;

  // The slot update: maps half full of chunks (some of them selected again).
  const int ks = sel_len;
  std::vector<std::vector<int32_t>> maps(c.batch, std::vector<int32_t>(static_cast<size_t>(c.hkv) * ks, -1));
  for (auto& m : maps)
    for (size_t i = 0; i < m.size(); i += 2) m[i] = static_cast<int32_t>((i / 2 * 3) % chunk_cap);
  std::vector<std::unique_ptr<DeviceBuffer>> dmaps;
  std::vector<int32_t*> dmp, hmp;
  for (auto& m : maps) {
    dmaps.push_back(ToDevice(m));
    dmp.push_back(dmaps.back()->get<int32_t>());
    hmp.push_back(m.data());
  }
  auto dmapp = ToDevice(dmp);
  const size_t miss_n = static_cast<size_t>(rows) * ks;
  auto dcount = ToDevice(std::vector<int32_t>(rows, kIntPoison));
  auto dslot = ToDevice(std::vector<int32_t>(miss_n, kIntPoison));
  auto dchunk = ToDevice(std::vector<int32_t>(miss_n, kIntPoison));
  ShadowkvSlotUpdateArgs ua;
  ua.selection = dsel->get<int32_t>();
  ua.selection_stride = sel_stride;
  ua.slot_maps = dmapp->get<int32_t* const>();
  ua.miss_count = dcount->get<int32_t>();
  ua.miss_slot = dslot->get<int32_t>();
  ua.miss_chunk = dchunk->get<int32_t>();
  ua.batch = c.batch;
  ua.hkv = c.hkv;
  ua.kslots = ks;
  ua.chunk_cap = chunk_cap;

  LaunchShadowkvGlobalSelect(ga, nullptr, c.update ? &ua : nullptr);
  SKV_CUDA(cudaDeviceSynchronize());
  EXPECT_TRUE(SameInts(dwin->Download<int32_t>(win_n), want_win)) << "winners";
  EXPECT_TRUE(SameInts(dsel->Download<int32_t>(sel_n), want_sel)) << "selection";
  if (!c.update) return;
  std::vector<int32_t> count(rows, kIntPoison), mslot(miss_n, kIntPoison), mchunk(miss_n, kIntPoison);
  cpu::ShadowkvSlotUpdateArgs cu;
  cu.selection = want_sel.data();
  cu.selection_stride = sel_stride;
  cu.slot_maps = hmp.data();
  cu.miss_count = count.data();
  cu.miss_slot = mslot.data();
  cu.miss_chunk = mchunk.data();
  cu.batch = c.batch;
  cu.hkv = c.hkv;
  cu.kslots = ks;
  cu.chunk_cap = chunk_cap;
  cpu::ShadowkvSlotUpdate(cu);
  EXPECT_TRUE(SameInts(dcount->Download<int32_t>(rows), count)) << "miss counts";
  EXPECT_TRUE(SameInts(dslot->Download<int32_t>(miss_n), mslot)) << "miss slots";
  EXPECT_TRUE(SameInts(dchunk->Download<int32_t>(miss_n), mchunk)) << "miss chunks";
  for (int b = 0; b < c.batch; ++b)
    EXPECT_TRUE(SameInts(dmaps[b]->Download<int32_t>(maps[b].size()), maps[b])) << "slot map of sequence " << b;
}

TEST(ShadowkvGlobalSelectGpu, MatchesCpuExactly) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  for (bool update : {false, true})
    for (int parts : {2, 3})
      for (int rank = 0; rank < parts; ++rank) {
        RunGlobalSelect({parts, rank, 2, 4, 64, 64, update});    // k = one part's proposals
        RunGlobalSelect({parts, rank, 1, 6, 40, 7, update});     // few winners
        RunGlobalSelect({parts, rank, 3, 2, 37, 1000, update});  // k above every candidate
      }
  RunGlobalSelect({3, 1, 1, 6, 4000, 4096, true});   // largest k
  RunGlobalSelect({3, 2, 1, 6, 12000, 300, false});  // 36000 candidates: keys re-read, not kept in shared memory
  RunGlobalSelect({1, 0, 2, 3, 50, 20, true});       // one part
}

// ============================================================================
// Key rebuild and value fetch
// ============================================================================

struct MissLists {
  std::vector<int32_t> count, slot, chunk;
};
// Per row: `misses` distinct slots of [0, ks) and distinct chunks of [0, n_chunks).
MissLists RandomMisses(Rng& rng, int rows, int ks, int n_chunks, int max_misses) {
  MissLists m;
  m.count.resize(rows);
  m.slot.assign(static_cast<size_t>(rows) * ks, -1);
  m.chunk.assign(static_cast<size_t>(rows) * ks, -1);
  for (int row = 0; row < rows; ++row) {
    const int cnt = row % 4 == 1 ? 0 : std::min(max_misses, 1 + rng.Int(max_misses));
    m.count[row] = cnt;
    std::vector<int32_t> slots(ks);
    std::iota(slots.begin(), slots.end(), 0);
    for (int i = ks - 1; i > 0; --i) std::swap(slots[i], slots[rng.Int(i + 1)]);
    std::set<int32_t> chunks;
    while (static_cast<int>(chunks.size()) < cnt) chunks.insert(rng.Int(n_chunks));
    std::vector<int32_t> cv(chunks.begin(), chunks.end());
    for (int i = cnt - 1; i > 0; --i) std::swap(cv[i], cv[rng.Int(i + 1)]);
    for (int i = 0; i < cnt; ++i) {
      m.slot[row * ks + i] = slots[i];
      m.chunk[row * ks + i] = cv[i];
    }
  }
  return m;
}

struct RebuildCase {
  int batch, hkv, d, r, C, ks, n_chunks;
  DType dtype;
  RebuildKAlgo algo;
};

void RunRebuildK(const RebuildCase& c) {
  SCOPED_TRACE(::testing::Message() << "batch " << c.batch << " hkv " << c.hkv << " d " << c.d << " r " << c.r << " C "
                                    << c.C << " ks " << c.ks << " n_chunks " << c.n_chunks << " dtype "
                                    << DTypeName(c.dtype) << " algo " << static_cast<int>(c.algo));
  Rng rng(31 + c.d + c.r + c.C);
  const int rows = c.batch * c.hkv, O = 3;
  const int token_cap = c.n_chunks * c.C + 5;
  const int att_cap = O * c.C + c.ks * c.C + 11;
  const int64_t head_stride = static_cast<int64_t>(att_cap) * c.d;
  const float b_scale = 1.0f / std::sqrt(static_cast<float>(c.r));
  std::vector<HostTensor> A, B;
  for (int b = 0; b < c.batch; ++b) {
    A.push_back(MakeTensor(static_cast<size_t>(token_cap) * c.r, c.dtype, rng));
    B.push_back(MakeTensor(static_cast<size_t>(c.hkv) * c.r * c.d, c.dtype, rng, b_scale * 2.0f));
  }
  std::vector<float> inv_freq(c.d / 2);
  for (int j = 0; j < c.d / 2; ++j) inv_freq[j] = std::pow(500000.0f, -2.0f * j / c.d);
  std::vector<int32_t> offset(c.batch);
  for (int b = 0; b < c.batch; ++b) offset[b] = b == 0 ? 0 : 1000003 * b;  // large angles too
  const MissLists m = RandomMisses(rng, rows, c.ks, c.n_chunks, c.ks);

  std::vector<std::vector<float>> K(c.batch, std::vector<float>(static_cast<size_t>(c.hkv) * head_stride, kNaN));
  std::vector<const float*> ap, bp;
  std::vector<float*> kp;
  for (int b = 0; b < c.batch; ++b) {
    ap.push_back(A[b].f32.data());
    bp.push_back(B[b].f32.data());
    kp.push_back(K[b].data());
  }
  cpu::ShadowkvRebuildKArgs ca;
  ca.a = ap.data();
  ca.b = bp.data();
  ca.position_offset = offset.data();
  ca.inv_freq = inv_freq.data();
  ca.miss_count = m.count.data();
  ca.miss_slot = m.slot.data();
  ca.miss_chunk = m.chunk.data();
  ca.miss_stride = c.ks;
  ca.att_k = kp.data();
  ca.att_head_stride = head_stride;
  ca.outlier_rows = O * c.C;
  ca.batch = c.batch;
  ca.hkv = c.hkv;
  ca.d = c.d;
  ca.r = c.r;
  ca.chunk_size = c.C;
  cpu::ShadowkvRebuildK(ca);

  std::vector<std::unique_ptr<DeviceBuffer>> keep, dk;
  std::vector<const void*> dap, dbp;
  std::vector<void*> dkp;
  for (int b = 0; b < c.batch; ++b) {
    keep.push_back(ToDevice(A[b].raw));
    dap.push_back(keep.back()->get());
    keep.push_back(ToDevice(B[b].raw));
    dbp.push_back(keep.back()->get());
    dk.push_back(ToDevice(Poisoned(static_cast<size_t>(c.hkv) * head_stride, c.dtype)));
    dkp.push_back(dk.back()->get());
  }
  auto da = ToDevice(dap), db = ToDevice(dbp), dkk = ToDevice(dkp);
  auto doff = ToDevice(offset), dfreq = ToDevice(inv_freq);
  auto dcount = ToDevice(m.count), dslot = ToDevice(m.slot), dchunk = ToDevice(m.chunk);
  ShadowkvRebuildKArgs ga;
  ga.a = da->get<const void* const>();
  ga.b = db->get<const void* const>();
  ga.position_offset = doff->get<int32_t>();
  ga.inv_freq = dfreq->get<float>();
  ga.miss_count = dcount->get<int32_t>();
  ga.miss_slot = dslot->get<int32_t>();
  ga.miss_chunk = dchunk->get<int32_t>();
  ga.miss_stride = c.ks;
  ga.att_k = dkk->get<void* const>();
  ga.att_head_stride = head_stride;
  ga.outlier_rows = O * c.C;
  ga.dtype = c.dtype;
  ga.batch = c.batch;
  ga.hkv = c.hkv;
  ga.d = c.d;
  ga.r = c.r;
  ga.chunk_size = c.C;
  ga.max_misses = c.ks;
  ga.algo = c.algo;
  LaunchShadowkvRebuildK(ga, nullptr);
  SKV_CUDA(cudaDeviceSynchronize());
  // bf16 output: <= 0.5 ulp of rounding plus f32 summation-order effects.
  const float atol = c.dtype == DType::kBF16 ? 2e-3f : 5e-5f;
  const float rtol = c.dtype == DType::kBF16 ? 8e-3f : 1e-5f;
  for (int b = 0; b < c.batch; ++b)
    EXPECT_TRUE(CloseOrPoison(DownloadF32(*dk[b], K[b].size(), c.dtype), K[b], atol, rtol)) << "sequence " << b;
}

TEST(ShadowkvRebuildKGpu, MatchesCpu) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  for (RebuildKAlgo algo : {RebuildKAlgo::kAuto, RebuildKAlgo::kSimt})
    for (int d : {64, 128})
      for (int r : {160, 37})
        for (int C : {8, 16}) RunRebuildK({2, 3, d, r, C, 13, 300, DType::kBF16, algo});
  for (int C : {1, 7, 64}) RunRebuildK({1, 2, 128, 160, C, 5, 40, DType::kBF16, RebuildKAlgo::kAuto});
  RunRebuildK({2, 2, 128, 160, 8, 256, 1000, DType::kBF16, RebuildKAlgo::kAuto});  // many tiles per row
  RunRebuildK({1, 2, 128, 512, 8, 20, 100, DType::kBF16, RebuildKAlgo::kAuto});
  RunRebuildK({1, 2, 256, 160, 8, 20, 100, DType::kBF16, RebuildKAlgo::kAuto});
  RunRebuildK({1, 2, 96, 160, 8, 20, 100, DType::kBF16, RebuildKAlgo::kAuto});  // SIMT fallback (d % 64 != 0)
  RunRebuildK({2, 3, 128, 160, 8, 13, 300, DType::kF32, RebuildKAlgo::kAuto});
  RunRebuildK({1, 2, 64, 37, 7, 9, 50, DType::kF32, RebuildKAlgo::kAuto});
}

struct FetchCase {
  int batch, hkv, d, C, ks, chunk_cap;
  DType dtype;
  bool staged;
  int max_blocks = 0;      // 0: the launcher's default
  bool on_device = false;  // ShadowkvFetchVArgs::values_on_device (a warp per miss)
  // > 0: chunks below it are an attached prefix's (the same rows of the
  // store, read through shared_store); with skip_shared they are not copied
  // (their V rows stay poisoned, as the reference leaves them NaN).
  int shared_chunks = 0;
  bool skip_shared = false;
};

void RunFetchV(const FetchCase& c) {
  SCOPED_TRACE(::testing::Message() << "batch " << c.batch << " hkv " << c.hkv << " d " << c.d << " C " << c.C << " ks "
                                    << c.ks << " dtype " << DTypeName(c.dtype) << " staged " << c.staged
                                    << " max_blocks " << c.max_blocks << " on_device " << c.on_device
                                    << " shared_chunks " << c.shared_chunks << " skip_shared " << c.skip_shared);
  Rng rng(11 + c.d + c.C + c.ks);
  const int rows = c.batch * c.hkv, O = 2;
  const int att_cap = O * c.C + c.ks * c.C + 3;
  const int64_t head_stride = static_cast<int64_t>(att_cap) * c.d;
  const size_t chunk_elems = static_cast<size_t>(c.C) * c.d;
  const size_t store_elems = static_cast<size_t>(c.hkv) * c.chunk_cap * chunk_elems;
  const size_t es = DTypeSize(c.dtype);
  const MissLists m = RandomMisses(rng, rows, c.ks, c.chunk_cap, c.ks);

  std::vector<HostTensor> store;
  std::vector<std::unique_ptr<MappedHostBuffer>> hstore;
  std::vector<const float*> sp, sp_own;
  std::vector<const void*> dsp, dsp_own;
  for (int b = 0; b < c.batch; ++b) {
    store.push_back(MakeTensor(store_elems, c.dtype, rng));
    hstore.push_back(std::make_unique<MappedHostBuffer>(store_elems * es));
    std::memcpy(hstore.back()->host(), store.back().raw.data(), store_elems * es);
    sp.push_back(store.back().f32.data());
    dsp.push_back(hstore.back()->device());
    // The sequence's own rows start after the prefix's chunks (same strides).
    sp_own.push_back(sp.back() + static_cast<size_t>(c.shared_chunks) * chunk_elems);
    dsp_own.push_back(static_cast<const char*>(dsp.back()) + static_cast<size_t>(c.shared_chunks) * chunk_elems * es);
  }
  // Staging buffer in miss-list order with compact offsets.
  std::vector<int32_t> offsets(rows);
  std::vector<float> staging_f32;
  for (int row = 0, at = 0; row < rows; ++row) {
    offsets[row] = at;
    at += m.count[row];
    for (int i = 0; i < m.count[row]; ++i) {
      const float* src =
          sp[row / c.hkv] + (static_cast<size_t>(row % c.hkv) * c.chunk_cap + m.chunk[row * c.ks + i]) * chunk_elems;
      staging_f32.insert(staging_f32.end(), src, src + chunk_elems);
    }
  }
  std::vector<uint8_t> staging_raw(staging_f32.size() * es);
  ConvertFromF32(staging_f32.data(), staging_raw.data(), c.dtype, staging_f32.size());

  std::vector<std::vector<float>> V(c.batch, std::vector<float>(static_cast<size_t>(c.hkv) * head_stride, kNaN));
  std::vector<float*> vp;
  for (auto& v : V) vp.push_back(v.data());
  cpu::ShadowkvFetchVArgs ca;
  ca.value_store = sp_own.data();
  ca.chunk_cap = c.chunk_cap;
  ca.shared_store = sp.data();
  ca.shared_chunks = c.shared_chunks;
  ca.shared_stride = c.chunk_cap;
  ca.skip_shared = c.skip_shared;
  ca.staging = c.staged ? staging_f32.data() : nullptr;
  ca.staging_offsets = offsets.data();
  ca.miss_count = m.count.data();
  ca.miss_slot = m.slot.data();
  ca.miss_chunk = m.chunk.data();
  ca.miss_stride = c.ks;
  ca.att_v = vp.data();
  ca.att_head_stride = head_stride;
  ca.outlier_rows = O * c.C;
  ca.batch = c.batch;
  ca.hkv = c.hkv;
  ca.d = c.d;
  ca.chunk_size = c.C;
  cpu::ShadowkvFetchV(ca);

  std::vector<std::unique_ptr<DeviceBuffer>> dv;
  std::vector<void*> dvp;
  for (int b = 0; b < c.batch; ++b) {
    dv.push_back(ToDevice(Poisoned(static_cast<size_t>(c.hkv) * head_stride, c.dtype)));
    dvp.push_back(dv.back()->get());
  }
  auto dstore = ToDevice(dsp_own), dshared = ToDevice(dsp), dvv = ToDevice(dvp), dstaging = ToDevice(staging_raw),
       doffs = ToDevice(offsets);
  auto dcount = ToDevice(m.count), dslot = ToDevice(m.slot), dchunk = ToDevice(m.chunk);
  ShadowkvFetchVArgs ga;
  ga.value_store = dstore->get<const void* const>();
  ga.chunk_cap = c.chunk_cap;
  ga.shared_store = dshared->get<const void* const>();
  ga.shared_chunks = c.shared_chunks;
  ga.shared_stride = c.chunk_cap;
  ga.skip_shared = c.skip_shared;
  ga.staging = c.staged ? dstaging->get() : nullptr;
  ga.staging_offsets = doffs->get<int32_t>();
  ga.miss_count = dcount->get<int32_t>();
  ga.miss_slot = dslot->get<int32_t>();
  ga.miss_chunk = dchunk->get<int32_t>();
  ga.miss_stride = c.ks;
  ga.att_v = dvv->get<void* const>();
  ga.att_head_stride = head_stride;
  ga.outlier_rows = O * c.C;
  ga.dtype = c.dtype;
  ga.batch = c.batch;
  ga.hkv = c.hkv;
  ga.d = c.d;
  ga.chunk_size = c.C;
  ga.max_misses = c.ks;
  ga.max_blocks = c.max_blocks;
  ga.values_on_device = c.on_device;
  if (c.staged)
    LaunchShadowkvScatterV(ga, nullptr);
  else
    LaunchShadowkvFetchV(ga, nullptr);
  SKV_CUDA(cudaDeviceSynchronize());
  for (int b = 0; b < c.batch; ++b)
    EXPECT_TRUE(CloseOrPoison(DownloadF32(*dv[b], V[b].size(), c.dtype), V[b], 0.0f, 0.0f)) << "sequence " << b;
}

TEST(ShadowkvFetchVGpu, MatchesCpu) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  for (bool staged : {false, true}) {
    RunFetchV({2, 3, 128, 8, 17, 200, DType::kBF16, staged});
    RunFetchV({1, 2, 64, 16, 40, 100, DType::kBF16, staged});
    RunFetchV({2, 2, 64, 1, 9, 30, DType::kBF16, staged});
    RunFetchV({1, 2, 128, 64, 6, 20, DType::kBF16, staged});
    RunFetchV({1, 2, 128, 8, 300, 2000, DType::kBF16, staged});
    RunFetchV({2, 2, 64, 7, 11, 50, DType::kF32, staged});
    RunFetchV({1, 1, 128, 8, 10, 40, DType::kBF16, staged});  // one row
    RunFetchV({40, 8, 64, 8, 5, 30, DType::kBF16, staged});   // 320 rows: several per thread in the prefix scan
    // Grid-stride loops with fewer and more blocks than the default 32.
    RunFetchV({2, 3, 128, 8, 17, 200, DType::kBF16, staged, 1});
    RunFetchV({1, 2, 128, 8, 300, 2000, DType::kBF16, staged, 3});
    RunFetchV({1, 2, 128, 8, 300, 2000, DType::kBF16, staged, 96});
    // A warp per miss (values in device memory): chunks of fewer, as many and
    // more vectors than a warp's lanes, one block and many.
    for (int blocks : {1, 1024}) {
      RunFetchV({2, 3, 128, 8, 17, 200, DType::kBF16, staged, blocks, true});
      RunFetchV({2, 2, 64, 1, 9, 30, DType::kBF16, staged, blocks, true});
      RunFetchV({1, 2, 128, 64, 6, 20, DType::kBF16, staged, blocks, true});
      RunFetchV({2, 2, 64, 7, 11, 50, DType::kF32, staged, blocks, true});
      RunFetchV({40, 8, 64, 8, 5, 30, DType::kBF16, staged, blocks, true});
    }
  }
  // An attached prefix's chunks: copied from shared_store, or skipped (the
  // attention reads them in place) by FetchVOwnKernel: rows of fewer, as many
  // and more entries than a warp's 32, one block and many.
  for (int blocks : {0, 1, 1024}) {
    for (bool skip : {false, true}) {
      RunFetchV({2, 3, 128, 8, 17, 200, DType::kBF16, false, blocks, true, 150, skip});
      RunFetchV({1, 2, 128, 8, 300, 2000, DType::kBF16, false, blocks, true, 1000, skip});
      RunFetchV({2, 2, 64, 7, 11, 50, DType::kF32, false, blocks, true, 40, skip});
      RunFetchV({40, 8, 64, 8, 5, 30, DType::kBF16, false, blocks, true, 29, skip});
    }
  }
}

// ============================================================================
// Timing harness (PENUMBRA_KERNEL_BENCH=1)
// ============================================================================

// Fills a device buffer with random bf16 in [-scale, scale) in slices.
void FillRandomBf16(void* dst, size_t n, Rng& rng, float scale) {
  constexpr size_t kSlice = size_t{1} << 24;
  std::vector<uint16_t> buf(std::min(n, kSlice));
  for (size_t off = 0; off < n; off += kSlice) {
    const size_t len = std::min(kSlice, n - off);
    for (size_t i = 0; i < len; ++i) buf[i] = F32ToBF16(rng.Next() * scale);
    SKV_CUDA(cudaMemcpy(static_cast<uint16_t*>(dst) + off, buf.data(), len * 2, cudaMemcpyHostToDevice));
  }
}

TEST(ShadowkvDecodeGpuBench, Timings) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  if (!::penumbra::testing::KernelBenchEnabled()) GTEST_SKIP() << "set PENUMBRA_KERNEL_BENCH=1";
  const int batch = 16, hkv = 8, hq = 32, d = 128, n = 15616, C = 8, r = 160, ks = 256, misses = 105;
  const int rows = batch * hkv;
  Rng rng(99);
  cudaStream_t s0, s1;
  SKV_CUDA(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  SKV_CUDA(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));

  // ---- scores: 15616 chunks x 8 heads x batch 16, GQA 4 ----
  const size_t land_elems = static_cast<size_t>(hkv) * n * d;
  DeviceBuffer land(batch * land_elems * 2);
  FillRandomBf16(land.get(), batch * land_elems, rng, 1.0f);
  std::vector<const void*> lp;
  for (int b = 0; b < batch; ++b) lp.push_back(land.get<uint16_t>() + b * land_elems);
  auto dlp = ToDevice(lp);
  DeviceBuffer q(static_cast<size_t>(batch) * hq * d * 2);
  FillRandomBf16(q.get(), static_cast<size_t>(batch) * hq * d, rng, 1.0f);
  auto dn = ToDevice(std::vector<int32_t>(batch, n));
  DeviceBuffer scores(static_cast<size_t>(rows) * n * 4);
  DeviceBuffer ws(ShadowkvScoreWorkspaceBytes(batch, hq, n));
  ShadowkvScoreArgs sa;
  sa.q = q.get();
  sa.landmarks = dlp->get<const void* const>();
  sa.n_chunks = dn->get<int32_t>();
  sa.batch = batch;
  sa.hq = hq;
  sa.hkv = hkv;
  sa.d = d;
  sa.chunk_cap = n;
  sa.max_chunks = n;
  sa.scale = 1.0f / std::sqrt(static_cast<float>(d));
  sa.scores = scores.get<float>();
  sa.score_stride = n;
  sa.workspace = ws.get();
  sa.workspace_bytes = ws.bytes();
  const float score_ms = TimeMs([&] { LaunchShadowkvScore(sa, s0); }, 20, s0);
  std::printf("[bench] score  %d chunks x %d kv heads x batch %d (d %d, GQA %d): %.3f ms, landmarks %.0f GB/s\n", n,
              hkv, batch, d, hq / hkv, score_ms, batch * land_elems * 2 / (score_ms * 1e-3) / 1e9);

  // ---- top-k 256 of 15616 for 128 rows ----
  DeviceBuffer sel(static_cast<size_t>(rows) * ks * 4);
  TopKArgs ta;
  ta.values = scores.get<float>();
  ta.stride = n;
  ta.rows = rows;
  ta.uniform_count = n;
  ta.max_count = n;
  ta.k = ks;
  ta.out = sel.get<int32_t>();
  ta.out_stride = ks;
  const float topk_ms = TimeMs([&] { LaunchTopK(ta, s0); }, 20, s0);
  std::printf("[bench] top-k  %d of %d, %d rows: %.3f ms\n", ks, n, rows, topk_ms);
  {
    // A million-token shard's decode step: 256 of 131072 chunks, 8 rows
    // (batch 1 x 8 KV heads), one block per row and split.
    const int long_n = 131072, long_rows = hkv;
    std::vector<float> lv(static_cast<size_t>(long_rows) * long_n);
    for (float& x : lv) x = rng.Next();
    auto dlv = ToDevice(lv);
    DeviceBuffer lsel(static_cast<size_t>(long_rows) * ks * 4);
    TopKArgs la;
    la.values = dlv->get<float>();
    la.stride = long_n;
    la.rows = long_rows;
    la.uniform_count = long_n;
    la.max_count = long_n;
    la.k = ks;
    la.skip_worst_inf = true;
    la.out = lsel.get<int32_t>();
    la.out_stride = ks;
    const float one_ms = TimeMs([&] { LaunchTopK(la, s0); }, 20, s0);
    DeviceBuffer lws(static_cast<size_t>(TopKSplitWorkspaceInts(long_rows, long_n, ks)) * 4);
    la.split_workspace = lws.get<int32_t>();
    la.split_workspace_ints = TopKSplitWorkspaceInts(long_rows, long_n, ks);
    const float split_ms = TimeMs([&] { LaunchTopK(la, s0); }, 20, s0);
    std::printf("[bench] top-k  %d of %d, %d rows: one block a row %.3f ms, split %.3f ms\n", ks, long_n, long_rows,
                one_ms, split_ms);
  }
  ShadowkvScoreArgs ss = sa;
  ss.select_k = ks;
  ss.selection = sel.get<int32_t>();
  ss.selection_stride = ks;
  const float fused_ms = TimeMs([&] { LaunchShadowkvScore(ss, s0); }, 20, s0);
  std::printf("[bench] score + top-k fused: %.3f ms (score, then top-k: %.3f ms)\n", fused_ms, score_ms + topk_ms);

  // ---- rebuild K / fetch V of 16*8*105 misses ----
  const int token_cap = n * C;
  const size_t a_elems = static_cast<size_t>(token_cap) * r, b_elems = static_cast<size_t>(hkv) * r * d;
  const int att_cap = 48 * C + ks * C + 64;
  const size_t att_elems = static_cast<size_t>(hkv) * att_cap * d;
  DeviceBuffer A(batch * a_elems * 2), B(batch * b_elems * 2), K(batch * att_elems * 2), V(batch * att_elems * 2);
  FillRandomBf16(A.get(), batch * a_elems, rng, 1.0f);
  FillRandomBf16(B.get(), batch * b_elems, rng, 0.1f);
  const int store_chunks = 2048;  // value store per sequence: 8 heads x 2048 chunks x 2 KiB
  const size_t store_elems = static_cast<size_t>(hkv) * store_chunks * C * d;
  MappedHostBuffer store(batch * store_elems * 2);
  std::memset(store.host(), 0x3c, batch * store_elems * 2);
  std::vector<const void*> ap, bp, sp;
  std::vector<void*> kp, vp;
  for (int b = 0; b < batch; ++b) {
    ap.push_back(A.get<uint16_t>() + b * a_elems);
    bp.push_back(B.get<uint16_t>() + b * b_elems);
    kp.push_back(K.get<uint16_t>() + b * att_elems);
    vp.push_back(V.get<uint16_t>() + b * att_elems);
    sp.push_back(static_cast<uint16_t*>(store.device()) + b * store_elems);
  }
  auto dap = ToDevice(ap), dbp = ToDevice(bp), dkp = ToDevice(kp), dvp = ToDevice(vp), dsp = ToDevice(sp);
  std::vector<float> inv_freq(d / 2);
  for (int j = 0; j < d / 2; ++j) inv_freq[j] = std::pow(500000.0f, -2.0f * j / d);
  auto dfreq = ToDevice(inv_freq);
  // Exactly `misses` distinct chunks and slots per row.
  MissLists full = RandomMisses(rng, rows, ks, store_chunks, misses);
  {
    for (int row = 0; row < rows; ++row)
      if (full.count[row] != misses) {
        std::set<int32_t> used(full.chunk.begin() + row * ks, full.chunk.begin() + row * ks + full.count[row]);
        std::set<int32_t> used_slots(full.slot.begin() + row * ks, full.slot.begin() + row * ks + full.count[row]);
        int next_chunk = 0, next_slot = 0;
        for (int i = full.count[row]; i < misses; ++i) {
          while (used.count(next_chunk)) ++next_chunk;
          while (used_slots.count(next_slot)) ++next_slot;
          full.chunk[row * ks + i] = next_chunk;
          full.slot[row * ks + i] = next_slot;
          used.insert(next_chunk);
          used_slots.insert(next_slot);
        }
        full.count[row] = misses;
      }
  }
  auto dcount = ToDevice(full.count), dslot = ToDevice(full.slot), dchunk = ToDevice(full.chunk);
  ShadowkvRebuildKArgs ka;
  ka.a = dap->get<const void* const>();
  ka.b = dbp->get<const void* const>();
  ka.inv_freq = dfreq->get<float>();
  ka.miss_count = dcount->get<int32_t>();
  ka.miss_slot = dslot->get<int32_t>();
  ka.miss_chunk = dchunk->get<int32_t>();
  ka.miss_stride = ks;
  ka.att_k = dkp->get<void* const>();
  ka.att_head_stride = static_cast<int64_t>(att_cap) * d;
  ka.outlier_rows = 48 * C;
  ka.batch = batch;
  ka.hkv = hkv;
  ka.d = d;
  ka.r = r;
  ka.chunk_size = C;
  ka.max_misses = ks;
  const float rebuild_ms = TimeMs([&] { LaunchShadowkvRebuildK(ka, s0); }, 20, s0);
  ka.algo = RebuildKAlgo::kSimt;
  const float rebuild_simt_ms = TimeMs([&] { LaunchShadowkvRebuildK(ka, s0); }, 5, s0);
  ka.algo = RebuildKAlgo::kAuto;
  const double flops = 2.0 * rows * misses * C * static_cast<double>(r) * d;
  std::printf("[bench] rebuild K %d misses (r %d): %.3f ms tensor cores (%.1f TFLOP/s), %.3f ms SIMT\n", rows * misses,
              r, rebuild_ms, flops / (rebuild_ms * 1e-3) / 1e12, rebuild_simt_ms);

  ShadowkvFetchVArgs fa;
  fa.value_store = dsp->get<const void* const>();
  fa.chunk_cap = store_chunks;
  fa.miss_count = dcount->get<int32_t>();
  fa.miss_slot = dslot->get<int32_t>();
  fa.miss_chunk = dchunk->get<int32_t>();
  fa.miss_stride = ks;
  fa.att_v = dvp->get<void* const>();
  fa.att_head_stride = static_cast<int64_t>(att_cap) * d;
  fa.outlier_rows = 48 * C;
  fa.batch = batch;
  fa.hkv = hkv;
  fa.d = d;
  fa.chunk_size = C;
  fa.max_misses = ks;
  const double fetch_bytes = static_cast<double>(rows) * misses * C * d * 2;
  const float fetch_ms = TimeMs([&] { LaunchShadowkvFetchV(fa, s1); }, 10, s1);
  std::printf("[bench] fetch V %d misses (%.1f MB over PCIe, zero copy): %.3f ms, %.1f GB/s\n", rows * misses,
              fetch_bytes / 1e6, fetch_ms, fetch_bytes / (fetch_ms * 1e-3) / 1e9);

  // Staging variant: chunks already in device memory in miss-list order.
  DeviceBuffer staging(static_cast<size_t>(rows) * ks * C * d * 2);
  fa.staging = staging.get();
  const float scatter_ms = TimeMs([&] { LaunchShadowkvScatterV(fa, s1); }, 20, s1);
  fa.staging = nullptr;
  std::printf("[bench] scatter V (staged, device to device) %d misses: %.3f ms\n", rows * misses, scatter_ms);

  // Rebuild K and fetch V concurrently, as in a decode step.
  cudaEvent_t fork, join;
  SKV_CUDA(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  SKV_CUDA(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  const float both_ms = TimeMs(
      [&] {
        SKV_CUDA(cudaEventRecord(fork, s0));
        SKV_CUDA(cudaStreamWaitEvent(s1, fork, 0));
        LaunchShadowkvFetchV(fa, s1);
        LaunchShadowkvRebuildK(ka, s0);
        SKV_CUDA(cudaEventRecord(join, s1));
        SKV_CUDA(cudaStreamWaitEvent(s0, join, 0));
      },
      10, s0);
  std::printf("[bench] rebuild K || fetch V on two streams: %.3f ms\n", both_ms);
  cudaEventDestroy(fork);
  cudaEventDestroy(join);
  SKV_CUDA(cudaStreamSynchronize(s0));
  SKV_CUDA(cudaStreamSynchronize(s1));
  cudaStreamDestroy(s0);
  cudaStreamDestroy(s1);
}

}  // namespace
}  // namespace penumbra::kernels
