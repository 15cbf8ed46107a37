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
// QKV instance (the qkv projection of a decode step, gemv_qkv_post): a CTA takes dims i..i+3
// (warps 0-3) and i + D/2..i + D/2 + 3 (warps 4-7) of one head, meets in shared memory and
// runs qkv_post on the pairs (qkv_post_pair.cuh: bias, RoPE, the bf16 q / K / V stores, Quest
// page min / max), so no fp32 qkv buffer and no qkv_post launch; heads with a q/k norm or INT4
// keys need the whole row and keep qkv_post.
// SPLIT instance (gemv_f32 with a GemvSplit workspace, grids of at most one wave: the o and down
// projections at batch 1-2): a grid that fits in one wave gives each SM a fixed share of rows and
// the slowest SM's stream sets the time (alone, o and down streamed at 0.59 / 0.67 of the copy
// rate where the multi-wave gate|up and lm_head reach 0.98-1.05; three times the bytes in flight
// per warp did not help: docs/cuda.md). So a warp takes a segment of `seg` chunks of a row (a
// unit); units are spread over several waves of CTAs, which the hardware balances. Lane 0 of each
// unit stores its partial sums ([row][part][M] fp32), then counts in on the row's arrival counter;
// the unit that arrives last sums the parts in part order (a fixed order: deterministic, though
// not the bits of the one-warp-per-row form), writes y (beta as in the plain form) and resets the
// counter for the next launch.
// Napkin math (Llama-3.1-8B, M = 1): 436 MB of weights per layer stack (qkv 48 MB, o 32 MB,
// gate/up 224 MB, down 112 MB) + 1 GB lm_head; at 3.0 TB/s that is 5.3 ms of the TPOT.
#include <algorithm>
#include <cstdlib>

#include "backend/cuda/gemm.h"
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
  // SPLIT: chunks per unit, units per row, partials [N][parts][M], arrival counters [N] (zero
  // between launches).
  int seg = 0, parts = 1;
  float* partial = nullptr;
  uint32_t* arrivals = nullptr;
};

enum Epi { kPlain, kSwiglu, kQkv, kSplit };

