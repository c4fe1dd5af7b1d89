// SpindleKV ("spindlekv"; Tang et al., the seed 004): a compact KV cache
// without offload, the eviction balanced with a codebook.
//
// A sequence's first prefill (its whole prompt, or its first segment: a
// document) runs exact attention over one layer's exact keys and values at a
// time; when a layer's prefill ends, the layer is compressed:
//   - eviction (deep layers mostly): the observation window's queries (the
//     prefill's last `window` tokens) score every earlier token by their
//     accumulated attention (SnapKV's, pooled); each *query* head keeps its
//     top floor(r_c(layer) * context) tokens of its KV head plus the window.
//     The per-layer ratio r_c(layer) falls linearly from shallow to deep
//     layers (the paper's eq. 5-6). A query head choosing its own tokens is
//     the paper's answer to GQA ("repeat": each query head a KV head of its
//     own), without the repeat's copies: a KV head holds each token kept by
//     any of its query heads once, with a mask of the query heads that keep
//     it (attention reads each token once for its whole group).
//   - replacement (shallow layers mostly): the tokens a KV head holds are
//     replaced by references into a codebook of unit vectors, one for
//     pre-RoPE keys and one for values, with each token's magnitude
//     (Algorithm 1: greedy, highest degree of the cos > theta graph first;
//     built in blocks of codebook_block tokens, spindlekv_math.h). RoPE is
//     applied again to a reconstructed key at its token's position.
// Tokens after the first prefill (a question after a document, generated
// tokens) are merged as the paper does at decode: each new key and value
// references the most similar entry of its KV head's codebook above the
// threshold, or becomes an entry; every query head of the group keeps it.
// The search covers the codebook's last merge_window entries (0: all, the
// paper's rule), so that a step does not read every entry twice (once here,
// once in attention); the prefill's blocks share only inside a block too.
//
// Attention reconstructs the keys and values a KV head holds (entry x
// magnitude, keys rotated), once per layer call, and each query head attends
// to those its bit of the mask marks. Prefixes (the document cache's unit) are the
// compressed state of a first prefill; a sequence attached to one adds its
// own tokens and codebook entries on top without copying it (Part below).
//
// The CPU backend runs it (host arrays; the CPU backend's device memory is
// host memory); other backends run the same algorithm with its state in
// device memory (spindlekv_device_policy.cc).
#include "worker/engine/spindlekv_policy.h"

#include <glog/logging.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>

#include "kernels/cpu/ops.h"
#include "worker/engine/spindlekv_math.h"
#include "worker/engine/spindlekv_prefix_format.h"

namespace penumbra {
namespace {

using spindlekv::ExportPart;
using spindlekv::Part;
using spindlekv::Tokens;

class SpindleKvPrefix final : public KvPrefix {
 public:
  SpindleKvPrefix(int64_t tokens, std::vector<Part> layers, std::string meta)
      : tokens_(tokens), layers_(std::move(layers)), meta_(std::move(meta)) {
    for (const Part& p : layers_) bytes_ += p.bytes();
  }
  std::string policy() const override { return "spindlekv"; }
  int64_t tokens() const override { return tokens_; }
  size_t device_bytes() const override { return bytes_; }
  Result<std::map<std::string, std::string>> Export() const override {
    std::map<std::string, std::string> out;
    out["meta"] = meta_;
    for (size_t l = 0; l < layers_.size(); ++l) out["layer." + std::to_string(l)] = ExportPart(layers_[l]);
    return out;
  }
  const Part& layer(int l) const { return layers_[l]; }

 private:
  int64_t tokens_;
  std::vector<Part> layers_;
  std::string meta_;
  size_t bytes_ = 0;
};

class SpindleKvPolicy final : public KvPolicy {
 public:
  SpindleKvPolicy(const PolicyContext& ctx, const SpindleKvOptions& o) : ctx_(ctx), o_(o) {}

  std::string name() const override { return "spindlekv"; }

  std::string StateFingerprint() const override { return SpindleKvStateFingerprint(o_); }

