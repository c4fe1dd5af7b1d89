// CudaBackend: bf16 (default) or f32 weights, activations and KV cache; f32
// residual stream and GEMM outputs. GEMMs through cuBLAS (f32 accumulation,
// TF32 off in f32 mode so results track the CPU reference), everything else
// through the kernels in kernels/. All work is issued on one stream.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#include <cusolverDn.h>
#include "kernels/add_bias.cuh"
#include "kernels/attention_decode.cuh"
#include "kernels/attention_merge.cuh"
#include "kernels/attention_prefill.cuh"
#include "kernels/attention_prefix.cuh"
#include "kernels/convert.cuh"
#include "kernels/cuda_check.h"
#include "kernels/embedding.cuh"
#include "kernels/fill_random.cuh"
#include "kernels/linear_skinny.cuh"
#include "kernels/lowrank.cuh"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope_store.cuh"
#include "kernels/sample.cuh"
#include "kernels/shadowkv_decode.cuh"
#include "kernels/shadowkv_prefill.cuh"
#include "kernels/spindlekv_attention.cuh"
#include "kernels/spindlekv_codebook.cuh"
#include "kernels/spindlekv_compress.cuh"
#include "kernels/swiglu.cuh"
#include "kernels/topk.cuh"
#include "kernels/value_fp8.cuh"
#include "worker/engine/backend.h"

namespace penumbra {
namespace {

namespace kn = kernels;

void FreeDevice(void* p) { cudaFree(p); }
void FreeHostPinned(void* p) { cudaFreeHost(p); }
void FreeHostRegistered(void* p) {
  (void)cudaHostUnregister(p);
  std::free(p);
}

const char* CublasName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS:
      return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "alloc failed";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "invalid value";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "arch mismatch";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "execution failed";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "not supported";
    default:
      return "error";
  }
}

