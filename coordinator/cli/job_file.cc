#include "coordinator/cli/job_file.h"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <limits>
#include <map>

#include <nlohmann/json.hpp>

#include "common/kv_policies.h"

namespace penumbra {
namespace {

using nlohmann::json;

constexpr size_t kMaxIdBytes = 256;
constexpr size_t kMaxStops = 16;
constexpr size_t kMaxStopBytes = 256;
constexpr int64_t kMaxNewTokens = int64_t{1} << 20;
constexpr double kMaxTemperature = 100.0;
constexpr size_t kUnbounded = std::numeric_limits<size_t>::max();

const char* const kKeys[] = {"custom_id",      "custom_id_prefix", "documents", "question", "question_ids", "questions",
                             "max_new_tokens", "temperature",      "top_k",     "top_p",    "seed",         "stop",
                             "kv_policy"};

// A value as the error shows it: short, one line.
std::string Shown(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > 40 ? s.substr(0, 37) + "..." : s;
}

// Errors of one line: `NAME:LINE: ...`.
class LineReader {
 public:
  LineReader(const std::string& name, int64_t line) : where_(name + ":" + std::to_string(line) + ": ") {}

  Status Error(const std::string& message) const { return Status::InvalidArgument(where_ + message); }
  Status KeyError(const std::string& key, const std::string& must, const json& got) const {
    return Error("\"" + key + "\" must be " + must + ", got " + Shown(got));
  }

  Result<int64_t> Int(const json& o, const std::string& key, int64_t lo, int64_t hi) const {
    const json& v = o.at(key);
    const std::string must = "an integer " + (hi == std::numeric_limits<int64_t>::max()
                                                  ? ">= " + std::to_string(lo)
                                                  : "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    if (!v.is_number_integer()) return KeyError(key, must, v);
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return KeyError(key, must, v);
    }
    const int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) return KeyError(key, must, v);
    return x;
  }

  Result<double> Number(const json& o, const std::string& key, double lo, double hi, bool lo_open) const {
    const json& v = o.at(key);
    const std::string must =
        std::string("a number in ") + (lo_open ? "(" : "[") + Shown(json(lo)) + ", " + Shown(json(hi)) + "]";
    if (!v.is_number()) return KeyError(key, must, v);
    const double x = v.get<double>();
    if (!(lo_open ? x > lo : x >= lo) || !(x <= hi)) return KeyError(key, must, v);
    return x;
  }

  Result<std::string> String(const json& o, const std::string& key, size_t min_bytes, size_t max_bytes) const {
    const json& v = o.at(key);
    const std::string must = max_bytes == kUnbounded ? "a non-empty string"
                                                     : "a string of " + std::to_string(min_bytes) + ".." +
                                                           std::to_string(max_bytes) + " bytes";
    if (!v.is_string()) return KeyError(key, must, v);
    std::string s = v.get<std::string>();
    if (s.size() < min_bytes || s.size() > max_bytes) return KeyError(key, must, v);
    return s;
  }

  // A list of strings, each 1..max_bytes bytes.
  Result<std::vector<std::string>> Strings(const json& o, const std::string& key, size_t max_items,
                                           size_t max_bytes) const {
    const json& v = o.at(key);
    const std::string must = (max_items == kUnbounded ? std::string("a list of strings")
                                                      : "a list of at most " + std::to_string(max_items) + " strings") +
                             ", each 1.." + std::to_string(max_bytes) + " bytes";
    if (!v.is_array() || v.size() > max_items) return KeyError(key, must, v);
    std::vector<std::string> out;
    for (size_t i = 0; i < v.size(); ++i) {
      if (!v[i].is_string() || v[i].get_ref<const std::string&>().empty() ||
          v[i].get_ref<const std::string&>().size() > max_bytes) {
        return KeyError(key + "[" + std::to_string(i) + "]", "a string of 1.." + std::to_string(max_bytes) + " bytes",
                        v[i]);
      }
      out.push_back(v[i].get<std::string>());
    }
    return out;
  }

 private:
  std::string where_;
};

// The request options of one line (every key but the ids and the questions).
Status ReadRequest(const LineReader& r, const json& o, rpc::GenerateRequest* g) {
  if (o.contains("documents")) {
    PENUMBRA_ASSIGN_OR_RETURN(g->document_ids, r.Strings(o, "documents", kUnbounded, kMaxIdBytes));
  }
  if (o.contains("max_new_tokens")) {
    PENUMBRA_ASSIGN_OR_RETURN(int64_t n, r.Int(o, "max_new_tokens", 1, kMaxNewTokens));
    g->max_new_tokens = static_cast<int32_t>(n);
  }
  if (o.contains("temperature")) {
    PENUMBRA_ASSIGN_OR_RETURN(g->sampling.temperature, r.Number(o, "temperature", 0.0, kMaxTemperature, false));
  }
  if (o.contains("top_k")) {
    PENUMBRA_ASSIGN_OR_RETURN(int64_t k, r.Int(o, "top_k", 0, std::numeric_limits<int32_t>::max()));
    g->sampling.top_k = static_cast<int32_t>(k);
  }
  if (o.contains("top_p")) {
    PENUMBRA_ASSIGN_OR_RETURN(g->sampling.top_p, r.Number(o, "top_p", 0.0, 1.0, /*lo_open=*/true));
  }
  if (o.contains("seed")) {
    PENUMBRA_ASSIGN_OR_RETURN(g->sampling.seed, r.Int(o, "seed", 0, std::numeric_limits<int64_t>::max()));
  }
  if (o.contains("stop")) {
    PENUMBRA_ASSIGN_OR_RETURN(g->stop, r.Strings(o, "stop", kMaxStops, kMaxStopBytes));
  }
  if (o.contains("kv_policy")) {
    const json& v = o.at("kv_policy");
    if (!v.is_string() || !IsKvPolicyPin(v.get<std::string>())) return r.KeyError("kv_policy", KvPolicyPins(), v);
    g->kv_policy = v.get<std::string>();
  }
  return Status::OK();
}

Status ReadQuestionIds(const LineReader& r, const json& o, rpc::GenerateRequest* g) {
  const json& v = o.at("question_ids");
  const std::string must = "a non-empty list of token ids (integers in [0, 2147483647])";
  if (!v.is_array() || v.empty()) return r.KeyError("question_ids", must, v);
  std::vector<int32_t> ids;
  for (const json& x : v) {
    // An unsigned id past INT64_MAX reads back negative: refused too.
    if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return r.KeyError("question_ids", must, x);
    }
    ids.push_back(static_cast<int32_t>(x.get<int64_t>()));
  }
  g->__set_token_ids(ids);
  return Status::OK();
}

