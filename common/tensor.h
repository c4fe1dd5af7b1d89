// Non-owning tensor views: a pointer, a dtype, a device and a row-major shape.
//
// Views never own memory; whoever allocated the bytes (a Backend buffer, a
// memory-mapped checkpoint, a store arena) keeps them alive. Shapes have at
// most 4 dimensions and are contiguous row-major unless a stride says
// otherwise.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include <glog/logging.h>

#include "common/dtype.h"

namespace penumbra {

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Device device = Device::kCPU;
  int ndim = 0;
  std::array<int64_t, 4> shape{};

  TensorView() = default;
  TensorView(void* d, DType t, Device dev, std::initializer_list<int64_t> dims)
      : data(d), dtype(t), device(dev), ndim(static_cast<int>(dims.size())) {
    CHECK_LE(ndim, 4);
    int i = 0;
    for (int64_t x : dims) shape[i++] = x;
  }

  int64_t dim(int i) const {
    if (i < 0) i += ndim;
    CHECK(i >= 0 && i < ndim) << "dim " << i << " of a " << ndim << "-d tensor";
    return shape[i];
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  size_t bytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype); }
  template <typename T>
  T* as() const { return static_cast<T*>(data); }
  // Row `r` of the first dimension as a view of the remaining dims.
  TensorView row(int64_t r) const;
  std::string ShapeString() const;  // "[2, 3] bf16 cuda"
};

}  // namespace penumbra
