// Options of the SpindleKV KV policy (worker/engine/spindlekv_policy.cc;
// the paper's Table 3 defaults). Runtime options: YAML under `spindlekv:`
// and CLI flags.
#pragma once

#include <cstdint>
#include <string>

#include "common/args.h"
#include "common/config.h"
#include "common/option_table.h"
#include "common/status.h"

namespace penumbra {

struct SpindleKvOptions {
  // The reserve ratio r: the share of a prompt's tokens the eviction keeps
  // per query head, over all layers (the pyramid of eq. 5-6 gives shallow
  // layers more and deep layers less). Default: 0.3.
  double reserve_ratio = 0.3;
  // beta: the least a layer keeps of the context (eq. 5). Default: 0.05.
  double min_ratio = 0.05;
  // The observation window: the prompt's last tokens, always kept, whose
  // queries' attention decides what the rest keeps (SnapKV's). Default: 32.
  int window = 32;
  // Average pooling of the window's accumulated attention over this many
  // neighbouring tokens (odd; 1: none) before the top-k, so that a kept
  // token keeps its neighbours (SnapKV's clustering). Default: 31, not
  // SnapKV's 7: on the evaluation model pooling over 7 keeps a needle's first
  // tokens and evicts its tail (20% at 16K against 61% with 31, 73% full;
  // docs/kv-policies.md).
  int pool = 31;
  // Cosine similarity above which a key (pre-RoPE) or a value shares a
  // codebook entry (theta_K, theta_V). 1 or more: no sharing. Defaults: 0.98
  // and 0.95.
  double key_threshold = 0.98;
  double value_threshold = 0.95;
  // The codebook is built greedily (highest degree first) inside blocks of
  // this many tokens, in token order: O(tokens x block) instead of the
  // paper's O(tokens^2); entries are not shared across blocks at prefill.
  // Default: 1024.
  int codebook_block = 1024;
  // A new token's key and value (decode, continuations) search the last
  // this many entries of their codebook for one to share, as the prefill's
  // blocks share only inside a block; 0: the whole codebook (the paper's
  // rule, which reads every entry once more each step: as many bytes as the
  // attention). Default: 1024.
  int64_t merge_window = 1024;
  // Prompts shorter than this keep every token (the codebook still applies).
  // Default: 0.
  int64_t min_prompt_tokens = 0;
};

const OptionTable<SpindleKvOptions>& SpindleKvOptionTable();
// Every option that changes the state the policy makes for given tokens
// (KvPolicy::StateFingerprint; the same for its host and device forms).
std::string SpindleKvStateFingerprint(const SpindleKvOptions& o);
void AddSpindleKvFlags(Args& a);
Status ApplySpindleKvFlags(const Args& a, SpindleKvOptions* o);
Status LoadSpindleKvOptions(ConfigReader& r, SpindleKvOptions* o);

}  // namespace penumbra