// The items of one line, appended to `out`.
Status ReadLine(const LineReader& r, const json& o, std::vector<rpc::JobItem>* out) {
  if (!o.is_object()) return r.Error("not a JSON object");
  for (const auto& kv : o.items()) {
    if (std::find(std::begin(kKeys), std::end(kKeys), kv.key()) == std::end(kKeys)) {
      return r.Error("unknown key \"" + kv.key() + "\"");
    }
  }
  const int forms = o.contains("question") + o.contains("question_ids") + o.contains("questions");
  if (forms != 1) return r.Error("give exactly one of \"question\", \"question_ids\", \"questions\"");
  rpc::GenerateRequest g;
  PENUMBRA_RETURN_IF_ERROR(ReadRequest(r, o, &g));
  if (!o.contains("questions")) {
    if (o.contains("custom_id_prefix")) {
      return r.Error("\"custom_id_prefix\" goes with \"questions\"; use \"custom_id\"");
    }
    if (!o.contains("custom_id")) return r.Error("\"custom_id\" is required");
    rpc::JobItem item;
    PENUMBRA_ASSIGN_OR_RETURN(item.custom_id, r.String(o, "custom_id", 1, kMaxIdBytes));
    if (o.contains("question")) {
      PENUMBRA_ASSIGN_OR_RETURN(std::string q, r.String(o, "question", 1, kUnbounded));
      g.__set_text(q);
    } else {
      PENUMBRA_RETURN_IF_ERROR(ReadQuestionIds(r, o, &g));
    }
    item.request = g;  // Thrift structs copy (no move assignment)
    out->push_back(std::move(item));
    return Status::OK();
  }
  if (o.contains("custom_id")) return r.Error("\"custom_id\" goes with \"question\"; use \"custom_id_prefix\"");
  if (!o.contains("custom_id_prefix")) return r.Error("\"custom_id_prefix\" is required with \"questions\"");
  const json& qs = o.at("questions");
  if (!qs.is_array() || qs.empty()) return r.KeyError("questions", "a non-empty list of strings", qs);
  // Room for "-" and the largest index.
  const size_t max_prefix = kMaxIdBytes - 1 - std::to_string(qs.size() - 1).size();
  PENUMBRA_ASSIGN_OR_RETURN(std::string prefix, r.String(o, "custom_id_prefix", 1, max_prefix));
  for (size_t i = 0; i < qs.size(); ++i) {
    if (!qs[i].is_string() || qs[i].get_ref<const std::string&>().empty()) {
      return r.KeyError("questions[" + std::to_string(i) + "]", "a non-empty string", qs[i]);
    }
    rpc::JobItem item;
    item.custom_id = prefix + "-" + std::to_string(i);
    item.request = g;
    item.request.__set_text(qs[i].get<std::string>());
    out->push_back(std::move(item));
  }
  return Status::OK();
}

}  // namespace

Result<JobFile> ParseJobLines(std::istream& in, const std::string& name) {
  JobFile file;
  std::vector<rpc::JobItem>& items = file.items;
  std::map<std::string, int64_t> line_of;  // custom_id -> the line that made it
  std::string text;
  int64_t line = 0;
  while (std::getline(in, text)) {
    ++line;
    if (!text.empty() && text.back() == '\r') text.pop_back();
    if (text.find_first_not_of(" \t") == std::string::npos) continue;
    const LineReader r(name, line);
    json o;
    try {
      o = json::parse(text);
    } catch (const json::parse_error& e) {
      std::string what = e.what();
      const size_t bracket = what.find("] ");
      return r.Error("not JSON: " + (bracket == std::string::npos ? what : what.substr(bracket + 2)));
    }
    const size_t first = items.size();
    PENUMBRA_RETURN_IF_ERROR(ReadLine(r, o, &items));
    for (size_t i = first; i < items.size(); ++i) {
      auto [it, added] = line_of.emplace(items[i].custom_id, line);
      if (!added) {
        return r.Error("custom_id \"" + items[i].custom_id + "\" is already used on line " +
                       std::to_string(it->second));
      }
      file.lines.push_back(line);
    }
    if (items.size() > kMaxJobFileItems) {
      return r.Error("more than " + std::to_string(kMaxJobFileItems) + " items (split the file into several jobs)");
    }
  }
  if (in.bad()) return Status::IOError(name + ": read failed");
  if (items.empty()) return Status::InvalidArgument(name + ": no items");
  return file;
}

Result<JobFile> ReadJobFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot open " + path);
  return ParseJobLines(in, path);
}

}  // namespace penumbra
