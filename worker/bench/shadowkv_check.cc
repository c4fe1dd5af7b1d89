// The engine side of the ShadowKV reference check.
//
// RunShadowkvCheck runs the policy's own ShadowKV objects
// (worker/engine/shadowkv/) on one layer of one sequence:
//   ShadowKvLayout::Shape, Allocate  -> geometry (token_cap, chunk_cap,
//                                       local_cap, att_cap, O, kslots; for a
//                                       shard its window, share of outliers,
//                                       global budget), checked against the
//                                       inputs'; the buffers as the policy's
//                                       AddSequence makes them
//   ShadowKvCompressor               -> StoreTokens into its temporaries, then
//                                       Factor (LowRankFactor), Landmarks,
//                                       Outliers, OffloadValues (to a
//                                       value-store segment), TailToLocal, as
//                                       the policy's CompressPrompt
//   ShadowKvPrefixIo (attached)      -> Capture (take, as a put's TakePrefix),
//                                       ShadowKvPrefix::Export, Import, then
//                                       Fit + Allocate + Attach (AddSequence
//                                       with the prefix)
//   ShadowKvDecodeStep               -> per step: Begin (the pointer tables
//                                       and ints), RopeStoreOf, ScoreArgsOf +
//                                       SlotUpdateOf (ShadowkvScoreAndSlotUpdate,
//                                       as the policy's Select), ForkSide,
//                                       FetchVOf (zero copy), RebuildKOf,
//                                       JoinSide, AttentionOf
//   ShadowKvShardExchange (cp2)      -> per step and rank, as the policy's
//                                       DecodeAttentionGlobal: statistics,
//                                       AllGatherStats, proposals,
//                                       AllGatherCandidates, the global
//                                       select + slot update, attention with
//                                       its log-sum-exp (empty slots masked);
//                                       then the runtime's MergeRanks
//                                       (all-gather, MergeAttentionParts)
// The ranks of cp2 share this process's backend and step in lock step
// (LockstepGroup, worker/bench/lockstep_group.h); each has its own
// sequence, decode step, exchange and score workspace (workspace_part).
// Adaptations to the reference's setting, made here and not in the policy:
//  * no token is appended during decode: the sequence (every shard) is
//    closed (as a context-parallel shard that is not the last), so
//    RopeStore's K/V go to the row after the local rows, the attention
//    length is (O + kslots) * C + tail (no + 1), and FinishDecodeStep's
//    local-row growth / CompressOldest never runs;
//  * the whole prompt is one layer's prefill (the layer's full prefill
//    attention is skipped: the check does not use its output);
//  * one landmark per chunk in the model's dtype (landmarks_per_chunk 1,
//    landmark_format model), what the reference computes;
//  * the scores are also computed alone (ShadowkvScore without a selection,
//    into a buffer of their own; in cp2 the second, normalized call) to be
//    compared: the fused selection may not write them.
// The slot map persists across steps as in production, so steps after the
// first rebuild only their misses.
#include "worker/bench/shadowkv_check.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>

#include <nlohmann/json.hpp>

#include "storage/dram_value_store.h"
#include "worker/bench/lockstep_group.h"
#include "worker/engine/backend_host_allocator.h"
#include "worker/engine/runtime.h"
#include "worker/engine/shadowkv/compressor.h"
#include "worker/engine/shadowkv/decode_step.h"
#include "worker/engine/shadowkv/layout.h"
#include "worker/engine/shadowkv/prefix_io.h"
#include "worker/engine/shadowkv/shard_exchange.h"
#include "worker/engine/shadowkv_options.h"
#include "worker/model/safetensors.h"

namespace penumbra::shadowkv_check {
namespace {

namespace kn = kernels;

constexpr char kInputsFormat[] = "penumbra-shadowkv-check-inputs/1";
constexpr char kOutputsFormat[] = "penumbra-shadowkv-check-outputs/1";

std::string Str(int64_t v) { return std::to_string(v); }

// ---------------------------------------------------------------- reading

Result<int64_t> MetaInt(const std::map<std::string, std::string>& meta, const std::string& key) {
  auto it = meta.find(key);
  if (it == meta.end()) return Status::InvalidArgument("inputs: missing metadata key '" + key + "'");
  const std::string& s = it->second;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || end != s.c_str() + s.size() || errno == ERANGE || v < std::numeric_limits<int32_t>::min() ||
      v > std::numeric_limits<int32_t>::max()) {
    return Status::InvalidArgument("inputs: metadata key '" + key + "' = '" + s + "' is not a 32-bit integer");
  }
  return static_cast<int64_t>(v);
}

Result<double> MetaDouble(const std::map<std::string, std::string>& meta, const std::string& key) {
  auto it = meta.find(key);
  if (it == meta.end()) return Status::InvalidArgument("inputs: missing metadata key '" + key + "'");
  const std::string& s = it->second;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v)) {
    return Status::InvalidArgument("inputs: metadata key '" + key + "' = '" + s + "' is not a finite number");
  }
  return v;
}

// The F32 tensor `name` of rank `dims`, copied out; its shape to `shape`.
Status ReadF32(const SafetensorsFile& f, const std::string& name, size_t dims, std::vector<int64_t>* shape,
               std::vector<float>* out) {
  const TensorInfo* t = f.Find(name);
  if (t == nullptr) return Status::InvalidArgument("inputs: missing tensor '" + name + "'");
  if (t->dtype_name != "F32") {
    return Status::InvalidArgument("inputs: tensor '" + name + "' is " + t->dtype_name + ", want F32");
  }
  if (t->shape.size() != dims) {
    return Status::InvalidArgument("inputs: tensor '" + name + "' has shape " + ShapeToString(t->shape) + ", want " +
                                   Str(static_cast<int64_t>(dims)) + " dimensions");
  }
  for (int64_t s : t->shape) {
    if (s > std::numeric_limits<int32_t>::max()) {
      return Status::InvalidArgument("inputs: tensor '" + name + "' shape " + ShapeToString(t->shape) +
                                     " is too large");
    }
  }
  *shape = t->shape;
  out->resize(static_cast<size_t>(t->numel()));
  if (!out->empty()) std::memcpy(out->data(), t->data, out->size() * sizeof(float));
  return Status::OK();
}

std::string Dims(std::initializer_list<int64_t> dims) { return ShapeToString(std::vector<int64_t>(dims)); }

}  // namespace

// ------------------------------------------------------------- validation

