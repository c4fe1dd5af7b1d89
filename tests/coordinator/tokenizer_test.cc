// Tokenizer unit tests: ids worked out by hand from the vocabularies of the
// Qwen2 / Llama-2 files shipped in tests/data/tokenizer/ and of small synthetic tokenizer.json files,
// plus every error path. Exact parity over hundreds of strings is checked by
// tokenizer_golden_test.cc against `tokenizers` itself.
#include "coordinator/tokenizer/tokenizer.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "coordinator/tokenizer/regex.h"
#include "tests/test_util.h"

namespace penumbra {
namespace {

using Ids = std::vector<int32_t>;

// The shipped Qwen2 / Llama-2 tokenizers, loaded once per process. A
// tokenizer that fails to load stays null; the fixtures below then fail each
// test with the load error (one line naming the file) instead of aborting.
const Tokenizer* LoadShared(const std::string& name, Status* error) {
  auto t = Tokenizer::FromFile(testing::TokenizerFile(name));
  if (!t.ok()) {
    *error = t.status();
    return nullptr;
  }
  return std::move(t).value().release();
}

struct SharedTokenizer {
  const Tokenizer* tokenizer = nullptr;
  Status error;
};

const SharedTokenizer& Shared(const std::string& name) {
  static std::map<std::string, SharedTokenizer>* loaded = new std::map<std::string, SharedTokenizer>;
  auto it = loaded->find(name);
  if (it == loaded->end()) {
    SharedTokenizer s;
    s.tokenizer = LoadShared(name, &s.error);
    it = loaded->emplace(name, s).first;
  }
  return it->second;
}

const Tokenizer& Qwen2() { return *Shared("qwen2").tokenizer; }
const Tokenizer& Llama2() { return *Shared("llama2").tokenizer; }

// Fixtures of the tests that use a shipped tokenizer: SetUp fails the test
// when it did not load, so the body never dereferences a missing one.
class SharedTokenizerTest : public ::testing::Test {
 protected:
  explicit SharedTokenizerTest(std::string name) : name_(std::move(name)) {}
  void SetUp() override {
    const SharedTokenizer& s = Shared(name_);
    ASSERT_NE(s.tokenizer, nullptr) << s.error;
  }

