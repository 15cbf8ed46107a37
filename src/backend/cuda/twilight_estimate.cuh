// Twilight pruner, the estimate's warp-level pieces (twilight.h; the kernel is
// twilight_estimate.cu).
//
// One warp estimates 16-slot tiles with integer tensor cores, mma.m16n8k32 u8 x s8 -> s32:
//   A = the INT4 codes of 16 rows as bytes: lane (r = lane / 4, t = lane % 4) holds 16-byte
//       (D = 128) or 8-byte (D = 64) pieces of rows r and r + 8, bytes [t D/8, t D/8 + D/8),
//       i.e. dims [t D/4, t D/4 + D/4) (two codes per byte, even dim in the low nibble).
//       Code word c becomes two A registers: w & 0x0F0F0F0F (dims 8c + 0, 2, 4, 6 of the
//       piece) and (w >> 4) & 0x0F0F0F0F (dims 8c + 1, 3, 5, 7): one mma step per word, and a
//       lane's k indices are its own dims for A and B alike (no shuffles).
//   B = q as signed 7-bit digits: per query head, with 2^e > max |q_d| (frexp), x = q 2^(7-e)
//       (exact) = Q0 + Q1 / 128 + Q2 / 128^2 + rest, Q_k = trunc of the remainder (|Q_k| <=
//       127, all of q's sign). Every bf16 q_d >= 2^-20 max |q| is exact in three digits;
//       smaller ones lose bits below 2^(e - 28). Columns of a pair of n-tiles: tile 2m column
//       2j + d = digit d (0, 1) of head 4m + j; tile 2m + 1 column 2j = digit 2 of head 4m + j
//       (column 2j + 1 is zero). So lane (r, t)'s accumulators are the three digit dot
//       products of head 4m + t for rows r and r + 8.
//   q . code = 2^(e - 7) (I0 + I1 / 128 + I2 / 128^2): integer sums are exact (|I| < 2^18),
//   then three exact conversions and two fp32 roundings. The previous bf16 form (codes as
//   0x4300 | c minus 128, fp32-accumulated mma.m16n8k16) spent 11 ALU ops per code word
//   against 3 here.
//   logit = scale * (zero * sum(q) + s * q . code), as kv/int4_keys.h's int4_dot (fp32).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/twilight.h"

