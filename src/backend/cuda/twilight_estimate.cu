// Twilight pruner, stage 1 (twilight.h): estimated logits of every base token from INT4 keys.
//
// twl_estimate_kernel<D, NTILE>
//   reads  per base token D/2 code bytes + 4 scale/zero bytes (68 B at D = 128, a quarter of
//          the 256 B bf16 K row; the pruner's byte floor), the list's entries (4 B per entry),
//          q of the G heads once per warp
//   writes logits fp32 [list][G][max_slots] (4*G B per token: scratch, L2-resident)
//   CTA = 4 warps of one list (b, KV head); a warp takes 16-slot tiles `stride` apart. Lane
//   (row r = lane/4, t = lane%4) loads 16-byte pieces of rows r and r+8 (bytes
//   [t*D/8, t*D/8 + D/8) = dims [t*D/4, t*D/4 + D/4)), turns each code word (8 dims) into
//   four bf16x2 of dims (d, d + 4) (0x4300 | c is 128 + c, minus 128: exact; q's words are
//   regrouped into the same pairs once) and feeds mma.m16n8k16 (A = codes, 16 rows x 16
//   dims; B = q^T, 16 dims x 8 heads, in registers: lane's head r, the same dims). A lane's
//   k indices are its own dims for A and B alike, so no shuffle is needed; products are
//   exact, accumulation fp32.
//   Chunk16 lists (Quest pages): the grid gives each warp at most 16 tiles (enough warps for
//   ~16 per SM); lane j resolves tile j's entry -> page -> first row up front (one dependent
//   chain per warp, beside q's load), then stages of two tiles stream through a 4-stage
//   cp.async ring per warp (10 KB at D = 128; three stages in flight during one's math).
//   Token lists: two tiles per iteration, every index, page and code load of both issued
//   before the math.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/twilight.h"
#include "backend/cuda/pdl.cuh"

namespace spade::cuda {
namespace {

using attn_detail::cp_async16;
using attn_detail::cp_async_commit;
using attn_detail::cp_async_wait;
using attn_detail::smem_u32;

// Codes (nibbles) S / 4 and S / 4 + 4 of the code word w (dims d and d + 4 of its eight) as
// a bf16x2, exact: each nibble lands in a half's mantissa under the exponent of 128
// (0x4300 | c is 128 + c), then 128 is subtracted. Three shifts, four LOP3 and four HSUB2
// per word of eight codes.
template <int S>
__device__ __forceinline__ uint32_t nibble_pair_bf16x2(uint32_t w) {
  const uint32_t v = ((w >> S) & 0x000f000fu) | 0x43004300u;
  __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&v);
  b = __hsub2(b, __floats2bfloat162_rn(128.f, 128.f));
  return *reinterpret_cast<const uint32_t*>(&b);
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

constexpr int kEstWarps = 4;
constexpr int kEstTilesPerWarp = 2;     // tiles per load stage
constexpr int kEstMaxWarpTiles = 32;    // Chunk16 pipeline: a warp's tiles, one per lane
constexpr int kEstWarpsPerSm = 16;      // grid sizing target (resident estimate warps per SM)
constexpr int kEstRing = 4;             // Chunk16 pipeline: stages in a warp's cp.async ring

// A warp's cp.async ring (Chunk16 pipeline): per stage and tile, lane l's W code words of
// rows r and r + 8 and their scale/zero words; every lane reads back only what it copied.
template <int W>
struct EstRing {
  uint32_t codes[kEstRing][kEstTilesPerWarp][2][32][W];
  uint32_t sz[kEstRing][kEstTilesPerWarp][2][32];
};

__device__ __forceinline__ void cp_async_small(void* dst, const void* src, int bytes, bool valid) {
  if (bytes == 8)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(valid ? 8 : 0));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(valid ? 4 : 0));
}

// One stage of kEstTilesPerWarp tiles: this lane's code words and scale/zero of rows r and
// r + 8 of each tile, and whether each row is a real token.
template <int W>
struct EstStage {
  uint32_t w[kEstTilesPerWarp][2][W], sz[kEstTilesPerWarp][2];
  bool ok[kEstTilesPerWarp][2];
};

template <int W>
__device__ __forceinline__ void est_load_row(const uint8_t* codes, const uint32_t* sz, int64_t row,
                                             int t, bool ok, uint32_t (&w)[W], uint32_t& szr) {
  if (ok) {
    const uint8_t* src = codes + row * (W * 16) + t * (W * 4);
    if constexpr (W == 4) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(src));
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(src));
      w[0] = v.x, w[1] = v.y;
    }
    szr = __ldg(sz + row);
  } else {
#pragma unroll
    for (int c = 0; c < W; ++c) w[c] = 0u;
    szr = 0u;
  }
}

