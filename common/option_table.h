// OptionTable: every option of an options struct declared once — its
// command-line flag, its YAML key, its range or choices and its help — and
// from that one table: the flags (Args), their parsing, the YAML reader, the
// validation and the documentation, so no two of them can disagree.
//
//   const OptionTable<ShadowKvOptions>& Table() {
//     static const auto* t = &(*new OptionTable<ShadowKvOptions>("shadowkv"))
//         .Int(&ShadowKvOptions::rank, "rank", "rank", 1, 1 << 16, "rank of the pre-RoPE key factors")
//         .Enum(&ShadowKvOptions::continuation, "continuation", "continuation", {"dense", "sparse"},
//               "a prefill after a factored prompt attends dense or sparse")
//         .Check("landmarks_per_chunk", [](const ShadowKvOptions& o) -> std::string {
//           return o.chunk_size % o.landmarks_per_chunk ? "must divide chunk_size" : ""; });
//     return *t;
//   }
//
// An empty flag name means YAML only; an empty key means command line only
// (a table of command-line options only, a program's, documents no key
// column).
// The default shown in help and docs is the struct's own (a default-
// constructed T): the table never holds a second copy of it.
//
// Every error is InvalidArgument naming the option both ways, the rule and the
// value: "shadowkv.landmarks_per_chunk (--landmarks-per-chunk) must be in
// [1, 16], got 32". Validate() applies the same ranges and checks to a struct
// however it was filled (flags, YAML, code), so a caller that builds options
// in code is checked too.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "common/args.h"
#include "common/config.h"
#include "common/status.h"

namespace penumbra {

template <class T>
class OptionTable {
 public:
  // `section`: the YAML section (and message prefix) the options live under.
  explicit OptionTable(std::string section) : section_(std::move(section)) {}

  // Each option names its field by a member pointer, or by a function
  // returning a pointer to it (a field of a nested struct:
  // [](EngineOptions* o) { return &o->backend.device; }).
  template <class M>
  using Field = std::function<M*(T*)>;

  // An integer (int, int64_t or size_t member) in [min, max].
  template <class M>
  OptionTable& Int(M T::*member, std::string flag, std::string key, M min, M max, std::string help) {
    return Int<M>(Member(member), std::move(flag), std::move(key), min, max, std::move(help));
  }
  template <class M>
  OptionTable& Int(Field<M> field, std::string flag, std::string key, M min, M max, std::string help) {
    static_assert(std::is_integral_v<M> && !std::is_same_v<M, bool>, "Int takes an integer member");
    Entry e = Base(std::move(flag), std::move(key), std::move(help));
    e.range = "[" + std::to_string(min) + ", " + std::to_string(max) + "]";
    e.show = [field](const T& o) { return std::to_string(Get(field, o)); };
    e.check = [field, min, max, range = e.range](const T& o) -> std::string {
      const M v = Get(field, o);
      return v < min || v > max ? "must be in " + range + ", got " + std::to_string(v) : "";
    };
    e.from_flag = [field, name = e.flag](const Args& a, T* o) -> Status {
      PENUMBRA_ASSIGN_OR_RETURN(int64_t v, a.GetInt(name, static_cast<int64_t>(*field(o))));
      if constexpr (std::is_unsigned_v<M>) {
        if (v < 0) return Status::InvalidArgument("--" + name + " must be >= 0, got " + std::to_string(v));
      }
      if (static_cast<long double>(v) > static_cast<long double>(std::numeric_limits<M>::max()) ||
          static_cast<long double>(v) < static_cast<long double>(std::numeric_limits<M>::lowest())) {
        return Status::InvalidArgument("--" + name + " is out of range, got " + std::to_string(v));
      }
      *field(o) = static_cast<M>(v);
      return Status::OK();
    };
    e.from_yaml = [field, min, max](ConfigReader& r, const std::string& key, T* o) { r.Read(key, field(o), min, max); };
    entries_.push_back(std::move(e));
    return *this;
  }