namespace spade::cuda::twl {

using attn_detail::cp_async16;
using attn_detail::cp_async_commit;
using attn_detail::cp_async_wait;
using attn_detail::smem_u32;

constexpr int kEstTilesPerWarp = 2;   // tiles per load stage
constexpr int kEstMaxWarpTiles = 32;  // Chunk16 pipeline: a warp's tiles, one per lane
constexpr int kEstRing = 4;           // Chunk16 pipeline: stages in a warp's cp.async ring

__device__ __forceinline__ void imma_u8s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

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

// q of a KV head's group in this lane's registers: B fragments of the n-tile pairs (NP pairs
// of four heads each) and, for the epilogue, sum(q) and 2^(e - 7) of head 4m + t.
template <int D, int NP>
struct EstQ {
  uint32_t b[2 * NP][D / 32][2];
  float qsum[NP], qmul[NP];
};

// q's words of this lane (column r's head of each n-tile pair, dims [t D/4, t D/4 + D/4)),
// loaded first so the loads overlap the list's address chain; qg: the group's first query
// head [G][D] (bf16).
template <int D, int NP>
struct EstQRaw {
  uint32_t w[NP][D / 8];
};
template <int D, int NP>
__device__ __forceinline__ void est_q_fetch(EstQRaw<D, NP>& R, const bf16* __restrict__ qg, int G,
                                            int r, int t) {
#pragma unroll
  for (int m = 0; m < NP; ++m) {
    const int n = 4 * m + r / 2;
    const uint4* src = reinterpret_cast<const uint4*>(qg + int64_t(n < G ? n : 0) * D + t * (D / 4));
#pragma unroll
    for (int c = 0; c < D / 32; ++c) {
      const uint4 v = __ldg(src + c);
      R.w[m][4 * c] = v.x, R.w[m][4 * c + 1] = v.y, R.w[m][4 * c + 2] = v.z, R.w[m][4 * c + 3] = v.w;
    }
  }
}

// v 2^k as v times two normal powers of two (k in [-252, 254]): exact while the result is
// normal (here |v 2^k| < 2^21, and anything under 2^-126 truncates to 0 anyway).
__device__ __forceinline__ float scale_pow2(float v, int k) {
  const int k1 = k / 2, k2 = k - k1;
  return v * __int_as_float((127 + k1) << 23) * __int_as_float((127 + k2) << 23);
}

template <int D, int NP>
__device__ __forceinline__ void est_q_digits(EstQ<D, NP>& Q, const EstQRaw<D, NP>& R, int G, int r,
                                             int t) {
  constexpr int QW = D / 8;
  constexpr int W = D / 32;
#pragma unroll
  for (int m = 0; m < NP; ++m) {
    const bool valid = 4 * m + r / 2 < G;
    float amax = 0.f, part = 0.f;
#pragma unroll
    for (int c = 0; c < QW; ++c) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&R.w[m][c]));
      part += f.x + f.y;
      amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
    part += __shfl_xor_sync(0xffffffffu, part, 1);
    part += __shfl_xor_sync(0xffffffffu, part, 2);  // sum(q) of column r's head
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    int e = 0;
    if (amax > 0.f) frexpf(amax, &e);  // amax < 2^e
    // Digits of every dim of the piece: tile 2m takes digit (r & 1), tile 2m + 1 digit 2
    // (even r) or zeros (odd r). N = trunc(|q| 2^(21 - e)) < 2^21 (exact: a power-of-two
    // scaling and one conversion) holds the three digits as bits [14, 21), [7, 14), [0, 7).
    const int sh_a = (r & 1) ? 7 : 14, mask_b = (r & 1) ? 0 : 127;
#pragma unroll
    for (int c = 0; c < W; ++c) {
      uint32_t lo0 = 0u, hi0 = 0u, lo1 = 0u, hi1 = 0u;  // tile 2m: b0, b1; tile 2m + 1: b0, b1
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // dim 8c + j of the piece: word 4c + j / 2, half j % 2
        const __nv_bfloat162 h2 = *reinterpret_cast<const __nv_bfloat162*>(&R.w[m][4 * c + j / 2]);
        const float v = valid ? (j & 1 ? __high2float(h2) : __low2float(h2)) : 0.f;
        const int n = __float2int_rz(scale_pow2(v, 21 - e));
        const int sg = n >> 31, a = (n ^ sg) - sg;  // sign mask, |n|
        const uint32_t pa = uint32_t((((a >> sh_a) & 127) ^ sg) - sg) & 0xffu;
        const uint32_t pb = uint32_t(((a & mask_b) ^ sg) - sg) & 0xffu;
        const int sh = 8 * (j / 2);  // byte j/2 of b0 (even dims) or b1 (odd dims)
        if (j & 1) hi0 |= pa << sh, hi1 |= pb << sh;
        else lo0 |= pa << sh, lo1 |= pb << sh;
      }
      Q.b[2 * m][c][0] = lo0, Q.b[2 * m][c][1] = hi0;
      Q.b[2 * m + 1][c][0] = lo1, Q.b[2 * m + 1][c][1] = hi1;
    }
    // The epilogue's head 4m + t is column 2t's: lane (2t, 0) = lane 8t holds its values.
    Q.qsum[m] = __shfl_sync(0xffffffffu, part, 8 * t);
    Q.qmul[m] = scale_pow2(1.f, __shfl_sync(0xffffffffu, e, 8 * t) - 7);
  }
}

