// CUDA SpindleKV codebooks (kernels/spindlekv_codebook.cuh) against the host
// math (worker/engine/spindlekv_math.h) on the same dtype-rounded inputs. It
// lives under tests/worker, not tests/kernels, because spindlekv::
// BuildCodebook and MergeOrAdd are in penumbra_engine, which only the worker
// tests link.
//
// BuildCodebook: many problems of different n in one launch (0, 1, n not a
// multiple of the block, exact multiples), rows gathered through `rows` from
// a strided source, tight clusters (pairwise cos ~0.995) and arcs whose
// neighbours only are within the threshold (so degrees differ and the greedy
// order matters), singletons, zero rows, non-finite rows, tiny rows and an
// all-zero problem (e_0); blocks of 1, 64, 200 and 1024 rows; f32 and bf16
// sources and entries; d 32 to 256. References must match exactly, entries
// within the entry dtype's rounding.
//
// Merge: two decode steps over sequences x KV heads at one layer of two,
// base parts present and absent, own parts empty and not, rows that merge
// into a base entry, into an own entry (one appended the step before), into
// a tie between a base entry and its copy in the own part (the lower index),
// rows that add, zero rows (entry 0, or e_0 into an empty codebook); the
// references, magnitudes, appended entries, counts, token records, part[1].n
// and the gathered views are checked, and the other layer left alone.
// Outputs are poisoned before each launch.
//
// PENUMBRA_KERNEL_BENCH=1 also times BuildCodebook at 124928 rows x 16
// problems and a merge over 125000 entries per KV head.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/dtype.h"
#include "kernels/spindlekv_codebook.cuh"
#include "tests/gpu_test_util.h"
#include "worker/engine/spindlekv_math.h"

