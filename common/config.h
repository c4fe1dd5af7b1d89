// Reading options from YAML with validation that names the offending key.
//
// Options are plain structs; each module writes a `Status LoadX(ConfigReader&,
// XOptions*)` that pulls its fields through a ConfigReader. Unknown keys, wrong
// types and out-of-range values become one InvalidArgument naming the full key
// path (e.g. "engine.shadowkv.rank: must be in [1, 4096], got 0").
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "common/status.h"

namespace penumbra {

class ConfigReader {
 public:
  // Parses a YAML document; a syntax error names the file and line.
  static Result<ConfigReader> FromFile(const std::string& path);
  static Result<ConfigReader> FromString(const std::string& text, const std::string& origin = "<string>");

  ConfigReader(YAML::Node node, std::string path, std::string origin);

  bool Has(const std::string& key) const;
  // Each Read leaves *out unchanged when the key is absent.
  void Read(const std::string& key, bool* out);
  void Read(const std::string& key, std::string* out);
  void Read(const std::string& key, double* out, double min, double max);
  void Read(const std::string& key, int64_t* out, int64_t min, int64_t max);
  void Read(const std::string& key, int* out, int min, int max);
  // A non-negative integer (a size in bytes or a count), in [min, max].
  void Read(const std::string& key, size_t* out, size_t min, size_t max);
  // A string that must be one of `choices`.
  void ReadEnum(const std::string& key, std::string* out, const std::vector<std::string>& choices);
  // A nested map (empty when absent). The caller must Finish() it too.
  ConfigReader Child(const std::string& key);

  // OK, or the first error: a bad value, or a key that no Read asked for.
  Status Finish();
  // InvalidArgument "<origin>: <path>.<key>: <what>", for checks across keys.
  Status Error(const std::string& key, const std::string& what) const {
    return Status::InvalidArgument(origin_ + ": " + KeyPath(key) + ": " + what);
  }

 private:
  std::string KeyPath(const std::string& key) const;
  void Fail(const std::string& key, const std::string& what);
  YAML::Node Get(const std::string& key);

  YAML::Node node_;
  std::string path_;    // "engine.shadowkv" ("" at the root)
  std::string origin_;  // file name for messages
  std::set<std::string> seen_;
  std::optional<Status> error_;
};

}  // namespace penumbra
