#include "worker/engine/per_document_policy.h"

#include <glog/logging.h>

#include <algorithm>
#include <array>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "worker/engine/op_profiler.h"

namespace penumbra {
namespace {

// The forms: sub_[kExact] "full", sub_[kSparse] "shadowkv", then the forms
// held only by a pin ("spindlekv", "specontext").
constexpr int kExact = 0, kSparse = 1;

// A document's exact form factored into ShadowKV, a layer per step, through
// a sequence of the sparse policy's own (ids the runtime never uses).
class ExactToSparseMove final : public PrefixMove {
 public:
  ExactToSparseMove(KvPolicy* sparse, int64_t seq, std::shared_ptr<const KvPrefix> from, const ExactKv& kv, int layers)
      : sparse_(sparse), seq_(seq), from_(std::move(from)), kv_(kv), layers_(layers) {}
  ~ExactToSparseMove() override {
    if (added_) sparse_->RemoveSequence(seq_);
  }
  Status Begin() {
    SequenceSpec spec;
    spec.prompt_len = kv_.tokens;
    spec.max_new_tokens = 0;
    spec.first_prefill = kv_.tokens;
    PENUMBRA_RETURN_IF_ERROR(sparse_->AddSequence(seq_, spec));
    added_ = true;
    return Status::OK();
  }
  Result<bool> Step() override {
    if (result_) return true;
    const double t0 = NowSeconds();
    if (layer_ < layers_) {
      Status s = sparse_->FactorExactLayer(seq_, kv_, layer_);
      seconds_ += NowSeconds() - t0;
      PENUMBRA_RETURN_IF_ERROR(s);
      ++layer_;
      return false;
    }
    Result<std::shared_ptr<const KvPrefix>> p = sparse_->TakePrefix(seq_, kv_.tokens);
    sparse_->RemoveSequence(seq_);
    added_ = false;
    seconds_ += NowSeconds() - t0;
    PENUMBRA_RETURN_IF_ERROR(p.status());
    result_ = std::move(*p);
    return true;
  }
  std::shared_ptr<const KvPrefix> result() const override { return result_; }
  const std::shared_ptr<const KvPrefix>& from() const override { return from_; }
  double seconds() const override { return seconds_; }

 private:
  KvPolicy* const sparse_;
  const int64_t seq_;
  const std::shared_ptr<const KvPrefix> from_;  // held: its K/V are read until the last layer
  const ExactKv kv_;
  const int layers_;
  int layer_ = 0;
  bool added_ = false;
  double seconds_ = 0;
  std::shared_ptr<const KvPrefix> result_;
};

class PerDocumentKvPolicy final : public KvPolicy {
 public:
  PerDocumentKvPolicy(const PolicyContext& ctx, std::unique_ptr<KvPolicy> exact, std::unique_ptr<KvPolicy> sparse,
                      std::vector<std::unique_ptr<KvPolicy>> pinned, size_t exact_bytes)
      : ctx_(ctx), exact_bytes_(exact_bytes) {
    CHECK(exact && exact->name() == "full") << "auto: the exact policy must be full";
    CHECK(sparse && sparse->name() == "shadowkv") << "auto: the sparse policy must be shadowkv";
    sub_.push_back(std::move(exact));
    sub_.push_back(std::move(sparse));
    for (auto& p : pinned) {
      CHECK(p && (p->name() == "spindlekv" || p->name() == "specontext"))
          << "auto: a pinned-only form must be spindlekv or specontext";
      CHECK_LT(IndexOf(p->name()), 0) << "auto: two " << p->name() << " forms";
      sub_.push_back(std::move(p));
    }
    rows_.resize(sub_.size());
    begun_.assign(sub_.size(), false);
  }

  std::string name() const override { return "auto"; }
  std::vector<std::string> Forms() const override {
    std::vector<std::string> out;
    for (const auto& s : sub_) out.push_back(s->name());
    return out;
  }
  std::string FormOf(int64_t seq) const override {
    auto it = where_.find(seq);
    return it == where_.end() ? std::string() : sub_[it->second]->name();
  }

