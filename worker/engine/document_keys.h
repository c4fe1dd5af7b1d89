// The document cache's keys: the one key function a document's cached state
// is found by, in every tier (DocumentCache, worker/engine/document_cache.h)
// and on every worker sharing a store.
//
// The key of a prompt's first i documents covers a fence (what else
// determines the state: the policy's parameters, the dtype, the model and
// the tenant namespace: DocumentCache::Fence) and the content digest of every
// one of those documents (DocumentDigest, common/crypto.h: what the
// coordinator sends instead of their ids), chained document by document, so
// a document's key depends on everything before it. With a deployment secret
// (RuntimeOptions::document_key_secret, from the cluster secret) each link is
// an HMAC-SHA256 under it: nobody without the secret can compute a document's
// key from its tokens, or guess another tenant's, and keys from a store
// shared by workers (a value-store node) are unguessable there.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/hash.h"

namespace penumbra {

// keys[i] covers the prompt's first i + 1 documents: a chain over `fence`
// (everything besides the documents that the state depends on) and each
// document's length and content digest (DocumentDigest), so a document's key
// depends on everything before it. Each link is an HMAC-SHA256 under
// `secret` (the deployment's document-key secret; empty: a plain keyed-by-
// nothing HMAC), truncated to 128 bits. digests and document_ends have one
// entry per document; the ends ascend (Runtime::Validate checks requests).
std::vector<Hash128> DocumentKeys(const std::string& fence, const std::vector<Hash128>& digests,
                                  const std::vector<int64_t>& document_ends, std::string_view secret = {});
// The same keys from the documents' ids (their digests computed here).
std::vector<Hash128> PrefixKeys(const std::string& fence, const std::vector<int32_t>& prompt,
                                const std::vector<int64_t>& document_ends, std::string_view secret = {});
// The digests of the prompt's documents (DocumentDigest of each
// [previous end, end) of document_ends).
std::vector<Hash128> DocumentDigests(const std::vector<int32_t>& prompt, const std::vector<int64_t>& document_ends);

}  // namespace penumbra
