// Readers of a request body's fields, shared by the OpenAI API's
// translations (openai_api.cc, batch_api.cc): absent and null read as unset;
// any other type, or a value out of range, is InvalidArgument naming the
// field as OpenAI's errors do ("'max_tokens' must be an integer, got ...").
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace penumbra::openai::json_fields {

inline Status Bad(const std::string& message) { return Status::InvalidArgument(message); }
// The JSON type's name ("a string", "an array", ...).
std::string TypeName(const nlohmann::json& v);
// The field, or null when absent or null.
const nlohmann::json* Field(const nlohmann::json& body, const char* name);
Result<std::optional<double>> Number(const nlohmann::json& body, const char* name, double lo, double hi);
// An integer in [lo, hi] (3.0 is one: JavaScript clients send it so).
Result<std::optional<int64_t>> Integer(const nlohmann::json& body, const char* name, int64_t lo, int64_t hi);
Result<std::optional<bool>> Boolean(const nlohmann::json& body, const char* name);
Result<std::optional<std::string>> String(const nlohmann::json& body, const char* name);
// A list of strings (or one string, where `one` allows it).
Result<std::vector<std::string>> Strings(const nlohmann::json& body, const char* name, bool one);

}  // namespace penumbra::openai::json_fields