  Status AddSequence(int64_t seq, const SequenceSpec& spec) override {
    if (seqs_.count(seq)) return Status::InvalidArgument("sequence " + std::to_string(seq) + " already exists");
    if (spec.shard.sharded()) {
      return Status::Unimplemented("the spindlekv KV policy cannot hold a context-parallel shard");
    }
    if (spec.prompt_len < 1) return Status::InvalidArgument("spindlekv: a sequence needs a prompt");
    Seq s;
    s.capacity = spec.prompt_len + spec.max_new_tokens;
    if (spec.prefix) {
      PENUMBRA_ASSIGN_OR_RETURN(s.base, AttachedPrefix<SpindleKvPrefix>(spec, "spindlekv"));
      s.prefix = spec.prefix;
      s.first = s.length = s.base->tokens();
      s.compressed = ctx_.num_layers;
    } else {
      s.first = spec.first_prefill > 0 ? std::min(spec.first_prefill, spec.prompt_len) : spec.prompt_len;
    }
    const SequenceBytes need = Estimate(s.first, s.capacity - s.first, s.base != nullptr);
    const size_t free = ctx_.backend->FreeMemoryBytes();
    if (need.device > free) {
      return Status::ResourceExhausted("spindlekv: a sequence of " + std::to_string(s.capacity) +
                                       " tokens needs up to " + std::to_string(need.device >> 20) + " MiB, " +
                                       std::to_string(free >> 20) + " MiB are free");
    }
    s.own.resize(ctx_.num_layers);
    for (Part& p : s.own) p.Init(ctx_.hkv, ctx_.head_dim);
    if (s.base == nullptr) {
      const size_t rows = static_cast<size_t>(s.first) * ctx_.hkv * ctx_.head_dim;
      s.k.assign(rows, 0.0f);
      s.pre_k.assign(rows, 0.0f);
      s.v.assign(rows, 0.0f);
      s.window = std::min<int64_t>(o_.window, s.first);
      s.wq.assign(static_cast<size_t>(s.window) * ctx_.hq * ctx_.head_dim, 0.0f);
      s.wpos.assign(s.window, 0);
      s.ratios = spindlekv::LayerRatios(o_.reserve_ratio, o_.min_ratio, s.first, s.window, o_.min_prompt_tokens,
                                        ctx_.num_layers);
    }
    seqs_.emplace(seq, std::move(s));
    return Status::OK();
  }

  void RemoveSequence(int64_t seq) override { seqs_.erase(seq); }

  bool PrefillSplits(int64_t) const override { return false; }

  Status PrefillAttention(int layer, int64_t seq, const float* qkv, int n, int64_t start, const int32_t* positions,
                          void* q_scratch, void* out, float* lse) override {
    Seq& s = Get(seq);
    if (start + n > s.capacity) return Status::InvalidArgument("spindlekv: prefill past the sequence's capacity");
    if (start < s.first) {
      if (start + n > s.first) {
        return Status::InvalidArgument("spindlekv: a prefill run across the end of the first prefill (" +
                                       std::to_string(s.first) + ")");
      }
      return FirstPrefill(layer, s, qkv, n, start, positions, q_scratch, out, lse);
    }
    if (s.compressed < ctx_.num_layers) {
      return Status::FailedPrecondition("spindlekv: a continuation before the first prefill is complete");
    }
    PENUMBRA_RETURN_IF_ERROR(
        AppendAndAttend(layer, s, qkv, n, positions, static_cast<float*>(q_scratch), static_cast<float*>(out), lse));
    s.length = std::max(s.length, start + n);
    return Status::OK();
  }

  Status FinishPrefillLayer(int layer, int64_t seq, int64_t prompt_len) override {
    Seq& s = Get(seq);
    if (prompt_len != s.first || s.base != nullptr || layer != s.compressed) return Status::OK();
    Compress(layer, s);
    if (++s.compressed == ctx_.num_layers) {
      s.length = s.first;
      ReleaseScratch(s);
    }
    return Status::OK();
  }

  Status BeginDecodeStep(const std::vector<int64_t>& seqs, const std::vector<int64_t>& positions) override {
    step_.clear();
    for (size_t i = 0; i < seqs.size(); ++i) {
      Seq& s = Get(seqs[i]);
      PENUMBRA_RETURN_IF_ERROR(
          spindlekv::CheckDecodePosition(seqs[i], s.compressed == ctx_.num_layers, s.length, s.capacity, positions[i]));
      step_.push_back(&s);
    }
    return Status::OK();
  }