// Logits of one 16-slot tile from its stage entry u: mma over the code words, then
// scale * (zero * sum(q) + s * (q . codes)) per (row, head); -inf for rows past the context.
template <int D, int NTILE>
__device__ __forceinline__ void est_tile(const EstStage<D / 32>& S, int u, int tile, int n_slots,
                                         const uint32_t (&qf)[NTILE][D / 8], const float (&qs_a)[NTILE],
                                         const float (&qs_b)[NTILE], float scale, int G, int r, int t,
                                         float* __restrict__ lrow, int max_slots) {
  constexpr int W = D / 32;
  float acc[NTILE][4];
#pragma unroll
  for (int nt = 0; nt < NTILE; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
  for (int c = 0; c < W; ++c) {  // word c: dims 8c + 0..7 of the lane's piece, two k-steps
    // k-step 2c: k = 2t, 2t+1 are dims (0, 4), k = 2t+8, 2t+9 dims (1, 5) of the word;
    // k-step 2c + 1: (2, 6) and (3, 7). q's words were permuted to the same pairs.
    const uint32_t a00 = nibble_pair_bf16x2<0>(S.w[u][0][c]), a01 = nibble_pair_bf16x2<4>(S.w[u][0][c]);
    const uint32_t a02 = nibble_pair_bf16x2<8>(S.w[u][0][c]), a03 = nibble_pair_bf16x2<12>(S.w[u][0][c]);
    const uint32_t a10 = nibble_pair_bf16x2<0>(S.w[u][1][c]), a11 = nibble_pair_bf16x2<4>(S.w[u][1][c]);
    const uint32_t a12 = nibble_pair_bf16x2<8>(S.w[u][1][c]), a13 = nibble_pair_bf16x2<12>(S.w[u][1][c]);
#pragma unroll
    for (int nt = 0; nt < NTILE; ++nt) {
      mma_bf16(acc[nt], a00, a10, a01, a11, qf[nt][4 * c], qf[nt][4 * c + 1]);
      mma_bf16(acc[nt], a02, a12, a03, a13, qf[nt][4 * c + 2], qf[nt][4 * c + 3]);
    }
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int slot = tile * 16 + r + 8 * hr;
    if (slot >= n_slots) continue;
    const __half2 p2 = *reinterpret_cast<const __half2*>(&S.sz[u][hr]);
    const float s = __low2float(p2), z = __high2float(p2);
#pragma unroll
    for (int nt = 0; nt < NTILE; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int g = nt * 8 + 2 * t + e;
        if (g >= G) continue;
        const float qsum = e ? qs_b[nt] : qs_a[nt];
        const float v = S.ok[u][hr] ? scale * (z * qsum + s * acc[nt][2 * hr + e]) : -INFINITY;
        lrow[int64_t(g) * max_slots + slot] = v;
      }
  }
}

template <int D, int NTILE>
__global__ void __launch_bounds__(kEstWarps * 32) twl_estimate_kernel(const TwilightStep st,
                                                                       float* __restrict__ logits,
                                                                       int Hq, int Hkv, int P,
                                                                       int max_slots) {
  pdl_begin();  // pdl.cuh: first, before any global access
  constexpr int W = D / 32;  // 32-bit code words per lane per row (D/8 bytes)
  constexpr int QW = D / 8;  // bf16x2 q words per lane and head tile (D/4 dims)
  constexpr int U = kEstTilesPerWarp;
  const int list = blockIdx.y, b = list / Hkv, h = list % Hkv;
  const int G = Hq / Hkv;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = lane >> 2, t = lane & 3;
  const int e0 = st.base_off[list], ne = st.base_off[list + 1] - e0;
  const bool chunk = st.gran == SelGran::Chunk16;
  const int n_slots = min(chunk ? 16 * ne : ne, max_slots);  // longer lists: caller's bug
  const int n_tiles = (n_slots + 15) / 16;
  const int first = blockIdx.x * kEstWarps + warp, stride = gridDim.x * kEstWarps;
  if (first >= n_tiles) return;
  const int L = st.kv_len[b];
  const int32_t* pt = st.page_table + st.page_off[b];
  float* lrow = logits + int64_t(list) * G * max_slots;
  // q of head nt*8 + r, dims [t*D/4, t*D/4 + D/4), as bf16x2 (loads issued first: they
  // overlap the entry -> page chain below); its full sum over D.
  uint32_t qf[NTILE][QW];
  float qs_a[NTILE], qs_b[NTILE];
#pragma unroll
  for (int nt = 0; nt < NTILE; ++nt) {
    const int n = nt * 8 + r;
    const uint4* src = reinterpret_cast<const uint4*>(st.q + (int64_t(b) * Hq + h * G + min(n, G - 1)) * D + t * (D / 4));
#pragma unroll
    for (int c = 0; c < QW / 4; ++c) {
      const uint4 v = __ldg(src + c);
      qf[nt][4 * c] = v.x, qf[nt][4 * c + 1] = v.y, qf[nt][4 * c + 2] = v.z, qf[nt][4 * c + 3] = v.w;
    }
  }
  // Chunk16: lane j finds the first K row of the warp's tile j (entry -> page -> row).
  const int nt_w = (n_tiles - first + stride - 1) / stride;  // this warp's tiles
  const bool piped = chunk && nt_w <= kEstMaxWarpTiles;
  int64_t rb = 0;  // lane j: row of tile j's first token; pos0: its position
  int pos0 = 0;
  if (piped && lane < nt_w) {
    pos0 = __ldg(st.base_idx + e0 + first + lane * stride) * 16;
    const bool pow2 = (P & (P - 1)) == 0;  // the usual page sizes: no integer division
    const int page = pow2 ? pos0 >> (__ffs(P) - 1) : pos0 / P;
    rb = (int64_t(__ldg(pt + page)) * Hkv + h) * P + (pos0 - page * P);
  }
#pragma unroll
  for (int nt = 0; nt < NTILE; ++nt) {
    float part = 0.f;
    if (nt * 8 + r < G) {
#pragma unroll
      for (int c = 0; c < QW; ++c) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&qf[nt][c]));
        part += f.x + f.y;
      }
      // Words 4j..4j+3 hold dims (0,1) (2,3) (4,5) (6,7) of eight: regroup them as the code
      // pairs (0,4) (1,5) (2,6) (3,7) (nibble_pair_bf16x2's order).
#pragma unroll
      for (int j = 0; j < QW / 4; ++j) {
        const uint32_t w0 = qf[nt][4 * j], w1 = qf[nt][4 * j + 1], w2 = qf[nt][4 * j + 2], w3 = qf[nt][4 * j + 3];
        qf[nt][4 * j] = __byte_perm(w0, w2, 0x5410);
        qf[nt][4 * j + 1] = __byte_perm(w0, w2, 0x7632);
        qf[nt][4 * j + 2] = __byte_perm(w1, w3, 0x5410);
        qf[nt][4 * j + 3] = __byte_perm(w1, w3, 0x7632);
      }
    } else {
#pragma unroll
      for (int c = 0; c < QW; ++c) qf[nt][c] = 0u;
    }
    part += __shfl_xor_sync(0xffffffffu, part, 1);
    part += __shfl_xor_sync(0xffffffffu, part, 2);  // sum(q) of head nt*8 + r
    // This lane's accumulator columns are heads nt*8 + 2t and nt*8 + 2t + 1.
    qs_a[nt] = __shfl_sync(0xffffffffu, part, (2 * t) * 4);
    qs_b[nt] = __shfl_sync(0xffffffffu, part, (2 * t + 1) * 4);
  }
  if (piped) {
    // Stages of U tiles through a kEstRing-deep cp.async ring: kEstRing - 1 stages of code
    // loads in flight while one is multiplied (no registers held for them).
    __shared__ EstRing<W> ring_all[kEstWarps];
    EstRing<W>& ring = ring_all[warp];
    const int n_stages = (nt_w + U - 1) / U;
    uint32_t ok_bits = 0;  // bit (slot * 2U + 2u + hr): the row is a real token
    auto issue = [&](int k) {
      if (k < n_stages) {
        const int slot = k % kEstRing;
        ok_bits &= ~(((1u << (2 * U)) - 1u) << (slot * 2 * U));
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int j = k * U + u;  // warp-uniform
          const int64_t row0 = __shfl_sync(0xffffffffu, rb, j & 31);
          const int p0 = __shfl_sync(0xffffffffu, pos0, j & 31);
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const bool ok = j < nt_w && p0 + r + 8 * hr < L;
            ok_bits |= uint32_t(ok) << (slot * 2 * U + 2 * u + hr);
            const int64_t row = ok ? row0 + r + 8 * hr : 0;
            const uint8_t* src = st.codes + row * (D / 2) + t * (D / 8);
            if constexpr (W == 4) cp_async16(&ring.codes[slot][u][hr][lane][0], src, ok);
            else cp_async_small(&ring.codes[slot][u][hr][lane][0], src, 8, ok);
            cp_async_small(&ring.sz[slot][u][hr][lane], st.sz + row, 4, ok);
          }
        }
      }
      cp_async_commit();  // one group per stage, empty past the end (uniform counting)
    };
