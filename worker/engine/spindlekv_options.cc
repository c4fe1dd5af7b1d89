#include "worker/engine/spindlekv_options.h"

#include <sstream>

namespace penumbra {

const OptionTable<SpindleKvOptions>& SpindleKvOptionTable() {
  using O = SpindleKvOptions;
  static const auto* table =
      &(*new OptionTable<O>("spindlekv"))
           .Double(&O::reserve_ratio, "spindlekv-ratio", "reserve_ratio", 0.0, 1.0,
                   "the share of a prompt's tokens kept per query head over all layers (r)")
           .Double(&O::min_ratio, "spindlekv-min-ratio", "min_ratio", 0.0, 0.5,
                   "the least share of the context a layer keeps (beta)")
           .Int(&O::window, "spindlekv-window", "window", 1, 1 << 16,
                "the observation window: last prompt tokens, always kept, whose attention decides the eviction")
           .Int(&O::pool, "spindlekv-pool", "pool", 1, 1025,
                "average pooling of the window's attention over this many tokens (odd; 1: none)")
           .Double(&O::key_threshold, "spindlekv-key-threshold", "key_threshold", -1.0, 2.0,
                   "cosine similarity above which pre-RoPE keys share a codebook entry (1 or more: none)")
           .Double(&O::value_threshold, "spindlekv-value-threshold", "value_threshold", -1.0, 2.0,
                   "cosine similarity above which values share a codebook entry (1 or more: none)")
           .Int(&O::codebook_block, "spindlekv-block", "codebook_block", 1, 1 << 16,
                "tokens per block of the prefill's greedy codebook construction")
           .Int(&O::merge_window, "spindlekv-merge-window", "merge_window", int64_t{0}, (int64_t{1} << 31) - 1,
                "a new token's key and value search the last this many codebook entries (0: all, the paper's rule)")
           .Int(&O::min_prompt_tokens, "spindlekv-min-prompt", "min_prompt_tokens", int64_t{0}, int64_t{1} << 40,
                "prompts shorter than this keep every token")
           .Check("pool", [](const O& o) -> std::string {
             return o.pool % 2 == 1 ? "" : "must be odd, got " + std::to_string(o.pool);
           });
  return *table;
}

std::string SpindleKvStateFingerprint(const SpindleKvOptions& o) {
  std::ostringstream os;
  os << "spindlekv r=" << o.reserve_ratio << " beta=" << o.min_ratio << " window=" << o.window << " pool=" << o.pool
     << " tk=" << o.key_threshold << " tv=" << o.value_threshold << " block=" << o.codebook_block
     << " min=" << o.min_prompt_tokens << " merge=" << o.merge_window;
  return os.str();
}

void AddSpindleKvFlags(Args& a) { SpindleKvOptionTable().AddFlags(a); }

Status ApplySpindleKvFlags(const Args& a, SpindleKvOptions* o) { return SpindleKvOptionTable().ApplyFlags(a, o); }

Status LoadSpindleKvOptions(ConfigReader& r, SpindleKvOptions* o) { return SpindleKvOptionTable().Load(r, o); }

}  // namespace penumbra