 private:
  std::string name_;
};
class TokenizerLlama2 : public SharedTokenizerTest {
 protected:
  TokenizerLlama2() : SharedTokenizerTest("llama2") {}
};
class TokenizerQwen2 : public SharedTokenizerTest {
 protected:
  TokenizerQwen2() : SharedTokenizerTest("qwen2") {}
};
class TokenizerErrorsShared : public TokenizerQwen2 {};

Ids Enc(const Tokenizer& t, std::string_view s, bool special = false) {
  auto r = t.Encode(s, special);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : Ids{};
}

std::string Dec(const Tokenizer& t, const Ids& ids, bool skip = false) {
  auto r = t.Decode(ids, skip);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : std::string();
}

// ---- Llama-2 (SentencePiece-style BPE with byte fallback) --------------------
TEST_F(TokenizerLlama2, HelloWorld) {
  const Tokenizer& t = Llama2();
  EXPECT_EQ(Enc(t, "Hello world"), (Ids{15043, 3186}));
  // This tokenizer.json's TemplateProcessing adds nothing, so `tokenizers`
  // gives the same ids with add_special_tokens; BOS is available as bos_id().
  EXPECT_EQ(Enc(t, "Hello world", true), (Ids{15043, 3186}));
  EXPECT_EQ(t.bos_id(), 1);
  EXPECT_EQ(t.eos_ids(), (Ids{2}));
  EXPECT_EQ(t.vocab_size(), 32000);
  EXPECT_EQ(Dec(t, {1, 15043, 3186}), "<s> Hello world");
  EXPECT_EQ(Dec(t, {1, 15043, 3186}, /*skip=*/true), "Hello world");
}

TEST_F(TokenizerLlama2, SpecialTokensInText) {
  const Tokenizer& t = Llama2();
  // "<s>" is cut out before the Metaspace pre-tokenizer; every remaining
  // piece gets its own "▁" (prepend_scheme "always").
  EXPECT_EQ(Enc(t, "<s>Hello"), (Ids{1, 15043}));
  EXPECT_EQ(Enc(t, "Hello</s>"), (Ids{15043, 2}));
  EXPECT_EQ(Enc(t, "<s>"), (Ids{1}));
}

TEST_F(TokenizerLlama2, ByteFallback) {
  const Tokenizer& t = Llama2();
  // U+1F999 is not in the vocabulary: "▁" then its four UTF-8 bytes.
  const Ids ids = Enc(t, "\xF0\x9F\xA6\x99");
  EXPECT_EQ(ids, (Ids{29871, 243, 162, 169, 156}));
  EXPECT_EQ(Dec(t, ids), "\xF0\x9F\xA6\x99");
  // A lone continuation byte token decodes to U+FFFD, as in `tokenizers`.
  EXPECT_EQ(Dec(t, {162}), "\xEF\xBF\xBD");
  EXPECT_EQ(Dec(t, {243, 162}), "\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST_F(TokenizerLlama2, LeadingSpacesAndEmpty) {
  const Tokenizer& t = Llama2();
  EXPECT_EQ(Enc(t, ""), Ids{});
  EXPECT_EQ(Enc(t, "", true), Ids{});
  // " Hello" already starts with "▁" after the replace: no second one.
  EXPECT_EQ(Enc(t, " Hello"), (Ids{15043}));
  // "▁▁Hello": the "▁ ▁" merge has rank 0, so it wins over "▁H...".
  EXPECT_EQ(Enc(t, "  Hello"), (Ids{259, 10994}));
}

// ---- Qwen2 (byte-level BPE with a split regex) --------------------------------
TEST_F(TokenizerQwen2, HelloWorld) {
  const Tokenizer& t = Qwen2();
  EXPECT_EQ(Enc(t, "Hello world"), (Ids{9707, 1879}));
  EXPECT_EQ(Enc(t, "Hello world", true), (Ids{9707, 1879}));  // no post-processor
  EXPECT_EQ(Dec(t, {9707, 1879}), "Hello world");
  EXPECT_EQ(t.vocab_size(), 151665);
  EXPECT_EQ(t.bos_id(), std::nullopt);
  EXPECT_EQ(t.eos_ids(), (Ids{151645}));
  EXPECT_EQ(t.TokenToId("<|im_start|>"), 151644);
  EXPECT_EQ(t.TokenToId("Hello"), 9707);
  EXPECT_EQ(t.IdToToken(151643), "<|endoftext|>");
  EXPECT_TRUE(t.IsSpecial(151643));
  EXPECT_FALSE(t.IsSpecial(151657));  // <tool_call> is added but not special
}

TEST_F(TokenizerQwen2, ChatMarkup) {
  const Tokenizer& t = Qwen2();
  const Ids ids = Enc(t, "<|im_start|>user\nHi<|im_end|>");
  EXPECT_EQ(ids, (Ids{151644, 872, 198, 13048, 151645}));
  EXPECT_EQ(Dec(t, ids), "<|im_start|>user\nHi<|im_end|>");
  EXPECT_EQ(Dec(t, ids, /*skip=*/true), "user\nHi");
}

TEST_F(TokenizerQwen2, DigitsAndSpaces) {
  const Tokenizer& t = Qwen2();
  EXPECT_EQ(Enc(t, "12"), (Ids{16, 17}));  // \p{N} one digit at a time
  // "a  b": "a", " " (\s+(?!\S) backs off one space), " b".
  EXPECT_EQ(Enc(t, "a  b"), (Ids{64, 220, 293}));
}

TEST_F(TokenizerQwen2, NfcBeforeBpe) {
  const Tokenizer& t = Qwen2();
  // "e" + U+0301 is composed to U+00E9 before tokenization.
  EXPECT_EQ(Enc(t, "e\xCC\x81"), Enc(t, "\xC3\xA9"));
  EXPECT_EQ(Enc(t, "\xC3\xA9"), (Ids{963}));
}

// ---- synthetic files: the rules the two shared files do not exercise ---------
// Byte-level vocabulary: id == byte value for the 256 alphabet characters.
std::string ByteLevelJson(const std::string& extra_model_fields, const std::string& added,
                          const std::string& pre_tokenizer, const std::string& post_processor) {
  // The GPT-2 alphabet, written as JSON escapes.
  std::string vocab;
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const int cp = printable ? b : next++;
    char buf[32];
    std::snprintf(buf, sizeof(buf), "\"\\u%04x\": %d,", cp, b);
    vocab += buf;
  }
  vocab += R"("he": 256, "ll": 257, "hell": 258, "hello": 259, "\u0120h": 260, "ab": 261)";
  return R"({"version": "1.0", "added_tokens": [)" + added + R"(], "normalizer": null,
    "pre_tokenizer": )" +
         pre_tokenizer + R"(, "post_processor": )" + post_processor + R"(,
    "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "fuse_unk": false, "byte_fallback": false, )" +
         extra_model_fields + R"(
      "vocab": {)" +
         vocab + R"(},
      "merges": ["h e", "l l", "he ll", "hell o", "\u0120 h"]}})";
}

