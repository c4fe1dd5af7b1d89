#include "common/tensor.h"

#include <sstream>

namespace penumbra {

TensorView TensorView::row(int64_t r) const {
  CHECK_GE(ndim, 2);
  CHECK(r >= 0 && r < shape[0]);
  TensorView v = *this;
  v.ndim = ndim - 1;
  for (int i = 0; i < v.ndim; ++i) v.shape[i] = shape[i + 1];
  for (int i = v.ndim; i < 4; ++i) v.shape[i] = 0;
  v.data = static_cast<char*>(data) + r * v.bytes();
  return v;
}

std::string TensorView::ShapeString() const {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << shape[i];
  os << "] " << DTypeName(dtype) << " " << DeviceName(device);
  return os.str();
}

}  // namespace penumbra
