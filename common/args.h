// A small command-line parser for subcommand-style tools:
//   tool SUBCOMMAND --key value --key=value --switch
// Every flag must be declared; unknown flags, a flag given twice, missing
// values and malformed numbers are InvalidArgument errors that name the flag.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace penumbra {

class Args {
 public:
  // Declares a flag taking a value, or a switch (no value).
  Args& Flag(const std::string& name, const std::string& help);
  Args& Switch(const std::string& name, const std::string& help);

  // Parses argv[first..argc).
  Status Parse(int argc, char** argv, int first);

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& def = "") const;
  Result<int64_t> GetInt(const std::string& name, int64_t def) const;
  Result<double> GetDouble(const std::string& name, double def) const;
  // The same, refusing a value outside [lo, hi] (or (lo, hi] with lo_open)
  // with InvalidArgument naming the flag, the range and the value; NaN is
  // outside every range. The default is not checked.
  Result<int64_t> GetIntIn(const std::string& name, int64_t def, int64_t lo, int64_t hi) const;
  Result<double> GetDoubleIn(const std::string& name, double def, double lo, double hi, bool lo_open = false) const;
  // "on" -> true, "off" -> false; anything else is InvalidArgument naming the flag.
  Result<bool> GetOnOff(const std::string& name, bool def) const;
  // "1,2,3" -> {1,2,3}; whitespace allowed around items.
  Result<std::vector<int64_t>> GetIntList(const std::string& name) const;
  std::string Help() const;

 private:
  struct Spec {
    bool takes_value;
    std::string help;
  };
  std::map<std::string, Spec> specs_;
  std::vector<std::string> order_;
  std::map<std::string, std::string> values_;
};

// Another process's command line with overrides: the flags of `overrides`
// replace the same flags of `base` (a "--flag value" pair, "--flag=value" or
// a switch; a word after a flag that does not start with "--" is its value),
// the rest of `overrides` is appended. For a launcher that passes a user's
// extra flags to processes it starts with flags of its own (penumbra serve
// --worker-args over the topology's args), since a flag given twice is
// refused.
std::vector<std::string> OverrideFlags(const std::vector<std::string>& base, const std::vector<std::string>& overrides);

}  // namespace penumbra
