// The SpindleKV KV policy with its state in device memory: what the CUDA
// backend runs (the CPU backend runs it too, in tests). The algorithm is the
// host policy's (worker/engine/spindlekv_policy.cc says what it keeps and
// why); here every step of it is a backend op (kernels/spindlekv_args.h,
// kernels/spindlekv_compress_args.h), so nothing of a sequence's state
// crosses the host link after its prompt:
//   - first prefill, one layer at a time: RopeStore writes the exact keys
//     (RoPE applied and not) and values into the sequence's scratch, exact
//     attention over them; the observation window's queries are kept;
//   - its end (FinishPrefillLayer): SpindlekvWindowScores, SpindlekvSelect
//     (the tokens each KV head holds and their query-head masks), one
//     download of the held counts to size the layer's state, then
//     SpindlekvBuildCodebook for keys (pre-RoPE, f32) and values (act dtype);
//     the scratch is freed after the last layer;
//   - tokens after it (a decode step's, or a continuation's one row at a
//     time): SpindlekvMerge appends each new key and value to the KV head's
//     codebooks and tokens on the device and gathers the views
//     SpindlekvAttention reads.
// Host buffers go to the device with CopyToDevice, which has read them when
// it returns (a pageable copy is staged), so they may be reused at once.
//
// A (sequence, layer) keeps its state in one allocation sized at the end of
// its first prefill: per KV head its held tokens plus every token the
// sequence may still add, and as many codebook entries of each kind (a token
// adds at most one). Codebook entries are in the act dtype (bf16 on CUDA:
// unit vectors, scaled by an f32 magnitude per token).
//
// Documents (prefixes) stay in device memory: a capture is the sequence's
// per-layer allocations, moved (TakePrefix) or copied, with each head's views
// and entry counts (SpindleKvDevicePrefix); an attached sequence reads them
// in place as part[0] and adds its own tokens and entries in part[1]. A
// document exports to the host policy's format (spindlekv_prefix_format.h:
// entries as f32) and imports from it, so the persistent tier holds the same
// blobs for both. Not yet on the device: capturing past an attached
// document, context-parallel shards.
#include <glog/logging.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>
#include <vector>

#include "kernels/spindlekv_compress_args.h"
#include "worker/engine/op_profiler.h"
#include "worker/engine/spindlekv_math.h"
#include "worker/engine/spindlekv_policy.h"
#include "worker/engine/spindlekv_prefix_format.h"

namespace penumbra {
namespace {

constexpr size_t kAlign = 256;
size_t AlignUp(size_t b) { return (b + kAlign - 1) / kAlign * kAlign; }

// Where a KV head's arrays lie in its (sequence, layer)'s allocation, for
// room for `cap` tokens.
struct HeadLayout {
  size_t pos, kref, vref, kmag, vmag, heads, kent, vent, bytes;
  HeadLayout(int64_t cap, int d, size_t es) {
    const size_t c = static_cast<size_t>(cap);
    size_t at = 0;
    auto take = [&](size_t b) {
      const size_t here = at;
      at += AlignUp(b);
      return here;
    };
    pos = take(c * 4);
    kref = take(c * 4);
    vref = take(c * 4);
    kmag = take(c * 4);
    vmag = take(c * 4);
    heads = take(c * 4);
    kent = take(c * d * es);
    vent = take(c * d * es);
    bytes = at;
  }
};

// A document's compressed state in device memory (what CapturePrefix and
// TakePrefix make): per layer the allocation of its sequence's state, the
// views of each KV head's tokens and entries in it (part[1]: the document's)
// and each head's entry counts. Immutable; sequences attached to it read it
// in place as their part[0].
class SpindleKvDevicePrefix final : public KvPrefix {
 public:
  struct Layer {
    DeviceBuffer mem;
    std::vector<kernels::SpindlekvHead> views;        // [hkv]
    std::vector<int32_t> key_entries, value_entries;  // [hkv]
    int64_t max_tokens = 0;                           // the most tokens a KV head holds
  };
  SpindleKvDevicePrefix(int64_t tokens, std::vector<Layer> layers, std::string meta, Backend* backend, int d)
      : tokens_(tokens), layers_(std::move(layers)), meta_(std::move(meta)), backend_(backend), d_(d) {
    for (const Layer& l : layers_) bytes_ += l.mem.bytes();
  }
  std::string policy() const override { return "spindlekv"; }
  int64_t tokens() const override { return tokens_; }
  size_t device_bytes() const override { return bytes_; }
  // The host policy's blobs: each layer's memory read back, each KV head's
  // arrays and entries (act dtype -> f32) as a Part.
  Result<std::map<std::string, std::string>> Export() const override {
    std::map<std::string, std::string> out;
    out["meta"] = meta_;
    const DType t = backend_->act_dtype();
    PENUMBRA_RETURN_IF_ERROR(backend_->Synchronize());
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      std::vector<char> host(L.mem.bytes());
      PENUMBRA_RETURN_IF_ERROR(backend_->CopyToHost(host.data(), L.mem.get(), host.size()));
      const char* base = static_cast<const char*>(L.mem.get());
      auto at = [&](const void* device) { return host.data() + (static_cast<const char*>(device) - base); };
      const int hkv = static_cast<int>(L.views.size());
      spindlekv::Part part;
      part.Init(hkv, d_);
      for (int g = 0; g < hkv; ++g) {
        const kernels::SpindlekvTokens& v = L.views[g].part[1];
        spindlekv::Tokens& tok = part.tok[g];
        const size_t n = static_cast<size_t>(v.n);
        auto take = [&](auto* dst, const auto* src) {
          dst->resize(n);
          std::memcpy(dst->data(), at(src), n * sizeof((*dst)[0]));
        };
        take(&tok.pos, v.pos);
        take(&tok.kref, v.kref);
        take(&tok.vref, v.vref);
        take(&tok.kmag, v.kmag);
        take(&tok.vmag, v.vmag);
        take(&tok.heads, v.heads);
        part.ck[g].entries.resize(static_cast<size_t>(L.key_entries[g]) * d_);
        part.cv[g].entries.resize(static_cast<size_t>(L.value_entries[g]) * d_);
        ConvertToF32(at(L.views[g].key_entries[1]), t, part.ck[g].entries.data(), part.ck[g].entries.size());
        ConvertToF32(at(L.views[g].value_entries[1]), t, part.cv[g].entries.data(), part.cv[g].entries.size());
      }
      out["layer." + std::to_string(l)] = spindlekv::ExportPart(part);
    }
    return out;
  }
  const Layer& layer(int l) const { return layers_[l]; }

