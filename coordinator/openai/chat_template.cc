// The chat-template evaluator: walks the syntax tree that
// chat_template_parse.cc builds, with Python's semantics for values, and
// ChatTemplate's public API. Errors are thrown as chat_template_internal::Error
// inside this module and become a Status at Parse and Render.
#include "coordinator/openai/chat_template.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <initializer_list>
#include <optional>

#include "coordinator/openai/chat_template_internal.h"

namespace penumbra::openai {
namespace chat_template_internal {

Value Value::Of(Kind kind, int64_t i) {
  Value v;
  v.kind = kind;
  v.i = i;
  return v;
}
Value Value::Float(double f) {
  Value v = Of(Kind::kFloat);
  v.f = f;
  return v;
}
Value Value::String(std::string s) {
  Value v = Of(Kind::kString);
  v.str = std::make_shared<const std::string>(std::move(s));
  return v;
}
Value Value::Undefined(std::string why) {
  Value v;
  v.str = std::make_shared<const std::string>(std::move(why));
  return v;
}

struct Scope {
  explicit Scope(std::shared_ptr<Scope> p) : parent(std::move(p)) {}
  std::shared_ptr<Scope> parent;
  std::unordered_map<std::string, Value> vars;
};

namespace {

using Kind = Value::Kind;
using ScopePtr = std::shared_ptr<Scope>;
constexpr int64_t kMaxRange = 100000;  // Jinja2's sandbox MAX_RANGE

constexpr std::string_view kFilters[] = {
    "abs",    "capitalize", "count",      "d",       "default", "dictsort", "e",    "escape", "first",      "float",
    "indent", "int",        "items",      "join",    "last",    "length",   "list", "lower",  "map",        "max",
    "min",    "reject",     "rejectattr", "replace", "reverse", "round",    "safe", "select", "selectattr", "sort",
    "string", "sum",        "title",      "tojson",  "trim",    "unique",   "upper"};

std::string_view TypeName(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return v.is_tuple ? "tuple" : "list";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kLoop:
      return "LoopContext";
    case Kind::kMacro:
      return "Macro";
    case Kind::kMethod:
      return "builtin_function_or_method";
    case Kind::kFunction:
      return "function";
  }
  return "object";
}

double AsDouble(const Value& v) { return v.kind == Kind::kFloat ? v.f : static_cast<double>(v.i); }

// Python's repr() of a float: the shortest digits that round-trip, in fixed
// notation for exponents -4..15 and scientific notation otherwise.
std::string FormatFloat(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<size_t>(r.ptr - buf));
  std::string out;
  if (sci[0] == '-') {
    out = "-";
    sci.remove_prefix(1);
  }
  size_t e = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e)) {
    if (c != '.') digits += c;
  }
  int exp = 0;
  std::from_chars(sci.data() + e + (sci[e + 1] == '+' ? 2 : 1), sci.data() + sci.size(), exp);
  int decpt = exp + 1;
  int n = static_cast<int>(digits.size());
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) return out + "0." + std::string(-decpt, '0') + digits;
    if (decpt >= n) return out + digits + std::string(decpt - n, '0') + ".0";
    return out + digits.substr(0, decpt) + "." + digits.substr(decpt);
  }
  out += digits.substr(0, 1);
  if (n > 1) out += "." + digits.substr(1);
  char expbuf[16];
  std::snprintf(expbuf, sizeof(expbuf), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
  return out + expbuf;
}

// Dict's index key: equal numbers (1, 1.0, True) share one.
std::string IndexKey(const Value& k) {
  if (k.Is(Kind::kString)) return "s" + *k.str;
  if (k.Is(Kind::kNone)) return "z";
  if (k.Is(Kind::kFloat) && !(std::floor(k.f) == k.f && std::fabs(k.f) < 9e18)) return "f" + FormatFloat(k.f);
  return "n" + std::to_string(k.Is(Kind::kFloat) ? static_cast<int64_t>(k.f) : k.i);
}

// ---- UTF-8 string helpers (Python's str methods count code points) ----

std::vector<std::string_view> CodePoints(std::string_view s) {
  std::vector<std::string_view> out;
  for (size_t i = 0, len = 0; i < s.size(); i += len) {
    DecodeUtf8(s, i, &len);
    out.push_back(s.substr(i, len));
  }
  return out;
}

size_t CodePointCount(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<uint8_t>(c) & 0xC0) != 0x80;
  return n;
}

// Letters of the scripts with case (Latin, Greek, Cyrillic); only ASCII is mapped.
bool IsCased(uint32_t c) {
  return (c < 0x80 && std::isalpha(static_cast<int>(c))) || (c >= 0xC0 && c <= 0x24F && c != 0xD7 && c != 0xF7) ||
         (c >= 0x370 && c <= 0x52F);
}
char Upper(char c) { return c >= 'a' && c <= 'z' ? static_cast<char>(c - 32) : c; }
char Lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; }
std::string MapCase(std::string_view s, bool upper) {
  std::string out(s);
  for (char& c : out) c = upper ? Upper(c) : Lower(c);
  return out;
}
// Python's str.title(): a cased letter after an uncased character starts a word.
std::string PyTitle(std::string_view s) {
  std::string out;
  bool prev_cased = false;
  for (size_t i = 0, len = 0; i < s.size(); i += len) {
    uint32_t cp = DecodeUtf8(s, i, &len);
    out += cp < 0x80 ? std::string(1, prev_cased ? Lower(s[i]) : Upper(s[i])) : std::string(s.substr(i, len));
    prev_cased = IsCased(cp);
  }
  return out;
}
std::string Capitalize(std::string_view s) {
  std::string out = MapCase(s, false);
  if (!out.empty()) out[0] = Upper(out[0]);
  return out;
}

std::string Strip(std::string_view s, const std::string* chars, bool left, bool right) {
  std::vector<uint32_t> set;
  if (chars) {
    for (size_t i = 0, len = 0; i < chars->size(); i += len) set.push_back(DecodeUtf8(*chars, i, &len));
  }
  auto strip = [&](uint32_t cp) { return chars ? std::find(set.begin(), set.end(), cp) != set.end() : IsSpace(cp); };
  std::vector<std::string_view> cps = CodePoints(s);
  size_t b = 0, e = cps.size();
  size_t len = 0;
  while (left && b < e && strip(DecodeUtf8(cps[b], 0, &len))) ++b;
  while (right && e > b && strip(DecodeUtf8(cps[e - 1], 0, &len))) --e;
  if (b == e) return "";
  return std::string(cps[b].data(), static_cast<size_t>(cps[e - 1].data() + cps[e - 1].size() - cps[b].data()));
}

size_t Find(std::string_view hay, std::string_view needle, size_t from) {  // linear time (glibc's two-way memmem)
  if (from > hay.size()) return std::string_view::npos;
  const void* p = memmem(hay.data() + from, hay.size() - from, needle.data(), needle.size());
  return p ? static_cast<size_t>(static_cast<const char*>(p) - hay.data()) : std::string_view::npos;
}

// Python's str.split(sep, maxsplit); sep == nullptr splits on whitespace runs.
std::vector<std::string> Split(std::string_view s, const std::string* sep, int64_t maxsplit, int64_t pos) {
  std::vector<std::string> out;
  if (sep) {
    if (sep->empty()) Fail(pos, "split(): empty separator");
    size_t b = 0;
    for (size_t at; (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) &&
                    (at = Find(s, *sep, b)) != std::string_view::npos;
         b = at + sep->size()) {
      out.emplace_back(s.substr(b, at - b));
    }
    out.emplace_back(s.substr(b));
    return out;
  }
  size_t i = 0, len = 0;
  while (true) {
    while (i < s.size() && IsSpace(DecodeUtf8(s, i, &len))) i += len;
    if (i >= s.size()) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
      out.emplace_back(s.substr(i));
      break;
    }
    size_t j = i;
    while (j < s.size() && !IsSpace(DecodeUtf8(s, j, &len))) j += len;
    out.emplace_back(s.substr(i, j - i));
    i = j;
  }
  return out;
}

std::string Replace(std::string_view s, std::string_view old, std::string_view with, int64_t count) {
  std::string out;
  if (old.empty()) {
    std::vector<std::string_view> cps = CodePoints(s);
    for (size_t k = 0; k <= cps.size(); ++k) {
      if (count < 0 || static_cast<int64_t>(k) < count) out += with;
      if (k < cps.size()) out += cps[k];
    }
    return out;
  }
  size_t b = 0;
  for (size_t at; count != 0 && (at = Find(s, old, b)) != std::string_view::npos; b = at + old.size(), --count) {
    out += s.substr(b, at - b);
    out += with;
  }
  return out += s.substr(b);
}

// Python's str.splitlines() (without keepends).
std::vector<std::string_view> SplitLines(std::string_view s) {
  std::vector<std::string_view> out;
  size_t b = 0, len = 0;
  for (size_t i = 0; i < s.size(); i += len) {
    uint32_t cp = DecodeUtf8(s, i, &len);
    if (cp == '\n' || cp == '\r' || cp == 0x0B || cp == 0x0C || (cp >= 0x1C && cp <= 0x1E) || cp == 0x85 ||
        cp == 0x2028 || cp == 0x2029) {
      out.push_back(s.substr(b, i - b));
      if (cp == '\r' && i + 1 < s.size() && s[i + 1] == '\n') ++len;
      b = i + len;
    }
  }
  if (b < s.size()) out.push_back(s.substr(b));
  return out;
}

// Characters Python's repr() escapes (not str.isprintable()), approximately.
bool IsPrintable(uint32_t c) {
  return !(c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD || c == 0x1680 || (c >= 0x2000 && c <= 0x200F) ||
           (c >= 0x2028 && c <= 0x202F) || (c >= 0x205F && c <= 0x206F) || c == 0x3000 ||
           (c >= 0xE000 && c <= 0xF8FF) || c == 0xFEFF || c == 0xFFFD);
}

}  // namespace

bool Dict::Hashable(const Value& key) { return key.Is(Kind::kString) || key.Is(Kind::kNone) || key.IsNumber(); }

const Value* Dict::Find(const Value& key) const {
  if (!Hashable(key)) return nullptr;
  if (key.Is(Kind::kString)) return Find(*key.str);
  if (!index_.empty()) {
    auto it = index_.find(IndexKey(key));
    return it == index_.end() ? nullptr : &entries_[it->second].second;
  }
  for (const auto& [k, v] : entries_) {
    bool same = k.IsNumber() && key.IsNumber()
                    ? AsDouble(k) == AsDouble(key) && (k.Is(Kind::kFloat) || key.Is(Kind::kFloat) || k.i == key.i)
                    : k.kind == key.kind;  // None
    if (same) return &v;
  }
  return nullptr;
}