  Status AddSequence(int64_t seq, const SequenceSpec& spec) override {
    if (where_.count(seq)) return Status::InvalidArgument("sequence " + std::to_string(seq) + " already exists");
    if (spec.shard.sharded()) {
      return Status::Unimplemented(
          "the auto KV policy does not hold context-parallel shards (run the group under full or shadowkv)");
    }
    PENUMBRA_ASSIGN_OR_RETURN(int w, Choose(spec));
    PENUMBRA_RETURN_IF_ERROR(sub_[w]->AddSequence(seq, spec));
    where_[seq] = w;
    return Status::OK();
  }
  void RemoveSequence(int64_t seq) override {
    auto it = where_.find(seq);
    if (it == where_.end()) return;
    sub_[it->second]->RemoveSequence(seq);
    where_.erase(it);
  }

  Status PrefillAttention(int layer, int64_t seq, const float* qkv, int n, int64_t start, const int32_t* positions,
                          void* q_scratch, void* out, float* lse) override {
    return Of(seq).PrefillAttention(layer, seq, qkv, n, start, positions, q_scratch, out, lse);
  }
  Status FinishPrefillLayer(int layer, int64_t seq, int64_t prompt_len) override {
    return Of(seq).FinishPrefillLayer(layer, seq, prompt_len);
  }
  Status PrefillTokens(int64_t seq, const int32_t* ids, const int32_t* positions, int n, int64_t start) override {
    return Of(seq).PrefillTokens(seq, ids, positions, n, start);
  }
  bool PrefillSplits(int64_t seq) const override {
    auto it = where_.find(seq);
    return it == where_.end() || sub_[it->second]->PrefillSplits(seq);
  }

  // ------------------------------------------------------------------ decode

  Status BeginDecodeStep(const std::vector<int64_t>& seqs, const std::vector<int64_t>& positions) override {
    for (auto& rows : rows_) rows.clear();
    for (size_t i = 0; i < seqs.size(); ++i) {
      auto it = where_.find(seqs[i]);
      if (it == where_.end()) return Status::NotFound("sequence " + std::to_string(seqs[i]) + " does not exist");
      rows_[it->second].push_back(static_cast<int>(i));
    }
    // In place when each form's rows are one run of the batch.
    in_place_ = true;
    order_.clear();
    for (const auto& r : rows_) {
      if (!r.empty() && r.back() - r.front() + 1 != static_cast<int>(r.size())) in_place_ = false;
      order_.insert(order_.end(), r.begin(), r.end());
    }
    for (size_t w = 0; w < sub_.size(); ++w) {
      if (rows_[w].empty()) continue;
      std::vector<int64_t> s, p;
      for (int i : rows_[w]) {
        s.push_back(seqs[i]);
        p.push_back(positions[i]);
      }
      begun_[w] = true;
      PENUMBRA_RETURN_IF_ERROR(sub_[w]->BeginDecodeStep(s, p));
    }
    ++stats_.decode_steps;
    return Status::OK();
  }

  // Each form's rows of the step's tokens (gathered when its rows are not
  // one run of the batch).
  Status DecodeTokens(const int32_t* ids, const int32_t* positions) override {
    const int32_t* id = ids;
    const int32_t* pos = positions;
    if (!in_place_) {
      PENUMBRA_RETURN_IF_ERROR(EnsureScratch());
      PENUMBRA_RETURN_IF_ERROR(Permute(g_ids_.get(), ids, sizeof(int32_t), /*gather=*/true));
      PENUMBRA_RETURN_IF_ERROR(Permute(g_pos_.get(), positions, sizeof(int32_t), true));
      id = g_ids_.as<int32_t>();
      pos = g_pos_.as<int32_t>();
    }
    int at = 0;
    for (size_t w = 0; w < sub_.size(); ++w) {
      if (rows_[w].empty()) continue;
      const int a = in_place_ ? rows_[w].front() : at;
      PENUMBRA_RETURN_IF_ERROR(sub_[w]->DecodeTokens(id + a, pos + a));
      at += static_cast<int>(rows_[w].size());
    }
    return Status::OK();
  }

