// Decode GEMV: y[M,N] (+)= x[M,K] W[N,K]^T for M <= kGemvMaxM rows (the tokens of a decode
// step), bf16 in, fp32 accumulate and out. At decode the weight stream is the whole cost of a
// projection (2 N K bytes, read once); cuBLASLt's kernels for these shapes read it at ~80% of
// copy bandwidth (docs/cuda.md), this one aims at the copy rate.
//
// Layout read: W bf16 [N][K] row-major (the Hugging Face Linear layout), K % 8 == 0 and rows
// 16-byte aligned; x bf16 [M][K]. Layout written: y fp32 [M][N] (beta = 1: y += x W^T, the
// fused residual add; beta = 0: y = x W^T).
// Work: one warp computes one output row over the whole K: lane l reads the 16-byte chunks
// l, l + 32, ... of the row (each warp load is 512 contiguous bytes), kUnroll (4) chunks in
// flight before any math (64 B per lane), with L1::no_allocate so the weights stream past L1
// while x (M K 2 bytes, re-read by every warp) stays there. fp32 FMAs on the bf16 halves (a
// bf16 is the top half of its fp32), then a butterfly per token and lane 0 writes. 256
// threads per CTA, no shared memory.
// SWIGLU instance (the gate|up projection of a decode step, gemv_swiglu): W = [W_gate; W_up]
// [2F][K]; a CTA's warps 0-3 take gate rows i..i+3 and warps 4-7 the up rows F + i..F + i + 3,
// and it writes h[M][F] = bf16(silu(g) * u) (swiglu()'s arithmetic on the same fp32 g, u)
// instead of the fp32 gate|up rows: no swiglu launch, no 8 F bytes per token written and read.
// Napkin math (Llama-3.1-8B, M = 1): 436 MB of weights per layer stack (qkv 48 MB, o 32 MB,
// gate/up 224 MB, down 112 MB) + 1 GB lm_head; at 3.0 TB/s that is 5.3 ms of the TPOT.
#include "backend/cuda/gemm.h"
#include "backend/cuda/load_stream.cuh"
#include "backend/cuda/pdl.cuh"

