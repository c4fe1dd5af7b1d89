// The engine side of the ShadowKV reference check.
//
// RunShadowkvCheck runs the policy's own ShadowKV objects
// (worker/engine/shadowkv/) on one layer of one sequence:
//   ShadowKvLayout::Shape            -> geometry (token_cap, chunk_cap,
//                                       local_cap, att_cap, O, kslots), checked
//                                       against the inputs'; the buffers as the
//                                       policy's AddSequence sizes them
//   ShadowKvCompressor               -> StoreTokens into its temporaries, then
//                                       Factor (LowRankFactor), Landmarks,
//                                       Outliers, as the policy's CompressPrompt
//   (here)                           -> the values to a value-store segment
//                                       and the tail into the local rows, as
//                                       the policy's CompressPrompt
//   ShadowKvDecodeStep               -> per step: Begin (the pointer tables
//                                       and ints), RopeStoreOf, ScoreArgsOf +
//                                       SlotUpdateOf (ShadowkvScoreAndSlotUpdate,
//                                       as the policy's Select), ForkSide,
//                                       FetchVOf (zero copy), RebuildKOf,
//                                       JoinSide, AttentionOf
// Adaptations to the reference's setting, made here and not in the policy:
//  * no token is appended during decode: the sequence is closed (as a
//    context-parallel shard that is not the last), so RopeStore's K/V go to
//    the row after the local rows, the attention length is
//    (O + kslots) * C + tail (no + 1), and FinishDecodeStep's local-row
//    growth / CompressOldest never runs;
//  * the whole prompt is one layer's prefill (the layer's full prefill
//    attention is skipped: the check does not use its output);
//  * one landmark per chunk in the model's dtype (landmarks_per_chunk 1,
//    landmark_format model), what the reference computes;
//  * the scores are also computed alone (ShadowkvScore without a selection,
//    into a buffer of their own) to be compared: the fused selection may not
//    write them.
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

#include <nlohmann/json.hpp>

#include "storage/dram_value_store.h"
#include "worker/engine/backend_host_allocator.h"
#include "worker/engine/shadowkv/compressor.h"
#include "worker/engine/shadowkv/decode_step.h"
#include "worker/engine/shadowkv/layout.h"
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