 private:
  int64_t tokens_;
  std::vector<Layer> layers_;
  std::string meta_;
  Backend* backend_;
  int d_;
  size_t bytes_ = 0;
};

class SpindleKvDevicePolicy final : public KvPolicy {
 public:
  SpindleKvDevicePolicy(const PolicyContext& ctx, const SpindleKvOptions& o)
      : ctx_(ctx), o_(o), es_(DTypeSize(ctx.backend->act_dtype())) {}

  std::string name() const override { return "spindlekv"; }

  std::string StateFingerprint() const override { return SpindleKvStateFingerprint(o_); }
  // A document's "meta" blob: the host policy's (spindlekv_prefix_format.h).
  std::string Meta(int64_t tokens) const {
    return spindlekv::PrefixMeta(tokens, ctx_.num_layers, ctx_.hq, ctx_.hkv, ctx_.head_dim, StateFingerprint());
  }

  Status AddSequence(int64_t seq, const SequenceSpec& spec) override {
    if (seqs_.count(seq)) return Status::InvalidArgument("sequence " + std::to_string(seq) + " already exists");
    if (spec.shard.sharded()) {
      return Status::Unimplemented("the spindlekv KV policy cannot hold a context-parallel shard");
    }
    if (spec.prompt_len < 1) return Status::InvalidArgument("spindlekv: a sequence needs a prompt");
    Seq s;
    s.capacity = spec.prompt_len + spec.max_new_tokens;
    if (s.capacity > std::numeric_limits<int32_t>::max()) {
      return Status::InvalidArgument("spindlekv: a sequence of " + std::to_string(s.capacity) + " tokens");
    }
    if (spec.prefix) {
      PENUMBRA_ASSIGN_OR_RETURN(s.base, AttachedPrefix<SpindleKvDevicePrefix>(spec, "spindlekv"));
      s.prefix = spec.prefix;
      s.first = s.length = s.base->tokens();
      s.compressed = ctx_.num_layers;
    } else {
      s.first = spec.first_prefill > 0 ? std::min(spec.first_prefill, spec.prompt_len) : spec.prompt_len;
      s.window = std::min<int64_t>(o_.window, s.first);
      s.ratios = spindlekv::LayerRatios(o_.reserve_ratio, o_.min_ratio, s.first, s.window, o_.min_prompt_tokens,
                                        ctx_.num_layers);
    }
    const SequenceBytes need = Estimate(s.first, s.capacity - s.first, s.base != nullptr);
    const size_t free = ctx_.backend->FreeMemoryBytes();
    if (need.device > free) {
      return Status::ResourceExhausted("spindlekv: a sequence of " + std::to_string(s.capacity) +
                                       " tokens needs up to " + std::to_string(need.device >> 20) + " MiB, " +
                                       std::to_string(free >> 20) + " MiB are free");
    }
    const int L = ctx_.num_layers, hkv = ctx_.hkv, d = ctx_.head_dim;
    if (s.base == nullptr) {
      PENUMBRA_ASSIGN_OR_RETURN(s.k, ctx_.backend->Allocate(static_cast<size_t>(s.first) * hkv * d * es_));
      PENUMBRA_ASSIGN_OR_RETURN(s.v, ctx_.backend->Allocate(static_cast<size_t>(s.first) * hkv * d * es_));
      PENUMBRA_ASSIGN_OR_RETURN(s.pre_k, ctx_.backend->Allocate(static_cast<size_t>(s.first) * hkv * d * 4));
      PENUMBRA_ASSIGN_OR_RETURN(s.wq, ctx_.backend->Allocate(static_cast<size_t>(s.window) * ctx_.hq * d * es_));
      PENUMBRA_ASSIGN_OR_RETURN(s.wpos, ctx_.backend->Allocate(static_cast<size_t>(s.window) * sizeof(int32_t)));
    }
    PENUMBRA_ASSIGN_OR_RETURN(s.heads,
                              ctx_.backend->Allocate(static_cast<size_t>(L) * hkv * sizeof(kernels::SpindlekvHead)));
    PENUMBRA_ASSIGN_OR_RETURN(s.counts, ctx_.backend->Allocate(static_cast<size_t>(L) * hkv * 2 * sizeof(int32_t)));
    PENUMBRA_ASSIGN_OR_RETURN(s.self, ctx_.backend->Allocate(2 * sizeof(void*)));
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Memset(s.counts.get(), 0, s.counts.bytes()));
    // A sequence alone as a merge's batch of one (continuations).
    void* self[2] = {s.heads.get(), s.counts.get()};
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->CopyToDevice(s.self.get(), self, sizeof(self)));
    s.layers.resize(L);
    if (s.base != nullptr) PENUMBRA_RETURN_IF_ERROR(Attach(s));
    seqs_.emplace(seq, std::move(s));
    return Status::OK();
  }

  void RemoveSequence(int64_t seq) override {
    if (seqs_.count(seq) == 0) return;
    // Kernels of the stream may still read its memory.
    (void)ctx_.backend->Synchronize();
    seqs_.erase(seq);
  }

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
    // One row at a time: each row's key and value join before it attends.
    const size_t row = static_cast<size_t>(ctx_.hq + 2 * ctx_.hkv) * ctx_.head_dim;
    const size_t qrow = static_cast<size_t>(ctx_.hq) * ctx_.head_dim * es_;
    for (int r = 0; r < n; ++r) {
      PENUMBRA_RETURN_IF_ERROR(
          AppendAndAttend(layer, {&s}, qkv + r * row, positions + r, static_cast<char*>(q_scratch) + r * qrow,
                          static_cast<char*>(out) + r * qrow, lse ? lse + static_cast<size_t>(r) * ctx_.hq : nullptr,
                          s.self.as<void*>(), start + r - s.first));
    }
    if (layer == ctx_.num_layers - 1) s.length = std::max(s.length, start + n);
    return Status::OK();
  }

  Status FinishPrefillLayer(int layer, int64_t seq, int64_t prompt_len) override {
    Seq& s = Get(seq);
    if (prompt_len != s.first || layer != s.compressed) return Status::OK();
    PENUMBRA_RETURN_IF_ERROR(Compress(layer, s));
    if (++s.compressed == ctx_.num_layers) {
      s.length = s.first;
      PENUMBRA_RETURN_IF_ERROR(ReleaseScratch(s));
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
    // The step's sequences for every layer's merge: [batch] heads arrays,
    // then [batch] entry counts.
    std::vector<void*> ptrs(2 * step_.size());
    for (size_t i = 0; i < step_.size(); ++i) {
      ptrs[i] = step_[i]->heads.get();
      ptrs[step_.size() + i] = step_[i]->counts.get();
    }
    PENUMBRA_RETURN_IF_ERROR(Grow(&step_ptrs_, ptrs.size() * sizeof(void*)));
    return ctx_.backend->CopyToDevice(step_ptrs_.get(), ptrs.data(), ptrs.size() * sizeof(void*));
  }

  Status DecodeAttention(int layer, const float* qkv, const int32_t* positions, void* q_scratch, void* out,
                         float* lse) override {
    int64_t at = 0;
    for (const Seq* s : step_) at = std::max(at, s->length - s->first);
    return AppendAndAttend(layer, step_, qkv, positions, q_scratch, out, lse, step_ptrs_.as<void*>(), at);
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
    Seq& s = it->second;
    if (s.base != nullptr && tokens == s.base->tokens()) return s.prefix;
    if (s.base != nullptr) {
      return Status::Unimplemented("the spindlekv KV policy on " + ctx_.backend->name() +
                                   " cannot capture past an attached document yet");
    }
    if (s.compressed < ctx_.num_layers || tokens != s.length) {
      return spindlekv::CaptureNotReady(tokens, s.length);
    }
    return MakePrefix(s, /*take=*/false);
  }

  Result<std::shared_ptr<const KvPrefix>> TakePrefix(int64_t seq, int64_t tokens) override {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return Status::NotFound("sequence " + std::to_string(seq) + " does not exist");
    Seq& s = it->second;
    if (s.base != nullptr || s.compressed < ctx_.num_layers || tokens != s.length) return CapturePrefix(seq, tokens);
    PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<const KvPrefix> p, MakePrefix(s, /*take=*/true));
    seqs_.erase(it);  // only RemoveSequence may follow
    return p;
  }

  // A document in the host policy's format (ImportPart checks every array
  // and reference), uploaded: per layer one allocation of hkv heads laid
  // out for the most tokens or entries any head has.
  Result<std::shared_ptr<const KvPrefix>> ImportPrefix(const std::map<std::string, std::string>& blobs) override {
    const int L = ctx_.num_layers, hkv = ctx_.hkv, d = ctx_.head_dim;
    PENUMBRA_ASSIGN_OR_RETURN(spindlekv::StoredPrefix stored,
                              spindlekv::ReadStoredPrefix(
                                  blobs, [this](int64_t t) { return Meta(t); }, L, ctx_.hq, hkv, d));
    const int64_t tokens = stored.tokens;
    const DType t = ctx_.backend->act_dtype();
    std::vector<SpindleKvDevicePrefix::Layer> layers(L);
    for (int l = 0; l < L; ++l) {
      const spindlekv::Part& part = stored.layers[l];
      int64_t cap = 1;
      for (int g = 0; g < hkv; ++g) {
        cap = std::max({cap, part.tok[g].size(), static_cast<int64_t>(part.ck[g].size()),
                        static_cast<int64_t>(part.cv[g].size())});
      }
      const HeadLayout lay(cap, d, es_);
      std::vector<char> host(lay.bytes * hkv, 0);
      SpindleKvDevicePrefix::Layer& pl = layers[l];
      PENUMBRA_ASSIGN_OR_RETURN(pl.mem, ctx_.backend->Allocate(host.size()));
      LayerState st;  // every head laid out for `cap`, one after another
      st.cap.assign(hkv, cap);
      for (int g = 0; g < hkv; ++g) {
        const spindlekv::Tokens& tok = part.tok[g];
        const size_t base = static_cast<size_t>(g) * lay.bytes, n = tok.pos.size();
        auto put = [&](size_t off, const auto& v) {
          std::memcpy(host.data() + base + off, v.data(), n * sizeof(v[0]));
        };
        put(lay.pos, tok.pos);
        put(lay.kref, tok.kref);
        put(lay.vref, tok.vref);
        put(lay.kmag, tok.kmag);
        put(lay.vmag, tok.vmag);
        put(lay.heads, tok.heads);
        ConvertFromF32(part.ck[g].entries.data(), host.data() + base + lay.kent, t, part.ck[g].entries.size());
        ConvertFromF32(part.cv[g].entries.data(), host.data() + base + lay.vent, t, part.cv[g].entries.size());
        st.base.push_back(base);
        st.held.push_back(static_cast<int32_t>(n));
        pl.key_entries.push_back(part.ck[g].size());
        pl.value_entries.push_back(part.cv[g].size());
        pl.max_tokens = std::max<int64_t>(pl.max_tokens, static_cast<int64_t>(n));
      }
      pl.views = OwnViews(st, pl.mem.as<char>(), 0);
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->CopyToDevice(pl.mem.get(), host.data(), host.size()));
    }
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Synchronize());
    return std::shared_ptr<const KvPrefix>(
        std::make_shared<SpindleKvDevicePrefix>(tokens, std::move(layers), Meta(tokens), ctx_.backend, d));
  }

  Status SynthesizeContext(int64_t seq, int64_t length, uint64_t seed) override {
    Seq& s = Get(seq);
    if (s.compressed > 0 || length != s.first) {
      return Status::InvalidArgument("spindlekv: a synthesized context fills a new sequence's whole first prefill (" +
                                     std::to_string(s.first) + " tokens)");
    }
    // Random QKV rows through the first prefill's own stores (RopeStore),
    // without its attention, then the real compression.
    const int64_t chunk = std::min<int64_t>(s.first, 4096);
    const size_t row = static_cast<size_t>(ctx_.hq + 2 * ctx_.hkv) * ctx_.head_dim;
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer qkv, ctx_.backend->Allocate(static_cast<size_t>(chunk) * row * 4));
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer q,
                              ctx_.backend->Allocate(static_cast<size_t>(chunk) * ctx_.hq * ctx_.head_dim * es_));
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer pos, ctx_.backend->Allocate(static_cast<size_t>(chunk) * 4));
    std::vector<int32_t> host_pos(chunk);
    for (int l = 0; l < ctx_.num_layers; ++l) {
      for (int64_t c0 = 0; c0 < s.first; c0 += chunk) {
        const int n = static_cast<int>(std::min(chunk, s.first - c0));
        for (int i = 0; i < n; ++i) host_pos[i] = static_cast<int32_t>(c0 + i);
        PENUMBRA_RETURN_IF_ERROR(ctx_.backend->CopyToDevice(pos.get(), host_pos.data(), n * sizeof(int32_t)));
        ctx_.backend->FillRandomNormal(qkv.get(), DType::kF32, static_cast<int64_t>(n) * row, 1.0f,
                                       seed * 1000003 + static_cast<uint64_t>(l) * 7919 + c0);
        PENUMBRA_RETURN_IF_ERROR(StoreFirst(s, qkv.as<float>(), n, c0, pos.as<int32_t>(), q.get()));
      }
      PENUMBRA_RETURN_IF_ERROR(Compress(l, s));
      ++s.compressed;
    }
    s.length = s.first;
    return ReleaseScratch(s);
  }

  void SetDecodeProfiler(OpProfiler* profiler) override { prof_ = profiler; }

  size_t DeviceBytes(int64_t seq) const override {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return 0;
    const Seq& s = it->second;
    size_t b = s.k.bytes() + s.v.bytes() + s.pre_k.bytes() + s.wq.bytes() + s.wpos.bytes() + s.heads.bytes() +
               s.counts.bytes();
    for (const LayerState& l : s.layers) b += l.mem.bytes();
    return b;
  }

  SequenceBytes EstimateSequenceBytes(const SequenceSpec& spec) const override {
    const int64_t first = spec.first_prefill > 0 ? std::min(spec.first_prefill, spec.prompt_len) : spec.prompt_len;
    return Estimate(first, spec.prompt_len + spec.max_new_tokens - first);
  }

 private:
  struct LayerState {
    DeviceBuffer mem;
    std::vector<int32_t> held;  // [hkv] tokens held after the first prefill
    std::vector<int64_t> cap;   // [hkv] room for tokens (and entries of each kind)
    std::vector<size_t> base;   // [hkv] where each KV head's arrays start in mem
    int64_t max_held = 0;       // tokens any KV head holds when the first prefill ends (or an attached document's)
  };

  struct Seq {
    int64_t capacity = 0;
    int64_t first = 0;   // tokens of the first prefill (compressed at its end)
    int64_t length = 0;  // tokens held
    int compressed = 0;  // layers compressed
    int64_t window = 0;
    std::vector<double> ratios;
    // The first prefill's exact state of the layer being prefilled: k (RoPE
    // applied) and v [hkv][first][d] act dtype; pre_k [first][hkv][d] f32;
    // the observation window's queries [window][hq][d] (RoPE applied) at
    // wpos [window].
    DeviceBuffer k, v, pre_k, wq, wpos;
    std::vector<LayerState> layers;
    std::shared_ptr<const KvPrefix> prefix;  // an attached document (held while attached)
    const SpindleKvDevicePrefix* base = nullptr;
    DeviceBuffer heads;   // [layers][hkv] SpindlekvHead: what attention reads
    DeviceBuffer counts;  // [layers][hkv][2] int32: own key and value entries
    DeviceBuffer self;    // {heads, counts}: the sequence as a batch of one
  };

  Seq& Get(int64_t seq) {
    auto it = seqs_.find(seq);
    CHECK(it != seqs_.end()) << "spindlekv: no sequence " << seq;
    return it->second;
  }

  Status Grow(DeviceBuffer* b, size_t bytes) {
    if (b->bytes() >= bytes) return Status::OK();
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Synchronize());  // in-flight kernels may read the old one
    PENUMBRA_ASSIGN_OR_RETURN(*b, ctx_.backend->Allocate(std::max(bytes, 2 * b->bytes())));
    return Status::OK();
  }

  Status ReleaseScratch(Seq& s) {
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Synchronize());
    for (DeviceBuffer* b : {&s.k, &s.v, &s.pre_k, &s.wq, &s.wpos}) *b = DeviceBuffer();
    return Status::OK();
  }

  // A document of all `s` holds (a whole sequence, its first prefill and any
  // tokens after it): its layers' memory moved (take) or copied, with each
  // head's entry counts.
  Result<std::shared_ptr<const KvPrefix>> MakePrefix(Seq& s, bool take) {
    const int L = ctx_.num_layers, hkv = ctx_.hkv;
    std::vector<int32_t> counts(static_cast<size_t>(L) * hkv * 2);
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->CopyToHost(counts.data(), s.counts.get(), counts.size() * sizeof(int32_t)));
    const int64_t appended = s.length - s.first;
    std::vector<SpindleKvDevicePrefix::Layer> layers(L);
    for (int l = 0; l < L; ++l) {
      LayerState& st = s.layers[l];
      SpindleKvDevicePrefix::Layer& pl = layers[l];
      if (take) {
        pl.mem = std::move(st.mem);
      } else {
        PENUMBRA_ASSIGN_OR_RETURN(pl.mem, ctx_.backend->Allocate(st.mem.bytes()));
        PENUMBRA_RETURN_IF_ERROR(ctx_.backend->CopyDeviceToDevice(pl.mem.get(), st.mem.get(), st.mem.bytes()));
      }
      pl.views = OwnViews(st, pl.mem.as<char>(), appended);
      for (int g = 0; g < hkv; ++g) {
        pl.key_entries.push_back(counts[(static_cast<size_t>(l) * hkv + g) * 2]);
        pl.value_entries.push_back(counts[(static_cast<size_t>(l) * hkv + g) * 2 + 1]);
      }
      pl.max_tokens = st.max_held + appended;
    }
    return std::shared_ptr<const KvPrefix>(std::make_shared<SpindleKvDevicePrefix>(
        s.length, std::move(layers), Meta(s.length), ctx_.backend, ctx_.head_dim));
  }

  // A sequence attached to s.base: per layer its own part (room for every
  // token it will add) after the document's, which it reads in place.
  Status Attach(Seq& s) {
    const int L = ctx_.num_layers, hkv = ctx_.hkv;
    const int64_t more = s.capacity - s.first;
    std::vector<kernels::SpindlekvHead> all;
    for (int l = 0; l < L; ++l) {
      LayerState& st = s.layers[l];
      const SpindleKvDevicePrefix::Layer& pl = s.base->layer(l);
      st.held.assign(hkv, 0);
      st.cap.assign(hkv, more);
      st.base.assign(hkv, 0);
      const size_t head_bytes = HeadLayout(more, ctx_.head_dim, es_).bytes;
      for (int g = 0; g < hkv; ++g) st.base[g] = g * head_bytes;
      PENUMBRA_ASSIGN_OR_RETURN(st.mem, ctx_.backend->Allocate(head_bytes * hkv));
      st.max_held = pl.max_tokens;
      std::vector<kernels::SpindlekvHead> views = OwnViews(st, st.mem.as<char>(), 0);
      for (int g = 0; g < hkv; ++g) {
        kernels::SpindlekvHead& v = views[g];
        v.part[0] = pl.views[g].part[1];
        v.key_entries[0] = pl.views[g].key_entries[1];
        v.value_entries[0] = pl.views[g].value_entries[1];
        v.key_base_entries = pl.key_entries[g];
        v.value_base_entries = pl.value_entries[g];
      }
      all.insert(all.end(), views.begin(), views.end());
    }
    return ctx_.backend->CopyToDevice(s.heads.get(), all.data(), all.size() * sizeof(all[0]));
  }

  // The views of a layer's own part in `mem` (laid out as `st` says): each
  // KV head's first-prefill tokens and `appended` more, and its entries.
  std::vector<kernels::SpindlekvHead> OwnViews(const LayerState& st, char* mem, int64_t appended) const {
    std::vector<kernels::SpindlekvHead> views(ctx_.hkv);
    for (int g = 0; g < ctx_.hkv; ++g) {
      const HeadLayout L(st.cap[g], ctx_.head_dim, es_);
      char* h = mem + st.base[g];
      kernels::SpindlekvTokens& t = views[g].part[1];
      t.pos = reinterpret_cast<const int32_t*>(h + L.pos);
      t.kref = reinterpret_cast<const int32_t*>(h + L.kref);
      t.vref = reinterpret_cast<const int32_t*>(h + L.vref);
      t.kmag = reinterpret_cast<const float*>(h + L.kmag);
      t.vmag = reinterpret_cast<const float*>(h + L.vmag);
      t.heads = reinterpret_cast<const uint32_t*>(h + L.heads);
      t.n = st.held[g] + appended;
      views[g].key_entries[1] = h + L.kent;
      views[g].value_entries[1] = h + L.vent;
    }
    return views;
  }

  // Tokens layer `l` holds at most per KV head: every token its query heads
  // may keep (group x keep of the context, at most all of it) and the window.
  int64_t HeldBound(const std::vector<double>& ratios, int l, int64_t first, int64_t window) const {
    const int64_t context = first - window;
    const int64_t keep = spindlekv::KeptTokens(ratios[l], context);
    return std::min(context, keep * (ctx_.hq / ctx_.hkv)) + window;
  }

  // Upper bound of a sequence's bytes: the first prefill's one-layer exact
  // scratch, and per layer every token a KV head may hold with an entry of
  // each kind, for its first prefill's tokens and `more` after them.
  SequenceBytes Estimate(int64_t first, int64_t more, bool attached = false) const {
    if (attached) {  // its own tokens only: the document's are the prefix's
      SequenceBytes b;
      b.device = HeadLayout(std::max<int64_t>(more, 1), ctx_.head_dim, es_).bytes * ctx_.hkv * ctx_.num_layers;
      return b;
    }
    const int64_t window = std::min<int64_t>(o_.window, first);
    const std::vector<double> ratios =
        spindlekv::LayerRatios(o_.reserve_ratio, o_.min_ratio, first, window, o_.min_prompt_tokens, ctx_.num_layers);
    SequenceBytes b;
    for (int l = 0; l < ctx_.num_layers; ++l) {
      const HeadLayout h(HeldBound(ratios, l, first, window) + std::max<int64_t>(more, 0), ctx_.head_dim, es_);
      b.device += h.bytes * ctx_.hkv;
    }
    const size_t d = ctx_.head_dim, hkv = ctx_.hkv;
    b.device += static_cast<size_t>(first) * hkv * d * (2 * es_ + 4) + static_cast<size_t>(window) * ctx_.hq * d * es_;
    return b;
  }

  // RoPE on n rows of qkv: the queries into q_out, the keys and values to
  // the rows whose addresses dst holds (keys first, values from dst +
  // v_at; v_at 0: n), the pre-RoPE keys to pre_k_out when it is set.
  void Rope(const float* qkv, int n, const int32_t* positions, void* q_out, void* const* dst, int64_t head_stride,
            float* pre_k_out, int v_at = 0) {
    RopeStoreOp r;
    r.qkv = qkv;
    r.positions = positions;
    r.inv_freq = ctx_.inv_freq;
    r.n = n;
    r.hq = ctx_.hq;
    r.hkv = ctx_.hkv;
    r.d = ctx_.head_dim;
    r.q_out = q_out;
    r.k_dst = dst;
    r.v_dst = dst + (v_at > 0 ? v_at : n);
    r.head_stride = head_stride;
    r.pre_rope_k_out = pre_k_out;
    ctx_.backend->RopeStore(r);
  }

  // RopeStore of rows [start, start + n) of the first prefill into the
  // scratch, and the observation window's queries among them.
  Status StoreFirst(Seq& s, const float* qkv, int n, int64_t start, const int32_t* positions, void* q_scratch) {
    const int d = ctx_.head_dim, hkv = ctx_.hkv;
    std::vector<void*> ptrs(2 * static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      ptrs[i] = s.k.as<char>() + static_cast<size_t>(start + i) * d * es_;
      ptrs[n + i] = s.v.as<char>() + static_cast<size_t>(start + i) * d * es_;
    }
    PENUMBRA_RETURN_IF_ERROR(Grow(&store_ptrs_, ptrs.size() * sizeof(void*)));
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->CopyToDevice(store_ptrs_.get(), ptrs.data(), ptrs.size() * sizeof(void*)));
    Rope(qkv, n, positions, q_scratch, store_ptrs_.as<void*>(), s.first * d,
         s.pre_k.as<float>() + static_cast<size_t>(start) * hkv * d);
    // The window's rows: [w0, first) of the prompt.
    const int64_t w0 = s.first - s.window, lo = std::max(start, w0), hi = start + n;
    if (lo < hi) {
      const size_t qrow = static_cast<size_t>(ctx_.hq) * d * es_;
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->CopyDeviceToDevice(
          s.wq.as<char>() + (lo - w0) * qrow, static_cast<const char*>(q_scratch) + (lo - start) * qrow,
          (hi - lo) * qrow));
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->CopyDeviceToDevice(s.wpos.as<int32_t>() + (lo - w0),
                                                                positions + (lo - start), (hi - lo) * sizeof(int32_t)));
    }
    return Status::OK();
  }

  Status FirstPrefill(int layer, Seq& s, const float* qkv, int n, int64_t start, const int32_t* positions,
                      void* q_scratch, void* out, float* lse) {
    if (layer != s.compressed) {
      return Status::FailedPrecondition("spindlekv: layer " + std::to_string(layer) + " prefilled while layer " +
                                        std::to_string(s.compressed) + " is not finished");
    }
    PENUMBRA_RETURN_IF_ERROR(StoreFirst(s, qkv, n, start, positions, q_scratch));
    PrefillAttentionOp a;
    a.q = q_scratch;
    a.k = s.k.get();
    a.v = s.v.get();
    a.out = out;
    a.lse = lse;
    a.head_stride = s.first * ctx_.head_dim;
    a.q_start = static_cast<int>(start);
    a.nq = n;
    a.hq = ctx_.hq;
    a.hkv = ctx_.hkv;
    a.d = ctx_.head_dim;
    a.scale = ctx_.scale;
    ctx_.backend->PrefillAttention(a);
    return Status::OK();
  }

  // The eviction and the codebooks of `layer` from the first prefill's
  // exact state (the module comment).
  Status Compress(int layer, Seq& s) {
    const int d = ctx_.head_dim, hq = ctx_.hq, hkv = ctx_.hkv;
    const int64_t F = s.first, context = F - s.window;
    const int64_t keep = spindlekv::KeptTokens(s.ratios[layer], context);
    Backend& be = *ctx_.backend;
    PENUMBRA_RETURN_IF_ERROR(Grow(&sel_, static_cast<size_t>(hkv) * (4 + 8 * static_cast<size_t>(F)) + kAlign));
    int32_t* held_dev = sel_.as<int32_t>();
    int32_t* pos_dev = held_dev + AlignUp(hkv * 4) / 4;
    auto* heads_dev = reinterpret_cast<uint32_t*>(pos_dev + static_cast<size_t>(hkv) * F);
    kernels::SpindlekvSelectArgs sel;
    if (keep < context) {
      PENUMBRA_RETURN_IF_ERROR(Grow(&scores_, static_cast<size_t>(hq) * F * sizeof(float)));
      kernels::SpindlekvWindowScoresArgs w;
      w.q = s.wq.get();
      w.q_pos = s.wpos.as<int32_t>();
      w.k = s.k.get();
      w.head_stride = F * d;
      w.dtype = be.act_dtype();
      w.w = static_cast<int>(s.window);
      w.hq = hq;
      w.hkv = hkv;
      w.d = d;
      w.n = F;
      w.scale = ctx_.scale;
      w.pool = o_.pool;
      w.out = scores_.as<float>();
      PENUMBRA_RETURN_IF_ERROR(be.SpindlekvWindowScores(w));
      sel.scores = scores_.as<float>();
    }
    sel.n = F;
    sel.context = context;
    sel.keep = keep;
    sel.hq = hq;
    sel.hkv = hkv;
    sel.held = held_dev;
    sel.pos = pos_dev;
    sel.heads = heads_dev;
    PENUMBRA_RETURN_IF_ERROR(be.SpindlekvSelect(sel));
    LayerState& st = s.layers[layer];
    st.held.assign(hkv, 0);
    st.cap.clear();
    PENUMBRA_RETURN_IF_ERROR(be.CopyToHost(st.held.data(), held_dev, hkv * sizeof(int32_t)));
    // The layer's state: room for what each head holds and every token to come.
    const int64_t more = s.capacity - s.first;
    std::vector<HeadLayout> lay;
    std::vector<size_t> base(hkv);
    size_t total = 0;
    st.max_held = 0;
    for (int g = 0; g < hkv; ++g) {
      if (st.held[g] < 0 || st.held[g] > F) {
        return Status::Internal("spindlekv: KV head " + std::to_string(g) + " holds " + std::to_string(st.held[g]) +
                                " of " + std::to_string(F) + " tokens");
      }
      st.max_held = std::max<int64_t>(st.max_held, st.held[g]);
      lay.emplace_back(st.held[g] + more, d, es_);
      base[g] = total;
      total += lay.back().bytes;
      st.cap.push_back(st.held[g] + more);
    }
    PENUMBRA_ASSIGN_OR_RETURN(st.mem, be.Allocate(total));
    st.base = base;
    char* mem = st.mem.as<char>();
    std::vector<kernels::SpindlekvCodebookProblem> problems(2 * static_cast<size_t>(hkv));
    int32_t* counts = s.counts.as<int32_t>() + static_cast<size_t>(layer) * hkv * 2;
    for (int g = 0; g < hkv; ++g) {
      char* h = mem + base[g];
      const HeadLayout& L = lay[g];
      const size_t n = static_cast<size_t>(st.held[g]);
      PENUMBRA_RETURN_IF_ERROR(be.CopyDeviceToDevice(h + L.pos, pos_dev + static_cast<size_t>(g) * F, n * 4));
      PENUMBRA_RETURN_IF_ERROR(be.CopyDeviceToDevice(h + L.heads, heads_dev + static_cast<size_t>(g) * F, n * 4));
      kernels::SpindlekvCodebookProblem& pk = problems[g];
      pk.x = s.pre_k.as<float>() + static_cast<size_t>(g) * d;
      pk.row_stride = static_cast<int64_t>(hkv) * d;
      pk.rows = reinterpret_cast<const int32_t*>(h + L.pos);
      pk.n = st.held[g];
      pk.theta = static_cast<float>(o_.key_threshold);
      pk.entries = h + L.kent;
      pk.refs = reinterpret_cast<int32_t*>(h + L.kref);
      pk.mags = reinterpret_cast<float*>(h + L.kmag);
      pk.entry_count = counts + 2 * g;
      kernels::SpindlekvCodebookProblem& pv = problems[hkv + g];
      pv.x = s.v.as<char>() + static_cast<size_t>(g) * F * d * es_;
      pv.row_stride = d;
      pv.rows = pk.rows;
      pv.n = pk.n;
      pv.theta = static_cast<float>(o_.value_threshold);
      pv.entries = h + L.vent;
      pv.refs = reinterpret_cast<int32_t*>(h + L.vref);
      pv.mags = reinterpret_cast<float*>(h + L.vmag);
      pv.entry_count = counts + 2 * g + 1;
    }
    const std::vector<kernels::SpindlekvHead> views = OwnViews(st, mem, 0);
    // Keys (pre-RoPE, f32) and values (act dtype) in two launches: one
    // source dtype each.
    const size_t pbytes = problems.size() * sizeof(problems[0]);
    PENUMBRA_RETURN_IF_ERROR(Grow(&problems_, pbytes));
    PENUMBRA_RETURN_IF_ERROR(be.CopyToDevice(problems_.get(), problems.data(), pbytes));
    for (int kind = 0; kind < 2; ++kind) {
      kernels::SpindlekvCodebookArgs c;
      c.problems = problems_.as<kernels::SpindlekvCodebookProblem>() + kind * hkv;
      c.count = hkv;
      c.d = d;
      c.block = o_.codebook_block;
      c.x_dtype = kind == 0 ? DType::kF32 : be.act_dtype();
      c.entry_dtype = be.act_dtype();
      c.max_n = static_cast<int32_t>(st.max_held);
      PENUMBRA_RETURN_IF_ERROR(be.SpindlekvBuildCodebook(c));
    }
    PENUMBRA_RETURN_IF_ERROR(be.CopyToDevice(s.heads.as<kernels::SpindlekvHead>() + static_cast<size_t>(layer) * hkv,
                                             views.data(), views.size() * sizeof(views[0])));
    // The compressed bytes (the paper's r as measured): one more download.
    std::vector<int32_t> made(2 * static_cast<size_t>(hkv));
    PENUMBRA_RETURN_IF_ERROR(be.CopyToHost(made.data(), counts, made.size() * sizeof(int32_t)));
    int64_t kept = 0, entries = 0;
    for (int g = 0; g < hkv; ++g) {
      kept += st.held[g];
      entries += made[2 * g] + made[2 * g + 1];
    }
    const int64_t kept_bytes = kept * static_cast<int64_t>(6 * sizeof(int32_t)) + entries * d * es_;
    stats_.kv_exact_bytes += static_cast<int64_t>(2 * es_) * hkv * F * d;
    stats_.kv_kept_bytes += kept_bytes;
    VLOG(1) << "spindlekv: layer " << layer << " keeps " << keep << " of " << context
            << " context tokens a query head; " << entries << " codebook entries for " << F << " tokens";
    return Status::OK();
  }

  // One new token per sequence of `batch` at `layer` (qkv rows [batch], the
  // row of batch[i] at positions[i]): queries rotated into q_out, keys and
  // values merged into the codebooks (SpindlekvMerge over `seq_ptrs`: the
  // batch's heads arrays, then its counts), then attention over all each
  // KV head holds. `after` bounds the tokens any of them holds past its
  // first prefill before this one.
  Status AppendAndAttend(int layer, const std::vector<Seq*>& batch, const float* qkv, const int32_t* positions,
                         void* q_out, void* out, float* lse, void* const* seq_ptrs, int64_t after) {
    Backend& be = *ctx_.backend;
    const int n = static_cast<int>(batch.size()), d = ctx_.head_dim, hkv = ctx_.hkv;
    if (n == 0) return Status::OK();
    // RoPE on the queries; the rotated keys and values it stores are not
    // needed (the merge reads the pre-RoPE rows), so they go to a scratch.
    const size_t kv_row = static_cast<size_t>(hkv) * d * es_;
    PENUMBRA_RETURN_IF_ERROR(Grow(&dummy_kv_, 2 * static_cast<size_t>(n) * kv_row));
    if (dummy_rows_ < n) {
      std::vector<void*> ptrs(2 * static_cast<size_t>(n));
      for (int i = 0; i < 2 * n; ++i) ptrs[i] = dummy_kv_.as<char>() + i * kv_row;
      PENUMBRA_RETURN_IF_ERROR(Grow(&dummy_ptrs_, 2 * static_cast<size_t>(n) * sizeof(void*)));
      PENUMBRA_RETURN_IF_ERROR(be.CopyToDevice(dummy_ptrs_.get(), ptrs.data(), ptrs.size() * sizeof(void*)));
      dummy_rows_ = n;
    }
    Rope(qkv, n, positions, q_out, dummy_ptrs_.as<void*>(), d, nullptr, dummy_rows_);
    PENUMBRA_RETURN_IF_ERROR(Grow(&gathered_, static_cast<size_t>(n) * hkv * sizeof(kernels::SpindlekvHead)));
    kernels::SpindlekvMergeArgs m;
    m.seq_heads = reinterpret_cast<kernels::SpindlekvHead* const*>(seq_ptrs);
    m.seq_entries = reinterpret_cast<int32_t* const*>(seq_ptrs + n);
    m.qkv = qkv;
    m.positions = positions;
    m.gathered = gathered_.as<kernels::SpindlekvHead>();
    m.entry_dtype = be.act_dtype();
    m.layer = layer;
    m.batch = n;
    m.hq = ctx_.hq;
    m.hkv = hkv;
    m.d = d;
    m.key_theta = static_cast<float>(o_.key_threshold);
    m.value_theta = static_cast<float>(o_.value_threshold);
    m.window = static_cast<int32_t>(o_.merge_window);
    PENUMBRA_RETURN_IF_ERROR(be.SpindlekvMerge(m));
    if (prof_ != nullptr) prof_->Lap("spindlekv_rope_merge");
    int64_t max_tokens = 0;
    for (const Seq* s : batch) max_tokens = std::max(max_tokens, s->layers[layer].max_held);
    kernels::SpindlekvAttentionArgs a;
    a.q = q_out;
    a.heads = gathered_.as<kernels::SpindlekvHead>();
    a.inv_freq = ctx_.inv_freq;
    a.out = out;
    a.lse = lse;
    a.dtype = be.act_dtype();
    a.batch = n;
    a.hq = ctx_.hq;
    a.hkv = hkv;
    a.d = d;
    a.scale = ctx_.scale;
    a.max_tokens = max_tokens + after + 1;
    return be.SpindlekvAttention(a);
  }

  PolicyContext ctx_;
  SpindleKvOptions o_;
  size_t es_;  // bytes of an act-dtype element
  std::map<int64_t, Seq> seqs_;
  std::vector<Seq*> step_;
  OpProfiler* prof_ = nullptr;  // decode laps while non-null
  // Scratch shared by the policy's ops (stream-ordered, one op at a time).
  DeviceBuffer scores_;                 // [hq][first] window scores
  DeviceBuffer sel_;                    // Select's held counts, positions and masks
  DeviceBuffer problems_;               // codebook problems
  DeviceBuffer store_ptrs_;             // RopeStore's row addresses (first prefill)
  DeviceBuffer step_ptrs_;              // a decode step's heads arrays and counts
  DeviceBuffer dummy_kv_, dummy_ptrs_;  // where decode's RopeStore puts the rotated keys nobody reads
  int dummy_rows_ = 0;
  DeviceBuffer gathered_;  // [batch * hkv] views for SpindlekvAttention
};

}  // namespace

Result<std::unique_ptr<KvPolicy>> MakeSpindleKvDevicePolicy(const PolicyContext& ctx, const SpindleKvOptions& options) {
  PENUMBRA_RETURN_IF_ERROR(SpindleKvOptionTable().Validate(options));
  if (ctx.hkv < 1 || ctx.hq % ctx.hkv != 0 || ctx.hq / ctx.hkv > 32) {
    return Status::InvalidArgument("spindlekv: " + std::to_string(ctx.hq) + " query heads over " +
                                   std::to_string(ctx.hkv) + " KV heads (at most 32 query heads per KV head)");
  }
  return std::unique_ptr<KvPolicy>(std::make_unique<SpindleKvDevicePolicy>(ctx, options));
}

}  // namespace penumbra
