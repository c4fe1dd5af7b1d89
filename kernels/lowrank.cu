#include "kernels/lowrank.cuh"

#include <algorithm>
#include <string>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/cuda_check.h"

namespace penumbra::kernels {
namespace {

constexpr int64_t kTileRows = 4096;  // rows of K per A = K P GEMM tile
constexpr size_t kAlign = 256;

size_t AlignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

Status BlasStatus(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::OK();
  std::string msg = std::string(what) + ": " + cublasGetStatusString(s);
  if (s == CUBLAS_STATUS_ALLOC_FAILED) return Status::ResourceExhausted(msg);
  return Status::Internal(msg);
}
Status SolverStatus(cusolverStatus_t s, const char* what) {
  if (s == CUSOLVER_STATUS_SUCCESS) return Status::OK();
  std::string msg = std::string(what) + ": cusolver status " + std::to_string(static_cast<int>(s));
  if (s == CUSOLVER_STATUS_ALLOC_FAILED) return Status::ResourceExhausted(msg);
  return Status::Internal(msg);
}
#define LR_BLAS(expr) PENUMBRA_RETURN_IF_ERROR(BlasStatus((expr), #expr))
#define LR_SOLVER(expr) PENUMBRA_RETURN_IF_ERROR(SolverStatus((expr), #expr))

// Workspace carve-up; every piece 256-byte aligned.
struct Layout {
  size_t gram = 0, eigvals = 0, info = 0, solver = 0, key_tile = 0, a_tile = 0, total = 0;
};
Layout MakeLayout(int64_t S, int D, int rank, int lwork) {
  Layout l;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += AlignUp(bytes);
    return at;
  };
  const int64_t tile = std::min<int64_t>(S, kTileRows);
  l.gram = take(sizeof(float) * static_cast<size_t>(D) * D);
  l.eigvals = take(sizeof(float) * D);
  l.info = take(sizeof(int));
  l.solver = take(sizeof(float) * static_cast<size_t>(std::max(lwork, 1)));
  l.key_tile = take(sizeof(float) * static_cast<size_t>(tile) * D);
  l.a_tile = take(sizeof(float) * static_cast<size_t>(tile) * rank);
  l.total = off;
  return l;
}

// Restores the handle's math mode when leaving LowRankFactor.
class MathModeGuard {
 public:
  explicit MathModeGuard(cublasHandle_t h) : h_(h) { ok_ = cublasGetMathMode(h_, &saved_) == CUBLAS_STATUS_SUCCESS; }
  ~MathModeGuard() {
    if (ok_) (void)cublasSetMathMode(h_, saved_);
  }
  MathModeGuard(const MathModeGuard&) = delete;
  MathModeGuard& operator=(const MathModeGuard&) = delete;

 private:
  cublasHandle_t h_;
  cublasMath_t saved_ = CUBLAS_DEFAULT_MATH;
  bool ok_ = false;
};

template <typename Src, typename Dst>
__global__ void ConvertKernel(const Src* __restrict__ src, Dst* __restrict__ dst, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = FromF32<Dst>(ToF32<Src>(src[i]));
}
template <typename Src, typename Dst>
void Convert(const Src* src, Dst* dst, int64_t n, cudaStream_t stream) {
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 8192);
  ConvertKernel<Src, Dst><<<static_cast<int>(blocks), threads, 0, stream>>>(src, dst, n);
}

// One block per kept component i (eigenvector column D-1-i of `vecs`, which is
// column-major so the column is contiguous). Writes sigma, P[:, i], B rows.
template <typename T>
__global__ void ComponentsKernel(const float* __restrict__ vecs, const float* __restrict__ eigvals, int D, int d,
                                 int rank, float* __restrict__ proj, T* __restrict__ b, float* __restrict__ sigma_out) {
  const int i = blockIdx.x;
  const int col = D - 1 - i;
  const float* v = vecs + static_cast<size_t>(col) * D;
  // Largest |v_k|, lowest k on ties.
  float best = -1.0f;
  int arg = D;
  for (int k = threadIdx.x; k < D; k += blockDim.x) {
    const float m = fabsf(v[k]);
    if (m > best) best = m, arg = k;  // k increases per thread, so ties keep the lower k
  }
  __shared__ float s_best[32];
  __shared__ int s_arg[32];
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
    if (ob > best || (ob == best && oa < arg)) best = ob, arg = oa;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) s_best[warp] = best, s_arg[warp] = arg;
  __syncthreads();
  if (warp == 0) {
    best = lane < warps ? s_best[lane] : -1.0f;
    arg = lane < warps ? s_arg[lane] : D;
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
      if (ob > best || (ob == best && oa < arg)) best = ob, arg = oa;
    }
    if (lane == 0) s_arg[0] = arg;
  }
  __syncthreads();
  arg = s_arg[0];
  const float sign = (arg < D && v[arg] < 0.0f) ? -1.0f : 1.0f;
  const float sigma0 = sqrtf(fmaxf(eigvals[D - 1], 0.0f));
  const float sigma = sqrtf(fmaxf(eigvals[col], 0.0f));
  const bool zero = !(sigma > 0.0f) || sigma < 1e-6f * sigma0;
  const float inv = zero ? 0.0f : sign / sigma;
  const float scale = zero ? 0.0f : sign * sigma;
  for (int k = threadIdx.x; k < D; k += blockDim.x) {
    const float x = v[k];
    proj[static_cast<size_t>(k) * rank + i] = x * inv;
    const int h = k / d, j = k - h * d;
    b[(static_cast<size_t>(h) * rank + i) * d + j] = FromF32<T>(x * scale);
  }
  if (threadIdx.x == 0 && sigma_out) sigma_out[i] = sigma;
}

