// How ShadowKV's chunk landmarks are stored, shared by the CPU and CUDA
// kernels and the policy that sizes their buffers.
//
// Landmarks are kept per chunk as one record of S rows of d elements (S =
// landmarks_per_chunk), chunk c's record at c * LandmarkChunkElems(S, d, fp8)
// elements of the landmark type from its head's first:
//  - model dtype (f32 or bf16): the S rows, nothing else;
//  - fp8: S * d OCP e4m3 codes (bytes) and then the record's scale, an f32,
//    padded to kLandmarkFp8Tail bytes with zeros. A landmark element is its
//    code's value times the scale; the scale is the record's largest |value|
//    over kE4M3Max (1 when every value is 0), so the largest element keeps
//    the format's full 3-bit mantissa and none saturates. Half the bytes of
//    bf16 per element: the landmarks are what every decode step reads most.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace penumbra::kernels {

inline constexpr int kLandmarkFp8Tail = 16;  // the scale (f32) and 12 zero bytes: records stay 16-byte aligned
inline constexpr float kE4M3Max = 448.0f;    // the largest finite e4m3 value

// Elements of the landmark type (bytes for fp8) in one chunk's record.
constexpr int64_t LandmarkChunkElems(int landmarks_per_chunk, int d, bool fp8) {
  return static_cast<int64_t>(landmarks_per_chunk) * d + (fp8 ? kLandmarkFp8Tail : 0);
}
// Bytes of one chunk's record; model_elem_bytes: the model dtype's size.
constexpr int64_t LandmarkChunkBytes(int landmarks_per_chunk, int d, bool fp8, size_t model_elem_bytes) {
  return LandmarkChunkElems(landmarks_per_chunk, d, fp8) * static_cast<int64_t>(fp8 ? 1 : model_elem_bytes);
}

// f32 -> e4m3, round to nearest even, saturating at +-448 (what CUDA's
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) gives); NaN -> 0x7f.
inline uint8_t F32ToE4M3(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if (std::isnan(f)) return 0x7f;
  const float a = std::fabs(f);
  if (a > 464.0f) return sign | 0x7e;            // past the midpoint of 448 and 480 (no such value): saturate
  if (a < 0.015625f) {                           // below 2^-6: subnormal codes, steps of 2^-9
    const float m = std::nearbyint(a * 512.0f);  // 0 .. 8 (8 is 2^-6, the first normal code)
    return sign | static_cast<uint8_t>(m);
  }
  std::memcpy(&u, &a, 4);
  uint32_t e = (u >> 23) - 127 + 7;  // 1 .. 15
  uint32_t m = (u >> 20) & 7u;
  const uint32_t rest = u & 0xfffffu, half = 0x80000u;
  if (rest > half || (rest == half && (m & 1u))) ++m;
  if (m == 8) {
    m = 0;
    ++e;
  }
  const uint32_t code = (e << 3) | m;
  return sign | static_cast<uint8_t>(code > 0x7eu ? 0x7eu : code);
}

// e4m3 -> f32, exact; 0x7f and 0xff are NaN.
inline float E4M3ToF32(uint8_t c) {
  if ((c & 0x7f) == 0x7f) return std::nanf("");
  const int e = (c >> 3) & 15, m = c & 7;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return (c & 0x80) ? -v : v;
}

// Every code's value (E4M3ToF32), for decoding rows.
inline const float* E4M3Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = E4M3ToF32(static_cast<uint8_t>(i));
    return t;
  }();
  return table.data();
}

// The NaN code every fp8 encoder here writes for a value that is not finite.
inline constexpr uint8_t kE4M3NaN = 0x7f;

// One record's S * d values (f32) as fp8: the codes at `out`, the scale and
// its zero padding after them. The scale is the finite values' largest |x|
// over kE4M3Max; a value that is not finite (NaN, +-Inf: a model that
// overflowed) becomes kE4M3NaN and leaves the others' codes as they would
// be without it, on the CPU and the GPU alike (shadowkv_prefill.cu).
inline void EncodeLandmarkFp8(const float* values, int64_t n, uint8_t* out) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isfinite(values[i])) amax = std::fmax(amax, std::fabs(values[i]));
  }
  const float inv = amax > 0.0f ? kE4M3Max / amax : 1.0f;
  const float scale = amax > 0.0f ? amax / kE4M3Max : 1.0f;
  for (int64_t i = 0; i < n; ++i) out[i] = std::isfinite(values[i]) ? F32ToE4M3(values[i] * inv) : kE4M3NaN;
  std::memset(out + n, 0, kLandmarkFp8Tail);
  std::memcpy(out + n, &scale, sizeof(float));
}

}  // namespace penumbra::kernels
