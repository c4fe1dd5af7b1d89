#include "worker/engine/specontext_options.h"

#include <sstream>

#include "kernels/topk_args.h"

namespace penumbra {

const OptionTable<SpeContextOptions>& SpeContextOptionTable() {
  using O = SpeContextOptions;
  static const auto* table =
      &(*new OptionTable<O>("specontext"))
           .Int(&O::budget, "specontext-budget", "budget", 1, kernels::kTopKMaxK,
                "tokens each KV head attends to per step besides the local window, chosen by the retrieval head")
           .Int(&O::local, "specontext-local", "local", 1, 4096,
                "the last tokens (the current one included) every step attends to")
           .Int(&O::observe, "specontext-observe", "observe", 0, 1024,
                "the prompt's last tokens whose head queries' weights floor every step's scores (0: the current "
                "token's alone, the paper's)")
           .Int(&O::successors, "specontext-successors", "successors", 0, 64,
                "a selected token brings the next this many")
           .String(&O::head, "specontext-head", "head", "PATH|random",
                   "the retrieval head (head.safetensors; random: a random head of the model's shape; empty: "
                   "specontext-head.safetensors in the model's directory)")
           .Int(&O::device_layers, "specontext-device-layers", "device_layers", -1, 1 << 16,
                "layers whose keys and values stay in device memory (-1: the memory model decides per sequence)")
           .Int(&O::device_reserve_bytes, "specontext-device-reserve", "device_reserve_bytes", int64_t{0},
                int64_t{1} << 50, "device bytes the memory model leaves free")
           .Double(&O::yarn_factor, "specontext-yarn", "yarn_factor", 0.0, 1024.0,
                   "YaRN factor of the retrieval head's positions (0: per sequence, its length over the head's "
                   "trained context; 1: none)");
  return *table;
}

std::string SpeContextStateFingerprint(const SpeContextOptions& o) {
  std::ostringstream os;
  os << "specontext budget=" << o.budget << " local=" << o.local << " observe=" << o.observe
     << " successors=" << o.successors << " head=" << o.head << " yarn=" << o.yarn_factor;
  return os.str();
}

void AddSpeContextFlags(Args& a) { SpeContextOptionTable().AddFlags(a); }

Status ApplySpeContextFlags(const Args& a, SpeContextOptions* o) { return SpeContextOptionTable().ApplyFlags(a, o); }

Status LoadSpeContextOptions(ConfigReader& r, SpeContextOptions* o) { return SpeContextOptionTable().Load(r, o); }

}  // namespace penumbra
