// The names of the KV policies a request, a document or a job may be pinned
// to (a worker runs one of them, or "auto": full or shadowkv per document).
#pragma once

#include <string>
#include <string_view>

namespace penumbra {

// "full", "shadowkv" or "spindlekv".
inline bool IsKvPolicyPin(std::string_view p) { return p == "full" || p == "shadowkv" || p == "spindlekv"; }
// What a pin may be, for error messages: "\"full\", \"shadowkv\" or \"spindlekv\"".
inline const char* KvPolicyPins() { return "\"full\", \"shadowkv\" or \"spindlekv\""; }
// Whether a worker running `worker_policy` holds requests pinned to `pin`
// ("" pins nothing; an "auto" worker holds full and shadowkv).
inline bool KvPolicyServes(std::string_view worker_policy, std::string_view pin) {
  return pin.empty() || worker_policy == pin || (worker_policy == "auto" && (pin == "full" || pin == "shadowkv"));
}

}  // namespace penumbra
