// Decode GEMV: y[M,N] (+)= x[M,K] W[N,K]^T for M <= kGemvMaxM rows (the tokens of a decode
// step), bf16 in, fp32 accumulate and out. At decode the weight stream is the whole cost of a
// projection (2 N K bytes, read once); cuBLASLt's kernels for these shapes read it at ~80% of
// copy bandwidth (docs/cuda.md), this one aims at the copy rate.
//
// Layout read: W bf16 [N][K] row-major (the Hugging Face Linear layout), K % 8 == 0 and rows
// 16-byte aligned; x bf16 [M][K]. Layout written: y fp32 [M][N] (beta = 1: y += x W^T, the
// fused residual add; beta = 0: y = x W^T).
// Work: one warp computes one output row over the whole K, in passes of 128 chunks (2 KB):
// lane l reads the 16-byte chunks l, l + 32, l + 64, l + 96 of a pass (each warp load is 512
// contiguous bytes); W row r takes its passes starting at pass r mod n (rotated: see the
// kernel), so warps of a one-wave grid do not all stream the same row offsets at once; kUnroll
// (4) chunks in flight before any math (64 B per lane), with L1::no_allocate so the weights
// stream past L1 while x (M K 2 bytes, re-read by every warp) stays there. fp32 FMAs on the
// bf16 halves (a bf16 is the top half of its fp32), then a butterfly per token and lane 0
// writes. 256 threads per CTA, no shared memory.
// SWIGLU instance (the gate|up projection of a decode step, gemv_swiglu): W = [W_gate; W_up]
// [2F][K]; a CTA's warps 0-3 take gate rows i..i+3 and warps 4-7 the up rows F + i..F + i + 3,
// and it writes h[M][F] = bf16(silu(g) * u) (swiglu()'s arithmetic on the same fp32 g, u)
// instead of the fp32 gate|up rows: no swiglu launch, no 8 F bytes per token written and read.
// QKV instance (the qkv projection of a decode step, gemv_qkv_post): a CTA takes dims i..i+3
// (warps 0-3) and i + D/2..i + D/2 + 3 (warps 4-7) of one head, meets in shared memory and
// runs qkv_post on the pairs (qkv_post_pair.cuh: bias, RoPE, the bf16 q / K / V stores, Quest
// page min / max), so no fp32 qkv buffer and no qkv_post launch; heads with a q/k norm or INT4
// keys need the whole row and keep qkv_post.
// Napkin math (Llama-3.1-8B, M = 1): 436 MB of weights per layer stack (qkv 48 MB, o 32 MB,
// gate/up 224 MB, down 112 MB) + 1 GB lm_head; at 3.0 TB/s that is 5.3 ms of the TPOT.
#include <cstdlib>
#include <string>

#include "backend/cuda/gemm.h"
#include "core/tuning.h"
#include "backend/cuda/load_stream.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/qkv_post_pair.cuh"

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
  const bf16* W;  // [N][K]; SWIGLU: [2N][K] (gate rows, then up rows); QKV: [(Hq + 2Hkv) D][K]
  float* y;       // [M][N] fp32 (plain)
  bf16* h;        // [M][N] bf16 (SWIGLU)
  int N, K;       // N = output columns (F for SWIGLU, (Hq + 2Hkv) D for QKV)
  float beta;
  QkvPostArgs post;  // QKV: where the pairs go (post.qkv unused)
  int rotate = 0;    // plain: start each row's passes at pass (row mod passes) (gemv_rotate())
};

enum Epi { kPlain, kSwiglu, kQkv };