namespace penumbra::kernels {
namespace {

using ::penumbra::testing::Download;
using ::penumbra::testing::DownloadAs;
using ::penumbra::testing::GpuBuffer;
using ::penumbra::testing::KernelBenchEnabled;
using ::penumbra::testing::TimeMs;
using ::penumbra::testing::Upload;
using ::penumbra::testing::UploadAs;

void Poison(const GpuBuffer& b, size_t bytes) { CHECK(cudaMemset(b.get(), 0xff, bytes) == cudaSuccess); }

// f32 values as the device holds them in `dtype`, widened back.
std::vector<float> Rounded(const std::vector<float>& x, DType dtype) {
  std::vector<char> host(x.size() * DTypeSize(dtype));
  ConvertFromF32(x.data(), host.data(), dtype, x.size());
  std::vector<float> out(x.size());
  ConvertToF32(host.data(), dtype, out.data(), x.size());
  return out;
}

std::vector<float> RandomUnit(std::mt19937& rng, int d) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(d);
  double s = 0;
  for (float& x : v) {
    x = nd(rng);
    s += static_cast<double>(x) * x;
  }
  for (float& x : v) x = static_cast<float>(x / std::sqrt(s));
  return v;
}

// `base` plus gaussian noise of expected norm `eps`, scaled by `mag`.
std::vector<float> Near(std::mt19937& rng, const float* base, int d, float eps, float mag) {
  std::normal_distribution<float> nd(0.0f, eps / std::sqrt(static_cast<float>(d)));
  std::vector<float> v(d);
  for (int c = 0; c < d; ++c) v[c] = (base[c] + nd(rng)) * mag;
  return v;
}

// n rows of d floats in groups: tight clusters (members at cos ~0.995 from
// the centre, ~0.99 from each other), arcs of points phi apart in a random
// plane with cos(phi) = (1 + theta) / 2 (neighbours adjacent, the next but
// one not: a graph whose degrees differ), singletons; random magnitudes;
// with `specials` zero rows, non-finite rows and a tiny row; shuffled.
std::vector<float> MakeRows(std::mt19937& rng, int64_t n, int d, float theta, bool specials) {
  std::uniform_real_distribution<float> mag(0.5f, 4.0f);
  std::vector<std::vector<float>> rows;
  const double phi = std::acos((1.0 + theta) / 2.0);
  while (static_cast<int64_t>(rows.size()) < n) {
    const int kind = static_cast<int>(rng() % 4);
    const std::vector<float> c = RandomUnit(rng, d);
    if (kind == 0 || kind == 3) {
      const int size = kind == 0 ? 1 + static_cast<int>(rng() % 40) : 150;
      for (int k = 0; k < size; ++k) rows.push_back(Near(rng, c.data(), d, 0.07f, mag(rng)));
    } else if (kind == 1) {
      // w: a unit vector orthogonal to c.
      std::vector<float> w = RandomUnit(rng, d);
      double dot = 0;
      for (int i = 0; i < d; ++i) dot += static_cast<double>(w[i]) * c[i];
      double s = 0;
      for (int i = 0; i < d; ++i) {
        w[i] = static_cast<float>(w[i] - dot * c[i]);
        s += static_cast<double>(w[i]) * w[i];
      }
      for (float& x : w) x = static_cast<float>(x / std::sqrt(s));
      const int len = 2 + static_cast<int>(rng() % 7);
      for (int k = 0; k < len; ++k) {
        std::vector<float> p(d);
        for (int i = 0; i < d; ++i) p[i] = static_cast<float>(std::cos(k * phi) * c[i] + std::sin(k * phi) * w[i]);
        rows.push_back(Near(rng, p.data(), d, 0.003f, mag(rng)));
      }
    } else {
      std::vector<float> v = c;
      for (float& x : v) x *= mag(rng);
      rows.push_back(v);
    }
  }
  rows.resize(n);
  if (specials && n >= 8) {
    rows[1].assign(d, 0.0f);
    rows[n / 2].assign(d, 0.0f);
    rows[n - 1].assign(d, 0.0f);
    rows[2][d / 3] = std::numeric_limits<float>::infinity();
    rows[3][d - 1] = std::numeric_limits<float>::quiet_NaN();
    for (float& x : rows[4]) x *= 1e-20f;  // squares below f32's range: the norm is f64
  }
  std::shuffle(rows.begin(), rows.end(), rng);
  std::vector<float> out;
  out.reserve(static_cast<size_t>(n) * d);
  for (const auto& r : rows) out.insert(out.end(), r.begin(), r.end());
  return out;
}

// A magnitude: the same f32 (NaN and infinities alike).
bool SameMag(float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

struct BuildProblem {
  int64_t n;
  float theta;
  bool specials;
  bool all_zero;
};

// One launch of `problems` against spindlekv::BuildCodebook per problem.
void RunBuild(int d, int block, DType x_dtype, DType entry_dtype, const std::vector<BuildProblem>& problems,
              uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "d " << d << " block " << block << " x " << DTypeName(x_dtype) << " entries "
                                    << DTypeName(entry_dtype));
  std::mt19937 rng(seed);
  const int count = static_cast<int>(problems.size());
  std::vector<GpuBuffer> keep;
  std::vector<SpindlekvCodebookProblem> dev(count);
  std::vector<std::vector<float>> logical(count);  // the rows as the device holds them, in order
  int32_t max_n = 0;
  for (int p = 0; p < count; ++p) {
    const BuildProblem& bp = problems[p];
    const int64_t n = bp.n;
    max_n = std::max<int32_t>(max_n, static_cast<int32_t>(n));
    std::vector<float> rows_f =
        bp.all_zero ? std::vector<float>(static_cast<size_t>(n) * d, 0.0f) : MakeRows(rng, n, d, bp.theta, bp.specials);
    // The source: n + 5 rows of stride d + 32 (the padding and unused rows NaN,
    // so a stray read shows), row i of the problem at source row perm[i].
    const int64_t src_rows = n + 5, stride = d + 32;
    std::vector<int32_t> perm(src_rows);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    perm.resize(n);
    std::vector<float> src(static_cast<size_t>(src_rows) * stride, std::numeric_limits<float>::quiet_NaN());
    for (int64_t i = 0; i < n; ++i) {
      std::copy_n(&rows_f[i * d], d, &src[perm[i] * stride]);
    }
    std::vector<float> src_rounded;
    keep.push_back(UploadAs(src, x_dtype, &src_rounded));
    dev[p].x = keep.back().get();
    dev[p].row_stride = stride;
    logical[p].resize(static_cast<size_t>(n) * d);
    for (int64_t i = 0; i < n; ++i) std::copy_n(&src_rounded[perm[i] * stride], d, &logical[p][i * d]);
    keep.push_back(Upload(perm));
    dev[p].rows = keep.back().as<int32_t>();
    dev[p].n = static_cast<int32_t>(n);
    dev[p].theta = bp.theta;
    keep.emplace_back(static_cast<size_t>(n + 1) * d * DTypeSize(entry_dtype));
    Poison(keep.back(), static_cast<size_t>(n + 1) * d * DTypeSize(entry_dtype));
    dev[p].entries = keep.back().get();
    keep.emplace_back(static_cast<size_t>(n) * sizeof(int32_t));
    Poison(keep.back(), static_cast<size_t>(n) * sizeof(int32_t));
    dev[p].refs = keep.back().as<int32_t>();
    keep.emplace_back(static_cast<size_t>(n) * sizeof(float));
    Poison(keep.back(), static_cast<size_t>(n) * sizeof(float));
    dev[p].mags = keep.back().as<float>();
    keep.emplace_back(sizeof(int32_t));
    Poison(keep.back(), sizeof(int32_t));
    dev[p].entry_count = keep.back().as<int32_t>();
  }
  GpuBuffer problems_dev = Upload(dev);
  SpindlekvCodebookArgs a;
  a.problems = problems_dev.as<SpindlekvCodebookProblem>();
  a.count = count;
  a.d = d;
  a.block = block;
  a.x_dtype = x_dtype;
  a.entry_dtype = entry_dtype;
  a.max_n = max_n;
  const size_t ws_bytes = SpindlekvCodebookWorkspaceBytes(a);
  GpuBuffer ws(ws_bytes);
  CHECK(cudaMemset(ws.get(), 0xab, std::max<size_t>(ws_bytes, 1)) == cudaSuccess);
  a.workspace = ws.get();
  ASSERT_TRUE(SpindlekvCodebookSupported(d, block));
  LaunchSpindlekvBuildCodebook(a, nullptr);
  PENUMBRA_CUDA_OK(cudaGetLastError());
  PENUMBRA_CUDA_OK(cudaDeviceSynchronize());

  const float entry_tol = entry_dtype == DType::kF32 ? 1e-6f : 4e-3f;
  for (int p = 0; p < count; ++p) {
    SCOPED_TRACE(::testing::Message() << "problem " << p << " n " << problems[p].n);
    const int64_t n = problems[p].n;
    spindlekv::Codebook cb;
    std::vector<int32_t> refs(n);
    std::vector<float> mags(n);
    spindlekv::BuildCodebook(logical[p].data(), n, d, problems[p].theta, block, &cb, refs.data(), mags.data());
    const int32_t got_count = Download<int32_t>(dev[p].entry_count, 1)[0];
    ASSERT_EQ(got_count, cb.size());
    const std::vector<int32_t> got_refs = Download<int32_t>(dev[p].refs, n);
    const std::vector<float> got_mags = Download<float>(dev[p].mags, n);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(got_refs[i], refs[i]) << "row " << i;
      ASSERT_TRUE(SameMag(got_mags[i], mags[i])) << "row " << i << ": " << got_mags[i] << " vs " << mags[i];
    }
    // The entries, and the slot past them untouched (still the poison).
    std::vector<char> raw = Download<char>(dev[p].entries, static_cast<size_t>(n + 1) * d * DTypeSize(entry_dtype));
    std::vector<float> got(static_cast<size_t>(n + 1) * d);
    ConvertToF32(raw.data(), entry_dtype, got.data(), got.size());
    const std::vector<float> want = Rounded(cb.entries, entry_dtype);
    for (size_t k = 0; k < want.size(); ++k) {
      ASSERT_NEAR(got[k], want[k], entry_tol) << "entry " << k / d << " element " << k % d;
    }
    for (size_t k = want.size(); k < want.size() + d; ++k) ASSERT_TRUE(std::isnan(got[k])) << "past the entries " << k;
  }
}