  Status DecodeAttention(int layer, const float* qkv, const int32_t* positions, void* q_scratch, void* out,
                         float* lse) override {
    // Every sequence's new token first, then one attention for the batch.
    const size_t row = static_cast<size_t>(ctx_.hq + 2 * ctx_.hkv) * ctx_.head_dim;
    const size_t qrow = static_cast<size_t>(ctx_.hq) * ctx_.head_dim;
    for (size_t i = 0; i < step_.size(); ++i) {
      Append(layer, *step_[i], qkv + i * row, positions[i], static_cast<float*>(q_scratch) + i * qrow);
    }
    return Attend(layer, step_.data(), static_cast<int>(step_.size()), static_cast<const float*>(q_scratch),
                  static_cast<float*>(out), lse);
  }

  Status FinishDecodeStep() override {
    for (Seq* s : step_) ++s->length;
    step_.clear();
    ++stats_.decode_steps;
    return Status::OK();
  }

  Result<std::shared_ptr<const KvPrefix>> CapturePrefix(int64_t seq, int64_t tokens) override {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return Status::NotFound("sequence " + std::to_string(seq) + " does not exist");
    const Seq& s = it->second;
    if (s.base != nullptr && tokens == s.base->tokens()) return s.prefix;
    if (s.compressed < ctx_.num_layers || tokens != s.length) {
      return spindlekv::CaptureNotReady(tokens, s.length);
    }
    std::vector<Part> layers(ctx_.num_layers);
    for (int l = 0; l < ctx_.num_layers; ++l) layers[l] = Flatten(s, l);
    return MakePrefix(tokens, std::move(layers));
  }

  Result<std::shared_ptr<const KvPrefix>> TakePrefix(int64_t seq, int64_t tokens) override {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return Status::NotFound("sequence " + std::to_string(seq) + " does not exist");
    Seq& s = it->second;
    if (s.base != nullptr || s.compressed < ctx_.num_layers || tokens != s.length) return CapturePrefix(seq, tokens);
    std::vector<Part> layers = std::move(s.own);
    seqs_.erase(it);  // only RemoveSequence may follow
    return MakePrefix(tokens, std::move(layers));
  }

  Result<std::shared_ptr<const KvPrefix>> ImportPrefix(const std::map<std::string, std::string>& blobs) override {
    PENUMBRA_ASSIGN_OR_RETURN(spindlekv::StoredPrefix p, spindlekv::ReadStoredPrefix(
                                                             blobs, [this](int64_t t) { return Meta(t); },
                                                             ctx_.num_layers, ctx_.hq, ctx_.hkv, ctx_.head_dim));
    return MakePrefix(p.tokens, std::move(p.layers));
  }

  Status SynthesizeContext(int64_t seq, int64_t length, uint64_t seed) override {
    Seq& s = Get(seq);
    if (s.base != nullptr || s.compressed > 0 || length != s.first) {
      return Status::InvalidArgument("spindlekv: a synthesized context fills a new sequence's whole first prefill (" +
                                     std::to_string(s.first) + " tokens)");
    }
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int d = ctx_.head_dim;
    for (int l = 0; l < ctx_.num_layers; ++l) {
      for (float& x : s.pre_k) x = normal(rng);
      for (float& x : s.v) x = normal(rng);
      for (float& x : s.wq) x = normal(rng);
      for (int64_t t = 0; t < s.first; ++t) {
        for (int g = 0; g < ctx_.hkv; ++g) {
          float* k = &s.k[(static_cast<size_t>(g) * s.first + t) * d];
          std::memcpy(k, &s.pre_k[(static_cast<size_t>(t) * ctx_.hkv + g) * d], sizeof(float) * d);
          kernels::cpu::ApplyRope(k, 1, d, static_cast<int32_t>(t), ctx_.inv_freq);
        }
      }
      for (int64_t i = 0; i < s.window; ++i) {
        s.wpos[i] = static_cast<int32_t>(s.first - s.window + i);
        kernels::cpu::ApplyRope(&s.wq[i * ctx_.hq * d], ctx_.hq, d, s.wpos[i], ctx_.inv_freq);
      }
      Compress(l, s);
      ++s.compressed;
    }
    s.length = s.first;
    ReleaseScratch(s);
    return Status::OK();
  }

