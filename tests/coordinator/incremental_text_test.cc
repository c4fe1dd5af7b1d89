// IncrementalText: generated ids decoded a window at a time give, at every
// step, a prefix of what decoding all of them at once gives, and exactly that
// at the end, for byte-level BPE (qwen2), SentencePiece-style BPE with byte
// fallback (llama2) and the decode-only vocabulary of stories260K.
#include <gtest/gtest.h>

#include <stdlib.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "coordinator/tokenizer/text_codec.h"
#include "tests/test_util.h"

namespace penumbra {
namespace {

// A model directory holding only `tokenizer` as tokenizer.json.
std::string CodecDir(const std::string& tokenizer) {
  std::string dir = (std::filesystem::temp_directory_path() / "penumbra-incremental-text-XXXXXX").string();
  if (mkdtemp(dir.data()) == nullptr) return "";
  std::filesystem::remove(dir + "/tokenizer.json");
  std::filesystem::create_symlink(testing::TokenizerFile(tokenizer), dir + "/tokenizer.json");
  return dir;
}

// Mixed scripts, emoji (4-byte characters split over byte tokens), spaces
// and newlines: the cases a window must give context for.
const std::string kText =
    "Hello world!  The café's menu: 寿司 and ラーメン, 🍣🍜 for two.\n\n"
    "  Indented line\twith tab; naïve résumé — done. Ünïcödé ✓ 🚀🚀";

void ExpectIncrementalMatchesWhole(const TextCodec& codec, const std::vector<int32_t>& ids, uint64_t seed) {
  Result<std::string> whole = codec.Decode(ids);
  ASSERT_TRUE(whole.ok()) << whole.status();
  std::mt19937_64 rng(seed);
  IncrementalText t;
  size_t at = 0;
  std::string before;
  while (at < ids.size()) {
    // Chunks of 1 to 4 ids, as polls return them.
    const size_t n = std::min<size_t>(ids.size() - at, 1 + rng() % 4);
    ASSERT_TRUE(t.Append(codec, std::span<const int32_t>(ids).subspan(at, n)).ok());
    at += n;
    // Only grows, and always a prefix of the whole text.
    ASSERT_EQ(t.text().compare(0, before.size(), before), 0) << "shrank at " << at;
    ASSERT_EQ(whole->compare(0, t.text().size(), t.text()), 0) << "not a prefix at " << at << ": " << t.text();
    before = t.text();
  }
  ASSERT_TRUE(t.Finish(codec).ok());
  EXPECT_EQ(t.text(), *whole);
  EXPECT_EQ(t.size(), ids.size());
}

TEST(IncrementalText, MatchesAWholeDecodeForEachTokenizer) {
  for (const std::string name : {"qwen2", "llama2"}) {
    SCOPED_TRACE(name);
    auto codec = TextCodec::ForModel(CodecDir(name));
    ASSERT_TRUE(codec.ok()) << codec.status();
    Result<std::vector<int32_t>> ids = (*codec)->Encode(kText, /*add_special_tokens=*/false);
    ASSERT_TRUE(ids.ok()) << ids.status();
    ASSERT_GT(ids->size(), 20u);
    for (uint64_t seed = 1; seed <= 5; ++seed) ExpectIncrementalMatchesWhole(**codec, *ids, seed);
  }
}

TEST(IncrementalText, MatchesAWholeDecodeOnADecodeOnlyVocabulary) {
  auto codec = TextCodec::ForModel(testing::StoriesDir());
  ASSERT_TRUE(codec.ok()) << codec.status();
  std::vector<int32_t> ids;
  for (int i = 0; i < 300; ++i) ids.push_back(static_cast<int32_t>((i * 37 + 11) % 512));
  ExpectIncrementalMatchesWhole(**codec, ids, 7);
}

TEST(IncrementalText, AnUnknownIdIsAnError) {
  auto codec = TextCodec::ForModel(CodecDir("qwen2"));
  ASSERT_TRUE(codec.ok()) << codec.status();
  IncrementalText t;
  const std::vector<int32_t> bad = {1 << 30};
  EXPECT_FALSE(t.Append(**codec, bad).ok());
}

}  // namespace
}  // namespace penumbra