// Batch-1 instances are held to 6 CTAs per SM (<= 40 registers), where the plain kernel is on
// its own: Llama-3.1-8B's qkv projection is then one wave (768 CTAs, 792 slots); the M = 2
// plain instance keeps its 5. (The shared code with the fused forms nudged both over.)
template <int M, int EPI>
__global__ void __launch_bounds__(kThreads, M == 1 ? 6 : (EPI == kPlain || EPI == kSplit) && M == 2 ? 5 : 0)
    gemv_kernel(const GemvArgs a) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Paired forms (SWIGLU, QKV): warps 0-3 and 4-7 compute two rows of each output.
  constexpr int kHalfWarps = kWarps / 2;
  int col = 0, row = 0;   // plain / SWIGLU: output column; QKV: the pair's dim i
  int head = 0;           // QKV
  int part = 0;           // SPLIT
  if constexpr (EPI == kPlain) {
    col = row = blockIdx.x * kWarps + warp;
    if (col >= a.N) {
      pdl_begin();
      return;
    }
  } else if constexpr (EPI == kSplit) {
    const int unit = blockIdx.x * kWarps + warp;
    if (unit >= a.N * a.parts) {
      pdl_begin();
      return;
    }
    col = row = unit / a.parts;
    part = unit % a.parts;
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
  // Chunks [cb, ce) of the row: the whole row, or the unit's segment (SPLIT).
  const int cb = EPI == kSplit ? part * a.seg : 0;
  const int ce = EPI == kSplit ? min(nc, cb + a.seg) : nc;
  const uint4* wr = reinterpret_cast<const uint4*>(a.W + int64_t(row) * a.K);
  const uint4* xr = reinterpret_cast<const uint4*>(a.x);
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  uint4 w[kUnroll];
  auto load_w = [&](int c0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      w[u] = c0 + 32 * u < ce ? ld_stream(wr + c0 + 32 * u) : make_uint4(0, 0, 0, 0);
  };
  // The weights are constant: the first chunks are requested before the wait for the kernel
  // that writes x (pdl.cuh), so they arrive while it finishes.
  load_w(cb + lane);
  // The gate|up GEMV (SWIGLU) is followed by the down GEMV: released at this kernel's start,
  // its CTAs took SM slots during this one's last wave and the decode step got slower (H200,
  // Llama-3.1-8B, 32K, batch 1: +0.16 ms; bench/results/gemv_fusion_ab_h200_20261126.json),
  // so it releases them at its end (pdl.cuh, pdl_wait / pdl_release).
  if constexpr (EPI == kSwiglu) pdl_wait();
  else pdl_begin();
  for (int c0 = cb + lane; c0 < ce; c0 += 32 * kUnroll) {
    if (c0 != cb + lane) load_w(c0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + 32 * u;
      if (c < ce) {
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
  } else if constexpr (EPI == kSplit) {
    if (lane == 0) {
      float* mine = a.partial + (int64_t(row) * a.parts + part) * M;
#pragma unroll
      for (int m = 0; m < M; ++m) mine[m] = acc[m];
      __threadfence();  // the partials before the arrival
      if (atomicAdd(a.arrivals + row, 1u) == uint32_t(a.parts - 1)) {
        __threadfence();  // the other units' partials after their arrivals (read from L2)
        const float* parts = a.partial + int64_t(row) * a.parts * M;
#pragma unroll
        for (int m = 0; m < M; ++m) {
          float sum = __ldcg(parts + m);
          for (int p = 1; p < a.parts; ++p) sum += __ldcg(parts + p * M + m);
          float* d = a.y + int64_t(m) * a.N + col;
          *d = a.beta != 0.f ? *d + sum : sum;
        }
        a.arrivals[row] = 0u;
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
                 : EPI == kSplit ? int((int64_t(a.N) * a.parts + kWarps - 1) / kWarps)
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

// Chunks per unit for split_parts parts of a row of nc chunks: whole passes of a warp (128
// chunks, 2 KB).
int split_seg(int nc, int parts) {
  const int per = (nc + parts - 1) / parts;
  return std::max(32 * kUnroll, (per + 32 * kUnroll - 1) / (32 * kUnroll) * (32 * kUnroll));
}


}  // namespace

bool gemv_supported(const bf16* x, const bf16* W, int M, int K) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return M >= 1 && M <= kGemvMaxM && K % 8 == 0 && aligned(x) && aligned(W);
}

int gemv_split_parts(int M, int N, int K) {
  static const int forced = [] {
    const char* e = std::getenv("SPADE_GEMV_SPLIT");
    return e && *e ? std::max(0, std::atoi(e)) : -1;
  }();
  const int nc = K / 8;
  int want;
  if (forced >= 0) {
    want = std::max(1, forced);
  } else {
    // Split grids of at most one wave into about 4 waves of units (slots: the launch bounds'
    // CTAs per SM, 6 at M = 1, 5 at M = 2, 4 beyond).
    const int ctas = (N + kWarps - 1) / kWarps;
    const int slots = sm_count() * (M == 1 ? 6 : M == 2 ? 5 : 4);
    if (ctas > slots) return 1;
    want = (4 * slots + ctas - 1) / ctas;
  }
  if (want <= 1 || nc < 2 * 32 * kUnroll) return 1;
  const int parts = (nc + split_seg(nc, want) - 1) / split_seg(nc, want);
  return int64_t(N) * parts > kGemvSplitMaxUnits ? 1 : parts;
}

void gemv_f32(const bf16* x, const bf16* W, float* y, int M, int N, int K, float beta,
              cudaStream_t s, const GemvSplit* split) {
  SPADE_CHECK(gemv_supported(x, W, M, K), "gemv_f32: unsupported M=", M, " K=", K,
              " or unaligned operands");
  GemvArgs a{x, W, y, nullptr, N, K, beta, {}};
  int parts = !split ? 1 : split->parts > 0 ? split->parts : gemv_split_parts(M, N, K);
  if (parts > 1) {  // whole 2 KB passes per unit; fewer parts if the rows are short
    const int seg = split_seg(K / 8, parts);
    parts = (K / 8 + seg - 1) / seg;
    SPADE_CHECK(int64_t(N) * parts <= kGemvSplitMaxUnits, "gemv_f32: ", N, " rows x ", parts,
                " parts exceed the split workspace");
  }
  if (parts <= 1) return launch_m<kPlain>(a, M, s);
  a.parts = parts;
  a.seg = split_seg(K / 8, parts);
  a.partial = split->partial;
  a.arrivals = split->arrivals;
  launch_m<kSplit>(a, M, s);
}


void gemv_swiglu(const bf16* x, const bf16* W_gu, bf16* h, int M, int F, int K, cudaStream_t s) {
  SPADE_CHECK(gemv_supported(x, W_gu, M, K), "gemv_swiglu: unsupported M=", M, " K=", K,
              " or unaligned operands");
  launch_m<kSwiglu>(GemvArgs{x, W_gu, nullptr, h, F, K, 0.f, {}}, M, s);
}

bool gemv_qkv_post_supported(const bf16* x, const bf16* W, const QkvPostArgs& post, int M, int K) {
  return gemv_supported(x, W, M, K) && post.T == M && !post.q_norm && !post.k_norm &&
         !post.k_int4 && !post.k_int4_sz && post.D % 8 == 0 && post.D <= 256;
}

void gemv_qkv_post(const bf16* x, const bf16* W, const QkvPostArgs& post, int M, int K,
                   cudaStream_t s) {
  SPADE_CHECK(gemv_qkv_post_supported(x, W, post, M, K), "gemv_qkv_post: unsupported M=", M,
              " K=", K, " D=", post.D, ", unaligned operands, q/k norms or INT4 keys");
  const int N = (post.Hq + 2 * post.Hkv) * post.D;
  launch_m<kQkv>(GemvArgs{x, W, nullptr, nullptr, N, K, 0.f, post}, M, s);
}

}  // namespace spade::cuda