Status ValidateInputs(const CheckInputs& in) {
  auto bad = [](const std::string& m) { return Status::InvalidArgument("inputs: " + m); };
  const int64_t H = in.hkv, S = in.seq, d = in.d, hq = in.hq, steps = in.steps;
  if (H < 1 || S < 1 || d < 2 || hq < 1 || steps < 1) {
    return bad("empty tensors: hkv " + Str(H) + ", seq " + Str(S) + ", d " + Str(d) + ", hq " + Str(hq) + ", steps " +
               Str(steps));
  }
  if (d % 2 != 0) return bad("tensor 'k_pre': head dim " + Str(d) + " must be even");
  if (static_cast<int64_t>(in.k_pre.size()) != H * S * d) return bad("tensor 'k_pre' size != hkv*seq*d");
  if (static_cast<int64_t>(in.v.size()) != H * S * d) return bad("tensor 'v' must have shape " + Dims({H, S, d}));
  if (static_cast<int64_t>(in.q.size()) != steps * hq * d)
    return bad("tensor 'q' must have shape " + Dims({steps, hq, d}));
  if (static_cast<int64_t>(in.inv_freq.size()) != d / 2)
    return bad("tensor 'inv_freq' must have shape " + Dims({d / 2}));
  if (hq % H != 0) return bad("tensor 'q': hq " + Str(hq) + " is not a multiple of hkv " + Str(H));
  if (in.rank < 1 || in.rank > std::min<int64_t>(S, H * d)) {
    return bad("metadata 'rank' = " + Str(in.rank) +
               " not in [1, min(seq, hkv*d) = " + Str(std::min<int64_t>(S, H * d)) + "]");
  }
  if (in.chunk < 1) return bad("metadata 'chunk' = " + Str(in.chunk) + " must be >= 1");
  if (in.local_window < 0) return bad("metadata 'local_window' = " + Str(in.local_window) + " must be >= 0");
  const int n = in.n_chunks();
  if (S < in.local_window || n < 1) {
    return bad("metadata 'local_window'/'chunk': no chunks (seq " + Str(S) + ", local_window " + Str(in.local_window) +
               ", chunk " + Str(in.chunk) + ")");
  }
  if (in.outliers < 0 || in.outliers >= n) {
    return bad("metadata 'outliers' = " + Str(in.outliers) + " not in [0, n_chunks = " + Str(n) + ")");
  }
  if (in.budget < 0 || in.kslots() < 1 || in.kslots() > n - in.outliers) {
    return bad("metadata 'budget' = " + Str(in.budget) + ": kslots = budget // chunk = " + Str(in.kslots()) +
               " not in [1, n_chunks - outliers = " + Str(n - in.outliers) + "]");
  }
  if (!(in.scale > 0.0f) || !std::isfinite(in.scale)) return bad("metadata 'scale' must be a positive finite number");
  for (size_t i = 0; i < in.inv_freq.size(); ++i) {
    if (!std::isfinite(in.inv_freq[i])) return bad("tensor 'inv_freq' has a non-finite value at " + Str(i));
  }
  // The engine's limits (kernel contracts and ShadowKvOptions validation).
  auto limit = [](const std::string& m) { return Status::InvalidArgument("inputs: unsupported by the engine: " + m); };
  if (d % 8 != 0 || d > 256) return limit("head dim " + Str(d) + " (needs d % 8 == 0 and d <= 256)");
  if (hq / H > 8) return limit("group " + Str(hq / H) + " > 8 query heads per KV head");
  if (in.chunk > 64) return limit("metadata 'chunk' = " + Str(in.chunk) + " > 64");
  if (in.rank > 512) return limit("metadata 'rank' = " + Str(in.rank) + " > 512");
  if (in.local_window < 1) return limit("metadata 'local_window' = 0 (shadowkv.local_window must be >= 1)");
  if (in.kslots() > kn::kTopKMaxK) return limit("kslots " + Str(in.kslots()) + " > " + Str(kn::kTopKMaxK));
  if (S + steps > std::numeric_limits<int32_t>::max() / 2) return limit("seq " + Str(S) + " too long");
  return Status::OK();
}

Result<CheckInputs> ReadInputs(const std::string& path) {
  PENUMBRA_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::Open(path));
  CheckInputs in;
  std::vector<int64_t> ks, vs, qs, fs;
  PENUMBRA_RETURN_IF_ERROR(ReadF32(f, "k_pre", 3, &ks, &in.k_pre));
  PENUMBRA_RETURN_IF_ERROR(ReadF32(f, "v", 3, &vs, &in.v));
  PENUMBRA_RETURN_IF_ERROR(ReadF32(f, "q", 3, &qs, &in.q));
  PENUMBRA_RETURN_IF_ERROR(ReadF32(f, "inv_freq", 1, &fs, &in.inv_freq));
  in.hkv = static_cast<int>(ks[0]);
  in.seq = static_cast<int>(ks[1]);
  in.d = static_cast<int>(ks[2]);
  in.steps = static_cast<int>(qs[0]);
  in.hq = static_cast<int>(qs[1]);
  if (vs != ks) {
    return Status::InvalidArgument("inputs: tensor 'v' has shape " + ShapeToString(vs) + ", want " + ShapeToString(ks) +
                                   " (as 'k_pre')");
  }
  if (qs[2] != in.d) {
    return Status::InvalidArgument("inputs: tensor 'q' has shape " + ShapeToString(qs) + ", want [steps, hq, " +
                                   Str(in.d) + "]");
  }
  if (fs[0] * 2 != in.d) {
    return Status::InvalidArgument("inputs: tensor 'inv_freq' has shape " + ShapeToString(fs) + ", want [" +
                                   Str(in.d / 2) + "]");
  }
  const auto& meta = f.metadata();
  auto fmt = meta.find("format");
  if (fmt != meta.end() && fmt->second != kInputsFormat) {
    return Status::InvalidArgument("inputs: metadata 'format' = '" + fmt->second + "', want '" + kInputsFormat + "'");
  }
  PENUMBRA_ASSIGN_OR_RETURN(int64_t rank, MetaInt(meta, "rank"));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t chunk, MetaInt(meta, "chunk"));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t budget, MetaInt(meta, "budget"));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t outliers, MetaInt(meta, "outliers"));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t local_window, MetaInt(meta, "local_window"));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t steps, MetaInt(meta, "steps"));
  PENUMBRA_ASSIGN_OR_RETURN(double scale, MetaDouble(meta, "scale"));
  if (steps != in.steps) {
    return Status::InvalidArgument("inputs: metadata 'steps' = " + Str(steps) + " but tensor 'q' has " + Str(in.steps) +
                                   " steps");
  }
  in.rank = static_cast<int>(rank);
  in.chunk = static_cast<int>(chunk);
  in.budget = budget;
  in.outliers = static_cast<int>(outliers);
  in.local_window = static_cast<int>(local_window);
  in.scale = static_cast<float>(scale);
  PENUMBRA_RETURN_IF_ERROR(ValidateInputs(in));
  return in;
}

// ------------------------------------------------------------------- run

