// ChatTemplate: every case of tests/data/chat_templates/goldens.json (rendered
// by Python's jinja2 the way transformers' apply_chat_template renders, see
// make_goldens.py) comes out byte for byte the same, or fails with the
// expected error; errors name line:column; the limits turn hostile templates
// and contexts into errors (no crash, hang or runaway memory); the API keeps
// the client's key order and renders concurrently.
#include "coordinator/openai/chat_template.h"

#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace penumbra::openai {
namespace {

using nlohmann::ordered_json;
using Clock = std::chrono::system_clock;

std::string DataDir() {
  std::string dir = "tests/data/chat_templates/";
  if (std::ifstream(dir + "goldens.json").good()) return dir;
  const char* src = std::getenv("PENUMBRA_SOURCE_DIR");
  return src ? std::string(src) + "/" + dir : dir;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << "cannot read " << path;
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

const ordered_json& Goldens() {
  static const ordered_json g = ordered_json::parse(ReadFile(DataDir() + "goldens.json"));
  return g;
}

Clock::time_point GoldenNow() {
  return Clock::time_point(std::chrono::seconds(Goldens()["now_unix_seconds"].get<int64_t>()));
}

std::string SourceOf(const ordered_json& c) {
  return c.contains("template") ? ReadFile(DataDir() + c["template"].get<std::string>())
                                : c["source"].get<std::string>();
}

// "first difference at byte N: ...got... vs ...want..." for long outputs.
std::string FirstDifference(const std::string& got, const std::string& want) {
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  size_t from = i < 40 ? 0 : i - 40;
  return "first difference at byte " + std::to_string(i) + ":\n got: " + ordered_json(got.substr(from, 80)).dump() +
         "\nwant: " + ordered_json(want.substr(from, 80)).dump();
}

Result<std::string> RenderSource(std::string_view source, const ordered_json& context = ordered_json::object(),
                                 ChatTemplateLimits limits = {}, Clock::time_point now = Clock::time_point()) {
  Result<ChatTemplate> t = ChatTemplate::Parse(source, limits);
  if (!t.ok()) return t.status();
  return t->Render(context, now);
}

TEST(ChatTemplateGoldenTest, MatchesJinja2ByteForByte) {
  const ordered_json& cases = Goldens()["cases"];
  ASSERT_GE(cases.size(), 40u);
  int errors = 0;
  for (const ordered_json& c : cases) {
    SCOPED_TRACE("case " + c["name"].get<std::string>());
    ChatTemplateLimits limits;
    if (c.contains("limits")) {
      const ordered_json& l = c["limits"];
      limits.max_output_bytes = l.value("max_output_bytes", limits.max_output_bytes);
      limits.max_steps = l.value("max_steps", limits.max_steps);
      limits.max_depth = l.value("max_depth", limits.max_depth);
    }
    Result<std::string> out = RenderSource(SourceOf(c), c["context"], limits, GoldenNow());
    if (c.contains("error")) {
      ++errors;
      ASSERT_FALSE(out.ok()) << "rendered " << *out;
      EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument) << out.status();
      EXPECT_NE(out.status().message().find(c["error"].get<std::string>()), std::string::npos)
          << out.status() << "\nwant the substring: " << c["error"].get<std::string>();
    } else {
      ASSERT_TRUE(out.ok()) << out.status();
      const std::string want = c["expected"].get<std::string>();
      EXPECT_TRUE(*out == want) << FirstDifference(*out, want);
    }
  }
  EXPECT_GE(errors, 10);
}

TEST(ChatTemplateTest, ErrorsNameLineAndColumn) {
  Result<std::string> r = RenderSource("{% if x %}\n  {{ 1 + }}\n{% endif %}");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "chat template 2:10: unexpected end of print statement '}}', expected an expression");
  r = RenderSource("héllo {{ raise_exception('no ' ~ 'way') }}");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "chat template 1:10: raise_exception: no way");
  r = RenderSource("{% for m in messages %}\n{{ m.content.x.y }}{% endfor %}", {{"messages", {{{"role", "user"}}}}});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "chat template 2:13: 'dict object' has no attribute 'content'");
  r = RenderSource("{% for x in xs %}\n{% endif %}");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(),
            "chat template 2:4: unexpected 'endif', expected 'else' or 'endfor' to close the 'for' at 1:4");
  r = RenderSource("ok \xff");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "chat template 1:4: the template is not valid UTF-8");
}

