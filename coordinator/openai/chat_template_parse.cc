// The chat-template lexer and parser: source text to the syntax tree of
// chat_template_internal.h, with Jinja2's whitespace rules under
// trim_blocks and lstrip_blocks. Recursion is bounded by limits.max_depth.
#include <algorithm>
#include <charconv>
#include <initializer_list>
#include <string>
#include <utility>

#include "common/utf8.h"
#include "coordinator/openai/chat_template_internal.h"

namespace penumbra::openai::chat_template_internal {

void Fail(int64_t pos, std::string message) { throw Error{pos, std::move(message)}; }

uint32_t DecodeUtf8(std::string_view s, size_t i, size_t* len) {
  auto b = [&](size_t k) { return static_cast<uint8_t>(s[i + k]); };
  uint8_t c = b(0);
  int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  *len = 1;
  if (n == 0 || i + n > s.size()) return n == 1 ? c : 0xFFFD;
  if (n == 1) return c;
  uint32_t cp = c & (0x7F >> n);
  for (int k = 1; k < n; ++k) {
    if ((b(k) & 0xC0) != 0x80) return 0xFFFD;
    cp = (cp << 6) | (b(k) & 0x3F);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0xFFFD;
  *len = n;
  return cp;
}

bool IsSpace(uint32_t c) {  // Python's str.isspace()
  return (c >= 9 && c <= 13) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

std::string LineColumn(std::string_view src, int64_t pos) {
  size_t p = std::min(static_cast<size_t>(std::max<int64_t>(pos, 0)), src.size());
  size_t line_start = src.rfind('\n', p == 0 ? std::string_view::npos : p - 1);
  line_start = line_start == std::string_view::npos ? 0 : line_start + 1;
  int64_t line = 1 + std::count(src.begin(), src.begin() + static_cast<int64_t>(line_start), '\n');
  int64_t column = 1;
  for (size_t i = line_start, len = 0; i < p; i += len, ++column) DecodeUtf8(src, i, &len);
  return std::to_string(line) + ":" + std::to_string(column);
}

namespace {

enum class Tok : uint8_t { kText, kBlockBegin, kBlockEnd, kVarBegin, kVarEnd, kName, kString, kInt, kFloat, kOp, kEof };

struct Token {
  Tok type;
  int64_t pos;
  std::string text;  // kText, kName, kString (unescaped), kOp
  int64_t int_value = 0;
  double float_value = 0;
};

bool IsNameStart(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool IsNameChar(char c) { return IsNameStart(c) || (c >= '0' && c <= '9'); }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }
int HexDigit(char c) {
  if (IsDigit(c)) return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Splits the source into text and the tokens inside {% %} and {{ }},
// dropping comments and applying the whitespace rules: `-` at a tag's edge
// strips all whitespace on that side; trim_blocks drops the newline right
// after a block or comment; lstrip_blocks drops the spaces and tabs between
// a line's start and a block or comment (unless the tag opens with `+`).
class Lexer {
 public:
  explicit Lexer(const std::string& src) : src_(src) {}

  std::vector<Token> Run() {
    size_t pos = 0;
    After after = After::kNothing;
    while (true) {
      size_t tag = FindTag(pos);
      size_t b = pos;
      size_t e = tag == std::string::npos ? src_.size() : tag;
      if (after == After::kStrip) {
        while (b < e && SpaceAt(b)) b += CharLen(b);
      } else if (after == After::kTrimNewline && b < e && src_[b] == '\n') {
        ++b;
      }
      if (tag != std::string::npos) e = StripBeforeTag(b, e, tag);
      if (e > b) tokens_.push_back({Tok::kText, static_cast<int64_t>(b), src_.substr(b, e - b)});
      if (tag == std::string::npos) break;
      char kind = src_[tag + 1];
      size_t inner = tag + 2 + (tag + 2 < src_.size() && (src_[tag + 2] == '-' || src_[tag + 2] == '+') ? 1 : 0);
      if (kind == '#') {
        size_t end = src_.find("#}", inner);
        if (end == std::string::npos) Fail(static_cast<int64_t>(tag), "unclosed comment, expected '#}'");
        after = end > inner && src_[end - 1] == '-' ? After::kStrip : After::kTrimNewline;
        pos = end + 2;
      } else if (kind == '%' && IsRawTag(inner, &pos, &after)) {
        LexRaw(tag, &pos, &after);
      } else {
        tokens_.push_back({kind == '%' ? Tok::kBlockBegin : Tok::kVarBegin, static_cast<int64_t>(tag), ""});
        pos = LexInside(inner, kind == '%', &after);
      }
    }
    tokens_.push_back({Tok::kEof, static_cast<int64_t>(src_.size()), ""});
    return std::move(tokens_);
  }

 private:
  enum class After { kNothing, kStrip, kTrimNewline };  // what the last tag does to the text after it

  size_t CharLen(size_t i) const {
    size_t len = 0;
    DecodeUtf8(src_, i, &len);
    return len;
  }
  bool SpaceAt(size_t i) const {
    size_t len = 0;
    return IsSpace(DecodeUtf8(src_, i, &len));
  }
  size_t FindTag(size_t from) const {
    for (size_t i = src_.find('{', from); i != std::string::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    }
    return std::string::npos;
  }
  // The end of the text [b, e) once the tag at `tag` has stripped what it strips.
  size_t StripBeforeTag(size_t b, size_t e, size_t tag) const {
    char marker = tag + 2 < src_.size() ? src_[tag + 2] : '\0';
    if (marker == '-') {
      size_t keep = b;
      for (size_t i = b; i < e; i += CharLen(i)) {
        if (!SpaceAt(i)) keep = i + CharLen(i);
      }
      return keep;
    }
    if (marker == '+' || src_[tag + 1] == '{' || e == b) return e;
    size_t nl = src_.rfind('\n', e - 1);
    size_t line_start = nl != std::string::npos && nl >= b ? nl + 1 : b;
    if (line_start == b && b != 0 && src_[b - 1] != '\n') return e;
    for (size_t i = line_start; i < e; i += CharLen(i)) {
      if (!SpaceAt(i)) return e;
    }
    return line_start;
  }
  size_t SkipBlanks(size_t i) const {
    while (i < src_.size() && (src_[i] == ' ' || src_[i] == '\t' || src_[i] == '\n' || src_[i] == '\r' ||
                               src_[i] == '\f' || src_[i] == '\v')) {
      ++i;
    }
    return i;
  }
  // True when [i...] is `<ws>raw<ws>[-+]%}`; then *end is past it and *after its effect.
  bool IsRawTag(size_t i, size_t* end, After* after) const { return MatchWordTag(i, "raw", end, after); }
  bool MatchWordTag(size_t i, std::string_view word, size_t* end, After* after) const {
    i = SkipBlanks(i);
    if (src_.compare(i, word.size(), word) != 0) return false;
    i = SkipBlanks(i + word.size());
    char marker = i < src_.size() ? src_[i] : '\0';
    if (marker == '-' || marker == '+') ++i;
    if (src_.compare(i, 2, "%}") != 0) return false;
    *end = i + 2;
    *after = marker == '-' ? After::kStrip : marker == '+' ? After::kNothing : After::kTrimNewline;
    return true;
  }
  // {% raw %}...{% endraw %}: the text between is kept as is, except that
  // the tags' `-` markers and lstrip_blocks apply to it (trim_blocks does not
  // apply after {% raw %}: Jinja2 keeps that newline).
  void LexRaw(size_t tag, size_t* pos, After* after) {
    size_t b = *pos;
    if (*after == After::kStrip) {
      while (b < src_.size() && SpaceAt(b)) b += CharLen(b);
    }
    for (size_t i = src_.find("{%", b); i != std::string::npos; i = src_.find("{%", i + 1)) {
      size_t inner = i + 2 + (i + 2 < src_.size() && (src_[i + 2] == '-' || src_[i + 2] == '+') ? 1 : 0);
      if (!MatchWordTag(inner, "endraw", pos, after)) continue;
      size_t e = StripBeforeTag(b, i, i);
      if (e > b) tokens_.push_back({Tok::kText, static_cast<int64_t>(b), src_.substr(b, e - b)});
      return;
    }
    Fail(static_cast<int64_t>(tag), "unclosed {% raw %}, expected {% endraw %}");
  }

  // Lexes the tokens of a {% %} (block) or {{ }} tag from `i` to its end marker.
  size_t LexInside(size_t i, bool block, After* after) {
    std::string brackets;  // the closers of the open ( [ {, innermost last
    while (true) {
      i = SkipBlanks(i);
      int64_t at = static_cast<int64_t>(i);
      if (i >= src_.size()) {
        Fail(at, block ? "unexpected end of template, expected '%}'" : "unexpected end of template, expected '}}'");
      }
      if (brackets.empty()) {
        std::string_view rest = std::string_view(src_).substr(i);
        std::string_view end = block ? "%}" : "}}";
        size_t marker = (rest[0] == '-' || (block && rest[0] == '+')) ? 1 : 0;
        if (rest.substr(marker, 2) == end) {
          tokens_.push_back({block ? Tok::kBlockEnd : Tok::kVarEnd, at, ""});
          *after = marker && rest[0] == '-' ? After::kStrip
                   : (block && !marker)     ? After::kTrimNewline
                                            : After::kNothing;
          return i + marker + 2;
        }
      }
      char c = src_[i];
      if (IsNameStart(c)) {
        size_t j = i;
        while (j < src_.size() && IsNameChar(src_[j])) ++j;
        tokens_.push_back({Tok::kName, at, src_.substr(i, j - i)});
        i = j;
      } else if (IsDigit(c)) {
        i = LexNumber(i);
      } else if (c == '\'' || c == '"') {
        i = LexString(i);
      } else {
        static constexpr std::string_view kTwo[] = {"//", "**", "==", "!=", ">=", "<="};
        std::string op(1, c);
        for (std::string_view two : kTwo) {
          if (src_.compare(i, 2, two) == 0) op = two;
        }
        if (op.size() == 1 && std::string_view("+-*/%~[](){}<>=.:|,").find(c) == std::string_view::npos) {
          Fail(at, "unexpected character '" + std::string(1, c) + "'");
        }
        if (c == '(' || c == '[' || c == '{') brackets.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
        if (c == ')' || c == ']' || c == '}') {
          if (brackets.empty() || brackets.back() != c) Fail(at, "unexpected '" + op + "'");
          brackets.pop_back();
        }
        tokens_.push_back({Tok::kOp, at, op});
        i += op.size();
      }
    }
  }

  size_t LexNumber(size_t i) {
    auto digits = [&](size_t j, std::string* out) {
      while (j < src_.size() && (IsDigit(src_[j]) || (src_[j] == '_' && j + 1 < src_.size() && IsDigit(src_[j + 1])))) {
        if (src_[j] != '_') out->push_back(src_[j]);
        ++j;
      }
      return j;
    };
    std::string text;
    size_t j = digits(i, &text);
    bool is_float = false;
    if (j + 1 < src_.size() && src_[j] == '.' && IsDigit(src_[j + 1])) {
      text.push_back('.');
      j = digits(j + 1, &text);
      is_float = true;
    }
    if (j < src_.size() && (src_[j] == 'e' || src_[j] == 'E')) {
      size_t k = j + 1 + (j + 1 < src_.size() && (src_[j + 1] == '+' || src_[j + 1] == '-') ? 1 : 0);
      if (k < src_.size() && IsDigit(src_[k])) {
        text += 'e';
        if (k > j + 1) text += src_[j + 1];
        j = digits(k, &text);
        is_float = true;
      }
    }
    Token t{is_float ? Tok::kFloat : Tok::kInt, static_cast<int64_t>(i), text};
    const char* end = text.data() + text.size();
    auto r =
        is_float ? std::from_chars(text.data(), end, t.float_value) : std::from_chars(text.data(), end, t.int_value);
    if (r.ec != std::errc() || r.ptr != end) Fail(t.pos, "number literal '" + text + "' is out of range");
    tokens_.push_back(std::move(t));
    return j;
  }

  // A Python string literal: '...' or "...", with Python's backslash escapes.
  size_t LexString(size_t i) {
    char quote = src_[i];
    size_t start = i++;
    std::string out;
    auto hex = [&](size_t digits) {
      uint32_t cp = 0;
      for (size_t k = 0; k < digits; ++k) {
        int d = i + k < src_.size() ? HexDigit(src_[i + k]) : -1;
        if (d < 0) Fail(static_cast<int64_t>(i), "truncated \\x, \\u or \\U escape in a string literal");
        cp = cp * 16 + static_cast<uint32_t>(d);
      }
      i += digits;
      AppendUtf8(cp, &out);
    };
    while (true) {
      if (i >= src_.size()) Fail(static_cast<int64_t>(start), "unclosed string literal");
      char c = src_[i++];
      if (c == quote) break;
      if (c != '\\' || i >= src_.size()) {
        out.push_back(c);
        continue;
      }
      char e = src_[i++];
      switch (e) {
        case '\n':
          break;
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'v':
          out += '\v';
          break;
        case 'a':
          out += '\a';
          break;
        case '\\':
        case '\'':
        case '"':
          out += e;
          break;
        case 'x':
          hex(2);
          break;
        case 'u':
          hex(4);
          break;
        case 'U':
          hex(8);
          break;
        case 'N':
          Fail(static_cast<int64_t>(i - 2), "\\N{...} escapes are not supported");
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = static_cast<uint32_t>(e - '0');
            for (int k = 0; k < 2 && i < src_.size() && src_[i] >= '0' && src_[i] <= '7'; ++k) {
              cp = cp * 8 + (src_[i++] - '0');
            }
            AppendUtf8(cp, &out);
          } else {
            out += '\\';
            out += e;
          }
      }
    }
    tokens_.push_back({Tok::kString, static_cast<int64_t>(start), std::move(out)});
    return i;
  }

  const std::string& src_;
  std::vector<Token> tokens_;
};

// Recursive descent over the tokens, following Jinja2's grammar and operator
// precedence (lowest first): `x if c else y`, or, and, not, comparisons and
// in, + -, ~, * / // %, **, unary - +, then postfix . [] () | is.
class Parser {
 public:
  Parser(const Template& t, std::vector<Token> tokens)
      : src_(t.source), max_depth_(t.limits.max_depth), toks_(std::move(tokens)) {}

  Body Run() {
    std::string ended_by;
    return ParseBody({}, &ended_by, nullptr);
  }

 private:
  // Counts the parser's recursion; fails past max_depth.
  class Nest {
   public:
    Nest(Parser* p, int64_t pos) : p_(p) {
      if (++p_->nesting_ > p_->max_depth_) {
        Fail(pos, "template nests deeper than max_depth (" + std::to_string(p_->max_depth_) + ")");
      }
    }
    ~Nest() { --p_->nesting_; }
    Nest(const Nest&) = delete;
    Nest& operator=(const Nest&) = delete;

   private:
    Parser* p_;
  };

  const Token& Peek(size_t k = 0) const { return toks_[std::min(at_ + k, toks_.size() - 1)]; }
  const Token& Next() { return toks_[at_ < toks_.size() - 1 ? at_++ : at_]; }
  bool AtOp(std::string_view op) const { return Peek().type == Tok::kOp && Peek().text == op; }
  bool AtName(std::string_view name) const { return Peek().type == Tok::kName && Peek().text == name; }

  static std::string Describe(const Token& t) {
    switch (t.type) {
      case Tok::kEof:
        return "end of template";
      case Tok::kBlockEnd:
        return "end of statement block '%}'";
      case Tok::kVarEnd:
        return "end of print statement '}}'";
      case Tok::kBlockBegin:
        return "'{%'";
      case Tok::kVarBegin:
        return "'{{'";
      case Tok::kText:
        return "template text";
      case Tok::kString:
        return "string literal";
      default:
        return "'" + t.text + "'";
    }
  }
  [[noreturn]] void Unexpected(std::string_view expected) const {
    Fail(Peek().pos, "unexpected " + Describe(Peek()) + ", expected " + std::string(expected));
  }
  void ExpectOp(std::string_view op) {
    if (!AtOp(op)) Unexpected("'" + std::string(op) + "'");
    Next();
  }
  std::string ExpectName(std::string_view what) {
    if (Peek().type != Tok::kName) Unexpected(what);
    return Next().text;
  }
  void ExpectBlockEnd() {
    if (Peek().type != Tok::kBlockEnd) Unexpected("end of statement block '%}'");
    Next();
  }

  ExprPtr Make(Expr::Kind kind, int64_t pos, std::vector<ExprPtr> args = {}) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->pos = pos;
    for (const ExprPtr& a : args) {
      if (a) e->depth = std::max(e->depth, a->depth + 1);
    }
    if (e->depth > max_depth_) Fail(pos, "expression nests deeper than max_depth (" + std::to_string(max_depth_) + ")");
    e->args = std::move(args);
    return e;
  }
  ExprPtr Literal(int64_t pos, Value v) {
    ExprPtr e = Make(Expr::Kind::kLiteral, pos);
    e->literal = std::move(v);
    return e;
  }

  // ---- statements ----

  // Parses nodes up to one of `end_tags` ({% name ...), consuming `{% name`
  // and leaving the rest of that tag; or, with no end tags, to the end.
  Body ParseBody(std::initializer_list<std::string_view> end_tags, std::string* ended_by, const Token* opener) {
    Nest nest(this, Peek().pos);
    std::string expected;
    for (std::string_view t : end_tags) expected += (expected.empty() ? "'" : " or '") + std::string(t) + "'";
    if (opener) expected += " to close the '" + opener->text + "' at " + LineColumn(src_, opener->pos);
    Body body;
    while (true) {
      const Token& t = Peek();
      if (t.type == Tok::kEof) {
        if (end_tags.size() == 0) return body;
        Unexpected(expected);
      } else if (t.type == Tok::kText) {
        auto n = std::make_unique<Node>();
        n->pos = t.pos;
        n->text = Next().text;
        body.push_back(std::move(n));
      } else if (t.type == Tok::kVarBegin) {
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::kOutput;
        n->pos = Next().pos;
        n->exprs.push_back(ParseTuple(true));
        if (Peek().type != Tok::kVarEnd) Unexpected("end of print statement '}}'");
        Next();
        body.push_back(std::move(n));
      } else if (t.type == Tok::kBlockBegin) {
        const Token& name = Peek(1);
        if (name.type != Tok::kName) Fail(name.pos, "unexpected " + Describe(name) + ", expected a tag name");
        for (std::string_view end : end_tags) {
          if (name.text == end) {
            Next();
            *ended_by = Next().text;
            return body;
          }
        }
        if (name.text.rfind("end", 0) == 0 || name.text == "else" || name.text == "elif") {
          Fail(name.pos, "unexpected '" + name.text + "'" + (end_tags.size() ? ", expected " + expected : ""));
        }
        body.push_back(ParseStatement());
      } else {
        Unexpected("template text or a tag");
      }
    }
  }

  NodePtr ParseStatement() {
    Next();  // {%
    const Token& tag = Next();
    auto n = std::make_unique<Node>();
    n->pos = tag.pos;
    std::string ended;
    if (tag.text == "if") {
      n->kind = Node::Kind::kIf;
      do {
        n->exprs.push_back(ParseExpr(true));
        ExpectBlockEnd();
        n->bodies.push_back(ParseBody({"elif", "else", "endif"}, &ended, &tag));
      } while (ended == "elif");
      if (ended == "else") {
        ExpectBlockEnd();
        n->bodies.push_back(ParseBody({"endif"}, &ended, &tag));
      }
    } else if (tag.text == "for") {
      n->kind = Node::Kind::kFor;
      n->names = ParseTargets();
      if (!AtName("in")) Unexpected("'in'");
      Next();
      n->exprs.push_back(ParseTuple(false));
      n->exprs.push_back(AtName("if") ? (Next(), ParseExpr(true)) : nullptr);
      if (AtName("recursive")) Fail(Peek().pos, "recursive loops are not supported");
      ExpectBlockEnd();
      ++loop_depth_;
      n->bodies.push_back(ParseBody({"else", "endfor"}, &ended, &tag));
      --loop_depth_;
      n->bodies.emplace_back();
      if (ended == "else") {
        ExpectBlockEnd();
        n->bodies.back() = ParseBody({"endfor"}, &ended, &tag);
      }
    } else if (tag.text == "set") {
      n->kind = Node::Kind::kSet;
      n->names = ParseTargets();
      if (n->names.size() == 1 && AtOp(".")) {
        Next();
        n->attr = ExpectName("an attribute name");
      }
      if (AtOp("=")) {
        Next();
        n->exprs.push_back(ParseTuple(true));
      } else if (Peek().type == Tok::kBlockEnd && n->names.size() == 1 && n->attr.empty()) {
        n->kind = Node::Kind::kSetBlock;
        Next();
        n->bodies.push_back(ParseBody({"endset"}, &ended, &tag));
      } else {
        Unexpected("'='");
      }
    } else if (tag.text == "macro") {
      n->kind = Node::Kind::kMacro;
      n->text = ExpectName("a macro name");
      ExpectOp("(");
      while (!AtOp(")")) {
        if (!n->names.empty()) ExpectOp(",");
        if (AtOp(")")) break;
        n->names.push_back(ExpectName("a parameter name"));
        n->exprs.push_back(AtOp("=") ? (Next(), ParseExpr(true)) : nullptr);
      }
      Next();
      ExpectBlockEnd();
      int saved_loop_depth = loop_depth_;
      loop_depth_ = 0;
      n->bodies.push_back(ParseBody({"endmacro"}, &ended, &tag));
      loop_depth_ = saved_loop_depth;
    } else if (tag.text == "break" || tag.text == "continue") {
      n->kind = tag.text == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
      if (loop_depth_ == 0) Fail(tag.pos, "'" + tag.text + "' outside a loop");
    } else if (tag.text == "filter") {  // {% filter f | g(x) %}body{% endfilter %}: g(f(body))
      n->kind = Node::Kind::kFilterBlock;
      ExprPtr body = Make(Expr::Kind::kName, tag.pos);
      body->name = kFilterBlockBody;
      n->exprs.push_back(ParseFilters(std::move(body), true));
      ExpectBlockEnd();
      n->bodies.push_back(ParseBody({"endfilter"}, &ended, &tag));
    } else if (tag.text == "generation") {  // a call block in transformers: its own scope, no loop
      n->kind = Node::Kind::kGeneration;
      ExpectBlockEnd();
      int saved_loop_depth = loop_depth_;
      loop_depth_ = 0;
      n->bodies.push_back(ParseBody({"endgeneration"}, &ended, &tag));
      loop_depth_ = saved_loop_depth;
    } else {
      Fail(tag.pos, "unknown tag '" + tag.text + "'");
    }
    ExpectBlockEnd();
    return n;
  }

  // `a`, `a, b` or `(a, b)`: the names a for loop or set assigns.
  std::vector<std::string> ParseTargets() {
    bool paren = AtOp("(");
    if (paren) Next();
    std::vector<std::string> names{ExpectName("a variable name")};
    while (AtOp(",")) {
      Next();
      names.push_back(ExpectName("a variable name"));
    }
    if (paren) ExpectOp(")");
    return names;
  }

  // ---- expressions ----

  // `a` or `a, b, ...` (a tuple).
  ExprPtr ParseTuple(bool allow_cond) {
    int64_t pos = Peek().pos;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    items.push_back(ParseExpr(allow_cond));
    while (AtOp(",")) {
      Next();
      is_tuple = true;
      Tok t = Peek().type;
      if (t == Tok::kBlockEnd || t == Tok::kVarEnd || AtOp(")")) break;
      items.push_back(ParseExpr(allow_cond));
    }
    if (!is_tuple) return std::move(items[0]);
    ExprPtr e = Make(Expr::Kind::kList, pos, std::move(items));
    e->is_tuple = true;
    return e;
  }

  ExprPtr ParseExpr(bool allow_cond) {
    Nest nest(this, Peek().pos);
    ExprPtr e = ParseChain(Expr::Kind::kOr, {"or"}, &Parser::ParseAnd);
    while (allow_cond && AtName("if")) {
      int64_t pos = Next().pos;
      ExprPtr cond = ParseChain(Expr::Kind::kOr, {"or"}, &Parser::ParseAnd);
      ExprPtr otherwise = AtName("else") ? (Next(), ParseExpr(true)) : nullptr;
      std::vector<ExprPtr> args;
      args.push_back(std::move(e));
      args.push_back(std::move(cond));
      args.push_back(std::move(otherwise));
      e = Make(Expr::Kind::kCond, pos, std::move(args));
    }
    return e;
  }

  // A left-associative run of `next` joined by any of `ops` (names or operators).
  ExprPtr ParseChain(Expr::Kind kind, std::initializer_list<std::string_view> ops, ExprPtr (Parser::*next)()) {
    int64_t pos = Peek().pos;
    std::vector<ExprPtr> args;
    std::vector<std::string> names;
    args.push_back((this->*next)());
    while (true) {
      const Token& t = Peek();
      bool match = false;
      for (std::string_view op : ops) match = match || ((t.type == Tok::kOp || t.type == Tok::kName) && t.text == op);
      if (!match) break;
      names.push_back(Next().text);
      args.push_back((this->*next)());
    }
    if (args.size() == 1) return std::move(args[0]);
    ExprPtr e = Make(kind, pos, std::move(args));
    e->ops = std::move(names);
    return e;
  }
  ExprPtr ParseAnd() { return ParseChain(Expr::Kind::kAnd, {"and"}, &Parser::ParseNot); }
  ExprPtr ParseNot() {
    if (!AtName("not")) return ParseCompare();
    Nest nest(this, Peek().pos);
    int64_t pos = Next().pos;
    std::vector<ExprPtr> args;
    args.push_back(ParseNot());
    return Make(Expr::Kind::kNot, pos, std::move(args));
  }
  ExprPtr ParseCompare() {
    int64_t pos = Peek().pos;
    std::vector<ExprPtr> args;
    std::vector<std::string> ops;
    args.push_back(ParseMath1());
    while (true) {
      const Token& t = Peek();
      if (t.type == Tok::kOp &&
          (t.text == "==" || t.text == "!=" || t.text == "<" || t.text == ">" || t.text == "<=" || t.text == ">=")) {
        ops.push_back(Next().text);
      } else if (AtName("in")) {
        ops.push_back(Next().text);
      } else if (AtName("not") && Peek(1).type == Tok::kName && Peek(1).text == "in") {
        Next();
        Next();
        ops.push_back("not in");
      } else {
        break;
      }
      args.push_back(ParseMath1());
    }
    if (args.size() == 1) return std::move(args[0]);
    ExprPtr e = Make(Expr::Kind::kCompare, pos, std::move(args));
    e->ops = std::move(ops);
    return e;
  }
  ExprPtr ParseMath1() { return ParseChain(Expr::Kind::kBinary, {"+", "-"}, &Parser::ParseConcat); }
  ExprPtr ParseConcat() { return ParseChain(Expr::Kind::kBinary, {"~"}, &Parser::ParseMath2); }
  ExprPtr ParseMath2() { return ParseChain(Expr::Kind::kBinary, {"*", "/", "//", "%"}, &Parser::ParsePow); }
  ExprPtr ParsePow() { return ParseChain(Expr::Kind::kBinary, {"**"}, &Parser::ParseUnaryFiltered); }
  ExprPtr ParseUnaryFiltered() { return ParseUnary(true); }

  ExprPtr ParseUnary(bool with_filter) {
    Nest nest(this, Peek().pos);
    ExprPtr e;
    if (AtOp("-") || AtOp("+")) {
      const Token& t = Next();
      std::vector<ExprPtr> args;
      args.push_back(ParseUnary(false));
      e = Make(t.text == "-" ? Expr::Kind::kNeg : Expr::Kind::kPos, t.pos, std::move(args));
    } else {
      e = ParsePrimary();
    }
    e = ParsePostfix(std::move(e));
    return with_filter ? ParseFilters(std::move(e)) : std::move(e);
  }

  ExprPtr ParsePrimary() {
    const Token& t = Peek();
    int64_t pos = t.pos;
    switch (t.type) {
      case Tok::kName: {
        std::string name = Next().text;
        if (name == "true" || name == "True") return Literal(pos, Value::Bool(true));
        if (name == "false" || name == "False") return Literal(pos, Value::Bool(false));
        if (name == "none" || name == "None") return Literal(pos, Value::None());
        ExprPtr e = Make(Expr::Kind::kName, pos);
        e->name = std::move(name);
        return e;
      }
      case Tok::kString: {
        std::string s;
        while (Peek().type == Tok::kString) s += Next().text;
        return Literal(pos, Value::String(std::move(s)));
      }
      case Tok::kInt:
        return Literal(pos, Value::Int(Next().int_value));
      case Tok::kFloat:
        return Literal(pos, Value::Float(Next().float_value));
      case Tok::kOp:
        if (t.text == "(") {
          Next();
          if (AtOp(")")) {
            Next();
            ExprPtr e = Make(Expr::Kind::kList, pos);
            e->is_tuple = true;
            return e;
          }
          ExprPtr e = ParseTuple(true);
          ExpectOp(")");
          return e;
        }
        if (t.text == "[" || t.text == "{") {
          bool dict = t.text == "{";
          std::string close = dict ? "}" : "]";
          Next();
          std::vector<ExprPtr> items;
          while (!AtOp(close)) {
            if (!items.empty()) ExpectOp(",");
            if (AtOp(close)) break;
            items.push_back(ParseExpr(true));
            if (dict) {
              ExpectOp(":");
              items.push_back(ParseExpr(true));
            }
          }
          Next();
          return Make(dict ? Expr::Kind::kDict : Expr::Kind::kList, pos, std::move(items));
        }
        break;
      default:
        break;
    }
    Unexpected("an expression");
  }

  ExprPtr ParsePostfix(ExprPtr e) {
    while (true) {
      int64_t pos = Peek().pos;
      if (AtOp(".")) {
        Next();
        std::vector<ExprPtr> args;
        args.push_back(std::move(e));
        if (Peek().type == Tok::kInt) {
          args.push_back(Literal(Peek().pos, Value::Int(Next().int_value)));
          e = Make(Expr::Kind::kGetitem, pos, std::move(args));
        } else {
          std::string name = ExpectName("an attribute name");
          e = Make(Expr::Kind::kGetattr, pos, std::move(args));
          e->name = std::move(name);
        }
      } else if (AtOp("[")) {
        Next();
        std::vector<ExprPtr> args;
        args.push_back(std::move(e));
        args.push_back(AtOp(":") ? nullptr : ParseExpr(true));
        bool slice = AtOp(":");
        if (slice) {
          Next();
          args.push_back(AtOp(":") || AtOp("]") ? nullptr : ParseExpr(true));
          args.push_back(AtOp(":") && (Next(), !AtOp("]")) ? ParseExpr(true) : nullptr);
        } else if (!args[1]) {
          Unexpected("an expression");
        }
        ExpectOp("]");
        e = Make(slice ? Expr::Kind::kSlice : Expr::Kind::kGetitem, pos, std::move(args));
      } else if (AtOp("(")) {
        int64_t callee_pos = e->pos;
        e = ParseCall(Expr::Kind::kCall, callee_pos, std::move(e), "");
      } else {
        return e;
      }
    }
  }

  // `(args...)` after a callee, filter or test; `operand` becomes args[0].
  ExprPtr ParseCall(Expr::Kind kind, int64_t pos, ExprPtr operand, std::string name) {
    std::vector<ExprPtr> args;
    args.push_back(std::move(operand));
    std::vector<std::string> kwnames;
    if (AtOp("(")) {
      Next();
      while (!AtOp(")")) {
        if (args.size() > 1) ExpectOp(",");
        if (AtOp(")")) break;
        if (AtOp("*") || AtOp("**")) Fail(Peek().pos, "*args and **kwargs in calls are not supported");
        if (Peek().type == Tok::kName && Peek(1).type == Tok::kOp && Peek(1).text == "=") {
          kwnames.push_back(Next().text);
          Next();
        } else if (!kwnames.empty()) {
          Fail(Peek().pos, "positional argument follows keyword argument");
        }
        args.push_back(ParseExpr(true));
      }
      Next();
    }
    ExprPtr e = Make(kind, pos, std::move(args));
    e->name = std::move(name);
    e->kwnames = std::move(kwnames);
    return e;
  }

  ExprPtr ParseFilters(ExprPtr e, bool first_without_bar = false) {
    while (true) {
      int64_t pos = Peek().pos;
      if (AtOp("|") || std::exchange(first_without_bar, false)) {
        if (AtOp("|")) Next();
        int64_t name_pos = Peek().pos;
        std::string name = ExpectName("a filter name");
        if (!IsKnownFilter(name)) Fail(name_pos, "no filter named '" + name + "'");
        e = ParseCall(Expr::Kind::kFilter, pos, std::move(e), std::move(name));
      } else if (AtName("is")) {
        Next();
        bool negated = AtName("not");
        if (negated) Next();
        std::string name = ExpectName("a test name");
        const Token& t = Peek();
        bool bare_arg = (t.type == Tok::kName && t.text != "else" && t.text != "or" && t.text != "and") ||
                        t.type == Tok::kString || t.type == Tok::kInt || t.type == Tok::kFloat ||
                        (t.type == Tok::kOp && (t.text == "[" || t.text == "{"));
        if (bare_arg) {
          if (t.type == Tok::kName && t.text == "is") Fail(t.pos, "tests cannot be chained with 'is'");
          std::vector<ExprPtr> args;
          args.push_back(std::move(e));
          args.push_back(ParsePostfix(ParsePrimary()));
          e = Make(Expr::Kind::kTest, pos, std::move(args));
          e->name = std::move(name);
        } else {
          e = ParseCall(Expr::Kind::kTest, pos, std::move(e), std::move(name));
        }
        e->negated = negated;
      } else if (AtOp("(")) {
        int64_t callee_pos = e->pos;
        e = ParseCall(Expr::Kind::kCall, callee_pos, std::move(e), "");
      } else {
        return e;
      }
    }
  }

  const std::string& src_;
  int max_depth_;
  std::vector<Token> toks_;
  size_t at_ = 0;
  int nesting_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

void ParseTemplate(std::string_view source, Template* t) {
  std::string& s = t->source;
  s.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] != '\r') {
      s.push_back(source[i]);
    } else {
      s.push_back('\n');
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    }
  }
  if (!s.empty() && s.back() == '\n') s.pop_back();  // Jinja2's keep_trailing_newline=False
  for (size_t i = 0, len = 0; i < s.size(); i += len) {
    if (DecodeUtf8(s, i, &len) == 0xFFFD && s.compare(i, 3, "\xEF\xBF\xBD") != 0) {
      Fail(static_cast<int64_t>(i), "the template is not valid UTF-8");
    }
  }
  t->body = Parser(*t, Lexer(s).Run()).Run();
}

}  // namespace penumbra::openai::chat_template_internal