namespace {

// One run's engine objects: the options and geometry the policy has for a
// one-layer model of the inputs' shape (ShadowKvLayout), the value store,
// the compressor and the document capture/attach (ShadowKvPrefixIo); the
// modes below make sequences (one, or one per rank) and drive them.
class CheckRun {
 public:
  CheckRun(const CheckInputs& in, Backend& b)
      : in_(in),
        b_(b),
        act_(b.act_dtype()),
        es_(DTypeSize(act_)),
        host_alloc_(&b),
        store_(&host_alloc_, storage::DramValueStoreOptions{}) {}
  ~CheckRun() {
    (void)b_.Synchronize();  // kernels may still read the sequences' buffers
    for (storage::SegmentId id : segments_) (void)store_.DropSegment(id);
  }

  Status Init();
  Result<CheckResults> Direct();
  Result<CheckResults> Attached();
  Result<CheckResults> ContextParallel(int world);

 private:
  // A sequence of `spec` as the policy's AddSequence makes it: the layout's
  // shape (and the prefix's Fit), its buffers (ShadowKvLayout::Allocate),
  // its value-store segment (this sequence's own chunks).
  Status NewSeq(const SequenceSpec& spec, int64_t id, const ShadowKvPrefix* prefix, ShadowKvSeq* s);
  // The policy's first prefill of inputs tokens [t0, t1) into `s` (a shard
  // when t0 > 0): PrefillAttention's StoreTokens at the tokens' positions,
  // then FinishPrefillLayer's CompressPrompt (the compressor's factors,
  // landmarks and outliers, the values to the store, the tail to the local
  // rows). The check skips the prefill's attention (its output is unused).
  Status Prefill(ShadowKvSeq& s, int64_t t0, int64_t t1);
  // Head h's records of chunks [0, n) of `lm` ([hkv][cap] records, device)
  // into res->landmarks chunks [at, at + n).
  Status ReadLandmarks(const void* lm, int cap, int n, int at, CheckResults* res);
  // The decode steps of one sequence (direct, attached): the policy's
  // DecodeAttention without a group.
  Status DecodeOne(ShadowKvSeq& seq, CheckResults* res);
  // The decode steps of the shards of one sequence, one per rank of
  // `group`: the policy's DecodeAttentionGlobal on every rank, then the
  // runtime's merge of the ranks' attention (MergeRanks).
  Status DecodeShards(const std::vector<ShadowKvSeq*>& shards, LockstepGroup& group, CheckResults* res);
  CheckResults Empty(const char* mode) const;

  const CheckInputs& in_;
  Backend& b_;
  const DType act_;
  const size_t es_;
  ShadowKvOptions o_;
  DeviceBuffer inv_freq_;
  PolicyContext ctx_;
  std::unique_ptr<ShadowKvLayout> lay_;
  BackendHostAllocator host_alloc_;
  storage::DramValueStore store_;
  std::unique_ptr<ShadowKvCompressor> comp_;
  std::unique_ptr<ShadowKvPrefixIo> io_;
  std::vector<storage::SegmentId> segments_;  // dropped at the end (a taken one is detached)
};

Status CheckRun::Init() {
  PENUMBRA_RETURN_IF_ERROR(ValidateInputs(in_));
  o_.rank = in_.rank;
  o_.chunk_size = in_.chunk;
  o_.budget_tokens = static_cast<int64_t>(in_.kslots()) * in_.chunk;
  o_.outlier_chunks = in_.outliers;
  o_.local_window = in_.local_window;
  o_.min_prompt_tokens = 0;
  // The reference's landmarks: one per chunk, in the model's dtype.
  o_.landmarks_per_chunk = 1;
  o_.landmark_format = "model";
  PENUMBRA_RETURN_IF_ERROR(ValidateShadowKvOptions(o_, in_.hkv, in_.d));
  PENUMBRA_ASSIGN_OR_RETURN(inv_freq_, b_.Allocate(in_.inv_freq.size() * sizeof(float)));
  PENUMBRA_RETURN_IF_ERROR(b_.CopyToDevice(inv_freq_.get(), in_.inv_freq.data(), in_.inv_freq.size() * sizeof(float)));
  ctx_.backend = &b_;
  ctx_.num_layers = 1;
  ctx_.hq = in_.hq;
  ctx_.hkv = in_.hkv;
  ctx_.head_dim = in_.d;
  ctx_.inv_freq = inv_freq_.as<float>();
  ctx_.scale = in_.scale;
  lay_ = std::make_unique<ShadowKvLayout>(ctx_, o_);
  comp_ = std::make_unique<ShadowKvCompressor>(*lay_, b_);
  io_ = std::make_unique<ShadowKvPrefixIo>(*lay_, b_, store_, host_alloc_);
  return Status::OK();
}

Status CheckRun::NewSeq(const SequenceSpec& spec, int64_t id, const ShadowKvPrefix* prefix, ShadowKvSeq* s) {
  s->id = id;
  s->pos0 = spec.shard.position_base;
  s->closed = spec.shard.closed;
  lay_->Shape(spec, s);
  if (prefix != nullptr) PENUMBRA_RETURN_IF_ERROR(io_->Fit(*prefix, *s));
  PENUMBRA_RETURN_IF_ERROR(lay_->Allocate(s));
  // Not in the policy: rows attention never reads hold zeros instead of garbage.
  PENUMBRA_RETURN_IF_ERROR(b_.Memset(s->att_k.get(), 0, s->att_k.bytes()));
  PENUMBRA_RETURN_IF_ERROR(b_.Memset(s->att_v.get(), 0, s->att_v.bytes()));
  if (!s->sparse) return Status::OK();
  storage::SegmentLayout lay{1, in_.hkv, s->chunk_cap - s->shared_chunks, in_.chunk, in_.d, act_};
  PENUMBRA_ASSIGN_OR_RETURN(s->segment, store_.CreateSegment(lay));
  segments_.push_back(s->segment);
  PENUMBRA_ASSIGN_OR_RETURN(const void* store_host, store_.LayerBase(s->segment, 0));
  s->store_host.assign(1, store_host);
  s->store_dev.assign(1, b_.DeviceAddressOfHost(store_host));
  return Status::OK();
}

Status CheckRun::Prefill(ShadowKvSeq& seq, int64_t t0, int64_t t1) {
  Backend& b = b_;
  const int H = in_.hkv, d = in_.d, hq = in_.hq, D = H * d, C = in_.chunk;
  const size_t es = es_;
  const int64_t S = t1 - t0;  // the sequence's own tokens
  ShadowKvCompressor& comp = *comp_;
  // ---- StoreTokens over the prompt (the compressor's): exact post-RoPE K, V
  // (act dtype) into the temporaries [hkv][tmp_cap][d], f32 pre-RoPE keys
  // [tmp_cap][hkv*d]; row t - t0 holds token t at position t.
  PENUMBRA_RETURN_IF_ERROR(comp.EnsureTemp(seq.token_cap));
  const int64_t tstride = comp.tmp_cap() * d;
  {
    const int tile = static_cast<int>(std::min<int64_t>(S, 4096));
    const int64_t qkv_row = static_cast<int64_t>(hq + 2 * H) * d;
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer qkv, b.Allocate(static_cast<size_t>(tile) * qkv_row * sizeof(float)));
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer q_scratch, b.Allocate(static_cast<size_t>(tile) * hq * d * es));
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer pos, b.Allocate(static_cast<size_t>(tile) * sizeof(int32_t)));
    std::vector<float> host(static_cast<size_t>(tile) * qkv_row);
    std::vector<int32_t> p(tile);
    for (int64_t start = 0; start < S; start += tile) {
      const int n = static_cast<int>(std::min<int64_t>(tile, S - start));
      std::fill(host.begin(), host.end(), 0.0f);  // the prompt's queries are not used
      for (int i = 0; i < n; ++i) {
        const int64_t t = t0 + start + i;
        float* rw = host.data() + static_cast<size_t>(i) * qkv_row;
        for (int h = 0; h < H; ++h) {
          const size_t src = (static_cast<size_t>(h) * in_.seq + t) * d;
          std::memcpy(rw + static_cast<size_t>(hq + h) * d, in_.k_pre.data() + src, d * sizeof(float));
          std::memcpy(rw + static_cast<size_t>(hq + H + h) * d, in_.v.data() + src, d * sizeof(float));
        }
        p[i] = static_cast<int32_t>(t);
      }
      PENUMBRA_RETURN_IF_ERROR(
          b.CopyToDevice(qkv.get(), host.data(), static_cast<size_t>(n) * qkv_row * sizeof(float)));
      PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(pos.get(), p.data(), n * sizeof(int32_t)));
      PENUMBRA_RETURN_IF_ERROR(comp.StoreTokens(qkv.as<float>(), pos.as<int32_t>(), n, start, q_scratch.get(),
                                                comp.tmp_k().get(), comp.tmp_v().get(), tstride,
                                                comp.tmp_prek().as<float>() + start * D));
      // The host buffers are rewritten by the next tile.
      PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    }
  }

  // ---- CompressPrompt: the compressor's steps, as the policy runs them.
  const int n_chunks = static_cast<int>((S - seq.window) / C);
  PENUMBRA_RETURN_IF_ERROR(comp.Factor(seq, 0, S));
  comp.Landmarks(seq, 0, n_chunks);
  PENUMBRA_RETURN_IF_ERROR(comp.Outliers(seq, 0, n_chunks));
  // OffloadValues: every chunk's values (outliers too) to the store through
  // pinned staging; the tail becomes the local rows (exact K/V and pre-RoPE
  // keys).
  if (n_chunks > 0) {
    DeviceBuffer stage;
    PENUMBRA_RETURN_IF_ERROR(comp.OffloadValues(store_, &stage, seq, 0, comp.tmp_v().get(), tstride, 0, n_chunks, 0));
  }
  const int64_t tail0 = static_cast<int64_t>(n_chunks) * C, tail = S - tail0;
  PENUMBRA_RETURN_IF_ERROR(comp.TailToLocal(seq, 0, tail0, tail));
  PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
  seq.n_chunks = n_chunks;
  seq.local_count = tail;
  seq.compressed = true;
  // The prefill temporaries are done with (the policy keeps them for reuse).
  comp.ReleaseTempIfLarge();
  return Status::OK();
}

