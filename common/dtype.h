// Element types and devices, and host-side conversions for 16-bit floats.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace penumbra {

enum class DType : uint8_t { kF32, kF16, kBF16, kI32, kI64 };
enum class Device : uint8_t { kCPU, kCUDA };

constexpr size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kF16:
      return 2;
    case DType::kBF16:
      return 2;
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
  }
  return 0;
}
std::string_view DTypeName(DType t);
std::string_view DeviceName(Device d);

// bf16 <-> f32 on the host, round-to-nearest-even (NaN stays NaN).
inline uint16_t F32ToBF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float BF16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// IEEE half <-> f32 on the host, round-to-nearest-even.
float F16ToF32(uint16_t h);
uint16_t F32ToF16(float f);

// Converts n elements of `src` (any float dtype) to f32.
void ConvertToF32(const void* src, DType src_type, float* dst, size_t n);
// Converts n f32 values to `dst_type` (f32, f16 or bf16).
void ConvertFromF32(const float* src, void* dst, DType dst_type, size_t n);

}  // namespace penumbra