Result<CheckResults> RunShadowkvCheck(const CheckInputs& in, Backend& b) {
  PENUMBRA_RETURN_IF_ERROR(ValidateInputs(in));
  const DType act = b.act_dtype();
  const size_t es = DTypeSize(act);
  const int H = in.hkv, d = in.d, hq = in.hq, D = H * d, C = in.chunk, r = in.rank, W = in.local_window;
  const int64_t S = in.seq;

  // ---- AddSequence: options, geometry and buffers.
  ShadowKvOptions o;
  o.rank = r;
  o.chunk_size = C;
  o.budget_tokens = static_cast<int64_t>(in.kslots()) * C;
  o.outlier_chunks = in.outliers;
  o.local_window = W;
  o.min_prompt_tokens = 0;
  // The reference's landmarks: one per chunk, in the model's dtype.
  o.landmarks_per_chunk = 1;
  o.landmark_format = "model";
  PENUMBRA_RETURN_IF_ERROR(ValidateShadowKvOptions(o, H, d));
  auto alloc = [&](DeviceBuffer* buf, size_t bytes) -> Status {
    PENUMBRA_ASSIGN_OR_RETURN(*buf, b.Allocate(bytes));
    return Status::OK();
  };
  DeviceBuffer inv_freq;
  PENUMBRA_RETURN_IF_ERROR(alloc(&inv_freq, in.inv_freq.size() * sizeof(float)));
  PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(inv_freq.get(), in.inv_freq.data(), in.inv_freq.size() * sizeof(float)));
  // The policy's geometry (ShadowKvLayout::Shape) of one layer and one
  // sequence of the prompt and the steps.
  PolicyContext ctx;
  ctx.backend = &b;
  ctx.num_layers = 1;
  ctx.hq = hq;
  ctx.hkv = H;
  ctx.head_dim = d;
  ctx.inv_freq = inv_freq.as<float>();
  ctx.scale = in.scale;
  const ShadowKvLayout layout(ctx, o);
  SequenceSpec spec;
  spec.prompt_len = S;
  spec.max_new_tokens = in.steps;
  ShadowKvSeq seq;
  layout.Shape(spec, &seq);
  if (!seq.sparse || seq.outliers != in.outliers || seq.kslots != in.kslots()) {
    return Status::Internal("policy geometry (sparse " + Str(seq.sparse) + ", outliers " + Str(seq.outliers) +
                            ", kslots " + Str(seq.kslots) + ") differs from the inputs'");
  }
  const int O = seq.outliers, K = seq.kslots;
  const int chunk_cap = seq.chunk_cap;
  const int n_chunks = static_cast<int>((S - W) / C);
  // The policy's AddSequence for one layer (no attached prefix): every A row
  // and landmark record held by the sequence.
  seq.a_rows = seq.token_cap;
  seq.lm_cap = seq.chunk_cap;
  PENUMBRA_RETURN_IF_ERROR(alloc(&seq.att_k, layout.AttLayer(seq) * es));
  PENUMBRA_RETURN_IF_ERROR(alloc(&seq.att_v, layout.AttLayer(seq) * es));
  PENUMBRA_RETURN_IF_ERROR(alloc(&seq.a, static_cast<size_t>(seq.a_rows) * r * es));
  PENUMBRA_RETURN_IF_ERROR(alloc(&seq.b, static_cast<size_t>(H) * r * d * es));
  PENUMBRA_RETURN_IF_ERROR(alloc(&seq.p, static_cast<size_t>(D) * r * sizeof(float)));
  PENUMBRA_RETURN_IF_ERROR(alloc(&seq.lm, static_cast<size_t>(H) * seq.lm_cap * layout.lm_rec_bytes()));
  PENUMBRA_RETURN_IF_ERROR(alloc(&seq.excl, static_cast<size_t>(H) * chunk_cap));
  PENUMBRA_RETURN_IF_ERROR(alloc(&seq.slots, static_cast<size_t>(H) * K * sizeof(int32_t)));
  PENUMBRA_RETURN_IF_ERROR(alloc(&seq.prek, static_cast<size_t>(seq.local_cap) * D * sizeof(float)));
  PENUMBRA_RETURN_IF_ERROR(b.Memset(seq.excl.get(), 0, seq.excl.bytes()));
  PENUMBRA_RETURN_IF_ERROR(b.Memset(seq.slots.get(), 0xff, seq.slots.bytes()));
  // Not in the policy: rows attention never reads hold zeros instead of garbage.
  PENUMBRA_RETURN_IF_ERROR(b.Memset(seq.att_k.get(), 0, seq.att_k.bytes()));
  PENUMBRA_RETURN_IF_ERROR(b.Memset(seq.att_v.get(), 0, seq.att_v.bytes()));
  BackendHostAllocator host_alloc(&b);
  storage::DramValueStore store(&host_alloc, storage::DramValueStoreOptions{});
  storage::SegmentLayout lay{1, H, chunk_cap, C, d, act};
  PENUMBRA_ASSIGN_OR_RETURN(seq.segment, store.CreateSegment(lay));
  PENUMBRA_ASSIGN_OR_RETURN(const void* store_host, store.LayerBase(seq.segment, 0));
  seq.store_host.assign(1, store_host);
  seq.store_dev.assign(1, b.DeviceAddressOfHost(store_host));

  // ---- StoreTokens over the prompt (the compressor's): exact post-RoPE K, V
  // (act dtype) into the temporaries [hkv][tmp_cap][d], f32 pre-RoPE keys
  // [tmp_cap][hkv*d].
  ShadowKvCompressor comp(layout, b);
  PENUMBRA_RETURN_IF_ERROR(comp.EnsureTemp(seq.token_cap));
  const int64_t tstride = comp.tmp_cap() * d;
  {
    const int tile = static_cast<int>(std::min<int64_t>(S, 4096));
    const int64_t qkv_row = static_cast<int64_t>(hq + 2 * H) * d;
    DeviceBuffer qkv, q_scratch, pos;
    PENUMBRA_RETURN_IF_ERROR(alloc(&qkv, static_cast<size_t>(tile) * qkv_row * sizeof(float)));
    PENUMBRA_RETURN_IF_ERROR(alloc(&q_scratch, static_cast<size_t>(tile) * hq * d * es));
    PENUMBRA_RETURN_IF_ERROR(alloc(&pos, static_cast<size_t>(tile) * sizeof(int32_t)));
    std::vector<float> host(static_cast<size_t>(tile) * qkv_row);
    std::vector<int32_t> p(tile);
    for (int64_t start = 0; start < S; start += tile) {
      const int n = static_cast<int>(std::min<int64_t>(tile, S - start));
      std::fill(host.begin(), host.end(), 0.0f);  // the prompt's queries are not used
      for (int i = 0; i < n; ++i) {
        const int64_t t = start + i;
        float* rw = host.data() + static_cast<size_t>(i) * qkv_row;
        for (int h = 0; h < H; ++h) {
          const size_t src = (static_cast<size_t>(h) * S + t) * d;
          std::memcpy(rw + static_cast<size_t>(hq + h) * d, in.k_pre.data() + src, d * sizeof(float));
          std::memcpy(rw + static_cast<size_t>(hq + H + h) * d, in.v.data() + src, d * sizeof(float));
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
  PENUMBRA_RETURN_IF_ERROR(comp.Factor(seq, 0, S));
  comp.Landmarks(seq, 0, n_chunks);
  PENUMBRA_RETURN_IF_ERROR(comp.Outliers(seq, 0, n_chunks));
  // OffloadValues(s, layer, tmp_v, tmp_cap*d, 0, n_chunks, 0): every chunk's
  // values (outliers too) to the store through pinned staging.
  auto row = [&](const DeviceBuffer& buf, int64_t rw) { return static_cast<char*>(buf.get()) + rw * d * es; };
  {
    const size_t rowb = static_cast<size_t>(n_chunks) * C * d * es;
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer stage, b.AllocateHost(rowb * H));
    PENUMBRA_RETURN_IF_ERROR(b.Copy2D(stage.get(), rowb, comp.tmp_v().get(), tstride * es, rowb, H));
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    for (int h = 0; h < H; ++h) {
      PENUMBRA_RETURN_IF_ERROR(store.PutChunks(seq.segment, 0, h, 0, n_chunks, stage.as<char>() + h * rowb));
    }
  }
  // The tail becomes the local rows (exact K/V and pre-RoPE keys).
  const int64_t tail0 = static_cast<int64_t>(n_chunks) * C, tail = S - tail0;
  if (tail > seq.local_cap) return Status::Internal("local tail " + Str(tail) + " > local_cap " + Str(seq.local_cap));
  const int64_t local_row0 = layout.LocalRow0(seq), att_stride = seq.att_cap * d * es;
  PENUMBRA_RETURN_IF_ERROR(
      b.Copy2D(row(seq.att_k, local_row0), att_stride, row(comp.tmp_k(), tail0), tstride * es, tail * d * es, H));
  PENUMBRA_RETURN_IF_ERROR(
      b.Copy2D(row(seq.att_v, local_row0), att_stride, row(comp.tmp_v(), tail0), tstride * es, tail * d * es, H));
  PENUMBRA_RETURN_IF_ERROR(
      b.CopyDeviceToDevice(seq.prek.get(), comp.tmp_prek().as<float>() + tail0 * D, tail * D * sizeof(float)));
  PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
  seq.n_chunks = n_chunks;
  seq.local_count = tail;

  CheckResults res;
  res.hkv = H;
  res.n_chunks = n_chunks;
  res.d = d;
  res.hq = hq;
  res.steps = in.steps;
  res.outliers = O;
  res.kslots = K;
  res.dtype = act;
  {
    std::vector<char> raw(seq.lm.bytes());
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(raw.data(), seq.lm.get(), raw.size()));
    std::vector<float> all(static_cast<size_t>(H) * chunk_cap * d);
    ConvertToF32(raw.data(), act, all.data(), all.size());
    res.landmarks.resize(static_cast<size_t>(H) * n_chunks * d);
    for (int h = 0; h < H; ++h) {
      std::copy_n(all.data() + static_cast<size_t>(h) * chunk_cap * d, static_cast<size_t>(n_chunks) * d,
                  res.landmarks.data() + static_cast<size_t>(h) * n_chunks * d);
    }
    res.outlier_ids = seq.outlier_ids;  // the compressor's host copy (empty when O == 0)
    res.outlier_ids.resize(static_cast<size_t>(H) * O);
  }
  // The prefill temporaries are done with (the policy keeps them for reuse).
  comp.ReleaseTempIfLarge();

  // ---- BeginDecodeStep, DecodeAttention, Select: through the policy's own
  // decode step (worker/engine/shadowkv/decode_step.h), which builds the
  // pointer tables and ints and every kernel's arguments from the sequence.
  // The sequence is closed (a context-parallel shard's setting): the new
  // token's K/V go to the row after the local rows and attention never reads
  // it, as the reference appends no token.
  seq.closed = true;
  ShadowKvDecodeStep decode(layout, b);
  const int64_t sstride = n_chunks + 1;
  DeviceBuffer score_buf, qkv1, pos1, q_scratch, out_buf;
  PENUMBRA_RETURN_IF_ERROR(alloc(&score_buf, static_cast<size_t>(H) * sstride * sizeof(float)));
  PENUMBRA_RETURN_IF_ERROR(alloc(&qkv1, static_cast<size_t>(hq + 2 * H) * d * sizeof(float)));
  PENUMBRA_RETURN_IF_ERROR(alloc(&pos1, sizeof(int32_t)));
  PENUMBRA_RETURN_IF_ERROR(alloc(&q_scratch, static_cast<size_t>(hq) * d * es));
  PENUMBRA_RETURN_IF_ERROR(alloc(&out_buf, static_cast<size_t>(hq) * d * es));

  res.selected.resize(static_cast<size_t>(in.steps) * H * K);
  res.scores.resize(static_cast<size_t>(in.steps) * H * n_chunks);
  res.out.resize(static_cast<size_t>(in.steps) * hq * d);
  std::vector<float> qkv_host(static_cast<size_t>(hq + 2 * H) * d, 0.0f);
  std::vector<float> score_host(static_cast<size_t>(H) * sstride);
  std::vector<int32_t> sel_host(static_cast<size_t>(H) * K), slot_host(static_cast<size_t>(H) * K);
  std::vector<char> out_raw(static_cast<size_t>(hq) * d * es);
  for (int step = 0; step < in.steps; ++step) {
    PENUMBRA_RETURN_IF_ERROR(decode.Begin({&seq}));
    // ---- DecodeAttention: RoPE of the query at position S + step.
    std::copy_n(in.q.data() + static_cast<size_t>(step) * hq * d, static_cast<size_t>(hq) * d, qkv_host.data());
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
                  res.scores.data() + (static_cast<size_t>(step) * H + h) * n_chunks);
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
      std::copy(s.begin(), s.end(), res.selected.begin() + (static_cast<size_t>(step) * H + h) * K);
    }
    ConvertToF32(out_raw.data(), act, res.out.data() + static_cast<size_t>(step) * hq * d, static_cast<size_t>(hq) * d);
  }
  PENUMBRA_RETURN_IF_ERROR(store.DropSegment(seq.segment));
  return res;
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
  };
  return WriteSafetensors(path, t, meta);
}

}  // namespace penumbra::shadowkv_check