cudaDataType_t CudaType(DType t) {
  switch (t) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
    default:
      LOG(FATAL) << "no cuBLAS type for " << DTypeName(t);
  }
  return CUDA_R_32F;
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, DType act, LinearKernels linear) : device_(device), act_(act), linear_(linear) {}
  ~CudaBackend() override {
    if (sample_params_) cudaFree(sample_params_);
    if (sample_out_) cudaFree(sample_out_);
    if (solver_) cusolverDnDestroy(solver_);
    if (cublas_) cublasDestroy(cublas_);
    if (side_) cudaStreamDestroy(side_);
    if (fork_ev_) cudaEventDestroy(fork_ev_);
    if (join_ev_) cudaEventDestroy(join_ev_);
    for (cudaEvent_t e : marks_)
      if (e) cudaEventDestroy(e);
    for (cudaEvent_t e : timeline_)
      if (e) cudaEventDestroy(e);
    for (cudaEvent_t e : fetch_done_)
      if (e) cudaEventDestroy(e);
    if (stream_) cudaStreamDestroy(stream_);
  }

  Status Init() {
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    cublasStatus_t s = cublasCreate(&cublas_);
    if (s != CUBLAS_STATUS_SUCCESS) return Status::Internal(std::string("cublasCreate: ") + CublasName(s));
    cublasSetStream(cublas_, stream_);
    if (cusolverDnCreate(&solver_) != CUSOLVER_STATUS_SUCCESS) return Status::Internal("cusolverDnCreate failed");
    cusolverDnSetStream(solver_, stream_);
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&fork_ev_, cudaEventDisableTiming));
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&join_ev_, cudaEventDisableTiming));
    for (cudaEvent_t& e : marks_) PENUMBRA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH);  // no TF32: f32 mode must track the CPU reference
    cudaDeviceProp prop{};
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device_));
    name_ = "cuda:" + std::to_string(device_) + " " + prop.name;
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaMalloc(&sample_params_, sizeof(kn::SamplingRow) * kMaxSampleRows));
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaMalloc(&sample_out_, sizeof(int32_t) * kMaxSampleRows));
    return Status::OK();
  }

  Device device() const override { return Device::kCUDA; }
  DType act_dtype() const override { return act_; }
  std::string name() const override { return name_; }

  Result<DeviceBuffer> Allocate(size_t bytes) override {
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes == 0 ? 256 : bytes);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::ResourceExhausted("cuda: cannot allocate " + std::to_string(bytes) + " bytes of GPU memory (" +
                                       cudaGetErrorString(e) + ")");
    }
    return DeviceBuffer(p, bytes, &FreeDevice);
  }
  Result<DeviceBuffer> AllocateHost(size_t bytes) override {
    void* p = nullptr;
    cudaError_t e = cudaHostAlloc(&p, bytes == 0 ? 256 : bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::ResourceExhausted("cuda: cannot allocate " + std::to_string(bytes) +
                                       " bytes of pinned host memory (" + cudaGetErrorString(e) + ")");
    }
    return DeviceBuffer(p, bytes, &FreeHostPinned);
  }
  Result<DeviceBuffer> AllocateHostLarge(size_t bytes) override {
    constexpr size_t kHuge = size_t{2} << 20;
    const size_t n = (std::max<size_t>(bytes, 1) + kHuge - 1) / kHuge * kHuge;
    void* p = std::aligned_alloc(kHuge, n);
    if (p == nullptr) {
      return Status::ResourceExhausted("cannot allocate " + std::to_string(bytes) + " bytes of host memory");
    }
    (void)madvise(p, n, MADV_HUGEPAGE);  // a hint: fewer pages to pin where the kernel has them
    std::memset(p, 0, n);                // faulted in here, outside the driver's lock
    cudaError_t e = cudaHostRegister(p, n, cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      std::free(p);
      return Status::ResourceExhausted("cuda: cannot pin " + std::to_string(bytes) + " bytes of host memory (" +
                                       cudaGetErrorString(e) + ")");
    }
    return DeviceBuffer(p, bytes, &FreeHostRegistered);
  }
  Status RegisterHost(void* p, size_t bytes) override {
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
    return Status::OK();
  }
  void UnregisterHost(void* p) override { (void)cudaHostUnregister(p); }
  const void* DeviceAddressOfHost(const void* host) const override {
    void* d = nullptr;
    PENUMBRA_CUDA_CHECK(cudaHostGetDevicePointer(&d, const_cast<void*>(host), 0));
    return d;
  }
  Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    return Status::OK();
  }
  Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return Status::OK();
  }
  Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) override {
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
    return Status::OK();
  }
  Status Memset(void* dst, int value, size_t bytes) override {
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, value, bytes, stream_));
    return Status::OK();
  }
  Status Synchronize() override {
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return Status::OK();
  }
  Status BindThread() override {
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return Status::OK();
  }
  // cudaMalloc hands out large buffers in 2 MiB pages.
  size_t AllocationGranularity() const override { return size_t{2} << 20; }
  size_t FreeMemoryBytes() const override {
    size_t free_b = 0, total = 0;
    if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) return 0;
    return free_b;
  }

  void Embedding(const void* table, DType table_dtype, const int32_t* ids, int n, int dim, float* out) override {
    kn::LaunchEmbedding(table, table_dtype, ids, n, dim, out, stream_);
  }
  void RmsNorm(const float* x, const void* w, DType w_dtype, int n, int dim, float eps, void* out,
               bool out_f32) override {
    kn::LaunchRmsNorm(x, w, w_dtype, n, dim, eps, out, out_f32 ? DType::kF32 : act_, stream_);
  }
  void Linear(const void* x, const LinearWeight& w, int n, float* y, bool accumulate) override {
    // Decode-sized batches: the skinny kernel (chained, W streamed into the
    // tensor cores; bench/results/2026-11-21-h200-skinny-linear.jsonl). cuBLAS otherwise.
    kn::SkinnyLinearArgs sk = SkinnyArgs(x, w, n);
    sk.y = y;
    sk.accumulate = accumulate;
    if (linear_ != LinearKernels::kCublas && n <= kSkinnyRows && kn::SkinnyLinearSupported(sk, w.dtype)) {
      kn::LaunchSkinnyLinear(sk, stream_);
      if (w.bias) kn::LaunchAddBias(y, w.bias, w.dtype, n, w.out, stream_);
      return;
    }
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    // Row-major y[n,out] = x[n,in] W[out,in]^T is column-major y^T = W^T' x^T'.
    cublasStatus_t s =
        cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, w.out, n, w.in, &alpha, w.w, CudaType(w.dtype), w.in, x,
                     CudaType(w.dtype), w.in, &beta, y, CUDA_R_32F, w.out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    CHECK(s == CUBLAS_STATUS_SUCCESS) << "cublasGemmEx: " << CublasName(s);
    if (w.bias) kn::LaunchAddBias(y, w.bias, w.dtype, n, w.out, stream_);
  }
  void LinearSwiGLU(const void* x, const LinearWeight& gate_up, int n, float* gu, void* out) override {
    // The SwiGLU in the skinny kernel's epilogue: a kernel fewer in decode's
    // chain (bench/results/2026-11-21-h200-swiglu.jsonl).
    kn::SkinnyLinearArgs sk = SkinnyArgs(x, gate_up, n);
    sk.out = gate_up.out / 2;
    sk.act_out = out;
    if (linear_ == LinearKernels::kAuto && n <= kSkinnyRows && !gate_up.bias && gate_up.out % 2 == 0 &&
        kn::SkinnyLinearSupported(sk, gate_up.dtype)) {
      kn::LaunchSkinnyLinear(sk, stream_);
      return;
    }
    Backend::LinearSwiGLU(x, gate_up, n, gu, out);
  }
  static kn::SkinnyLinearArgs SkinnyArgs(const void* x, const LinearWeight& w, int n) {
    kn::SkinnyLinearArgs sk;
    sk.x = x;
    sk.w = w.w;
    sk.n = n;
    sk.out = w.out;
    sk.in = w.in;
    return sk;
  }
  void RopeStore(const RopeStoreOp& op) override {
    kn::RopeStoreArgs a;
    a.qkv = op.qkv;
    a.positions = op.positions;
    a.inv_freq = op.inv_freq;
    a.n = op.n;
    a.hq = op.hq;
    a.hkv = op.hkv;
    a.d = op.d;
    a.q_out = op.q_out;
    a.q_dtype = act_;
    a.k_dst = op.k_dst;
    a.v_dst = op.v_dst;
    a.head_stride = op.head_stride;
    a.kv_dtype = act_;
    a.pre_rope_k_out = op.pre_rope_k_out;
    a.pre_rope_k_dst = op.pre_rope_k_dst;
    kn::LaunchRopeStore(a, stream_);
  }
  void SwiGLU(const float* gate_up, int n, int F, void* out) override {
    kn::LaunchSwiGLU(gate_up, n, F, out, act_, stream_);
  }
  void PrefillAttention(const PrefillAttentionOp& op) override {
    kn::PrefillAttentionArgs a;
    a.q = op.q;
    a.k = op.k;
    a.v = op.v;
    a.out = op.out;
    a.dtype = act_;
    a.lse = op.lse;
    a.head_stride = op.head_stride;
    a.q_start = op.q_start;
    a.nq = op.nq;
    a.hq = op.hq;
    a.hkv = op.hkv;
    a.d = op.d;
    a.scale = op.scale;
    kn::LaunchPrefillAttention(a, stream_);
  }
  Status DecodeAttention(const DecodeAttentionOp& op) override {
    PENUMBRA_RETURN_IF_ERROR(
        GrowWorkspace(&decode_ws_, kn::DecodeAttentionWorkspaceBytes(op.batch, op.hq, op.d, op.max_length)));
    kn::DecodeAttentionArgs a;
    a.q = op.q;
    a.k = op.k;
    a.v = op.v;
    a.lengths = op.lengths;
    a.out = op.out;
    a.lse = op.lse;
    a.dtype = act_;
    a.head_stride = op.head_stride;
    a.batch = op.batch;
    a.hq = op.hq;
    a.hkv = op.hkv;
    a.d = op.d;
    a.max_length = op.max_length;
    a.scale = op.scale;
    a.slot_maps = op.slot_maps;
    a.slot_row0 = op.slot_row0;
    a.slot_count = op.slot_count;
    a.slot_rows = op.slot_rows;
    a.slot_values = op.slot_values;
    a.slot_values_stride = op.slot_values_stride;
    a.slot_values_chunks = op.slot_values_chunks;
    a.workspace = decode_ws_.get();
    a.workspace_bytes = decode_ws_.bytes();
    kn::LaunchDecodeAttention(a, stream_);
    return Status::OK();
  }
  Status PrefixAttention(const PrefixAttentionOp& op) override {
    PENUMBRA_RETURN_IF_ERROR(
        GrowWorkspace(&prefix_ws_, kn::PrefixAttentionWorkspaceBytes(op.n, op.hq, op.hkv, op.d, op.keys)));
    kn::PrefixAttentionArgs a;
    a.q = op.q;
    a.rows = op.rows;
    a.n = op.n;
    a.k = op.k;
    a.v = op.v;
    a.head_stride = op.head_stride;
    a.keys = op.keys;
    a.out = op.out;
    a.own_lse = op.own_lse;
    a.lse_out = op.lse_out;
    a.dtype = act_;
    a.hq = op.hq;
    a.hkv = op.hkv;
    a.d = op.d;
    a.scale = op.scale;
    a.workspace = prefix_ws_.get();
    a.workspace_bytes = prefix_ws_.bytes();
    kn::LaunchPrefixAttention(a, stream_);
    return Status::OK();
  }
  void MergeAttentionParts(const MergeParts& m) override {
    kn::MergeAttentionArgs a;
    a.x = m.x;
    a.x_part_stride = m.x_part_stride;
    a.lse = m.lse;
    a.lse_part_stride = m.lse_part_stride;
    a.parts = m.parts;
    a.rows = m.rows;
    a.d = m.d;
    a.out = m.out;
    a.lse_out = m.lse_out;
    a.dtype = act_;
    kn::LaunchMergeAttention(a, stream_);
  }
  Status Sample(const float* logits, int rows, int vocab, const std::vector<SampleParams>& params,
                int32_t* out_host) override {
    for (int r0 = 0; r0 < rows; r0 += kMaxSampleRows) {
      const int nr = std::min(kMaxSampleRows, rows - r0);
      std::vector<kn::SamplingRow> p(nr);
      for (int i = 0; i < nr; ++i) {
        const SampleParams& s = params[r0 + i];
        p[i] = {s.temperature, s.top_k, s.top_p, s.uniform};
      }
      PENUMBRA_RETURN_IF_ERROR(CopyToDevice(sample_params_, p.data(), sizeof(kn::SamplingRow) * nr));
      kn::LaunchSample(logits + static_cast<int64_t>(r0) * vocab, nr, vocab,
                       static_cast<const kn::SamplingRow*>(sample_params_), static_cast<int32_t*>(sample_out_),
                       stream_);
      PENUMBRA_RETURN_IF_ERROR(CopyToHost(out_host + r0, sample_out_, sizeof(int32_t) * nr));
    }
    return Status::OK();
  }
  void Convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n) override {
    kn::LaunchConvert(src, src_dtype, dst, dst_dtype, n, stream_);
  }
  void FillRandomNormal(void* dst, DType dtype, int64_t n, float std, uint64_t seed) override {
    kn::LaunchFillRandomNormal(dst, dtype, n, std, seed, stream_);
  }

  Status Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height) override {
    PENUMBRA_CUDA_RETURN_IF_ERROR(
        cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDefault, stream_));
    return Status::OK();
  }

  Status LowRankFactor(kn::LowRankArgs a) override {
    a.key_dtype = DType::kF32;
    a.factor_dtype = act_;
    PENUMBRA_ASSIGN_OR_RETURN(size_t need, kn::LowRankWorkspaceBytes(solver_, a.S, a.hkv * a.d, a.rank));
    PENUMBRA_RETURN_IF_ERROR(GrowWorkspace(&lowrank_ws_, need));
    a.workspace = lowrank_ws_.get();
    a.workspace_bytes = lowrank_ws_.bytes();
    return kn::LowRankFactor(a, cublas_, solver_, stream_);
  }
  void ProjectKeys(kn::ProjectKeysArgs a) override {
    a.key_dtype = DType::kF32;
    a.out_dtype = act_;
    kn::LaunchProjectKeys(a, stream_);
  }
  void ChunkLandmarks(kn::ChunkLandmarksArgs a) override {
    a.kv_dtype = act_;
    a.landmark_dtype = act_;
    kn::LaunchChunkLandmarks(a, stream_);
  }
  void SelectOutlierChunks(const kn::SelectOutliersArgs& a) override { kn::LaunchSelectOutlierChunks(a, stream_); }
  void GatherOutliers(kn::GatherOutliersArgs a) override {
    a.kv_dtype = act_;
    kn::LaunchGatherOutliers(a, stream_);
  }
  Status ShadowkvScore(kn::ShadowkvScoreArgs a) override { return Score(a, nullptr); }
  Status ShadowkvScoreAndSlotUpdate(kn::ShadowkvScoreArgs a, const kn::ShadowkvSlotUpdateArgs& u) override {
    return Score(a, &u);
  }
  Status Score(kn::ShadowkvScoreArgs a, const kn::ShadowkvSlotUpdateArgs* then_update) {
    a.q_dtype = act_;
    a.dtype = act_;
    // A context-parallel score's first call keeps its logits in its part's
    // workspace until its second call (other groups score in between).
    if (a.workspace_part < 0 || a.workspace_part >= kMaxScoreParts) {
      return Status::InvalidArgument("ShadowkvScore: workspace_part out of range");
    }
    if (static_cast<int>(score_ws_.size()) <= a.workspace_part) score_ws_.resize(a.workspace_part + 1);
    DeviceBuffer& ws = score_ws_[a.workspace_part];
    PENUMBRA_RETURN_IF_ERROR(GrowWorkspace(&ws, kn::ShadowkvScoreWorkspaceBytes(a)));
    a.workspace = ws.get();
    a.workspace_bytes = ws.bytes();
    kn::LaunchShadowkvScore(a, stream_, then_update);
    return Status::OK();
  }
  void ShadowkvGlobalSelectAndSlotUpdate(const kn::ShadowkvGlobalSelectArgs& a,
                                         const kn::ShadowkvSlotUpdateArgs& u) override {
    kn::LaunchShadowkvGlobalSelect(a, stream_, &u);
  }
  void TopK(const kn::TopKArgs& a) override { kn::LaunchTopK(a, stream_); }
  void MaxRows(const kn::MaxRowsArgs& a) override { kn::LaunchMaxRows(a, stream_); }
  Status ShadowkvQueryScores(kn::ShadowkvQueryScoresArgs a) override {
    a.score.q_dtype = act_;
    a.score.dtype = act_;
    const kn::ShadowkvScoreArgs& s = a.score;
    PENUMBRA_RETURN_IF_ERROR(GrowWorkspace(
        &query_ws_, kn::ShadowkvQueryScoresWorkspaceBytes(a.rows, s.hq, s.hkv, s.max_chunks, s.landmarks_per_chunk)));
    a.workspace = query_ws_.get();
    a.workspace_bytes = query_ws_.bytes();
    if (kn::LaunchShadowkvQueryScores(a, stream_)) return Status::OK();
    // A shape the tensor-core path does not cover (f32, other head sizes).
    PENUMBRA_RETURN_IF_ERROR(GrowWorkspace(
        &query_ws_, sizeof(float) * static_cast<size_t>(std::max(s.batch, 1)) * s.hkv * std::max(s.max_chunks, 1)));
    return QueryScoresRowByRow(a, query_ws_.as<float>());
  }
  void ShadowkvSlotUpdate(const kn::ShadowkvSlotUpdateArgs& a) override { kn::LaunchShadowkvSlotUpdate(a, stream_); }
  void ShadowkvRebuildK(kn::ShadowkvRebuildKArgs a) override {
    a.dtype = act_;
    kn::LaunchShadowkvRebuildK(a, stream_);
  }
  void ShadowkvFetchV(kn::ShadowkvFetchVArgs a, bool staged) override {
    a.dtype = act_;
    cudaStream_t s = forked_ ? side_ : stream_;
    if (timeline_on_) RecordTimeline(s);
    if (staged) {
      kn::LaunchShadowkvScatterV(a, s);
    } else {
      kn::LaunchShadowkvFetchV(a, s);
    }
    if (timeline_on_) RecordTimeline(s);
  }
  void EncodeValuesFp8(const void* src, int64_t rows, int chunk_tokens, int d, void* dst) override {
    kn::LaunchEncodeValuesFp8(src, act_, rows, chunk_tokens, d, static_cast<uint8_t*>(dst), stream_);
  }
  Status SpindlekvAttention(const kn::SpindlekvAttentionArgs& op) override {
    if (!kn::SpindlekvAttentionSupported(op.hq, op.hkv, op.d)) {
      return Status::InvalidArgument(
          "spindlekv attention on CUDA takes head_dim a multiple of 32 up to 256 and at "
          "most 8 query heads per KV head; got hq " +
          std::to_string(op.hq) + ", hkv " + std::to_string(op.hkv) + ", d " + std::to_string(op.d));
    }
    if (op.dtype != act_) return Status::InvalidArgument("spindlekv attention: entries of another dtype");
    kn::SpindlekvAttentionArgs a = op;
    // Enough blocks for the machine (8 a multiprocessor at 132: a block's
    // warps wait on gathered entries), no split under 1024 tokens (8 tiles
    // of 32 a warp).
    const int64_t rows = std::max(1, a.batch * a.hkv);
    const int64_t by_tokens = (a.max_tokens + 1023) / 1024, by_blocks = (1056 + rows - 1) / rows;
    a.splits = static_cast<int>(std::clamp<int64_t>(std::min(by_tokens, by_blocks), 1, 256));
    if (a.splits > 1) {
      PENUMBRA_RETURN_IF_ERROR(GrowWorkspace(&spindle_ws_, kn::SpindlekvWorkspaceFloats(a) * sizeof(float)));
      a.workspace = spindle_ws_.as<float>();
    }
    kn::LaunchSpindlekvAttention(a, stream_);
    return Status::OK();
  }
  Status SpindlekvWindowScores(const kn::SpindlekvWindowScoresArgs& op) override {
    if (!kn::SpindlekvWindowScoresSupported(op.d) || op.hkv < 1 || op.hq % op.hkv != 0) {
      return Status::InvalidArgument("spindlekv window scores on CUDA: hq " + std::to_string(op.hq) + ", hkv " +
                                     std::to_string(op.hkv) + ", d " + std::to_string(op.d));
    }
    kn::SpindlekvWindowScoresArgs a = op;
    PENUMBRA_RETURN_IF_ERROR(
        GrowWorkspace(&spindle_compress_ws_, kn::SpindlekvWindowScoresWorkspaceFloats(a) * sizeof(float)));
    a.workspace = spindle_compress_ws_.as<float>();
    kn::LaunchSpindlekvWindowScores(a, stream_);
    return Status::OK();
  }
  Status SpindlekvSelect(const kn::SpindlekvSelectArgs& op) override {
    if (op.hkv < 1 || op.hq % op.hkv != 0 || op.hq / op.hkv > 32) {
      return Status::InvalidArgument("spindlekv select: bad head counts");
    }
    if (op.n >= std::numeric_limits<int32_t>::max()) {
      return Status::InvalidArgument("spindlekv select: " + std::to_string(op.n) + " tokens (positions are int32)");
    }
    kn::SpindlekvSelectArgs a = op;
    PENUMBRA_RETURN_IF_ERROR(GrowWorkspace(&spindle_compress_ws_, kn::SpindlekvSelectWorkspaceBytes(a)));
    a.workspace = spindle_compress_ws_.get();
    kn::LaunchSpindlekvSelect(a, stream_);
    return Status::OK();
  }
  Status SpindlekvBuildCodebook(const kn::SpindlekvCodebookArgs& op) override {
    if (!kn::SpindlekvCodebookSupported(op.d, op.block)) {
      return Status::InvalidArgument(
          "spindlekv codebooks on CUDA take head_dim a multiple of 32 up to 256 and "
          "blocks of 1 to 1024 rows; got d " +
          std::to_string(op.d) + ", block " + std::to_string(op.block));
    }
    kn::SpindlekvCodebookArgs a = op;
    PENUMBRA_RETURN_IF_ERROR(GrowWorkspace(&spindle_compress_ws_, kn::SpindlekvCodebookWorkspaceBytes(a)));
    a.workspace = spindle_compress_ws_.get();
    kn::LaunchSpindlekvBuildCodebook(a, stream_);
    return Status::OK();
  }
  Status SpindlekvMerge(const kn::SpindlekvMergeArgs& op) override {
    if (!kn::SpindlekvCodebookSupported(op.d, 1) || op.hkv < 1 || op.hq % op.hkv != 0 || op.hq / op.hkv > 32) {
      return Status::InvalidArgument("spindlekv merge on CUDA: hq " + std::to_string(op.hq) + ", hkv " +
                                     std::to_string(op.hkv) + ", d " + std::to_string(op.d));
    }
    kn::SpindlekvMergeArgs a = op;
    // The search's blocks: 8 a multiprocessor at 132 over the (sequence, KV
    // head, keys or values) codebooks.
    const int64_t searches = std::max(1, 2 * a.batch * a.hkv);
    a.splits = static_cast<int>(std::clamp<int64_t>((1056 + searches - 1) / searches, 1, 256));
    PENUMBRA_RETURN_IF_ERROR(GrowWorkspace(&spindle_merge_ws_, kn::SpindlekvMergeWorkspaceBytes(a)));
    a.workspace = spindle_merge_ws_.get();
    kn::LaunchSpindlekvMerge(a, stream_);
    return Status::OK();
  }
  Status PrepareFetchTurns(int layers) override {
    while (static_cast<int>(fetch_done_.size()) < layers) {
      cudaEvent_t e = nullptr;
      PENUMBRA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      fetch_done_.push_back(e);
    }
    return Status::OK();
  }
  void RecordFetchDone(int layer) override {
    CHECK(layer >= 0 && layer < static_cast<int>(fetch_done_.size())) << "RecordFetchDone: layer " << layer;
    PENUMBRA_CUDA_CHECK(cudaEventRecord(fetch_done_[layer], side_));
  }
  void WaitFetchDone(Backend& other, int layer) override {
    auto* o = dynamic_cast<CudaBackend*>(&other);
    CHECK(o != nullptr) << "WaitFetchDone: the other lane's backend is not a CUDA backend";
    // fetch_done_ is not resized after PrepareFetchTurns, so reading it from
    // this lane's thread is safe.
    CHECK(layer >= 0 && layer < static_cast<int>(o->fetch_done_.size())) << "WaitFetchDone: layer " << layer;
    PENUMBRA_CUDA_CHECK(cudaStreamWaitEvent(side_, o->fetch_done_[layer], 0));
  }
  void SetFetchTimeline(bool on) override {
    timeline_on_ = on;
    if (!on) return;
    timeline_used_ = 0;
    // The process-wide reference: recorded once, before anything it measures.
    static std::once_flag once;
    std::call_once(once, [this] {
      PENUMBRA_CUDA_CHECK(cudaEventCreate(&TimelineReference()));
      PENUMBRA_CUDA_CHECK(cudaEventRecord(TimelineReference(), stream_));
    });
  }
  Result<std::vector<Interval>> FetchIntervals() override {
    std::vector<Interval> out;
    for (size_t i = 0; i + 1 < timeline_used_; i += 2) {
      float t0 = 0, t1 = 0;
      PENUMBRA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(timeline_[i + 1]));
      PENUMBRA_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&t0, TimelineReference(), timeline_[i]));
      PENUMBRA_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&t1, TimelineReference(), timeline_[i + 1]));
      out.push_back({t0, t1});
    }
    return out;
  }
  void ForkSide() override {
    PENUMBRA_CUDA_CHECK(cudaEventRecord(fork_ev_, stream_));
    PENUMBRA_CUDA_CHECK(cudaStreamWaitEvent(side_, fork_ev_, 0));
    forked_ = true;
  }
  void JoinSide() override {
    PENUMBRA_CUDA_CHECK(cudaEventRecord(join_ev_, side_));
    PENUMBRA_CUDA_CHECK(cudaStreamWaitEvent(stream_, join_ev_, 0));
    forked_ = false;
  }
  void JoinSideLater(int mark) override {
    CHECK(mark >= 0 && mark < kSideMarks) << "side mark " << mark;
    PENUMBRA_CUDA_CHECK(cudaEventRecord(marks_[mark], side_));
    forked_ = false;
  }
  void WaitSideMark(int mark) override {
    CHECK(mark >= 0 && mark < kSideMarks) << "side mark " << mark;
    PENUMBRA_CUDA_CHECK(cudaStreamWaitEvent(stream_, marks_[mark], 0));
  }

  cudaStream_t stream() const { return stream_; }
  void* native_stream() const override { return stream_; }
  int device_index() const override { return device_; }

 private:
  static cudaEvent_t& TimelineReference() {
    static cudaEvent_t ref = nullptr;
    return ref;
  }
  void RecordTimeline(cudaStream_t s) {
    if (timeline_used_ == timeline_.size()) {
      cudaEvent_t e = nullptr;
      PENUMBRA_CUDA_CHECK(cudaEventCreate(&e));
      timeline_.push_back(e);
    }
    PENUMBRA_CUDA_CHECK(cudaEventRecord(timeline_[timeline_used_++], s));
  }

  size_t WorkspaceBytes() const override {
    size_t n = lowrank_ws_.bytes() + query_ws_.bytes() + decode_ws_.bytes() + prefix_ws_.bytes() + spindle_ws_.bytes();
    for (const DeviceBuffer& ws : score_ws_) n += ws.bytes();
    return n;
  }

  // Reallocates `ws` when it is smaller than `need`, after the stream has
  // finished with the old one.
  Status GrowWorkspace(DeviceBuffer* ws, size_t need) {
    if (need <= ws->bytes()) return Status::OK();
    PENUMBRA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    PENUMBRA_ASSIGN_OR_RETURN(*ws, Allocate(need));
    return Status::OK();
  }

  // A step's groups name one part each (ShadowKvPolicy's global selection),
  // at most one per sequence of the batch; the bound only catches a bad part.
  static constexpr int kMaxScoreParts = 1 << 16;
  DeviceBuffer lowrank_ws_;
  DeviceBuffer spindle_ws_;             // SpindlekvAttention's splits
  DeviceBuffer spindle_compress_ws_;    // SpindleKV's compression ops (one at a time on the stream)
  DeviceBuffer spindle_merge_ws_;       // SpindlekvMerge's split searches
  std::vector<DeviceBuffer> score_ws_;  // per workspace_part
  DeviceBuffer query_ws_;               // ShadowkvQueryScores (either path)
  cusolverDnHandle_t solver_ = nullptr;
  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_ev_ = nullptr, join_ev_ = nullptr;
  cudaEvent_t marks_[kSideMarks] = {};
  bool forked_ = false;
  std::vector<cudaEvent_t> fetch_done_;  // [layer]: this lane's last value fetch of the layer (fetch turns)
  bool timeline_on_ = false;
  std::vector<cudaEvent_t> timeline_;  // fetch start/end pairs, reused across runs
  size_t timeline_used_ = 0;
  static constexpr int kMaxSampleRows = 1024;
  int device_;
  DType act_;
  LinearKernels linear_;  // BackendOptions::linear: skinny kernel unless kCublas; LinearSwiGLU fused with kAuto
  // The skinny kernel takes batches up to this many rows: on the H200 it is
  // within ~10% of cuBLAS on every Llama-8B projection there, and chained;
  // at 14-16 rows it is 4-18% slower (bench/results/2026-11-21-h200-skinny-linear.jsonl).
  static constexpr int kSkinnyRows = 8;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  void* sample_params_ = nullptr;
  void* sample_out_ = nullptr;
  DeviceBuffer decode_ws_;
  DeviceBuffer prefix_ws_;
};

}  // namespace

bool CudaBackendCompiled() { return true; }

bool CudaDevicePresent() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

Result<std::unique_ptr<Backend>> CreateCudaBackend(const BackendOptions& options) {
  if (!CudaDevicePresent()) return Status::Unavailable("--device cuda: no CUDA device is present");
  DType act = DType::kBF16;
  if (options.dtype == "f32") {
    act = DType::kF32;
  } else if (options.dtype != "auto" && options.dtype != "bf16") {
    return Status::InvalidArgument("unknown dtype '" + options.dtype + "' (expected bf16, f32 or auto)");
  }
  PENUMBRA_ASSIGN_OR_RETURN(const LinearKernels linear, ParseLinearKernels(options.linear));
  kn::SetChainedLaunch(options.chained_launch);
  auto b = std::make_unique<CudaBackend>(options.cuda_device, act, linear);
  PENUMBRA_RETURN_IF_ERROR(b->Init());
  return std::unique_ptr<Backend>(std::move(b));
}

}  // namespace penumbra
