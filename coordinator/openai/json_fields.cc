#include "coordinator/openai/json_fields.h"

#include <cmath>
#include <sstream>

namespace penumbra::openai::json_fields {

using nlohmann::json;

// The JSON type's name, as OpenAI's errors say it.
std::string TypeName(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    case json::value_t::number_float:
      return "a number";
    default:
      return "an integer";
  }
}

const json* Field(const json& body, const char* name) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

Result<std::optional<double>> Number(const json& body, const char* name, double lo, double hi) {
  const json* v = Field(body, name);
  if (!v) return std::optional<double>();
  if (!v->is_number()) return Bad(std::string("'") + name + "' must be a number, got " + TypeName(*v));
  const double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || x > hi) {
    std::ostringstream s;
    s << "'" << name << "' must be in [" << lo << ", " << hi << "], got " << v->dump();
    return Bad(s.str());
  }
  return std::optional<double>(x);
}

Result<std::optional<int64_t>> Integer(const json& body, const char* name, int64_t lo, int64_t hi) {
  const json* v = Field(body, name);
  if (!v) return std::optional<int64_t>();
  // 3.0 is an integer to a JavaScript client.
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e15) {
      const auto x = static_cast<int64_t>(d);
      if (x >= lo && x <= hi) return std::optional<int64_t>(x);
    }
  }
  if (!v->is_number_integer()) return Bad(std::string("'") + name + "' must be an integer, got " + v->dump());
  const bool negative = v->is_number_unsigned() ? false : v->get<int64_t>() < 0;
  if (!negative && v->get<uint64_t>() > static_cast<uint64_t>(hi)) {
    return Bad(std::string("'") + name + "' must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
               v->dump());
  }
  const int64_t x = negative ? v->get<int64_t>() : static_cast<int64_t>(v->get<uint64_t>());
  if (x < lo || x > hi) {
    return Bad(std::string("'") + name + "' must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
               std::to_string(x));
  }
  return std::optional<int64_t>(x);
}

Result<std::optional<bool>> Boolean(const json& body, const char* name) {
  const json* v = Field(body, name);
  if (!v) return std::optional<bool>();
  if (!v->is_boolean()) return Bad(std::string("'") + name + "' must be a boolean, got " + TypeName(*v));
  return std::optional<bool>(v->get<bool>());
}

Result<std::optional<std::string>> String(const json& body, const char* name) {
  const json* v = Field(body, name);
  if (!v) return std::optional<std::string>();
  if (!v->is_string()) return Bad(std::string("'") + name + "' must be a string, got " + TypeName(*v));
  return std::optional<std::string>(v->get<std::string>());
}

Result<std::vector<std::string>> Strings(const json& body, const char* name, bool one) {
  std::vector<std::string> out;
  const json* v = Field(body, name);
  if (!v) return out;
  if (one && v->is_string()) {
    out.push_back(v->get<std::string>());
    return out;
  }
  if (!v->is_array()) {
    return Bad(std::string("'") + name + "' must be " + (one ? "a string or " : "") + "an array of strings, got " +
               TypeName(*v));
  }
  for (size_t i = 0; i < v->size(); ++i) {
    if (!(*v)[i].is_string()) {
      return Bad(std::string("'") + name + "[" + std::to_string(i) + "]' must be a string, got " + TypeName((*v)[i]));
    }
    out.push_back((*v)[i].get<std::string>());
  }
  return out;
}

}  // namespace penumbra::openai::json_fields
