#include "worker/model/safetensors.h"

#include <cstring>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/worker/model_test_util.h"

namespace penumbra {
namespace {

using nlohmann::json;
using testing::BuildSafetensors;
using testing::RampTensor;
using testing::RawSafetensors;
using testing::TempDir;
using testing::TestTensor;

Result<SafetensorsFile> ParseString(const std::string& bytes) {
  return SafetensorsFile::Parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "test.safetensors");
}

// Expects Corruption naming the file and, if given, the tensor.
void ExpectCorrupt(const std::string& bytes, const std::string& tensor = "") {
  Result<SafetensorsFile> f = ParseString(bytes);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kCorruption) << f.status();
  EXPECT_HAS_SUBSTR(f.status().message(), "test.safetensors");
  if (!tensor.empty()) {
    EXPECT_HAS_SUBSTR(f.status().message(), "'" + tensor + "'");
  }
}

// One F32 tensor "a" [2, 3] (24 bytes).
std::string Body24() { return std::string(24, '\x01'); }

TEST(SafetensorsTest, ParsesValidFile) {
  const std::vector<TestTensor> tensors = {
      RampTensor("w", {2, 3}, "F32", 1.0f),
      RampTensor("b", {5}, "BF16", 2.0f),
      RampTensor("h", {4, 1}, "F16", -1.0f),
      {"ids", "I32", {3}, std::vector<uint8_t>(12, 7)},
      {"scalar", "F32", {}, std::vector<uint8_t>(4, 0)},
      {"empty", "F32", {0, 5}, {}},
  };
  const std::string bytes = BuildSafetensors(tensors, {{"format", "pt"}});
  Result<SafetensorsFile> f = ParseString(bytes);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->name(), "test.safetensors");
  EXPECT_EQ(f->tensors().size(), tensors.size());
  EXPECT_EQ(f->metadata().at("format"), "pt");
  for (const TestTensor& want : tensors) {
    SCOPED_TRACE(want.name);
    const TensorInfo* t = f->Find(want.name);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->name, want.name);
    EXPECT_EQ(t->dtype_name, want.dtype);
    EXPECT_TRUE(t->dtype_supported);
    EXPECT_EQ(t->shape, want.shape);
    EXPECT_EQ(t->file, "test.safetensors");
    ASSERT_EQ(t->bytes, want.bytes.size());
    if (t->bytes) {
      EXPECT_EQ(std::memcmp(t->data, want.bytes.data(), t->bytes), 0);
    }
  }
  const TensorInfo* w = f->Find("w");
  EXPECT_EQ(w->dtype, DType::kF32);
  EXPECT_EQ(w->numel(), 6);
  float x;
  std::memcpy(&x, w->data + 4, 4);
  EXPECT_FLOAT_EQ(x, 1.01f);
  EXPECT_EQ(f->Find("b")->dtype, DType::kBF16);
  EXPECT_EQ(f->Find("h")->dtype, DType::kF16);
  EXPECT_EQ(f->Find("ids")->dtype, DType::kI32);
  EXPECT_EQ(f->Find("scalar")->numel(), 1);
  EXPECT_EQ(f->Find("empty")->numel(), 0);
  EXPECT_EQ(f->Find("nope"), nullptr);
  Result<const TensorInfo*> g = f->Get("nope");
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kNotFound);
  EXPECT_HAS_SUBSTR(g.status().message(), "'nope'");
}

TEST(SafetensorsTest, EmptyHeaderIsValid) {
  Result<SafetensorsFile> f = ParseString(RawSafetensors("{}", ""));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(f->tensors().empty());
}