const Value* Dict::Find(std::string_view key) const {
  if (!index_.empty()) {
    auto it = index_.find("s" + std::string(key));
    return it == index_.end() ? nullptr : &entries_[it->second].second;
  }
  for (const auto& [k, v] : entries_) {
    if (k.Is(Kind::kString) && *k.str == key) return &v;
  }
  return nullptr;
}

void Dict::Set(Value key, Value value) {
  if (const Value* v = Find(key)) {
    *const_cast<Value*>(v) = std::move(value);
    return;
  }
  entries_.emplace_back(std::move(key), std::move(value));
  if (!index_.empty()) {
    index_.emplace(IndexKey(entries_.back().first), entries_.size() - 1);
  } else if (entries_.size() > 16) {
    for (size_t i = 0; i < entries_.size(); ++i) index_.emplace(IndexKey(entries_[i].first), i);
  }
}

namespace {

// Binds call arguments to a Python-style signature: positional first, then
// keywords by name. Absent parameters are nullptr.
struct Args {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keywords;

  std::vector<const Value*> Bind(std::string_view fn, std::initializer_list<std::string_view> params,
                                 int64_t pos) const {
    if (positional.size() > params.size()) {
      Fail(pos, std::string(fn) + "() takes at most " + std::to_string(params.size()) + " argument(s) (" +
                    std::to_string(positional.size()) + " given)");
    }
    std::vector<const Value*> out(params.size(), nullptr);
    for (size_t k = 0; k < positional.size(); ++k) out[k] = &positional[k];
    for (const auto& [name, value] : keywords) {
      auto it = std::find(params.begin(), params.end(), name);
      if (it == params.end()) Fail(pos, std::string(fn) + "() got an unexpected keyword argument '" + name + "'");
      const Value*& slot = out[static_cast<size_t>(it - params.begin())];
      if (slot) Fail(pos, std::string(fn) + "() got multiple values for argument '" + name + "'");
      slot = &value;
    }
    return out;
  }
  void NoKeywords(std::string_view fn, int64_t pos) const {
    if (!keywords.empty()) Fail(pos, std::string(fn) + "() takes no keyword arguments");
  }
};

class Renderer {
 public:
  Renderer(const Template& t, std::chrono::system_clock::time_point now) : t_(t), limits_(t.limits), now_(now) {}

  Renderer(const Renderer&) = delete;
  Renderer& operator=(const Renderer&) = delete;

  std::string Run(const Value& context) {
    auto root = std::make_shared<Scope>(nullptr);
    for (const auto& [k, v] : context.dict->entries()) root->vars[*k.str] = v;
    std::string out;
    out_ = &out;
    ExecBody(t_.body, root);
    return out;
  }

 private:
  enum class Flow { kNext, kBreak, kContinue };

  // Counts the evaluator's recursion; fails past max_depth.
  class Nest {
   public:
    Nest(Renderer* r, int64_t pos) : r_(r) {
      if (++r_->depth_ > r_->limits_.max_depth) {
        Fail(pos, "rendering nests deeper than max_depth (" + std::to_string(r_->limits_.max_depth) + ")");
      }
    }
    ~Nest() { --r_->depth_; }
    Nest(const Nest&) = delete;
    Nest& operator=(const Nest&) = delete;

   private:
    Renderer* r_;
  };

  void Step(int64_t pos, int64_t n = 1) {
    steps_ += n;
    if (steps_ > limits_.max_steps) {
      Fail(pos, "rendering takes more than max_steps (" + std::to_string(limits_.max_steps) + ")");
    }
  }
  void CheckSize(size_t bytes, int64_t pos) {
    if (static_cast<int64_t>(bytes) > limits_.max_output_bytes) {
      Fail(pos, "a string exceeds max_output_bytes (" + std::to_string(limits_.max_output_bytes) + ")");
    }
  }
  void Emit(std::string_view s, int64_t pos) {
    Step(pos, static_cast<int64_t>(s.size() / 16));
    out_->append(s);
    CheckSize(out_->size(), pos);
  }

  // ---- value construction (charged to the step budget) ----

  Value Str(std::string s, int64_t pos) {
    Step(pos, static_cast<int64_t>(s.size() / 16));
    CheckSize(s.size(), pos);
    return Value::String(std::move(s));
  }
  int DepthOf(const Value& v, int64_t pos) const {
    if (v.depth + 1 > limits_.max_depth) {
      Fail(pos, "a value nests deeper than max_depth (" + std::to_string(limits_.max_depth) + ")");
    }
    return v.depth + 1;
  }
  static bool HoldsNamespace(const Value& v) {
    return v.holds_namespace || v.Is(Kind::kNamespace) || v.Is(Kind::kLoop) || v.Is(Kind::kMethod);
  }
  Value MakeList(List items, int64_t pos, bool tuple = false) {
    Step(pos, static_cast<int64_t>(items.size()));
    Value v = Value::Of(Kind::kList);
    v.is_tuple = tuple;
    for (const Value& item : items) {
      v.depth = std::max(v.depth, DepthOf(item, pos));
      v.holds_namespace = v.holds_namespace || HoldsNamespace(item);
    }
    v.list = std::make_shared<const List>(std::move(items));
    return v;
  }
  Value MakeDict(std::shared_ptr<Dict> d, int64_t pos, Kind kind = Kind::kDict) {
    Step(pos, static_cast<int64_t>(d->size()));
    Value v = Value::Of(kind);
    for (const auto& entry : d->entries()) {
      v.depth = std::max(v.depth, DepthOf(entry.second, pos));
      v.holds_namespace = v.holds_namespace || HoldsNamespace(entry.second);
    }
    v.dict = std::move(d);
    return v;
  }
  // True when `target` is inside v: storing v in target would make a cycle.
  bool Reaches(const Value& v, const Dict* target, int depth, int64_t pos) {
    if (!HoldsNamespace(v)) return false;
    Step(pos);
    if (depth > limits_.max_depth) {
      Fail(pos, "a value nests deeper than max_depth (" + std::to_string(limits_.max_depth) + ")");
    }
    if (v.Is(Kind::kNamespace) && v.dict.get() == target) return true;
    if (const List* items = v.Is(Kind::kLoop) ? v.loop->items.get() : v.list.get()) {
      for (const Value& item : *items) {
        if (Reaches(item, target, depth + 1, pos)) return true;
      }
    }
    if (v.dict) {
      for (const auto& entry : v.dict->entries()) {
        if (Reaches(entry.second, target, depth + 1, pos)) return true;
      }
    }
    return false;
  }

  // ---- conversions ----

  [[noreturn]] static void FailUndefined(const Value& v, int64_t pos) { Fail(pos, v.str ? *v.str : "undefined"); }

  bool Truthy(const Value& v) const {
    switch (v.kind) {
      case Kind::kUndefined:
      case Kind::kNone:
        return false;
      case Kind::kBool:
      case Kind::kInt:
        return v.i != 0;
      case Kind::kFloat:
        return v.f != 0;
      case Kind::kString:
        return !v.str->empty();
      case Kind::kList:
        return !v.list->empty();
      case Kind::kDict:
        return v.dict->size() > 0;
      default:
        return true;
    }
  }

  // Python's str().
  std::string ToStr(const Value& v, int64_t pos) {
    switch (v.kind) {
      case Kind::kUndefined:
        return "";
      case Kind::kString:
        return *v.str;
      default: {
        std::string out;
        AppendRepr(&out, v, 0, pos);
        return out;
      }
    }
  }

  // Python's repr().
  void AppendRepr(std::string* out, const Value& v, int depth, int64_t pos) {
    Step(pos);
    CheckSize(out->size(), pos);
    if (depth > limits_.max_depth) Fail(pos, "a value nests deeper than max_depth (cyclic?)");
    switch (v.kind) {
      case Kind::kUndefined:
        *out += "Undefined";
        return;
      case Kind::kNone:
        *out += "None";
        return;
      case Kind::kBool:
        *out += v.i ? "True" : "False";
        return;
      case Kind::kInt:
        *out += std::to_string(v.i);
        return;
      case Kind::kFloat:
        *out += FormatFloat(v.f);
        return;
      case Kind::kString: {
        const std::string& s = *v.str;
        char quote = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
        *out += quote;
        for (size_t i = 0, len = 0; i < s.size(); i += len) {
          uint32_t cp = DecodeUtf8(s, i, &len);
          char buf[16];
          if (cp == static_cast<uint32_t>(quote) || cp == '\\') {
            *out += '\\';
            *out += static_cast<char>(cp);
          } else if (cp == '\n' || cp == '\r' || cp == '\t') {
            *out += cp == '\n' ? "\\n" : cp == '\r' ? "\\r" : "\\t";
          } else if (!IsPrintable(cp)) {
            std::snprintf(buf, sizeof(buf), cp < 0x100 ? "\\x%02x" : "\\u%04x", cp);
            *out += buf;
          } else {
            out->append(s, i, len);
          }
        }
        *out += quote;
        return;
      }
      case Kind::kList: {
        *out += v.is_tuple ? '(' : '[';
        for (size_t k = 0; k < v.list->size(); ++k) {
          if (k) *out += ", ";
          AppendRepr(out, (*v.list)[k], depth + 1, pos);
        }
        *out += v.is_tuple ? (v.list->size() == 1 ? ",)" : ")") : "]";
        return;
      }
      case Kind::kDict:
      case Kind::kNamespace: {
        *out += v.kind == Kind::kNamespace ? "<Namespace {" : "{";
        bool first = true;
        for (const auto& [k, item] : v.dict->entries()) {
          if (!first) *out += ", ";
          first = false;
          AppendRepr(out, k, depth + 1, pos);
          *out += ": ";
          AppendRepr(out, item, depth + 1, pos);
        }
        *out += v.kind == Kind::kNamespace ? "}>" : "}";
        return;
      }
      case Kind::kLoop:
        *out +=
            "<LoopContext " + std::to_string(v.loop->index0 + 1) + "/" + std::to_string(v.loop->items->size()) + ">";
        return;
      case Kind::kMacro:
        *out += "<Macro '" + v.macro->node->text + "'>";
        return;
      case Kind::kMethod:
        *out += "<built-in method " + *v.str + ">";
        return;
      case Kind::kFunction:
        *out += "<function " + *v.str + ">";
        return;
    }
  }

  struct JsonStyle {
    bool indent = false;
    std::string indent_unit;
    std::string item_sep = ", ";
    std::string key_sep = ": ";
    bool ensure_ascii = false;
    bool sort_keys = false;
  };

  static void AppendJsonString(std::string* out, std::string_view s, bool ensure_ascii) {
    *out += '"';
    for (size_t i = 0, len = 0; i < s.size(); i += len) {
      uint32_t cp = DecodeUtf8(s, i, &len);
      char buf[16];
      switch (cp) {
        case '"':
          *out += "\\\"";
          break;
        case '\\':
          *out += "\\\\";
          break;
        case '\n':
          *out += "\\n";
          break;
        case '\r':
          *out += "\\r";
          break;
        case '\t':
          *out += "\\t";
          break;
        case '\b':
          *out += "\\b";
          break;
        case '\f':
          *out += "\\f";
          break;
        default:
          if (cp < 0x20 || (ensure_ascii && cp >= 0x7F && cp < 0x10000)) {
            std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
            *out += buf;
          } else if (ensure_ascii && cp >= 0x10000) {
            std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xD800 + ((cp - 0x10000) >> 10), 0xDC00 + (cp & 0x3FF));
            *out += buf;
          } else {
            out->append(s, i, len);
          }
      }
    }
    *out += '"';
  }

