// The engine side of the ShadowKV reference check.
//
// RunShadowkvCheck composes the backend's ShadowKV ops the way
// worker/engine/shadowkv_policy.cc does; the policy's steps are methods of a
// class private to that file, so they are mirrored here with the same
// layouts, arguments and order:
//   ShadowKvPolicy::AddSequence      -> geometry (token_cap, chunk_cap,
//                                       local_cap, att_cap, O, kslots) and the
//                                       per-sequence buffers, value store segment
//   ShadowKvPolicy::StoreTokens      -> prefill RopeStore into the exact K/V
//                                       temporaries + f32 pre-RoPE keys
//   ShadowKvPolicy::CompressPrompt   -> LowRankFactor, ChunkLandmarks,
//                                       SelectOutlierChunks, GatherOutliers,
//                                       OffloadValues, local rows copy
//   ShadowKvPolicy::OffloadValues    -> Copy2D to pinned staging, PutChunks
//   ShadowKvPolicy::BeginDecodeStep  -> the per-layer pointer table + lengths,
//                                       n_chunks blob (kTables = 10 layout)
//   ShadowKvPolicy::DecodeAttention  -> RopeStore of the query, Select, DecodeAttention
//   ShadowKvPolicy::Select           -> ShadowkvScore, TopK, ShadowkvSlotUpdate,
//                                       ForkSide, ShadowkvFetchV (zero copy),
//                                       ShadowkvRebuildK, JoinSide
// Adaptations to the reference's setting, made here and not in the policy:
//  * no token is appended during decode: the query's K/V from RopeStore go to
//    a scratch row, the attention length is (O + kslots) * C + tail (no + 1),
//    and FinishDecodeStep's local-row growth / CompressOldest never runs;
//  * the whole prompt is one layer's prefill (the layer's full prefill
//    attention is skipped: the check does not use its output);
//  * O and kslots come from the inputs; AddSequence's formulas give the same
//    values under the README's constraints (checked below).
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
      return Status::InvalidArgument("inputs: tensor '" + name + "' shape " + ShapeToString(t->shape) + " is too large");
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
    return bad("empty tensors: hkv " + Str(H) + ", seq " + Str(S) + ", d " + Str(d) + ", hq " + Str(hq) +
               ", steps " + Str(steps));
  }
  if (d % 2 != 0) return bad("tensor 'k_pre': head dim " + Str(d) + " must be even");
  if (static_cast<int64_t>(in.k_pre.size()) != H * S * d) return bad("tensor 'k_pre' size != hkv*seq*d");
  if (static_cast<int64_t>(in.v.size()) != H * S * d) return bad("tensor 'v' must have shape " + Dims({H, S, d}));
  if (static_cast<int64_t>(in.q.size()) != steps * hq * d) return bad("tensor 'q' must have shape " + Dims({steps, hq, d}));
  if (static_cast<int64_t>(in.inv_freq.size()) != d / 2) return bad("tensor 'inv_freq' must have shape " + Dims({d / 2}));
  if (hq % H != 0) return bad("tensor 'q': hq " + Str(hq) + " is not a multiple of hkv " + Str(H));
  if (in.rank < 1 || in.rank > std::min<int64_t>(S, H * d)) {
    return bad("metadata 'rank' = " + Str(in.rank) + " not in [1, min(seq, hkv*d) = " +
               Str(std::min<int64_t>(S, H * d)) + "]");
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
    return Status::InvalidArgument("inputs: tensor 'v' has shape " + ShapeToString(vs) + ", want " +
                                   ShapeToString(ks) + " (as 'k_pre')");
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
    return Status::InvalidArgument("inputs: metadata 'steps' = " + Str(steps) + " but tensor 'q' has " +
                                   Str(in.steps) + " steps");
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
  PENUMBRA_RETURN_IF_ERROR(ValidateShadowKvOptions(o, H, d));
  const int64_t token_cap = S + in.steps;
  const int64_t prompt_chunks = (S - W) / C;
  const int outl = static_cast<int>(
      std::min<int64_t>(o.outlier_chunks, std::max<int64_t>(prompt_chunks - o.budget_tokens / C, 0)));
  const int K = static_cast<int>(std::min<int64_t>(o.budget_tokens / C, prompt_chunks - outl));
  if (outl != in.outliers || K != in.kslots()) {
    return Status::Internal("policy geometry (outliers " + Str(outl) + ", kslots " + Str(K) +
                            ") differs from the inputs'");
  }
  const int O = outl;
  const int64_t local_cap = W + 2 * C;
  const int chunk_cap = static_cast<int>((token_cap + C - 1) / C);
  const int64_t att_cap = static_cast<int64_t>(O + K) * C + local_cap;
  const int64_t local_row0 = static_cast<int64_t>(O + K) * C;
  const int n_chunks = static_cast<int>(prompt_chunks);

  auto alloc = [&](DeviceBuffer* buf, size_t bytes) -> Status {
    PENUMBRA_ASSIGN_OR_RETURN(*buf, b.Allocate(bytes));
    return Status::OK();
  };
  DeviceBuffer att_k, att_v, a_buf, b_buf, p_buf, lm, excl, slots;
  PENUMBRA_RETURN_IF_ERROR(alloc(&att_k, static_cast<size_t>(H) * att_cap * d * es));
  PENUMBRA_RETURN_IF_ERROR(alloc(&att_v, static_cast<size_t>(H) * att_cap * d * es));
  PENUMBRA_RETURN_IF_ERROR(alloc(&a_buf, static_cast<size_t>(token_cap) * r * es));
  PENUMBRA_RETURN_IF_ERROR(alloc(&b_buf, static_cast<size_t>(H) * r * d * es));
  PENUMBRA_RETURN_IF_ERROR(alloc(&p_buf, static_cast<size_t>(D) * r * sizeof(float)));
  PENUMBRA_RETURN_IF_ERROR(alloc(&lm, static_cast<size_t>(H) * chunk_cap * d * es));
  PENUMBRA_RETURN_IF_ERROR(alloc(&excl, static_cast<size_t>(H) * chunk_cap));
  PENUMBRA_RETURN_IF_ERROR(alloc(&slots, static_cast<size_t>(H) * K * sizeof(int32_t)));
  PENUMBRA_RETURN_IF_ERROR(b.Memset(excl.get(), 0, excl.bytes()));
  PENUMBRA_RETURN_IF_ERROR(b.Memset(slots.get(), 0xff, slots.bytes()));
  // Not in the policy: rows attention never reads hold zeros instead of garbage.
  PENUMBRA_RETURN_IF_ERROR(b.Memset(att_k.get(), 0, att_k.bytes()));
  PENUMBRA_RETURN_IF_ERROR(b.Memset(att_v.get(), 0, att_v.bytes()));
  BackendHostAllocator host_alloc(&b);
  storage::DramValueStore store(&host_alloc, storage::DramValueStoreOptions{});
  storage::SegmentLayout lay{1, H, chunk_cap, C, d, act};
  PENUMBRA_ASSIGN_OR_RETURN(storage::SegmentId segment, store.CreateSegment(lay));
  PENUMBRA_ASSIGN_OR_RETURN(const void* store_host, store.LayerBase(segment, 0));
  const void* store_dev = b.DeviceAddressOfHost(store_host);
  auto row = [&](const DeviceBuffer& buf, int64_t rw) { return static_cast<char*>(buf.get()) + rw * d * es; };

  // ---- StoreTokens over the prompt: exact post-RoPE K, V (act dtype) into
  // the temporaries [hkv][S][d], f32 pre-RoPE keys [S][hkv*d].
  DeviceBuffer tmp_k, tmp_v, tmp_prek, tmp_cos, tmp_outl, inv_freq;
  PENUMBRA_RETURN_IF_ERROR(alloc(&tmp_k, static_cast<size_t>(H) * S * d * es));
  PENUMBRA_RETURN_IF_ERROR(alloc(&tmp_v, static_cast<size_t>(H) * S * d * es));
  PENUMBRA_RETURN_IF_ERROR(alloc(&tmp_prek, static_cast<size_t>(S) * D * sizeof(float)));
  PENUMBRA_RETURN_IF_ERROR(alloc(&tmp_cos, static_cast<size_t>(H) * chunk_cap * sizeof(float)));
  PENUMBRA_RETURN_IF_ERROR(alloc(&tmp_outl, static_cast<size_t>(H) * (O + 1) * sizeof(int32_t)));
  PENUMBRA_RETURN_IF_ERROR(alloc(&inv_freq, in.inv_freq.size() * sizeof(float)));
  PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(inv_freq.get(), in.inv_freq.data(), in.inv_freq.size() * sizeof(float)));
  {
    const int tile = static_cast<int>(std::min<int64_t>(S, 4096));
    const int64_t qkv_row = static_cast<int64_t>(hq + 2 * H) * d;
    DeviceBuffer qkv, q_scratch, pos, ptrs;
    PENUMBRA_RETURN_IF_ERROR(alloc(&qkv, static_cast<size_t>(tile) * qkv_row * sizeof(float)));
    PENUMBRA_RETURN_IF_ERROR(alloc(&q_scratch, static_cast<size_t>(tile) * hq * d * es));
    PENUMBRA_RETURN_IF_ERROR(alloc(&pos, static_cast<size_t>(tile) * sizeof(int32_t)));
    PENUMBRA_RETURN_IF_ERROR(alloc(&ptrs, static_cast<size_t>(2) * tile * sizeof(void*)));
    std::vector<float> host(static_cast<size_t>(tile) * qkv_row);
    std::vector<int32_t> p(tile);
    std::vector<void*> kv_ptrs(2 * static_cast<size_t>(tile));
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
        kv_ptrs[i] = row(tmp_k, t);
        kv_ptrs[n + i] = row(tmp_v, t);
      }
      PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(qkv.get(), host.data(), static_cast<size_t>(n) * qkv_row * sizeof(float)));
      PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(pos.get(), p.data(), n * sizeof(int32_t)));
      PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(ptrs.get(), kv_ptrs.data(), 2 * static_cast<size_t>(n) * sizeof(void*)));
      RopeStoreOp rs;
      rs.qkv = qkv.as<float>();
      rs.positions = pos.as<int32_t>();
      rs.inv_freq = inv_freq.as<float>();
      rs.n = n;
      rs.hq = hq;
      rs.hkv = H;
      rs.d = d;
      rs.q_out = q_scratch.get();
      rs.k_dst = static_cast<void* const*>(ptrs.get());
      rs.v_dst = static_cast<void* const*>(ptrs.get()) + n;
      rs.head_stride = S * d;
      rs.pre_rope_k_out = tmp_prek.as<float>() + start * D;
      b.RopeStore(rs);
      // The host buffers are rewritten by the next tile.
      PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    }
  }

  // ---- CompressPrompt.
  kn::LowRankArgs lr;
  lr.keys = tmp_prek.get();
  lr.S = S;
  lr.hkv = H;
  lr.d = d;
  lr.rank = r;
  lr.a_out = a_buf.get();
  lr.b_out = b_buf.get();
  lr.proj_out = p_buf.as<float>();
  PENUMBRA_RETURN_IF_ERROR(b.LowRankFactor(lr));
  kn::ChunkLandmarksArgs cl;
  cl.k = tmp_k.get();
  cl.k_head_stride = S * d;
  cl.first_token = 0;
  cl.n_chunks = n_chunks;
  cl.chunk_tokens = C;
  cl.hkv = H;
  cl.d = d;
  cl.landmarks = lm.get();
  cl.landmark_head_stride = static_cast<int64_t>(chunk_cap) * d;
  cl.min_cos = tmp_cos.as<float>();
  cl.min_cos_head_stride = chunk_cap;
  b.ChunkLandmarks(cl);
  if (O > 0) {
    kn::SelectOutliersArgs so;
    so.min_cos = tmp_cos.as<float>();
    so.min_cos_head_stride = chunk_cap;
    so.hkv = H;
    so.n_chunks = n_chunks;
    so.num_outliers = O;
    so.out = tmp_outl.as<int32_t>();
    b.SelectOutlierChunks(so);
    kn::GatherOutliersArgs go;
    go.k = tmp_k.get();
    go.v = tmp_v.get();
    go.kv_head_stride = S * d;
    go.first_token = 0;
    go.chunk_tokens = C;
    go.hkv = H;
    go.d = d;
    go.n_chunks = n_chunks;
    go.outliers = tmp_outl.as<int32_t>();
    go.num_outliers = O;
    go.att_k = att_k.get();
    go.att_v = att_v.get();
    go.att_head_stride = att_cap * d;
    go.excluded = excl.as<uint8_t>();
    go.mask_head_stride = chunk_cap;
    b.GatherOutliers(go);
  }
  // OffloadValues(s, layer, tmp_v, S*d, 0, n_chunks, 0): every chunk's values
  // (outliers too) to the store through pinned staging.
  {
    const size_t rowb = static_cast<size_t>(n_chunks) * C * d * es;
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer stage, b.AllocateHost(rowb * H));
    PENUMBRA_RETURN_IF_ERROR(b.Copy2D(stage.get(), rowb, tmp_v.get(), S * d * es, rowb, H));
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    for (int h = 0; h < H; ++h) {
      PENUMBRA_RETURN_IF_ERROR(store.PutChunks(segment, 0, h, 0, n_chunks, stage.as<char>() + h * rowb));
    }
  }
  // The tail becomes the local rows.
  const int64_t tail0 = static_cast<int64_t>(n_chunks) * C, tail = S - tail0;
  if (tail > local_cap) return Status::Internal("local tail " + Str(tail) + " > local_cap " + Str(local_cap));
  PENUMBRA_RETURN_IF_ERROR(b.Copy2D(row(att_k, local_row0), att_cap * d * es, row(tmp_k, tail0), S * d * es,
                                    tail * d * es, H));
  PENUMBRA_RETURN_IF_ERROR(b.Copy2D(row(att_v, local_row0), att_cap * d * es, row(tmp_v, tail0), S * d * es,
                                    tail * d * es, H));
  PENUMBRA_RETURN_IF_ERROR(b.Synchronize());

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
    std::vector<char> raw(lm.bytes());
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(raw.data(), lm.get(), raw.size()));
    std::vector<float> all(static_cast<size_t>(H) * chunk_cap * d);
    ConvertToF32(raw.data(), act, all.data(), all.size());
    res.landmarks.resize(static_cast<size_t>(H) * n_chunks * d);
    for (int h = 0; h < H; ++h) {
      std::copy_n(all.data() + static_cast<size_t>(h) * chunk_cap * d, static_cast<size_t>(n_chunks) * d,
                  res.landmarks.data() + static_cast<size_t>(h) * n_chunks * d);
    }
    res.outlier_ids.resize(static_cast<size_t>(H) * O);
    if (O > 0) {
      PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(res.outlier_ids.data(), tmp_outl.get(), res.outlier_ids.size() * 4));
    }
  }
  // The prefill temporaries are done with (the policy keeps them for reuse).
  tmp_k.Reset();
  tmp_v.Reset();
  tmp_prek.Reset();

  // ---- BeginDecodeStep: the pointer table (kTables = 10 entries, batch 1)
  // and the ints (attention length, n_chunks). Entries 0/1 (where RopeStore
  // stores the new token's K/V) point at a scratch row instead of the next
  // local row: the reference appends no token.
  constexpr int kTables = 10;
  DeviceBuffer kv_dump, step_buf;
  PENUMBRA_RETURN_IF_ERROR(alloc(&kv_dump, static_cast<size_t>(2) * D * es));
  {
    std::vector<const void*> t(kTables);
    t[0] = kv_dump.get();
    t[1] = static_cast<char*>(kv_dump.get()) + static_cast<size_t>(D) * es;
    t[2] = att_k.get();
    t[3] = att_v.get();
    t[4] = lm.get();
    t[5] = excl.get();
    t[6] = slots.get();
    t[7] = a_buf.get();
    t[8] = b_buf.get();
    t[9] = store_dev;
    const int32_t ints[2] = {static_cast<int32_t>(local_row0 + tail), n_chunks};
    std::vector<uint8_t> blob(t.size() * sizeof(void*) + sizeof(ints));
    std::memcpy(blob.data(), t.data(), t.size() * sizeof(void*));
    std::memcpy(blob.data() + t.size() * sizeof(void*), ints, sizeof(ints));
    PENUMBRA_RETURN_IF_ERROR(alloc(&step_buf, blob.size()));
    PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(step_buf.get(), blob.data(), blob.size()));
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
  }
  void* const* tab = static_cast<void* const*>(step_buf.get());
  const int32_t* lengths = reinterpret_cast<const int32_t*>(tab + kTables);
  const int32_t* nchunks = lengths + 1;
  const int64_t sstride = n_chunks + 1;
  DeviceBuffer score_buf, miss_buf, qkv1, pos1, q_scratch, out_buf;
  PENUMBRA_RETURN_IF_ERROR(alloc(&score_buf, static_cast<size_t>(H) * sstride * sizeof(float)));
  PENUMBRA_RETURN_IF_ERROR(alloc(&miss_buf, (static_cast<size_t>(H) * K * 3 + H) * sizeof(int32_t)));
  PENUMBRA_RETURN_IF_ERROR(alloc(&qkv1, static_cast<size_t>(hq + 2 * H) * d * sizeof(float)));
  PENUMBRA_RETURN_IF_ERROR(alloc(&pos1, sizeof(int32_t)));
  PENUMBRA_RETURN_IF_ERROR(alloc(&q_scratch, static_cast<size_t>(hq) * d * es));
  PENUMBRA_RETURN_IF_ERROR(alloc(&out_buf, static_cast<size_t>(hq) * d * es));
  int32_t* sel = miss_buf.as<int32_t>();
  int32_t* mslot = sel + static_cast<size_t>(H) * K;
  int32_t* mchunk = mslot + static_cast<size_t>(H) * K;
  int32_t* mcount = mchunk + static_cast<size_t>(H) * K;

  res.selected.resize(static_cast<size_t>(in.steps) * H * K);
  res.scores.resize(static_cast<size_t>(in.steps) * H * n_chunks);
  res.out.resize(static_cast<size_t>(in.steps) * hq * d);
  std::vector<float> qkv_host(static_cast<size_t>(hq + 2 * H) * d, 0.0f);
  std::vector<float> score_host(static_cast<size_t>(H) * sstride);
  std::vector<int32_t> sel_host(static_cast<size_t>(H) * K), slot_host(static_cast<size_t>(H) * K);
  std::vector<char> out_raw(static_cast<size_t>(hq) * d * es);
  for (int step = 0; step < in.steps; ++step) {
    // ---- DecodeAttention: RoPE of the query at position S + step.
    std::copy_n(in.q.data() + static_cast<size_t>(step) * hq * d, static_cast<size_t>(hq) * d, qkv_host.data());
    const int32_t position = static_cast<int32_t>(S + step);
    PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(qkv1.get(), qkv_host.data(), qkv_host.size() * sizeof(float)));
    PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(pos1.get(), &position, sizeof(position)));
    RopeStoreOp rs;
    rs.qkv = qkv1.as<float>();
    rs.positions = pos1.as<int32_t>();
    rs.inv_freq = inv_freq.as<float>();
    rs.n = 1;
    rs.hq = hq;
    rs.hkv = H;
    rs.d = d;
    rs.q_out = q_scratch.get();
    rs.k_dst = tab + 0;
    rs.v_dst = tab + 1;
    rs.head_stride = d;  // the scratch row holds the hkv heads back to back
    rs.pre_rope_k_out = nullptr;
    b.RopeStore(rs);

    // ---- Select.
    kn::ShadowkvScoreArgs sc;
    sc.q = q_scratch.get();
    sc.landmarks = reinterpret_cast<const void* const*>(tab + 4);
    sc.excluded = reinterpret_cast<const uint8_t* const*>(tab + 5);
    sc.n_chunks = nchunks;
    sc.batch = 1;
    sc.hq = hq;
    sc.hkv = H;
    sc.d = d;
    sc.chunk_cap = chunk_cap;
    sc.max_chunks = n_chunks;
    sc.scale = in.scale;
    sc.scores = score_buf.as<float>();
    sc.score_stride = sstride;
    PENUMBRA_RETURN_IF_ERROR(b.ShadowkvScore(sc));
    kn::TopKArgs tk;
    tk.values = score_buf.as<float>();
    tk.stride = sstride;
    tk.rows = H;
    tk.counts = nchunks;
    tk.rows_per_count = H;
    tk.max_count = n_chunks;
    tk.k = K;
    tk.out = sel;
    tk.out_stride = K;
    b.TopK(tk);
    kn::ShadowkvSlotUpdateArgs su;
    su.selection = sel;
    su.selection_stride = K;
    su.slot_maps = reinterpret_cast<int32_t* const*>(tab + 6);
    su.miss_count = mcount;
    su.miss_slot = mslot;
    su.miss_chunk = mchunk;
    su.batch = 1;
    su.hkv = H;
    su.kslots = K;
    su.chunk_cap = chunk_cap;
    su.force_keep = -1.0f;
    b.ShadowkvSlotUpdate(su);
    b.ForkSide();
    kn::ShadowkvFetchVArgs fv;
    fv.value_store = reinterpret_cast<const void* const*>(tab + 9);
    fv.chunk_cap = chunk_cap;
    fv.miss_count = mcount;
    fv.miss_slot = mslot;
    fv.miss_chunk = mchunk;
    fv.miss_stride = K;
    fv.att_v = tab + 3;
    fv.att_head_stride = att_cap * d;
    fv.outlier_rows = O * C;
    fv.batch = 1;
    fv.hkv = H;
    fv.d = d;
    fv.chunk_size = C;
    fv.max_misses = K;
    b.ShadowkvFetchV(fv, /*staged=*/false);
    kn::ShadowkvRebuildKArgs rk;
    rk.a = reinterpret_cast<const void* const*>(tab + 7);
    rk.b = reinterpret_cast<const void* const*>(tab + 8);
    rk.inv_freq = inv_freq.as<float>();
    rk.miss_count = mcount;
    rk.miss_slot = mslot;
    rk.miss_chunk = mchunk;
    rk.miss_stride = K;
    rk.att_k = tab + 2;
    rk.att_head_stride = att_cap * d;
    rk.outlier_rows = O * C;
    rk.batch = 1;
    rk.hkv = H;
    rk.d = d;
    rk.r = r;
    rk.chunk_size = C;
    rk.max_misses = K;
    b.ShadowkvRebuildK(rk);
    b.JoinSide();

    // ---- Attention over outliers + slots + local rows (no appended token).
    DecodeAttentionOp at;
    at.q = q_scratch.get();
    at.k = reinterpret_cast<const void* const*>(tab + 2);
    at.v = reinterpret_cast<const void* const*>(tab + 3);
    at.lengths = lengths;
    at.out = out_buf.get();
    at.head_stride = att_cap * d;
    at.batch = 1;
    at.hq = hq;
    at.hkv = H;
    at.d = d;
    at.max_length = static_cast<int>(att_cap);
    at.scale = in.scale;
    PENUMBRA_RETURN_IF_ERROR(b.DecodeAttention(at));

    // ---- Results of the step.
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(score_host.data(), score_buf.get(), score_host.size() * sizeof(float)));
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(sel_host.data(), sel, sel_host.size() * sizeof(int32_t)));
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(slot_host.data(), slots.get(), slot_host.size() * sizeof(int32_t)));
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(out_raw.data(), out_buf.get(), out_raw.size()));
    for (int h = 0; h < H; ++h) {
      std::copy_n(score_host.data() + static_cast<size_t>(h) * sstride, n_chunks,
                  res.scores.data() + (static_cast<size_t>(step) * H + h) * n_chunks);
      std::vector<int32_t> s(sel_host.begin() + static_cast<size_t>(h) * K, sel_host.begin() + static_cast<size_t>(h + 1) * K);
      std::vector<int32_t> m(slot_host.begin() + static_cast<size_t>(h) * K, slot_host.begin() + static_cast<size_t>(h + 1) * K);
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
  PENUMBRA_RETURN_IF_ERROR(store.DropSegment(segment));
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
      case DType::kF32: dt = "F32"; break;
      case DType::kF16: dt = "F16"; break;
      case DType::kBF16: dt = "BF16"; break;
      case DType::kI32: dt = "I32"; break;
      case DType::kI64: dt = "I64"; break;
      default: return Status::InvalidArgument("safetensors: no dtype name for tensor '" + t.name + "'");
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
