#include "transport/worker_documents.h"

#include <algorithm>

#include "common/crypto.h"

namespace penumbra::transport {

rpc::WorkerDocument DocumentRef(const Hash128& digest, int64_t tokens) {
  rpc::WorkerDocument d;
  d.digest = Hash128Bytes(digest);
  d.tokens = tokens;
  return d;
}

rpc::WorkerDocument DocumentWithIds(std::span<const int32_t> ids, const Hash128& digest) {
  rpc::WorkerDocument d = DocumentRef(digest, static_cast<int64_t>(ids.size()));
  d.__set_ids(std::vector<int32_t>(ids.begin(), ids.end()));
  return d;
}

rpc::WorkerDocument DocumentWithIds(std::span<const int32_t> ids) {
  return DocumentWithIds(ids, DocumentDigest(ids.data(), ids.size()));
}

std::vector<rpc::WorkerDocument> DocumentsOf(const std::vector<int32_t>& prompt,
                                             const std::vector<int64_t>& document_ends) {
  std::vector<rpc::WorkerDocument> out;
  int64_t begin = 0;
  const auto size = static_cast<int64_t>(prompt.size());
  for (int64_t end : document_ends) {
    // Ends outside the prompt (a caller's bad input) give a document whose
    // length and ids disagree: the worker refuses it, naming it.
    const int64_t b = std::clamp<int64_t>(begin, 0, size), e = std::clamp<int64_t>(end, b, size);
    rpc::WorkerDocument d = DocumentWithIds(std::span<const int32_t>(prompt).subspan(b, e - b));
    d.tokens = end - begin;
    out.push_back(std::move(d));
    begin = end;
  }
  return out;
}

void SetPrompt(rpc::WorkerGenerateRequest* g, const std::vector<int32_t>& prompt,
               const std::vector<int64_t>& document_ends) {
  g->documents = DocumentsOf(prompt, document_ends);
  const int64_t begin =
      std::clamp<int64_t>(document_ends.empty() ? 0 : document_ends.back(), 0, static_cast<int64_t>(prompt.size()));
  g->prompt.assign(prompt.begin() + begin, prompt.end());
}

}  // namespace penumbra::transport
