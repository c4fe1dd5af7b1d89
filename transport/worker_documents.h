// Building the worker API's documents (transport/worker.thrift,
// WorkerDocument): a document named by its content digest, with or without
// its ids. The coordinator sends the ids only to a worker it does not know
// to hold the document; a worker that turns out not to hold it fails the
// request with FAILED_PRECONDITION, and the coordinator sends it again with
// the ids (coordinator/server/coordinator_generations.cc).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/hash.h"
#include "gen-cpp/worker_types.h"

namespace penumbra::transport {

// A document named by digest alone (`tokens` long).
rpc::WorkerDocument DocumentRef(const Hash128& digest, int64_t tokens);
// A document with its ids (its digest computed from them).
rpc::WorkerDocument DocumentWithIds(std::span<const int32_t> ids);
// With its ids, its digest already known (DocumentDigest of these ids).
rpc::WorkerDocument DocumentWithIds(std::span<const int32_t> ids, const Hash128& digest);
// Fills g's documents and prompt from a whole prompt whose leading documents
// end at `document_ends` (ascending, inside the prompt), every document with
// its ids: what a caller that tokenizes whole prompts sends.
void SetPrompt(rpc::WorkerGenerateRequest* g, const std::vector<int32_t>& prompt,
               const std::vector<int64_t>& document_ends);
// The documents of a whole prompt as above (a put, or ForgetDocuments).
std::vector<rpc::WorkerDocument> DocumentsOf(const std::vector<int32_t>& prompt,
                                             const std::vector<int64_t>& document_ends);

}  // namespace penumbra::transport
