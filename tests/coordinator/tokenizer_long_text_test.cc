// Long inputs: ~200 KB of mixed text must encode (the BPE is O(n log n) per
// pre-token with a per-call cache) and decode back to itself. Only
// correctness is asserted; speed is for benchmarks.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "coordinator/tokenizer/tokenizer.h"
#include "tests/test_util.h"

namespace penumbra {
namespace {

// Deterministic mixed text: prose, code, numbers, CJK, emoji, long whitespace.
std::string MakeText(size_t bytes) {
  static const char* kParts[] = {
      "The quick brown fox jumps over the lazy dog. ",
      "def f(x):\n    return x * 2  # comment\n\n",
      "3.14159265358979 and 1234567890123 ",
      "\xE4\xBD\xA0\xE5\xA5\xBD\xEF\xBC\x8C\xE4\xB8\x96\xE7\x95\x8C\xE3\x80\x82",  // 你好，世界。
      "\xF0\x9F\x98\x80\xF0\x9F\xA6\x99 caf\xC3\xA9 na\xC3\xAFve ",
      "\t\t  \n   \n",
      "<|im_start|>user\nhello<|im_end|>\n",
      "don't WE'LL they're ",
  };
  std::string s;
  uint32_t state = 12345;
  while (s.size() < bytes) {
    state = state * 1103515245u + 12345u;
    s += kParts[(state >> 16) % (sizeof(kParts) / sizeof(kParts[0]))];
  }
  return s;
}

void RoundTrip(const std::string& name, const std::string& text) {
  auto tok = Tokenizer::FromFile(testing::TokenizerFile(name));
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto ids = (*tok)->Encode(text, false);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_GT(ids->size(), text.size() / 10);
  EXPECT_LT(ids->size(), text.size());
  auto back = (*tok)->Decode(*ids, false);
  ASSERT_TRUE(back.ok()) << back.status();
  const std::string& want = text;
  if (*back != want) {
    size_t i = 0;
    while (i < back->size() && i < want.size() && (*back)[i] == want[i]) ++i;
    FAIL() << name << ": round trip differs at byte " << i << " of " << want.size() << " (decoded " << back->size()
           << " bytes)";
  }
}

TEST(TokenizerLongText, Qwen2RoundTrip200KB) { RoundTrip("qwen2", MakeText(200 * 1024)); }

TEST(TokenizerLongText, Llama2RoundTrip200KB) {
  // Metaspace with split=false makes the whole text one BPE word: this is the
  // worst case for the merge queue.
  RoundTrip("llama2", MakeText(200 * 1024));
}

TEST(TokenizerLongText, LongWhitespaceRun) {
  auto tok = Tokenizer::FromFile(testing::TokenizerFile("qwen2"));
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::string text = "a" + std::string(100000, ' ') + "b" + std::string(50000, '\n');
  auto ids = (*tok)->Encode(text, false);
  ASSERT_TRUE(ids.ok()) << ids.status();
  auto back = (*tok)->Decode(*ids, false);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, text);
}

}  // namespace
}  // namespace penumbra