TEST(SpindlekvCodebookGpu, BuildMatchesTheHostGreedy) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  // Many problems of one launch: empty, one row, n past and at block multiples,
  // the two thresholds, special rows.
  const std::vector<BuildProblem> mixed = {
      {5000, 0.98f, true, false},  {0, 0.95f, false, false}, {1, 0.98f, false, false}, {1024, 0.95f, true, false},
      {2049, 0.98f, false, false}, {37, 0.95f, true, false}, {12, 0.98f, false, true}, {3000, 0.95f, true, false},
  };
  for (DType x : {DType::kF32, DType::kBF16}) {
    for (DType e : {DType::kF32, DType::kBF16}) {
      RunBuild(128, 1024, x, e, mixed, 1 + static_cast<uint32_t>(x) * 4 + static_cast<uint32_t>(e));
    }
  }
  const std::vector<BuildProblem> small = {
      {1000, 0.98f, true, false}, {64, 0.95f, false, false}, {63, 0.98f, true, false},
      {0, 0.98f, false, false},   {1, 0.95f, false, false},  {9, 0.98f, false, true},
  };
  RunBuild(128, 64, DType::kBF16, DType::kBF16, small, 11);
  RunBuild(64, 64, DType::kF32, DType::kF32, small, 12);
  RunBuild(96, 200, DType::kBF16, DType::kF32, small, 13);  // a block of a partial tile, d of 3 lanes' elements
  RunBuild(256, 1024, DType::kF32, DType::kBF16, {{2500, 0.95f, true, false}, {700, 0.98f, false, false}}, 14);
  RunBuild(32, 1024, DType::kF32, DType::kF32, {{1500, 0.95f, true, false}, {1, 0.98f, false, false}}, 15);
  RunBuild(64, 1, DType::kF32, DType::kBF16,
           {{37, 0.95f, true, false}, {1, 0.98f, false, false}, {0, 0.95f, false, false}, {5, 0.98f, false, true}}, 16);
}

