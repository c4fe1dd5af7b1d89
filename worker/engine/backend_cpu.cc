// CpuBackend: f32 everywhere; GEMMs through OpenBLAS, other ops through the
// CPU references in kernels/cpu (the reference every CUDA kernel is checked
// against).
#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>

#include "kernels/cpu/lowrank.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/shadowkv_decode.h"
#include "kernels/cpu/shadowkv_prefill.h"
#include "kernels/cpu/spindlekv.h"
#include "kernels/value_format.h"
#include "worker/engine/backend.h"
#include "worker/engine/spindlekv_math.h"

namespace penumbra {
namespace {

namespace kc = kernels::cpu;

void FreeHost(void* p) { std::free(p); }

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const BackendOptions& o) : threads_(o.cpu_threads) {
    if (threads_ > 0) openblas_set_num_threads(threads_);
  }

  Device device() const override { return Device::kCPU; }
  DType act_dtype() const override { return DType::kF32; }
  std::string name() const override { return "cpu"; }

  Result<DeviceBuffer> Allocate(size_t bytes) override {
    void* p = nullptr;
    if (posix_memalign(&p, 64, bytes == 0 ? 64 : bytes) != 0) {
      return Status::ResourceExhausted("cpu: cannot allocate " + std::to_string(bytes) + " bytes");
    }
    return DeviceBuffer(p, bytes, &FreeHost);
  }
  Result<DeviceBuffer> AllocateHost(size_t bytes) override { return Allocate(bytes); }
  Status RegisterHost(void*, size_t) override { return Status::OK(); }
  void UnregisterHost(void*) override {}
  const void* DeviceAddressOfHost(const void* host) const override { return host; }
  Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return Status::OK();
  }
  Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return Status::OK();
  }
  Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) override {
    std::memmove(dst, src, bytes);
    return Status::OK();
  }
  Status Memset(void* dst, int value, size_t bytes) override {
    std::memset(dst, value, bytes);
    return Status::OK();
  }
  Status Synchronize() override { return Status::OK(); }
  size_t FreeMemoryBytes() const override {
    long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : 0;
  }

  void Embedding(const void* table, DType table_dtype, const int32_t* ids, int n, int dim, float* out) override {
    CHECK(table_dtype == DType::kF32) << "cpu backend keeps tables in f32";
    kc::Embedding(static_cast<const float*>(table), ids, n, dim, out);
  }
  void RmsNorm(const float* x, const void* w, DType w_dtype, int n, int dim, float eps, void* out,
               bool /*out_f32*/) override {
    CHECK(w_dtype == DType::kF32);
    kc::RmsNorm(x, static_cast<const float*>(w), n, dim, eps, static_cast<float*>(out));
  }
  void Linear(const void* x, const LinearWeight& w, int n, float* y, bool accumulate) override {
    CHECK(w.dtype == DType::kF32);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, w.out, w.in, 1.0f, static_cast<const float*>(x), w.in,
                static_cast<const float*>(w.w), w.in, accumulate ? 1.0f : 0.0f, y, w.out);
    if (w.bias) kc::AddBias(y, static_cast<const float*>(w.bias), n, w.out);
  }
  void RopeStore(const RopeStoreOp& op) override {
    kc::RopeStoreArgs a;
    a.qkv = op.qkv;
    a.positions = op.positions;
    a.inv_freq = op.inv_freq;
    a.n = op.n;
    a.hq = op.hq;
    a.hkv = op.hkv;
    a.d = op.d;
    a.q_out = static_cast<float*>(op.q_out);
    a.k_dst = reinterpret_cast<float* const*>(op.k_dst);
    a.v_dst = reinterpret_cast<float* const*>(op.v_dst);
    a.head_stride = op.head_stride;
    a.pre_rope_k_out = op.pre_rope_k_out;
    a.pre_rope_k_dst = op.pre_rope_k_dst;
    kc::RopeStore(a);
  }
  void SwiGLU(const float* gate_up, int n, int F, void* out) override {
    kc::SwiGLU(gate_up, n, F, static_cast<float*>(out));
  }
  void PrefillAttention(const PrefillAttentionOp& op) override {
    kc::PrefillAttentionArgs a;
    a.q = static_cast<const float*>(op.q);
    a.k = static_cast<const float*>(op.k);
    a.v = static_cast<const float*>(op.v);
    a.out = static_cast<float*>(op.out);
    a.lse = op.lse;
    a.head_stride = op.head_stride;
    a.q_start = op.q_start;
    a.nq = op.nq;
    a.hq = op.hq;
    a.hkv = op.hkv;
    a.d = op.d;
    a.scale = op.scale;
    kc::PrefillAttention(a);
  }
  Status DecodeAttention(const DecodeAttentionOp& op) override {
    kc::DecodeAttentionArgs a;
    a.q = static_cast<const float*>(op.q);
    a.k = reinterpret_cast<const float* const*>(op.k);
    a.v = reinterpret_cast<const float* const*>(op.v);
    a.lengths = op.lengths;
    a.out = static_cast<float*>(op.out);
    a.lse = op.lse;
    a.head_stride = op.head_stride;
    a.batch = op.batch;
    a.hq = op.hq;
    a.hkv = op.hkv;
    a.d = op.d;
    a.scale = op.scale;
    a.slot_maps = op.slot_maps;
    a.slot_row0 = op.slot_row0;
    a.slot_count = op.slot_count;
    a.slot_rows = op.slot_rows;
    a.slot_values = reinterpret_cast<const float* const*>(op.slot_values);
    a.slot_values_stride = op.slot_values_stride;
    a.slot_values_chunks = op.slot_values_chunks;
    kc::DecodeAttention(a);
    return Status::OK();
  }
  Status PrefixAttention(const PrefixAttentionOp& op) override {
    kc::PrefixAttentionArgs a;
    a.q = static_cast<const float*>(op.q);
    a.rows = op.rows;
    a.n = op.n;
    a.k = static_cast<const float*>(op.k);
    a.v = static_cast<const float*>(op.v);
    a.head_stride = op.head_stride;
    a.keys = op.keys;
    a.out = static_cast<float*>(op.out);
    a.own_lse = op.own_lse;
    a.lse_out = op.lse_out;
    a.hq = op.hq;
    a.hkv = op.hkv;
    a.d = op.d;
    a.scale = op.scale;
    kc::PrefixAttention(a);
    return Status::OK();
  }
  void MergeAttentionParts(const MergeParts& m) override {
    kc::MergeAttention(static_cast<const float*>(m.x), m.x_part_stride, m.lse, m.lse_part_stride, m.parts, m.rows, m.d,
                       static_cast<float*>(m.out), m.lse_out);
  }
  Status Sample(const float* logits, int rows, int vocab, const std::vector<SampleParams>& params,
                int32_t* out_host) override {
    for (int r = 0; r < rows; ++r) {
      kc::SamplingRow p{params[r].temperature, params[r].top_k, params[r].top_p, params[r].uniform};
      out_host[r] = kc::Sample(logits + static_cast<int64_t>(r) * vocab, vocab, p);
    }
    return Status::OK();
  }
  void Convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n) override {
    CHECK(dst_dtype == DType::kF32 || src_dtype == DType::kF32);
    if (dst_dtype == DType::kF32) {
      ConvertToF32(src, src_dtype, static_cast<float*>(dst), static_cast<size_t>(n));
    } else {
      ConvertFromF32(static_cast<const float*>(src), dst, dst_dtype, static_cast<size_t>(n));
    }
  }
  void FillRandomNormal(void* dst, DType dtype, int64_t n, float std, uint64_t seed) override {
    CHECK(dtype == DType::kF32);
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> dist(0.0f, std);
    float* p = static_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) p[i] = dist(rng);
  }

  Status Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height) override {
    for (size_t r = 0; r < height; ++r) {
      std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
    }
    return Status::OK();
  }

  Status LowRankFactor(kernels::LowRankArgs a) override {
    kc::LowRankArgs c;
    c.keys = static_cast<const float*>(a.keys);
    c.S = a.S;
    c.hkv = a.hkv;
    c.d = a.d;
    c.rank = a.rank;
    c.a_out = static_cast<float*>(a.a_out);
    c.b_out = static_cast<float*>(a.b_out);
    c.proj_out = a.proj_out;
    c.sigma_out = a.sigma_out;
    return kc::LowRankFactor(c);
  }
  void ProjectKeys(kernels::ProjectKeysArgs a) override {
    const int64_t stride = a.a_row_stride ? a.a_row_stride : a.rank;
    std::vector<float> tmp(static_cast<size_t>(a.n) * a.rank);
    for (int p = 0; p < a.batch; ++p) {
      kc::ProjectKeys(static_cast<const float*>(a.keys) + p * a.keys_batch_stride, a.n, a.D, a.rank,
                      a.proj + p * a.proj_batch_stride, tmp.data());
      float* out = static_cast<float*>(a.a_out) + p * a.a_batch_stride;
      for (int i = 0; i < a.n; ++i) {
        std::memcpy(out + i * stride, tmp.data() + static_cast<size_t>(i) * a.rank, sizeof(float) * a.rank);
      }
    }
  }
  void ChunkLandmarks(kernels::ChunkLandmarksArgs a) override {
    for (int p = 0; p < a.batch; ++p) {
      kc::ChunkLandmarksArgs c;
      c.k = static_cast<const float*>(a.k) + p * a.k_batch_stride;
      c.k_head_stride = a.k_head_stride;
      c.first_token = a.first_token;
      c.n_chunks = a.n_chunks;
      c.chunk_tokens = a.chunk_tokens;
      c.hkv = a.hkv;
      c.d = a.d;
      if (a.landmark_fp8)
        c.landmarks_fp8 = static_cast<uint8_t*>(a.landmarks) + p * a.landmark_batch_stride;
      else
        c.landmarks = static_cast<float*>(a.landmarks) + p * a.landmark_batch_stride;
      c.landmark_head_stride = a.landmark_head_stride;
      c.min_cos = a.min_cos + p * a.min_cos_batch_stride;
      c.min_cos_head_stride = a.min_cos_head_stride;
      c.landmarks_per_chunk = a.landmarks_per_chunk;
      kc::ChunkLandmarks(c);
    }
  }
  void SelectOutlierChunks(const kernels::SelectOutliersArgs& a) override {
    kc::SelectOutlierChunks(a.min_cos, a.min_cos_head_stride, a.hkv, a.n_chunks, a.num_outliers, a.out);
  }
  void GatherOutliers(kernels::GatherOutliersArgs a) override {
    kc::GatherOutliersArgs c;
    c.k = static_cast<const float*>(a.k);
    c.v = static_cast<const float*>(a.v);
    c.kv_head_stride = a.kv_head_stride;
    c.first_token = a.first_token;
    c.chunk_tokens = a.chunk_tokens;
    c.hkv = a.hkv;
    c.d = a.d;
    c.n_chunks = a.n_chunks;
    c.outliers = a.outliers;
    c.num_outliers = a.num_outliers;
    c.att_k = static_cast<float*>(a.att_k);
    c.att_v = static_cast<float*>(a.att_v);
    c.att_head_stride = a.att_head_stride;
    c.excluded = a.excluded;
    c.mask_head_stride = a.mask_head_stride;
    kc::GatherOutliers(c);
  }
  Status ShadowkvScore(kernels::ShadowkvScoreArgs a) override {
    PENUMBRA_RETURN_IF_ERROR(CheckOnePrefix(a));
    kc::ShadowkvScoreArgs c;
    c.q = static_cast<const float*>(a.q);
    if (a.landmark_fp8) {
      c.landmarks_fp8 = reinterpret_cast<const uint8_t* const*>(a.landmarks);
      c.shared_landmarks_fp8 = reinterpret_cast<const uint8_t* const*>(a.shared_landmarks);
    } else {
      c.landmarks = reinterpret_cast<const float* const*>(a.landmarks);
      c.shared_landmarks = reinterpret_cast<const float* const*>(a.shared_landmarks);
    }
    c.excluded = a.excluded;
    c.n_chunks = a.n_chunks;
    c.batch = a.batch;
    c.hq = a.hq;
    c.hkv = a.hkv;
    c.d = a.d;
    c.chunk_cap = a.chunk_cap;
    c.max_chunks = a.max_chunks;
    c.shared_chunks = a.shared_chunks;
    c.landmark_cap = a.landmark_cap;
    c.scale = a.scale;
    c.scores = a.scores;
    c.score_stride = a.score_stride;
    c.successors = a.successors;
    c.landmarks_per_chunk = a.landmarks_per_chunk;
    c.stats_out = a.stats_out;
    c.stats_in = a.stats_in;
    c.stats_parts = a.stats_parts;
    c.stats_part_stride = a.stats_part_stride;
    kc::ShadowkvScore(c);
    if (a.stats_out != nullptr) return Status::OK();  // statistics only
    if (a.select_k > 0) {
      TopK(kernels::ShadowkvSelectionTopK(a));  // what the CUDA kernels fuse
      if (a.selection_scores != nullptr) {
        kc::SelectionScores(a.scores, a.score_stride, a.selection, a.selection_stride, a.batch * a.hkv, a.select_k,
                            a.selection_scores);
      }
    }
    return Status::OK();
  }
  void ShadowkvGlobalSelectAndSlotUpdate(const kernels::ShadowkvGlobalSelectArgs& a,
                                         const kernels::ShadowkvSlotUpdateArgs& u) override {
    kc::ShadowkvGlobalSelectArgs c;
    c.candidates = a.candidates;
    c.parts = a.parts;
    c.rank = a.rank;
    c.part_stride = a.part_stride;
    c.rows = a.rows;
    c.cand_stride = a.cand_stride;
    c.k = a.k;
    c.proposals = a.proposals;
    c.winners = a.winners;
    c.selection = a.selection;
    c.selection_stride = a.selection_stride;
    c.selection_len = a.selection_len;
    kc::ShadowkvGlobalSelect(c);
    ShadowkvSlotUpdate(u);
  }
  void TopK(const kernels::TopKArgs& a) override {
    kc::TopKArgs c;
    c.values = a.values;
    c.stride = a.stride;
    c.rows = a.rows;
    c.counts = a.counts;
    c.rows_per_count = a.rows_per_count;
    c.uniform_count = a.uniform_count;
    c.k = a.k;
    c.smallest = a.smallest;
    c.skip_worst_inf = a.skip_worst_inf;
    c.out = a.out;
    c.out_stride = a.out_stride;
    kc::TopK(c);
  }
  void MaxRows(const kernels::MaxRowsArgs& a) override {
    kc::MaxRows(a.in, a.rows, a.row_stride, a.cols, a.out, a.accumulate);
  }
  // The reference: the definition, row by row.
  // The reference scores every entry on its own, but holds the caller to
  // ShadowkvScoreArgs::one_prefix's promise (which the GPU's one-pass scores
  // rely on): one prefix array, every entry at least its chunks, its
  // chunks' exclusions the same for every entry.
  static Status CheckOnePrefix(const kernels::ShadowkvScoreArgs& a) {
    if (!a.one_prefix || a.batch <= 1) return Status::OK();
    auto broken = [](const std::string& what) {
      return Status::Internal("ShadowkvScore: one_prefix promised but " + what);
    };
    if (a.shared_chunks <= 0)
      return broken("there is no prefix (shared_chunks " + std::to_string(a.shared_chunks) + ")");
    const int64_t n = std::min(a.shared_chunks, a.max_chunks);
    for (int b = 0; b < a.batch; ++b) {
      if (a.shared_landmarks[b] != a.shared_landmarks[0]) {
        return broken("entry " + std::to_string(b) + " is attached to another prefix");
      }
      if (a.n_chunks[b] < a.shared_chunks) {
        return broken("entry " + std::to_string(b) + " has " + std::to_string(a.n_chunks[b]) + " chunks, fewer than " +
                      "the prefix's " + std::to_string(a.shared_chunks));
      }
      if (a.excluded == nullptr || b == 0) continue;
      for (int h = 0; h < a.hkv; ++h) {
        const int64_t off = static_cast<int64_t>(h) * a.chunk_cap;
        if (std::memcmp(a.excluded[b] + off, a.excluded[0] + off, static_cast<size_t>(n)) != 0) {
          return broken("entry " + std::to_string(b) + "'s exclusions of the prefix's chunks differ (head " +
                        std::to_string(h) + ")");
        }
      }
    }
    return Status::OK();
  }
  Status ShadowkvQueryScores(kernels::ShadowkvQueryScoresArgs a) override {
    const kernels::ShadowkvScoreArgs& s = a.score;
    query_scratch_.resize(static_cast<size_t>(std::max(s.batch, 1)) * s.hkv * std::max(s.max_chunks, 1));
    return QueryScoresRowByRow(a, query_scratch_.data());
  }
  void ShadowkvSlotUpdate(const kernels::ShadowkvSlotUpdateArgs& a) override {
    kc::ShadowkvSlotUpdateArgs c;
    c.selection = a.selection;
    c.selection_stride = a.selection_stride;
    c.slot_maps = a.slot_maps;
    c.miss_count = a.miss_count;
    c.miss_slot = a.miss_slot;
    c.miss_chunk = a.miss_chunk;
    c.batch = a.batch;
    c.hkv = a.hkv;
    c.kslots = a.kslots;
    c.chunk_cap = a.chunk_cap;
    c.force_keep = a.force_keep;
    kc::ShadowkvSlotUpdate(c);
  }
  void ShadowkvRebuildK(kernels::ShadowkvRebuildKArgs a) override {
    kc::ShadowkvRebuildKArgs c;
    c.a = reinterpret_cast<const float* const*>(a.a);
    c.shared_a = reinterpret_cast<const float* const*>(a.shared_a);
    c.shared_chunks = a.shared_chunks;
    c.b = reinterpret_cast<const float* const*>(a.b);
    c.position_offset = a.position_offset;
    c.inv_freq = a.inv_freq;
    c.miss_count = a.miss_count;
    c.miss_slot = a.miss_slot;
    c.miss_chunk = a.miss_chunk;
    c.miss_stride = a.miss_stride;
    c.att_k = reinterpret_cast<float* const*>(a.att_k);
    c.att_head_stride = a.att_head_stride;
    c.outlier_rows = a.outlier_rows;
    c.batch = a.batch;
    c.hkv = a.hkv;
    c.d = a.d;
    c.r = a.r;
    c.chunk_size = a.chunk_size;
    kc::ShadowkvRebuildK(c);
  }
  Status SpindlekvAttention(const kernels::SpindlekvAttentionArgs& a) override {
    if (a.dtype != DType::kF32) return Status::InvalidArgument("spindlekv attention on the CPU takes f32");
    if (a.hkv < 1 || a.hq % a.hkv != 0 || a.hq / a.hkv > 32 || a.d % 2 != 0) {
      return Status::InvalidArgument("spindlekv attention: hq " + std::to_string(a.hq) + ", hkv " +
                                     std::to_string(a.hkv) + ", d " + std::to_string(a.d));
    }
    kc::SpindlekvAttention(a);
    return Status::OK();
  }
  Status SpindlekvWindowScores(const kernels::SpindlekvWindowScoresArgs& a) override {
    if (a.dtype != DType::kF32) return Status::InvalidArgument("spindlekv window scores on the CPU take f32");
    if (a.hkv < 1 || a.hq % a.hkv != 0) return Status::InvalidArgument("spindlekv window scores: bad head counts");
    const int group = a.hq / a.hkv;
    const auto* q = static_cast<const float*>(a.q);
    kc::ParallelFor(a.hq, [&](int64_t h) {
      std::vector<float> rows(static_cast<size_t>(a.w) * a.d);
      for (int b = 0; b < a.w; ++b) {
        std::memcpy(&rows[static_cast<size_t>(b) * a.d], q + (static_cast<size_t>(b) * a.hq + h) * a.d,
                    sizeof(float) * a.d);
      }
      const auto* k = static_cast<const float*>(a.k) + (h / group) * a.head_stride;
      spindlekv::WindowScores(rows.data(), a.q_pos, a.w, k, a.n, a.d, a.scale, a.pool, a.out + h * a.n);
    });
    return Status::OK();
  }
  Status SpindlekvSelect(const kernels::SpindlekvSelectArgs& a) override {
    if (a.hkv < 1 || a.hq % a.hkv != 0 || a.hq / a.hkv > 32) {
      return Status::InvalidArgument("spindlekv select: bad head counts");
    }
    std::vector<std::vector<int32_t>> pos;
    std::vector<std::vector<uint32_t>> heads;
    spindlekv::SelectHeld(a.scores, a.n, a.context, a.keep, a.hq, a.hkv, &pos, &heads);
    for (int g = 0; g < a.hkv; ++g) {
      a.held[g] = static_cast<int32_t>(pos[g].size());
      std::copy(pos[g].begin(), pos[g].end(), a.pos + g * a.n);
      std::copy(heads[g].begin(), heads[g].end(), a.heads + g * a.n);
    }
    return Status::OK();
  }
  Status SpindlekvBuildCodebook(const kernels::SpindlekvCodebookArgs& a) override {
    if (a.x_dtype != DType::kF32 || a.entry_dtype != DType::kF32) {
      return Status::InvalidArgument("spindlekv codebooks on the CPU take f32");
    }
    kc::ParallelFor(a.count, [&](int64_t i) {
      const kernels::SpindlekvCodebookProblem& p = a.problems[i];
      std::vector<float> x(static_cast<size_t>(p.n) * a.d);
      for (int32_t r = 0; r < p.n; ++r) {
        std::memcpy(&x[static_cast<size_t>(r) * a.d], static_cast<const float*>(p.x) + p.rows[r] * p.row_stride,
                    sizeof(float) * a.d);
      }
      spindlekv::Codebook cb;
      cb.d = a.d;
      spindlekv::BuildCodebook(x.data(), p.n, a.d, p.theta, a.block, &cb, p.refs, p.mags);
      std::copy(cb.entries.begin(), cb.entries.end(), static_cast<float*>(p.entries));
      *p.entry_count = cb.size();
    });
    return Status::OK();
  }
  Status SpindlekvMerge(const kernels::SpindlekvMergeArgs& a) override {
    if (a.entry_dtype != DType::kF32) return Status::InvalidArgument("spindlekv merge on the CPU takes f32");
    const int group = a.hq / a.hkv, d = a.d;
    const uint32_t all = group == 32 ? ~uint32_t{0} : (uint32_t{1} << group) - 1;
    const size_t row = static_cast<size_t>(a.hq + 2 * a.hkv) * d;
    kc::ParallelFor(static_cast<int64_t>(a.batch) * a.hkv, [&](int64_t r) {
      const int i = static_cast<int>(r / a.hkv), g = static_cast<int>(r % a.hkv);
      // The views' arrays are the policy's own (writable) memory.
      kernels::SpindlekvHead& h = a.seq_heads[i][a.layer * a.hkv + g];
      int32_t* counts = a.seq_entries[i] + (static_cast<size_t>(a.layer) * a.hkv + g) * 2;
      const float* src = a.qkv + i * row;
      float km = 0, vm = 0;
      const int32_t kr = spindlekv::MergeOrAdd(
          src + (a.hq + g) * d, d, a.key_theta, static_cast<const float*>(h.key_entries[0]), h.key_base_entries,
          const_cast<float*>(static_cast<const float*>(h.key_entries[1])), &counts[0], &km, a.window);
      const int32_t vr = spindlekv::MergeOrAdd(src + (a.hq + a.hkv + g) * d, d, a.value_theta,
                                               static_cast<const float*>(h.value_entries[0]), h.value_base_entries,
                                               const_cast<float*>(static_cast<const float*>(h.value_entries[1])),
                                               &counts[1], &vm, a.window);
      kernels::SpindlekvTokens& t = h.part[1];
      const int64_t at = t.n;
      const_cast<int32_t*>(t.pos)[at] = a.positions[i];
      const_cast<int32_t*>(t.kref)[at] = kr;
      const_cast<float*>(t.kmag)[at] = km;
      const_cast<int32_t*>(t.vref)[at] = vr;
      const_cast<float*>(t.vmag)[at] = vm;
      const_cast<uint32_t*>(t.heads)[at] = all;
      ++t.n;
      if (a.gathered != nullptr) a.gathered[r] = h;
    });
    return Status::OK();
  }
  void EncodeValuesFp8(const void* src, int64_t rows, int chunk_tokens, int d, void* dst) override {
    const int64_t elems = static_cast<int64_t>(chunk_tokens) * d, rb = kernels::ValueRowBytesFp8(chunk_tokens, d);
    for (int64_t r = 0; r < rows; ++r) {
      kernels::EncodeValueRowFp8(static_cast<const float*>(src) + r * elems, chunk_tokens, d,
                                 static_cast<uint8_t*>(dst) + r * rb);
    }
  }
  void ShadowkvFetchV(kernels::ShadowkvFetchVArgs a, bool /*staged*/) override {
    kc::ShadowkvFetchVArgs c;
    c.value_store = reinterpret_cast<const float* const*>(a.value_store);
    c.chunk_cap = a.chunk_cap;
    c.shared_store = reinterpret_cast<const float* const*>(a.shared_store);
    c.shared_chunks = a.shared_chunks;
    c.shared_stride = a.shared_stride;
    c.staging = static_cast<const float*>(a.staging);
    c.staging_offsets = a.staging_offsets;
    c.miss_count = a.miss_count;
    c.miss_slot = a.miss_slot;
    c.miss_chunk = a.miss_chunk;
    c.miss_stride = a.miss_stride;
    c.att_v = reinterpret_cast<float* const*>(a.att_v);
    c.values_fp8 = a.values_fp8;
    c.att_head_stride = a.att_head_stride;
    c.outlier_rows = a.outlier_rows;
    c.batch = a.batch;
    c.hkv = a.hkv;
    c.d = a.d;
    c.chunk_size = a.chunk_size;
    c.skip_shared = a.skip_shared;
    kc::ShadowkvFetchV(c);
  }
  void ForkSide() override {}
  void JoinSide() override {}
  void JoinSideLater(int mark) override { CHECK(mark >= 0 && mark < kSideMarks) << "side mark " << mark; }
  void WaitSideMark(int mark) override { CHECK(mark >= 0 && mark < kSideMarks) << "side mark " << mark; }

 private:
  int threads_;
  std::vector<float> query_scratch_;  // ShadowkvQueryScores' per-row scores
};

}  // namespace

