// How ShadowKV's offloaded values are stored when shadowkv.value_format is
// fp8, shared by the CPU and CUDA kernels (the reference codec is here; the
// CUDA encoder and the dequantizing value fetch must give the same bytes and
// the same values, bit for bit).
//
// A value row is one (KV head, chunk): C tokens of d elements. As fp8 it is
//   C * d OCP e4m3 codes, token-major (token t's element j at t * d + j),
//   then C f32 scales (token t's at C * d + 4 t), zero-padded to a multiple
//   of 16 bytes (kValueRowAlign):
// ValueRowBytesFp8(C, d) bytes, against C * d * 2 for bf16 (1056 of 2048 at
// C = 8, d = 128: the host link moves 0.52x the bytes). Element (t, j) is
// code * scale[t]. The scale is per token (and head): the token's largest
// finite |value| over kE4M3Max (1 when that is 0), so each token's largest
// element keeps e4m3's full mantissa, whatever the other tokens' ranges.
// A value that is not finite (NaN, +-Inf) encodes as the NaN code 0x7f and
// decodes as NaN, on the CPU and the GPU alike: a non-finite input is shown,
// never turned into a finite value; it does not enter its token's scale.
// Rounding: x * (kE4M3Max / amax) to nearest even, saturating at +-448 (a
// product can pass 448 by rounding); decoding: code's value * scale in f32,
// then the row's dtype (bf16 to nearest even).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/landmark_format.h"

namespace penumbra::kernels {

inline constexpr int kValueRowAlign = 16;

constexpr int64_t ValueRowBytesFp8(int chunk_tokens, int d) {
  const int64_t raw = static_cast<int64_t>(chunk_tokens) * d + 4 * static_cast<int64_t>(chunk_tokens);
  return (raw + kValueRowAlign - 1) / kValueRowAlign * kValueRowAlign;
}

// Bytes of one value row (a KV head's chunk of chunk_tokens x d) as the
// value store keeps it: an fp8 row, or elem_bytes per element (the model's
// dtype).
constexpr int64_t ValueRowBytes(bool fp8, int chunk_tokens, int d, size_t elem_bytes) {
  return fp8 ? ValueRowBytesFp8(chunk_tokens, d)
             : static_cast<int64_t>(chunk_tokens) * d * static_cast<int64_t>(elem_bytes);
}

// One token's scale from its d values (finite ones only).
inline float ValueTokenScale(const float* x, int d) {
  float amax = 0.0f;
  for (int j = 0; j < d; ++j)
    if (std::isfinite(x[j])) amax = std::fmax(amax, std::fabs(x[j]));
  return amax > 0.0f ? amax / kE4M3Max : 1.0f;
}

// One row's C * d values (f32) -> ValueRowBytesFp8(C, d) bytes at `out`.
inline void EncodeValueRowFp8(const float* x, int chunk_tokens, int d, uint8_t* out) {
  float* scales = reinterpret_cast<float*>(out + static_cast<int64_t>(chunk_tokens) * d);  // 4-byte aligned: C * d % 4
  for (int t = 0; t < chunk_tokens; ++t) {
    const float* v = x + static_cast<int64_t>(t) * d;
    float amax = 0.0f;
    for (int j = 0; j < d; ++j)
      if (std::isfinite(v[j])) amax = std::fmax(amax, std::fabs(v[j]));
    const float inv = amax > 0.0f ? kE4M3Max / amax : 1.0f;
    const float scale = amax > 0.0f ? amax / kE4M3Max : 1.0f;
    for (int j = 0; j < d; ++j) {
      out[static_cast<int64_t>(t) * d + j] = std::isfinite(v[j]) ? F32ToE4M3(v[j] * inv) : kE4M3NaN;
    }
    std::memcpy(scales + t, &scale, sizeof(float));
  }
  const int64_t used = static_cast<int64_t>(chunk_tokens) * d + 4 * static_cast<int64_t>(chunk_tokens);
  std::memset(out + used, 0, static_cast<size_t>(ValueRowBytesFp8(chunk_tokens, d) - used));
}

// A row's bytes -> its C * d values (f32; the caller rounds to the row's
// dtype).
inline void DecodeValueRowFp8(const uint8_t* in, int chunk_tokens, int d, float* x) {
  const float* table = E4M3Table();
  for (int t = 0; t < chunk_tokens; ++t) {
    float scale;
    std::memcpy(&scale, in + static_cast<int64_t>(chunk_tokens) * d + 4 * static_cast<int64_t>(t), sizeof(float));
    for (int j = 0; j < d; ++j) {
      const int64_t i = static_cast<int64_t>(t) * d + j;
      x[i] = table[in[i]] * scale;
    }
  }
}

}  // namespace penumbra::kernels
