// Args: range-checked flag values name the flag, the range and the value;
// absent flags give the default; NaN is outside every range; a flag given
// twice is refused.
#include "common/args.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace penumbra {
namespace {

Args Parsed(std::vector<std::string> argv) {
  Args a;
  a.Flag("t", "").Flag("n", "");
  std::vector<char*> p;
  for (auto& s : argv) p.push_back(s.data());
  Status s = a.Parse(static_cast<int>(p.size()), p.data(), 0);
  EXPECT_TRUE(s.ok()) << s;
  return a;
}

TEST(ArgsTest, DoubleInRange) {
  EXPECT_EQ(*Parsed({}).GetDoubleIn("t", 5.0, 0, 1), 5.0);  // the default is not checked
  EXPECT_EQ(*Parsed({"--t", "0.5"}).GetDoubleIn("t", 1, 0, 1), 0.5);
  EXPECT_EQ(*Parsed({"--t", "1"}).GetDoubleIn("t", 1, 0, 1, true), 1.0);
  auto r = Parsed({"--t", "0"}).GetDoubleIn("t", 1, 0, 1, /*lo_open=*/true);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "flag --t: must be in (0, 1], got 0");
  r = Parsed({"--t", "-1"}).GetDoubleIn("t", 0, 0, 100);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "flag --t: must be in [0, 100], got -1");
  EXPECT_FALSE(Parsed({"--t", "nan"}).GetDoubleIn("t", 0, 0, 100).ok());
  EXPECT_FALSE(Parsed({"--t", "inf"}).GetDoubleIn("t", 0, 0, 100).ok());
  EXPECT_FALSE(Parsed({"--t", "x"}).GetDoubleIn("t", 0, 0, 100).ok());
}

TEST(ArgsTest, IntInRange) {
  EXPECT_EQ(*Parsed({}).GetIntIn("n", -7, 0, 10), -7);
  EXPECT_EQ(*Parsed({"--n=10"}).GetIntIn("n", 0, 0, 10), 10);
  auto r = Parsed({"--n", "1000000000000"}).GetIntIn("n", 1, 1, int64_t{1} << 30);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "flag --n: must be in [1, 1073741824], got 1000000000000");
  // Out of int64 range is a parse error, not a wrap-around.
  r = Parsed({"--n", "99999999999999999999"}).GetIntIn("n", 1, 1, 10);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("is not an integer"), std::string::npos) << r.status();
}

TEST(ArgsTest, AFlagGivenTwiceIsRefused) {
  for (std::vector<std::string> argv :
       {std::vector<std::string>{"--t", "1", "--t", "2"}, std::vector<std::string>{"--t=1", "--n", "3", "--t", "2"}}) {
    Args a;
    a.Flag("t", "").Flag("n", "");
    std::vector<char*> p;
    for (auto& s : argv) p.push_back(s.data());
    const Status st = a.Parse(static_cast<int>(p.size()), p.data(), 0);
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(st.message(), "flag --t given twice ('1', then '2')");
  }
  Args a;
  a.Switch("json", "");
  std::string j = "--json";
  std::vector<char*> p = {j.data(), j.data()};
  const Status st = a.Parse(2, p.data(), 0);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.message(), "flag --json given twice");
}

// A launcher's extra flags replace its own (pairs, --flag=value, switches);
// the rest of both stays in order.
TEST(ArgsTest, OverrideFlagsReplacesTheSameFlags) {
  using V = std::vector<std::string>;
  EXPECT_EQ(OverrideFlags({"--device", "auto"}, {"--device", "cpu"}), (V{"--device", "cpu"}));
  EXPECT_EQ(OverrideFlags({"--device", "auto", "--config", "e.yaml", "--json"},
                          {"--kv-policy", "shadowkv", "--device=cuda", "--json"}),
            (V{"--config", "e.yaml", "--kv-policy", "shadowkv", "--device=cuda", "--json"}));
  EXPECT_EQ(OverrideFlags({"--device=auto", "--budget", "-1"}, {"--device", "cpu"}),
            (V{"--budget", "-1", "--device", "cpu"}));
  EXPECT_EQ(OverrideFlags({"--a", "1"}, {}), (V{"--a", "1"}));
  EXPECT_EQ(OverrideFlags({}, {"--a", "1"}), (V{"--a", "1"}));
  // A switch followed by a flag keeps the flag; a lone word is kept as it is.
  EXPECT_EQ(OverrideFlags({"--json", "--device", "auto", "x"}, {"--device", "cpu"}),
            (V{"--json", "x", "--device", "cpu"}));
}

}  // namespace
}  // namespace penumbra
