// Exact parity with the Hugging Face `tokenizers` library: every line of
// tests/data/tokenizer/<name>_golden.jsonl holds a text and what `tokenizers`
// returned for it (see tests/tools/make_tokenizer_goldens.py, run on the GPU
// machine where the library is installed). Every id must match.
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "coordinator/tokenizer/tokenizer.h"
#include "tests/test_util.h"

namespace penumbra {
namespace {

using Ids = std::vector<int32_t>;

std::string Show(const Ids& ids) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ids.size(); ++i) os << (i ? ", " : "") << ids[i];
  os << "]";
  return os.str();
}

// Index of the first difference, or the shorter length.
size_t FirstDiff(const Ids& a, const Ids& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return i;
}

void CheckGolden(const std::string& name) {
  const std::string golden = testing::SourceDir() + "/tests/data/tokenizer/" + name + "_golden.jsonl";
  std::ifstream in(golden);
  ASSERT_TRUE(in.good()) << golden << " does not exist. Generate it on a machine with the `tokenizers` "
                         << "Python package: python3 tests/tools/make_tokenizer_goldens.py "
                         << "build/test_data/tokenizers tests/data/tokenizer";
  auto tok = Tokenizer::FromFile(testing::TokenizerFile(name));
  ASSERT_TRUE(tok.ok()) << tok.status();

  std::string line;
  size_t line_no = 0, checked = 0, failures = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    ASSERT_FALSE(j.is_discarded()) << golden << ":" << line_no << ": not JSON";
    const std::string text = j.at("text").get<std::string>();
    const Ids want = j.at("ids").get<Ids>();
    const Ids want_special = j.at("ids_special").get<Ids>();
    const std::string want_decoded = j.at("decoded").get<std::string>();
    const std::string where = golden + ":" + std::to_string(line_no) + " text " + nlohmann::json(text).dump();

    auto got = (*tok)->Encode(text, false);
    ASSERT_TRUE(got.ok()) << where << ": " << got.status();
    if (*got != want) {
      ++failures;
      const size_t d = FirstDiff(*got, want);
      ADD_FAILURE() << where << "\n  ids differ first at index " << d << "\n  got  " << Show(*got) << "\n  want "
                    << Show(want);
    }
    auto got_special = (*tok)->Encode(text, true);
    ASSERT_TRUE(got_special.ok()) << where << ": " << got_special.status();
    if (*got_special != want_special) {
      ++failures;
      ADD_FAILURE() << where << "\n  ids_special differ\n  got  " << Show(*got_special) << "\n  want "
                    << Show(want_special);
    }
    auto decoded = (*tok)->Decode(want, false);
    ASSERT_TRUE(decoded.ok()) << where << ": " << decoded.status();
    if (*decoded != want_decoded) {
      ++failures;
      ADD_FAILURE() << where << "\n  decoded " << nlohmann::json(*decoded).dump() << "\n  want    "
                    << nlohmann::json(want_decoded).dump();
    }
    ++checked;
    ASSERT_LT(failures, 20u) << "stopping after 20 mismatches";
  }
  EXPECT_GE(checked, 100u) << golden << " holds too few lines";
  EXPECT_EQ(failures, 0u) << failures << " mismatches over " << checked << " lines of " << golden;
}

TEST(TokenizerGolden, Qwen2) { CheckGolden("qwen2"); }
TEST(TokenizerGolden, Llama2) { CheckGolden("llama2"); }

}  // namespace
}  // namespace penumbra