template <typename Tin, typename Tout>
__global__ void ProjectKeysKernel(const Tin* __restrict__ keys, int D, int rank, const float* __restrict__ proj,
                                  Tout* __restrict__ out, int64_t out_stride, int64_t keys_batch_stride,
                                  int64_t proj_batch_stride, int64_t out_batch_stride) {
  extern __shared__ float s_key[];
  const int t = blockIdx.x;
  keys += blockIdx.z * keys_batch_stride;
  proj += blockIdx.z * proj_batch_stride;
  out += blockIdx.z * out_batch_stride;
  for (int k = threadIdx.x; k < D; k += blockDim.x) s_key[k] = ToF32<Tin>(keys[static_cast<size_t>(t) * D + k]);
  __syncthreads();
  const int i = blockIdx.y * blockDim.x + threadIdx.x;
  if (i >= rank) return;
  float acc = 0.0f;
  for (int k = 0; k < D; ++k) acc = fmaf(s_key[k], proj[static_cast<size_t>(k) * rank + i], acc);
  out[static_cast<size_t>(t) * out_stride + i] = FromF32<Tout>(acc);
}

}  // namespace

Result<size_t> LowRankWorkspaceBytes(cusolverDnHandle_t solver, int64_t S, int D, int rank) {
  if (S < 1 || D < 1 || rank < 1 || rank > D) return Status::InvalidArgument("LowRankWorkspaceBytes: bad sizes");
  int lwork = 0;
  LR_SOLVER(cusolverDnSsyevd_bufferSize(solver, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, D, nullptr, D,
                                        nullptr, &lwork));
  return MakeLayout(S, D, rank, lwork).total;
}

