#include "worker/model/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>

#include <nlohmann/json.hpp>

namespace penumbra {

using json = nlohmann::json;

namespace {

// The reference implementation caps the header at 100 MB.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

struct DTypeEntry {
  const char* name;
  size_t size;
  std::optional<DType> dtype;
};

// Every dtype in the safetensors spec with a whole-byte element size.
constexpr DTypeEntry kDTypes[] = {
    {"F32", 4, DType::kF32},   {"F16", 2, DType::kF16},      {"BF16", 2, DType::kBF16},    {"I32", 4, DType::kI32},
    {"I64", 8, DType::kI64},   {"F64", 8, std::nullopt},     {"I8", 1, std::nullopt},      {"U8", 1, std::nullopt},
    {"I16", 2, std::nullopt},  {"U16", 2, std::nullopt},     {"U32", 4, std::nullopt},     {"U64", 8, std::nullopt},
    {"BOOL", 1, std::nullopt}, {"F8_E4M3", 1, std::nullopt}, {"F8_E5M2", 1, std::nullopt}, {"F8_E8M0", 1, std::nullopt},
};

const DTypeEntry* FindDType(const std::string& name) {
  for (const DTypeEntry& e : kDTypes) {
    if (name == e.name) return &e;
  }
  return nullptr;
}

// A non-negative JSON integer, or nullopt.
std::optional<uint64_t> AsIndex(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i >= 0) return static_cast<uint64_t>(i);
  }
  return std::nullopt;
}

}  // namespace

int64_t TensorInfo::numel() const {
  // Non-zero dimensions multiply to at most the tensor's byte count, so this cannot overflow.
  for (int64_t d : shape) {
    if (d == 0) return 0;
  }
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeToString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

Result<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  PENUMBRA_ASSIGN_OR_RETURN(MappedFile mapped, MappedFile::Open(path));
  auto map = std::make_unique<MappedFile>(std::move(mapped));
  PENUMBRA_ASSIGN_OR_RETURN(SafetensorsFile f, Parse(map->data(), map->size(), path));
  f.map_ = std::move(map);
  return f;
}