Result<std::unique_ptr<Backend>> CreateCpuBackend(const BackendOptions& options) {
  if (options.dtype != "auto" && options.dtype != "f32") {
    return Status::InvalidArgument("the cpu backend computes in f32; --dtype " + options.dtype +
                                   " is only available with --device cuda");
  }
  return std::unique_ptr<Backend>(new CpuBackend(options));
}

Result<LinearKernels> ParseLinearKernels(const std::string& name) {
  if (name == "auto") return LinearKernels::kAuto;
  if (name == "skinny") return LinearKernels::kSkinny;
  if (name == "cublas") return LinearKernels::kCublas;
  return Status::InvalidArgument("unknown linear kernel '" + name + "' (expected auto, skinny or cublas)");
}

Result<std::unique_ptr<Backend>> CreateBackend(const BackendOptions& options) {
  // The CPU backend has no choice of kernels, but a misspelt option is still an error.
  PENUMBRA_RETURN_IF_ERROR(ParseLinearKernels(options.linear).status());
  if (options.device == "cpu") return CreateCpuBackend(options);
  if (options.device == "cuda" || options.device == "auto") {
    if (CudaBackendCompiled() && CudaDevicePresent()) return CreateCudaBackend(options);
    if (options.device == "cuda") {
      return Status::Unavailable(CudaBackendCompiled() ? "--device cuda: no CUDA device is present"
                                                       : "--device cuda: this build has no CUDA backend");
    }
    return CreateCpuBackend(options);
  }
  return Status::InvalidArgument("unknown device '" + options.device + "' (expected cpu, cuda or auto)");
}

}  // namespace penumbra

namespace penumbra {
size_t HostMemAvailableBytes() {
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (!f) return 0;
  char line[256];
  size_t kb = 0;
  while (std::fgets(line, sizeof(line), f)) {
    if (std::sscanf(line, "MemAvailable: %zu kB", &kb) == 1) break;
  }
  std::fclose(f);
  return kb * 1024;
}
}  // namespace penumbra
