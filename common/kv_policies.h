// The names of the KV policies a request, a document or a job may be pinned
// to (a worker runs one of them, or "auto": full or shadowkv per document).
#pragma once

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

namespace penumbra {

// "full", "shadowkv", "spindlekv" or "specontext".
inline bool IsKvPolicyPin(std::string_view p) {
  return p == "full" || p == "shadowkv" || p == "spindlekv" || p == "specontext";
}
// What a pin may be, for error messages.
inline const char* KvPolicyPins() { return "\"full\", \"shadowkv\", \"spindlekv\" or \"specontext\""; }
// Whether a worker running `worker_policy` with these forms (the policies
// its pins may name; WorkerHealth.kv_forms) holds requests pinned to `pin`
// ("" pins nothing). A worker that reports no forms: an "auto" one holds
// full and shadowkv.
inline bool KvPolicyServes(std::string_view worker_policy, const std::vector<std::string>& forms,
                           std::string_view pin) {
  if (pin.empty() || worker_policy == pin) return true;
  if (!forms.empty()) return std::find(forms.begin(), forms.end(), pin) != forms.end();
  return worker_policy == "auto" && (pin == "full" || pin == "shadowkv");
}

}  // namespace penumbra