  // Python's json.dumps().
  void AppendJson(std::string* out, const Value& v, const JsonStyle& style, int depth, int64_t pos) {
    Step(pos);
    CheckSize(out->size(), pos);
    if (depth > limits_.max_depth) Fail(pos, "a value nests deeper than max_depth (cyclic?)");
    auto newline = [&](int level) {
      if (!style.indent) return;
      *out += '\n';
      for (int k = 0; k < level; ++k) *out += style.indent_unit;
    };
    switch (v.kind) {
      case Kind::kNone:
        *out += "null";
        return;
      case Kind::kBool:
        *out += v.i ? "true" : "false";
        return;
      case Kind::kInt:
        *out += std::to_string(v.i);
        return;
      case Kind::kFloat:
        *out += std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity") : FormatFloat(v.f);
        return;
      case Kind::kString:
        AppendJsonString(out, *v.str, style.ensure_ascii);
        return;
      case Kind::kList: {
        if (v.list->empty()) {
          *out += "[]";
          return;
        }
        *out += '[';
        for (size_t k = 0; k < v.list->size(); ++k) {
          if (k) *out += style.item_sep;
          newline(depth + 1);
          AppendJson(out, (*v.list)[k], style, depth + 1, pos);
        }
        newline(depth);
        *out += ']';
        return;
      }
      case Kind::kDict: {
        if (v.dict->size() == 0) {
          *out += "{}";
          return;
        }
        std::vector<const std::pair<Value, Value>*> entries;
        for (const auto& e : v.dict->entries()) entries.push_back(&e);
        if (style.sort_keys) {
          std::stable_sort(entries.begin(), entries.end(),
                           [&](const std::pair<Value, Value>* a, const std::pair<Value, Value>* b) {
                             return Compare(a->first, b->first, "<", depth, pos) < 0;
                           });
        }
        *out += '{';
        for (size_t k = 0; k < entries.size(); ++k) {
          if (k) *out += style.item_sep;
          newline(depth + 1);
          const Value& key = entries[k]->first;  // json.dumps writes number, bool and None keys as strings
          AppendJsonString(out,
                           key.Is(Kind::kString) ? *key.str
                           : key.Is(Kind::kNone) ? "null"
                           : key.Is(Kind::kBool) ? (key.i ? "true" : "false")
                                                 : ToStr(key, pos),
                           style.ensure_ascii);
          *out += style.key_sep;
          AppendJson(out, entries[k]->second, style, depth + 1, pos);
        }
        newline(depth);
        *out += '}';
        return;
      }
      default:
        Fail(pos, "Object of type " + std::string(TypeName(v)) + " is not JSON serializable");
    }
  }

  bool Equal(const Value& a, const Value& b, int depth, int64_t pos) {
    Step(pos);
    if (depth > limits_.max_depth) Fail(pos, "a value nests deeper than max_depth (cyclic?)");
    if (a.IsNumber() && b.IsNumber()) {
      return a.kind != Kind::kFloat && b.kind != Kind::kFloat ? a.i == b.i : AsDouble(a) == AsDouble(b);
    }
    if (a.kind != b.kind) return false;
    switch (a.kind) {
      case Kind::kUndefined:
      case Kind::kNone:
        return true;
      case Kind::kString:
        return *a.str == *b.str;
      case Kind::kList:
        if (a.is_tuple != b.is_tuple || a.list->size() != b.list->size()) return false;
        for (size_t k = 0; k < a.list->size(); ++k) {
          if (!Equal((*a.list)[k], (*b.list)[k], depth + 1, pos)) return false;
        }
        return true;
      case Kind::kDict:
        if (a.dict->size() != b.dict->size()) return false;
        for (const auto& [k, v] : a.dict->entries()) {
          const Value* other = b.dict->Find(k);
          if (!other || !Equal(v, *other, depth + 1, pos)) return false;
        }
        return true;
      case Kind::kNamespace:
        return a.dict == b.dict;
      case Kind::kMacro:
        return a.macro == b.macro;
      default:
        return false;
    }
  }

  // <0, 0 or >0 as Python orders a and b; fails where Python raises TypeError.
  int Compare(const Value& a, const Value& b, std::string_view op, int depth, int64_t pos) {
    Step(pos);
    if (depth > limits_.max_depth) Fail(pos, "a value nests deeper than max_depth (cyclic?)");
    if (a.IsNumber() && b.IsNumber()) {
      if (a.kind != Kind::kFloat && b.kind != Kind::kFloat) return a.i < b.i ? -1 : a.i > b.i;
      double x = AsDouble(a), y = AsDouble(b);
      return x < y ? -1 : x > y;
    }
    if (a.Is(Kind::kString) && b.Is(Kind::kString)) return a.str->compare(*b.str);
    if (a.Is(Kind::kList) && b.Is(Kind::kList) && a.is_tuple == b.is_tuple) {
      for (size_t k = 0; k < std::min(a.list->size(), b.list->size()); ++k) {
        if (!Equal((*a.list)[k], (*b.list)[k], depth + 1, pos)) {
          return Compare((*a.list)[k], (*b.list)[k], op, depth + 1, pos);
        }
      }
      return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size();
    }
    if (a.Is(Kind::kUndefined)) FailUndefined(a, pos);
    if (b.Is(Kind::kUndefined)) FailUndefined(b, pos);
    Fail(pos, "'" + std::string(op) + "' not supported between instances of '" + std::string(TypeName(a)) + "' and '" +
                  std::string(TypeName(b)) + "'");
  }

  bool Contains(const Value& container, const Value& item, int64_t pos) {
    switch (container.kind) {
      case Kind::kUndefined:
        return false;
      case Kind::kString:
        if (!item.Is(Kind::kString)) {
          Fail(pos, "'in <string>' requires string as left operand, not " + std::string(TypeName(item)));
        }
        Step(pos, static_cast<int64_t>(container.str->size() / 16));
        return Find(*container.str, *item.str, 0) != std::string_view::npos;
      case Kind::kList:
        for (const Value& v : *container.list) {
          if (Equal(v, item, 0, pos)) return true;
        }
        return false;
      case Kind::kDict:
        if (!Dict::Hashable(item)) Fail(pos, "unhashable type: '" + std::string(TypeName(item)) + "'");
        return container.dict->Find(item) != nullptr;
      default:
        Fail(pos, "argument of type '" + std::string(TypeName(container)) + "' is not iterable");
    }
  }

  // The items a for loop or a filter walks: a list's items, a string's
  // characters, a dict's keys; nothing for undefined.
  std::shared_ptr<const List> Iterate(const Value& v, int64_t pos) {
    if (v.Is(Kind::kList)) return v.list;
    auto out = std::make_shared<List>();
    if (v.Is(Kind::kString)) {
      for (std::string_view c : CodePoints(*v.str)) out->push_back(Value::String(std::string(c)));
    } else if (v.Is(Kind::kDict)) {
      for (const auto& entry : v.dict->entries()) out->push_back(entry.first);
    } else if (!v.Is(Kind::kUndefined)) {
      Fail(pos, "'" + std::string(TypeName(v)) + "' object is not iterable");
    }
    Step(pos, static_cast<int64_t>(out->size()));
    return out;
  }

  // ---- variables ----

  Value Lookup(const std::string& name, const Scope* scope) const {
    for (; scope; scope = scope->parent.get()) {
      auto it = scope->vars.find(name);
      if (it != scope->vars.end()) return it->second;
    }
    if (name == "range" || name == "namespace" || name == "dict" || name == "raise_exception" ||
        name == "strftime_now") {
      Value f = Value::Of(Kind::kFunction);
      f.str = std::make_shared<const std::string>(name);
      return f;
    }
    return Value::Undefined("'" + name + "' is undefined");
  }

  void Assign(const std::vector<std::string>& names, const Value& v, Scope* scope, int64_t pos) {
    if (names.size() == 1) {
      scope->vars[names[0]] = v;
      return;
    }
    std::shared_ptr<const List> items = Iterate(v, pos);
    if (items->size() != names.size()) {
      Fail(pos, (items->size() > names.size() ? "too many values to unpack (expected "
                                              : "not enough values to unpack (expected ") +
                    std::to_string(names.size()) + ", got " + std::to_string(items->size()) + ")");
    }
    for (size_t k = 0; k < names.size(); ++k) scope->vars[names[k]] = (*items)[k];
  }

  // ---- statements ----

  Flow ExecBody(const Body& body, const ScopePtr& scope) {
    for (const NodePtr& n : body) {
      Flow f = Exec(*n, scope);
      if (f != Flow::kNext) return f;
    }
    return Flow::kNext;
  }

  std::string Capture(const Body& body, const ScopePtr& scope) {
    std::string buf;
    std::string* saved = out_;
    out_ = &buf;
    ExecBody(body, scope);
    out_ = saved;
    return buf;
  }

  Flow Exec(const Node& n, const ScopePtr& scope) {
    Nest nest(this, n.pos);
    Step(n.pos);
    switch (n.kind) {
      case Node::Kind::kText:
        Emit(n.text, n.pos);
        return Flow::kNext;
      case Node::Kind::kOutput: {
        Value v = Eval(*n.exprs[0], scope);
        if (v.Is(Kind::kString)) {
          Emit(*v.str, n.pos);
        } else {
          Emit(ToStr(v, n.pos), n.pos);
        }
        return Flow::kNext;
      }
      case Node::Kind::kIf:
        for (size_t k = 0; k < n.exprs.size(); ++k) {
          if (Truthy(Eval(*n.exprs[k], scope))) return ExecBody(n.bodies[k], scope);
        }
        return n.bodies.size() > n.exprs.size() ? ExecBody(n.bodies.back(), scope) : Flow::kNext;
      case Node::Kind::kFor:
        return ExecFor(n, scope);
      case Node::Kind::kSet: {
        Value v = Eval(*n.exprs[0], scope);
        if (n.attr.empty()) {
          Assign(n.names, v, scope.get(), n.pos);
          return Flow::kNext;
        }
        Value ns = Lookup(n.names[0], scope.get());
        if (!ns.Is(Kind::kNamespace)) Fail(n.pos, "cannot assign attribute on non-namespace object");
        DepthOf(v, n.pos);
        if (Reaches(v, ns.dict.get(), 0, n.pos)) Fail(n.pos, "a namespace cannot contain itself");
        ns.dict->Set(Value::String(n.attr), std::move(v));
        return Flow::kNext;
      }
      case Node::Kind::kSetBlock:
        scope->vars[n.names[0]] = Value::String(Capture(n.bodies[0], scope));
        return Flow::kNext;
      case Node::Kind::kMacro: {
        Value m = Value::Of(Kind::kMacro);
        m.macro = std::make_shared<const MacroInfo>(MacroInfo{&n, scope});
        scope->vars[n.text] = std::move(m);
        return Flow::kNext;
      }
      case Node::Kind::kBreak:
        return Flow::kBreak;
      case Node::Kind::kContinue:
        return Flow::kContinue;
      case Node::Kind::kFilterBlock: {
        auto s = std::make_shared<Scope>(scope);
        s->vars[std::string(kFilterBlockBody)] = Value::String(Capture(n.bodies[0], s));
        Value v = Eval(*n.exprs[0], s);
        Emit(v.Is(Kind::kString) ? *v.str : ToStr(v, n.pos), n.pos);
        return Flow::kNext;
      }
      case Node::Kind::kGeneration:
        Emit(Capture(n.bodies[0], std::make_shared<Scope>(scope)), n.pos);
        return Flow::kNext;
    }
    return Flow::kNext;
  }