constexpr const char* kGpt2PreTokenizer =
    R"({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true})";

std::unique_ptr<Tokenizer> Load(const std::string& json) {
  auto t = Tokenizer::FromJsonString(json, "synthetic.json");
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(t).value() : nullptr;
}

TEST(TokenizerSynthetic, ByteLevelRegexPrefixSpaceAndMergeOrder) {
  auto t = Load(ByteLevelJson("", "", kGpt2PreTokenizer, "null"));
  ASSERT_NE(t, nullptr);
  // " hello": the queued "Ġ h" (rank 4) goes stale once h..o merged first.
  EXPECT_EQ(Enc(*t, "hello"), (Ids{32, 259}));
  EXPECT_EQ(Enc(*t, " hello"), (Ids{32, 259}));
  EXPECT_EQ(Dec(*t, {32, 259}), " hello");
  // "ab" is in the vocabulary but no merge builds it.
  EXPECT_EQ(Enc(*t, "ab"), (Ids{32, 97, 98}));
}

TEST(TokenizerSynthetic, IgnoreMerges) {
  auto t = Load(ByteLevelJson(R"("ignore_merges": true,)", "",
                              R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})", "null"));
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(Enc(*t, "ab"), (Ids{261}));
  EXPECT_EQ(Enc(*t, "hello"), (Ids{259}));
}

TEST(TokenizerSynthetic, AddedTokenFlags) {
  const std::string added =
      R"({"id": 300, "content": "<|x|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
         {"id": 301, "content": "[M]", "single_word": false, "lstrip": true, "rstrip": true, "normalized": false, "special": false},
         {"id": 302, "content": "tok", "single_word": true, "lstrip": false, "rstrip": false, "normalized": true, "special": false})";
  auto t = Load(ByteLevelJson("", added, kGpt2PreTokenizer, "null"));
  ASSERT_NE(t, nullptr);
  // Every piece between added tokens gets its own prefix space.
  EXPECT_EQ(Enc(*t, "a<|x|>b"), (Ids{32, 97, 300, 32, 98}));
  // lstrip/rstrip swallow the spaces around [M].
  EXPECT_EQ(Enc(*t, "x [M] y"), (Ids{32, 120, 301, 32, 121}));
  // single_word: "tok" inside "tokens" is not a match.
  EXPECT_EQ(Enc(*t, "tok tokens"), (Ids{302, 32, 116, 111, 107, 101, 110, 115}));
  EXPECT_EQ(Dec(*t, {300, 32, 97}), "<|x|> a");
  EXPECT_EQ(Dec(*t, {300, 32, 97}, /*skip=*/true), " a");
  EXPECT_EQ(t->eos_ids(), Ids{});
  EXPECT_EQ(t->bos_id(), std::nullopt);
  EXPECT_EQ(t->vocab_size(), 303);
}

