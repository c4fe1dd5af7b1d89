#include "common/record.h"

#include <bit>
#include <cstring>

#include "common/hash.h"

namespace penumbra {

static_assert(std::endian::native == std::endian::little, "records are written in the host's byte order");

RecordWriter& RecordWriter::Str(std::string_view v) {
  U32(static_cast<uint32_t>(v.size()));
  s_.append(v);
  return *this;
}

RecordWriter& RecordWriter::Strs(const std::vector<std::string>& v) {
  U32(static_cast<uint32_t>(v.size()));
  for (const std::string& x : v) Str(x);
  return *this;
}

RecordWriter& RecordWriter::I32s(std::span<const int32_t> v) {
  U32(static_cast<uint32_t>(v.size()));
  return Raw(v.data(), 4 * v.size());
}

std::string RecordWriter::Seal(std::string_view key) {
  const uint64_t sum = Hash64(s_.data(), s_.size(), Hash64(key));
  Raw(&sum, 8);
  return std::move(s_);
}

Status UnsealRecord(std::string_view key, std::string_view value, uint32_t format_version, std::string_view* fields) {
  uint32_t version = 0;
  return UnsealRecordVersions(key, value, format_version, format_version, &version, fields);
}

Status UnsealRecordVersions(std::string_view key, std::string_view value, uint32_t oldest, uint32_t newest,
                            uint32_t* version, std::string_view* fields) {
  if (value.size() < 12) return Status::Corruption("truncated value (" + std::to_string(value.size()) + " bytes)");
  uint64_t sum = 0;
  std::memcpy(&sum, value.data() + value.size() - 8, 8);
  if (sum != Hash64(value.data(), value.size() - 8, Hash64(key))) return Status::Corruption("checksum mismatch");
  std::memcpy(version, value.data(), 4);
  if (*version < oldest || *version > newest) {
    return Status::Corruption(
        "format version " + std::to_string(*version) + ", this binary reads " +
        (oldest == newest ? std::to_string(newest) : std::to_string(oldest) + " to " + std::to_string(newest)));
  }
  *fields = value.substr(4, value.size() - 12);
  return Status::OK();
}

bool RecordReader::Raw(void* v, size_t n) {
  if (n > s_.size() - pos_) return false;
  std::memcpy(v, s_.data() + pos_, n);
  pos_ += n;
  return true;
}

bool RecordReader::Str(std::string* v) {
  uint32_t n = 0;
  if (!U32(&n) || n > s_.size() - pos_) return false;
  v->assign(s_.substr(pos_, n));
  pos_ += n;
  return true;
}

bool RecordReader::Strs(std::vector<std::string>* v) {
  uint32_t n = 0;
  if (!U32(&n) || n > (s_.size() - pos_) / 4) return false;  // each string takes 4 bytes at least
  v->resize(n);
  for (std::string& x : *v) {
    if (!Str(&x)) return false;
  }
  return true;
}

bool RecordReader::I32s(std::vector<int32_t>* v) {
  uint32_t n = 0;
  if (!U32(&n) || n > (s_.size() - pos_) / 4) return false;
  v->resize(n);
  // An empty vector's data() may be null, and memcpy's arguments must not be
  // (UBSan's nonnull-attribute check), even for zero bytes.
  if (n > 0) std::memcpy(v->data(), s_.data() + pos_, 4 * size_t{n});
  pos_ += 4 * size_t{n};
  return true;
}

void PutBigEndian32(std::string* s, uint32_t v) {
  for (int i = 3; i >= 0; --i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void PutBigEndian64(std::string* s, uint64_t v) {
  for (int i = 7; i >= 0; --i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t GetBigEndian32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

uint64_t GetBigEndian64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

}  // namespace penumbra