#pragma unroll
    for (int k = 0; k < kEstRing - 1; ++k) issue(k);
    for (int k = 0; k < n_stages; ++k) {
      cp_async_wait<kEstRing - 2>();  // stage k has landed (this lane's copies)
      const int slot = k % kEstRing;
      EstStage<W> S;
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          S.ok[u][hr] = (ok_bits >> (slot * 2 * U + 2 * u + hr)) & 1u;
#pragma unroll
          for (int c = 0; c < W; ++c) S.w[u][hr][c] = ring.codes[slot][u][hr][lane][c];
          S.sz[u][hr] = ring.sz[slot][u][hr][lane];
        }
      issue(k + kEstRing - 1);  // into the slot read at iteration k - 1
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int j = k * U + u;
        if (j >= nt_w) break;  // warp-uniform
        est_tile<D, NTILE>(S, u, first + j * stride, n_slots, qf, qs_a, qs_b, st.scale, G, r, t, lrow, max_slots);
      }
    }
    return;
  }
  // Token lists (a position per slot): U tiles per iteration, all their index, page and
  // code loads issued before any math (a warp's tiles are `stride` apart).
  for (int tile0 = first; tile0 < n_tiles; tile0 += U * stride) {
    EstStage<W> S;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tile = tile0 + u * stride;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int slot = tile * 16 + r + 8 * hr;
        int pos;
        if (chunk) {
          S.ok[u][hr] = tile < n_tiles;
          pos = S.ok[u][hr] ? __ldg(st.base_idx + e0 + tile) * 16 + r + 8 * hr : 0;
          S.ok[u][hr] = S.ok[u][hr] && pos < L;
        } else {
          S.ok[u][hr] = slot < n_slots;
          pos = S.ok[u][hr] ? __ldg(st.base_idx + e0 + slot) : 0;
        }
        const int64_t row = S.ok[u][hr] ? (int64_t(__ldg(pt + pos / P)) * Hkv + h) * P + pos % P : 0;
        est_load_row<W>(st.codes, st.sz, row, t, S.ok[u][hr], S.w[u][hr], S.sz[u][hr]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tile = tile0 + u * stride;
      if (tile >= n_tiles) break;  // warp-uniform
      est_tile<D, NTILE>(S, u, tile, n_slots, qf, qs_a, qs_b, st.scale, G, r, t, lrow, max_slots);
    }
  }
}

}  // namespace