TEST(SafetensorsTest, OpensFromDiskAndSurvivesMove) {
  TempDir dir;
  const std::string path = dir.File("m.safetensors");
  testing::WriteStringToFile(path, BuildSafetensors({RampTensor("x", {3}, "F32", 5.0f)}));
  Result<SafetensorsFile> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  SafetensorsFile moved = std::move(f).value();
  const TensorInfo* t = moved.Find("x");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->file, path);
  float v;
  std::memcpy(&v, t->data + 8, 4);
  EXPECT_FLOAT_EQ(v, 5.02f);

  Result<SafetensorsFile> missing = SafetensorsFile::Open(dir.File("absent.safetensors"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_HAS_SUBSTR(missing.status().message(), "absent.safetensors");
}

TEST(SafetensorsTest, UnsupportedDtypeIsRecordedButRefused) {
  const std::string bytes = BuildSafetensors({{"q", "I8", {4}, std::vector<uint8_t>(4, 1)},
                                              {"e4m3", "F8_E4M3", {2}, std::vector<uint8_t>(2, 1)},
                                              {"d", "F64", {1}, std::vector<uint8_t>(8, 0)}});
  Result<SafetensorsFile> f = ParseString(bytes);
  ASSERT_TRUE(f.ok()) << f.status();
  const TensorInfo* q = f->Find("q");
  ASSERT_NE(q, nullptr);
  EXPECT_FALSE(q->dtype_supported);
  EXPECT_EQ(q->dtype_name, "I8");
  Result<const TensorInfo*> g = f->Get("q");
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
  EXPECT_HAS_SUBSTR(g.status().message(), "'q'");
  EXPECT_HAS_SUBSTR(g.status().message(), "I8");
}

TEST(SafetensorsTest, TooShortOrHeaderPastEnd) {
  ExpectCorrupt("");
  ExpectCorrupt(std::string(7, '\0'));
  std::string bytes = RawSafetensors("{}", "");
  bytes[0] = 3;  // claims a 3-byte header, but only 2 follow
  ExpectCorrupt(bytes);
  bytes = RawSafetensors("{}", "");
  bytes[7] = '\x80';  // a header length near 2^63
  ExpectCorrupt(bytes);
  std::string huge(8, '\xff');  // 2^64 - 1
  ExpectCorrupt(huge + "{}");
}

TEST(SafetensorsTest, BadJson) {
  ExpectCorrupt(RawSafetensors("{\"a\": ", ""));
  ExpectCorrupt(RawSafetensors("[1, 2, 3]", ""));
  ExpectCorrupt(RawSafetensors("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}} trailing",
                               std::string(4, '\0')));
  ExpectCorrupt(RawSafetensors(std::string("{\"a\xff\": 1}"), ""));
  ExpectCorrupt(RawSafetensors("{\"__metadata__\": [1]}", ""));
  ExpectCorrupt(RawSafetensors("{\"__metadata__\": {\"k\": 1}}", ""));
}

TEST(SafetensorsTest, BadEntries) {
  const std::string body = Body24();
  auto with = [&](const json& entry) { return RawSafetensors(json{{"a", entry}}.dump(), body); };
  const json good = {{"dtype", "F32"}, {"shape", {2, 3}}, {"data_offsets", {0, 24}}};
  ASSERT_TRUE(ParseString(with(good)).ok()) << ParseString(with(good)).status();

  ExpectCorrupt(with(5), "a");
  json e = good;
  e["dtype"] = "Q7";  // not a safetensors dtype
  ExpectCorrupt(with(e), "a");
  e["dtype"] = 4;
  ExpectCorrupt(with(e), "a");
  e = good;
  e.erase("dtype");
  ExpectCorrupt(with(e), "a");
  e = good;
  e["shape"] = {2, -3};
  ExpectCorrupt(with(e), "a");
  e["shape"] = {2.5, 3};
  ExpectCorrupt(with(e), "a");
  e["shape"] = "2x3";
  ExpectCorrupt(with(e), "a");
  e["shape"] = {2, 4};  // 32 bytes, but the range is 24
  ExpectCorrupt(with(e), "a");
  e = good;
  e["data_offsets"] = {24, 0};
  ExpectCorrupt(with(e), "a");
  e["data_offsets"] = {0};
  ExpectCorrupt(with(e), "a");
  e["data_offsets"] = {0, 24, 48};
  ExpectCorrupt(with(e), "a");
  e["data_offsets"] = {-1, 23};
  ExpectCorrupt(with(e), "a");
  e.erase("data_offsets");
  ExpectCorrupt(with(e), "a");
}

TEST(SafetensorsTest, ShapeProductOverflow) {
  // 2^32 * 2^32 elements wraps to 0 in 64 bits; must not be accepted as 0 bytes.
  json h = {{"a", {{"dtype", "F32"}, {"shape", {4294967296ull, 4294967296ull}}, {"data_offsets", {0, 0}}}}};
  ExpectCorrupt(RawSafetensors(h.dump(), ""), "a");
  // 2^62 elements x 4 bytes overflows only in the byte count.
  h = {{"a", {{"dtype", "F32"}, {"shape", {4611686018427387904ull}}, {"data_offsets", {0, 0}}}}};
  ExpectCorrupt(RawSafetensors(h.dump(), ""), "a");
  h = {{"a", {{"dtype", "F32"}, {"shape", {18446744073709551615ull}}, {"data_offsets", {0, 0}}}}};
  ExpectCorrupt(RawSafetensors(h.dump(), ""), "a");
  // A zero dimension makes any other dimensions harmless.
  h = {{"a", {{"dtype", "F32"}, {"shape", {4294967296ull, 4294967296ull, 0}}, {"data_offsets", {0, 0}}}}};
  Result<SafetensorsFile> f = ParseString(RawSafetensors(h.dump(), ""));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->Find("a")->numel(), 0);
}