Result<SafetensorsFile> SafetensorsFile::Parse(const uint8_t* data, size_t size, std::string name) {
  SafetensorsFile f;
  f.name_ = std::move(name);
  const std::string& fname = f.name_;
  auto corrupt = [&fname](const std::string& what) { return Status::Corruption(fname + ": " + what); };
  if (size < 8) return corrupt("file is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];
  if (header_len > size - 8) {
    return corrupt("header length " + std::to_string(header_len) + " runs past the end of the file (" +
                   std::to_string(size) + " bytes)");
  }
  if (header_len > kMaxHeaderBytes) return corrupt("header length " + std::to_string(header_len) + " exceeds 100 MB");
  if (header_len < 2) return corrupt("header is too short to be a JSON object");
  const char* header = reinterpret_cast<const char*>(data + 8);
  if (header[0] != '{') return corrupt("header does not start with '{'");
  json root = json::parse(header, header + header_len, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return corrupt("header is not valid JSON");
  if (!root.is_object()) return corrupt("header is not a JSON object");

  const uint8_t* body = data + 8 + header_len;
  const uint64_t body_size = size - 8 - header_len;

  auto bad = [&fname](const std::string& tensor, const std::string& what) {
    return Status::Corruption(fname + ": tensor '" + tensor + "': " + what);
  };
  struct Range {
    uint64_t begin, end;
    size_t index;
  };
  std::vector<Range> ranges;
  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "__metadata__") {
      if (!v.is_object()) return corrupt("__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) return corrupt("__metadata__ value for '" + m.key() + "' is not a string");
        f.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) return bad(key, "entry is not an object");
    TensorInfo t;
    t.name = key;
    t.file = fname;

    auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string()) return bad(key, "missing or non-string 'dtype'");
    t.dtype_name = dt->get<std::string>();
    const DTypeEntry* entry = FindDType(t.dtype_name);
    if (!entry) return bad(key, "unknown dtype '" + t.dtype_name + "'");
    if (entry->dtype) {
      t.dtype = *entry->dtype;
      t.dtype_supported = true;
    }

    auto sh = v.find("shape");
    if (sh == v.end() || !sh->is_array()) return bad(key, "missing or non-list 'shape'");
    uint64_t numel = 1;
    bool overflow = false;
    for (const json& d : *sh) {
      std::optional<uint64_t> dim = AsIndex(d);
      if (!dim || *dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return bad(key, "shape entry " + d.dump() + " is not a non-negative integer");
      }
      t.shape.push_back(static_cast<int64_t>(*dim));
      overflow = overflow || __builtin_mul_overflow(numel, *dim, &numel);
    }
    uint64_t nbytes = 0;
    overflow = overflow || __builtin_mul_overflow(numel, static_cast<uint64_t>(entry->size), &nbytes);
    // A zero dimension makes the product 0 whatever overflowed before it.
    if (std::find(t.shape.begin(), t.shape.end(), 0) != t.shape.end()) {
      overflow = false;
      nbytes = 0;
    }
    if (overflow) return bad(key, "shape " + ShapeToString(t.shape) + " overflows");

    auto off = v.find("data_offsets");
    if (off == v.end() || !off->is_array() || off->size() != 2) return bad(key, "missing or malformed 'data_offsets'");
    std::optional<uint64_t> begin = AsIndex((*off)[0]), end = AsIndex((*off)[1]);
    if (!begin || !end || *begin > *end) return bad(key, "data_offsets " + off->dump() + " are not a valid range");
    if (*end > body_size) {
      return bad(key, "data_offsets " + off->dump() + " run past the end of the data (" + std::to_string(body_size) +
                          " bytes)");
    }
    if (*end - *begin != nbytes) {
      return bad(key, "data_offsets " + off->dump() + " span " + std::to_string(*end - *begin) + " bytes but " +
                          t.dtype_name + " " + ShapeToString(t.shape) + " needs " + std::to_string(nbytes));
    }
    t.data = body + *begin;
    t.bytes = static_cast<size_t>(nbytes);
    ranges.push_back({*begin, *end, f.tensors_.size()});
    f.tensors_.push_back(std::move(t));
  }

  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  uint64_t covered = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const Range& r = ranges[i];
    if (r.begin < covered) {
      return bad(f.tensors_[r.index].name,
                 "data_offsets overlap tensor '" + f.tensors_[ranges[i - 1].index].name + "'");
    }
    if (r.begin > covered) {
      return bad(f.tensors_[r.index].name, "data begins at " + std::to_string(r.begin) +
                                               ", leaving a hole after byte " + std::to_string(covered));
    }
    covered = r.end;
  }
  if (covered != body_size) {
    return corrupt("tensors cover " + std::to_string(covered) + " of " + std::to_string(body_size) + " data bytes");
  }

  std::vector<TensorInfo> ordered;
  ordered.reserve(ranges.size());
  for (const Range& r : ranges) ordered.push_back(std::move(f.tensors_[r.index]));
  f.tensors_ = std::move(ordered);
  for (size_t i = 0; i < f.tensors_.size(); ++i) f.index_.emplace(f.tensors_[i].name, i);
  return f;
}

const TensorInfo* SafetensorsFile::Find(const std::string& tensor_name) const {
  auto it = index_.find(tensor_name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

Result<const TensorInfo*> SafetensorsFile::Get(const std::string& tensor_name) const {
  const TensorInfo* t = Find(tensor_name);
  if (!t) return Status::NotFound(name_ + ": no tensor '" + tensor_name + "'");
  if (!t->dtype_supported) {
    return Status::InvalidArgument(name_ + ": tensor '" + tensor_name + "' has dtype " + t->dtype_name +
                                   ", which Penumbra cannot read (supported: F32, F16, BF16, I32, I64)");
  }
  return t;
}

}  // namespace penumbra