// ---- Merge ------------------------------------------------------------------

struct MergeCase {
  int batch, hq, hkv, d;
  DType entry_dtype;
};

// One (sequence, KV head)'s state at the test layer, on the host and the device.
struct HeadState {
  int32_t nb[2] = {0, 0};       // base entries, keys and values (0: no base part)
  std::vector<float> base[2];   // rounded
  std::vector<float> own[2];    // rounded, the entries held so far
  int64_t n0 = 0;               // own tokens before the steps
  GpuBuffer* base_dev[2] = {};  // null without a base part
  GpuBuffer* own_dev[2] = {};   // room for own0 + the steps' entries
  GpuBuffer *pos = nullptr, *kref = nullptr, *vref = nullptr, *kmag = nullptr, *vmag = nullptr, *heads = nullptr;
  SpindlekvHead view;  // the device view (what the kernel should leave, n aside)
};

void RunMerge(const MergeCase& c) {
  SCOPED_TRACE(::testing::Message() << "batch " << c.batch << " hq " << c.hq << " hkv " << c.hkv << " d " << c.d
                                    << " entries " << DTypeName(c.entry_dtype));
  constexpr int kLayers = 2, kLayer = 1, kSteps = 3;
  const int d = c.d, hkv = c.hkv, G = c.hq / c.hkv, rows = c.batch * hkv;
  const size_t es = DTypeSize(c.entry_dtype);
  const float theta[2] = {0.98f, 0.95f};
  std::mt19937 rng(d * 7 + c.hq + static_cast<int>(c.entry_dtype));
  std::uniform_real_distribution<float> mag(0.5f, 4.0f);
  std::vector<std::unique_ptr<GpuBuffer>> keep;
  auto alloc = [&](size_t bytes) {
    keep.push_back(std::make_unique<GpuBuffer>(bytes));
    return keep.back().get();
  };
  auto unit_rows = [&](int n) {
    std::vector<float> e;
    for (int k = 0; k < n; ++k) {
      const std::vector<float> u = RandomUnit(rng, d);
      e.insert(e.end(), u.begin(), u.end());
    }
    return Rounded(e, c.entry_dtype);
  };
  // Per (i, g): the sizes cycle through no base and no own entries, a large
  // base with an own part (its entry 0 a copy of base entry 5: a tie), a base
  // alone, an own part alone.
  std::vector<HeadState> st(rows);
  const int base_sizes[4] = {0, 3000, 50, 0}, own_sizes[4] = {0, 700, 0, 129};
  for (int h = 0; h < rows; ++h) {
    HeadState& s = st[h];
    s.n0 = 3 + h;
    for (int kind = 0; kind < 2; ++kind) {
      s.nb[kind] = base_sizes[h % 4];
      s.base[kind] = unit_rows(s.nb[kind]);
      s.own[kind] = unit_rows(own_sizes[h % 4]);
      if (h % 4 == 1) std::copy_n(&s.base[kind][5 * d], d, s.own[kind].begin());
      if (s.nb[kind] > 0) {
        s.base_dev[kind] = alloc(s.base[kind].size() * es);
        std::vector<char> raw(s.base[kind].size() * es);
        ConvertFromF32(s.base[kind].data(), raw.data(), c.entry_dtype, s.base[kind].size());
        PENUMBRA_CUDA_OK(cudaMemcpy(s.base_dev[kind]->get(), raw.data(), raw.size(), cudaMemcpyHostToDevice));
      }
      const size_t cap = s.own[kind].size() + static_cast<size_t>(kSteps + 1) * d;
      s.own_dev[kind] = alloc(cap * es);
      Poison(*s.own_dev[kind], cap * es);
      std::vector<char> raw(s.own[kind].size() * es);
      ConvertFromF32(s.own[kind].data(), raw.data(), c.entry_dtype, s.own[kind].size());
      if (!raw.empty()) {
        PENUMBRA_CUDA_OK(cudaMemcpy(s.own_dev[kind]->get(), raw.data(), raw.size(), cudaMemcpyHostToDevice));
      }
    }
    const size_t cap = static_cast<size_t>(s.n0 + kSteps + 1);
    s.pos = alloc(cap * 4);
    s.kref = alloc(cap * 4);
    s.vref = alloc(cap * 4);
    s.kmag = alloc(cap * 4);
    s.vmag = alloc(cap * 4);
    s.heads = alloc(cap * 4);
    for (GpuBuffer* b : {s.pos, s.kref, s.vref, s.kmag, s.vmag, s.heads}) Poison(*b, cap * 4);
    SpindlekvHead& v = s.view;
    v.part[0].n = 17;  // a document's tokens: the merge leaves part 0 alone
    v.part[1].pos = s.pos->as<int32_t>();
    v.part[1].kref = s.kref->as<int32_t>();
    v.part[1].vref = s.vref->as<int32_t>();
    v.part[1].kmag = s.kmag->as<float>();
    v.part[1].vmag = s.vmag->as<float>();
    v.part[1].heads = s.heads->as<uint32_t>();
    v.part[1].n = s.n0;
    v.key_entries[0] = s.base_dev[0] ? s.base_dev[0]->get() : nullptr;
    v.value_entries[0] = s.base_dev[1] ? s.base_dev[1]->get() : nullptr;
    v.key_entries[1] = s.own_dev[0]->get();
    v.value_entries[1] = s.own_dev[1]->get();
    v.key_base_entries = s.nb[0];
    v.value_base_entries = s.nb[1];
  }
  // Per sequence: its heads of every layer and its counts (the other layer's
  // views with distinct n, to see they stay).
  std::vector<GpuBuffer*> seq_heads(c.batch), seq_counts(c.batch);
  std::vector<SpindlekvHead*> head_ptrs(c.batch);
  std::vector<int32_t*> count_ptrs(c.batch);
  for (int i = 0; i < c.batch; ++i) {
    std::vector<SpindlekvHead> hs(static_cast<size_t>(kLayers) * hkv);
    std::vector<int32_t> counts(static_cast<size_t>(kLayers) * hkv * 2, -3);
    for (int g = 0; g < hkv; ++g) {
      hs[g].part[1].n = 1000 + g;  // layer 0
      const HeadState& s = st[i * hkv + g];
      hs[kLayer * hkv + g] = s.view;
      counts[(kLayer * hkv + g) * 2 + 0] = static_cast<int32_t>(s.own[0].size() / d);
      counts[(kLayer * hkv + g) * 2 + 1] = static_cast<int32_t>(s.own[1].size() / d);
    }
    seq_heads[i] = alloc(hs.size() * sizeof(SpindlekvHead));
    PENUMBRA_CUDA_OK(cudaMemcpy(seq_heads[i]->get(), hs.data(), hs.size() * sizeof(hs[0]), cudaMemcpyHostToDevice));
    seq_counts[i] = alloc(counts.size() * 4);
    PENUMBRA_CUDA_OK(cudaMemcpy(seq_counts[i]->get(), counts.data(), counts.size() * 4, cudaMemcpyHostToDevice));
    head_ptrs[i] = seq_heads[i]->as<SpindlekvHead>();
    count_ptrs[i] = seq_counts[i]->as<int32_t>();
  }
  GpuBuffer head_ptrs_dev = Upload(head_ptrs), count_ptrs_dev = Upload(count_ptrs);
  GpuBuffer gathered(static_cast<size_t>(rows) * sizeof(SpindlekvHead));
  const size_t row_len = static_cast<size_t>(c.hq + 2 * hkv) * d;

  for (int step = 0; step < kSteps; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    // The new rows: per (i, g, kind) near a base entry, near the latest own
    // entry, near base entry 5 (tied with own entry 0 where it was copied),
    // random, or zero.
    std::vector<float> qkv(static_cast<size_t>(c.batch) * row_len);
    for (float& x : qkv) x = std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
    std::vector<int32_t> positions(c.batch);
    for (int i = 0; i < c.batch; ++i) positions[i] = static_cast<int32_t>(rng() % 100000);
    for (int h = 0; h < rows; ++h) {
      const int i = h / hkv, g = h % hkv;
      const HeadState& s = st[h];
      for (int kind = 0; kind < 2; ++kind) {
        float* v = &qkv[i * row_len + static_cast<size_t>((kind == 0 ? c.hq : c.hq + hkv) + g) * d];
        const int n_own = static_cast<int>(s.own[kind].size() / d);
        // The first step's key of a head with no entries at all is zero: e_0.
        const int scenario = step == 0 && h % 4 == 0 && kind == 0 ? 3 : (h + kind + 3 * step) % 5;
        std::vector<float> r;
        if (scenario == 0 && s.nb[kind] > 0) {
          r = Near(rng, &s.base[kind][(rng() % s.nb[kind]) * d], d, 0.07f, mag(rng));
        } else if (scenario <= 1 && n_own > 0) {
          r = Near(rng, &s.own[kind][static_cast<size_t>(n_own - 1) * d], d, 0.07f, mag(rng));
        } else if (scenario == 2 && s.nb[kind] > 5) {
          r.assign(&s.base[kind][5 * d], &s.base[kind][6 * d]);  // exactly its direction: the tie
          const float scale = mag(rng);
          for (float& x : r) x *= scale;
        } else if (scenario == 3) {
          r.assign(d, 0.0f);
        } else {
          r = RandomUnit(rng, d);
          for (float& x : r) x *= mag(rng);
        }
        std::copy(r.begin(), r.end(), v);
      }
    }
    GpuBuffer qkv_dev = Upload(qkv), pos_dev = Upload(positions);
    Poison(gathered, static_cast<size_t>(rows) * sizeof(SpindlekvHead));

    SpindlekvMergeArgs m;
    m.seq_heads = head_ptrs_dev.as<SpindlekvHead*>();
    m.seq_entries = count_ptrs_dev.as<int32_t*>();
    m.qkv = qkv_dev.as<float>();
    m.positions = pos_dev.as<int32_t>();
    m.gathered = gathered.as<SpindlekvHead>();
    m.entry_dtype = c.entry_dtype;
    m.layer = kLayer;
    m.batch = c.batch;
    m.hq = c.hq;
    m.hkv = hkv;
    m.d = d;
    m.key_theta = theta[0];
    m.value_theta = theta[1];
    // The search in one block, in a few, and in more blocks than entries;
    // over all entries, then over the last 3 (a window that starts in the
    // base part where there is one), then the last 40.
    m.splits = step == 0 ? 1 : step == 1 ? 3 : 70;
    m.window = step == 0 ? 0 : step == 1 ? 3 : 40;
    GpuBuffer ws(SpindlekvMergeWorkspaceBytes(m));
    m.workspace = ws.get();
    LaunchSpindlekvMerge(m, nullptr);
    PENUMBRA_CUDA_OK(cudaGetLastError());
    PENUMBRA_CUDA_OK(cudaDeviceSynchronize());

    const std::vector<SpindlekvHead> got_gathered = Download<SpindlekvHead>(gathered.get(), rows);
    for (int i = 0; i < c.batch; ++i) {
      const std::vector<SpindlekvHead> hs = Download<SpindlekvHead>(seq_heads[i]->get(), kLayers * hkv);
      const std::vector<int32_t> counts = Download<int32_t>(seq_counts[i]->get(), kLayers * hkv * 2);
      for (int g = 0; g < hkv; ++g) {
        SCOPED_TRACE(::testing::Message() << "sequence " << i << " KV head " << g);
        HeadState& s = st[i * hkv + g];
        EXPECT_EQ(hs[g].part[1].n, 1000 + g) << "layer 0 touched";
        EXPECT_EQ(counts[g * 2], -3) << "layer 0's counts touched";
        int32_t ref[2];
        float mg[2];
        for (int kind = 0; kind < 2; ++kind) {
          const float* v = &qkv[i * row_len + static_cast<size_t>((kind == 0 ? c.hq : c.hq + hkv) + g) * d];
          spindlekv::Codebook base, own;
          base.d = own.d = d;
          base.entries = s.base[kind];
          own.entries = s.own[kind];
          const int32_t before = own.size();
          ref[kind] =
              spindlekv::MergeOrAdd(v, theta[kind], s.nb[kind] > 0 ? &base : nullptr, &own, &mg[kind], m.window);
          ASSERT_EQ(counts[(kLayer * hkv + g) * 2 + kind], own.size()) << "kind " << kind;
          // The entries the device holds: the old ones as they were, the new one as the host's, rounded.
          const size_t n_el = static_cast<size_t>(own.size() + 1) * d;
          std::vector<char> raw = Download<char>(s.own_dev[kind]->get(), n_el * es);
          std::vector<float> got(n_el);
          ConvertToF32(raw.data(), c.entry_dtype, got.data(), n_el);
          const std::vector<float> want = Rounded(own.entries, c.entry_dtype);
          const float tol = c.entry_dtype == DType::kF32 ? 1e-6f : 4e-3f;
          for (size_t k = 0; k < want.size(); ++k) {
            if (k < static_cast<size_t>(before) * d) {
              ASSERT_EQ(got[k], want[k]) << "kind " << kind << " old element " << k;
            } else {
              ASSERT_NEAR(got[k], want[k], tol) << "kind " << kind << " new element " << k;
            }
          }
          for (size_t k = want.size(); k < n_el; ++k) ASSERT_TRUE(std::isnan(got[k])) << "past the entries " << k;
          s.own[kind].assign(got.begin(), got.begin() + want.size());  // the next step reads what the device holds
        }
        // The token record.
        const SpindlekvHead& h = hs[kLayer * hkv + g];
        const int64_t at = s.n0 + step;
        ASSERT_EQ(h.part[1].n, at + 1);
        EXPECT_EQ(Download<int32_t>(s.pos->as<int32_t>() + at, 1)[0], positions[i]);
        EXPECT_EQ(Download<int32_t>(s.kref->as<int32_t>() + at, 1)[0], ref[0]);
        EXPECT_EQ(Download<int32_t>(s.vref->as<int32_t>() + at, 1)[0], ref[1]);
        EXPECT_TRUE(SameMag(Download<float>(s.kmag->as<float>() + at, 1)[0], mg[0]));
        EXPECT_TRUE(SameMag(Download<float>(s.vmag->as<float>() + at, 1)[0], mg[1]));
        EXPECT_EQ(Download<uint32_t>(s.heads->as<uint32_t>() + at, 1)[0], G == 32 ? ~0u : (1u << G) - 1);
        EXPECT_EQ(Download<int32_t>(s.kref->as<int32_t>() + at + 1, 1)[0], -1) << "past the token";
        // The views: the same but for part[1].n, and gathered a copy.
        SpindlekvHead want = s.view;
        want.part[1].n = at + 1;
        for (const SpindlekvHead* x : {&h, &got_gathered[i * hkv + g]}) {
          EXPECT_EQ(std::memcmp(x, &want, sizeof(want)), 0) << (x == &h ? "heads" : "gathered");
        }
      }
    }
  }
}