CheckResults CheckRun::Empty(const char* mode) const {
  CheckResults res;
  res.mode = mode;
  res.hkv = in_.hkv;
  res.n_chunks = in_.n_chunks();
  res.d = in_.d;
  res.hq = in_.hq;
  res.steps = in_.steps;
  res.outliers = in_.outliers;
  res.kslots = in_.kslots();
  res.dtype = act_;
  res.landmarks.assign(static_cast<size_t>(res.hkv) * res.n_chunks * res.d, 0.0f);
  res.outlier_ids.assign(static_cast<size_t>(res.hkv) * res.outliers, -1);
  res.selected.assign(static_cast<size_t>(res.steps) * res.hkv * res.kslots, -1);
  res.scores.assign(static_cast<size_t>(res.steps) * res.hkv * res.n_chunks, 0.0f);
  res.out.assign(static_cast<size_t>(res.steps) * res.hq * res.d, 0.0f);
  return res;
}

Status CheckRun::ReadLandmarks(const void* lm, int cap, int n, int at, CheckResults* res) {
  const int H = in_.hkv, d = in_.d;
  // landmarks_per_chunk 1, landmark_format model: a record is d act-dtype elements.
  std::vector<char> raw(static_cast<size_t>(H) * cap * d * es_);
  PENUMBRA_RETURN_IF_ERROR(b_.CopyToHost(raw.data(), lm, raw.size()));
  std::vector<float> all(static_cast<size_t>(H) * cap * d);
  ConvertToF32(raw.data(), act_, all.data(), all.size());
  for (int h = 0; h < H; ++h) {
    std::copy_n(all.data() + static_cast<size_t>(h) * cap * d, static_cast<size_t>(n) * d,
                res->landmarks.data() + (static_cast<size_t>(h) * res->n_chunks + at) * d);
  }
  return Status::OK();
}

// The policy's geometry must be the inputs' (one whole sequence).
Status CheckGeometry(const ShadowKvSeq& s, const CheckInputs& in) {
  if (!s.sparse || s.outliers != in.outliers || s.kslots != in.kslots()) {
    return Status::Internal("policy geometry (sparse " + Str(s.sparse) + ", outliers " + Str(s.outliers) + ", kslots " +
                            Str(s.kslots) + ") differs from the inputs'");
  }
  return Status::OK();
}

Result<CheckResults> CheckRun::Direct() {
  SequenceSpec spec;
  spec.prompt_len = in_.seq;
  spec.max_new_tokens = in_.steps;
  ShadowKvSeq seq;
  PENUMBRA_RETURN_IF_ERROR(NewSeq(spec, 1, nullptr, &seq));
  PENUMBRA_RETURN_IF_ERROR(CheckGeometry(seq, in_));
  PENUMBRA_RETURN_IF_ERROR(Prefill(seq, 0, in_.seq));
  CheckResults res = Empty("direct");
  PENUMBRA_RETURN_IF_ERROR(ReadLandmarks(seq.lm.get(), seq.lm_cap, seq.n_chunks, 0, &res));
  res.outlier_ids = seq.outlier_ids;  // the compressor's host copy (empty when O == 0)
  res.outlier_ids.resize(static_cast<size_t>(in_.hkv) * in_.outliers);
  PENUMBRA_RETURN_IF_ERROR(DecodeOne(seq, &res));
  return res;
}