// Logits of one 16-slot tile from its stage entry u (slots slot0 .. slot0 + 15; slots at or
// past n_slots are not written): lane (r, t) stores head 4m + t of rows r and r + 8 at
// dst[g * dstride + r (+ 8)], -inf for rows past the context.
template <int D, int NP>
__device__ __forceinline__ void est_tile(const EstStage<D / 32>& S, int u, int slot0, int n_slots,
                                         const EstQ<D, NP>& Q, float scale, int G, int r, int t,
                                         float* __restrict__ dst, int dstride) {
  constexpr int W = D / 32;
  int acc[2 * NP][4];
#pragma unroll
  for (int j = 0; j < 2 * NP; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0;
#pragma unroll
  for (int c = 0; c < W; ++c) {
    const uint32_t w0 = S.w[u][0][c], w1 = S.w[u][1][c];
    const uint32_t a0 = w0 & 0x0f0f0f0fu, a2 = (w0 >> 4) & 0x0f0f0f0fu;
    const uint32_t a1 = w1 & 0x0f0f0f0fu, a3 = (w1 >> 4) & 0x0f0f0f0fu;
#pragma unroll
    for (int j = 0; j < 2 * NP; ++j) imma_u8s8(acc[j], a0, a1, a2, a3, Q.b[j][c][0], Q.b[j][c][1]);
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int slot = slot0 + r + 8 * hr;
    if (slot >= n_slots) continue;
    const __half2 p2 = *reinterpret_cast<const __half2*>(&S.sz[u][hr]);
    const float s = __low2float(p2), z = __high2float(p2);
#pragma unroll
    for (int m = 0; m < NP; ++m) {
      const int g = 4 * m + t;
      if (g >= G) continue;
      const float qc = (float(acc[2 * m][2 * hr]) + float(acc[2 * m][2 * hr + 1]) * 0x1p-7f +
                        float(acc[2 * m + 1][2 * hr]) * 0x1p-14f) * Q.qmul[m];
      const float v = S.ok[u][hr] ? scale * (z * Q.qsum[m] + s * qc) : -INFINITY;
      dst[int64_t(g) * dstride + r + 8 * hr] = v;
    }
  }
}

// One warp's tiles first, first + stride, ... < n_tiles of list `list`: logits of tile j's
// slots go to out[g * ostride + 16 j - obase + ...]; qg: the group's first query head. Chunk16 lists with at most
// kEstMaxWarpTiles tiles for this warp: lane j resolves tile j's entry -> page -> first row up
// front (one dependent chain per warp), then stages of kEstTilesPerWarp tiles stream through
// the warp's kEstRing-deep cp.async ring (ring: this warp's). Otherwise (Token lists, long
// Chunk16 lists): kEstTilesPerWarp tiles per iteration, all their index, page and code loads
// issued before the math.
template <int D, int NP>
__device__ __forceinline__ void est_warp(const TwilightStep& st, EstRing<D / 32>& ring, int list,
                                         int Hkv, int P, int G, int first, int stride, int n_tiles,
                                         int n_slots, const bf16* __restrict__ qg,
                                         float* __restrict__ out, int ostride, int obase) {
  constexpr int W = D / 32;
  constexpr int U = kEstTilesPerWarp;
  const int lane = threadIdx.x & 31, r = lane >> 2, t = lane & 3;
  const int b = list / Hkv, h = list % Hkv;
  const int e0 = st.base_off[list];
  const bool chunk = st.gran == SelGran::Chunk16;
  if (first >= n_tiles) return;
  EstQRaw<D, NP> qraw;
  est_q_fetch<D, NP>(qraw, qg, G, r, t);
  EstQ<D, NP> Q;
  const int L = st.kv_len[b];
  const int32_t* pt = st.page_table + st.page_off[b];
  const int nt_w = (n_tiles - first + stride - 1) / stride;  // this warp's tiles
  if (chunk && nt_w <= kEstMaxWarpTiles) {
    int64_t rb = 0;  // lane j: row of tile j's first token; pos0: its position
    int pos0 = 0;
    if (lane < nt_w) {
      pos0 = __ldg(st.base_idx + e0 + first + lane * stride) * 16;
      const bool pow2 = (P & (P - 1)) == 0;  // the usual page sizes: no integer division
      const int page = pow2 ? pos0 >> (__ffs(P) - 1) : pos0 / P;
      rb = (int64_t(__ldg(pt + page)) * Hkv + h) * P + (pos0 - page * P);
    }
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
    est_q_digits<D, NP>(Q, qraw, G, r, t);  // under the first stages' loads
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
        const int tile = first + j * stride;
        est_tile<D, NP>(S, u, tile * 16, n_slots, Q, st.scale, G, r, t, out + (tile * 16 - obase), ostride);
      }
    }
    return;
  }
  est_q_digits<D, NP>(Q, qraw, G, r, t);
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
      est_tile<D, NP>(S, u, tile * 16, n_slots, Q, st.scale, G, r, t, out + (tile * 16 - obase), ostride);
    }
  }
}

}  // namespace spade::cuda::twl
