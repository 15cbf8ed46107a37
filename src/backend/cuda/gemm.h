// bf16 GEMM / GEMV through cuBLASLt: y[M,N] (+)= x[M,K] * W[N,K]^T, row-major, W in the
// Hugging Face Linear layout. fp32 accumulation; y is fp32 or bf16. beta = 1 accumulates
// into y (fp32): that is how the residual add of the o- and down-projections is fused.
// Napkin math: decode (M <= 32) is weight-bandwidth bound (2*N*K bytes); prefill is
// tensor-core bound (2*M*N*K flops). The heuristic's choice is cached per shape; its
// workspace comes from the device arena, so steady state allocates nothing. Decode shapes
// (M <= small_m(), fp32 out) go to our own weight-streaming GEMV (gemv.cu) instead.
#pragma once
#include <map>
#include <tuple>

#include "backend/cuda/cuda_common.h"
#include "backend/cuda/ops.h"

namespace spade::cuda {

// gemv.cu: y_f32[M,N] = beta * y + x W^T for 1 <= M <= kGemvMaxM, K % 8 == 0, 16-byte
// aligned x and W (gemv_supported); gemv_f32 throws otherwise.
constexpr int kGemvMaxM = 8;
bool gemv_supported(const bf16* x, const bf16* W, int M, int K);
// Whether the decode GEMVs rotate each W row's pass order (gemv.cu; on unless
// SPADE_GEMV_ROTATE=0, read once: A/B timings).
bool gemv_rotate();
void gemv_f32(const bf16* x, const bf16* W, float* y, int M, int N, int K, float beta,
              cudaStream_t s);
// The decode GEMV of the gate|up projection with SwiGLU fused after it (gemv.cu): W_gu =
// [W_gate; W_up] [2F][K], h[M][F] = bf16(silu(g) * u) with g, u = x W_gate^T, x W_up^T: the
// values of gemv_f32 over W_gu + swiglu() (ops.h), one launch. Same operand rules as gemv_f32.
void gemv_swiglu(const bf16* x, const bf16* W_gu, bf16* h, int M, int F, int K, cudaStream_t s);
// The decode GEMV of the qkv projection with qkv_post (ops.h) fused after it: the outputs of
// gemv_f32 into a fp32 buffer followed by qkv_post(post) (q, the K / V appends, Quest metadata),
// bit for bit, in one launch; post.qkv is not read. Needs post.T == M, no q/k norm, no INT4 keys,
// D % 8 == 0 (gemv_qkv_post_supported).
bool gemv_qkv_post_supported(const bf16* x, const bf16* W, const QkvPostArgs& post, int M, int K);
void gemv_qkv_post(const bf16* x, const bf16* W, const QkvPostArgs& post, int M, int K,
                   cudaStream_t s);

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
  // run_f32 with M <= this (and gemv_supported) runs gemv_f32, else cuBLASLt. 0 = always
  // cuBLASLt. Default kDefaultSmallM; env SPADE_GEMV=<max M> overrides (0 for A/B timings).
  void set_small_m(int m) { small_m_ = m < 0 ? 0 : (m > kGemvMaxM ? kGemvMaxM : m); }
  int small_m() const { return small_m_; }
  // Whether run_f32 with M rows takes the decode GEMV (M <= small_m(), operands permitting).
  bool uses_gemv(int M) const { return M >= 1 && M <= small_m_; }
  // Batch-invariant: run_f32 computes every row with the decode GEMV (groups of kGemvMaxM
  // rows), whose per-row arithmetic (lane chunks, pass order, butterfly) does not depend on M,
  // so a row's bits do not depend on the other rows of the call -- cuBLASLt's choice of
  // kernel, tile and split-K varies with M. Costs a weight pass per kGemvMaxM rows (prefill
  // chunks get slow). Throws for operands the GEMV does not take. (CudaModelOptions::
  // deterministic.)
  void set_batch_invariant(bool b) { batch_invariant_ = b; }
  bool batch_invariant() const { return batch_invariant_; }
  // H100 (bench/bench_gemv.cu): the GEMV is 1.05-1.18x faster than cuBLASLt at M = 1 and
  // 1.00-1.09x at M = 2 on Llama-3.1-8B shapes, slower from M = 4 (x re-read per token).
  static constexpr int kDefaultSmallM = 2;

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
  int small_m_ = kDefaultSmallM;
  bool batch_invariant_ = false;
  std::map<std::tuple<int, int, int, bool, bool>, Plan> plans_;
};

}  // namespace spade::cuda
