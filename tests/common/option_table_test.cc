#include "common/option_table.h"

#include <gtest/gtest.h>

#include <chrono>
#include <limits>
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

// A program's options: flags only, in the units the flags give (seconds as a
// duration, MiB as bytes), some "not given" by default.
struct Process {
  std::string host = "127.0.0.1";
  std::string port_file;
  std::chrono::milliseconds lease{30000};
  std::chrono::milliseconds abandon{std::chrono::seconds(120)};
  size_t cache_bytes = size_t{64} << 20;
  int64_t seed = -1;
  double idle_seconds = 120;
};

const OptionTable<Process>& ProcessTable() {
  static const auto* t =
      &(*new OptionTable<Process>("proc"))
           .String(&Process::host, "host", "", "HOST", "where to listen")
           .String(&Process::port_file, "port-file", "", "FILE", "the port, once serving")
           .Unset("", "none")
           .Duration(&Process::lease, "lease-ms", "", 100, 86400000, "a lease")
           .Duration(&Process::abandon, "abandon-s", "", 1, 600, "abandoned after", std::chrono::seconds{})
           .MiB(&Process::cache_bytes, "cache-mb", "", 1, 1024, "the cache")
           .Int(&Process::seed, "seed", "", int64_t{0}, int64_t{1} << 40, "random weights")
           .Unset("-1", "off")
           .Double(&Process::idle_seconds, "idle-seconds", "", 0, std::numeric_limits<double>::infinity(), "idle",
                   /*min_open=*/true);
  return *t;
}

Status ParseProcess(const std::vector<std::string>& flags, Process* o) {
  Args a;
  ProcessTable().AddFlags(a);
  std::vector<std::string> argv = {"tool"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  std::vector<char*> p;
  for (std::string& s : argv) p.push_back(s.data());
  PENUMBRA_RETURN_IF_ERROR(a.Parse(static_cast<int>(p.size()), p.data(), 1));
  return ProcessTable().ApplyFlags(a, o);
}

TEST(OptionTable, FlagsInOtherUnitsThanTheStructs) {
  Process o;
  ASSERT_TRUE(ParseProcess({}, &o).ok());
  EXPECT_EQ(o.lease.count(), 30000);
  EXPECT_EQ(o.seed, -1) << "not given";
  Status s = ParseProcess({"--lease-ms", "250", "--abandon-s", "7", "--cache-mb", "3", "--seed", "0", "--host",
                           "0.0.0.0", "--port-file", "/tmp/p", "--idle-seconds", "0.5"},
                          &o);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(o.lease.count(), 250);
  EXPECT_EQ(o.abandon.count(), 7000);
  EXPECT_EQ(o.cache_bytes, size_t{3} << 20);
  EXPECT_EQ(o.seed, 0);
  EXPECT_EQ(o.host, "0.0.0.0");
  EXPECT_EQ(o.port_file, "/tmp/p");
  EXPECT_DOUBLE_EQ(o.idle_seconds, 0.5);
}

TEST(OptionTable, RangesInTheFlagsUnits) {
  Process o;
  Status a = ParseProcess({"--abandon-s", "601"}, &o);
  EXPECT_NE(a.message().find("--abandon-s must be in [1, 600], got 601"), std::string::npos) << a;
  Process m;
  Status b = ParseProcess({"--cache-mb", "0"}, &m);
  EXPECT_NE(b.message().find("--cache-mb must be in [1, 1024], got 0"), std::string::npos) << b;
  Process i;
  Status c = ParseProcess({"--idle-seconds", "0"}, &i);
  EXPECT_NE(c.message().find("--idle-seconds must be in (0, inf], got 0"), std::string::npos) << c;
  Process n;
  EXPECT_FALSE(ParseProcess({"--seed", "-1"}, &n).ok()) << "the unset value is not a value one may give";
  Process l;
  EXPECT_FALSE(ParseProcess({"--lease-ms", "99"}, &l).ok());
  // Refused before it is stored: in bytes it would wrap around.
  Process w;
  Status big = ParseProcess({"--cache-mb", "17592186044417"}, &w);
  EXPECT_NE(big.message().find("--cache-mb must be in [1, 1024], got 17592186044417"), std::string::npos) << big;
  EXPECT_EQ(w.cache_bytes, size_t{64} << 20);
}

TEST(OptionTable, AProgramsTableDocumentsFlagsOnly) {
  const std::string md = ProcessTable().Markdown();
  EXPECT_EQ(md.find("key"), std::string::npos) << md;
  EXPECT_NE(md.find("| flag | default | range | what |\n|---|---|---|---|\n"), std::string::npos) << md;
  EXPECT_NE(md.find("| `--abandon-s` | 120 | [1, 600] | abandoned after |"), std::string::npos) << md;
  EXPECT_NE(md.find("| `--cache-mb` | 64 | [1, 1024] | the cache |"), std::string::npos) << md;
  EXPECT_NE(md.find("| `--seed` | off | [0, 1099511627776] | random weights |"), std::string::npos) << md;
  EXPECT_NE(md.find("| `--port-file` | none | FILE | the port, once serving |"), std::string::npos) << md;
  EXPECT_NE(md.find("| `--host` | 127.0.0.1 | HOST | where to listen |"), std::string::npos) << md;
  Args a;
  ProcessTable().AddFlags(a);
  EXPECT_NE(a.Help().find("proc: random weights (default off; [0, 1099511627776])"), std::string::npos) << a.Help();
}

}  // namespace
}  // namespace penumbra