Status LowRankFactor(const LowRankArgs& a, cublasHandle_t blas, cusolverDnHandle_t solver, cudaStream_t stream) {
  const int D = a.hkv * a.d;
  if (a.S < 1 || a.S > INT32_MAX || a.hkv < 1 || a.d < 1 || a.rank < 1 || a.rank > D)
    return Status::InvalidArgument("LowRankFactor: S " + std::to_string(a.S) + ", D " + std::to_string(D) + ", rank " +
                                   std::to_string(a.rank));
  if ((a.key_dtype != DType::kF32 && a.key_dtype != DType::kBF16) ||
      (a.factor_dtype != DType::kF32 && a.factor_dtype != DType::kBF16))
    return Status::InvalidArgument("LowRankFactor: keys and factors must be f32 or bf16");
  if (!a.keys || !a.a_out || !a.b_out || !a.proj_out || !a.workspace)
    return Status::InvalidArgument("LowRankFactor: null pointer");
  const int r = a.rank;
  const int S = static_cast<int>(a.S);

  LR_BLAS(cublasSetStream(blas, stream));
  LR_SOLVER(cusolverDnSetStream(solver, stream));
  // The Gram matrix and eigenvalue offsets do not depend on lwork.
  char* ws = static_cast<char*>(a.workspace);
  const Layout l0 = MakeLayout(a.S, D, r, 0);
  float* gram = reinterpret_cast<float*>(ws + l0.gram);
  float* eigvals = reinterpret_cast<float*>(ws + l0.eigvals);
  int lwork = 0;
  LR_SOLVER(cusolverDnSsyevd_bufferSize(solver, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, D, gram, D, eigvals,
                                        &lwork));
  const Layout l = MakeLayout(a.S, D, r, lwork);
  if (a.workspace_bytes < l.total)
    return Status::InvalidArgument("LowRankFactor: workspace " + std::to_string(a.workspace_bytes) + " < " +
                                   std::to_string(l.total));
  int* info = reinterpret_cast<int*>(ws + l.info);
  float* solver_ws = reinterpret_cast<float*>(ws + l.solver);
  float* key_tile = reinterpret_cast<float*>(ws + l.key_tile);
  float* a_tile = reinterpret_cast<float*>(ws + l.a_tile);

  MathModeGuard guard(blas);
  LR_BLAS(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH));
  const float one = 1.0f, zero = 0.0f;
  const cudaDataType_t kt = a.key_dtype == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
  // Row-major K [S, D] is column-major K^T [D, S]; G = K^T (K^T)^T.
  LR_BLAS(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, D, D, S, &one, a.keys, kt, D, a.keys, kt, D, &zero, gram,
                       CUDA_R_32F, D, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  LR_SOLVER(cusolverDnSsyevd(solver, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, D, gram, D, eigvals, solver_ws,
                             lwork, info));
  int info_host = 0;
  PENUMBRA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&info_host, info, sizeof(int), cudaMemcpyDeviceToHost, stream));
  PENUMBRA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (info_host != 0) return Status::Internal("cusolverDnSsyevd: info " + std::to_string(info_host));

  if (a.factor_dtype == DType::kBF16) {
    ComponentsKernel<__nv_bfloat16><<<r, 256, 0, stream>>>(gram, eigvals, D, a.d, r, a.proj_out,
                                                           static_cast<__nv_bfloat16*>(a.b_out), a.sigma_out);
  } else {
    ComponentsKernel<float>
        <<<r, 256, 0, stream>>>(gram, eigvals, D, a.d, r, a.proj_out, static_cast<float*>(a.b_out), a.sigma_out);
  }
  PENUMBRA_CUDA_RETURN_IF_ERROR(cudaGetLastError());

  // A = K P in row tiles: column-major A^T [r, rows] = P^T [r, D] * K^T [D, rows].
  for (int64_t t0 = 0; t0 < a.S; t0 += kTileRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kTileRows, a.S - t0));
    const float* k_f32;
    if (a.key_dtype == DType::kBF16) {
      Convert(static_cast<const __nv_bfloat16*>(a.keys) + t0 * D, key_tile, static_cast<int64_t>(rows) * D, stream);
      k_f32 = key_tile;
    } else {
      k_f32 = static_cast<const float*>(a.keys) + t0 * D;
    }
    float* c = a.factor_dtype == DType::kF32 ? static_cast<float*>(a.a_out) + t0 * r : a_tile;
    LR_BLAS(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, r, rows, D, &one, a.proj_out, CUDA_R_32F, r, k_f32, CUDA_R_32F,
                         D, &zero, c, CUDA_R_32F, r, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    if (a.factor_dtype == DType::kBF16)
      Convert(a_tile, static_cast<__nv_bfloat16*>(a.a_out) + t0 * r, static_cast<int64_t>(rows) * r, stream);
  }
  PENUMBRA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::OK();
}

void LaunchProjectKeys(const ProjectKeysArgs& a, cudaStream_t stream) {
  if (a.n <= 0) return;
  const int threads = 128;
  if (a.batch <= 0) return;
  CHECK_LE(a.batch, 65535) << "ProjectKeys: batch";
  const dim3 grid(a.n, (a.rank + threads - 1) / threads, a.batch);
  const size_t smem = sizeof(float) * a.D;
  const int64_t stride = a.a_row_stride > 0 ? a.a_row_stride : a.rank;
  auto launch = [&](auto* keys, auto* out) {
    using Tin = std::remove_cv_t<std::remove_pointer_t<decltype(keys)>>;
    using Tout = std::remove_pointer_t<decltype(out)>;
    ProjectKeysKernel<Tin, Tout><<<grid, threads, smem, stream>>>(
        keys, a.D, a.rank, a.proj, out, stride, a.keys_batch_stride, a.proj_batch_stride, a.a_batch_stride);
  };
  const bool kb = a.key_dtype == DType::kBF16, ob = a.out_dtype == DType::kBF16;
  if (kb && ob) launch(static_cast<const __nv_bfloat16*>(a.keys), static_cast<__nv_bfloat16*>(a.a_out));
  if (kb && !ob) launch(static_cast<const __nv_bfloat16*>(a.keys), static_cast<float*>(a.a_out));
  if (!kb && ob) launch(static_cast<const float*>(a.keys), static_cast<__nv_bfloat16*>(a.a_out));
  if (!kb && !ob) launch(static_cast<const float*>(a.keys), static_cast<float*>(a.a_out));
}

}  // namespace penumbra::kernels
