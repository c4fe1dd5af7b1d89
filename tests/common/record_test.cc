// common/record.h: a record's fields read back as written, empty lists
// included, and a reader that never reads past the end.
#include "common/record.h"

#include <gtest/gtest.h>

namespace penumbra {
namespace {

TEST(Record, FieldsReadBackAsWrittenEmptyListsIncluded) {
  const std::vector<int32_t> ids = {7, -1, 1 << 30};
  RecordWriter w(3);
  w.U8(1).U32(2).U64(3).I64(-4).F64(0.5).Str("name").Strs({"a", ""}).I32s(ids).I32s({}).Strs({}).Str("");
  const std::string value = w.Seal("key");

  std::string_view fields;
  ASSERT_TRUE(UnsealRecord("key", value, 3, &fields).ok());
  RecordReader r(fields);
  uint8_t u8 = 0;
  uint32_t u32 = 0;
  uint64_t u64 = 0;
  int64_t i64 = 0;
  double f64 = 0;
  std::string str, empty_str = "x";
  std::vector<std::string> strs, empty_strs = {"x"};
  std::vector<int32_t> got, empty;  // data() of an empty vector is null: nothing is copied there
  ASSERT_TRUE(r.U8(&u8) && r.U32(&u32) && r.U64(&u64) && r.I64(&i64) && r.F64(&f64) && r.Str(&str) && r.Strs(&strs) &&
              r.I32s(&got) && r.I32s(&empty) && r.Strs(&empty_strs) && r.Str(&empty_str));
  EXPECT_TRUE(r.done());
  EXPECT_EQ(u8, 1);
  EXPECT_EQ(u32, 2u);
  EXPECT_EQ(u64, 3u);
  EXPECT_EQ(i64, -4);
  EXPECT_EQ(f64, 0.5);
  EXPECT_EQ(str, "name");
  EXPECT_EQ(strs, (std::vector<std::string>{"a", ""}));
  EXPECT_EQ(got, ids);
  EXPECT_TRUE(empty.empty());
  EXPECT_TRUE(empty_strs.empty());
  EXPECT_TRUE(empty_str.empty());
}

TEST(Record, AReaderFailsInsteadOfReadingPastTheEnd) {
  RecordWriter w(1);
  w.I32s(std::vector<int32_t>{1, 2, 3});
  const std::string value = w.Seal("k");
  std::string_view fields;
  ASSERT_TRUE(UnsealRecord("k", value, 1, &fields).ok());
  RecordReader r(fields.substr(0, fields.size() - 1));  // the list cut short
  std::vector<int32_t> v;
  EXPECT_FALSE(r.I32s(&v));
  EXPECT_FALSE(UnsealRecord("other key", value, 1, &fields).ok());
  EXPECT_FALSE(UnsealRecord("k", value, 2, &fields).ok());
}

}  // namespace
}  // namespace penumbra