TEST(SpindlekvCodebookGpu, MergeMatchesMergeOrAdd) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  for (DType e : {DType::kF32, DType::kBF16}) {
    RunMerge({3, 8, 2, 128, e});   // 4 query heads a KV head
    RunMerge({2, 64, 2, 64, e});   // 32: every bit of the mask
    RunMerge({2, 3, 3, 96, e});    // one query head a KV head; d of 3 elements a lane
    RunMerge({1, 16, 8, 256, e});  // 8 KV heads: every size pattern twice
  }
}

// ---- Benchmarks (PENUMBRA_KERNEL_BENCH=1) ---------------------------------------

TEST(SpindlekvCodebookGpu, Bench) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  if (!KernelBenchEnabled()) GTEST_SKIP() << "PENUMBRA_KERNEL_BENCH=1 runs it";
  constexpr int d = 128, kProblems = 16, kHeads = 8;
  constexpr int32_t n = 124928;
  std::mt19937 rng(5);
  for (bool clustered : {true, false}) {
    for (DType x_dtype : {DType::kF32, DType::kBF16}) {
      // One source shared by the problems ([n][kHeads][d], as the policy's keys), values of cos ~0.995 in
      // clusters or random directions.
      std::vector<float> src;
      if (clustered) {
        src = MakeRows(rng, static_cast<int64_t>(n) * kHeads, d, 0.95f, false);
      } else {
        src.resize(static_cast<size_t>(n) * kHeads * d);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (float& v : src) v = nd(rng);
      }
      GpuBuffer x = UploadAs(src, x_dtype, nullptr);
      std::vector<int32_t> rows(n);
      std::iota(rows.begin(), rows.end(), 0);
      GpuBuffer rows_dev = Upload(rows);
      std::vector<SpindlekvCodebookProblem> ps(kProblems);
      std::vector<GpuBuffer> outs;
      for (int p = 0; p < kProblems; ++p) {
        ps[p].x = static_cast<const char*>(x.get()) + (p % kHeads) * d * DTypeSize(x_dtype);
        ps[p].row_stride = static_cast<int64_t>(kHeads) * d;
        ps[p].rows = rows_dev.as<int32_t>();
        ps[p].n = n;
        ps[p].theta = p < kHeads ? 0.98f : 0.95f;
        outs.emplace_back(static_cast<size_t>(n) * d * 2);
        ps[p].entries = outs.back().get();
        outs.emplace_back(static_cast<size_t>(n) * 4);
        ps[p].refs = outs.back().as<int32_t>();
        outs.emplace_back(static_cast<size_t>(n) * 4);
        ps[p].mags = outs.back().as<float>();
        outs.emplace_back(4);
        ps[p].entry_count = outs.back().as<int32_t>();
      }
      GpuBuffer ps_dev = Upload(ps);
      SpindlekvCodebookArgs a;
      a.problems = ps_dev.as<SpindlekvCodebookProblem>();
      a.count = kProblems;
      a.d = d;
      a.block = 1024;
      a.x_dtype = x_dtype;
      a.entry_dtype = DType::kBF16;
      a.max_n = n;
      GpuBuffer ws(SpindlekvCodebookWorkspaceBytes(a));
      a.workspace = ws.get();
      const float ms = TimeMs([&] { LaunchSpindlekvBuildCodebook(a, nullptr); }, 3);
      PENUMBRA_CUDA_OK(cudaGetLastError());
      const int32_t entries = Download<int32_t>(ps[0].entry_count, 1)[0];
      std::printf("BuildCodebook %s x %s, %d problems x %d rows, block 1024: %.2f ms (problem 0: %d entries)\n",
                  clustered ? "clustered" : "random", std::string(DTypeName(x_dtype)).c_str(), kProblems, n, ms,
                  entries);
    }
  }
  // Merge: 8 KV heads of one sequence, 100000 base + 25000 own bf16 entries each.
  {
    constexpr int kBase = 100000, kOwn = 25000, kRoom = 64, hq = 32;
    std::vector<float> ent(static_cast<size_t>(kBase) * d);
    std::normal_distribution<float> nd(0.0f, 0.1f);
    for (float& v : ent) v = nd(rng);
    GpuBuffer base = UploadAs(ent, DType::kBF16, nullptr);
    ent.resize(static_cast<size_t>(kOwn + kRoom) * d);
    std::vector<GpuBuffer> own;  // per KV head: keys, values
    std::vector<SpindlekvHead> hs(kHeads);
    std::vector<int32_t> counts(2 * kHeads, kOwn);
    GpuBuffer toks(static_cast<size_t>(kHeads) * 6 * kRoom * 4);
    for (int g = 0; g < kHeads; ++g) {
      SpindlekvHead& h = hs[g];
      int32_t* t = toks.as<int32_t>() + static_cast<size_t>(g) * 6 * kRoom;
      h.part[1].pos = t;
      h.part[1].kref = t + kRoom;
      h.part[1].vref = t + 2 * kRoom;
      h.part[1].kmag = reinterpret_cast<float*>(t + 3 * kRoom);
      h.part[1].vmag = reinterpret_cast<float*>(t + 4 * kRoom);
      h.part[1].heads = reinterpret_cast<uint32_t*>(t + 5 * kRoom);
      h.key_entries[0] = h.value_entries[0] = base.get();
      own.push_back(UploadAs(ent, DType::kBF16, nullptr));
      h.key_entries[1] = own.back().get();
      own.push_back(UploadAs(ent, DType::kBF16, nullptr));
      h.value_entries[1] = own.back().get();
      h.key_base_entries = h.value_base_entries = kBase;
    }
    GpuBuffer hs_dev = Upload(hs), counts_dev = Upload(counts);
    std::vector<SpindlekvHead*> hp = {hs_dev.as<SpindlekvHead>()};
    std::vector<int32_t*> cp = {counts_dev.as<int32_t>()};
    GpuBuffer hp_dev = Upload(hp), cp_dev = Upload(cp);
    std::vector<float> qkv(static_cast<size_t>(hq + 2 * kHeads) * d);
    for (float& v : qkv) v = nd(rng);
    GpuBuffer qkv_dev = Upload(qkv), pos_dev = Upload(std::vector<int32_t>{7});
    SpindlekvMergeArgs m;
    m.seq_heads = hp_dev.as<SpindlekvHead*>();
    m.seq_entries = cp_dev.as<int32_t*>();
    m.qkv = qkv_dev.as<float>();
    m.positions = pos_dev.as<int32_t>();
    m.entry_dtype = DType::kBF16;
    m.batch = 1;
    m.hq = hq;
    m.hkv = kHeads;
    m.d = d;
    m.key_theta = m.value_theta = 2.0f;  // never merges: every step adds (room for kRoom steps)
    m.splits = 66;                       // what the CUDA backend picks for one sequence x 8 KV heads
    GpuBuffer ws(SpindlekvMergeWorkspaceBytes(m));
    m.workspace = ws.get();
    const float ms = TimeMs([&] { LaunchSpindlekvMerge(m, nullptr); }, 10);
    PENUMBRA_CUDA_OK(cudaGetLastError());
    std::printf("Merge, 1 sequence x %d KV heads, %d bf16 entries a head, keys and values, %d splits: %.3f ms\n",
                kHeads, kBase + kOwn, m.splits, ms);
  }
}

}  // namespace
}  // namespace penumbra::kernels
