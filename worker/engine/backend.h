// Backend: the table of device operations the engine is written against.
//
// The engine (runtime, KV policies) is written once against this interface;
// CpuBackend implements it with OpenBLAS and the CPU references in
// kernels/cpu, CudaBackend with cuBLAS, cuSOLVER and the kernels in kernels/.
// Every pointer passed to an op is device memory of this backend (host memory
// for the CPU backend). Ops are asynchronous on the backend's main stream;
// Synchronize() waits. Ops do not validate shapes: callers (runtime, policies)
// do, and a violated contract is a bug (CHECK), not a Status.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
// The ShadowKV ops take the kernels' argument structs (plain structs of
// pointers and sizes, kernels/*_args.h): plain C++, so a CPU-only build
// needs no CUDA header.
#include "kernels/lowrank_args.h"
#include "kernels/shadowkv_decode_args.h"
#include "kernels/shadowkv_prefill_args.h"
#include "kernels/spindlekv_args.h"
#include "kernels/spindlekv_compress_args.h"
#include "kernels/topk_args.h"

namespace penumbra {

// An owning allocation on a backend's device (or pinned host memory).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(void* p, size_t bytes, void (*free_fn)(void*)) : p_(p), bytes_(bytes), free_(free_fn) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      p_ = o.p_;
      bytes_ = o.bytes_;
      free_ = o.free_;
      o.p_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Reset(); }
  void Reset() {
    if (p_ && free_) free_(p_);
    p_ = nullptr;
    bytes_ = 0;
  }
  void* get() const { return p_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
  void (*free_)(void*) = nullptr;
};

// A linear layer's weight: row-major [out, in] of `dtype`, optional bias [out].
struct LinearWeight {
  const void* w = nullptr;
  const void* bias = nullptr;
  DType dtype = DType::kF32;
  int out = 0, in = 0;
};

struct RopeStoreOp {
  const float* qkv = nullptr;          // [n, (hq + 2*hkv) * d]
  const int32_t* positions = nullptr;  // [n]
  const float* inv_freq = nullptr;     // [d/2]
  int n = 0, hq = 0, hkv = 0, d = 0;
  void* q_out = nullptr;                   // [n, hq, d] of act dtype
  void* const* k_dst = nullptr;            // [n] slot address of KV head 0, per token
  void* const* v_dst = nullptr;            // null: values not stored
  int64_t head_stride = 0;                 // elements
  float* pre_rope_k_out = nullptr;         // optional [n, hkv, d] f32
  float* const* pre_rope_k_dst = nullptr;  // optional [n] address of each token's [hkv, d] f32 row
};

struct PrefillAttentionOp {
  const void* q = nullptr;  // [nq, hq, d]
  const void* k = nullptr;  // [hkv][head_stride]
  const void* v = nullptr;
  void* out = nullptr;   // [nq, hq, d]
  float* lse = nullptr;  // optional [nq, hq] f32: ln sum exp(scale q.k) over each row's keys
  int64_t head_stride = 0;
  int q_start = 0, nq = 0, hq = 0, hkv = 0, d = 0;
  float scale = 1.0f;
};

struct DecodeAttentionOp {
  const void* q = nullptr;         // [batch, hq, d]
  const void* const* k = nullptr;  // [batch] per-sequence bases
  const void* const* v = nullptr;
  const int32_t* lengths = nullptr;  // [batch]
  void* out = nullptr;               // [batch, hq, d]
  float* lse = nullptr;              // optional [batch, hq] f32: ln sum exp(scale q.k) over the keys
  int64_t head_stride = 0;
  int batch = 0, hq = 0, hkv = 0, d = 0;
  int max_length = 0;
  float scale = 1.0f;
  // Optional: rows of empty slots (slot map entry < 0) not attended
  // (kernels/attention_decode.cuh): ShadowKV's selection slots under a global
  // top-k, where a shard may hold fewer selected chunks than slots.
  const int32_t* const* slot_maps = nullptr;  // [batch] -> [hkv][slot_count]
  int slot_row0 = 0, slot_count = 0, slot_rows = 0;
  // Optional, with slot_maps: slots holding an attached document's chunk c <
  // slot_values_chunks read their V rows in place from the document's values
  // (kernels/attention_decode.cuh, DecodeAttentionArgs::slot_values).
  const void* const* slot_values = nullptr;  // [batch]
  int64_t slot_values_stride = 0;
  int slot_values_chunks = 0;
};