  // A floating-point number in [min, max], or (min, max] with min_open (NaN
  // is outside every range).
  OptionTable& Double(double T::*member, std::string flag, std::string key, double min, double max, std::string help,
                      bool min_open = false) {
    return Double(Member(member), std::move(flag), std::move(key), min, max, std::move(help), min_open);
  }
  OptionTable& Double(Field<double> field, std::string flag, std::string key, double min, double max, std::string help,
                      bool min_open = false) {
    Entry e = Base(std::move(flag), std::move(key), std::move(help));
    e.range = (min_open ? "(" : "[") + Num(min) + ", " + Num(max) + "]";
    e.show = [field](const T& o) { return Num(Get(field, o)); };
    e.check = [field, min, max, min_open, range = e.range](const T& o) -> std::string {
      const double v = Get(field, o);
      const bool above = min_open ? v > min : v >= min;
      return !(above && v <= max) ? "must be in " + range + ", got " + Num(v) : "";
    };
    e.from_flag = [field, name = e.flag](const Args& a, T* o) -> Status {
      PENUMBRA_ASSIGN_OR_RETURN(*field(o), a.GetDouble(name, *field(o)));
      return Status::OK();
    };
    e.from_yaml = [field, min, max](ConfigReader& r, const std::string& key, T* o) { r.Read(key, field(o), min, max); };
    entries_.push_back(std::move(e));
    return *this;
  }

  // An integer in [min, max] that the struct holds in other units (MiB as
  // bytes, seconds as milliseconds...): `get` gives the option's value from
  // the struct, `set` stores one.
  OptionTable& IntVia(std::function<int64_t(const T&)> get, std::function<void(T*, int64_t)> set, std::string flag,
                      std::string key, int64_t min, int64_t max, std::string help) {
    Entry e = Base(std::move(flag), std::move(key), std::move(help));
    e.range = "[" + std::to_string(min) + ", " + std::to_string(max) + "]";
    e.show = [get](const T& o) { return std::to_string(get(o)); };
    e.check = [get, min, max, range = e.range](const T& o) -> std::string {
      const int64_t v = get(o);
      return v < min || v > max ? "must be in " + range + ", got " + std::to_string(v) : "";
    };
    // Checked before it is stored: a value out of range could wrap in the
    // struct's units.
    e.from_flag = [get, set, min, max, name = e.flag, full = Name(e.key, e.flag), range = e.range](const Args& a,
                                                                                                   T* o) -> Status {
      if (!a.Has(name)) return Status::OK();
      PENUMBRA_ASSIGN_OR_RETURN(int64_t v, a.GetInt(name, get(*o)));
      if (v < min || v > max) {
        return Status::InvalidArgument(full + " must be in " + range + ", got " + std::to_string(v));
      }
      set(o, v);
      return Status::OK();
    };
    e.from_yaml = [get, set, min, max](ConfigReader& r, const std::string& key, T* o) {
      if (!r.Has(key)) return;
      int64_t v = get(*o);
      r.Read(key, &v, min, max);  // out of range: an error, and v unchanged
      if (v >= min && v <= max) set(o, v);
    };
    entries_.push_back(std::move(e));
    return *this;
  }

  // A duration, given as a count of `unit`s (std::chrono::seconds for an
  // option in seconds held as milliseconds).
  template <class D, class Unit = D>
  OptionTable& Duration(Field<D> field, std::string flag, std::string key, int64_t min, int64_t max, std::string help,
                        Unit /*unit*/ = Unit{}) {
    return IntVia(
        [field](const T& o) { return static_cast<int64_t>(std::chrono::duration_cast<Unit>(Get(field, o)).count()); },
        [field](T* o, int64_t v) { *field(o) = std::chrono::duration_cast<D>(Unit(v)); }, std::move(flag),
        std::move(key), min, max, std::move(help));
  }
  template <class D, class Unit = D>
  OptionTable& Duration(D T::*member, std::string flag, std::string key, int64_t min, int64_t max, std::string help,
                        Unit unit = Unit{}) {
    return Duration<D, Unit>(Member(member), std::move(flag), std::move(key), min, max, std::move(help), unit);
  }

  // A size given in MiB, held in bytes (an integer or a double member).
  template <class M>
  OptionTable& MiB(Field<M> field, std::string flag, std::string key, int64_t min, int64_t max, std::string help) {
    return IntVia([field](const T& o) { return static_cast<int64_t>(Get(field, o) / (1 << 20)); },
                  [field](T* o, int64_t v) { *field(o) = static_cast<M>(v) * (1 << 20); }, std::move(flag),
                  std::move(key), min, max, std::move(help));
  }
  template <class M>
  OptionTable& MiB(M T::*member, std::string flag, std::string key, int64_t min, int64_t max, std::string help) {
    return MiB<M>(Member(member), std::move(flag), std::move(key), min, max, std::move(help));
  }