  Status DecodeAttention(int layer, const float* qkv, const int32_t* positions, void* q_scratch, void* out,
                         float* lse) override {
    const int64_t qkv_row = QkvRow();
    const size_t act_row = ActRow();
    // Each form's rows: in place (at their run of the batch), or gathered
    // into the scratch copy (the exact form's first) and scattered back.
    const float* q_in = qkv;
    const int32_t* pos = positions;
    char* q_out = static_cast<char*>(q_scratch);
    char* attn = static_cast<char*>(out);
    float* lse_out = lse;
    if (!in_place_) {
      PENUMBRA_RETURN_IF_ERROR(EnsureScratch());
      PENUMBRA_RETURN_IF_ERROR(Permute(g_qkv_.get(), qkv, qkv_row * sizeof(float), /*gather=*/true));
      PENUMBRA_RETURN_IF_ERROR(Permute(g_pos_.get(), positions, sizeof(int32_t), true));
      q_in = g_qkv_.as<float>();
      pos = g_pos_.as<int32_t>();
      q_out = static_cast<char*>(g_q_.get());
      attn = static_cast<char*>(g_out_.get());
      lse_out = lse ? g_lse_.as<float>() : nullptr;
    }
    int at = 0;
    for (size_t w = 0; w < sub_.size(); ++w) {
      if (rows_[w].empty()) continue;
      const int a = in_place_ ? rows_[w].front() : at;
      PENUMBRA_RETURN_IF_ERROR(
          sub_[w]->DecodeAttention(layer, q_in + a * qkv_row, pos + a, q_out + a * act_row, attn + a * act_row,
                                   lse_out ? lse_out + static_cast<int64_t>(a) * ctx_.hq : nullptr));
      at += static_cast<int>(rows_[w].size());
    }
    if (in_place_) return Status::OK();
    PENUMBRA_RETURN_IF_ERROR(Permute(out, g_out_.get(), act_row, /*gather=*/false));
    PENUMBRA_RETURN_IF_ERROR(Permute(q_scratch, g_q_.get(), act_row, false));
    if (lse) PENUMBRA_RETURN_IF_ERROR(Permute(lse, g_lse_.get(), ctx_.hq * sizeof(float), false));
    return Status::OK();
  }

  Status FinishDecodeStep() override {
    Status first;
    for (size_t w = 0; w < sub_.size(); ++w) {
      if (!begun_[w]) continue;
      Status s = sub_[w]->FinishDecodeStep();
      if (first.ok() && !s.ok()) first = s;
    }
    return first;
  }
  void EndDecodeStep() override {
    for (size_t w = 0; w < sub_.size(); ++w) {
      if (begun_[w]) sub_[w]->EndDecodeStep();
      begun_[w] = false;
    }
  }

  // ------------------------------------------------------------- documents

  std::string StateFingerprint() const override {
    // A document's key is the same whichever form holds it.
    std::string f = "auto[" + sub_[kExact]->StateFingerprint() + ";" + sub_[kSparse]->StateFingerprint();
    for (size_t w = kSparse + 1; w < sub_.size(); ++w) f += ";" + sub_[w]->StateFingerprint();
    return f + "]";
  }
  Result<std::shared_ptr<const KvPrefix>> CapturePrefix(int64_t seq, int64_t tokens) override {
    return Of(seq).CapturePrefix(seq, tokens);
  }
  Result<std::shared_ptr<const KvPrefix>> TakePrefix(int64_t seq, int64_t tokens) override {
    return Of(seq).TakePrefix(seq, tokens);
  }
  Result<std::shared_ptr<const KvPrefix>> ImportPrefix(const std::map<std::string, std::string>& blobs) override {
    return sub_[StoredForm(blobs)]->ImportPrefix(blobs);
  }
  std::vector<std::string> LazyBlobs() const override { return sub_[kSparse]->LazyBlobs(); }
  Result<std::shared_ptr<const KvPrefix>> ImportPrefixLazy(const std::map<std::string, std::string>& blobs,
                                                           std::shared_ptr<storage::BlobReader> lazy,
                                                           int read_threads) override {
    return sub_[StoredForm(blobs)]->ImportPrefixLazy(blobs, std::move(lazy), read_threads);
  }