// Cascade attention's shared half (kernels/attention_prefix.cuh): the rows
// `rows` of q (sequences attached to one prefix) attend to all `keys` keys of
// the prefix's K/V, held once; merged by log-sum-exp into out, which holds
// each row's attention over its own keys (own_lse from DecodeAttentionOp::lse).
struct PrefixAttentionOp {
  const void* q = nullptr;        // [batch, hq, d]
  const int32_t* rows = nullptr;  // device [n]: batch rows attached to the prefix
  int n = 0;
  const void* k = nullptr;  // the prefix's K of one layer, [hkv][head_stride]
  const void* v = nullptr;
  int64_t head_stride = 0;
  int keys = 0;
  void* out = nullptr;             // [batch, hq, d]
  const float* own_lse = nullptr;  // [batch, hq]; null: out is overwritten with the prefix's part
  float* lse_out = nullptr;        // [batch, hq] or null: the log-sum-exp of what out holds after (may alias own_lse)
  int hq = 0, hkv = 0, d = 0;
  float scale = 1.0f;
};

struct SampleParams {
  float temperature = 0.0f;  // <= 0: greedy
  int top_k = 0;
  float top_p = 1.0f;
  float uniform = 0.0f;
};

// MemAvailable from /proc/meminfo (0 when unknown).
size_t HostMemAvailableBytes();

class Backend {
 public:
  virtual ~Backend() = default;

  virtual Device device() const = 0;
  // dtype of weights, GEMM inputs, attention inputs/outputs and the KV cache.
  virtual DType act_dtype() const = 0;
  virtual std::string name() const = 0;  // "cpu" or e.g. "cuda:0 NVIDIA H100 80GB HBM3"
  // Makes the calling thread's calls go to this backend's device (CUDA:
  // cudaSetDevice; the current device is per thread, and a thread that
  // never set it works on device 0). Every thread but the creating one
  // calls it before its first call (the scheduler's loop and I/O threads).
  // No-op on the CPU.
  virtual Status BindThread() { return Status::OK(); }

