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
  // own key must be attended; the few before it are nearly always chosen).
  // Default: 32.
  int local = 32;
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