TEST(TokenizerSynthetic, TemplateProcessingAddsBos) {
  const std::string added =
      R"({"id": 300, "content": "<|x|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true})";
  const std::string post = R"({"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<|x|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
      "pair": [], "special_tokens": {"<|x|>": {"id": "<|x|>", "ids": [300], "tokens": ["<|x|>"]}}})";
  auto t = Load(ByteLevelJson("", added, kGpt2PreTokenizer, post));
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(Enc(*t, "hello", true), (Ids{300, 32, 259}));
  EXPECT_EQ(Enc(*t, "hello", false), (Ids{32, 259}));
  EXPECT_EQ(Enc(*t, "", true), (Ids{300}));
  EXPECT_EQ(t->bos_id(), 300);
}

std::string MetaspaceJson(const std::string& scheme, bool fuse_unk) {
  return R"({"added_tokens": [{"id": 1, "content": "<s>", "special": true, "normalized": false}],
    "normalizer": null,
    "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": ")" +
         scheme +
         R"(", "split": false},
    "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": ")" +
         scheme + R"(", "split": false},
    "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": )" +
         (fuse_unk ? "true" : "false") + R"(,
      "byte_fallback": false,
      "vocab": {"<unk>": 0, "<s>": 1, "\u2581": 2, "a": 3, "\u2581a": 4},
      "merges": [["\u2581", "a"]]}})";
}

TEST(TokenizerSynthetic, MetaspacePrependFirstAndUnk) {
  auto first = Load(MetaspaceJson("first", true));
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(Enc(*first, "a<s>a"), (Ids{4, 1, 3}));
  EXPECT_EQ(Enc(*first, "aZZa"), (Ids{4, 0, 3}));  // fused unk
  EXPECT_EQ(Dec(*first, {4, 1, 3}), "a<s>a");
  auto always = Load(MetaspaceJson("always", false));
  ASSERT_NE(always, nullptr);
  EXPECT_EQ(Enc(*always, "a<s>a"), (Ids{4, 1, 4}));
  EXPECT_EQ(Enc(*always, "aZZa"), (Ids{4, 0, 0, 3}));  // one unk per char
}

TEST(TokenizerSynthetic, LegacyLlamaNormalizerForm) {
  // Older Llama-2 files: Prepend + Replace normalizer instead of Metaspace.
  const std::string json = R"({"added_tokens": [{"id": 1, "content": "<s>", "special": true, "normalized": false}],
    "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                   {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
    "pre_tokenizer": null,
    "post_processor": {"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
      "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
    "decoder": {"type": "Sequence", "decoders": [
      {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
      {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "unk_token": "<unk>", "byte_fallback": true,
      "vocab": {"<unk>": 0, "<s>": 1, "\u2581": 2, "a": 3, "\u2581a": 4, "<0x62>": 5},
      "merges": ["\u2581 a"]}})";
  auto t = Load(json);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(Enc(*t, "a a", true), (Ids{1, 4, 4}));
  EXPECT_EQ(Enc(*t, "ab"), (Ids{4, 5}));  // "b" by byte fallback
  EXPECT_EQ(Dec(*t, {1, 4, 4}, true), "a a");
  EXPECT_EQ(Dec(*t, {4, 5}), "ab");
  EXPECT_EQ(t->bos_id(), 1);
}

// ---- errors -------------------------------------------------------------------
class TokenizerErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("penumbra_tokenizer_test_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }
  std::filesystem::path dir_;
};

TEST_F(TokenizerErrors, MissingFile) {
  const std::string path = (dir_ / "nope.json").string();
  auto t = Tokenizer::FromFile(path);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  EXPECT_NE(t.status().message().find(path), std::string::npos) << t.status();
}

TEST_F(TokenizerErrors, MalformedJson) {
  const std::string path = Write("tokenizer.json", R"({"model": {"type": "BPE", "vocab": {)");
  auto t = Tokenizer::FromFile(path);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find(path), std::string::npos) << t.status();
  EXPECT_NE(t.status().message().find("malformed JSON"), std::string::npos) << t.status();
}

TEST_F(TokenizerErrors, UnsupportedModelType) {
  const std::string path = Write("tokenizer.json", R"({"model": {"type": "WordPiece", "vocab": {"a": 0}}})");
  auto t = Tokenizer::FromFile(path);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(t.status().message().find("WordPiece"), std::string::npos) << t.status();
  EXPECT_NE(t.status().message().find(path), std::string::npos) << t.status();
}

TEST_F(TokenizerErrors, UnsupportedComponentAndBadFields) {
  auto bad = [](const std::string& json) { return Tokenizer::FromJsonString(json, "x.json").status(); };
  const std::string model = R"("model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]})";
  Status s = bad(R"({"normalizer": {"type": "Precompiled"}, )" + model + "}");
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("Precompiled"), std::string::npos) << s;
  s = bad(R"({"pre_tokenizer": {"type": "Whitespace"}, )" + model + "}");
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s;
  s = bad(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a c"]}})");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("merges[0]"), std::string::npos) << s;
  s = bad(R"({"model": {"type": "BPE", "vocab": {"a": "zero"}, "merges": []}})");
  EXPECT_NE(s.message().find("model.vocab"), std::string::npos) << s;
  s = bad(R"({"pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated"}, )" +
          model + "}");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("pre_tokenizer"), std::string::npos) << s;
  s = bad(R"({"added_tokens": [{"id": -1, "content": "x"}], )" + model + "}");
  EXPECT_NE(s.message().find("added_tokens[0]"), std::string::npos) << s;
  s = bad("[1, 2]");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
}