TEST(SafetensorsTest, TruncatedFile) {
  std::string bytes = BuildSafetensors({RampTensor("w", {4, 4}), RampTensor("v", {4})});
  bytes.resize(bytes.size() - 3);
  ExpectCorrupt(bytes, "v");
}

TEST(SafetensorsTest, OverlapsHolesAndTrailingBytes) {
  const json a = {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}};
  json b = {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {4, 12}}};
  Result<SafetensorsFile> f = ParseString(RawSafetensors(json{{"a", a}, {"b", b}}.dump(), std::string(12, '\0')));
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kCorruption);
  EXPECT_HAS_SUBSTR(f.status().message(), "overlap");
  EXPECT_HAS_SUBSTR(f.status().message(), "'b'");
  EXPECT_HAS_SUBSTR(f.status().message(), "'a'");

  b["data_offsets"] = {0, 8};  // identical ranges
  ExpectCorrupt(RawSafetensors(json{{"a", a}, {"b", b}}.dump(), std::string(8, '\0')));
  b["data_offsets"] = {12, 20};  // hole at [8, 12)
  ExpectCorrupt(RawSafetensors(json{{"a", a}, {"b", b}}.dump(), std::string(20, '\0')), "b");
  b["data_offsets"] = {8, 16};
  ASSERT_TRUE(ParseString(RawSafetensors(json{{"a", a}, {"b", b}}.dump(), std::string(16, '\0'))).ok());
  ExpectCorrupt(RawSafetensors(json{{"a", a}, {"b", b}}.dump(), std::string(17, '\0')));  // trailing byte
}

TEST(SafetensorsTest, TensorsAreOrderedByOffset) {
  const json a = {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {4, 8}}};
  const json b = {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0, 4}}};
  Result<SafetensorsFile> f = ParseString(RawSafetensors(json{{"a", a}, {"b", b}}.dump(), std::string(8, '\0')));
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->tensors().size(), 2u);
  EXPECT_EQ(f->tensors()[0].name, "b");
  EXPECT_EQ(f->tensors()[1].name, "a");
  EXPECT_EQ(f->Find("a")->data, f->Find("b")->data + 4);
}

// Every prefix and a sweep of single-byte corruptions of a valid file must be
// handled without crashing (the fuzzer does this at scale).
TEST(SafetensorsTest, PrefixesAndBitFlipsDoNotCrash) {
  const std::string good = BuildSafetensors({RampTensor("w", {3, 2}), RampTensor("b", {2}, "BF16")}, {{"k", "v"}});
  for (size_t n = 0; n < good.size(); ++n) {
    Result<SafetensorsFile> f = ParseString(good.substr(0, n));
    EXPECT_FALSE(f.ok()) << n;
  }
  int ok = 0;
  for (size_t i = 0; i < good.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string bad = good;
      bad[i] = static_cast<char>(bad[i] ^ (1 << bit));
      ok += ParseString(bad).ok() ? 1 : 0;
    }
  }
  EXPECT_GT(ok, 0);  // flips inside tensor data are harmless
}

}  // namespace
}  // namespace penumbra
