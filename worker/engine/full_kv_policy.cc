// The exact KV cache ("full" attention): each sequence owns one contiguous
// allocation per K and V laid out [layers][hkv][rows][d] in act dtype, so
// head h of layer l is a [rows, d] matrix the attention kernels stream.
//
// Prefixes (KvPrefix): the exact K/V of a prompt prefix, [layers][hkv][T][d]
// per K and V, held once in device memory and read in place by every
// sequence attached to it (cascade attention): an attached sequence's rows
// are only its own tokens (position T on), and attention is the sequence's
// own keys (decode or prefill kernel, with their log-sum-exp) merged with the
// prefix's keys (PrefixAttention: one launch per prefix and layer for all the
// step's sequences attached to it, so 64 questions over one document read
// its K/V once per step, as one tall matrix product on tensor cores).
#include <cstring>
#include <map>
#include <sstream>

#include "worker/engine/kv_policy.h"

namespace penumbra {
namespace {

class FullKvPrefix final : public KvPrefix {
 public:
  FullKvPrefix(int64_t tokens, int layers, int hkv, int d, DType dtype, DeviceBuffer k, DeviceBuffer v,
               Backend* backend)
      : tokens_(tokens),
        layers_(layers),
        hkv_(hkv),
        d_(d),
        dtype_(dtype),
        k_(std::move(k)),
        v_(std::move(v)),
        backend_(backend) {}
  std::string policy() const override { return "full"; }
  int64_t tokens() const override { return tokens_; }
  size_t device_bytes() const override { return k_.bytes() + v_.bytes(); }
  Result<std::map<std::string, std::string>> Export() const override {
    std::map<std::string, std::string> out;
    out["meta"] = Meta(tokens_, layers_, hkv_, d_, dtype_);
    for (const auto& [name, buf] : {std::pair<const char*, const DeviceBuffer*>{"k", &k_}, {"v", &v_}}) {
      std::string bytes(buf->bytes(), '\0');
      PENUMBRA_RETURN_IF_ERROR(backend_->CopyToHost(bytes.data(), buf->get(), bytes.size()));
      out[name] = std::move(bytes);
    }
    return out;
  }
  // The "meta" blob: what Import checks before reading k and v.
  static std::string Meta(int64_t tokens, int layers, int hkv, int d, DType dtype) {
    std::ostringstream os;
    os << "full-kv-prefix v1 tokens=" << tokens << " layers=" << layers << " kv_heads=" << hkv << " head_dim=" << d
       << " dtype=" << DTypeName(dtype);
    return os.str();
  }
  const void* k() const { return k_.get(); }
  const void* v() const { return v_.get(); }
  bool exact_kv(ExactKv* out) const override {
    out->k = k_.get();
    out->v = v_.get();
    out->tokens = tokens_;
    out->head_stride = tokens_ * d_;
    return true;
  }

 private:
  int64_t tokens_;
  int layers_, hkv_, d_;
  DType dtype_;
  DeviceBuffer k_, v_;
  Backend* backend_;
};

class FullKvPolicy final : public KvPolicy {
 public:
  explicit FullKvPolicy(const PolicyContext& ctx) : ctx_(ctx), esize_(DTypeSize(ctx.backend->act_dtype())) {}

  std::string name() const override { return "full"; }