  size_t ExactBudgetBytes() const override { return exact_bytes_; }
  Result<std::unique_ptr<PrefixMove>> BeginMove(std::shared_ptr<const KvPrefix> from) override {
    ExactKv kv;
    if (!from || !from->exact_kv(&kv)) {
      return Status::InvalidArgument("auto: only a document held in the exact form moves (to shadowkv)");
    }
    auto move = std::make_unique<ExactToSparseMove>(sub_[kSparse].get(), next_move_seq_--, std::move(from), kv,
                                                    ctx_.num_layers);
    PENUMBRA_RETURN_IF_ERROR(move->Begin());
    return std::unique_ptr<PrefixMove>(std::move(move));
  }

  // ----------------------------------------------------------------- the rest

  Status SynthesizeContext(int64_t seq, int64_t length, uint64_t seed) override {
    return Of(seq).SynthesizeContext(seq, length, seed);
  }
  size_t DeviceBytes(int64_t seq) const override {
    auto it = where_.find(seq);
    return it == where_.end() ? 0 : sub_[it->second]->DeviceBytes(seq);
  }
  SequenceBytes EstimateSequenceBytes(const SequenceSpec& spec) const override {
    Result<int> w = Choose(spec);
    return w.ok() ? sub_[*w]->EstimateSequenceBytes(spec) : SequenceBytes{};
  }
  PolicyStats stats() const override {
    PolicyStats st = sub_[kSparse]->stats();
    for (size_t w = 0; w < sub_.size(); ++w) {
      if (w == kSparse) continue;
      const PolicyStats e = sub_[w]->stats();
      st.selected_chunks += e.selected_chunks;
      st.hit_chunks += e.hit_chunks;
      st.kv_exact_bytes += e.kv_exact_bytes;
      st.kv_kept_bytes += e.kv_kept_bytes;
      for (const auto& [op, ms] : e.prefill_op_ms) st.prefill_op_ms[op] += ms;
    }
    st.decode_steps = stats_.decode_steps;
    return st;
  }
  void SetProfiling(bool on) override {
    for (auto& p : sub_) p->SetProfiling(on);
  }
  void SetDecodeProfiler(OpProfiler* profiler) override {
    for (auto& p : sub_) p->SetDecodeProfiler(profiler);
  }
  Status SetForcedHitRate(double rate) override { return sub_[kSparse]->SetForcedHitRate(rate); }

 private:
  // The form a new sequence is held in (see the header).
  Result<int> Choose(const SequenceSpec& spec) const {
    const int pinned = spec.form.empty() ? -1 : IndexOf(spec.form);
    if (!spec.form.empty() && pinned < 0) {
      return Status::InvalidArgument("auto: a sequence's form must be one of this worker's (" + FormList() +
                                     "), not \"" + spec.form + "\"");
    }
    if (spec.prefix) {
      const int w = IndexOf(spec.prefix->policy());
      if (w < 0)
        return Status::InvalidArgument("auto: no form of this worker holds a " + spec.prefix->policy() + " document");
      if (pinned >= 0 && pinned != w) {
        return Status::InvalidArgument("auto: a sequence pinned to " + sub_[pinned]->name() +
                                       " cannot attach a document held as " + spec.prefix->policy());
      }
      return w;
    }
    if (pinned >= 0) return pinned;
    const SequenceBytes exact = sub_[kExact]->EstimateSequenceBytes(spec);
    return exact.device > 0 && exact.device <= exact_bytes_ ? kExact : kSparse;
  }
  int IndexOf(const std::string& form) const {
    for (size_t w = 0; w < sub_.size(); ++w) {
      if (sub_[w]->name() == form) return static_cast<int>(w);
    }
    return -1;
  }
  std::string FormList() const {
    std::string s;
    for (const auto& n : Forms()) s += (s.empty() ? "" : ", ") + n;
    return s;
  }
  // A stored document's form, from its meta blob (the full policy's begins
  // "full-kv-prefix", spindlekv's "spindlekv-prefix", specontext's
  // "specontext-prefix"); the sparse policy refuses what is none of them, by
  // name.
  int StoredForm(const std::map<std::string, std::string>& blobs) const {
    auto it = blobs.find("meta");
    if (it == blobs.end()) return kSparse;
    if (it->second.rfind("full-kv-prefix", 0) == 0) return kExact;
    for (const char* form : {"spindlekv", "specontext"}) {
      const int w = IndexOf(form);
      if (w >= 0 && it->second.rfind(std::string(form) + "-prefix", 0) == 0) return w;
    }
    return kSparse;
  }
  KvPolicy& Of(int64_t seq) {
    auto it = where_.find(seq);
    CHECK(it != where_.end()) << "auto: sequence " << seq << " does not exist";
    return *sub_[it->second];
  }