TEST(ChatTemplateTest, KeepsTheClientsKeyOrderWithOrderedJson) {
  Result<ChatTemplate> t = ChatTemplate::Parse("{{ d | tojson }} {% for k in d %}{{ k }}{% endfor %}");
  ASSERT_TRUE(t.ok()) << t.status();
  const char* body = R"({"d": {"b": 1, "a": {"z": true, "c": null}}})";
  Result<std::string> ordered = t->Render(ordered_json::parse(body), Clock::now());
  ASSERT_TRUE(ordered.ok()) << ordered.status();
  EXPECT_EQ(*ordered, R"({"b": 1, "a": {"z": true, "c": null}} ba)");
  Result<std::string> sorted = t->Render(nlohmann::json::parse(body), Clock::now());
  ASSERT_TRUE(sorted.ok()) << sorted.status();
  EXPECT_EQ(*sorted, R"({"a": {"c": null, "z": true}, "b": 1} ab)");
}

TEST(ChatTemplateTest, StrftimeNowFormatsTheGivenInstantInUtc) {
  // 2001-02-03 04:05:06 UTC.
  Clock::time_point now = Clock::time_point(std::chrono::seconds(981173106));
  Result<std::string> r =
      RenderSource("{{ strftime_now('%Y-%m-%d %H:%M:%S %a %d %B') }}", ordered_json::object(), {}, now);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, "2001-02-03 04:05:06 Sat 03 February");
}

TEST(ChatTemplateTest, RefusesBadLimitsAndContexts) {
  ChatTemplateLimits limits;
  limits.max_steps = 0;
  Result<ChatTemplate> t = ChatTemplate::Parse("x", limits);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(), "ChatTemplateLimits.max_steps must be positive");
  t = ChatTemplate::Parse("x");
  ASSERT_TRUE(t.ok());
  Result<std::string> r = t->Render(ordered_json::array(), Clock::now());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "chat template: the context must be a JSON object");
}

// Each of these must fail with a clear error under the default limits,
// quickly and without exhausting the stack or memory.
TEST(ChatTemplateTest, HostileTemplatesFailCleanly) {
  const int n = 100000;
  auto repeat = [](std::string_view s, int times) {
    std::string out;
    for (int k = 0; k < times; ++k) out += s;
    return out;
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{{ " + repeat("(", n) + "1" + repeat(")", n) + " }}", "max_depth"},
      {"{{ " + repeat("[", n) + repeat("]", n) + " }}", "max_depth"},
      {"{{ " + repeat("not ", n) + "1 }}", "max_depth"},
      {"{{ " + repeat("-", n) + "1 }}", "max_depth"},
      {"{{ x" + repeat("|trim", n) + " }}", "max_depth"},
      {"{{ x" + repeat(".a", n) + " }}", "max_depth"},
      {"{{ 1" + repeat(" if 1 else 1", n) + " }}", "max_depth"},
      {repeat("{% if true %}", n) + repeat("{% endif %}", n), "max_depth"},
      {"{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}", "max_depth"},
      {"{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}", "a namespace cannot contain itself"},
      {"{% set a = namespace() %}{% set b = namespace(x=[a]) %}{% set a.y = {'k': b} %}",
       "a namespace cannot contain itself"},
      {"{% for i in range(100000) %}{% for j in range(100) %}{% macro m() %}{% endmacro %}{% set n = namespace(m=m) %}"
       "{% endfor %}{% endfor %}",
       "max_steps"},
      {"{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}{% endfor %}", "max_depth"},
      {"{% set ns = namespace(c=none) %}{% for i in range(100000) %}{% set x = namespace() %}{% set x.p = ns.c %}"
       "{% set ns.c = x %}{% endfor %}{{ ns.c }}",
       "max_depth"},
      {"{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "max_steps"},
      {"{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
       "max_output_bytes"},
      {"{{ 'ab' * 100000000000 }}", "max_output_bytes"},
      {"{{ [1] * 100000000000 }}", "max_output_bytes"},
      {"{% for i in range(100000) %}{{ range(100000) }}{% endfor %}", "max_"},
      {"{{ 2 ** 100 }}", "integer overflow"},
      {"{{ strftime_now('%c' * 1000000) }}", "max_output_bytes"},
  };
  for (const auto& [source, error] : cases) {
    SCOPED_TRACE(source.substr(0, 80));
    Result<std::string> r = RenderSource(source, {{"x", "y"}});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(error), std::string::npos) << r.status();
  }
  ordered_json context = ordered_json::object();  // nested 1000 deep (nlohmann copies recursively: move it)
  ordered_json* leaf = &context["x"];
  for (int k = 0; k < 1000; ++k) leaf = &(*leaf)[0];
  *leaf = 1;
  Result<std::string> r = RenderSource("{{ x }}", context);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "chat template: the context nests deeper than max_depth (256)");
}