TEST_F(TokenizerErrorsShared, UnknownIdAndInvalidUtf8) {
  const Tokenizer& t = Qwen2();
  auto d = t.Decode(Ids{9707, 999999}, false);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("999999"), std::string::npos) << d.status();
  EXPECT_FALSE(t.Decode(Ids{-1}, false).ok());
  for (const std::string bad : {"abc\xFF", "\xC3", "\xED\xA0\x80", "\xC0\xAF", "ok\xF4\x90\x80\x80"}) {
    auto e = t.Encode(bad, false);
    ASSERT_FALSE(e.ok());
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(e.status().message().find("UTF-8"), std::string::npos) << e.status();
  }
  EXPECT_FALSE(Llama2().Encode("\x80", true).ok());
}

// ---- regex translation ----------------------------------------------------------
TEST(TokenizerRegex, OnigTranslation) {
  using tokenizer_internal::TranslateOnigPattern;
  EXPECT_EQ(TranslateOnigPattern(R"(\s+(?!\S))"), R"([\t-\r\x{85}\p{Z}]+(?![^\t-\r\x{85}\p{Z}]))");
  EXPECT_EQ(TranslateOnigPattern(R"([^\s\p{L}])"), R"([^\t-\r\x{85}\p{Z}\p{L}])");
  EXPECT_EQ(TranslateOnigPattern(R"([]\s])"), R"([]\t-\r\x{85}\p{Z}])");
  EXPECT_EQ(TranslateOnigPattern(R"(\\s)"), R"(\\s)");
}

TEST(TokenizerRegex, WhiteSpaceFollowsUnicodeProperty) {
  auto re = tokenizer_internal::Regex::Compile(R"(\s+)");
  ASSERT_TRUE(re.ok()) << re.status();
  std::vector<std::pair<size_t, size_t>> m;
  // U+0085 and U+3000 are White_Space; U+180E (PCRE2 counts it) and U+200B are not.
  ASSERT_TRUE((*re)
                  ->FindAll("a\xC2\x85"
                            "b\xE1\xA0\x8E"
                            "c\xE3\x80\x80"
                            "d\xE2\x80\x8B",
                            &m)
                  .ok());
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0], std::make_pair(size_t{1}, size_t{3}));
  EXPECT_EQ(m[1], std::make_pair(size_t{8}, size_t{11}));
}

}  // namespace
}  // namespace penumbra