// Batch-1 instances are held to 6 CTAs per SM (<= 40 registers), where the plain kernel is on
// its own: Llama-3.1-8B's qkv projection is then one wave (768 CTAs, 792 slots); the M = 2
// plain instance keeps its 5. (The shared code with the fused forms nudged both over.)
template <int M, int EPI>
__global__ void __launch_bounds__(kThreads, M == 1 ? 6 : EPI == kPlain && M == 2 ? 5 : 0)
    gemv_kernel(const GemvArgs a) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Paired forms (SWIGLU, QKV): warps 0-3 and 4-7 compute two rows of each output.
  constexpr int kHalfWarps = kWarps / 2;
  int col = 0, row = 0;   // plain / SWIGLU: output column; QKV: the pair's dim i
  int head = 0;           // QKV
  if constexpr (EPI == kPlain) {
    col = row = blockIdx.x * kWarps + warp;
    if (col >= a.N) {
      pdl_begin();
      return;
    }
  } else if constexpr (EPI == kSwiglu) {
    // Warps past N stream a valid row and discard it (every warp reaches the barrier).
    col = blockIdx.x * kHalfWarps + warp % kHalfWarps;
    row = min(warp >= kHalfWarps ? a.N + col : col, 2 * a.N - 1);
  } else {
    const int half = a.post.D / 2, per_head = half / kHalfWarps;
    head = blockIdx.x / per_head;
    col = (blockIdx.x % per_head) * kHalfWarps + warp % kHalfWarps;
    row = head * a.post.D + (warp >= kHalfWarps ? half : 0) + col;
  }
  const int nc = a.K / 8;  // 16-byte chunks per row
  const uint4* wr = reinterpret_cast<const uint4*>(a.W + int64_t(row) * a.K);
  const uint4* xr = reinterpret_cast<const uint4*>(a.x);
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  // Passes of 128 chunks (2 KB) per row. With `rotate`, W row r takes its passes in the order
  // r mod n, r mod n + 1, ... (wrapping), so the warps of a one-wave grid (o, down, qkv), which
  // otherwise all stream the same offsets of their rows at the same time, spread their requests
  // over the address bits. Each lane's chunks are the same, summed in that rotated order; every
  // form rotates by the W row, so the fused forms keep the plain form's values.
  const int n_pass = (nc + 32 * kUnroll - 1) / (32 * kUnroll);
  const int rot = a.rotate ? row % n_pass : 0;
  auto pass_c0 = [&](int j) {
    const int jj = j + rot;
    return lane + 32 * kUnroll * (jj >= n_pass ? jj - n_pass : jj);
  };
  uint4 w[kUnroll];
  auto load_w = [&](int c0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      w[u] = c0 + 32 * u < nc ? ld_stream(wr + c0 + 32 * u) : make_uint4(0, 0, 0, 0);
  };
  // The weights are constant: the first chunks are requested before the wait for the kernel
  // that writes x (pdl.cuh), so they arrive while it finishes.
  load_w(pass_c0(0));
  // The gate|up GEMV (SWIGLU) is followed by the down GEMV: released at this kernel's start,
  // its CTAs took SM slots during this one's last wave and the decode step got slower (H200,
  // Llama-3.1-8B, 32K, batch 1: +0.16 ms; bench/results/gemv_fusion_ab_h200_20261126.json),
  // so it releases them at its end (pdl.cuh, pdl_wait / pdl_release).
  if constexpr (EPI == kSwiglu) pdl_wait();
  else pdl_begin();
  for (int j = 0; j < n_pass; ++j) {
    const int c0 = pass_c0(j);
    if (j != 0) load_w(c0);
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
  if constexpr (EPI == kPlain) {
    if (lane == 0) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float* d = a.y + int64_t(m) * a.N + col;
        *d = a.beta != 0.f ? *d + acc[m] : acc[m];
      }
    }
  } else {
    __shared__ float s_second[kHalfWarps][M];  // the second row of each pair
    if (warp >= kHalfWarps && lane == 0)
#pragma unroll
      for (int m = 0; m < M; ++m) s_second[warp - kHalfWarps][m] = acc[m];
    __syncthreads();
    if (warp < kHalfWarps && lane == 0) {
      if constexpr (EPI == kSwiglu) {
        if (col < a.N)
#pragma unroll
          for (int m = 0; m < M; ++m) {
            const float g = acc[m], u = s_second[warp][m];
            a.h[int64_t(m) * a.N + col] = __float2bfloat16(g / (1.f + __expf(-g)) * u);
          }
      } else {
        // qkv_post_kernel's inputs: lo = qkv[i] + bias[i], hi = qkv[i + D/2] + bias[i + D/2].
        const QkvPostArgs& p = a.post;
        const int half = p.D / 2;
        const float* bias = p.bias ? p.bias + int64_t(head) * p.D : nullptr;
#pragma unroll
        for (int m = 0; m < M; ++m) {
          float lo = acc[m] + (bias ? bias[col] : 0.f);
          float hi = s_second[warp][m] + (bias ? bias[col + half] : 0.f);
          qkv_post_pair(p, m, head, col, qkv_post_dst(p, m, head), lo, hi);
          if (p.quest_meta && head >= p.Hq && head < p.Hq + p.Hkv)
            qkv_post_meta_pair(p, m, head, col, lo, hi);
        }
      }
    }
    if constexpr (EPI == kSwiglu) pdl_release();
  }
}

