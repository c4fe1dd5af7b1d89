#include "kernels/cpu/shadowkv_prefill.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/landmark_format.h"

namespace penumbra::kernels::cpu {

float ChunkCosine(float dot, float xx, float yy) {
  const bool x0 = xx == 0.0f, y0 = yy == 0.0f;
  if (x0 && y0) return 1.0f;
  if (x0 || y0) return 0.0f;
  return dot / (std::sqrt(xx) * std::sqrt(yy));
}

void ChunkLandmarks(const ChunkLandmarksArgs& a) {
  const int C = a.chunk_tokens, d = a.d;
  ParallelFor(static_cast<int64_t>(a.hkv) * a.n_chunks, [&](int64_t job) {
    const int h = static_cast<int>(job / a.n_chunks), c = static_cast<int>(job % a.n_chunks);
    const float* keys = a.k + h * a.k_head_stride + (a.first_token + static_cast<int64_t>(c) * C) * d;
    std::vector<float> mean(d, 0.0f);
    for (int t = 0; t < C; ++t)
      for (int j = 0; j < d; ++j) mean[j] += keys[static_cast<int64_t>(t) * d + j];
    float mm = 0.0f;
    for (int j = 0; j < d; ++j) {
      mean[j] /= static_cast<float>(C);
      mm += mean[j] * mean[j];
    }
    float lo = INFINITY;
    for (int t = 0; t < C; ++t) {
      float dot = 0.0f, kk = 0.0f;
      for (int j = 0; j < d; ++j) {
        const float x = keys[static_cast<int64_t>(t) * d + j];
        dot += mean[j] * x;
        kk += x * x;
      }
      const float cs = ChunkCosine(dot, mm, kk);
      lo = std::isnan(cs) || std::isnan(lo) ? NAN : std::min(lo, cs);
    }
    // The chunk's S rows: the means of its runs of C / S keys (S = 1: `mean`).
    const int S = a.landmarks_per_chunk, run = C / S;
    std::vector<float> rows(static_cast<size_t>(S) * d);
    if (S <= 1) {
      std::copy(mean.begin(), mean.end(), rows.begin());
    } else {
      for (int j = 0; j < S; ++j) {
        float* o = rows.data() + static_cast<int64_t>(j) * d;
        for (int t = j * run; t < (j + 1) * run; ++t)
          for (int i = 0; i < d; ++i) o[i] += keys[static_cast<int64_t>(t) * d + i];
        for (int i = 0; i < d; ++i) o[i] /= static_cast<float>(run);
      }
    }
    if (a.landmarks_fp8 != nullptr) {
      EncodeLandmarkFp8(rows.data(), static_cast<int64_t>(S) * d,
                        a.landmarks_fp8 + h * a.landmark_head_stride + c * LandmarkChunkElems(S, d, true));
    } else {
      std::copy(rows.begin(), rows.end(), a.landmarks + h * a.landmark_head_stride + static_cast<int64_t>(c) * S * d);
    }
    a.min_cos[h * a.min_cos_head_stride + c] = lo;
  });
}

void SelectOutlierChunks(const float* min_cos, int64_t min_cos_head_stride, int hkv, int n_chunks, int num_outliers,
                         int32_t* out) {
  std::vector<int32_t> idx(n_chunks);
  for (int h = 0; h < hkv; ++h) {
    const float* s = min_cos + h * min_cos_head_stride;
    std::iota(idx.begin(), idx.end(), 0);
    auto less = [s](int32_t x, int32_t y) {
      const bool nx = std::isnan(s[x]), ny = std::isnan(s[y]);
      if (nx != ny) return nx;
      if (!nx && s[x] != s[y]) return s[x] < s[y];
      return x < y;
    };
    std::partial_sort(idx.begin(), idx.begin() + num_outliers, idx.end(), less);
    std::sort(idx.begin(), idx.begin() + num_outliers);
    std::copy(idx.begin(), idx.begin() + num_outliers, out + static_cast<int64_t>(h) * num_outliers);
  }
}

void GatherOutliers(const GatherOutliersArgs& a) {
  const int64_t row = static_cast<int64_t>(a.chunk_tokens) * a.d;
  for (int h = 0; h < a.hkv; ++h) {
    uint8_t* mask = a.excluded + h * a.mask_head_stride;
    std::memset(mask, 0, a.n_chunks);
    for (int j = 0; j < a.num_outliers; ++j) {
      const int c = a.outliers[static_cast<int64_t>(h) * a.num_outliers + j];
      const int64_t src = h * a.kv_head_stride + (a.first_token + static_cast<int64_t>(c) * a.chunk_tokens) * a.d;
      const int64_t dst = h * a.att_head_stride + j * row;
      std::copy(a.k + src, a.k + src + row, a.att_k + dst);
      std::copy(a.v + src, a.v + src + row, a.att_v + dst);
      mask[c] = 1;
    }
  }
}

}  // namespace penumbra::kernels::cpu
