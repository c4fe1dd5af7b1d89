// Options of the SpeContext KV policy (worker/engine/specontext_policy.h).
// Runtime options: YAML under `specontext:` and CLI flags.
#pragma once

#include <cstdint>
#include <string>

#include "common/args.h"
#include "common/config.h"
#include "common/option_table.h"
#include "common/status.h"

namespace penumbra {

struct SpeContextOptions {
  // Tokens each KV head attends to per decode step besides the local window,
  // chosen by the retrieval head (the paper's KV budget). Default: 2048, the
  // paper's choice.
  int budget = 2048;
  // The sequence's last tokens, the current one included, which every step
  // attends to and the retrieval head does not choose among (the new token's
  // own key must be attended; the answer being written is read back from
  // here). Default: 128.
  int local = 128;
  // The retrieval head: a head.safetensors file (format:
  // worker/engine/specontext_head.h; ops/evalmodel/train_specontext_head.py
  // makes one), "random" (a random head of the model's shape: throughput
  // runs on random weights), or empty: specontext-head.safetensors in the
  // model's directory. Default: empty.
  std::string head;
  // Layers whose exact keys and values stay in device memory; the rest live
  // in pinned host memory and the selected rows are copied each step (only
  // those not already on the device: elastic loading). -1: the paper's memory
  // model decides per sequence at admission (as many layers as fit while
  // device_reserve_bytes stay free). Default: -1.
  int device_layers = -1;
  // Device memory the memory model leaves free (activations, workspaces and
  // the next sequences' fixed buffers). Default: 4 GiB.
  int64_t device_reserve_bytes = int64_t{4} << 30;
  // The prompt's last this many tokens: the head's attention weights of
  // their queries (max over them) are a floor of every decode step's
  // scores, so that what the prompt's end asked for (a question) stays
  // selected; the paper scores the current token's query alone (0). Scored
  // once when a prefill ends. Default: 0.
  int observe = 0;
  // A selected token brings the next this many (their scores are at least
  // its): the head finds a key by its own tokens, the answer follows them.
  // Default: 16 (the paper selects tokens alone: 0; on the evaluation model
  // that loses the needle at any budget, docs/kv-policies.md).
  int successors = 16;
  // YaRN factor of the retrieval head's positions (training-free context
  // extension, as the paper does): 0 = per sequence, its length over the
  // head's trained context (at least 1: plain RoPE within it); 1 = none.
  // Default: 0.
  double yarn_factor = 0;
};

const OptionTable<SpeContextOptions>& SpeContextOptionTable();
// Every option that changes what the policy computes for given tokens.
std::string SpeContextStateFingerprint(const SpeContextOptions& o);
void AddSpeContextFlags(Args& a);
Status ApplySpeContextFlags(const Args& a, SpeContextOptions* o);
Status LoadSpeContextOptions(ConfigReader& r, SpeContextOptions* o);

}  // namespace penumbra