  // ---- memory ----
  virtual Result<DeviceBuffer> Allocate(size_t bytes) = 0;
  // Host memory the device can read directly (pinned and mapped on CUDA).
  virtual Result<DeviceBuffer> AllocateHost(size_t bytes) = 0;
  // Pins (and maps for the device) host memory not from AllocateHost, e.g.
  // a value buffer filled from disk before it is pinned; UnregisterHost
  // undoes it before the memory is freed. No-ops on the CPU.
  virtual Status RegisterHost(void* p, size_t bytes) = 0;
  // Long-lived pinned host memory (the value store's layers): as
  // AllocateHost, but on CUDA allocated and faulted in (huge pages where the
  // kernel gives them) before it is registered, so that the driver's lock,
  // which stalls every other thread's launches, is held for the pinning of
  // present pages alone (cudaHostAlloc holds it while it allocates and
  // zeroes: ~0.1-0.17 s for a 256 MB layer of a 124928-token sequence).
  virtual Result<DeviceBuffer> AllocateHostLarge(size_t bytes) { return AllocateHost(bytes); }
  virtual void UnregisterHost(void* p) = 0;
  // The device address of host memory from AllocateHost (identity on CPU).
  virtual const void* DeviceAddressOfHost(const void* host) const = 0;
  virtual Status CopyToDevice(void* dst, const void* src, size_t bytes) = 0;
  virtual Status CopyToHost(void* dst, const void* src, size_t bytes) = 0;
  virtual Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) = 0;
  virtual Status Memset(void* dst, int value, size_t bytes) = 0;
  virtual Status Synchronize() = 0;
  // Bytes of device memory free now (SIZE_MAX semantics: host RAM on CPU).
  virtual size_t FreeMemoryBytes() const = 0;
  // Device bytes the backend holds for its kernels' workspaces (grown on
  // demand to the largest call seen, then kept). 0 where it holds none.
  virtual size_t WorkspaceBytes() const { return 0; }

  // ---- ops ----
  // out[i] = f32(table[ids[i]]); table [vocab, dim] of `table_dtype`.
  virtual void Embedding(const void* table, DType table_dtype, const int32_t* ids, int n, int dim, float* out) = 0;
  // out (act dtype or f32 when out_f32) = rmsnorm(x) * w.
  virtual void RmsNorm(const float* x, const void* w, DType w_dtype, int n, int dim, float eps, void* out,
                       bool out_f32 = false) = 0;
  // y[n, out] = x[n, in] (act dtype) * W^T (+ y when accumulate) (+ bias).
  virtual void Linear(const void* x, const LinearWeight& w, int n, float* y, bool accumulate) = 0;
  // out[n, F] (act dtype) = SwiGLU(x . W^T) for W = gate_up [2F, in] (the
  // gate rows, then the up rows): the MLP's first half. gu (f32 [n, 2F]) is
  // the unfused path's scratch; a fused backend may leave it unwritten.
  // Default: Linear, then SwiGLU.
  virtual void LinearSwiGLU(const void* x, const LinearWeight& gate_up, int n, float* gu, void* out) {
    Linear(x, gate_up, n, gu, false);
    SwiGLU(gu, n, gate_up.out / 2, out);
  }
  virtual void RopeStore(const RopeStoreOp& op) = 0;
  virtual void SwiGLU(const float* gate_up, int n, int F, void* out) = 0;
  virtual void PrefillAttention(const PrefillAttentionOp& op) = 0;
  // These three grow a device workspace with the batch: ResourceExhausted
  // (nothing launched) when the device has no room for it, never a crash.
  virtual Status DecodeAttention(const DecodeAttentionOp& op) = 0;
  virtual Status PrefixAttention(const PrefixAttentionOp& op) = 0;
  // Context parallel: merges `parts` partial attentions of the same rows,
  // each over a disjoint part of the keys, exactly by log-sum-exp:
  // out[r] = sum_p exp(lse[p][r] - m) * x[p][r] / sum_p exp(lse[p][r] - m),
  // m = max_p lse[p][r], for rows r in [0, rows) of d elements.
  //   x: part p's rows at x + p * x_part_stride elements ([rows][d] act
  //   dtype); lse: part p's at lse + p * lse_part_stride (f32 [rows]; -inf:
  //   that part saw no key, weight 0); out: [rows][d] act dtype (may alias
  //   part 0); lse_out (optional, [rows]): the merged log-sum-exp.
  struct MergeParts {
    const void* x = nullptr;
    int64_t x_part_stride = 0;
    const float* lse = nullptr;
    int64_t lse_part_stride = 0;
    int parts = 0, rows = 0, d = 0;
    void* out = nullptr;
    float* lse_out = nullptr;
  };
  virtual void MergeAttentionParts(const MergeParts& m) = 0;
  // Picks one token per row of logits [rows, vocab]; out_host receives the ids.
  virtual Status Sample(const float* logits, int rows, int vocab, const std::vector<SampleParams>& params,
                        int32_t* out_host) = 0;
  // Converts n elements between dtypes on the device.
  virtual void Convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n) = 0;
  // Fills n elements of `dtype` with values drawn from N(0, std) (benchmarks' random weights).
  virtual void FillRandomNormal(void* dst, DType dtype, int64_t n, float std, uint64_t seed) = 0;
  // 2-D copy (cudaMemcpy2D semantics; kind inferred from the pointers' owners).
  virtual Status Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height) = 0;

  // ---- ShadowKV ops (kernels/shadowkv_*.cuh, lowrank.cuh, topk.cuh; dtype
  // fields of the args are filled in by the backend from act_dtype()) ----
  virtual Status LowRankFactor(kernels::LowRankArgs args) = 0;
  virtual void ProjectKeys(kernels::ProjectKeysArgs args) = 0;
  virtual void ChunkLandmarks(kernels::ChunkLandmarksArgs args) = 0;
  virtual void SelectOutlierChunks(const kernels::SelectOutliersArgs& args) = 0;
  virtual void GatherOutliers(kernels::GatherOutliersArgs args) = 0;
  virtual Status ShadowkvScore(kernels::ShadowkvScoreArgs args) = 0;
  virtual void TopK(const kernels::TopKArgs& args) = 0;
  virtual void MaxRows(const kernels::MaxRowsArgs& args) = 0;
  // A sparse continuation's chunk scores (kernels::ShadowkvQueryScoresArgs):
  // the `score.batch` entries of its landmark tables all name the one
  // sequence (the row-by-row path scores that many query rows per call).
  virtual Status ShadowkvQueryScores(kernels::ShadowkvQueryScoresArgs args) = 0;
  virtual void ShadowkvSlotUpdate(const kernels::ShadowkvSlotUpdateArgs& args) = 0;
  // Scores with their selection, then the selection's slot update (`update`
  // reads score.selection). The CUDA backend runs the update in the
  // selection's blocks (one launch fewer per layer); default: one, then the other.
  virtual Status ShadowkvScoreAndSlotUpdate(kernels::ShadowkvScoreArgs score,
                                            const kernels::ShadowkvSlotUpdateArgs& update) {
    PENUMBRA_RETURN_IF_ERROR(ShadowkvScore(score));
    ShadowkvSlotUpdate(update);
    return Status::OK();
  }
  // Context parallel's global top-k (kernels::ShadowkvGlobalSelectArgs),
  // then the slot update of the selection it writes (`update` reads
  // select.selection); on the GPU in one launch.
  virtual void ShadowkvGlobalSelectAndSlotUpdate(const kernels::ShadowkvGlobalSelectArgs& select,
                                                 const kernels::ShadowkvSlotUpdateArgs& update) = 0;
  virtual void ShadowkvRebuildK(kernels::ShadowkvRebuildKArgs args) = 0;
  // On the side stream when forked (V fetch overlaps the K rebuild).
  virtual void ShadowkvFetchV(kernels::ShadowkvFetchVArgs args, bool staged) = 0;
  // `rows` value rows of chunk_tokens x d act-dtype elements (contiguous,
  // device) -> fp8 rows (kernels/value_format.h) at `dst` (device).
  virtual void EncodeValuesFp8(const void* src, int64_t rows, int chunk_tokens, int d, void* dst) = 0;

  // ---- SpindleKV (kernels/spindlekv_args.h) ----
  // A step's query heads over the tokens their KV heads hold compressed.
  // The backend picks splits and its workspace; InvalidArgument for a shape
  // or dtype it does not take.
  virtual Status SpindlekvAttention(const kernels::SpindlekvAttentionArgs& args) = 0;
  // A first prefill's compression and a decode step's merge
  // (kernels/spindlekv_compress_args.h: the semantics are
  // worker/engine/spindlekv_math.h's). The backend takes each op's workspace
  // itself; InvalidArgument for a shape or dtype it does not take.
  virtual Status SpindlekvWindowScores(const kernels::SpindlekvWindowScoresArgs& args) = 0;
  virtual Status SpindlekvSelect(const kernels::SpindlekvSelectArgs& args) = 0;
  virtual Status SpindlekvBuildCodebook(const kernels::SpindlekvCodebookArgs& args) = 0;
  virtual Status SpindlekvMerge(const kernels::SpindlekvMergeArgs& args) = 0;
  // Work issued between ForkSide() and JoinSide() by ops marked "side" runs
  // on a second stream that starts after all prior main-stream work; JoinSide
  // makes the main stream wait for it. No-ops on the CPU.
  virtual void ForkSide() = 0;
  virtual void JoinSide() = 0;
  // Like JoinSide, but the main stream does not wait yet: the side work so far
  // becomes mark `mark` (0 <= mark < kSideMarks), and WaitSideMark(mark) later
  // makes the main stream wait for it. Several micro-batches' side work can so
  // be in flight while the main stream works on the next ones.
  static constexpr int kSideMarks = 16;
  virtual void JoinSideLater(int mark) = 0;
  virtual void WaitSideMark(int mark) = 0;
  // The backend's main stream (cudaStream_t on CUDA; null on the CPU): for
  // collectives that order their work with the backend's (transport/).
  virtual void* native_stream() const { return nullptr; }
  // The device index (CUDA ordinal; 0 on the CPU).
  virtual int device_index() const { return 0; }
  // Host memory available for pinned allocations (MemAvailable).
  virtual size_t FreeHostBytes() const { return HostMemAvailableBytes(); }
  // The unit Allocate's device memory comes in (a buffer takes its bytes
  // rounded up to it): 1 where allocations are exact.
  virtual size_t AllocationGranularity() const { return 1; }
  // What a buffer of `bytes` takes as Allocate gives it: a large one (half a
  // granule or more) in whole granules; small ones share them.
  size_t AllocatedBytes(size_t bytes) const {
    const size_t g = AllocationGranularity();
    return g > 1 && bytes >= g / 2 ? (bytes + g - 1) / g * g : bytes;
  }

  // Fetch turns between lanes (worker/engine/fetch_turns.h).
  // PrepareFetchTurns creates the per-layer state (before any lane decodes);
  // RecordFetchDone marks the end of the side-stream work issued so far as
  // this backend's fetch of `layer`; WaitFetchDone makes the side stream
  // (after ForkSide) wait for `other`'s last recorded fetch of `layer`.
  // `other` is another lane's backend of the same kind. No-ops on the CPU.
  virtual Status PrepareFetchTurns(int layers) {
    (void)layers;
    return Status::OK();
  }
  virtual void RecordFetchDone(int layer) { (void)layer; }
  virtual void WaitFetchDone(Backend& other, int layer) {
    (void)other;
    (void)layer;
  }

  // Diagnostics (penumbra-bench --fetch-timeline): while on, the start and
  // end of every value fetch are recorded as timed device events, with no
  // synchronization. FetchIntervals() (after the work has finished) returns
  // them as [start, end) ms from one process-wide reference, so the intervals
  // of several lanes can be merged. Turning it on clears earlier intervals.
  // The CPU backend records nothing.
  struct Interval {
    double start_ms = 0, end_ms = 0;
  };
  virtual void SetFetchTimeline(bool on) { (void)on; }
  virtual Result<std::vector<Interval>> FetchIntervals() { return std::vector<Interval>{}; }

 protected:
  // ShadowkvQueryScores row by row: ShadowkvScore over score.batch query
  // rows at a time into `scratch` (this backend's memory, [batch][hkv]
  // [max_chunks] f32), the maximum over rows and KV heads into args.best.
  Status QueryScoresRowByRow(kernels::ShadowkvQueryScoresArgs a, float* scratch) {
    kernels::ShadowkvScoreArgs sc = a.score;
    const int per = std::max(sc.batch, 1), H = sc.hkv, n = sc.max_chunks;
    sc.scores = scratch;
    sc.score_stride = n;
    sc.select_k = 0;
    sc.selection = nullptr;
    sc.selection_scores = nullptr;
    sc.successors = 0;
    sc.stats_out = nullptr;
    sc.stats_in = nullptr;
    const size_t q_row = static_cast<size_t>(sc.hq) * sc.d * DTypeSize(act_dtype());
    for (int r0 = 0; r0 < std::max(a.rows, 1); r0 += per) {
      const int nr = std::max(0, std::min(per, a.rows - r0));
      if (nr > 0) {
        sc.batch = nr;
        sc.q = static_cast<const char*>(a.score.q) + static_cast<size_t>(r0) * q_row;
        PENUMBRA_RETURN_IF_ERROR(ShadowkvScore(sc));
      }
      kernels::MaxRowsArgs mr;  // over the rows and the heads: scores are [row][head][chunk]
      mr.in = scratch;
      mr.rows = nr * H;
      mr.row_stride = n;
      mr.cols = n;
      mr.out = a.best;
      mr.accumulate = r0 > 0;
      MaxRows(mr);
    }
    return Status::OK();
  }
};

