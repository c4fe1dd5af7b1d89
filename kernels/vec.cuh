// Pack<T, N>: N consecutive elements of T moved as one vector access, the
// unit the pointwise kernels (add_bias, convert, embedding, rmsnorm,
// rope_store, swiglu) load and store. Aligned to its size, capped at 16 bytes
// (the widest access): a Pack<float, 8> is two 16-byte accesses.
// Header-only; included by .cu files only.
#pragma once
#include <cstddef>

namespace penumbra::kernels {

// Widest single load/store, in bytes.
inline constexpr size_t kMaxVecBytes = 16;

template <typename T, int N>
struct alignas(sizeof(T) * N > kMaxVecBytes ? kMaxVecBytes : sizeof(T) * N) Pack {
  T v[N];
};

}  // namespace penumbra::kernels
