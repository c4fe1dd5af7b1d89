// PerDocumentKvPolicy ("auto"): a policy per document. One worker holds each
// sequence, and each cached document, under one of two policies at once (a
// third, "spindlekv", where the backend runs it, held only by a pin):
//   - "full": the exact KV cache in device memory (cascade attention over one
//     copy of a document for all its questions: the fastest decode, 128 KiB a
//     token for an 8B model);
//   - "shadowkv": low-rank keys, landmarks and outliers on the device, values
//     in host memory (a fifth of the device bytes; sparse decode).
// Which one: a sequence attached to a cached document takes the document's
// form; a request may pin one (SequenceSpec::form, GenerationRequest::
// kv_policy); otherwise the exact form when the sequence's exact bytes fit
// the budget for exact documents (exact_bytes), else ShadowKV. The document
// cache keeps the exact forms of the most recently used documents within that
// budget and moves the others to ShadowKV (DocumentCache::Place, one layer of
// one document per step): the ShadowKV state is factored from the exact keys
// and values (KvPolicy::FactorExactLayer), no model run. Sequences attached
// to a document when it moves keep the form they attached (the old state
// lives while they hold it); new ones attach the new form, so no request sees
// a document change under it.
//
// A decode batch may mix both forms: each sub-policy decodes its own
// sequences; the rows of each are passed in place when they form one run of
// the batch (the scheduler orders its batches so), else gathered into a
// scratch copy and the outputs scattered back.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "worker/engine/kv_policy.h"

namespace penumbra {

// `exact` must be a "full" policy and `sparse` a "shadowkv" one, both built
// with `ctx`. exact_bytes: device bytes of sequences and documents held in
// the exact form by choice (0: none; pins and attached exact documents
// still are). `pinned`: more forms ("spindlekv", "specontext"), each held
// only by a pin (or by attaching a document held so), never chosen by size
// nor moved to or from.
std::unique_ptr<KvPolicy> MakePerDocumentKvPolicy(const PolicyContext& ctx, std::unique_ptr<KvPolicy> exact,
                                                  std::unique_ptr<KvPolicy> sparse, size_t exact_bytes,
                                                  std::vector<std::unique_ptr<KvPolicy>> pinned = {});

}  // namespace penumbra