// Random edits of the golden templates (cut, duplicate, splice in syntax):
// whatever comes out must be an output or an InvalidArgument, never a crash.
TEST(ChatTemplateTest, MutatedTemplatesFailCleanly) {
  const ordered_json& cases = Goldens()["cases"];
  std::vector<std::string> sources;
  for (const ordered_json& c : cases) sources.push_back(SourceOf(c));
  const std::vector<std::string> snippets = {"{%",
                                             "%}",
                                             "{{",
                                             "}}",
                                             "{#",
                                             "#}",
                                             "-",
                                             "+",
                                             "(",
                                             ")",
                                             "[",
                                             "]",
                                             "'",
                                             "\"",
                                             "|",
                                             ".",
                                             ",",
                                             " if ",
                                             " else ",
                                             " in ",
                                             "{% endfor %}",
                                             "{% for x in messages %}",
                                             "{% set ns.a = ns %}",
                                             "|tojson",
                                             "loop.",
                                             "{% macro m(a) %}{{ m(a) }}{% endmacro %}{{ m(1) }}",
                                             "\xff",
                                             "\\"};
  std::mt19937 rng(20240726);
  ChatTemplateLimits limits;
  limits.max_steps = 200000;
  limits.max_output_bytes = 1 << 20;
  int rendered = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string s = sources[rng() % sources.size()];
    for (int edits = 1 + static_cast<int>(rng() % 3); edits > 0 && !s.empty(); --edits) {
      size_t at = rng() % s.size(), len = std::min<size_t>(rng() % 16, s.size() - at);
      switch (rng() % 3) {
        case 0:
          s.erase(at, len);
          break;
        case 1:
          s.insert(at, s.substr(at, len));
          break;
        default:
          s.insert(at, snippets[rng() % snippets.size()]);
      }
    }
    const ordered_json& context = cases[rng() % cases.size()]["context"];
    Result<std::string> r = RenderSource(s, context, limits);
    if (r.ok()) {
      ++rendered;
    } else {
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
    }
  }
  EXPECT_GT(rendered, 0);
}

TEST(ChatTemplateTest, RendersConcurrently) {
  const ordered_json* golden = nullptr;
  for (const ordered_json& c : Goldens()["cases"]) {
    if (c["name"] == "chatml_tools") golden = &c;
  }
  ASSERT_NE(golden, nullptr);
  Result<ChatTemplate> t = ChatTemplate::Parse(SourceOf(*golden));
  ASSERT_TRUE(t.ok()) << t.status();
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      ChatTemplate copy = *t;
      for (int i = 0; i < 50; ++i) {
        Result<std::string> r = copy.Render((*golden)["context"], GoldenNow());
        mismatches[k] += !r.ok() || *r != (*golden)["expected"].get<std::string>();
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

}  // namespace
}  // namespace penumbra::openai