  // Any string (a path, an address); `shape` says what it holds ("DIR",
  // "HOST:PORT,...") in help and docs.
  OptionTable& String(std::string T::*member, std::string flag, std::string key, std::string shape, std::string help) {
    return String(Member(member), std::move(flag), std::move(key), std::move(shape), std::move(help));
  }
  OptionTable& String(Field<std::string> field, std::string flag, std::string key, std::string shape,
                      std::string help) {
    Entry e = Base(std::move(flag), std::move(key), std::move(help));
    e.range = std::move(shape);
    e.show = [field](const T& o) { return Get(field, o); };
    e.check = [](const T&) { return std::string(); };
    e.from_flag = [field, name = e.flag](const Args& a, T* o) -> Status {
      if (a.Has(name)) *field(o) = a.Get(name);
      return Status::OK();
    };
    e.from_yaml = [field](ConfigReader& r, const std::string& key, T* o) { r.Read(key, field(o)); };
    entries_.push_back(std::move(e));
    return *this;
  }

  // The option declared last is "not given" while it shows as `value` (its
  // default, a value outside its range: 0, -1, ""): then its range is not
  // checked, and help and docs give `meaning` as its default ("the engine's
  // max_batch"). The program decides what not giving it means. A flag that
  // gives `value` itself is still checked (--max-batch 0 is refused).
  OptionTable& Unset(std::string value, std::string meaning) {
    Entry& e = entries_.back();
    e.unset_value = std::move(value);
    e.unset_meaning = std::move(meaning);
    const std::function<std::string(const T&)> range_check = e.check;
    e.check = [show = e.show, check = range_check, unset = e.unset_value](const T& o) {
      return show(o) == unset ? std::string() : check(o);
    };
    e.from_flag = [show = e.show, check = range_check, from_flag = e.from_flag, unset = e.unset_value,
                   name = Name(e.key, e.flag), flag = e.flag](const Args& a, T* o) -> Status {
      PENUMBRA_RETURN_IF_ERROR(from_flag(a, o));
      if (!a.Has(flag) || show(*o) != unset) return Status::OK();
      std::string bad = check(*o);
      return bad.empty() ? Status::OK() : Status::InvalidArgument(name + " " + bad);
    };
    return *this;
  }

  // A boolean: YAML true/false; on the command line "on" or "off".
  OptionTable& Bool(bool T::*member, std::string flag, std::string key, std::string help) {
    return Bool(Member(member), std::move(flag), std::move(key), std::move(help));
  }
  OptionTable& Bool(Field<bool> field, std::string flag, std::string key, std::string help) {
    Entry e = Base(std::move(flag), std::move(key), std::move(help));
    e.range = "on | off";
    e.show = [field](const T& o) { return std::string(Get(field, o) ? "on" : "off"); };
    e.check = [](const T&) { return std::string(); };
    e.from_flag = [field, name = e.flag](const Args& a, T* o) -> Status {
      PENUMBRA_ASSIGN_OR_RETURN(*field(o), a.GetOnOff(name, *field(o)));
      return Status::OK();
    };
    e.from_yaml = [field](ConfigReader& r, const std::string& key, T* o) { r.Read(key, field(o)); };
    entries_.push_back(std::move(e));
    return *this;
  }

  // A string that must be one of `choices`.
  OptionTable& Enum(std::string T::*member, std::string flag, std::string key, std::vector<std::string> choices,
                    std::string help) {
    return Enum(Member(member), std::move(flag), std::move(key), std::move(choices), std::move(help));
  }
  OptionTable& Enum(Field<std::string> field, std::string flag, std::string key, std::vector<std::string> choices,
                    std::string help) {
    Entry e = Base(std::move(flag), std::move(key), std::move(help));
    for (size_t i = 0; i < choices.size(); ++i) e.range += (i ? " | " : "") + choices[i];
    e.show = [field](const T& o) { return Get(field, o); };
    e.check = [field, choices, range = e.range](const T& o) -> std::string {
      const std::string& v = Get(field, o);
      for (const std::string& c : choices) {
        if (v == c) return "";
      }
      return "must be one of " + range + ", got '" + v + "'";
    };
    e.from_flag = [field, name = e.flag](const Args& a, T* o) -> Status {
      if (a.Has(name)) *field(o) = a.Get(name);
      return Status::OK();
    };
    e.from_yaml = [field, choices](ConfigReader& r, const std::string& key, T* o) {
      r.ReadEnum(key, field(o), choices);
    };
    entries_.push_back(std::move(e));
    return *this;
  }

  // A rule beyond one option's range (a relation between options, a power of
  // two...): `check` returns "" when the options satisfy it, else what is
  // wrong ("must divide chunk_size (8), got 3"). Reported against `key`.
  OptionTable& Check(std::string key, std::function<std::string(const T&)> check) {
    checks_.push_back({std::move(key), std::move(check)});
    return *this;
  }