Result<CheckResults> CheckRun::Attached() {
  // The document: a prefill-only sequence of the whole context (a put:
  // max_new_tokens 0), compressed as the policy compresses a prompt's
  // leading document, then taken into a prefix as the runtime's
  // CaptureSegment does for a put (TakePrefix: the store segment becomes the
  // prefix's values).
  std::shared_ptr<ShadowKvPrefix> imported;
  {
    SequenceSpec spec;
    spec.prompt_len = in_.seq;
    spec.max_new_tokens = 0;
    spec.first_prefill = in_.seq;
    ShadowKvSeq doc;
    PENUMBRA_RETURN_IF_ERROR(NewSeq(spec, 1, nullptr, &doc));
    PENUMBRA_RETURN_IF_ERROR(CheckGeometry(doc, in_));
    PENUMBRA_RETURN_IF_ERROR(Prefill(doc, 0, in_.seq));
    const storage::SegmentId doc_segment = doc.segment;
    PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<ShadowKvPrefix> taken, io_->Capture(doc, in_.seq, /*take=*/true));
    if (doc.segment == 0) {  // detached: its values are the prefix's now
      segments_.erase(std::remove(segments_.begin(), segments_.end(), doc_segment), segments_.end());
    }
    // Exported to blobs (what the document cache stores on disk or a store
    // node) and imported fresh: the attached state is the blobs' only.
    PENUMBRA_ASSIGN_OR_RETURN(auto blobs, taken->Export());
    taken.reset();
    PENUMBRA_ASSIGN_OR_RETURN(imported, io_->Import(blobs));
  }
  // A new sequence attaching it (AddSequence with a prefix: shaped from the
  // prefix's factored tokens, Fit, Allocate, Attach), decoding on the
  // attached state.
  SequenceSpec spec;
  spec.prompt_len = in_.seq;
  spec.max_new_tokens = in_.steps;
  spec.first_prefill = imported->geometry().factored;
  ShadowKvSeq seq;
  PENUMBRA_RETURN_IF_ERROR(NewSeq(spec, 2, imported.get(), &seq));
  PENUMBRA_RETURN_IF_ERROR(CheckGeometry(seq, in_));
  PENUMBRA_RETURN_IF_ERROR(io_->Attach(*imported, seq));
  seq.prefix = imported;
  if (seq.shared_chunks != in_.n_chunks() || seq.n_chunks != in_.n_chunks()) {
    return Status::Internal("attached: the sequence shares " + Str(seq.shared_chunks) + " of " + Str(seq.n_chunks) +
                            " chunks, want all " + Str(in_.n_chunks()));
  }
  CheckResults res = Empty("attached");
  // The landmarks the decode steps read: the attached prefix's.
  PENUMBRA_RETURN_IF_ERROR(ReadLandmarks(imported->lm_layer(0), seq.shared_chunks, seq.shared_chunks, 0, &res));
  res.outlier_ids = seq.outlier_ids;  // Attach's copy of the prefix's
  res.outlier_ids.resize(static_cast<size_t>(in_.hkv) * in_.outliers);
  PENUMBRA_RETURN_IF_ERROR(DecodeOne(seq, &res));
  return res;
}

Result<CheckResults> CheckRun::ContextParallel(int world) {
  const int C = in_.chunk, H = in_.hkv;
  const int64_t S = in_.seq;
  LockstepGroup group(b_, world);
  // Each rank's shard as the runtime makes it (Runtime::AddSequence under a
  // context group): Runtime::ShardOf's contiguous part of the prompt, every
  // shard but the last closed, the global selection's group.
  std::vector<ShadowKvSeq> shards(static_cast<size_t>(world));
  std::vector<Runtime::Shard> bounds;
  CheckResults res = Empty("cp2");
  int chunk0 = 0, outliers = 0;
  for (int r = 0; r < world; ++r) {
    const Runtime::Shard sh = Runtime::ShardOf(S, r, world);
    bounds.push_back(sh);
    SequenceSpec spec;
    spec.prompt_len = sh.end - sh.begin;
    spec.max_new_tokens = r == world - 1 ? in_.steps : 0;
    spec.shard.position_base = sh.begin;
    spec.shard.closed = r < world - 1;
    spec.shard.share = static_cast<double>(sh.end - sh.begin) / static_cast<double>(S);
    spec.shard.sequence_tokens = S;
    spec.shard.group = &group.rank(r);
    // The shards' chunks are the whole sequence's only when every closed
    // shard is whole chunks.
    if (r < world - 1 && sh.end % C != 0) {
      return Status::InvalidArgument("inputs: unsupported by cp" + Str(world) + ": shard " + Str(r) +
                                     " ends at token " + Str(sh.end) + ", not a multiple of chunk " + Str(C));
    }
    ShadowKvSeq& s = shards[static_cast<size_t>(r)];
    PENUMBRA_RETURN_IF_ERROR(NewSeq(spec, 1 + r, nullptr, &s));
    if (!s.sparse || s.group != &group.rank(r) || s.global_k != in_.kslots()) {
      return Status::InvalidArgument("inputs: unsupported by cp" + Str(world) + ": shard " + Str(r) + " (tokens " +
                                     Str(sh.begin) + ".." + Str(sh.end) + ") is too short to select from");
    }
    PENUMBRA_RETURN_IF_ERROR(Prefill(s, sh.begin, sh.end));
    PENUMBRA_RETURN_IF_ERROR(ReadLandmarks(s.lm.get(), s.lm_cap, s.n_chunks, chunk0, &res));
    for (int h = 0; h < H; ++h) {
      for (int j = 0; j < s.outliers && outliers + j < in_.outliers; ++j) {
        res.outlier_ids[static_cast<size_t>(h) * in_.outliers + outliers + j] =
            chunk0 + s.outlier_ids[static_cast<size_t>(h) * s.outliers + j];
      }
    }
    chunk0 += s.n_chunks;
    outliers += s.outliers;
  }
  if (chunk0 != in_.n_chunks()) {
    return Status::Internal("cp: the shards hold " + Str(chunk0) + " chunks, the sequence " + Str(in_.n_chunks()));
  }
  // Each shard's outliers are its share of the sequence's (rounded): the
  // results' format holds the sequence's count.
  if (outliers != in_.outliers) {
    return Status::InvalidArgument("inputs: unsupported by cp" + Str(world) + ": the shards' outliers (" +
                                   Str(outliers) + ") are not the inputs' " + Str(in_.outliers) +
                                   " (each shard keeps its share, rounded)");
  }
  for (const Runtime::Shard& sh : bounds) res.shard_bounds.push_back(sh.begin);
  res.shard_bounds.push_back(S);
  std::vector<ShadowKvSeq*> ptrs;
  for (ShadowKvSeq& s : shards) ptrs.push_back(&s);
  PENUMBRA_RETURN_IF_ERROR(DecodeShards(ptrs, group, &res));
  return res;
}

