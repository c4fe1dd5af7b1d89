#include "worker/engine/document_keys.h"

#include <glog/logging.h>

#include "common/crypto.h"

namespace penumbra {

std::vector<Hash128> DocumentKeys(const std::string& fence, const std::vector<Hash128>& digests,
                                  const std::vector<int64_t>& document_ends, std::string_view secret) {
  CHECK_EQ(digests.size(), document_ends.size()) << "one digest per document";
  std::vector<Hash128> keys;
  keys.reserve(document_ends.size());
  Hash128 prev = TruncatedKey(HmacSha256Stream(secret).Update("penumbra-document-keys-v2\n").Update(fence).Final());
  int64_t begin = 0;
  for (size_t i = 0; i < document_ends.size(); ++i) {
    const int64_t end = document_ends[i];
    CHECK(end > begin) << "document ends must ascend";
    const int64_t n = end - begin;
    HmacSha256Stream h(secret);
    h.Update(&prev, sizeof(prev)).Update(&n, sizeof(n)).Update(&digests[i], sizeof(Hash128));
    prev = TruncatedKey(h.Final());
    keys.push_back(prev);
    begin = end;
  }
  return keys;
}

std::vector<Hash128> PrefixKeys(const std::string& fence, const std::vector<int32_t>& prompt,
                                const std::vector<int64_t>& document_ends, std::string_view secret) {
  return DocumentKeys(fence, DocumentDigests(prompt, document_ends), document_ends, secret);
}

std::vector<Hash128> DocumentDigests(const std::vector<int32_t>& prompt, const std::vector<int64_t>& document_ends) {
  std::vector<Hash128> out;
  out.reserve(document_ends.size());
  int64_t begin = 0;
  for (int64_t end : document_ends) {
    CHECK(end > begin && end <= static_cast<int64_t>(prompt.size())) << "document ends must ascend within the prompt";
    out.push_back(DocumentDigest(prompt.data() + begin, static_cast<size_t>(end - begin)));
    begin = end;
  }
  return out;
}

}  // namespace penumbra
