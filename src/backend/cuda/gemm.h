// bf16 GEMM / GEMV through cuBLASLt: y[M,N] (+)= x[M,K] * W[N,K]^T, row-major, W in the
// Hugging Face Linear layout. fp32 accumulation; y is fp32 or bf16. beta = 1 accumulates
// into y (fp32): that is how the residual add of the o- and down-projections is fused.
// Napkin math: decode (M <= 32) is weight-bandwidth bound (2*N*K bytes); prefill is
// tensor-core bound (2*M*N*K flops). The heuristic's choice is cached per shape; its
// workspace comes from the device arena, so steady state allocates nothing.
#pragma once
#include <map>
#include <tuple>

#include "backend/cuda/cuda_common.h"

namespace spade::cuda {

class Gemm {
 public:
  Gemm(DeviceArena& arena, size_t workspace_bytes = 32u << 20);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // y_f32 = beta * y_f32 + x W^T   (beta in {0, 1})
  void run_f32(const bf16* x, const bf16* W, float* y, int M, int N, int K, float beta,
               cudaStream_t s);
  // y_bf16 = x W^T
  void run_bf16(const bf16* x, const bf16* W, bf16* y, int M, int N, int K, cudaStream_t s);

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  Plan& plan(int M, int N, int K, bool out_bf16, bool accumulate);
  void run(const bf16* x, const bf16* W, void* y, int M, int N, int K, bool out_bf16,
           float beta, cudaStream_t s);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<std::tuple<int, int, int, bool, bool>, Plan> plans_;
};

}  // namespace spade::cuda