  Flow ExecFor(const Node& n, const ScopePtr& scope) {
    std::shared_ptr<const List> items = Iterate(Eval(*n.exprs[0], scope), n.pos);
    if (n.exprs[1]) {  // {% for x in xs if cond %}: loop.* count only the items kept
      auto kept = std::make_shared<List>();
      for (const Value& item : *items) {
        auto s = std::make_shared<Scope>(scope);
        Assign(n.names, item, s.get(), n.pos);
        if (Truthy(Eval(*n.exprs[1], s))) kept->push_back(item);
      }
      items = std::move(kept);
    }
    if (items->empty()) return ExecBody(n.bodies[1], scope);
    for (size_t k = 0; k < items->size(); ++k) {
      Step(n.pos);
      auto s = std::make_shared<Scope>(scope);
      Assign(n.names, (*items)[k], s.get(), n.pos);
      Value loop = Value::Of(Kind::kLoop);
      loop.loop = std::make_shared<const LoopInfo>(LoopInfo{static_cast<int64_t>(k), items});
      s->vars["loop"] = std::move(loop);
      if (ExecBody(n.bodies[0], s) == Flow::kBreak) break;
    }
    return Flow::kNext;
  }

  // ---- expressions ----

  Value Eval(const Expr& e, const ScopePtr& scope) {
    Nest nest(this, e.pos);
    Step(e.pos);
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return e.literal;
      case Expr::Kind::kName:
        return Lookup(e.name, scope.get());
      case Expr::Kind::kList: {
        List items;
        for (const ExprPtr& a : e.args) items.push_back(Eval(*a, scope));
        return MakeList(std::move(items), e.pos, e.is_tuple);
      }
      case Expr::Kind::kDict: {
        auto d = std::make_shared<Dict>();
        for (size_t k = 0; k < e.args.size(); k += 2) {
          Value key = Eval(*e.args[k], scope);
          if (!Dict::Hashable(key)) Fail(e.args[k]->pos, "unhashable type: '" + std::string(TypeName(key)) + "'");
          d->Set(std::move(key), Eval(*e.args[k + 1], scope));
        }
        return MakeDict(std::move(d), e.pos);
      }
      case Expr::Kind::kGetattr:
        return GetAttr(Eval(*e.args[0], scope), e.name, e.pos);
      case Expr::Kind::kGetitem:
        return GetItem(Eval(*e.args[0], scope), Eval(*e.args[1], scope), e.pos);
      case Expr::Kind::kSlice: {
        Value obj = Eval(*e.args[0], scope);
        std::optional<int64_t> bounds[3];
        for (int k = 0; k < 3; ++k) {
          if (!e.args[k + 1]) continue;
          Value b = Eval(*e.args[k + 1], scope);
          if (b.Is(Kind::kInt) || b.Is(Kind::kBool)) {
            bounds[k] = b.i;
          } else if (!b.Is(Kind::kNone)) {
            Fail(e.args[k + 1]->pos, "slice indices must be integers or None");
          }
        }
        return SliceValue(obj, bounds, e.pos);
      }
      case Expr::Kind::kCall:
      case Expr::Kind::kFilter:
      case Expr::Kind::kTest: {
        Value first = Eval(*e.args[0], scope);
        Args args;
        size_t positional = e.args.size() - 1 - e.kwnames.size();
        for (size_t k = 1; k < e.args.size(); ++k) {
          Value v = Eval(*e.args[k], scope);
          if (k <= positional) {
            args.positional.push_back(std::move(v));
          } else {
            args.keywords.emplace_back(e.kwnames[k - 1 - positional], std::move(v));
          }
        }
        if (e.kind == Expr::Kind::kCall) return Call(first, args, e.pos);
        if (e.kind == Expr::Kind::kFilter) return Filter(e.name, first, args, e.pos);
        return Value::Bool(Test(e.name, first, args, e.pos) != e.negated);
      }
      case Expr::Kind::kNeg:
      case Expr::Kind::kPos: {
        Value v = Eval(*e.args[0], scope);
        if (v.Is(Kind::kUndefined)) FailUndefined(v, e.pos);
        if (!v.IsNumber()) {
          Fail(e.pos, "bad operand type for unary " + std::string(e.kind == Expr::Kind::kNeg ? "-" : "+") + ": '" +
                          std::string(TypeName(v)) + "'");
        }
        if (e.kind == Expr::Kind::kPos) return v.Is(Kind::kBool) ? Value::Int(v.i) : v;
        if (v.Is(Kind::kFloat)) return Value::Float(-v.f);
        if (v.i == INT64_MIN) Fail(e.pos, "integer overflow");
        return Value::Int(-v.i);
      }
      case Expr::Kind::kNot:
        return Value::Bool(!Truthy(Eval(*e.args[0], scope)));
      case Expr::Kind::kAnd:
      case Expr::Kind::kOr: {
        Value v;
        for (const ExprPtr& a : e.args) {
          v = Eval(*a, scope);
          if (Truthy(v) != (e.kind == Expr::Kind::kAnd)) break;
        }
        return v;
      }
      case Expr::Kind::kBinary: {
        Value v = Eval(*e.args[0], scope);
        for (size_t k = 1; k < e.args.size(); ++k) v = Binary(e.ops[k - 1], v, Eval(*e.args[k], scope), e.pos);
        return v;
      }
      case Expr::Kind::kCompare: {
        Value left = Eval(*e.args[0], scope);
        for (size_t k = 1; k < e.args.size(); ++k) {
          Value right = Eval(*e.args[k], scope);
          const std::string& op = e.ops[k - 1];
          bool ok = op == "=="       ? Equal(left, right, 0, e.pos)
                    : op == "!="     ? !Equal(left, right, 0, e.pos)
                    : op == "in"     ? Contains(right, left, e.pos)
                    : op == "not in" ? !Contains(right, left, e.pos)
                    : op == "<"      ? Compare(left, right, op, 0, e.pos) < 0
                    : op == ">"      ? Compare(left, right, op, 0, e.pos) > 0
                    : op == "<="     ? Compare(left, right, op, 0, e.pos) <= 0
                                     : Compare(left, right, op, 0, e.pos) >= 0;
          if (!ok) return Value::Bool(false);
          left = std::move(right);
        }
        return Value::Bool(true);
      }
      case Expr::Kind::kCond:
        if (Truthy(Eval(*e.args[1], scope))) return Eval(*e.args[0], scope);
        return e.args[2] ? Eval(*e.args[2], scope)
                         : Value::Undefined("the conditional expression's else branch is undefined");
    }
    return Value();
  }

  Value Binary(const std::string& op, const Value& a, const Value& b, int64_t pos) {
    if (op == "~") return Str(ToStr(a, pos) + ToStr(b, pos), pos);
    if (a.Is(Kind::kUndefined)) FailUndefined(a, pos);
    if (b.Is(Kind::kUndefined)) FailUndefined(b, pos);
    auto type_error = [&]() -> Value {
      Fail(pos, "unsupported operand type(s) for " + op + ": '" + std::string(TypeName(a)) + "' and '" +
                    std::string(TypeName(b)) + "'");
    };
    if (op == "+" && a.kind == b.kind && (a.Is(Kind::kString) || (a.Is(Kind::kList) && a.is_tuple == b.is_tuple))) {
      if (a.Is(Kind::kString)) return Str(*a.str + *b.str, pos);
      List items = *a.list;
      items.insert(items.end(), b.list->begin(), b.list->end());
      return MakeList(std::move(items), pos, a.is_tuple);
    }
    if (op == "*" && (a.Is(Kind::kString) || a.Is(Kind::kList) || b.Is(Kind::kString) || b.Is(Kind::kList))) {
      const Value& seq = a.IsNumber() ? b : a;
      const Value& times = a.IsNumber() ? a : b;
      if (!times.IsNumber() || times.Is(Kind::kFloat) || seq.IsNumber()) return type_error();
      int64_t n = std::max<int64_t>(times.i, 0);
      size_t unit = seq.Is(Kind::kString) ? seq.str->size() : seq.list->size();
      if (unit && n > limits_.max_output_bytes / static_cast<int64_t>(unit)) {
        Fail(pos, "repeating a sequence exceeds max_output_bytes (" + std::to_string(limits_.max_output_bytes) + ")");
      }
      if (seq.Is(Kind::kString)) {
        std::string s;
        for (int64_t k = 0; k < n; ++k) s += *seq.str;
        return Str(std::move(s), pos);
      }
      List items;
      for (int64_t k = 0; k < n; ++k) items.insert(items.end(), seq.list->begin(), seq.list->end());
      return MakeList(std::move(items), pos, seq.is_tuple);
    }
    if (!a.IsNumber() || !b.IsNumber()) {
      if (op == "%" && a.Is(Kind::kString)) Fail(pos, "'%' string formatting is not supported");
      return type_error();
    }
    bool ints = a.kind != Kind::kFloat && b.kind != Kind::kFloat;
    double x = AsDouble(a), y = AsDouble(b);
    int64_t r = 0;
    if (op == "/") {
      if (y == 0) Fail(pos, "division by zero");
      return Value::Float(x / y);
    }
    if ((op == "//" || op == "%") && (ints ? b.i == 0 : y == 0)) Fail(pos, "integer division or modulo by zero");
    if (!ints) {
      if (op == "+") return Value::Float(x + y);
      if (op == "-") return Value::Float(x - y);
      if (op == "*") return Value::Float(x * y);
      if (op == "**") return Value::Float(std::pow(x, y));
      double mod = std::fmod(x, y), div = (x - mod) / y;  // Python's float floor division and modulo
      if (mod != 0 && ((y < 0) != (mod < 0))) {
        mod += y;
        div -= 1.0;
      }
      double floor_div = std::floor(div);
      if (div - floor_div > 0.5) floor_div += 1.0;
      return Value::Float(op == "%" ? mod : floor_div);
    }
    bool overflow = false;
    if (op == "+") overflow = __builtin_add_overflow(a.i, b.i, &r);
    if (op == "-") overflow = __builtin_sub_overflow(a.i, b.i, &r);
    if (op == "*") overflow = __builtin_mul_overflow(a.i, b.i, &r);
    if (op == "//" || op == "%") {
      if (a.i == INT64_MIN && b.i == -1) Fail(pos, "integer overflow");
      int64_t q = a.i / b.i, m = a.i % b.i;
      if (m != 0 && ((m < 0) != (b.i < 0))) {
        --q;
        m += b.i;
      }
      r = op == "//" ? q : m;
    }
    if (op == "**") {
      if (b.i < 0) return Value::Float(std::pow(x, y));
      r = 1;
      for (int64_t k = 0; k < b.i && !overflow; ++k) {
        overflow = __builtin_mul_overflow(r, a.i, &r);
        if (r == 0 || r == 1) break;
        Step(pos);
      }
      if (r == 1 && a.i == -1) r = b.i % 2 ? -1 : 1;
    }
    if (overflow) Fail(pos, "integer overflow");
    return Value::Int(r);
  }

  // ---- attributes, items and slices ----

  static bool IsMethodOf(const Value& v, std::string_view name) {
    static constexpr std::string_view kStr[] = {"strip",    "lstrip", "rstrip", "split", "startswith",
                                                "endswith", "upper",  "lower",  "title", "capitalize",
                                                "replace",  "format", "join",   "find",  "count"};
    static constexpr std::string_view kDictMethods[] = {"items",   "keys",       "values", "get",  "pop",
                                                        "popitem", "setdefault", "update", "clear"};
    static constexpr std::string_view kList[] = {"append", "extend", "insert", "pop",
                                                 "remove", "clear",  "sort",   "reverse"};
    auto in = [&](const auto& names) { return std::find(std::begin(names), std::end(names), name) != std::end(names); };
    return (v.Is(Kind::kString) && in(kStr)) || (v.Is(Kind::kDict) && in(kDictMethods)) ||
           (v.Is(Kind::kList) && in(kList)) || (v.Is(Kind::kLoop) && name == "cycle");
  }

  Value GetAttr(const Value& obj, const std::string& name, int64_t pos) {
    if (obj.Is(Kind::kUndefined)) FailUndefined(obj, pos);
    if (IsMethodOf(obj, name)) {
      Value m = Value::Of(Kind::kMethod);
      m.str = std::make_shared<const std::string>(name);
      m.list = std::make_shared<const List>(List{obj});
      return m;
    }
    if (obj.Is(Kind::kDict) || obj.Is(Kind::kNamespace)) {
      if (const Value* v = obj.dict->Find(name)) return *v;
    }
    if (obj.Is(Kind::kLoop)) {
      const LoopInfo& l = *obj.loop;
      int64_t n = static_cast<int64_t>(l.items->size());
      if (name == "index") return Value::Int(l.index0 + 1);
      if (name == "index0") return Value::Int(l.index0);
      if (name == "revindex") return Value::Int(n - l.index0);
      if (name == "revindex0") return Value::Int(n - l.index0 - 1);
      if (name == "first") return Value::Bool(l.index0 == 0);
      if (name == "last") return Value::Bool(l.index0 == n - 1);
      if (name == "length") return Value::Int(n);
      if (name == "depth") return Value::Int(1);
      if (name == "depth0") return Value::Int(0);
      if (name == "previtem" && l.index0 > 0) return (*l.items)[static_cast<size_t>(l.index0 - 1)];
      if (name == "nextitem" && l.index0 + 1 < n) return (*l.items)[static_cast<size_t>(l.index0 + 1)];
    }
    return Value::Undefined("'" + std::string(TypeName(obj)) + " object' has no attribute '" + name + "'");
  }

  Value GetItem(const Value& obj, const Value& key, int64_t pos) {
    if (obj.Is(Kind::kUndefined)) FailUndefined(obj, pos);
    if ((key.Is(Kind::kInt) || key.Is(Kind::kBool)) && (obj.Is(Kind::kList) || obj.Is(Kind::kString))) {
      std::vector<std::string_view> cps;
      if (obj.Is(Kind::kString)) {
        Step(pos, static_cast<int64_t>(obj.str->size() / 16));
        cps = CodePoints(*obj.str);
      }
      int64_t n = static_cast<int64_t>(obj.Is(Kind::kList) ? obj.list->size() : cps.size());
      int64_t k = key.i < 0 ? key.i + n : key.i;
      if (k >= 0 && k < n) {
        return obj.Is(Kind::kList) ? (*obj.list)[static_cast<size_t>(k)]
                                   : Value::String(std::string(cps[static_cast<size_t>(k)]));
      }
      return Value::Undefined(std::string(TypeName(obj)) + " object has no element " + std::to_string(key.i));
    }
    if ((obj.Is(Kind::kDict) || obj.Is(Kind::kNamespace)) && obj.dict->Find(key)) return *obj.dict->Find(key);
    if (key.Is(Kind::kString)) return GetAttr(obj, *key.str, pos);
    return Value::Undefined("'" + std::string(TypeName(obj)) + " object' has no element " + ToStr(key, pos));
  }

  Value SliceValue(const Value& obj, const std::optional<int64_t> (&b)[3], int64_t pos) {
    if (obj.Is(Kind::kUndefined)) FailUndefined(obj, pos);
    if (!obj.Is(Kind::kList) && !obj.Is(Kind::kString)) {
      return Value::Undefined("'" + std::string(TypeName(obj)) + "' object is not subscriptable");
    }
    std::vector<std::string_view> cps;
    if (obj.Is(Kind::kString)) cps = CodePoints(*obj.str);
    int64_t n = static_cast<int64_t>(obj.Is(Kind::kList) ? obj.list->size() : cps.size());
    int64_t step = b[2].value_or(1);
    if (step == 0) Fail(pos, "slice step cannot be zero");
    auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {
      if (!v) return dflt;
      int64_t x = *v < 0 ? std::max<int64_t>(*v, -n - 1) + n : *v;
      return step > 0 ? std::clamp<int64_t>(x, 0, n) : std::clamp<int64_t>(x, -1, n - 1);
    };
    int64_t start = clamp(b[0], step > 0 ? 0 : n - 1), stop = clamp(b[1], step > 0 ? n : -1);
    List items;
    std::string s;
    for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
      if (obj.Is(Kind::kList)) {
        items.push_back((*obj.list)[static_cast<size_t>(k)]);
      } else {
        s += cps[static_cast<size_t>(k)];
      }
    }
    return obj.Is(Kind::kList) ? MakeList(std::move(items), pos, obj.is_tuple) : Str(std::move(s), pos);
  }

  // Jinja2's attribute='a.b.0' paths (selectattr, map, sort, ...).
  Value GetPath(const Value& obj, const std::string& path, int64_t pos) {
    Value v = obj;
    for (const std::string& part : Split(path, &kDot, -1, pos)) {
      int64_t k = 0;
      auto r = std::from_chars(part.data(), part.data() + part.size(), k);
      v = GetItem(v, r.ec == std::errc() && r.ptr == part.data() + part.size() ? Value::Int(k) : Value::String(part),
                  pos);
      if (v.Is(Kind::kUndefined)) break;
    }
    return v;
  }
  inline static const std::string kDot = ".";

  // ---- calls ----

  Value Call(const Value& callee, const Args& args, int64_t pos) {
    switch (callee.kind) {
      case Kind::kMacro:
        return CallMacro(*callee.macro, args, pos);
      case Kind::kMethod:
        return CallMethod((*callee.list)[0], *callee.str, args, pos);
      case Kind::kFunction:
        return CallFunction(*callee.str, args, pos);
      case Kind::kUndefined:
        FailUndefined(callee, pos);
      default:
        Fail(pos, "'" + std::string(TypeName(callee)) + "' object is not callable");
    }
  }

  Value CallMacro(const MacroInfo& m, const Args& args, int64_t pos) {
    const Node& n = *m.node;
    if (args.positional.size() > n.names.size()) {
      Fail(pos, "macro '" + n.text + "' takes not more than " + std::to_string(n.names.size()) + " argument(s)");
    }
    ScopePtr defined_in = m.scope.lock();
    if (!defined_in) Fail(pos, "macro '" + n.text + "' is called after the block it was defined in ended");
    auto s = std::make_shared<Scope>(defined_in);
    std::vector<const Value*> bound(n.names.size(), nullptr);
    for (size_t k = 0; k < args.positional.size(); ++k) bound[k] = &args.positional[k];
    for (const auto& [name, v] : args.keywords) {
      auto it = std::find(n.names.begin(), n.names.end(), name);
      if (it == n.names.end()) Fail(pos, "macro '" + n.text + "' takes no keyword argument '" + name + "'");
      bound[static_cast<size_t>(it - n.names.begin())] = &v;
    }
    for (size_t k = 0; k < n.names.size(); ++k) {
      s->vars[n.names[k]] = bound[k]     ? *bound[k]
                            : n.exprs[k] ? Eval(*n.exprs[k], s)
                                         : Value::Undefined("'" + n.names[k] + "' is undefined");
    }
    return Str(Capture(n.bodies[0], s), pos);
  }

  Value CallFunction(const std::string& name, const Args& args, int64_t pos) {
    if (name == "raise_exception") {
      auto a = args.Bind(name, {"message"}, pos);
      Fail(pos, "raise_exception: " + (a[0] ? ToStr(*a[0], pos) : std::string()));
    }
    if (name == "strftime_now") {
      auto a = args.Bind(name, {"format"}, pos);
      if (!a[0] || !a[0]->Is(Kind::kString)) Fail(pos, "strftime_now() takes a format string");
      std::time_t t = std::chrono::system_clock::to_time_t(now_);
      std::tm tm{};
      gmtime_r(&t, &tm);
      CheckSize(a[0]->str->size() * 64 + 64, pos);
      std::string buf(a[0]->str->size() * 64 + 64, '\0');
      buf.resize(std::strftime(buf.data(), buf.size(), a[0]->str->c_str(), &tm));
      return Str(std::move(buf), pos);
    }
    if (name == "range") {
      args.NoKeywords(name, pos);
      std::vector<int64_t> v;
      for (const Value& a : args.positional) {
        if (!a.Is(Kind::kInt) && !a.Is(Kind::kBool)) {
          Fail(pos, "range() takes integers, not '" + std::string(TypeName(a)) + "'");
        }
        v.push_back(a.i);
      }
      if (v.empty() || v.size() > 3) Fail(pos, "range() takes 1 to 3 arguments");
      int64_t start = v.size() > 1 ? v[0] : 0, stop = v.size() > 1 ? v[1] : v[0], step = v.size() > 2 ? v[2] : 1;
      if (step == 0) Fail(pos, "range() arg 3 must not be zero");
      List items;
      for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
        if (items.size() >= static_cast<size_t>(kMaxRange)) {
          Fail(pos, "range() is too big: the sandbox allows at most " + std::to_string(kMaxRange) + " items");
        }
        items.push_back(Value::Int(k));
        if ((step > 0 && k > INT64_MAX - step) || (step < 0 && k < INT64_MIN - step)) break;
      }
      return MakeList(std::move(items), pos);
    }
    // namespace(...) and dict(...): from an optional dict, then keyword arguments.
    if (args.positional.size() > 1 || (args.positional.size() == 1 && !args.positional[0].Is(Kind::kDict))) {
      Fail(pos, name + "() takes a dict and keyword arguments");
    }
    auto d = std::make_shared<Dict>();
    if (!args.positional.empty()) *d = *args.positional[0].dict;
    for (const auto& [k, v] : args.keywords) d->Set(Value::String(k), v);
    return MakeDict(std::move(d), pos, name == "namespace" ? Kind::kNamespace : Kind::kDict);
  }

  const std::string* OptStr(const Value* v, std::string_view what, int64_t pos) {
    if (!v || v->Is(Kind::kNone)) return nullptr;
    if (!v->Is(Kind::kString)) {
      Fail(pos, std::string(what) + " must be a string, not '" + std::string(TypeName(*v)) + "'");
    }
    return v->str.get();
  }
  const std::string& ReqStr(const Value* v, std::string_view what, int64_t pos) {
    const std::string* s = OptStr(v, what, pos);
    if (!s) Fail(pos, std::string(what) + " is required");
    return *s;
  }
  int64_t OptInt(const Value* v, int64_t dflt, std::string_view what, int64_t pos) {
    if (!v || v->Is(Kind::kNone)) return dflt;
    if (!v->Is(Kind::kInt) && !v->Is(Kind::kBool)) Fail(pos, std::string(what) + " must be an integer");
    return v->i;
  }

  Value CallMethod(const Value& self, const std::string& name, const Args& args, int64_t pos) {
    if (self.Is(Kind::kList) ||
        (self.Is(Kind::kDict) && name != "items" && name != "keys" && name != "values" && name != "get")) {
      Fail(pos, "access to attribute '" + name + "' of '" + std::string(TypeName(self)) + "' object is unsafe");
    }
    if (self.Is(Kind::kLoop)) {  // loop.cycle(a, b, ...)
      args.NoKeywords(name, pos);
      if (args.positional.empty()) Fail(pos, "no items for cycling given");
      return args.positional[static_cast<size_t>(self.loop->index0) % args.positional.size()];
    }
    if (self.Is(Kind::kDict)) {
      if (name == "get") {
        auto a = args.Bind(name, {"key", "default"}, pos);
        if (!a[0]) Fail(pos, "get() takes a key");
        const Value* v = self.dict->Find(*a[0]);
        return v ? *v : a[1] ? *a[1] : Value::None();
      }
      args.Bind(name, {}, pos);
      List out;
      for (const auto& [k, v] : self.dict->entries()) {
        if (name == "items") {
          out.push_back(MakeList({k, v}, pos, true));
        } else {
          out.push_back(name == "keys" ? k : v);
        }
      }
      return MakeList(std::move(out), pos);
    }
    const std::string& s = *self.str;
    Step(pos, static_cast<int64_t>(s.size() / 16));
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      auto a = args.Bind(name, {"chars"}, pos);
      return Str(Strip(s, OptStr(a[0], "chars", pos), name != "rstrip", name != "lstrip"), pos);
    }
    if (name == "split") {
      auto a = args.Bind(name, {"sep", "maxsplit"}, pos);
      List out;
      for (std::string& part : Split(s, OptStr(a[0], "sep", pos), OptInt(a[1], -1, "maxsplit", pos), pos)) {
        out.push_back(Value::String(std::move(part)));
      }
      return MakeList(std::move(out), pos);
    }
    if (name == "startswith" || name == "endswith") {
      auto a = args.Bind(name, {"prefix"}, pos);
      std::vector<Value> options =
          a[0] && a[0]->Is(Kind::kList) && a[0]->is_tuple ? *a[0]->list : std::vector<Value>{a[0] ? *a[0] : Value()};
      for (const Value& o : options) {
        const std::string& p = ReqStr(&o, name + "() argument", pos);
        bool hit = name == "startswith" ? s.compare(0, p.size(), p) == 0
                                        : s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
        if (hit) return Value::Bool(true);
      }
      return Value::Bool(false);
    }
    if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
      args.Bind(name, {}, pos);
      return Str(name == "title"        ? PyTitle(s)
                 : name == "capitalize" ? Capitalize(s)
                                        : MapCase(s, name == "upper"),
                 pos);
    }
    if (name == "replace") {
      auto a = args.Bind(name, {"old", "new", "count"}, pos);
      return Str(Replace(s, ReqStr(a[0], "old", pos), ReqStr(a[1], "new", pos), OptInt(a[2], -1, "count", pos)), pos);
    }
    if (name == "find" || name == "count") {
      auto a = args.Bind(name, {"sub"}, pos);
      const std::string& sub = ReqStr(a[0], "sub", pos);
      if (name == "find") {
        size_t at = Find(s, sub, 0);
        return Value::Int(at == std::string::npos ? -1 : static_cast<int64_t>(CodePointCount(s.substr(0, at))));
      }
      if (sub.empty()) return Value::Int(static_cast<int64_t>(CodePointCount(s)) + 1);
      int64_t n = 0;
      for (size_t at = Find(s, sub, 0); at != std::string::npos; at = Find(s, sub, at + sub.size())) ++n;
      return Value::Int(n);
    }
    if (name == "join") {
      auto a = args.Bind(name, {"iterable"}, pos);
      std::string out;
      bool first = true;
      std::shared_ptr<const List> items = Iterate(a[0] ? *a[0] : Value(), pos);
      for (const Value& v : *items) {
        if (!first) out += s;
        first = false;
        out += ReqStr(&v, "join() item", pos);
        CheckSize(out.size(), pos);
      }
      return Str(std::move(out), pos);
    }
    return Str(Format(s, args, pos), pos);
  }

  // str.format with {}, {0} and {name} fields (no format specs).
  std::string Format(const std::string& s, const Args& args, int64_t pos) {
    std::string out;
    size_t auto_index = 0;
    for (size_t i = 0; i < s.size(); ++i) {
      char c = s[i];
      if ((c == '{' || c == '}') && i + 1 < s.size() && s[i + 1] == c) {
        out += c;
        ++i;
        continue;
      }
      if (c == '}') Fail(pos, "format(): single '}' encountered in format string");
      if (c != '{') {
        out += c;
        continue;
      }
      size_t end = s.find('}', i);
      if (end == std::string::npos) Fail(pos, "format(): single '{' encountered in format string");
      std::string field = s.substr(i + 1, end - i - 1);
      if (field.find_first_of(":!.[") != std::string::npos) Fail(pos, "format(): format specs are not supported");
      const Value* v = nullptr;
      size_t index = 0;
      auto r = std::from_chars(field.data(), field.data() + field.size(), index);
      if (field.empty() || (r.ec == std::errc() && r.ptr == field.data() + field.size())) {
        if (field.empty()) index = auto_index++;
        if (index < args.positional.size()) v = &args.positional[index];
      } else {
        for (const auto& [k, kv] : args.keywords) {
          if (k == field) v = &kv;
        }
      }
      if (!v) Fail(pos, "format(): no argument for field {" + field + "}");
      out += ToStr(*v, pos);
      CheckSize(out.size(), pos);
      i = end;
    }
    return out;
  }

  // ---- filters and tests ----

  // Applies test `name` (with `args`) to each item; select/reject and *attr.
  List SelectItems(const Value& v, const Args& args, bool by_attr, bool keep, int64_t pos) {
    args.NoKeywords(by_attr ? "selectattr" : "select", pos);
    size_t first_arg = by_attr ? 1 : 0;
    if (by_attr && args.positional.empty()) Fail(pos, "selectattr()/rejectattr() take an attribute name");
    const std::string* attr = by_attr ? &ReqStr(&args.positional[0], "attribute", pos) : nullptr;
    Args test_args;
    std::string test = "truthy";
    if (args.positional.size() > first_arg) {
      test = ReqStr(&args.positional[first_arg], "test name", pos);
      test_args.positional.assign(args.positional.begin() + static_cast<int64_t>(first_arg) + 1, args.positional.end());
    }
    List out;
    std::shared_ptr<const List> items = Iterate(Truthy(v) ? v : Value(), pos);  // Jinja2: nothing from a falsy value
    for (const Value& item : *items) {
      Value x = attr ? GetPath(item, *attr, pos) : item;
      bool pass = test == "truthy" ? Truthy(x) : Test(test, x, test_args, pos);
      if (pass == keep) out.push_back(item);
    }
    return out;
  }

  Value SortKey(const Value& v, const std::string* attr, bool case_sensitive, int64_t pos) {
    Value k = attr ? GetPath(v, *attr, pos) : v;
    return !case_sensitive && k.Is(Kind::kString) ? Value::String(MapCase(*k.str, false)) : k;
  }

  Value Filter(const std::string& name, const Value& v, const Args& args, int64_t pos) {
    auto text = [&]() { return ToStr(v, pos); };
    if (name == "safe" || name == "string") return v.Is(Kind::kString) ? v : Str(text(), pos);  // safe: Markup(str(v))
    if (name == "upper" || name == "lower" || name == "capitalize") {
      args.Bind(name, {}, pos);
      return Str(name == "capitalize" ? Capitalize(text()) : MapCase(text(), name == "upper"), pos);
    }
    if (name == "title") {  // Jinja2's: words start after -, whitespace and opening brackets
      std::string s = text(), out;
      bool start = true;
      for (size_t i = 0, len = 0; i < s.size(); i += len) {
        uint32_t cp = DecodeUtf8(s, i, &len);
        bool delimiter = IsSpace(cp) || cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<';
        if (len == 1) {
          out += start ? Upper(s[i]) : Lower(s[i]);
        } else {
          out.append(s, i, len);
        }
        start = delimiter;
      }
      return Str(std::move(out), pos);
    }
    if (name == "trim") {
      auto a = args.Bind(name, {"chars"}, pos);
      return Str(Strip(text(), OptStr(a[0], "chars", pos), true, true), pos);
    }
    if (name == "replace") {
      auto a = args.Bind(name, {"old", "new", "count"}, pos);
      return Str(Replace(text(), ReqStr(a[0], "old", pos), ReqStr(a[1], "new", pos), OptInt(a[2], -1, "count", pos)),
                 pos);
    }
    if (name == "e" || name == "escape") {
      std::string out;
      for (char c : text()) {
        out += c == '&'    ? "&amp;"
               : c == '<'  ? "&lt;"
               : c == '>'  ? "&gt;"
               : c == '"'  ? "&#34;"
               : c == '\'' ? "&#39;"
                           : std::string(1, c);
      }
      return Str(std::move(out), pos);
    }
    if (name == "indent") {
      auto a = args.Bind(name, {"width", "first", "blank"}, pos);
      if (v.Is(Kind::kUndefined)) FailUndefined(v, pos);
      std::string unit =
          a[0] && a[0]->Is(Kind::kString)
              ? *a[0]->str
              : std::string(static_cast<size_t>(std::clamp<int64_t>(OptInt(a[0], 4, "width", pos), 0, 1024)), ' ');
      bool first = a[1] && Truthy(*a[1]), blank = a[2] && Truthy(*a[2]);
      std::string s = text() + "\n", out;
      std::vector<std::string_view> lines = SplitLines(s);
      for (size_t k = 0; k < lines.size(); ++k) {
        if (k) out += "\n";
        if ((k || first) && (blank || !lines[k].empty() || (k == 0 && first))) out += unit;
        out += lines[k];
        CheckSize(out.size(), pos);
      }
      return Str(std::move(out), pos);
    }
    if (name == "d" || name == "default") {
      auto a = args.Bind(name, {"default_value", "boolean"}, pos);
      bool use_default = v.Is(Kind::kUndefined) || (a[1] && Truthy(*a[1]) && !Truthy(v));
      return use_default ? (a[0] ? *a[0] : Value::String("")) : v;
    }
    if (name == "length" || name == "count") {
      args.Bind(name, {}, pos);
      switch (v.kind) {
        case Kind::kUndefined:
          return Value::Int(0);
        case Kind::kString:
          return Value::Int(static_cast<int64_t>(CodePointCount(*v.str)));
        case Kind::kList:
          return Value::Int(static_cast<int64_t>(v.list->size()));
        case Kind::kDict:
          return Value::Int(static_cast<int64_t>(v.dict->size()));
        default:
          Fail(pos, "object of type '" + std::string(TypeName(v)) + "' has no len()");
      }
    }
    if (name == "tojson") {
      auto a = args.Bind(name, {"ensure_ascii", "indent", "separators", "sort_keys"}, pos);
      JsonStyle style;
      style.ensure_ascii = a[0] && Truthy(*a[0]);
      style.sort_keys = a[3] && Truthy(*a[3]);
      if (a[1] && !a[1]->Is(Kind::kNone)) {
        style.indent = true;
        style.item_sep = ",";
        style.indent_unit =
            a[1]->Is(Kind::kString)
                ? *a[1]->str
                : std::string(static_cast<size_t>(std::clamp<int64_t>(OptInt(a[1], 0, "indent", pos), 0, 1024)), ' ');
      }
      if (a[2] && !a[2]->Is(Kind::kNone)) {
        if (!a[2]->Is(Kind::kList) || a[2]->list->size() != 2) {
          Fail(pos, "tojson(separators=) takes (item_separator, key_separator)");
        }
        style.item_sep = ReqStr(&(*a[2]->list)[0], "item separator", pos);
        style.key_sep = ReqStr(&(*a[2]->list)[1], "key separator", pos);
      }
      std::string out;
      AppendJson(&out, v, style, 0, pos);
      return Str(std::move(out), pos);
    }
    if (name == "first" || name == "last") {
      args.Bind(name, {}, pos);
      std::shared_ptr<const List> items = Iterate(v, pos);
      if (items->empty()) return Value::Undefined("'" + name + "' of an empty sequence is undefined");
      return name == "first" ? items->front() : items->back();
    }
    if (name == "list") return MakeList(*Iterate(v, pos), pos);
    if (name == "reverse") {
      if (v.Is(Kind::kString)) {
        std::vector<std::string_view> cps = CodePoints(*v.str);
        std::string out;
        for (size_t k = cps.size(); k-- > 0;) out += cps[k];
        return Str(std::move(out), pos);
      }
      List items = *Iterate(v, pos);
      std::reverse(items.begin(), items.end());
      return MakeList(std::move(items), pos);
    }
    if (name == "items") {
      if (v.Is(Kind::kUndefined)) return MakeList({}, pos);
      if (!v.Is(Kind::kDict)) Fail(pos, "can only get item pairs from a mapping");
      return CallMethod(v, "items", Args{}, pos);
    }
    if (name == "join") {
      auto a = args.Bind(name, {"d", "attribute"}, pos);
      const std::string* sep = OptStr(a[0], "separator", pos);
      const std::string* attr = OptStr(a[1], "attribute", pos);
      std::string out;
      bool first = true;
      std::shared_ptr<const List> items = Iterate(v, pos);
      for (const Value& item : *items) {
        if (!first && sep) out += *sep;
        first = false;
        out += ToStr(attr ? GetPath(item, *attr, pos) : item, pos);
        CheckSize(out.size(), pos);
      }
      return Str(std::move(out), pos);
    }
    if (name == "map") {
      List out;
      const std::string* attr = nullptr;
      const Value* dflt = nullptr;
      for (const auto& [k, kv] : args.keywords) {
        if (k == "attribute") attr = &ReqStr(&kv, "attribute", pos);
        if (k == "default") dflt = &kv;
      }
      if (!attr && (args.positional.empty() || !IsKnownFilter(ReqStr(&args.positional[0], "filter name", pos)))) {
        Fail(pos, "map() takes attribute= or the name of a known filter");
      }
      Args rest;
      if (!attr) rest.positional.assign(args.positional.begin() + 1, args.positional.end());
      std::shared_ptr<const List> items = Iterate(Truthy(v) ? v : Value(), pos);  // Jinja2: nothing from a falsy value
      for (const Value& item : *items) {
        if (attr) {
          Value x = GetPath(item, *attr, pos);
          out.push_back(x.Is(Kind::kUndefined) && dflt ? *dflt : x);
        } else {
          out.push_back(Filter(*args.positional[0].str, item, rest, pos));
        }
      }
      return MakeList(std::move(out), pos);
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      return MakeList(SelectItems(v, args, name.size() > 6, name[0] == 's', pos), pos);
    }
    if (name == "unique" || name == "sort" || name == "min" || name == "max" || name == "dictsort") {
      auto a = name == "sort"       ? args.Bind(name, {"reverse", "case_sensitive", "attribute"}, pos)
               : name == "dictsort" ? args.Bind(name, {"case_sensitive", "by", "reverse"}, pos)
                                    : args.Bind(name, {"case_sensitive", "attribute"}, pos);
      std::string item_index;  // dictsort: sorts its (key, value) items by item 0 or 1
      if (name == "dictsort") {
        if (!v.Is(Kind::kDict)) Fail(pos, "dictsort() takes a dict, not '" + std::string(TypeName(v)) + "'");
        const std::string* by = OptStr(a[1], "by", pos);
        if (by && *by != "key" && *by != "value") Fail(pos, "dictsort() can only sort by 'key' or 'value'");
        a = {a[2], a[0], nullptr};
        item_index = by && *by == "value" ? "1" : "0";
      } else if (name != "sort") {
        a.insert(a.begin(), nullptr);
      }
      bool reverse = a[0] && Truthy(*a[0]), case_sensitive = a[1] && Truthy(*a[1]);
      const std::string* attr = name == "dictsort" ? &item_index : OptStr(a[2], "attribute", pos);
      std::shared_ptr<const List> items =
          name == "dictsort" ? CallMethod(v, "items", Args{}, pos).list : Iterate(v, pos);
      List out;
      std::vector<Value> keys;
      for (const Value& item : *items) {
        Value key = SortKey(item, attr, case_sensitive, pos);
        if (name == "unique") {
          bool seen = false;
          for (const Value& k : keys) seen = seen || Equal(k, key, 0, pos);
          if (seen) continue;
        } else if ((name == "min" || name == "max") && !out.empty()) {
          int c = Compare(key, keys[0], "<", 0, pos);
          if (name == "min" ? c >= 0 : c <= 0) continue;
          out.clear();
          keys.clear();
        }
        keys.push_back(std::move(key));
        out.push_back(item);
      }
      if (name == "min" || name == "max") {
        return out.empty() ? Value::Undefined("no " + name + " of an empty sequence") : out[0];
      }
      if (name == "sort" || name == "dictsort") {
        std::vector<size_t> order(out.size());
        for (size_t k = 0; k < order.size(); ++k) order[k] = k;
        std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
          return reverse ? Compare(keys[y], keys[x], "<", 0, pos) < 0 : Compare(keys[x], keys[y], "<", 0, pos) < 0;
        });
        List sorted;
        for (size_t k : order) sorted.push_back(out[k]);
        out = std::move(sorted);
      }
      return MakeList(std::move(out), pos);
    }
    if (name == "sum") {
      auto a = args.Bind(name, {"attribute", "start"}, pos);
      const std::string* attr = OptStr(a[0], "attribute", pos);
      Value total = a[1] ? *a[1] : Value::Int(0);
      std::shared_ptr<const List> items = Iterate(v, pos);
      for (const Value& item : *items) total = Binary("+", total, attr ? GetPath(item, *attr, pos) : item, pos);
      return total;
    }
    if (name == "abs") {
      if (!v.IsNumber()) Fail(pos, "bad operand type for abs(): '" + std::string(TypeName(v)) + "'");
      if (v.Is(Kind::kFloat)) return Value::Float(std::fabs(v.f));
      if (v.i == INT64_MIN) Fail(pos, "integer overflow");
      return Value::Int(std::abs(v.i));
    }
    if (name == "int" || name == "float") return ToNumber(name == "int", v, args, pos);
    if (name == "round") {
      auto a = args.Bind(name, {"precision", "method"}, pos);
      int64_t precision = OptInt(a[0], 0, "precision", pos);
      const std::string* method = OptStr(a[1], "method", pos);
      if (method && *method != "common" && *method != "floor" && *method != "ceil") {
        Fail(pos, "round() method must be 'common', 'ceil' or 'floor'");
      }
      if (!v.IsNumber()) Fail(pos, "round() takes a number, not '" + std::string(TypeName(v)) + "'");
      if (!v.Is(Kind::kFloat) && (!method || *method == "common")) {  // Python's round(int, n): half to even
        if (precision >= 0) return Value::Int(v.i);
        if (precision < -18) return Value::Int(0);
        int64_t unit = 1;
        for (int64_t k = 0; k < -precision; ++k) unit *= 10;
        int64_t q = v.i / unit, r = v.i % unit;
        if (r < 0) {
          --q;
          r += unit;
        }
        if (2 * r > unit || (2 * r == unit && q % 2 != 0)) ++q;
        int64_t rounded = 0;
        if (__builtin_mul_overflow(q, unit, &rounded)) Fail(pos, "integer overflow");
        return Value::Int(rounded);
      }
      double x = AsDouble(v), scale = std::pow(10.0, static_cast<double>(std::clamp<int64_t>(precision, -308, 308)));
      if (method && *method != "common") {
        return Value::Float((*method == "floor" ? std::floor(x * scale) : std::ceil(x * scale)) / scale);
      }
      if (!std::isfinite(x) || precision > 17) return Value::Float(x);
      if (precision < 0) return Value::Float(std::nearbyint(x * scale) / scale);
      char buf[400];  // printf rounds the exact binary value half-to-even, as Python's round()
      std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(precision), x);
      return Value::Float(std::strtod(buf, nullptr));
    }
    Fail(pos, "no filter named '" + name + "'");
  }

  // The int and float filters: Python's int()/float() of the value, else the default.
  Value ToNumber(bool to_int, const Value& v, const Args& args, int64_t pos) {
    auto a = to_int ? args.Bind("int", {"default", "base"}, pos) : args.Bind("float", {"default"}, pos);
    Value dflt = a[0] ? *a[0] : to_int ? Value::Int(0) : Value::Float(0);
    if (v.Is(Kind::kUndefined)) FailUndefined(v, pos);
    double d = 0;
    if (v.IsNumber()) {
      if (!to_int) return Value::Float(AsDouble(v));
      if (!v.Is(Kind::kFloat)) return Value::Int(v.i);
      d = v.f;
    } else if (v.Is(Kind::kString)) {
      std::string s = Strip(*v.str, nullptr, true, true);
      s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
      bool negative = !s.empty() && s[0] == '-';
      std::string_view body = s;
      if (!s.empty() && (s[0] == '-' || s[0] == '+')) body.remove_prefix(1);
      if (to_int) {
        int base = static_cast<int>(OptInt(a.size() > 1 ? a[1] : nullptr, 10, "base", pos));
        std::string prefix = MapCase(body.substr(0, 2), false);
        for (auto [p, b] : {std::pair{"0x", 16}, std::pair{"0o", 8}, std::pair{"0b", 2}}) {
          if ((base == b || base == 0) && prefix == p) {
            body.remove_prefix(2);
            base = b;
          }
        }
        if (base == 0) base = 10;
        uint64_t u = 0;
        auto r = base >= 2 && base <= 36 ? std::from_chars(body.data(), body.data() + body.size(), u, base)
                                         : std::from_chars_result{body.data(), std::errc::invalid_argument};
        if (!body.empty() && r.ec == std::errc() && r.ptr == body.data() + body.size() && u <= uint64_t{INT64_MAX}) {
          return Value::Int(negative ? -static_cast<int64_t>(u) : static_cast<int64_t>(u));
        }
      }
      std::string lower = MapCase(body, false);
      if (lower == "inf" || lower == "infinity" || lower == "nan") {
        d = lower == "nan" ? NAN : INFINITY;
      } else {
        auto r = std::from_chars(body.data(), body.data() + body.size(), d);
        if (body.empty() || r.ptr != body.data() + body.size()) return dflt;
        if (r.ec == std::errc::result_out_of_range)
          d = std::strtod(std::string(body).c_str(), nullptr);  // inf or 0
        else if (r.ec != std::errc()) {
          return dflt;
        }
      }
      if (negative) d = -d;
      if (!to_int) return Value::Float(d);
    } else {
      return dflt;
    }
    if (!std::isfinite(d) || std::fabs(d) >= 9.2e18) return dflt;
    return Value::Int(static_cast<int64_t>(d));
  }

  bool Test(const std::string& name, const Value& v, const Args& args, int64_t pos) {
    auto arg = [&]() -> const Value& {
      auto a = args.Bind(name, {"other"}, pos);
      if (!a[0]) Fail(pos, "test '" + name + "' takes an argument");
      return *a[0];
    };
    if (name == "defined") return !v.Is(Kind::kUndefined);
    if (name == "undefined") return v.Is(Kind::kUndefined);
    if (name == "none") return v.Is(Kind::kNone);
    if (name == "boolean") return v.Is(Kind::kBool);
    if (name == "false") return v.Is(Kind::kBool) && !v.i;
    if (name == "true") return v.Is(Kind::kBool) && v.i;
    if (name == "integer") return v.Is(Kind::kInt);
    if (name == "float") return v.Is(Kind::kFloat);
    if (name == "number") return v.IsNumber();
    if (name == "string") return v.Is(Kind::kString);
    if (name == "mapping") return v.Is(Kind::kDict);
    if (name == "iterable") {
      return v.Is(Kind::kString) || v.Is(Kind::kList) || v.Is(Kind::kDict) || v.Is(Kind::kUndefined);
    }
    if (name == "sequence") {
      return v.Is(Kind::kString) || v.Is(Kind::kList) || v.Is(Kind::kDict) || v.Is(Kind::kUndefined);
    }
    if (name == "callable") {
      return v.Is(Kind::kMacro) || v.Is(Kind::kMethod) || v.Is(Kind::kFunction) || v.Is(Kind::kUndefined);
    }
    if (name == "lower" || name == "upper") {
      std::string s = ToStr(v, pos);
      bool cased = false;
      for (char c : s) {
        if ((name == "lower" && c >= 'A' && c <= 'Z') || (name == "upper" && c >= 'a' && c <= 'z')) return false;
        cased = cased || std::isalpha(static_cast<unsigned char>(c));
      }
      return cased;
    }
    if (name == "odd" || name == "even" || name == "divisibleby") {  // value % 2 == 1, == 0, value % n == 0
      Value m = Binary("%", v, name == "divisibleby" ? arg() : Value::Int(2), pos);
      return Equal(m, Value::Int(name == "odd" ? 1 : 0), 0, pos);
    }
    if (name == "eq" || name == "equalto" || name == "==") return Equal(v, arg(), 0, pos);
    if (name == "ne" || name == "!=") return !Equal(v, arg(), 0, pos);
    if (name == "lt" || name == "<" || name == "lessthan") return Compare(v, arg(), "<", 0, pos) < 0;
    if (name == "le" || name == "<=") return Compare(v, arg(), "<=", 0, pos) <= 0;
    if (name == "gt" || name == "greaterthan" || name == ">") return Compare(v, arg(), ">", 0, pos) > 0;
    if (name == "ge" || name == ">=") return Compare(v, arg(), ">=", 0, pos) >= 0;
    if (name == "in") return Contains(arg(), v, pos);
    if (name == "sameas") {  // identity: equal scalars, the same list, dict or namespace
      const Value& o = arg();
      if (v.kind != o.kind) return false;
      if (v.Is(Kind::kList)) return v.list == o.list;
      if (v.Is(Kind::kDict) || v.Is(Kind::kNamespace)) return v.dict == o.dict;
      return Equal(v, o, 0, pos);
    }
    Fail(pos, "no test named '" + name + "'");
  }

  const Template& t_;
  const ChatTemplateLimits& limits_;
  std::chrono::system_clock::time_point now_;
  std::string* out_ = nullptr;
  int64_t steps_ = 0;
  int depth_ = 0;
};

