// Internals of the chat-template interpreter (chat_template.h), shared by its
// parser (chat_template_parse.cc) and evaluator (chat_template.cc): values,
// the syntax tree and the error the two throw. Not part of the public API:
// Error never leaves ChatTemplate::Parse or ChatTemplate::Render.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "coordinator/openai/chat_template.h"

namespace penumbra::openai::chat_template_internal {

// A parse or render failure at byte offset `pos` of the (normalized) source;
// -1 when no position applies. Thrown inside the module, caught at its API.
struct Error {
  int64_t pos;
  std::string message;
};
[[noreturn]] void Fail(int64_t pos, std::string message);

struct Value;
struct Node;
struct Scope;
using List = std::vector<Value>;

class Dict;

// A loop's `loop` variable.
struct LoopInfo {
  int64_t index0 = 0;
  std::shared_ptr<const List> items;
};

// A macro: its definition and the scope it was defined in (looked up when
// called). The scope is held weakly: the macro lives in it, and a strong
// reference would be a cycle.
struct MacroInfo {
  const Node* node = nullptr;
  std::weak_ptr<Scope> scope;
};

// A template value. Lists and dicts are shared and never change once built
// (the sandbox is immutable); namespaces are the one mutable kind, and a
// namespace may not come to contain itself, so values never form cycles.
struct Value {
  enum class Kind : uint8_t {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kNamespace,
    kLoop,
    kMacro,
    kMethod,    // a method bound to its receiver: str = name, list = {receiver}
    kFunction,  // a global function: str = name
  };
  Kind kind = Kind::kUndefined;
  bool is_tuple = false;                   // a kList written (a, b) or made by items(): printed with parentheses
  bool holds_namespace = false;            // a namespace, loop or method may be inside (see kSet)
  int depth = 0;                           // nesting of lists, dicts and namespaces inside this one
  int64_t i = 0;                           // kBool (0 or 1), kInt
  double f = 0;                            // kFloat
  std::shared_ptr<const std::string> str;  // kString; kUndefined: why it is undefined, for errors
  std::shared_ptr<const List> list;        // kList, kMethod
  std::shared_ptr<Dict> dict;              // kDict, kNamespace
  std::shared_ptr<const LoopInfo> loop;
  std::shared_ptr<const MacroInfo> macro;

  static Value None() { return Of(Kind::kNone); }
  static Value Bool(bool b) { return Of(Kind::kBool, b ? 1 : 0); }
  static Value Int(int64_t i) { return Of(Kind::kInt, i); }
  static Value Float(double f);
  static Value String(std::string s);
  static Value Undefined(std::string why);
  static Value Of(Kind kind, int64_t i = 0);
  bool Is(Kind k) const { return kind == k; }
  bool IsNumber() const { return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool; }
};

// An insertion-ordered map, a Python dict: keys are strings, numbers, bools
// or None, and equal numbers are one key (1, 1.0 and True).
class Dict {
 public:
  static bool Hashable(const Value& key);
  const Value* Find(const Value& key) const;  // null when absent or not hashable
  const Value* Find(std::string_view key) const;
  // Replaces the value of an existing key in place, else appends. `key` is hashable.
  void Set(Value key, Value value);
  const std::vector<std::pair<Value, Value>>& entries() const { return entries_; }
  size_t size() const { return entries_.size(); }

 private:
  std::vector<std::pair<Value, Value>> entries_;
  std::unordered_map<std::string, size_t> index_;  // built once the dict outgrows a linear scan
};

using ExprPtr = std::unique_ptr<struct Expr>;

struct Expr {
  enum class Kind : uint8_t {
    kLiteral,  // literal
    kName,     // name
    kList,     // args: items (is_tuple for tuples)
    kDict,     // args: key, value, key, value...
    kGetattr,  // args: {object}; name: attribute
    kGetitem,  // args: {object, key}
    kSlice,    // args: {object, start, stop, step}, absent ones null
    kCall,     // args: {callee, arguments...}; kwnames: names of the trailing keyword arguments
    kFilter,   // args: {operand, arguments...}; name: filter; kwnames as kCall
    kTest,     // args: {operand, arguments...}; name: test; negated: `is not`
    kNeg,      // args: {operand}
    kPos,
    kNot,
    kAnd,  // args: operands, evaluated left to right until one is false
    kOr,
    kBinary,   // args: operands; ops: the operator between each pair, left-associative
    kCompare,  // args: operands; ops: comparisons, chained as in Python
    kCond,     // args: {then, condition, else or null}
  };
  Kind kind = Kind::kLiteral;
  bool is_tuple = false;
  bool negated = false;
  int depth = 1;  // nesting of this node's subtree
  int64_t pos = 0;
  std::string name;
  Value literal;
  std::vector<ExprPtr> args;
  std::vector<std::string> ops;
  std::vector<std::string> kwnames;
};

using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

struct Node {
  enum class Kind : uint8_t {
    kText,      // text
    kOutput,    // exprs: {value}
    kIf,        // exprs: a condition per branch; bodies: a body per branch, plus the else body
    kFor,       // names: targets; exprs: {iterable, filter or null}; bodies: {body, else body}
    kSet,       // names: targets, or {namespace} with attr; exprs: {value}
    kSetBlock,  // names: {target}; bodies: {body}
    kMacro,     // text: name; names: parameters; exprs: their defaults (null: none); bodies: {body}
    kBreak,
    kContinue,
    kGeneration,   // bodies: {body}
    kFilterBlock,  // exprs: {filters applied to the variable kFilterBlockBody}; bodies: {body}
  };
  Kind kind = Kind::kText;
  int64_t pos = 0;
  std::string text;
  std::string attr;
  std::vector<std::string> names;
  std::vector<ExprPtr> exprs;
  std::vector<Body> bodies;
};

// The variable a {% filter %} block's rendered body is bound to (no template can name it).
inline constexpr std::string_view kFilterBlockBody = "(filter body)";

struct Template {
  Body body;
  std::string source;  // normalized: "\n" line ends, one trailing newline dropped
  ChatTemplateLimits limits;
};

// Normalizes `source` into t->source (as Jinja2 does: "\r\n" and "\r" to
// "\n", one trailing newline dropped), checks it is UTF-8 and parses it into
// t->body under t->limits; throws Error.
void ParseTemplate(std::string_view source, Template* t);
// "line:column" (both from 1; the column counts code points) of byte `pos`.
std::string LineColumn(std::string_view source, int64_t pos);

// UTF-8: the code point at s[i] and its length in *len (invalid bytes decode
// one at a time as U+FFFD); Python's str.isspace(). Appending a code point:
// AppendUtf8 (common/utf8.h).
uint32_t DecodeUtf8(std::string_view s, size_t i, size_t* len);
bool IsSpace(uint32_t cp);
// True for the filters the evaluator implements. The parser refuses unknown
// filters, as Jinja2 does; unknown tests fail when evaluated, as in Jinja2.
bool IsKnownFilter(std::string_view name);

}  // namespace penumbra::openai::chat_template_internal