  int64_t QkvRow() const { return static_cast<int64_t>(ctx_.hq + 2 * ctx_.hkv) * ctx_.head_dim; }  // floats
  size_t ActRow() const { return static_cast<size_t>(ctx_.hq) * ctx_.head_dim * DTypeSize(ctx_.backend->act_dtype()); }
  // The step's gathered copies, for a batch of order_.size() rows.
  Status EnsureScratch() {
    const int batch = static_cast<int>(order_.size());
    if (scratch_rows_ >= batch) return Status::OK();
    Backend& b = *ctx_.backend;
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());  // the old scratch may still be read
    const size_t rows = static_cast<size_t>(batch), act_row = ActRow();
    PENUMBRA_ASSIGN_OR_RETURN(g_qkv_, b.Allocate(rows * QkvRow() * sizeof(float)));
    PENUMBRA_ASSIGN_OR_RETURN(g_ids_, b.Allocate(rows * sizeof(int32_t)));
    PENUMBRA_ASSIGN_OR_RETURN(g_pos_, b.Allocate(rows * sizeof(int32_t)));
    PENUMBRA_ASSIGN_OR_RETURN(g_q_, b.Allocate(rows * act_row));
    PENUMBRA_ASSIGN_OR_RETURN(g_out_, b.Allocate(rows * act_row));
    PENUMBRA_ASSIGN_OR_RETURN(g_lse_, b.Allocate(rows * ctx_.hq * sizeof(float)));
    scratch_rows_ = batch;
    return Status::OK();
  }
  // gather: dst row j <- src row order_[j]; else dst row order_[j] <- src
  // row j. Runs of consecutive rows are one copy.
  Status Permute(void* dst, const void* src, size_t row_bytes, bool gather) {
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    const int n = static_cast<int>(order_.size());
    for (int j = 0; j < n;) {
      int k = j + 1;
      while (k < n && order_[k] == order_[k - 1] + 1) ++k;
      const size_t scattered = static_cast<size_t>(order_[j]) * row_bytes, packed = static_cast<size_t>(j) * row_bytes;
      const size_t bytes = static_cast<size_t>(k - j) * row_bytes;
      PENUMBRA_RETURN_IF_ERROR(gather ? ctx_.backend->CopyDeviceToDevice(d + packed, s + scattered, bytes)
                                      : ctx_.backend->CopyDeviceToDevice(d + scattered, s + packed, bytes));
      j = k;
    }
    return Status::OK();
  }

  PolicyContext ctx_;
  const size_t exact_bytes_;
  std::vector<std::unique_ptr<KvPolicy>> sub_;
  std::map<int64_t, int> where_;  // sequence -> its form
  // The decode step: each form's batch rows, whether they were begun, the
  // gathered order (rows of the exact form first) and its scratch.
  std::vector<std::vector<int>> rows_;
  std::vector<bool> begun_;
  std::vector<int> order_;
  bool in_place_ = true;
  int scratch_rows_ = 0;
  DeviceBuffer g_qkv_, g_ids_, g_pos_, g_q_, g_out_, g_lse_;
  // Moves factor through sequences of the sparse policy with ids from here
  // down (the runtime's are >= 0).
  int64_t next_move_seq_ = std::numeric_limits<int64_t>::min() / 2;
};

}  // namespace

std::unique_ptr<KvPolicy> MakePerDocumentKvPolicy(const PolicyContext& ctx, std::unique_ptr<KvPolicy> exact,
                                                  std::unique_ptr<KvPolicy> sparse, size_t exact_bytes,
                                                  std::vector<std::unique_ptr<KvPolicy>> pinned) {
  return std::make_unique<PerDocumentKvPolicy>(ctx, std::move(exact), std::move(sparse), std::move(pinned),
                                               exact_bytes);
}

}  // namespace penumbra
