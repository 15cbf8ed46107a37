// Decode GEMV: y[M,N] (+)= x[M,K] W[N,K]^T for M <= kGemvMaxM rows (the tokens of a decode
// step), bf16 in, fp32 accumulate and out. At decode the weight stream is the whole cost of a
// projection (2 N K bytes, read once); cuBLASLt's kernels for these shapes read it at ~80% of
// copy bandwidth (docs/cuda.md), this one aims at the copy rate.
//
// Layout read: W bf16 [N][K] row-major (the Hugging Face Linear layout), K % 8 == 0 and rows
// 16-byte aligned; x bf16 [M][K]. Layout written: y fp32 [M][N] (beta = 1: y += x W^T, the
// fused residual add; beta = 0: y = x W^T).
// Work: one warp computes kRows (1) output rows over the whole K: lane l reads the 16-byte
// chunks l, l + 32, ... of each row (each warp load is 512 contiguous bytes), kUnroll (4)
// chunks per row in flight before any math (kRows x kUnroll x 16 B = 64 B per lane), with
// L1::no_allocate so the weights stream past L1 while x (M K 2 bytes, re-read by every warp)
// stays there. fp32 FMAs on the bf16 halves (a bf16 is the top half of its fp32), then a
// butterfly per (row, token) and lane 0 writes. 256 threads per CTA, no shared memory.
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
constexpr int kRows = 1, kUnroll = 4, kWarps = 8;

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

template <int M>
__global__ void __launch_bounds__(kWarps * 32) gemv_kernel(const bf16* __restrict__ x,
                                                           const bf16* __restrict__ W,
                                                           float* __restrict__ y, int N, int K,
                                                           float beta) {
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * kRows;
  if (row0 >= N) {
    pdl_begin();
    return;
  }
  const int nc = K / 8;  // 16-byte chunks per row
  const uint4* wr[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
    wr[r] = reinterpret_cast<const uint4*>(W + int64_t(min(row0 + r, N - 1)) * K);
  const uint4* xr = reinterpret_cast<const uint4*>(x);
  float acc[kRows][M];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  uint4 w[kRows][kUnroll];
  auto load_w = [&](int c0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        w[r][u] = c0 + 32 * u < nc ? ld_stream(wr[r] + c0 + 32 * u) : make_uint4(0, 0, 0, 0);
  };
  // The weights are constant: the first chunks are requested before the wait for the kernel
  // that writes x (pdl.cuh), so they arrive while it finishes.
  load_w(lane);
  pdl_begin();
  for (int c0 = lane; c0 < nc; c0 += 32 * kUnroll) {
    if (c0 != lane) load_w(c0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + 32 * u;
      if (c < nc) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const uint4 v = __ldg(xr + int64_t(m) * nc + c);
#pragma unroll
          for (int r = 0; r < kRows; ++r) acc[r][m] = dot8(w[r][u], v, acc[r][m]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], o);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r >= N) break;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float* d = y + int64_t(m) * N + row0 + r;
        *d = beta != 0.f ? *d + acc[r][m] : acc[r][m];
      }
    }
  }
}

template <int M>
void launch(const bf16* x, const bf16* W, float* y, int N, int K, float beta, cudaStream_t s) {
  const int warps = (N + kRows - 1) / kRows;
  launch_pdl(gemv_kernel<M>, (warps + kWarps - 1) / kWarps, kWarps * 32, 0, s, x, W, y, N, K, beta);
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
  switch (M) {
    case 1: launch<1>(x, W, y, N, K, beta, s); break;
    case 2: launch<2>(x, W, y, N, K, beta, s); break;
    case 3: launch<3>(x, W, y, N, K, beta, s); break;
    case 4: launch<4>(x, W, y, N, K, beta, s); break;
    case 5: launch<5>(x, W, y, N, K, beta, s); break;
    case 6: launch<6>(x, W, y, N, K, beta, s); break;
    case 7: launch<7>(x, W, y, N, K, beta, s); break;
    default: launch<8>(x, W, y, N, K, beta, s); break;
  }
  SPADE_CUDA_LAUNCH();
}

}  // namespace spade::cuda