template <int M, int EPI>
void launch(const GemvArgs& a, cudaStream_t s) {
  // QKV: one CTA per 4 dim pairs of a head.
  const int ctas = EPI == kPlain ? (a.N + kWarps - 1) / kWarps
                 : EPI == kSwiglu ? (a.N + kWarps / 2 - 1) / (kWarps / 2)
                                  : a.N / kWarps;
  launch_pdl(gemv_kernel<M, EPI>, ctas, kThreads, 0, s, a);
}

template <int EPI>
void launch_m(const GemvArgs& a, int M, cudaStream_t s) {
  switch (M) {
    case 1: launch<1, EPI>(a, s); break;
    case 2: launch<2, EPI>(a, s); break;
    case 3: launch<3, EPI>(a, s); break;
    case 4: launch<4, EPI>(a, s); break;
    case 5: launch<5, EPI>(a, s); break;
    case 6: launch<6, EPI>(a, s); break;
    case 7: launch<7, EPI>(a, s); break;
    default: launch<8, EPI>(a, s); break;
  }
  SPADE_CUDA_LAUNCH();
}

}  // namespace

bool gemv_supported(const bf16* x, const bf16* W, int M, int K) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return M >= 1 && M <= kGemvMaxM && K % 8 == 0 && aligned(x) && aligned(W);
}

bool gemv_rotate() {
  return tuning().gemv_rotate;
}

void gemv_f32(const bf16* x, const bf16* W, float* y, int M, int N, int K, float beta,
              cudaStream_t s) {
  SPADE_CHECK(gemv_supported(x, W, M, K), "gemv_f32: unsupported M=", M, " K=", K,
              " or unaligned operands");
  GemvArgs a{x, W, y, nullptr, N, K, beta, {}};
  a.rotate = gemv_rotate() ? 1 : 0;
  launch_m<kPlain>(a, M, s);
}

void gemv_swiglu(const bf16* x, const bf16* W_gu, bf16* h, int M, int F, int K, cudaStream_t s) {
  SPADE_CHECK(gemv_supported(x, W_gu, M, K), "gemv_swiglu: unsupported M=", M, " K=", K,
              " or unaligned operands");
  GemvArgs a{x, W_gu, nullptr, h, F, K, 0.f, {}};
  a.rotate = gemv_rotate() ? 1 : 0;
  launch_m<kSwiglu>(a, M, s);
}

bool gemv_qkv_post_supported(const bf16* x, const bf16* W, const QkvPostArgs& post, int M, int K) {
  return gemv_supported(x, W, M, K) && post.T == M && !post.q_norm && !post.k_norm &&
         !post.k_int4 && !post.k_int4_sz && !post.kv_amax && !post.rotate_qk && post.D % 8 == 0 &&
         post.D <= 256;
}

void gemv_qkv_post(const bf16* x, const bf16* W, const QkvPostArgs& post, int M, int K,
                   cudaStream_t s) {
  SPADE_CHECK(gemv_qkv_post_supported(x, W, post, M, K), "gemv_qkv_post: unsupported M=", M,
              " K=", K, " D=", post.D, ", unaligned operands, q/k norms or INT4 keys");
  const int N = (post.Hq + 2 * post.Hkv) * post.D;
  GemvArgs a{x, W, nullptr, nullptr, N, K, 0.f, post};
  a.rotate = gemv_rotate() ? 1 : 0;
  launch_m<kQkv>(a, M, s);
}

}  // namespace spade::cuda