  size_t DeviceBytes(int64_t seq) const override {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return 0;
    const Seq& s = it->second;
    size_t b = (s.k.size() + s.pre_k.size() + s.v.size() + s.wq.size()) * sizeof(float);
    for (const Part& p : s.own) b += p.bytes();
    return b;
  }

  SequenceBytes EstimateSequenceBytes(const SequenceSpec& spec) const override {
    const int64_t first = spec.first_prefill > 0 ? std::min(spec.first_prefill, spec.prompt_len) : spec.prompt_len;
    return Estimate(first, spec.prompt_len + spec.max_new_tokens - first, false);
  }

 private:
  struct Seq {
    int64_t capacity = 0;
    int64_t first = 0;   // tokens of the first prefill (compressed at its end)
    int64_t length = 0;  // tokens held
    int compressed = 0;  // layers compressed
    std::shared_ptr<const KvPrefix> prefix;
    const SpindleKvPrefix* base = nullptr;
    std::vector<Part> own;  // [layers]
    std::vector<double> ratios;
    // The first prefill's exact state of the layer being prefilled:
    // k (RoPE applied) and v [hkv][first][d]; pre_k [first][hkv][d]; the
    // observation window's queries [window][hq][d] (RoPE applied) at wpos.
    std::vector<float> k, pre_k, v, wq;
    std::vector<int32_t> wpos;
    int64_t window = 0;
  };

  Seq& Get(int64_t seq) {
    auto it = seqs_.find(seq);
    CHECK(it != seqs_.end()) << "spindlekv: no sequence " << seq;
    return it->second;
  }

  static void ReleaseScratch(Seq& s) {
    for (auto* v : {&s.k, &s.pre_k, &s.v, &s.wq}) std::vector<float>().swap(*v);
    std::vector<int32_t>().swap(s.wpos);
  }

  std::string Meta(int64_t tokens) const {
    return spindlekv::PrefixMeta(tokens, ctx_.num_layers, ctx_.hq, ctx_.hkv, ctx_.head_dim, StateFingerprint());
  }

  std::shared_ptr<const KvPrefix> MakePrefix(int64_t tokens, std::vector<Part> layers) const {
    return std::make_shared<SpindleKvPrefix>(tokens, std::move(layers), Meta(tokens));
  }

  // Upper bound of a sequence's bytes: the first prefill's one-layer exact
  // scratch, every token of it kept and every key and value its own entry,
  // and `more` tokens after it the same.
  SequenceBytes Estimate(int64_t first, int64_t more, bool attached) const {
    const size_t d = ctx_.head_dim, hkv = ctx_.hkv;
    const size_t per_token_layer = hkv * (2 * d * sizeof(float) + Tokens::kBytesPerToken);
    SequenceBytes b;
    const size_t held = static_cast<size_t>(attached ? 0 : first) + static_cast<size_t>(std::max<int64_t>(more, 0));
    b.device = held * per_token_layer * ctx_.num_layers;
    if (!attached) b.device += static_cast<size_t>(first) * hkv * d * 3 * sizeof(float);
    return b;
  }