Status CheckRun::DecodeOne(ShadowKvSeq& seq, CheckResults* res) {
  Backend& b = b_;
  const int H = in_.hkv, d = in_.d, hq = in_.hq, K = seq.kslots, n_chunks = seq.n_chunks;
  const size_t es = es_;
  const int64_t S = in_.seq;
  // ---- BeginDecodeStep, DecodeAttention, Select: through the policy's own
  // decode step (worker/engine/shadowkv/decode_step.h), which builds the
  // pointer tables and ints and every kernel's arguments from the sequence.
  // The sequence is closed (a context-parallel shard's setting): the new
  // token's K/V go to the row after the local rows and attention never reads
  // it, as the reference appends no token.
  seq.closed = true;
  ShadowKvDecodeStep decode(*lay_, b);
  const int64_t sstride = n_chunks + 1;
  PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer score_buf, b.Allocate(static_cast<size_t>(H) * sstride * sizeof(float)));
  PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer qkv1, b.Allocate(static_cast<size_t>(hq + 2 * H) * d * sizeof(float)));
  PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer pos1, b.Allocate(sizeof(int32_t)));
  PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer q_scratch, b.Allocate(static_cast<size_t>(hq) * d * es));
  PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer out_buf, b.Allocate(static_cast<size_t>(hq) * d * es));
  std::vector<float> qkv_host(static_cast<size_t>(hq + 2 * H) * d, 0.0f);
  std::vector<float> score_host(static_cast<size_t>(H) * sstride);
  std::vector<int32_t> sel_host(static_cast<size_t>(H) * K), slot_host(static_cast<size_t>(H) * K);
  std::vector<char> out_raw(static_cast<size_t>(hq) * d * es);
  for (int step = 0; step < in_.steps; ++step) {
    PENUMBRA_RETURN_IF_ERROR(decode.Begin({&seq}));
    // ---- DecodeAttention: RoPE of the query at position S + step.
    std::copy_n(in_.q.data() + static_cast<size_t>(step) * hq * d, static_cast<size_t>(hq) * d, qkv_host.data());
    const int32_t position = static_cast<int32_t>(S + step);
    PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(qkv1.get(), qkv_host.data(), qkv_host.size() * sizeof(float)));
    PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(pos1.get(), &position, sizeof(position)));
    const RopeStoreOp rs = decode.RopeStoreOf(0, 0, 1, qkv1.as<float>(), pos1.as<int32_t>(), q_scratch.get());
    b.RopeStore(rs);

    // ---- The scores alone, for the comparison (the fused selection below
    // may use its score rows as scratch or not write them).
    kn::ShadowkvScoreArgs only = decode.ScoreArgsOf(0, 0, 1, rs.q_out);
    only.scores = score_buf.as<float>();
    only.score_stride = sstride;
    only.select_k = 0;
    only.selection = nullptr;
    only.selection_stride = 0;
    PENUMBRA_RETURN_IF_ERROR(b.ShadowkvScore(only));

    // ---- Select, as the policy's: scores + top-k + slot update, then the
    // misses' values (zero copy) and keys.
    const kn::ShadowkvScoreArgs sc = decode.ScoreArgsOf(0, 0, 1, rs.q_out);
    PENUMBRA_RETURN_IF_ERROR(
        b.ShadowkvScoreAndSlotUpdate(sc, decode.SlotUpdateOf(0, 0, 1, sc.selection, sc.selection_stride)));
    b.ForkSide();
    b.ShadowkvFetchV(decode.FetchVOf(0, 0, 1), /*staged=*/false);
    b.ShadowkvRebuildK(decode.RebuildKOf(0, 0, 1));
    b.JoinSide();

    // ---- Attention over outliers + slots + local rows (no appended token).
    PENUMBRA_RETURN_IF_ERROR(
        b.DecodeAttention(decode.AttentionOf(0, 0, 1, rs.q_out, out_buf.get(), nullptr, /*mask_slots=*/false)));

    // ---- Results of the step.
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(score_host.data(), score_buf.get(), score_host.size() * sizeof(float)));
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(sel_host.data(), sc.selection, sel_host.size() * sizeof(int32_t)));
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(slot_host.data(), seq.slots.get(), slot_host.size() * sizeof(int32_t)));
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(out_raw.data(), out_buf.get(), out_raw.size()));
    for (int h = 0; h < H; ++h) {
      std::copy_n(score_host.data() + static_cast<size_t>(h) * sstride, n_chunks,
                  res->scores.data() + (static_cast<size_t>(step) * H + h) * n_chunks);
      std::vector<int32_t> s(sel_host.begin() + static_cast<size_t>(h) * K,
                             sel_host.begin() + static_cast<size_t>(h + 1) * K);
      std::vector<int32_t> m(slot_host.begin() + static_cast<size_t>(h) * K,
                             slot_host.begin() + static_cast<size_t>(h + 1) * K);
      std::sort(s.begin(), s.end());
      std::sort(m.begin(), m.end());
      for (int j = 0; j < K; ++j) {
        if (s[j] < 0 || s[j] >= n_chunks || (j > 0 && s[j] == s[j - 1])) {
          return Status::Internal("step " + Str(step) + " head " + Str(h) + ": top-k returned chunk id " + Str(s[j]));
        }
      }
      if (s != m) {
        return Status::Internal("step " + Str(step) + " head " + Str(h) +
                                ": the slot map does not hold the selection after ShadowkvSlotUpdate");
      }
      std::copy(s.begin(), s.end(), res->selected.begin() + (static_cast<size_t>(step) * H + h) * K);
    }
    ConvertToF32(out_raw.data(), act_, res->out.data() + static_cast<size_t>(step) * hq * d,
                 static_cast<size_t>(hq) * d);
  }
  return Status::OK();
}