namespace spade::cuda {
namespace {

// H100, M = 1 (bench/bench_gemv.cu): 1 row x 4 chunks in flight per lane beat 2 x 4 (down
// projection 1.05x vs 1.03x over cuBLASLt, the rest equal) and 1 x 8 / 2 x 8 (slower on the
// small matrices).
constexpr int kUnroll = 4, kWarps = 8, kThreads = 32 * kWarps;

__device__ __forceinline__ float lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ float dot8(const uint4& w, const uint4& v, float acc) {
  acc = fmaf(lo(w.x), lo(v.x), acc);
  acc = fmaf(hi(w.x), hi(v.x), acc);
  acc = fmaf(lo(w.y), lo(v.y), acc);
  acc = fmaf(hi(w.y), hi(v.y), acc);
  acc = fmaf(lo(w.z), lo(v.z), acc);
  acc = fmaf(hi(w.z), hi(v.z), acc);
  acc = fmaf(lo(w.w), lo(v.w), acc);
  acc = fmaf(hi(w.w), hi(v.w), acc);
  return acc;
}

struct GemvArgs {
  const bf16* x;  // [M][K]
  const bf16* W;  // [N][K]; SWIGLU: [2N][K] (gate rows, then up rows)
  float* y;       // [M][N] fp32 (not SWIGLU)
  bf16* h;        // [M][N] bf16 (SWIGLU)
  int N, K;       // N = output columns (F for SWIGLU)
  float beta;
};

template <int M, bool SWIGLU>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const GemvArgs a) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Output column col; its weight row is col, or (SWIGLU, warps 4-7) N + col. SWIGLU warps
  // past N stream a valid row and discard it (every warp reaches the exchange barrier).
  constexpr int per_cta = SWIGLU ? kWarps / 2 : kWarps;
  const int col = blockIdx.x * per_cta + warp % per_cta;
  if (!SWIGLU && col >= a.N) {
    pdl_begin();
    return;
  }
  const int rows = SWIGLU ? 2 * a.N : a.N;
  const int row = min(SWIGLU && warp >= per_cta ? a.N + col : col, rows - 1);
  const int nc = a.K / 8;  // 16-byte chunks per row
  const uint4* wr = reinterpret_cast<const uint4*>(a.W + int64_t(row) * a.K);
  const uint4* xr = reinterpret_cast<const uint4*>(a.x);
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  uint4 w[kUnroll];
  auto load_w = [&](int c0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      w[u] = c0 + 32 * u < nc ? ld_stream(wr + c0 + 32 * u) : make_uint4(0, 0, 0, 0);
  };
  // The weights are constant: the first chunks are requested before the wait for the kernel
  // that writes x (pdl.cuh), so they arrive while it finishes.
  load_w(lane);
  // The gate|up GEMV (SWIGLU) is followed by the down GEMV: released at this kernel's start,
  // its CTAs took SM slots during this one's last wave and the decode step got slower (H200,
  // Llama-3.1-8B, 32K, batch 1: +0.16 ms; bench/results/gemv_fusion_ab_h200_20261126.json),
  // so it releases them at its end (pdl.cuh, pdl_wait / pdl_release).
  if constexpr (SWIGLU) pdl_wait();
  else pdl_begin();
  for (int c0 = lane; c0 < nc; c0 += 32 * kUnroll) {
    if (c0 != lane) load_w(c0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + 32 * u;
      if (c < nc) {
#pragma unroll
        for (int m = 0; m < M; ++m) acc[m] = dot8(w[u], __ldg(xr + int64_t(m) * nc + c), acc[m]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
  if constexpr (SWIGLU) {
    __shared__ float s_up[per_cta][M];
    if (warp >= per_cta && lane == 0)
#pragma unroll
      for (int m = 0; m < M; ++m) s_up[warp - per_cta][m] = acc[m];
    __syncthreads();
    if (warp < per_cta && lane == 0 && col < a.N)
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float g = acc[m], u = s_up[warp][m];
        a.h[int64_t(m) * a.N + col] = __float2bfloat16(g / (1.f + __expf(-g)) * u);
      }
    pdl_release();
  } else if (lane == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float* d = a.y + int64_t(m) * a.N + col;
      *d = a.beta != 0.f ? *d + acc[m] : acc[m];
    }
  }
}

template <int M, bool SWIGLU>
void launch(const GemvArgs& a, cudaStream_t s) {
  constexpr int per_cta = SWIGLU ? kWarps / 2 : kWarps;
  launch_pdl(gemv_kernel<M, SWIGLU>, (a.N + per_cta - 1) / per_cta, kThreads, 0, s, a);
}

template <bool SWIGLU>
void launch_m(const GemvArgs& a, int M, cudaStream_t s) {
  switch (M) {
    case 1: launch<1, SWIGLU>(a, s); break;
    case 2: launch<2, SWIGLU>(a, s); break;
    case 3: launch<3, SWIGLU>(a, s); break;
    case 4: launch<4, SWIGLU>(a, s); break;
    case 5: launch<5, SWIGLU>(a, s); break;
    case 6: launch<6, SWIGLU>(a, s); break;
    case 7: launch<7, SWIGLU>(a, s); break;
    default: launch<8, SWIGLU>(a, s); break;
  }
  SPADE_CUDA_LAUNCH();
}

}  // namespace

bool gemv_supported(const bf16* x, const bf16* W, int M, int K) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return M >= 1 && M <= kGemvMaxM && K % 8 == 0 && aligned(x) && aligned(W);
}

void gemv_f32(const bf16* x, const bf16* W, float* y, int M, int N, int K, float beta,
              cudaStream_t s) {
  SPADE_CHECK(gemv_supported(x, W, M, K), "gemv_f32: unsupported M=", M, " K=", K,
              " or unaligned operands");
  launch_m<false>(GemvArgs{x, W, y, nullptr, N, K, beta}, M, s);
}

void gemv_swiglu(const bf16* x, const bf16* W_gu, bf16* h, int M, int F, int K, cudaStream_t s) {
  SPADE_CHECK(gemv_supported(x, W_gu, M, K), "gemv_swiglu: unsupported M=", M, " K=", K,
              " or unaligned operands");
  launch_m<true>(GemvArgs{x, W_gu, nullptr, h, F, K, 0.f}, M, s);
}

}  // namespace spade::cuda