  // Declares every option that has a flag; its help ends with the default
  // and the range.
  void AddFlags(Args& a) const {
    const T defaults{};
    for (const Entry& e : entries_) {
      if (e.flag.empty()) continue;
      a.Flag(e.flag, section_ + ": " + e.help + " (default " + Default(e, defaults) + (e.range.empty() ? "" : "; ") +
                         e.range + ")");
    }
  }

  // Applies the flags given on the command line over *o, then validates.
  Status ApplyFlags(const Args& a, T* o) const {
    for (const Entry& e : entries_) {
      if (!e.flag.empty()) PENUMBRA_RETURN_IF_ERROR(e.from_flag(a, o));
    }
    return Validate(*o);
  }

  // Reads the keys present in `r` over *o (unknown keys are errors naming
  // them), then validates. `r` is the section itself.
  Status Load(ConfigReader& r, T* o) const {
    Read(r, o);
    PENUMBRA_RETURN_IF_ERROR(r.Finish());
    return Validate(*o);
  }
  // Only reads the table's keys (a section that also holds other keys or
  // children: the caller reads those, then Finish()es `r` and Validate()s).
  void Read(ConfigReader& r, T* o) const {
    for (const Entry& e : entries_) {
      if (!e.key.empty()) e.from_yaml(r, e.key, o);
    }
  }

  // Every range and rule; the first violation, naming the option.
  Status Validate(const T& o) const {
    for (const Entry& e : entries_) {
      std::string bad = e.check(o);
      if (!bad.empty()) return Status::InvalidArgument(Name(e.key, e.flag) + " " + bad);
    }
    for (const auto& [key, check] : checks_) {
      std::string bad = check(o);
      if (!bad.empty()) return Status::InvalidArgument(Name(key, FlagOf(key)) + " " + bad);
    }
    return Status::OK();
  }

  // A Markdown table of the options (YAML key, flag, default, range, help),
  // for the docs; without the key column when no option has a key.
  std::string Markdown() const {
    const T defaults{};
    bool keys = false;
    for (const Entry& e : entries_) keys = keys || !e.key.empty();
    std::ostringstream s;
    if (keys) {
      s << "| `" << section_ << ":` key | flag | default | range | what |\n|---|---|---|---|---|\n";
    } else {
      s << "| flag | default | range | what |\n|---|---|---|---|\n";
    }
    for (const Entry& e : entries_) {
      s << "| ";
      if (keys) s << (e.key.empty() ? "" : "`" + e.key + "`") << " | ";
      s << (e.flag.empty() ? "" : "`--" + e.flag + "`") << " | " << Cell(Default(e, defaults)) << " | " << Cell(e.range)
        << " | " << Cell(e.help) << " |\n";
    }
    return s.str();
  }

  const std::string& section() const { return section_; }

 private:
  struct Entry {
    std::string flag, key, help, range;
    std::string unset_value, unset_meaning;  // Unset()
    std::function<std::string(const T&)> show;
    std::function<std::string(const T&)> check;  // "" when valid
    std::function<Status(const Args&, T*)> from_flag;
    std::function<void(ConfigReader&, const std::string&, T*)> from_yaml;
  };

  template <class M>
  static Field<M> Member(M T::*member) {
    return [member](T* o) { return &(o->*member); };
  }
  template <class M>
  static const M& Get(const Field<M>& field, const T& o) {
    return *field(const_cast<T*>(&o));  // the accessor only locates the field
  }
  static Entry Base(std::string flag, std::string key, std::string help) {
    Entry e;
    e.flag = std::move(flag);
    e.key = std::move(key);
    e.help = std::move(help);
    return e;
  }
  static std::string Default(const Entry& e, const T& defaults) {
    std::string v = e.show(defaults);
    if (!e.unset_meaning.empty() && v == e.unset_value) return e.unset_meaning;
    return v.empty() ? "\"\"" : v;
  }
  static std::string Cell(const std::string& text) {  // '|' would end a Markdown cell
    std::string out;
    for (char c : text) {
      if (c == '|') out += '\\';
      out += c;
    }
    return out;
  }
  static std::string Num(double v) {
    std::ostringstream s;
    s << v;
    return s.str();
  }
  std::string FlagOf(const std::string& key) const {
    for (const Entry& e : entries_) {
      if (e.key == key) return e.flag;
    }
    return "";
  }
  std::string Name(const std::string& key, const std::string& flag) const {
    std::string n = key.empty() ? "--" + flag : section_ + "." + key;
    if (!key.empty() && !flag.empty()) n += " (--" + flag + ")";
    return n;
  }

  std::string section_;
  std::vector<Entry> entries_;
  std::vector<std::pair<std::string, std::function<std::string(const T&)>>> checks_;
};

}  // namespace penumbra