void TwilightPruner::estimate(const TwilightStep& st, cudaStream_t s) {
  SPADE_CHECK(st.B >= 1 && st.B <= max_batch_, "twilight: batch ", st.B);
  SPADE_CHECK(st.gran == SelGran::Token || (st.gran == SelGran::Chunk16 && P_ % 16 == 0),
              "twilight: base lists must be Token or Chunk16 (P % 16 == 0)");
  const int G = Hq_ / Hkv_, NTILE = (G + 7) / 8;
  const int tiles = (max_slots_ + 15) / 16;
  // Tiles per warp: enough warps to fill the GPU (kEstWarpsPerSm per SM), at least
  // kEstTilesPerWarp (one stage) and at most kEstMaxWarpTiles (the Chunk16 pipeline's bound).
  const int64_t all_tiles = int64_t(tiles) * st.B * Hkv_;
  const int tpw = int(std::clamp<int64_t>(all_tiles / (int64_t(n_sms_) * kEstWarpsPerSm),
                                          kEstTilesPerWarp, kEstMaxWarpTiles / 2));
  dim3 grid(unsigned(std::max(1, (tiles + kEstWarps * tpw - 1) / (kEstWarps * tpw))),
            unsigned(st.B * Hkv_));
  auto go = [&](auto kernel) {
    launch_pdl(kernel, grid, kEstWarps * 32, 0, s, st, logits_, Hq_, Hkv_, P_, max_slots_);
  };
  if (D_ == 128) {
    if (NTILE == 1) go(twl_estimate_kernel<128, 1>);
    else if (NTILE == 2) go(twl_estimate_kernel<128, 2>);
    else go(twl_estimate_kernel<128, 4>);
  } else {
    if (NTILE == 1) go(twl_estimate_kernel<64, 1>);
    else if (NTILE == 2) go(twl_estimate_kernel<64, 2>);
    else go(twl_estimate_kernel<64, 4>);
  }
  SPADE_CUDA_LAUNCH();
}

}  // namespace spade::cuda
