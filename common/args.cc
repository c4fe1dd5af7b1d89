#include "common/args.h"

#include <cerrno>
#include <cstdlib>
#include <set>
#include <sstream>

namespace penumbra {

Args& Args::Flag(const std::string& name, const std::string& help) {
  specs_[name] = {true, help};
  order_.push_back(name);
  return *this;
}

Args& Args::Switch(const std::string& name, const std::string& help) {
  specs_[name] = {false, help};
  order_.push_back(name);
  return *this;
}

Status Args::Parse(int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) return Status::InvalidArgument("unexpected argument '" + a + "'");
    std::string name = a.substr(2), value;
    bool inline_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    auto it = specs_.find(name);
    if (it == specs_.end()) return Status::InvalidArgument("unknown flag --" + name);
    if (it->second.takes_value) {
      if (!inline_value) {
        if (i + 1 >= argc) return Status::InvalidArgument("flag --" + name + " needs a value");
        value = argv[++i];
      }
    } else if (inline_value) {
      return Status::InvalidArgument("flag --" + name + " takes no value");
    }
    // A flag given twice is a mistake in a script or a config line; taking
    // either value silently would hide it.
    if (auto prev = values_.find(name); prev != values_.end()) {
      return Status::InvalidArgument("flag --" + name + " given twice" +
                                     (it->second.takes_value ? " ('" + prev->second + "', then '" + value + "')" : ""));
    }
    values_[name] = value;
  }
  return Status::OK();
}

std::string Args::Get(const std::string& name, const std::string& def) const {
  auto it = values_.find(name);
  return it == values_.end() ? def : it->second;
}

Result<int64_t> Args::GetInt(const std::string& name, int64_t def) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  const char* s = it->second.c_str();
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(s, &end, 10);
  if (errno || end == s || *end != '\0') {
    return Status::InvalidArgument("flag --" + name + ": '" + it->second + "' is not an integer");
  }
  return static_cast<int64_t>(v);
}

Result<bool> Args::GetOnOff(const std::string& name, bool def) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  if (it->second == "on") return true;
  if (it->second == "off") return false;
  return Status::InvalidArgument("flag --" + name + ": '" + it->second + "' is not on or off");
}

Result<double> Args::GetDouble(const std::string& name, double def) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  const char* s = it->second.c_str();
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(s, &end);
  if (errno || end == s || *end != '\0') {
    return Status::InvalidArgument("flag --" + name + ": '" + it->second + "' is not a number");
  }
  return v;
}

Result<int64_t> Args::GetIntIn(const std::string& name, int64_t def, int64_t lo, int64_t hi) const {
  PENUMBRA_ASSIGN_OR_RETURN(int64_t v, GetInt(name, def));
  if (Has(name) && (v < lo || v > hi)) {
    return Status::InvalidArgument("flag --" + name + ": must be in [" + std::to_string(lo) + ", " +
                                   std::to_string(hi) + "], got " + Get(name));
  }
  return v;
}

Result<double> Args::GetDoubleIn(const std::string& name, double def, double lo, double hi, bool lo_open) const {
  PENUMBRA_ASSIGN_OR_RETURN(double v, GetDouble(name, def));
  const bool in = (lo_open ? v > lo : v >= lo) && v <= hi;  // false for NaN
  if (Has(name) && !in) {
    std::ostringstream os;
    os << "flag --" << name << ": must be in " << (lo_open ? "(" : "[") << lo << ", " << hi << "], got " << Get(name);
    return Status::InvalidArgument(os.str());
  }
  return v;
}

Result<std::vector<int64_t>> Args::GetIntList(const std::string& name) const {
  std::vector<int64_t> out;
  auto it = values_.find(name);
  if (it == values_.end()) return out;
  std::stringstream ss(it->second);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    if (b == std::string::npos)
      return Status::InvalidArgument("flag --" + name + ": empty item in '" + it->second + "'");
    item = item.substr(b, e - b + 1);
    char* end = nullptr;
    errno = 0;
    long long v = std::strtoll(item.c_str(), &end, 10);
    if (errno || *end != '\0') {
      return Status::InvalidArgument("flag --" + name + ": '" + item + "' is not an integer");
    }
    out.push_back(v);
  }
  return out;
}

std::string Args::Help() const {
  std::ostringstream os;
  for (const auto& n : order_) {
    const Spec& s = specs_.at(n);
    os << "  --" << n << (s.takes_value ? " VALUE" : "") << "\n      " << s.help << "\n";
  }
  return os.str();
}

namespace {

// Words grouped as flags: a flag with its value (if the next word does not
// start with "--"), or a word that is no flag on its own. The name is the
// flag's, without "--" and "=value"; "" for a lone word.
std::vector<std::pair<std::string, std::vector<std::string>>> FlagGroups(const std::vector<std::string>& words) {
  std::vector<std::pair<std::string, std::vector<std::string>>> out;
  for (size_t i = 0; i < words.size(); ++i) {
    const std::string& w = words[i];
    if (w.rfind("--", 0) != 0) {
      out.push_back({"", {w}});
      continue;
    }
    const size_t eq = w.find('=');
    std::string name = w.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    std::vector<std::string> g = {w};
    if (eq == std::string::npos && i + 1 < words.size() && words[i + 1].rfind("--", 0) != 0) g.push_back(words[++i]);
    out.push_back({std::move(name), std::move(g)});
  }
  return out;
}

}  // namespace

std::vector<std::string> OverrideFlags(const std::vector<std::string>& base,
                                       const std::vector<std::string>& overrides) {
  std::set<std::string> replaced;
  for (const auto& group : FlagGroups(overrides)) {
    if (!group.first.empty()) replaced.insert(group.first);
  }
  std::vector<std::string> out;
  for (const auto& [name, words] : FlagGroups(base)) {
    if (name.empty() || !replaced.count(name)) out.insert(out.end(), words.begin(), words.end());
  }
  out.insert(out.end(), overrides.begin(), overrides.end());
  return out;
}

}  // namespace penumbra