Status CheckRun::DecodeShards(const std::vector<ShadowKvSeq*>& shards, LockstepGroup& group, CheckResults* res) {
  Backend& b = b_;
  const int W = static_cast<int>(shards.size()), H = in_.hkv, d = in_.d, hq = in_.hq, K = in_.kslots();
  const size_t es = es_;
  const int64_t S = in_.seq;
  // Per rank: what its policy holds for the step (decode step, exchange)
  // and what its runtime holds (the query, the attention part sent to the
  // merge and the parts received).
  struct Rank {
    std::unique_ptr<ShadowKvDecodeStep> step;
    std::unique_ptr<ShadowKvShardExchange> x;
    DeviceBuffer score, qkv, pos, q, part, parts;
    int chunk0 = 0;
  };
  const size_t out_bytes = static_cast<size_t>(hq) * d * es;
  // The runtime's part: the output rows then their log-sum-exps (d even: the
  // floats stay aligned), one all-gather per layer.
  const size_t part_bytes = out_bytes + static_cast<size_t>(hq) * sizeof(float);
  std::vector<Rank> ranks(static_cast<size_t>(W));
  int chunk0 = 0;
  for (int r = 0; r < W; ++r) {
    Rank& k = ranks[static_cast<size_t>(r)];
    ShadowKvSeq& s = *shards[static_cast<size_t>(r)];
    // As in DecodeOne: no decode token is attended (the last shard, open in
    // production, is closed here too).
    s.closed = true;
    k.step = std::make_unique<ShadowKvDecodeStep>(*lay_, b);
    k.x = std::make_unique<ShadowKvShardExchange>(ctx_, b);
    k.chunk0 = chunk0;
    chunk0 += s.n_chunks;
    PENUMBRA_ASSIGN_OR_RETURN(k.score, b.Allocate(static_cast<size_t>(H) * (s.n_chunks + 1) * sizeof(float)));
    PENUMBRA_ASSIGN_OR_RETURN(k.qkv, b.Allocate(static_cast<size_t>(hq + 2 * H) * d * sizeof(float)));
    PENUMBRA_ASSIGN_OR_RETURN(k.pos, b.Allocate(sizeof(int32_t)));
    PENUMBRA_ASSIGN_OR_RETURN(k.q, b.Allocate(out_bytes));
    PENUMBRA_ASSIGN_OR_RETURN(k.part, b.Allocate(part_bytes));
    PENUMBRA_ASSIGN_OR_RETURN(k.parts, b.Allocate(part_bytes * W));
  }
  PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer out_buf, b.Allocate(out_bytes));
  std::vector<float> qkv_host(static_cast<size_t>(hq + 2 * H) * d, 0.0f);
  std::vector<std::vector<int32_t>> chosen(static_cast<size_t>(H));
  std::vector<char> out_raw(out_bytes);
  std::vector<const void*> q(static_cast<size_t>(W));
  for (int step = 0; step < in_.steps; ++step) {
    std::copy_n(in_.q.data() + static_cast<size_t>(step) * hq * d, static_cast<size_t>(hq) * d, qkv_host.data());
    const int32_t position = static_cast<int32_t>(S + step);
    // ---- BeginDecodeStep on every rank: tables, the exchange's buffers.
    for (int r = 0; r < W; ++r) {
      Rank& k = ranks[static_cast<size_t>(r)];
      PENUMBRA_RETURN_IF_ERROR(k.step->Begin({shards[static_cast<size_t>(r)]}));
      Collective* g = ShadowKvShardExchange::GroupOf(k.step->seqs());
      if (g != &group.rank(r)) return Status::Internal("cp: rank " + Str(r) + "'s step has no exchange group");
      PENUMBRA_RETURN_IF_ERROR(k.x->Prepare(g, k.step->seqs()));
      PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(k.qkv.get(), qkv_host.data(), qkv_host.size() * sizeof(float)));
      PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(k.pos.get(), &position, sizeof(position)));
    }
    // ---- DecodeAttentionGlobal, phase by phase on every rank (lock step).
    // 1. the query's RoPE; each shard's softmax statistics of its chunks.
    //    Each rank's score workspace is its own (workspace_part = rank): on
    //    the GPU the second call reuses the first's logits.
    for (int r = 0; r < W; ++r) {
      Rank& k = ranks[static_cast<size_t>(r)];
      const RopeStoreOp rs = k.step->RopeStoreOf(0, 0, 1, k.qkv.as<float>(), k.pos.as<int32_t>(), k.q.get());
      b.RopeStore(rs);
      q[static_cast<size_t>(r)] = rs.q_out;
      kn::ShadowkvScoreArgs sc = k.step->ScoreArgsOf(0, 0, 1, rs.q_out);
      sc.stats_out = k.x->stats_send();
      sc.workspace_part = r;
      PENUMBRA_RETURN_IF_ERROR(b.ShadowkvScore(sc));
    }
    // 2. all-gather of the statistics.
    for (int r = 0; r < W; ++r) PENUMBRA_RETURN_IF_ERROR(ranks[static_cast<size_t>(r)].x->AllGatherStats());
    // 3. each shard's scores normalized over the whole sequence: alone (for
    //    the comparison), then its proposals with their scores.
    for (int r = 0; r < W; ++r) {
      Rank& k = ranks[static_cast<size_t>(r)];
      const ShadowKvSeq& s = *shards[static_cast<size_t>(r)];
      kn::ShadowkvScoreArgs sc = k.step->ScoreArgsOf(0, 0, 1, q[static_cast<size_t>(r)]);
      sc.stats_in = k.x->stats_recv();
      sc.stats_parts = W;
      sc.stats_part_stride = static_cast<int64_t>(k.x->stats());
      sc.workspace_part = r;
      kn::ShadowkvScoreArgs only = sc;
      only.scores = k.score.as<float>();
      only.score_stride = s.n_chunks + 1;
      only.select_k = 0;
      only.selection = nullptr;
      only.selection_stride = 0;
      PENUMBRA_RETURN_IF_ERROR(b.ShadowkvScore(only));
      sc.selection = k.x->proposals();
      sc.selection_stride = k.x->width();
      sc.selection_scores = k.x->cand_send();
      PENUMBRA_RETURN_IF_ERROR(b.ShadowkvScore(sc));
    }
    // 4. all-gather of the proposals' scores.
    for (int r = 0; r < W; ++r) PENUMBRA_RETURN_IF_ERROR(ranks[static_cast<size_t>(r)].x->AllGatherCandidates());
    // 5. the global top-k (the same on every rank), each rank's winners into
    //    its slots, the misses' values and keys, attention over outliers +
    //    live slots + local rows with its log-sum-exp.
    for (int r = 0; r < W; ++r) {
      Rank& k = ranks[static_cast<size_t>(r)];
      const ShadowKvSeq& s = *shards[static_cast<size_t>(r)];
      ShadowKvShardExchange& x = *k.x;
      kn::ShadowkvGlobalSelectArgs gs;
      gs.candidates = x.cand_recv();
      gs.parts = W;
      gs.rank = r;
      gs.part_stride = static_cast<int64_t>(x.cand());
      gs.rows = H;
      gs.cand_stride = x.width();
      gs.k = s.global_k;
      gs.proposals = x.proposals();
      gs.winners = x.winners();
      gs.selection = x.selection();
      gs.selection_stride = x.width();
      gs.selection_len = s.kslots;
      b.ShadowkvGlobalSelectAndSlotUpdate(gs, k.step->SlotUpdateOf(0, 0, 1, x.selection(), x.width()));
      b.ForkSide();
      b.ShadowkvFetchV(k.step->FetchVOf(0, 0, 1), /*staged=*/false);
      b.ShadowkvRebuildK(k.step->RebuildKOf(0, 0, 1));
      b.JoinSide();
      float* lse = reinterpret_cast<float*>(k.part.as<char>() + out_bytes);
      PENUMBRA_RETURN_IF_ERROR(b.DecodeAttention(
          k.step->AttentionOf(0, 0, 1, q[static_cast<size_t>(r)], k.part.get(), lse, /*mask_slots=*/true)));
    }
    // ---- The runtime's MergeRanks: the parts all-gathered, merged by
    // log-sum-exp (every rank gets the same; rank 0's is read).
    for (int r = 0; r < W; ++r) {
      Rank& k = ranks[static_cast<size_t>(r)];
      PENUMBRA_RETURN_IF_ERROR(group.rank(r).AllGather(k.part.get(), k.parts.get(), part_bytes));
    }
    Backend::MergeParts m;
    m.x = ranks[0].parts.get();
    m.x_part_stride = static_cast<int64_t>(part_bytes / es);
    m.lse = reinterpret_cast<const float*>(ranks[0].parts.as<char>() + out_bytes);
    m.lse_part_stride = static_cast<int64_t>(part_bytes / sizeof(float));
    m.parts = W;
    m.rows = hq;
    m.d = d;
    m.out = out_buf.get();
    b.MergeAttentionParts(m);

    // ---- Results of the step, in the whole sequence's chunk numbering.
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    for (auto& c : chosen) c.clear();
    for (int r = 0; r < W; ++r) {
      Rank& k = ranks[static_cast<size_t>(r)];
      const ShadowKvSeq& s = *shards[static_cast<size_t>(r)];
      const int n = s.n_chunks, xk = k.x->width(), ks = s.kslots;
      std::vector<float> score(static_cast<size_t>(H) * (n + 1));
      std::vector<int32_t> sel(static_cast<size_t>(H) * xk), slots(static_cast<size_t>(H) * ks);
      PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(score.data(), k.score.get(), score.size() * sizeof(float)));
      PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(sel.data(), k.x->selection(), sel.size() * sizeof(int32_t)));
      PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(slots.data(), s.slots.get(), slots.size() * sizeof(int32_t)));
      for (int h = 0; h < H; ++h) {
        std::copy_n(score.data() + static_cast<size_t>(h) * (n + 1), n,
                    res->scores.data() + (static_cast<size_t>(step) * H + h) * in_.n_chunks() + k.chunk0);
        std::vector<int32_t> won, held;
        for (int j = 0; j < ks; ++j) {
          const int32_t c = sel[static_cast<size_t>(h) * xk + j];
          if (c >= 0) won.push_back(c);
          const int32_t m2 = slots[static_cast<size_t>(h) * ks + j];
          if (m2 >= 0) held.push_back(m2);
        }
        std::sort(won.begin(), won.end());
        std::sort(held.begin(), held.end());
        if (won != held) {
          return Status::Internal("step " + Str(step) + " rank " + Str(r) + " head " + Str(h) +
                                  ": the slot map does not hold the rank's winners after the global selection");
        }
        for (int32_t c : won) {
          if (c >= n) {
            return Status::Internal("step " + Str(step) + " rank " + Str(r) + " head " + Str(h) +
                                    ": the global selection returned chunk id " + Str(c));
          }
          chosen[static_cast<size_t>(h)].push_back(k.chunk0 + c);
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      std::vector<int32_t>& c = chosen[static_cast<size_t>(h)];
      std::sort(c.begin(), c.end());
      if (static_cast<int>(c.size()) != K || std::adjacent_find(c.begin(), c.end()) != c.end()) {
        return Status::Internal("step " + Str(step) + " head " + Str(h) + ": the ranks won " + Str(c.size()) +
                                " chunks, want the sequence's budget of " + Str(K));
      }
      std::copy(c.begin(), c.end(), res->selected.begin() + (static_cast<size_t>(step) * H + h) * K);
    }
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(out_raw.data(), out_buf.get(), out_raw.size()));
    ConvertToF32(out_raw.data(), act_, res->out.data() + static_cast<size_t>(step) * hq * d,
                 static_cast<size_t>(hq) * d);
  }
  return Status::OK();
}

}  // namespace