template <typename Json>
Value FromJson(const Json& j, int depth, int max_depth) {
  if (depth > max_depth) Fail(-1, "the context nests deeper than max_depth (" + std::to_string(max_depth) + ")");
  switch (j.type()) {
    case nlohmann::json::value_t::null:
      return Value::None();
    case nlohmann::json::value_t::boolean:
      return Value::Bool(j.template get<bool>());
    case nlohmann::json::value_t::number_integer:
      return Value::Int(j.template get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      uint64_t u = j.template get<uint64_t>();
      return u <= uint64_t{INT64_MAX} ? Value::Int(static_cast<int64_t>(u)) : Value::Float(static_cast<double>(u));
    }
    case nlohmann::json::value_t::number_float:
      return Value::Float(j.template get<double>());
    case nlohmann::json::value_t::string:
      return Value::String(j.template get_ref<const std::string&>());
    case nlohmann::json::value_t::array: {
      Value v = Value::Of(Kind::kList);
      List items;
      items.reserve(j.size());
      for (const Json& item : j) {
        items.push_back(FromJson(item, depth + 1, max_depth));
        v.depth = std::max(v.depth, items.back().depth + 1);
      }
      v.list = std::make_shared<const List>(std::move(items));
      return v;
    }
    case nlohmann::json::value_t::object: {
      Value v = Value::Of(Kind::kDict);
      v.dict = std::make_shared<Dict>();
      for (auto it = j.begin(); it != j.end(); ++it) {
        Value item = FromJson(it.value(), depth + 1, max_depth);
        v.depth = std::max(v.depth, item.depth + 1);
        v.dict->Set(Value::String(it.key()), std::move(item));
      }
      return v;
    }
    default:
      Fail(-1, "the context holds a value JSON text cannot carry (binary)");
  }
}

