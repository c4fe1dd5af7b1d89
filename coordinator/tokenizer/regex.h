// A compiled regular expression with the matching rules of the `tokenizers`
// library (Oniguruma, Ruby syntax), run by PCRE2 in UTF + UCP mode (internal
// to coordinator/tokenizer).
//
// The pattern is translated where the two engines differ on what the
// tokenizer patterns use: \s and \S follow the Unicode White_Space property
// (PCRE2 also counts U+180E), \h is a hex digit, and ^ / $ match at line
// boundaries. Thread-safe: a Regex is immutable after Compile.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace penumbra::tokenizer_internal {

class Regex {
 public:
  static Result<std::unique_ptr<Regex>> Compile(std::string_view pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends [start, end) byte offsets of the successive non-overlapping
  // matches in `s` (valid UTF-8), as Oniguruma's find_iter yields them: an
  // empty match right after the previous match is skipped by one character.
  Status FindAll(std::string_view s, std::vector<std::pair<size_t, size_t>>* out) const;

  const std::string& pattern() const { return pattern_; }

 private:
  Regex() = default;
  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8*
};

// The PCRE2 spelling of an Oniguruma pattern (exposed for tests).
std::string TranslateOnigPattern(std::string_view pattern);

}  // namespace penumbra::tokenizer_internal
