#include "common/config.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <sstream>

#include "common/file.h"

namespace penumbra {

Result<ConfigReader> ConfigReader::FromString(const std::string& text, const std::string& origin) {
  try {
    YAML::Node n = YAML::Load(text);
    if (n.IsNull()) n = YAML::Node(YAML::NodeType::Map);
    if (!n.IsMap()) return Status::InvalidArgument(origin + ": top level must be a map of options");
    return ConfigReader(n, "", origin);
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(origin + ": YAML syntax error at line " + std::to_string(e.mark.line + 1) + ": " +
                                   e.msg);
  }
}

Result<ConfigReader> ConfigReader::FromFile(const std::string& path) {
  PENUMBRA_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  return FromString(text, path);
}

ConfigReader::ConfigReader(YAML::Node node, std::string path, std::string origin)
    : node_(node), path_(std::move(path)), origin_(std::move(origin)) {}

std::string ConfigReader::KeyPath(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

void ConfigReader::Fail(const std::string& key, const std::string& what) {
  if (!error_) error_ = Status::InvalidArgument(origin_ + ": " + KeyPath(key) + ": " + what);
}

bool ConfigReader::Has(const std::string& key) const { return node_.IsMap() && node_[key].IsDefined(); }

YAML::Node ConfigReader::Get(const std::string& key) {
  seen_.insert(key);
  if (!node_.IsMap()) return YAML::Node();
  YAML::Node n = node_[key];
  return n;
}

void ConfigReader::Read(const std::string& key, bool* out) {
  YAML::Node n = Get(key);
  if (!n.IsDefined()) return;
  try {
    *out = n.as<bool>();
  } catch (const YAML::Exception&) {
    Fail(key, "expected true or false, got '" + n.Scalar() + "'");
  }
}

void ConfigReader::Read(const std::string& key, std::string* out) {
  YAML::Node n = Get(key);
  if (!n.IsDefined()) return;
  if (!n.IsScalar()) return Fail(key, "expected a string");
  *out = n.Scalar();
}

void ConfigReader::Read(const std::string& key, double* out, double min, double max) {
  YAML::Node n = Get(key);
  if (!n.IsDefined()) return;
  double v;
  try {
    v = n.as<double>();
  } catch (const YAML::Exception&) {
    return Fail(key, "expected a number, got '" + n.Scalar() + "'");
  }
  if (!(v >= min && v <= max)) {
    std::ostringstream os;
    os << "must be in [" << min << ", " << max << "], got " << v;
    return Fail(key, os.str());
  }
  *out = v;
}

void ConfigReader::Read(const std::string& key, size_t* out, size_t min, size_t max) {
  constexpr size_t kMax = static_cast<size_t>(std::numeric_limits<int64_t>::max());
  int64_t v = -1;  // set only when the key is there and valid
  Read(key, &v, static_cast<int64_t>(std::min(min, kMax)), static_cast<int64_t>(std::min(max, kMax)));
  if (v >= 0) *out = static_cast<size_t>(v);
}

void ConfigReader::Read(const std::string& key, int64_t* out, int64_t min, int64_t max) {
  YAML::Node n = Get(key);
  if (!n.IsDefined()) return;
  int64_t v;
  try {
    v = n.as<int64_t>();
  } catch (const YAML::Exception&) {
    return Fail(key, "expected an integer, got '" + n.Scalar() + "'");
  }
  if (v < min || v > max) {
    return Fail(key, "must be in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " + std::to_string(v));
  }
  *out = v;
}

void ConfigReader::Read(const std::string& key, int* out, int min, int max) {
  int64_t v = *out;
  Read(key, &v, min, max);
  *out = static_cast<int>(v);
}

void ConfigReader::ReadEnum(const std::string& key, std::string* out, const std::vector<std::string>& choices) {
  std::string v;
  YAML::Node n = Get(key);
  if (!n.IsDefined()) return;
  if (!n.IsScalar()) return Fail(key, "expected one of a fixed set of names");
  v = n.Scalar();
  for (const auto& c : choices) {
    if (c == v) {
      *out = v;
      return;
    }
  }
  std::string all;
  for (const auto& c : choices) all += (all.empty() ? "" : ", ") + c;
  Fail(key, "must be one of {" + all + "}, got '" + v + "'");
}

ConfigReader ConfigReader::Child(const std::string& key) {
  YAML::Node n = Get(key);
  if (n.IsDefined() && !n.IsMap()) {
    Fail(key, "expected a map");
    n = YAML::Node();
  }
  return ConfigReader(n.IsDefined() ? n : YAML::Node(YAML::NodeType::Map), KeyPath(key), origin_);
}

Status ConfigReader::Finish() {
  if (error_) return *error_;
  if (node_.IsMap()) {
    for (const auto& kv : node_) {
      const std::string k = kv.first.as<std::string>();
      if (!seen_.count(k)) return Status::InvalidArgument(origin_ + ": " + KeyPath(k) + ": unknown key");
    }
  }
  return Status::OK();
}

}  // namespace penumbra