  Status AddSequence(int64_t seq, const SequenceSpec& spec) override {
    if (seqs_.count(seq)) return Status::InvalidArgument("sequence " + std::to_string(seq) + " already exists");
    Seq s;
    s.capacity = spec.prompt_len + spec.max_new_tokens;
    if (spec.shard.sharded()) {
      // A context-parallel shard: its rows start at its first position (the
      // keys before it are other ranks'), as after an attached prefix. A
      // closed shard keeps one spare row: decode steps' RopeStore writes the
      // new token's K/V there (never attended to here) and the queries out.
      s.base = s.length = spec.shard.position_base;
      s.capacity = s.base + spec.prompt_len + (spec.shard.closed ? 1 : spec.max_new_tokens);
      s.closed = spec.shard.closed;
      s.shard = true;
      if (spec.prefix) return AddShardFromPrefix(seq, spec, std::move(s));
    }
    const FullKvPrefix* p = nullptr;
    if (spec.prefix) {
      PENUMBRA_ASSIGN_OR_RETURN(p, AttachedPrefix<FullKvPrefix>(spec, "full KV"));
    }
    if (p != nullptr) {
      s.base = s.length = p->tokens();
      s.fp = p;
      s.prefix = spec.prefix;
    }
    const size_t bytes = LayerStride(s) * ctx_.num_layers * esize_;
    PENUMBRA_ASSIGN_OR_RETURN(s.k, ctx_.backend->Allocate(bytes));
    PENUMBRA_ASSIGN_OR_RETURN(s.v, ctx_.backend->Allocate(bytes));
    seqs_.emplace(seq, std::move(s));
    return Status::OK();
  }

  void RemoveSequence(int64_t seq) override { seqs_.erase(seq); }

  Status PrefillAttention(int layer, int64_t seq, const float* qkv, int n, int64_t start, const int32_t* positions,
                          void* q_scratch, void* out, float* lse) override {
    Seq& s = Get(seq);
    if (lse != nullptr && s.fp != nullptr) {
      return Status::Unimplemented("full KV: the log-sum-exp of a sequence attached to a prefix");
    }
    CHECK_LE(start + n, s.capacity);
    CHECK_GE(start, s.base) << "prefill inside the attached prefix";
    std::vector<void*> ptrs(2 * static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      ptrs[i] = Slot(s.k, s, layer, start + i);
      ptrs[n + i] = Slot(s.v, s, layer, start + i);
    }
    // With a prefix, the chunk's rows 0..n-1 then attend to it as the
    // "sequences" of a PrefixAttention: their indices follow the pointers.
    std::vector<int32_t> iota(s.fp != nullptr ? n : 0);
    for (size_t i = 0; i < iota.size(); ++i) iota[i] = static_cast<int32_t>(i);
    PENUMBRA_RETURN_IF_ERROR(UploadPointers(ptrs, iota));
    RopeStoreOp r;
    r.qkv = qkv;
    r.positions = positions;
    r.inv_freq = ctx_.inv_freq;
    r.n = n;
    r.hq = ctx_.hq;
    r.hkv = ctx_.hkv;
    r.d = ctx_.head_dim;
    r.q_out = q_scratch;
    r.k_dst = static_cast<void* const*>(ptr_buf_.get());
    r.v_dst = static_cast<void* const*>(ptr_buf_.get()) + n;
    r.head_stride = OwnRows(s) * ctx_.head_dim;
    ctx_.backend->RopeStore(r);
    // The chunk over the sequence's own keys (causal; with its log-sum-exp
    // when a prefix's part is merged in next).
    PrefillAttentionOp a;
    a.q = q_scratch;
    a.k = Slot(s.k, s, layer, s.base);
    a.v = Slot(s.v, s, layer, s.base);
    a.out = out;
    a.head_stride = OwnRows(s) * ctx_.head_dim;
    a.q_start = static_cast<int>(start - s.base);
    a.nq = n;
    a.hq = ctx_.hq;
    a.hkv = ctx_.hkv;
    a.d = ctx_.head_dim;
    a.scale = ctx_.scale;
    if (s.fp != nullptr) {
      PENUMBRA_RETURN_IF_ERROR(GrowLse(n));
      a.lse = lse_.as<float>();
    } else {
      a.lse = lse;
    }
    ctx_.backend->PrefillAttention(a);
    if (s.fp != nullptr) {
      const auto* rows = reinterpret_cast<const int32_t*>(static_cast<void* const*>(ptr_buf_.get()) + ptrs.size());
      PENUMBRA_RETURN_IF_ERROR(PrefixPart(layer, *s.fp, q_scratch, rows, n, out));
    }
    s.length = std::max(s.length, start + n);
    return Status::OK();
  }

