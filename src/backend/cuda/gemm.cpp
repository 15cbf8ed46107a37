#include "backend/cuda/gemm.h"
#include "core/tuning.h"

#include <algorithm>

#include <cstdlib>

namespace spade::cuda {

Gemm::Gemm(DeviceArena& arena, size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  SPADE_CUBLAS(cublasLtCreate(&handle_));
  workspace_ = arena.alloc(workspace_bytes, "cuBLASLt workspace");
  if (tuning().gemv_max_m >= 0) set_small_m(tuning().gemv_max_m);
}

Gemm::~Gemm() {
  for (auto& [k, p] : plans_) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.op);
  }
  if (handle_) cublasLtDestroy(handle_);
}

// Column-major view: C[N, M] = op(A) * B with A = W stored [N,K] row-major = [K,N] col-major
// (transposed), B = x stored [M,K] row-major = [K,M] col-major, C = y [M,N] row-major =
// [N,M] col-major.
Gemm::Plan& Gemm::plan(int M, int N, int K, bool out_bf16, bool accumulate) {
  auto key = std::make_tuple(M, N, K, out_bf16, accumulate);
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  Plan p;
  SPADE_CUBLAS(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  SPADE_CUBLAS(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  SPADE_CUBLAS(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  SPADE_CUBLAS(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, K, N, K));
  SPADE_CUBLAS(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, K, M, K));
  SPADE_CUBLAS(cublasLtMatrixLayoutCreate(&p.c, out_bf16 ? CUDA_R_16BF : CUDA_R_32F, N, M, N));
  cublasLtMatmulPreference_t pref;
  SPADE_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
  SPADE_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_, sizeof(workspace_bytes_)));
  cublasLtMatmulHeuristicResult_t res[1];
  int n = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.c, p.c, pref, 1,
                                                      res, &n);
  cublasLtMatmulPreferenceDestroy(pref);
  SPADE_CHECK(st == CUBLAS_STATUS_SUCCESS && n > 0, "cuBLASLt: no algorithm for bf16 GEMM M=",
              M, " N=", N, " K=", K, " (status ", int(st), ")");
  p.algo = res[0].algo;
  (void)accumulate;
  return plans_.emplace(key, p).first->second;
}

void Gemm::run(const bf16* x, const bf16* W, void* y, int M, int N, int K, bool out_bf16,
               float beta, cudaStream_t s) {
  if (M == 0) return;
  Plan& p = plan(M, N, K, out_bf16, beta != 0.f);
  const float alpha = 1.f;
  SPADE_CUBLAS(cublasLtMatmul(handle_, p.op, &alpha, W, p.a, x, p.b, &beta, y, p.c, y, p.c,
                              &p.algo, workspace_, workspace_bytes_, s));
}

void Gemm::run_f32(const bf16* x, const bf16* W, float* y, int M, int N, int K, float beta,
                   cudaStream_t s) {
  if (batch_invariant_) {
    SPADE_CHECK(M == 0 || gemv_supported(x, W, 1, K), "batch-invariant GEMM: operands the decode "
                "GEMV does not take (K = ", K, ", 16-byte aligned rows needed)");
    for (int m0 = 0; m0 < M; m0 += kGemvMaxM)
      gemv_f32(x + int64_t(m0) * K, W, y + int64_t(m0) * N, std::min(kGemvMaxM, M - m0), N, K, beta, s);
    return;
  }
  if (M >= 1 && M <= small_m_ && gemv_supported(x, W, M, K)) return gemv_f32(x, W, y, M, N, K, beta, s);
  run(x, W, y, M, N, K, false, beta, s);
}

void Gemm::run_bf16(const bf16* x, const bf16* W, bf16* y, int M, int N, int K,
                    cudaStream_t s) {
  run(x, W, y, M, N, K, true, 0.f, s);
}

}  // namespace spade::cuda