  Status FirstPrefill(int layer, Seq& s, const float* qkv, int n, int64_t start, const int32_t* positions,
                      void* q_scratch, void* out, float* lse) {
    if (layer != s.compressed) {
      return Status::FailedPrecondition("spindlekv: layer " + std::to_string(layer) + " prefilled while layer " +
                                        std::to_string(s.compressed) + " is not finished");
    }
    const int d = ctx_.head_dim;
    std::vector<void*> kd(n), vd(n);
    std::vector<float*> pd(n);
    for (int i = 0; i < n; ++i) {
      kd[i] = &s.k[static_cast<size_t>(start + i) * d];
      vd[i] = &s.v[static_cast<size_t>(start + i) * d];
      pd[i] = &s.pre_k[static_cast<size_t>(start + i) * ctx_.hkv * d];
    }
    RopeStoreOp r;
    r.qkv = qkv;
    r.positions = positions;
    r.inv_freq = ctx_.inv_freq;
    r.n = n;
    r.hq = ctx_.hq;
    r.hkv = ctx_.hkv;
    r.d = d;
    r.q_out = q_scratch;
    r.k_dst = kd.data();
    r.v_dst = vd.data();
    r.head_stride = s.first * d;
    r.pre_rope_k_dst = pd.data();
    ctx_.backend->RopeStore(r);
    PrefillAttentionOp a;
    a.q = q_scratch;
    a.k = s.k.data();
    a.v = s.v.data();
    a.out = out;
    a.lse = lse;
    a.head_stride = s.first * d;
    a.q_start = static_cast<int>(start);
    a.nq = n;
    a.hq = ctx_.hq;
    a.hkv = ctx_.hkv;
    a.d = d;
    a.scale = ctx_.scale;
    ctx_.backend->PrefillAttention(a);
    // The observation window's queries.
    const int64_t w0 = s.first - s.window;
    const size_t qrow = static_cast<size_t>(ctx_.hq) * d;
    for (int i = 0; i < n; ++i) {
      const int64_t t = start + i;
      if (t < w0) continue;
      std::memcpy(&s.wq[(t - w0) * qrow], static_cast<const float*>(q_scratch) + i * qrow, sizeof(float) * qrow);
      s.wpos[t - w0] = positions[i];
    }
    return Status::OK();
  }

  // The eviction and the codebooks of `layer` from the first prefill's exact
  // state (module comment).
  void Compress(int layer, Seq& s) {
    const int d = ctx_.head_dim, hq = ctx_.hq, hkv = ctx_.hkv, group = hq / hkv;
    const int64_t F = s.first, context = F - s.window;
    const int64_t keep = spindlekv::KeptTokens(s.ratios[layer], context);
    Part& p = s.own[layer];
    p.Init(hkv, d);
    // Each query head's scores, then the tokens each KV head holds.
    std::vector<float> scores;
    if (keep < context) {
      scores.resize(static_cast<size_t>(hq) * F);
      kernels::cpu::ParallelFor(hq, [&](int64_t h) {
        std::vector<float> q(static_cast<size_t>(s.window) * d);
        for (int64_t i = 0; i < s.window; ++i) {
          std::memcpy(&q[i * d], &s.wq[(i * hq + h) * d], sizeof(float) * d);
        }
        const int g = static_cast<int>(h) / group;
        spindlekv::WindowScores(q.data(), s.wpos.data(), static_cast<int>(s.window),
                                &s.k[static_cast<size_t>(g) * F * d], F, d, ctx_.scale, o_.pool, &scores[h * F]);
      });
    }
    std::vector<std::vector<int32_t>> held_pos;
    std::vector<std::vector<uint32_t>> held_heads;
    spindlekv::SelectHeld(scores.data(), F, context, keep, hq, hkv, &held_pos, &held_heads);
    kernels::cpu::ParallelFor(hkv, [&](int64_t g) {
      const std::vector<int32_t>& held = held_pos[g];
      const int64_t n = static_cast<int64_t>(held.size());
      std::vector<float> keys(n * d), values(n * d);
      for (int64_t i = 0; i < n; ++i) {
        std::memcpy(&keys[i * d], &s.pre_k[(static_cast<size_t>(held[i]) * hkv + g) * d], sizeof(float) * d);
        std::memcpy(&values[i * d], &s.v[(static_cast<size_t>(g) * F + held[i]) * d], sizeof(float) * d);
      }
      Tokens& t = p.tok[g];
      t.pos = held;
      t.kref.resize(n);
      t.kmag.resize(n);
      t.vref.resize(n);
      t.vmag.resize(n);
      t.heads = std::move(held_heads[g]);
      spindlekv::BuildCodebook(keys.data(), n, d, static_cast<float>(o_.key_threshold), o_.codebook_block, &p.ck[g],
                               t.kref.data(), t.kmag.data());
      spindlekv::BuildCodebook(values.data(), n, d, static_cast<float>(o_.value_threshold), o_.codebook_block, &p.cv[g],
                               t.vref.data(), t.vmag.data());
    });
    stats_.kv_exact_bytes += static_cast<int64_t>(2 * sizeof(float)) * hkv * F * d;
    stats_.kv_kept_bytes += static_cast<int64_t>(p.bytes());
    VLOG(1) << "spindlekv: layer " << layer << " keeps " << keep << " of " << context
            << " context tokens a query head; " << p.entries() << " codebook entries for " << F << " tokens";
  }