struct BackendOptions {
  std::string device = "auto";  // "cpu", "cuda", or "auto" (cuda when a GPU is present). Default: auto.
  std::string dtype = "auto";   // CUDA compute dtype: "bf16", "f32", or "auto" (bf16). Default: auto.
  int cuda_device = 0;          // Default: 0.
  int cpu_threads = 0;          // 0 = all cores. Default: 0.
  // CUDA linear layers: "auto" (the skinny tensor-core kernel of
  // kernels/linear_skinny.cuh for bf16 with at most 8 rows, i.e. decode
  // batches, with the SwiGLU fused into it for LinearSwiGLU; cuBLAS
  // otherwise), "skinny" (the same kernel, never
  // fused) or "cublas" (always). Default: auto.
  std::string linear = "auto";  // see ParseLinearKernels
  // CUDA: launch the decode kernels chained (programmatic dependent launch,
  // kernels/common.cuh): each may be scheduled while the one before it in the
  // stream finishes. Process-wide (the last backend created sets it).
  // Default: true.
  bool chained_launch = true;
};

// BackendOptions::linear as a choice; InvalidArgument naming the value when it
// is none of auto, skinny, cublas (checked on every device).
enum class LinearKernels { kAuto, kSkinny, kCublas };
Result<LinearKernels> ParseLinearKernels(const std::string& name);

// Creates the backend named by options; InvalidArgument/Unavailable with a
// clear message when e.g. CUDA is asked for and no GPU is present.
Result<std::unique_ptr<Backend>> CreateBackend(const BackendOptions& options);
Result<std::unique_ptr<Backend>> CreateCpuBackend(const BackendOptions& options);
// Defined only when built with CUDA.
Result<std::unique_ptr<Backend>> CreateCudaBackend(const BackendOptions& options);
bool CudaBackendCompiled();
bool CudaDevicePresent();

}  // namespace penumbra