const std::vector<std::string>& CheckModes() {
  static const std::vector<std::string> modes = {"direct", "attached", "cp2"};
  return modes;
}

Status ValidateMode(const std::string& mode) {
  for (const std::string& m : CheckModes()) {
    if (m == mode) return Status::OK();
  }
  return Status::InvalidArgument("unknown check mode '" + mode + "' (direct, attached or cp2)");
}

Result<CheckResults> RunShadowkvCheck(const CheckInputs& in, Backend& b, const std::string& mode) {
  PENUMBRA_RETURN_IF_ERROR(ValidateMode(mode));
  CheckRun run(in, b);
  PENUMBRA_RETURN_IF_ERROR(run.Init());
  if (mode == "attached") return run.Attached();
  if (mode == "cp2") return run.ContextParallel(2);
  return run.Direct();
}

// --------------------------------------------------------------- writing

Status WriteSafetensors(const std::string& path, const std::vector<OutTensor>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = m;
  }
  size_t offset = 0;
  std::vector<size_t> sizes;
  for (const OutTensor& t : tensors) {
    std::string dt;
    switch (t.dtype) {
      case DType::kF32:
        dt = "F32";
        break;
      case DType::kF16:
        dt = "F16";
        break;
      case DType::kBF16:
        dt = "BF16";
        break;
      case DType::kI32:
        dt = "I32";
        break;
      case DType::kI64:
        dt = "I64";
        break;
      default:
        return Status::InvalidArgument("safetensors: no dtype name for tensor '" + t.name + "'");
    }
    size_t numel = 1;
    for (int64_t s : t.shape) {
      if (s < 0) return Status::InvalidArgument("safetensors: negative dimension in tensor '" + t.name + "'");
      numel *= static_cast<size_t>(s);
    }
    const size_t bytes = numel * DTypeSize(t.dtype);
    header[t.name] = {{"dtype", dt}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    sizes.push_back(bytes);
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t n = text.size();
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));

  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return Status::IOError("cannot create " + tmp + ": " + std::strerror(errno));
  bool ok = std::fwrite(len, 1, 8, f) == 8 && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  for (size_t i = 0; ok && i < tensors.size(); ++i) {
    ok = sizes[i] == 0 || std::fwrite(tensors[i].data, 1, sizes[i], f) == sizes[i];
  }
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = std::strerror(errno);
    std::remove(tmp.c_str());
    return Status::IOError("cannot write " + path + ": " + err);
  }
  return Status::OK();
}

Status WriteResults(const CheckResults& r, const std::string& path) {
  const int64_t H = r.hkv, n = r.n_chunks, d = r.d, steps = r.steps;
  std::vector<OutTensor> t = {
      {"landmarks", DType::kF32, {H, n, d}, r.landmarks.data()},
      {"outliers", DType::kI32, {H, r.outliers}, r.outlier_ids.data()},
      {"selected", DType::kI32, {steps, H, r.kslots}, r.selected.data()},
      {"out", DType::kF32, {steps, r.hq, d}, r.out.data()},
      {"scores", DType::kF32, {steps, H, n}, r.scores.data()},
  };
  std::map<std::string, std::string> meta = {
      {"format", kOutputsFormat},
      {"dtype", r.dtype == DType::kBF16 ? "bf16" : "f32"},
      {"mode", r.mode},
  };
  if (!r.shard_bounds.empty()) {
    std::string b;
    for (int64_t x : r.shard_bounds) b += (b.empty() ? "" : ",") + Str(x);
    meta["shards"] = b;
  }
  return WriteSafetensors(path, t, meta);
}

}  // namespace penumbra::shadowkv_check
