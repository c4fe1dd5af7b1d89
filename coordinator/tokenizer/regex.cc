#include "coordinator/tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "coordinator/tokenizer/unicode.h"

namespace penumbra::tokenizer_internal {
namespace {

constexpr std::string_view kSpaceSet = "\\t-\\r\\x{85}\\p{Z}";
constexpr std::string_view kHexSet = "0-9a-fA-F";

std::string PcreError(int code) {
  PCRE2_UCHAR buf[256];
  if (pcre2_get_error_message(code, buf, sizeof(buf)) < 0) return "PCRE2 error " + std::to_string(code);
  return std::string(reinterpret_cast<const char*>(buf));
}

}  // namespace

std::string TranslateOnigPattern(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 16);
  bool in_class = false;
  size_t class_start = 0;  // index in p just after '[' or '[^'
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char n = p[i + 1];
      ++i;
      if (n == 's' || n == 'h') {
        const std::string_view set = n == 's' ? kSpaceSet : kHexSet;
        if (in_class) {
          out.append(set);
        } else {
          out.push_back('[');
          out.append(set);
          out.push_back(']');
        }
      } else if ((n == 'S' || n == 'H') && !in_class) {
        out.append("[^");
        out.append(n == 'S' ? kSpaceSet : kHexSet);
        out.push_back(']');
      } else {
        out.push_back('\\');
        out.push_back(n);
      }
      continue;
    }
    if (!in_class) {
      if (c == '[') {
        in_class = true;
        out.push_back(c);
        if (i + 1 < p.size() && p[i + 1] == '^') out.push_back(p[++i]);
        class_start = i + 1;
        continue;
      }
      out.push_back(c);
      continue;
    }
    // Inside a character class.
    if (c == '[' && i + 1 < p.size() && p[i + 1] == ':') {
      const size_t end = p.find(":]", i + 2);
      if (end != std::string_view::npos) {
        out.append(p.substr(i, end + 2 - i));
        i = end + 1;
        continue;
      }
    }
    if (c == ']' && i != class_start) in_class = false;
    out.push_back(c);
  }
  return out;
}

Result<std::unique_ptr<Regex>> Regex::Compile(std::string_view pattern) {
  const std::string translated = TranslateOnigPattern(pattern);
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &err, &err_offset, nullptr);
  if (code == nullptr) {
    return Status::InvalidArgument("regex '" + std::string(pattern) + "' does not compile at offset " +
                                   std::to_string(err_offset) + ": " + PcreError(err));
  }
  // JIT is an optimization; the interpreter gives the same matches.
  (void)pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  std::unique_ptr<Regex> re(new Regex());
  re->pattern_ = std::string(pattern);
  re->code_ = code;
  return re;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

Status Regex::FindAll(std::string_view s, std::vector<std::pair<size_t, size_t>>* out) const {
  auto* code = static_cast<pcre2_code*>(code_);
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
  pcre2_match_context* mc = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* js = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  if (md == nullptr || mc == nullptr || js == nullptr) {
    pcre2_match_data_free(md);
    pcre2_match_context_free(mc);
    pcre2_jit_stack_free(js);
    return Status::ResourceExhausted("regex: out of memory");
  }
  pcre2_jit_stack_assign(mc, nullptr, js);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  Status status;
  size_t search_from = 0;
  bool have_last = false;
  size_t last_end = 0;
  while (search_from <= s.size()) {
    const int rc = pcre2_match(code, subject, s.size(), search_from, PCRE2_NO_UTF_CHECK, md, mc);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      status = Status::ResourceExhausted("regex '" + pattern_ + "' failed at byte " + std::to_string(search_from) +
                                         ": " + PcreError(rc));
      break;
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t start = ov[0], end = ov[1];
    if (start == end && have_last && last_end == end) {
      // Skip one character so an empty match cannot repeat forever.
      search_from += search_from < s.size() ? Utf8SeqLen(static_cast<unsigned char>(s[search_from])) : 1;
      continue;
    }
    out->emplace_back(start, end);
    search_from = end;
    have_last = true;
    last_end = end;
  }
  pcre2_jit_stack_free(js);
  pcre2_match_context_free(mc);
  pcre2_match_data_free(md);
  return status;
}

}  // namespace penumbra::tokenizer_internal
