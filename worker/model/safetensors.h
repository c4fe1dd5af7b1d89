// Reader for the safetensors format: an 8-byte little-endian header length N,
// N bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]},
// "__metadata__": {string: string}}, then the tensor bytes (offsets are
// relative to the end of the header).
//
// Parsing validates everything before any tensor is handed out: the header
// length, the JSON, every entry's fields, that each byte range matches
// dtype size x shape product (overflow-checked) and lies inside the file, and
// that the ranges tile the data region exactly (no overlaps, holes or trailing
// bytes), as the reference implementation requires. Any violation is
// Corruption naming the file and tensor. Parse never crashes on any input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/dtype.h"
#include "common/file.h"
#include "common/status.h"

namespace penumbra {

struct TensorInfo {
  std::string name;
  // Meaningful only when `dtype_supported`.
  DType dtype = DType::kF32;
  // The header's dtype string ("F32", "BF16", "I8", ...).
  std::string dtype_name;
  // F32, F16, BF16, I32 and I64 map to a DType; other valid safetensors dtypes
  // (I8, U8, F64, F8_E4M3, ...) are recorded but cannot be used.
  bool dtype_supported = false;
  std::vector<int64_t> shape;
  // Points into the file's bytes (not necessarily aligned: copy with memcpy).
  // Valid while the owning SafetensorsFile lives.
  const uint8_t* data = nullptr;
  size_t bytes = 0;
  // The path (or name) of the file holding the tensor.
  std::string file;

  int64_t numel() const;
};

// "[2, 3]".
std::string ShapeToString(const std::vector<int64_t>& shape);

// One parsed safetensors file. Move-only; tensor data stays at the same address
// across moves. Immutable after creation, so safe to share between threads.
class SafetensorsFile {
 public:
  // Maps `path` and parses it.
  static Result<SafetensorsFile> Open(const std::string& path);
  // Parses `size` bytes at `data`, which must outlive the result; `name` labels
  // errors and TensorInfo::file.
  static Result<SafetensorsFile> Parse(const uint8_t* data, size_t size, std::string name);

  SafetensorsFile(SafetensorsFile&&) noexcept = default;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept = default;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& name() const { return name_; }
  // In header order of data offsets.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // nullptr when absent.
  const TensorInfo* Find(const std::string& tensor_name) const;
  // NotFound when absent; InvalidArgument when its dtype is not one Penumbra reads.
  Result<const TensorInfo*> Get(const std::string& tensor_name) const;

 private:
  SafetensorsFile() = default;

  std::string name_;
  std::unique_ptr<MappedFile> map_;  // null when parsed from caller-owned bytes
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace penumbra
