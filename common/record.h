// The byte encoding of the records Penumbra's stores keep in RocksDB (the
// job store, the coordinator's document registry; the segment store's keys):
//   - values: u32 format version, then the fields (numbers little-endian,
//     fixed width; strings and arrays as a u32 count and their bytes), then
//     a u64 checksum, Hash64 of everything before it seeded with
//     Hash64(key), so a value moved under another key fails too;
//   - keys: numbers big-endian, so RocksDB's bytewise order is their order.
// A reader never reads past the end: every read reports failure instead.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace penumbra {

class RecordWriter {
 public:
  explicit RecordWriter(uint32_t format_version) { U32(format_version); }
  RecordWriter& U8(uint8_t v) { return Raw(&v, 1); }
  RecordWriter& U32(uint32_t v) { return Raw(&v, 4); }
  RecordWriter& U64(uint64_t v) { return Raw(&v, 8); }
  RecordWriter& I64(int64_t v) { return Raw(&v, 8); }
  RecordWriter& F64(double v) { return Raw(&v, 8); }
  RecordWriter& Str(std::string_view v);
  RecordWriter& Strs(const std::vector<std::string>& v);
  RecordWriter& I32s(std::span<const int32_t> v);
  void Reserve(size_t bytes) { s_.reserve(bytes); }
  // The value: the fields and their checksum under `key` (the writer is
  // left empty).
  std::string Seal(std::string_view key);

 private:
  RecordWriter& Raw(const void* p, size_t n) {
    s_.append(static_cast<const char*>(p), n);
    return *this;
  }
  std::string s_;
};

// Checks a value's checksum under `key` and its format version; *fields is
// what lies between them. Corruption saying which check failed.
Status UnsealRecord(std::string_view key, std::string_view value, uint32_t format_version, std::string_view* fields);
// As UnsealRecord for a store that reads every format version from
// `oldest` to `newest` (a newer binary reading older records): *version says
// which one the value has.
Status UnsealRecordVersions(std::string_view key, std::string_view value, uint32_t oldest, uint32_t newest,
                            uint32_t* version, std::string_view* fields);

class RecordReader {
 public:
  explicit RecordReader(std::string_view fields) : s_(fields) {}
  bool U8(uint8_t* v) { return Raw(v, 1); }
  bool U32(uint32_t* v) { return Raw(v, 4); }
  bool U64(uint64_t* v) { return Raw(v, 8); }
  bool I64(int64_t* v) { return Raw(v, 8); }
  bool F64(double* v) { return Raw(v, 8); }
  bool Str(std::string* v);
  bool Strs(std::vector<std::string>* v);
  bool I32s(std::vector<int32_t>* v);
  size_t pos() const { return pos_; }
  bool done() const { return pos_ == s_.size(); }

 private:
  bool Raw(void* v, size_t n);
  std::string_view s_;
  size_t pos_ = 0;
};

void PutBigEndian32(std::string* s, uint32_t v);
void PutBigEndian64(std::string* s, uint64_t v);
uint32_t GetBigEndian32(const char* p);
uint64_t GetBigEndian64(const char* p);

}  // namespace penumbra