  // The state of `layer` as one Part (an attached prefix's and the
  // sequence's own): the prefix's entries and tokens first.
  Part Flatten(const Seq& s, int layer) const {
    if (s.base == nullptr) return s.own[layer];
    const Part& b = s.base->layer(layer);
    const Part& o = s.own[layer];
    Part p = b;
    for (int g = 0; g < ctx_.hkv; ++g) {
      // Own references already count past the prefix's entries.
      p.ck[g].entries.insert(p.ck[g].entries.end(), o.ck[g].entries.begin(), o.ck[g].entries.end());
      p.cv[g].entries.insert(p.cv[g].entries.end(), o.cv[g].entries.begin(), o.cv[g].entries.end());
      p.tok[g].Append(o.tok[g]);
    }
    return p;
  }

  // Tokens after the first prefill (a continuation's rows or a decode
  // step's), in order: each row's key and value merge into the codebooks
  // and join every query head of their KV head, then the row's queries
  // attend to all its heads hold (itself included).
  //   qkv: [n, (hq + 2 hkv) d]; q_out, out: [n, hq d] f32; lse: null or [n, hq].
  Status AppendAndAttend(int layer, Seq& s, const float* qkv, int n, const int32_t* positions, float* q_out, float* out,
                         float* lse) {
    const size_t row = static_cast<size_t>(ctx_.hq + 2 * ctx_.hkv) * ctx_.head_dim;
    const size_t qrow = static_cast<size_t>(ctx_.hq) * ctx_.head_dim;
    if (n > 0) EnsureRopeTables(static_cast<int64_t>(*std::max_element(positions, positions + n)) + 1);
    for (int r = 0; r < n; ++r) {
      Seq* one[1] = {&s};
      Append(layer, s, qkv + r * row, positions[r], q_out + r * qrow);
      PENUMBRA_RETURN_IF_ERROR(Attend(layer, one, 1, q_out + r * qrow, out + r * qrow,
                                      lse ? lse + static_cast<size_t>(r) * ctx_.hq : nullptr));
    }
    return Status::OK();
  }

  // One new token of `s` at `pos` (src: its qkv row): its queries rotated
  // into q_out; its key and value merged into the codebooks and held by
  // every query head of their KV head.
  void Append(int layer, Seq& s, const float* src, int32_t pos, float* q_out) {
    const int d = ctx_.head_dim, hq = ctx_.hq, hkv = ctx_.hkv, group = hq / hkv;
    const Part* b = s.base ? &s.base->layer(layer) : nullptr;
    Part& own = s.own[layer];
    std::memcpy(q_out, src, sizeof(float) * hq * d);
    kernels::cpu::ApplyRope(q_out, hq, d, pos, ctx_.inv_freq);
    for (int g = 0; g < hkv; ++g) {
      float km = 0, vm = 0;
      const int32_t kr = spindlekv::MergeOrAdd(src + (hq + g) * d, static_cast<float>(o_.key_threshold),
                                               b ? &b->ck[g] : nullptr, &own.ck[g], &km, o_.merge_window);
      const int32_t vr = spindlekv::MergeOrAdd(src + (hq + hkv + g) * d, static_cast<float>(o_.value_threshold),
                                               b ? &b->cv[g] : nullptr, &own.cv[g], &vm, o_.merge_window);
      own.tok[g].Push(pos, kr, km, vr, vm, group == 32 ? ~uint32_t{0} : (uint32_t{1} << group) - 1);
    }
  }