Status ToStatus(const Error& e, const std::string& source) {
  std::string where = e.pos < 0 ? "chat template: " : "chat template " + LineColumn(source, e.pos) + ": ";
  return Status::InvalidArgument(where + e.message);
}

template <typename Json>
Result<std::string> RenderJson(const Template& t, const Json& context, std::chrono::system_clock::time_point now) {
  if (!context.is_object()) return Status::InvalidArgument("chat template: the context must be a JSON object");
  try {
    Value root = FromJson(context, 0, t.limits.max_depth);
    return Renderer(t, now).Run(root);
  } catch (const Error& e) {
    return ToStatus(e, t.source);
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("chat template: out of memory while rendering");
  }
}

}  // namespace

bool IsKnownFilter(std::string_view name) {
  return std::find(std::begin(kFilters), std::end(kFilters), name) != std::end(kFilters);
}

}  // namespace chat_template_internal

Result<ChatTemplate> ChatTemplate::Parse(std::string_view source, ChatTemplateLimits limits) {
  using chat_template_internal::Error;
  if (limits.max_output_bytes <= 0) {
    return Status::InvalidArgument("ChatTemplateLimits.max_output_bytes must be positive");
  }
  if (limits.max_steps <= 0) return Status::InvalidArgument("ChatTemplateLimits.max_steps must be positive");
  if (limits.max_depth <= 0) return Status::InvalidArgument("ChatTemplateLimits.max_depth must be positive");
  auto t = std::make_shared<chat_template_internal::Template>();
  t->limits = limits;
  try {
    chat_template_internal::ParseTemplate(source, t.get());
  } catch (const Error& e) {
    return chat_template_internal::ToStatus(e, t->source);
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("chat template: out of memory while parsing");
  }
  return ChatTemplate(std::move(t));
}

Result<std::string> ChatTemplate::Render(const nlohmann::ordered_json& context,
                                         std::chrono::system_clock::time_point now) const {
  return chat_template_internal::RenderJson(*template_, context, now);
}

Result<std::string> ChatTemplate::Render(const nlohmann::json& context,
                                         std::chrono::system_clock::time_point now) const {
  return chat_template_internal::RenderJson(*template_, context, now);
}

}  // namespace penumbra::openai
