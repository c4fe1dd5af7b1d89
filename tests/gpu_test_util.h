// For *_gpu_test.cc: skip when no CUDA device is present; check CUDA calls.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <glog/logging.h>
#include <gtest/gtest.h>

#include "common/dtype.h"

#include "tests/test_util.h"

#define PENUMBRA_SKIP_WITHOUT_GPU()                          \
  do {                                                       \
    int _n = 0;                                              \
    if (cudaGetDeviceCount(&_n) != cudaSuccess || _n == 0) { \
      (void)cudaGetLastError();                              \
      GTEST_SKIP() << "no CUDA device";                      \
    }                                                        \
  } while (0)

#define PENUMBRA_CUDA_OK(expr)                                             \
  do {                                                                     \
    cudaError_t _e = (expr);                                               \
    ASSERT_EQ(_e, cudaSuccess) << #expr << ": " << cudaGetErrorString(_e); \
  } while (0)

namespace penumbra::testing {

// An owning device allocation for tests (CHECK-fails when out of memory).
class GpuBuffer {
 public:
  explicit GpuBuffer(size_t bytes) {
    CHECK(cudaMalloc(&p_, std::max<size_t>(bytes, 1)) == cudaSuccess) << "cudaMalloc " << bytes;
  }
  ~GpuBuffer() { (void)cudaFree(p_); }
  GpuBuffer(GpuBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  GpuBuffer& operator=(GpuBuffer&&) = delete;
  void* get() const { return p_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
};

// A host vector's bytes in a new device buffer, and back.
template <typename T>
GpuBuffer Upload(const std::vector<T>& v) {
  GpuBuffer b(v.size() * sizeof(T));
  if (!v.empty()) CHECK(cudaMemcpy(b.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  return b;
}
template <typename T>
std::vector<T> Download(const void* p, size_t n) {
  std::vector<T> v(n);
  if (n > 0) CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
  return v;
}

// Host f32 -> device tensor of `dtype`; `rounded` receives the values the
// device holds, widened back to f32 (the CPU reference's input).
inline GpuBuffer UploadAs(const std::vector<float>& x, DType dtype, std::vector<float>* rounded) {
  GpuBuffer buf(x.size() * DTypeSize(dtype));
  std::vector<char> host(x.size() * DTypeSize(dtype));
  ConvertFromF32(x.data(), host.data(), dtype, x.size());
  CHECK(cudaMemcpy(buf.get(), host.data(), host.size(), cudaMemcpyHostToDevice) == cudaSuccess);
  if (rounded) {
    rounded->resize(x.size());
    ConvertToF32(host.data(), dtype, rounded->data(), x.size());
  }
  return buf;
}

// Device tensor of `dtype` -> host f32.
inline std::vector<float> DownloadAs(const GpuBuffer& buf, DType dtype, size_t n) {
  std::vector<char> host(n * DTypeSize(dtype));
  CHECK(cudaMemcpy(host.data(), buf.get(), host.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
  std::vector<float> out(n);
  ConvertToF32(host.data(), dtype, out.data(), n);
  return out;
}

// Kernel benchmarks run only with PENUMBRA_KERNEL_BENCH=1.
inline bool KernelBenchEnabled() {
  const char* e = std::getenv("PENUMBRA_KERNEL_BENCH");
  return e != nullptr && std::string(e) == "1";
}

// Mean milliseconds of fn() (work it enqueues on `stream`) over `iters` calls,
// after two warm-up calls.
template <typename Fn>
float TimeMs(Fn&& fn, int iters, cudaStream_t stream = nullptr) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  fn();
  fn();
  cudaStreamSynchronize(stream);
  cudaEventRecord(e0, stream);
  for (int i = 0; i < iters; ++i) fn();
  cudaEventRecord(e1, stream);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms / iters;
}

}  // namespace penumbra::testing