  // Attention of `batch` sequences' rotated queries q ([batch, hq d]) over
  // what their KV heads hold of `layer` (Backend::SpindlekvAttention).
  Status Attend(int layer, Seq* const* seqs, int batch, const float* q, float* out, float* lse) {
    const int hkv = ctx_.hkv;
    heads_.assign(static_cast<size_t>(batch) * hkv, kernels::SpindlekvHead{});
    int64_t max_tokens = 0, max_pos = 0;
    for (int i = 0; i < batch; ++i) {
      const Seq& s = *seqs[i];
      const Part* b = s.base ? &s.base->layer(layer) : nullptr;
      const Part& own = s.own[layer];
      for (int g = 0; g < hkv; ++g) {
        kernels::SpindlekvHead& v = heads_[static_cast<size_t>(i) * hkv + g];
        if (b != nullptr) {
          v.part[0] = View(b->tok[g]);
          v.key_entries[0] = b->ck[g].entries.data();
          v.value_entries[0] = b->cv[g].entries.data();
          v.key_base_entries = b->ck[g].size();
          v.value_base_entries = b->cv[g].size();
        }
        v.part[1] = View(own.tok[g]);
        v.key_entries[1] = own.ck[g].entries.data();
        v.value_entries[1] = own.cv[g].entries.data();
        max_tokens = std::max(max_tokens, v.part[0].n + v.part[1].n);
      }
      max_pos = std::max(max_pos, s.length + 1);
    }
    EnsureRopeTables(max_pos);
    kernels::SpindlekvAttentionArgs a;
    a.q = q;
    a.heads = heads_.data();
    a.inv_freq = ctx_.inv_freq;
    a.out = out;
    a.lse = lse;
    a.dtype = DType::kF32;
    a.batch = batch;
    a.hq = ctx_.hq;
    a.hkv = hkv;
    a.d = ctx_.head_dim;
    a.scale = ctx_.scale;
    a.max_tokens = max_tokens;
    a.rope_cos = rope_cos_.data();
    a.rope_sin = rope_sin_.data();
    a.rope_positions = ctx_.head_dim >= 2 ? static_cast<int64_t>(rope_cos_.size()) / (ctx_.head_dim / 2) : 0;
    return ctx_.backend->SpindlekvAttention(a);
  }

  static kernels::SpindlekvTokens View(const Tokens& t) {
    kernels::SpindlekvTokens v;
    v.pos = t.pos.data();
    v.kref = t.kref.data();
    v.vref = t.vref.data();
    v.kmag = t.kmag.data();
    v.vmag = t.vmag.data();
    v.heads = t.heads.data();
    v.n = t.size();
    return v;
  }

  // cos and sin of pos * inv_freq for every position below `positions`
  // (rebuilt keys are rotated every step: the tables save the cos/sin).
  void EnsureRopeTables(int64_t positions) {
    const int half = ctx_.head_dim / 2;
    const int64_t have = half ? static_cast<int64_t>(rope_cos_.size()) / half : 0;
    if (positions <= have) return;
    const int64_t want = std::max(positions, 2 * have);
    rope_cos_.resize(static_cast<size_t>(want) * half);
    rope_sin_.resize(static_cast<size_t>(want) * half);
    for (int64_t p = have; p < want; ++p) {
      const float pos = static_cast<float>(p);
      for (int i = 0; i < half; ++i) {
        const float angle = pos * ctx_.inv_freq[i];
        rope_cos_[p * half + i] = std::cos(angle);
        rope_sin_[p * half + i] = std::sin(angle);
      }
    }
  }

  PolicyContext ctx_;
  SpindleKvOptions o_;
  std::map<int64_t, Seq> seqs_;
  std::vector<Seq*> step_;
  std::vector<float> rope_cos_, rope_sin_;     // [positions][head_dim / 2]
  std::vector<kernels::SpindlekvHead> heads_;  // Attend's views
};

}  // namespace

Result<std::unique_ptr<KvPolicy>> MakeSpindleKvPolicy(const PolicyContext& ctx, const SpindleKvOptions& options) {
  PENUMBRA_RETURN_IF_ERROR(SpindleKvOptionTable().Validate(options));
  if (ctx.backend->device() != Device::kCPU) return MakeSpindleKvDevicePolicy(ctx, options);
  if (ctx.backend->act_dtype() != DType::kF32) {
    return Status::Unimplemented("the spindlekv KV policy needs f32 activations");
  }
  if (ctx.hkv < 1 || ctx.hq % ctx.hkv != 0 || ctx.hq / ctx.hkv > 32) {
    return Status::InvalidArgument("spindlekv: " + std::to_string(ctx.hq) + " query heads over " +
                                   std::to_string(ctx.hkv) + " KV heads (at most 32 query heads per KV head)");
  }
  return std::unique_ptr<KvPolicy>(std::make_unique<SpindleKvPolicy>(ctx, options));
}

}  // namespace penumbra
