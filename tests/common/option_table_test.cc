#include "common/option_table.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace penumbra {
namespace {

struct Opts {
  int lanes = 2;
  int64_t budget = 2048;
  size_t bytes = 4096;
  double fraction = 0.5;
  bool turbo = false;
  std::string mode = "dense";
  int chunk = 8;
  int per_chunk = 4;
};

const OptionTable<Opts>& Table() {
  static const auto* t =
      &(*new OptionTable<Opts>("demo"))
           .Int(&Opts::lanes, "lanes", "lanes", 1, 8, "decode lanes")
           .Int(&Opts::budget, "budget", "budget_tokens", int64_t{1}, int64_t{1} << 32, "budget")
           .Int(&Opts::bytes, "", "bytes", size_t{0}, size_t{1} << 40, "yaml only")
           .Double(&Opts::fraction, "fraction", "fraction", 0.0, 1.0, "a fraction")
           .Bool(&Opts::turbo, "turbo", "turbo", "go fast")
           .Enum(&Opts::mode, "mode", "mode", {"dense", "sparse"}, "how")
           .Int(&Opts::chunk, "chunk-size", "chunk_size", 1, 1024, "tokens per chunk")
           .Int(&Opts::per_chunk, "per-chunk", "per_chunk", 1, 16, "landmarks per chunk")
           .Check("per_chunk", [](const Opts& o) -> std::string {
             if (o.chunk % o.per_chunk != 0) {
               return "must divide chunk_size (" + std::to_string(o.chunk) + "), got " + std::to_string(o.per_chunk);
             }
             return "";
           });
  return *t;
}

Status Parse(const std::vector<std::string>& flags, Opts* o) {
  Args a;
  Table().AddFlags(a);
  std::vector<std::string> argv = {"tool"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  std::vector<char*> p;
  for (std::string& s : argv) p.push_back(s.data());
  PENUMBRA_RETURN_IF_ERROR(a.Parse(static_cast<int>(p.size()), p.data(), 1));
  return Table().ApplyFlags(a, o);
}

Status Load(const std::string& yaml, Opts* o) {
  PENUMBRA_ASSIGN_OR_RETURN(ConfigReader r, ConfigReader::FromString(yaml, "t.yaml"));
  ConfigReader s = r.Child("demo");
  PENUMBRA_RETURN_IF_ERROR(Table().Load(s, o));
  return r.Finish();
}

TEST(OptionTable, FlagsAndYamlFillTheSameFields) {
  Opts f;
  ASSERT_TRUE(
      Parse({"--lanes", "3", "--budget", "512", "--fraction", "0.25", "--turbo", "on", "--mode", "sparse"}, &f).ok());
  EXPECT_EQ(f.lanes, 3);
  EXPECT_EQ(f.budget, 512);
  EXPECT_DOUBLE_EQ(f.fraction, 0.25);
  EXPECT_TRUE(f.turbo);
  EXPECT_EQ(f.mode, "sparse");
  Opts y;
  Status s = Load(
      "demo:\n  lanes: 3\n  budget_tokens: 512\n  fraction: 0.25\n  turbo: true\n  mode: sparse\n"
      "  bytes: 77\n",
      &y);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(y.lanes, f.lanes);
  EXPECT_EQ(y.budget, f.budget);
  EXPECT_EQ(y.bytes, 77u);
  EXPECT_EQ(y.mode, f.mode);
  EXPECT_TRUE(y.turbo);
}

TEST(OptionTable, AbsentOptionsKeepTheStructsDefaults) {
  Opts o;
  ASSERT_TRUE(Parse({}, &o).ok());
  ASSERT_TRUE(Load("demo: {}\n", &o).ok());
  EXPECT_EQ(o.lanes, 2);
  EXPECT_EQ(o.mode, "dense");
  EXPECT_EQ(o.bytes, 4096u);
}

TEST(OptionTable, TheSameRangeRefusesBothWaysNamingTheOption) {
  Opts o;
  Status f = Parse({"--lanes", "9"}, &o);
  EXPECT_EQ(f.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(f.message().find("demo.lanes (--lanes) must be in [1, 8], got 9"), std::string::npos) << f;
  Opts y;
  Status l = Load("demo:\n  lanes: 9\n", &y);
  EXPECT_EQ(l.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(l.message().find("demo.lanes"), std::string::npos) << l;
  EXPECT_NE(l.message().find("[1, 8]"), std::string::npos) << l;
}

TEST(OptionTable, EnumsNumbersAndUnknownKeysAreRefused) {
  Opts o;
  Status m = Parse({"--mode", "wild"}, &o);
  EXPECT_NE(m.message().find("demo.mode (--mode) must be one of dense | sparse, got 'wild'"), std::string::npos) << m;
  Status n = Parse({"--fraction", "nan"}, &o);
  EXPECT_FALSE(n.ok());
  Status b = Parse({"--turbo", "yes"}, &o);
  EXPECT_FALSE(b.ok());
  Opts y;
  Status u = Load("demo:\n  lanez: 2\n", &y);
  EXPECT_NE(u.message().find("demo.lanez: unknown key"), std::string::npos) << u;
  Status t = Load("demo:\n  mode: 3x\n", &y);
  EXPECT_FALSE(t.ok());
}

TEST(OptionTable, RulesAcrossOptionsRunOnEveryPath) {
  Opts o;
  Status f = Parse({"--per-chunk", "3"}, &o);
  EXPECT_NE(f.message().find("demo.per_chunk (--per-chunk) must divide chunk_size (8), got 3"), std::string::npos) << f;
  Opts y;
  EXPECT_FALSE(Load("demo:\n  per_chunk: 3\n", &y).ok());
  Opts code;  // filled in code: Validate checks it the same way
  code.chunk = 6;
  code.per_chunk = 4;
  EXPECT_FALSE(Table().Validate(code).ok());
  code.per_chunk = 2;
  EXPECT_TRUE(Table().Validate(code).ok());
  code.lanes = 0;
  EXPECT_NE(Table().Validate(code).message().find("demo.lanes"), std::string::npos);
}

TEST(OptionTable, HelpAndDocsComeFromTheTable) {
  Args a;
  Table().AddFlags(a);
  const std::string help = a.Help();
  EXPECT_NE(help.find("--lanes"), std::string::npos);
  EXPECT_NE(help.find("demo: decode lanes (default 2; [1, 8])"), std::string::npos) << help;
  EXPECT_EQ(help.find("--bytes"), std::string::npos) << "a YAML-only option has no flag";
  const std::string md = Table().Markdown();
  EXPECT_NE(md.find("| `mode` | `--mode` | dense | dense \\| sparse | how |"), std::string::npos) << md;
  EXPECT_NE(md.find("| `bytes` |  | 4096 |"), std::string::npos) << md;
}

}  // namespace
}  // namespace penumbra
