// CUDA SpindleKV attention (kernels/spindlekv_attention.cuh) against the CPU
// reference (kernels/cpu/spindlekv.h) on the same dtype-rounded inputs: two
// parts per (sequence, KV head) (a document's and the sequence's own, the
// own references past the document's entries), random query-head masks
// (some tokens attended by no head), positions up to 130000 (RoPE at long
// positions), a row with no tokens (zeros, lse -inf), f32 and bf16, head
// sizes 64 and 128, one split and many. Outputs are poisoned with NaN first.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/dtype.h"
#include "kernels/cpu/spindlekv.h"
#include "kernels/spindlekv_attention.cuh"
#include "tests/gpu_test_util.h"

namespace penumbra::kernels {
namespace {

using ::penumbra::testing::DownloadAs;
using ::penumbra::testing::GpuBuffer;
using ::penumbra::testing::Upload;
using ::penumbra::testing::UploadAs;

// One part's tokens on the host.
struct HostTokens {
  std::vector<int32_t> pos, kref, vref;
  std::vector<float> kmag, vmag;
  std::vector<uint32_t> heads;
};

struct Case {
  int batch, hq, hkv, d;
  DType dtype;
  bool split;  // a workspace and several splits
};

void RunCase(const Case& c) {
  std::mt19937 rng(c.d * 131 + c.hq + (c.dtype == DType::kBF16 ? 7 : 0) + (c.split ? 1 : 0));
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  const int G = c.hq / c.hkv, rows = c.batch * c.hkv;
  // Per row: the document's entries and tokens, then the own ones.
  std::vector<std::vector<float>> entries_f32[2][2];  // [key/value][part] per row
  std::vector<HostTokens> toks[2];
  std::vector<int32_t> base_k(rows), base_v(rows);
  auto unit = [&](int n) {
    std::vector<float> e(static_cast<size_t>(n) * c.d);
    for (int i = 0; i < n; ++i) {
      double s = 0;
      for (int j = 0; j < c.d; ++j) s += std::pow(e[i * c.d + j] = uni(rng), 2);
      for (int j = 0; j < c.d; ++j) e[i * c.d + j] /= static_cast<float>(std::sqrt(s));
    }
    return e;
  };
  for (int kv = 0; kv < 2; ++kv) {
    for (int p = 0; p < 2; ++p) entries_f32[kv][p].resize(rows);
  }
  for (int p = 0; p < 2; ++p) toks[p].resize(rows);
  for (int r = 0; r < rows; ++r) {
    const bool empty = r == 1;  // a row holding nothing
    const int n[2] = {empty ? 0 : 300 + 37 * r, empty ? 0 : 5 + 11 * r};
    const int ne[2][2] = {{n[0] / 3 + 1, n[1] / 2 + 1}, {n[0] / 2 + 1, n[1] / 3 + 1}};  // [key/value][part]
    base_k[r] = ne[0][0];
    base_v[r] = ne[1][0];
    for (int kv = 0; kv < 2; ++kv) {
      for (int p = 0; p < 2; ++p) entries_f32[kv][p][r] = unit(ne[kv][p]);
    }
    int32_t pos = 0;
    for (int p = 0; p < 2; ++p) {
      HostTokens& t = toks[p][r];
      for (int i = 0; i < n[p]; ++i) {
        pos += 1 + static_cast<int32_t>(rng() % 400);  // positions to ~130000
        t.pos.push_back(pos);
        // The document's tokens reference its entries; the own ones either.
        const int kmax = p == 0 ? ne[0][0] : ne[0][0] + ne[0][1], vmax = p == 0 ? ne[1][0] : ne[1][0] + ne[1][1];
        t.kref.push_back(static_cast<int32_t>(rng() % kmax));
        t.vref.push_back(static_cast<int32_t>(rng() % vmax));
        t.kmag.push_back(0.5f + 3.0f * std::abs(uni(rng)));
        t.vmag.push_back(0.5f + 3.0f * std::abs(uni(rng)));
        t.heads.push_back(static_cast<uint32_t>(rng() % (1u << G)));  // 0: no head attends
      }
    }
  }
  // Device copies (entries in the dtype; the reference reads them rounded).
  std::vector<GpuBuffer> keep;
  std::vector<std::vector<float>> rounded_store;
  std::vector<SpindlekvHead> dev_heads(rows), cpu_heads(rows);
  int64_t max_tokens = 0;
  for (int r = 0; r < rows; ++r) {
    for (int p = 0; p < 2; ++p) {
      const HostTokens& t = toks[p][r];
      SpindlekvTokens dv, cv;
      dv.n = cv.n = static_cast<int64_t>(t.pos.size());
      cv.pos = t.pos.data();
      cv.kref = t.kref.data();
      cv.vref = t.vref.data();
      cv.kmag = t.kmag.data();
      cv.vmag = t.vmag.data();
      cv.heads = t.heads.data();
      keep.push_back(Upload(t.pos));
      dv.pos = keep.back().as<int32_t>();
      keep.push_back(Upload(t.kref));
      dv.kref = keep.back().as<int32_t>();
      keep.push_back(Upload(t.vref));
      dv.vref = keep.back().as<int32_t>();
      keep.push_back(Upload(t.kmag));
      dv.kmag = keep.back().as<float>();
      keep.push_back(Upload(t.vmag));
      dv.vmag = keep.back().as<float>();
      keep.push_back(Upload(t.heads));
      dv.heads = keep.back().as<uint32_t>();
      dev_heads[r].part[p] = dv;
      cpu_heads[r].part[p] = cv;
      for (int kv = 0; kv < 2; ++kv) {
        rounded_store.emplace_back();
        keep.push_back(UploadAs(entries_f32[kv][p][r], c.dtype, &rounded_store.back()));
        (kv == 0 ? dev_heads[r].key_entries : dev_heads[r].value_entries)[p] = keep.back().get();
      }
    }
    dev_heads[r].key_base_entries = cpu_heads[r].key_base_entries = base_k[r];
    dev_heads[r].value_base_entries = cpu_heads[r].value_base_entries = base_v[r];
    max_tokens = std::max<int64_t>(max_tokens, dev_heads[r].part[0].n + dev_heads[r].part[1].n);
  }
  // The CPU heads read the rounded entries (4 per row, in upload order).
  for (int r = 0; r < rows; ++r) {
    for (int p = 0; p < 2; ++p) {
      cpu_heads[r].key_entries[p] = rounded_store[(r * 2 + p) * 2 + 0].data();
      cpu_heads[r].value_entries[p] = rounded_store[(r * 2 + p) * 2 + 1].data();
    }
  }
  std::vector<float> q(static_cast<size_t>(c.batch) * c.hq * c.d), q_rounded;
  for (float& x : q) x = 2.0f * uni(rng);
  GpuBuffer q_dev = UploadAs(q, c.dtype, &q_rounded);
  std::vector<float> inv_freq(c.d / 2);
  for (int i = 0; i < c.d / 2; ++i) inv_freq[i] = std::pow(500000.0f, -2.0f * i / c.d);
  GpuBuffer freq_dev = Upload(inv_freq);
  GpuBuffer heads_dev = Upload(dev_heads);
  const size_t out_n = static_cast<size_t>(c.batch) * c.hq * c.d;
  GpuBuffer out_dev = UploadAs(std::vector<float>(out_n, NAN), c.dtype, nullptr);
  GpuBuffer lse_dev = Upload(std::vector<float>(static_cast<size_t>(c.batch) * c.hq, NAN));

  SpindlekvAttentionArgs a;
  a.q = q_dev.get();
  a.heads = heads_dev.as<SpindlekvHead>();
  a.inv_freq = freq_dev.as<float>();
  a.out = out_dev.get();
  a.lse = lse_dev.as<float>();
  a.dtype = c.dtype;
  a.batch = c.batch;
  a.hq = c.hq;
  a.hkv = c.hkv;
  a.d = c.d;
  a.scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  a.max_tokens = max_tokens;
  a.splits = c.split ? 7 : 1;
  GpuBuffer ws(SpindlekvWorkspaceFloats(a) * sizeof(float));
  a.workspace = c.split ? ws.as<float>() : nullptr;
  ASSERT_TRUE(SpindlekvAttentionSupported(c.hq, c.hkv, c.d));
  LaunchSpindlekvAttention(a, nullptr);
  PENUMBRA_CUDA_OK(cudaGetLastError());
  PENUMBRA_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> out = DownloadAs(out_dev, c.dtype, out_n);
  std::vector<float> lse(static_cast<size_t>(c.batch) * c.hq);
  PENUMBRA_CUDA_OK(cudaMemcpy(lse.data(), lse_dev.get(), lse.size() * sizeof(float), cudaMemcpyDeviceToHost));

  SpindlekvAttentionArgs r = a;
  r.q = q_rounded.data();
  r.heads = cpu_heads.data();
  r.inv_freq = inv_freq.data();
  std::vector<float> ref(out_n, NAN), ref_lse(lse.size(), NAN);
  r.out = ref.data();
  r.lse = ref_lse.data();
  r.dtype = DType::kF32;
  r.workspace = nullptr;
  cpu::SpindlekvAttention(r);

  const float tol = c.dtype == DType::kBF16 ? 2e-2f : 2e-4f;
  for (size_t i = 0; i < out_n; ++i) {
    ASSERT_TRUE(std::isfinite(out[i])) << "element " << i;
    ASSERT_NEAR(out[i], ref[i], tol * (1.0f + std::abs(ref[i]))) << "element " << i;
  }
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(ref_lse[i])) {
      EXPECT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << "row " << i;  // nothing attended
    } else {
      EXPECT_NEAR(lse[i], ref_lse[i], 1e-3f * (1.0f + std::abs(ref_lse[i]))) << "row " << i;
    }
  }
}

TEST(SpindlekvAttentionGpu, MatchesTheCpuReference) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int d : {64, 128}) {
      for (bool split : {false, true}) {
        SCOPED_TRACE(std::string(DTypeName(dtype)) + " d " + std::to_string(d) + (split ? " split" : ""));
        RunCase({3, 8, 2, d, dtype, split});
        RunCase({2, 32, 8, d, dtype, split});  // the Llama-3.1-8B grouping (4 query heads a KV head)
      }
    }
  }
}

}  // namespace
}  // namespace penumbra::kernels
