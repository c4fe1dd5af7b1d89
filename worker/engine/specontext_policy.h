// The SpeContext KV policy ("specontext"; the SpeContext paper):
// speculative context sparsity for long generations.
//
// Every layer's exact keys and values are kept, for the first device_layers
// layers in device memory and for the rest in pinned host memory (the
// paper's memory model chooses how many per sequence). Before each decode
// step's first layer, the retrieval head (worker/engine/specontext_head.h)
// projects the step's token, appends its key to the head's own K cache of
// the whole sequence and scores that cache: per query head the softmax of
// its attention weights, the element-wise maximum over the query heads of
// each GQA group, the top `budget` tokens per KV head (the kernels of
// ShadowKV's chunk scores, a chunk being one token). Every layer then
// attends to those tokens and to the `local` last ones.
//
// Each layer's selected rows are held on the device in `budget` slots;
// a step copies only the rows its selection adds to the last one's (elastic
// loading, ShadowKV's slot update with one-token chunks), on the side stream
// and ahead of the layers that read them (the selection depends on the
// token only, so the copies of the layers ahead overlap the layers'
// computation: the paper's asynchronous prefetch). PolicyStats' hit rate is
// the share of selected rows already on the device: the overlap between
// adjacent steps.
//
// Prefill is exact attention over the prompt (one layer at a time in a
// device scratch); generated tokens are stored as the prompt's are and are
// selectable once they leave the local window (long outputs are the
// paper's case).
//
// Documents (KvPrefix): every layer's exact keys and values of the
// document's tokens and the head's keys. A put moves its sequence's buffers
// into the document (the head's keys compacted); other captures copy, the
// layers into pinned host memory. A question attached to a document reads
// it in place: its own buffers hold the positions after it, the scores read
// the document's head keys as ShadowKV's shared landmarks and the row
// copies its layers as shared values. Exported as the compacted rows
// (meta, head_k, k.L, v.L).
//
// Context-parallel shards (ShardSpec): each rank holds its shard; every
// decode step the shards agree on the whole sequence's top `budget` (the
// head's statistics, then its proposals, all-gathered through the group:
// ShadowKV's global selection, once per step) and each layer's attention
// over a shard comes back with its log-sum-exp for the runtime's merge.
#pragma once

#include <memory>

#include "worker/engine/kv_policy.h"
#include "worker/engine/specontext_head.h"
#include "worker/engine/specontext_options.h"

namespace penumbra {

// InvalidArgument when the options do not fit the model (budget, local).
Result<std::unique_ptr<KvPolicy>> MakeSpeContextPolicy(const PolicyContext& ctx, const SpeContextOptions& options,
                                                       std::shared_ptr<SpeContextHead> head);

}  // namespace penumbra