  Status FinishPrefillLayer(int, int64_t, int64_t) override { return Status::OK(); }

  Result<std::shared_ptr<const KvPrefix>> CapturePrefix(int64_t seq, int64_t tokens) override {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return Status::NotFound("sequence " + std::to_string(seq) + " does not exist");
    const Seq& s = it->second;
    if (s.shard) return CaptureShard(s, seq, tokens);
    if (tokens < 1 || tokens > s.length) {
      return Status::InvalidArgument("prefix of " + std::to_string(tokens) + " tokens: sequence " +
                                     std::to_string(seq) + " holds " + std::to_string(s.length));
    }
    if (s.fp != nullptr && tokens == s.base) return s.prefix;  // exactly the attached prefix
    const size_t row = static_cast<size_t>(ctx_.head_dim) * esize_;
    const size_t rows = static_cast<size_t>(ctx_.num_layers) * ctx_.hkv;
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer k, ctx_.backend->Allocate(rows * tokens * row));
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer v, ctx_.backend->Allocate(rows * tokens * row));
    // Each (layer, head) is `tokens` rows in the new prefix: the attached
    // prefix's first ones (base rows per head there), then the sequence's own
    // (OwnRows per head).
    const int64_t from_base = std::min(tokens, s.base);
    if (from_base > 0) {
      const size_t w = from_base * row, pitch = s.base * row;
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Copy2D(k.get(), tokens * row, s.fp->k(), pitch, w, rows));
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Copy2D(v.get(), tokens * row, s.fp->v(), pitch, w, rows));
    }
    if (tokens > s.base) {
      const size_t w = (tokens - s.base) * row, off = s.base * row, pitch = OwnRows(s) * row;
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Copy2D(k.as<char>() + off, tokens * row, s.k.get(), pitch, w, rows));
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Copy2D(v.as<char>() + off, tokens * row, s.v.get(), pitch, w, rows));
    }
    return std::shared_ptr<const KvPrefix>(std::make_shared<FullKvPrefix>(tokens, ctx_.num_layers, ctx_.hkv,
                                                                          ctx_.head_dim, ctx_.backend->act_dtype(),
                                                                          std::move(k), std::move(v), ctx_.backend));
  }

  Result<std::shared_ptr<const KvPrefix>> ImportPrefix(const std::map<std::string, std::string>& blobs) override {
    for (const char* name : {"meta", "k", "v"}) {
      if (!blobs.count(name))
        return Status::InvalidArgument(std::string("full KV prefix: blob '") + name + "' is missing");
    }
    const std::string& meta = blobs.at("meta");
    // The token count is the only free field; the rest must be this model's.
    int64_t tokens = 0;
    const std::string head = "full-kv-prefix v1 tokens=";
    if (meta.rfind(head, 0) != 0) return Status::InvalidArgument("full KV prefix: unknown format '" + meta + "'");
    {
      std::istringstream is(meta.substr(head.size()));
      is >> tokens;
      if (!is || tokens < 1) return Status::InvalidArgument("full KV prefix: bad token count in '" + meta + "'");
    }
    const std::string want =
        FullKvPrefix::Meta(tokens, ctx_.num_layers, ctx_.hkv, ctx_.head_dim, ctx_.backend->act_dtype());
    if (meta != want) {
      return Status::InvalidArgument("full KV prefix: made for another geometry or dtype ('" + meta +
                                     "'; this policy: '" + want + "')");
    }
    const size_t bytes = static_cast<size_t>(ctx_.num_layers) * ctx_.hkv * tokens * ctx_.head_dim * esize_;
    DeviceBuffer kv[2];
    int i = 0;
    for (const char* name : {"k", "v"}) {
      const std::string& b = blobs.at(name);
      if (b.size() != bytes) {
        return Status::Corruption(std::string("full KV prefix: blob '") + name + "' holds " + std::to_string(b.size()) +
                                  " bytes, expected " + std::to_string(bytes));
      }
      PENUMBRA_ASSIGN_OR_RETURN(kv[i], ctx_.backend->Allocate(bytes));
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->CopyToDevice(kv[i].get(), b.data(), bytes));
      ++i;
    }
    return std::shared_ptr<const KvPrefix>(
        std::make_shared<FullKvPrefix>(tokens, ctx_.num_layers, ctx_.hkv, ctx_.head_dim, ctx_.backend->act_dtype(),
                                       std::move(kv[0]), std::move(kv[1]), ctx_.backend));
  }

  Status BeginDecodeStep(const std::vector<int64_t>& seqs, const std::vector<int64_t>& positions) override {
    // One upload per step: per layer, the batch's K/V slot pointers (for the
    // store) and own K/V bases (for attention); then the own lengths, then
    // per attached prefix the batch rows attached to it.
    const size_t B = seqs.size();
    step_batch_ = static_cast<int>(B);
    step_max_len_ = 0;
    step_seqs_.clear();
    step_prefixes_.clear();
    std::vector<void*> ptrs(static_cast<size_t>(ctx_.num_layers) * 4 * B);
    std::vector<int32_t> tail(B);
    std::map<const FullKvPrefix*, std::vector<int32_t>> attached;
    for (size_t i = 0; i < B; ++i) {
      Seq& s = Get(seqs[i]);
      // A closed shard's new K/V go to its spare row and are not attended.
      const int64_t at = s.closed ? s.length : positions[i];
      CHECK_LT(at, s.capacity) << "sequence " << seqs[i] << " is full";
      CHECK_GE(positions[i], s.base);
      step_seqs_.push_back(&s);
      tail[i] = static_cast<int32_t>(s.closed ? s.length - s.base
                                              : positions[i] + 1 - s.base);  // own keys, the new one included
      step_max_len_ = std::max<int64_t>(step_max_len_, tail[i]);
      if (s.fp != nullptr) attached[s.fp].push_back(static_cast<int32_t>(i));
      for (int l = 0; l < ctx_.num_layers; ++l) {
        void** row = &ptrs[static_cast<size_t>(l) * 4 * B];
        row[i] = Slot(s.k, s, l, at);
        row[B + i] = Slot(s.v, s, l, at);
        row[2 * B + i] = Slot(s.k, s, l, s.base);
        row[3 * B + i] = Slot(s.v, s, l, s.base);
      }
    }
    for (auto& [p, rows] : attached) {
      step_prefixes_.push_back({p, static_cast<int>(tail.size()), static_cast<int>(rows.size())});
      tail.insert(tail.end(), rows.begin(), rows.end());
    }
    if (!attached.empty()) PENUMBRA_RETURN_IF_ERROR(GrowLse(static_cast<int>(B)));
    PENUMBRA_RETURN_IF_ERROR(UploadPointers(ptrs, tail));
    return Status::OK();
  }

  Status DecodeAttention(int layer, const float* qkv, const int32_t* positions, void* q_scratch, void* out,
                         float* lse_out) override {
    if (lse_out != nullptr && !step_prefixes_.empty()) {
      return Status::Unimplemented("full KV: the log-sum-exp of sequences attached to a prefix");
    }
    const int B = step_batch_;
    void* const* row = static_cast<void* const*>(ptr_buf_.get()) + static_cast<size_t>(layer) * 4 * B;
    // Sequences of one step may hold different numbers of rows (head
    // strides): run the store and attention once per run of equal strides.
    int i = 0;
    const size_t row_q = static_cast<size_t>(ctx_.hq) * ctx_.head_dim;
    const size_t qkv_row = static_cast<size_t>(ctx_.hq + 2 * ctx_.hkv) * ctx_.head_dim;
    const auto* tail = reinterpret_cast<const int32_t*>(static_cast<void* const*>(ptr_buf_.get()) +
                                                        static_cast<size_t>(ctx_.num_layers) * 4 * B);
    float* lse = step_prefixes_.empty() ? lse_out : lse_.as<float>();
    while (i < B) {
      int j = i + 1;
      while (j < B && OwnRows(*step_seqs_[j]) == OwnRows(*step_seqs_[i])) ++j;
      const int nb = j - i;
      const int64_t stride = OwnRows(*step_seqs_[i]) * ctx_.head_dim;
      RopeStoreOp r;
      r.qkv = qkv + i * qkv_row;
      r.positions = positions + i;
      r.inv_freq = ctx_.inv_freq;
      r.n = nb;
      r.hq = ctx_.hq;
      r.hkv = ctx_.hkv;
      r.d = ctx_.head_dim;
      r.q_out = static_cast<char*>(q_scratch) + i * row_q * esize_;
      r.k_dst = row + i;
      r.v_dst = row + B + i;
      r.head_stride = stride;
      ctx_.backend->RopeStore(r);
      DecodeAttentionOp a;
      a.q = r.q_out;
      a.k = reinterpret_cast<const void* const*>(row + 2 * B + i);
      a.v = reinterpret_cast<const void* const*>(row + 3 * B + i);
      a.lengths = tail + i;
      a.out = static_cast<char*>(out) + i * row_q * esize_;
      a.lse = lse != nullptr ? lse + static_cast<size_t>(i) * ctx_.hq : nullptr;
      a.head_stride = stride;
      a.batch = nb;
      a.hq = ctx_.hq;
      a.hkv = ctx_.hkv;
      a.d = ctx_.head_dim;
      a.max_length = static_cast<int>(step_max_len_);
      a.scale = ctx_.scale;
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->DecodeAttention(a));
      i = j;
    }
    for (const StepPrefix& sp : step_prefixes_) {
      PENUMBRA_RETURN_IF_ERROR(PrefixPart(layer, *sp.prefix, q_scratch, tail + sp.offset, sp.n, out));
    }
    return Status::OK();
  }

  Status FinishDecodeStep() override {
    for (Seq* s : step_seqs_) {
      if (!s->closed) ++s->length;
    }
    ++stats_.decode_steps;
    return Status::OK();
  }

  Status SynthesizeContext(int64_t seq, int64_t length, uint64_t seed) override {
    Seq& s = Get(seq);
    // A shard's `length` tokens follow its first position.
    if (s.base + length > s.capacity) {
      return Status::InvalidArgument("synthesized context longer than the sequence's capacity");
    }
    if (s.fp != nullptr)
      return Status::InvalidArgument("cannot synthesize the context of a sequence attached to a prefix");
    const int64_t n = LayerStride(s) * ctx_.num_layers;
    ctx_.backend->FillRandomNormal(s.k.get(), ctx_.backend->act_dtype(), n, 1.0f, seed * 2 + 1);
    ctx_.backend->FillRandomNormal(s.v.get(), ctx_.backend->act_dtype(), n, 1.0f, seed * 2 + 2);
    s.length = s.base + length;
    return Status::OK();
  }

  // Merges prefix `p`'s part of `layer` into out for the rows `rows` (device
  // [n]) of q; lse_ holds their own parts' log-sum-exp.
  Status PrefixPart(int layer, const FullKvPrefix& p, const void* q, const int32_t* rows, int n, void* out) {
    const int64_t per_layer = static_cast<int64_t>(ctx_.hkv) * p.tokens() * ctx_.head_dim;
    PrefixAttentionOp a;
    a.q = q;
    a.rows = rows;
    a.n = n;
    a.k = static_cast<const char*>(p.k()) + layer * per_layer * esize_;
    a.v = static_cast<const char*>(p.v()) + layer * per_layer * esize_;
    a.head_stride = p.tokens() * ctx_.head_dim;
    a.keys = static_cast<int>(p.tokens());
    a.out = out;
    a.own_lse = lse_.as<float>();
    a.hq = ctx_.hq;
    a.hkv = ctx_.hkv;
    a.d = ctx_.head_dim;
    a.scale = ctx_.scale;
    return ctx_.backend->PrefixAttention(a);
  }

  SequenceBytes EstimateSequenceBytes(const SequenceSpec& spec) const override {
    Seq s;
    s.capacity = spec.prompt_len + spec.max_new_tokens;
    const size_t one = static_cast<size_t>(LayerStride(s)) * ctx_.num_layers * esize_;  // K, and V
    return {2 * ctx_.backend->AllocatedBytes(one), 0};
  }

  size_t DeviceBytes(int64_t seq) const override {
    auto it = seqs_.find(seq);
    return it == seqs_.end() ? 0 : it->second.k.bytes() + it->second.v.bytes();
  }

 private:
  struct Seq {
    int64_t capacity = 0;  // tokens, the attached prefix's included
    int64_t length = 0;
    int64_t base = 0;                        // the attached prefix's tokens: rows from `base` on are the sequence's own
    DeviceBuffer k, v;                       // own rows: [layers][hkv][capacity - base][d]
    bool closed = false;                     // a closed context-parallel shard (ShardSpec::closed)
    bool shard = false;                      // a context-parallel shard (its prefixes: its own rows)
    const FullKvPrefix* fp = nullptr;        // the attached prefix (null: none)
    std::shared_ptr<const KvPrefix> prefix;  // ... held while the sequence lives
  };
  struct StepPrefix {
    const FullKvPrefix* prefix;
    int offset, n;  // its rows in the step's upload tail
  };

  // A context-parallel shard from a prefix of exactly its own tokens (a
  // shard's capture): the prefix's K/V copied into the shard's own rows, so
  // the shard is what its prefill made (no cascade attention).
  Status AddShardFromPrefix(int64_t seq, const SequenceSpec& spec, Seq s) {
    const auto* p = dynamic_cast<const FullKvPrefix*>(spec.prefix.get());
    if (p == nullptr) {
      return Status::InvalidArgument("a " + spec.prefix->policy() + " prefix cannot attach to a full KV sequence");
    }
    if (p->tokens() != spec.prompt_len) {
      return Status::InvalidArgument("a context-parallel shard of " + std::to_string(spec.prompt_len) +
                                     " tokens attaches a prefix of exactly its tokens, not " +
                                     std::to_string(p->tokens()));
    }
    const size_t bytes = LayerStride(s) * ctx_.num_layers * esize_;
    PENUMBRA_ASSIGN_OR_RETURN(s.k, ctx_.backend->Allocate(bytes));
    PENUMBRA_ASSIGN_OR_RETURN(s.v, ctx_.backend->Allocate(bytes));
    const size_t row = static_cast<size_t>(ctx_.head_dim) * esize_, T = static_cast<size_t>(p->tokens());
    const size_t rows = static_cast<size_t>(ctx_.num_layers) * ctx_.hkv, pitch = OwnRows(s) * row;
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Copy2D(s.k.get(), pitch, p->k(), T * row, T * row, rows));
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Copy2D(s.v.get(), pitch, p->v(), T * row, T * row, rows));
    s.length = s.base + p->tokens();
    seqs_.emplace(seq, std::move(s));
    return Status::OK();
  }

  // A context-parallel shard's first `tokens` own tokens (from its first
  // position): the prefix AddShardFromPrefix takes.
  Result<std::shared_ptr<const KvPrefix>> CaptureShard(const Seq& s, int64_t seq, int64_t tokens) {
    if (tokens < 1 || tokens > s.length - s.base) {
      return Status::InvalidArgument("prefix of " + std::to_string(tokens) + " tokens: shard " + std::to_string(seq) +
                                     " holds " + std::to_string(s.length - s.base));
    }
    const size_t row = static_cast<size_t>(ctx_.head_dim) * esize_, T = static_cast<size_t>(tokens);
    const size_t rows = static_cast<size_t>(ctx_.num_layers) * ctx_.hkv, pitch = OwnRows(s) * row;
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer k, ctx_.backend->Allocate(rows * T * row));
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer v, ctx_.backend->Allocate(rows * T * row));
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Copy2D(k.get(), T * row, s.k.get(), pitch, T * row, rows));
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Copy2D(v.get(), T * row, s.v.get(), pitch, T * row, rows));
    return std::shared_ptr<const KvPrefix>(std::make_shared<FullKvPrefix>(tokens, ctx_.num_layers, ctx_.hkv,
                                                                          ctx_.head_dim, ctx_.backend->act_dtype(),
                                                                          std::move(k), std::move(v), ctx_.backend));
  }

  Seq& Get(int64_t seq) {
    auto it = seqs_.find(seq);
    CHECK(it != seqs_.end()) << "unknown sequence " << seq;
    return it->second;
  }
  static int64_t OwnRows(const Seq& s) { return s.capacity - s.base; }
  int64_t LayerStride(const Seq& s) const { return static_cast<int64_t>(ctx_.hkv) * OwnRows(s) * ctx_.head_dim; }
  // Token `pos` (>= s.base) of `layer`, head 0.
  void* Slot(const DeviceBuffer& buf, const Seq& s, int layer, int64_t pos) const {
    return static_cast<char*>(buf.get()) + (layer * LayerStride(s) + (pos - s.base) * ctx_.head_dim) * esize_;
  }
  // lse_ holds at least `rows` rows of hq floats.
  Status GrowLse(int rows) {
    const size_t bytes = static_cast<size_t>(rows) * ctx_.hq * sizeof(float);
    if (bytes <= lse_.bytes()) return Status::OK();
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Synchronize());  // the previous step may still read it
    PENUMBRA_ASSIGN_OR_RETURN(lse_, ctx_.backend->Allocate(bytes * 2));
    return Status::OK();
  }

  // Copies host pointer arrays (and optional int32 tail) into ptr_buf_.
  Status UploadPointers(const std::vector<void*>& ptrs, const std::vector<int32_t>& tail = {}) {
    const size_t bytes = ptrs.size() * sizeof(void*) + tail.size() * sizeof(int32_t);
    if (bytes > ptr_buf_.bytes()) {
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Synchronize());
      PENUMBRA_ASSIGN_OR_RETURN(ptr_buf_, ctx_.backend->Allocate(bytes * 2));
    }
    staging_.resize(bytes);
    std::memcpy(staging_.data(), ptrs.data(), ptrs.size() * sizeof(void*));
    if (!tail.empty()) std::memcpy(staging_.data() + ptrs.size() * sizeof(void*), tail.data(), tail.size() * 4);
    // The previous step's kernels may still read ptr_buf_; the copy is on the
    // same stream, so it is ordered after them.
    return ctx_.backend->CopyToDevice(ptr_buf_.get(), staging_.data(), bytes);
  }

  PolicyContext ctx_;
  size_t esize_;
  std::map<int64_t, Seq> seqs_;
  DeviceBuffer ptr_buf_;
  std::vector<uint8_t> staging_;
  std::vector<Seq*> step_seqs_;
  std::vector<StepPrefix> step_prefixes_;
  DeviceBuffer lse_;  // [rows][hq] f32: own parts' log-sum-exp for the prefix merges
  int step_batch_ = 0;
  int64_t step_max_len_ = 0;
};

}  // namespace

std::unique_ptr<KvPolicy> MakeFullKvPolicy(const PolicyContext& ctx) { return std::make_unique<FullKvPolicy>(ctx); }

}  // namespace penumbra
