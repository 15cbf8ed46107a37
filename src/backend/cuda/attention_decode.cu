// Paged decode attention, v3 (cp.async rings per warp), for steps where every sequence has
// q_len == 1; see attention.h for the API.
//
// Layout read: q bf16 [B, Hq, D]; K/V bf16 pages [page][Hkv][P][D] (one page of one head is
// P*D*2 contiguous bytes: 4 KB at P=16, D=128); page table int32 per sequence.
// Layout written: out bf16 [B, Hq, D]; with splits, partials fp32 [split][B*Hq][D] and
// log2-sum-exp [split][B*Hq], combined by the LAST CTA of each (sequence, KV head) to arrive
// (arrival counter per (sequence, KV head), reset by that CTA): no second launch.
//
// Work: a CTA = (sequence, split, KV head) with W warps (grid: KV head x work item). The CTA's token range is cut into
// chunks of TK tokens (TK = 16: one page at P = 16); warp w streams chunks w, w+W, w+2W, ...
// through its OWN S-stage cp.async ring (16-byte copies, rows swizzled for ldmatrix) with
// only __syncwarp between stages: no CTA barrier in the main loop, so one warp's compute
// never holds up another warp's loads. Per lane and chunk: one page-id (read one iteration
// ahead, a broadcast load), then TK*D*2*2/512 16-byte cp.async with constant offsets.
// Compute per chunk (mma.sync m16n8k16, bf16 -> fp32): the G <= 16 query heads of the KV
// head are the rows (rows >= G are zero), Q fragments live in registers for the whole loop;
// S = Q K^T (two accumulator chains), online softmax in log2 units with a lazy rescale (the
// running max moves only when it grows by > 8, i.e. p <= 256, so o is rescaled rarely; only
// rows < 8 are touched when G <= 8), O += P V. The W warps merge through shared memory.
// v4 (lane 0 of each warp moves a chunk by TMA bulk tensor copies instead of cp.async per
// lane) measured 5-7% SLOWER than v3 on an H200 and was never picked: it lives on, for A/B runs
// only, in bench/dev/attention_decode_tma.cu.
// Variants: v3_w4s3 (4 warps, 3 stages, 2 CTAs/SM) and v3_w8s3 (8 warps, 1 CTA/SM); auto's
// rule is in attention.cu. Split count: the smallest that fills >= 96% of the CTA slots of the
// last wave (W4: 32 at B = 1, Hkv = 8; W8: 16).
// DYN twins (v3d_*): a warp's first S chunks are static, (k * nsplit + split) * W + warp, and
// every later one is nsplit * W * S + a ticket drawn (atomicAdd by lane 0, one iteration before
// the chunk's page id is read) from a counter per (sequence, KV head): the splits and warps
// that stream faster take more chunks, so none waits at the end for a slower one. The order of
// the sums then varies between runs (not bit-reproducible: AttentionWorkspace's deterministic
// mode runs the static twin, passing no counters). The last CTA resets the counter; a warp
// draws only while it has chunks, so each drawn ticket is read before the warp leaves its loop
// (no draw outlives the reset).
// Bytes per SM in flight: (CTAs/SM) x W x (S-1..S) x TK*D*2*2 (8 KB per chunk at D = 128).
// Shared memory: 4 KB (Q) + W*S*TK*D*2*2 (ring) + 1 KB alignment: W4 S3 -> 101 KB (2 CTAs/SM).
// Split combine: the last CTA reads every split's lse (one round of loads), then the partial
// rows as float4 with 8 loads in flight per thread (latency, not bytes, bounds it).
// FP8 cache (F8 instances, AttnArgs::k_scale set; issue 40): the ring holds E4M3 codes (TK*D
// bytes per tile: 16-byte cp.async of half the bytes, unswizzled rows); after a chunk lands,
// each lane widens the 16-byte pieces it copied itself (one cvt.rn.f16x2.e4m3x2 per two codes,
// exact: every E4M3 value is an f16) into the warp's own f16 K and V tiles (swizzled as the
// bf16 ring), and the chunk math runs on them with f16 mma.sync (m16n8k16, fp32 accumulate):
// Q's fragments are converted once from bf16 to f16 (exact for |q| in [2^-14, 65504]), P is
// packed as f16 (<= 256 by the lazy rescale; finer than bf16). The scales are per (layer, KV
// head), so one per CTA: K's is folded into the softmax's log2 scale and V's into o before the
// merge; both are powers of two, so this equals widening code x scale (no rounding moves). The
// ring gets one more stage than the bf16 variant's (S + 1: same shared memory and CTAs per SM).
// FP8 direct (F8R instances, SPADE_FP8_DIRECT=1, D = 128 only; A/B candidate): no widened tile.
// The widened path moves ~6 shared-memory bytes per code byte (cp.async write 1, lds 1, sts 2,
// ldmatrix 2; bf16 moves 2 per byte) at twice bf16's bytes per second: near the SM's 128 B/clk.
// Here each code byte is written once (cp.async) and read once (lds.128 into registers), then
// cvt.rn.f16x2.e4m3x2 builds the mma fragments directly:
// - Tile layout: rows of 128 codes (8 pieces of 16 bytes); piece p of row r at p ^ h(r),
//   h(r) = (r & 6) ^ ((r & 1) << 2): both read patterns below hit 8 distinct pieces (32 banks)
//   per quarter-warp.
// - S = Q K^T: the sum over d may take the d's in any order, as long as Q and K agree. Lane
//   (g8 = lane / 4, t4 = lane % 4) loads piece 4 kk4 + t4 of K row (8 nb + g8): 16 codes, d =
//   64 kk4 + 16 t4 + 0..15. K-step kk = 4 kk4 + j takes bytes 4j..4j+3 of it: B slots k = 2 t4,
//   2 t4 + 1 are d0 + 0, 1 and slots 2 t4 + 8, 9 are d0 + 2, 3 (d0 = 64 kk4 + 16 t4 + 4 j); Q's A
//   fragments are loaded once in that same order (two bf16x2 loads per k-step and row).
// - O += P V: B slot n of n-block dp holds d = 16 n + dp, so lane g8 needs d = 16 g8 + dp for all
//   16 dp: piece g8 of the V rows 2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9 (4 lds.128); a byte permute
//   (prmt) pairs the two rows' codes of one d (k slots 2 t4, 2 t4 + 1) before the cvt. P's
//   fragments and the token order are unchanged (masking as before). o's columns come out
//   permuted (o[dp][e] of lane t4 is d = 16 (2 t4 + e) + dp); the warp merge stores them to
//   their natural columns (rows of D + 4 floats: 4-way conflicts on that one store).
// - The freed shared memory (no widened tiles) goes to the ring: 6 stages at 4 and 8 warps (4
//   for the two-stage variant's twin): the same bytes and CTAs per SM as the bf16 variant.
// Napkin math (Llama-3-8B shapes Hq=32, Hkv=8, D=128, bf16): 32K tokens = 134 MB of K/V per
// sequence and layer -> 30 us at 4.5 TB/s; ~8 KFLOP of mma per token and KV head (16 padded
// rows), 16 FLOP/byte: far under the tensor-core roof. Measured (H200, docs/cuda.md): 4.39-4.44
// TB/s at B >= 8 (SDPA on contiguous caches: 4.31-4.56), 3.3-4.0 TB/s at B = 1.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/per_device.h"
#include "core/tuning.h"

namespace spade::cuda::attn_detail {
namespace {

template <int D, int W, int S, int TK, bool F8 = false, bool F8R = false>
struct DecCfg {
  static constexpr int kThreads = W * 32;
  static constexpr int CH = D / 8;     // 16-byte chunks per row
  static constexpr int RPI = 32 / CH;  // rows per warp-wide copy instruction
  static constexpr int kTile = TK * D;
  static constexpr int kStage = 2 * kTile;  // K then V (elements)
  static constexpr size_t kQ = 4096;        // 16 rows x D bf16, padded to keep the ring 1 KB aligned
  // Bytes of one ring stage: bf16 tiles, or fp8 codes (F8).
  static constexpr size_t kStageBytes = size_t(kStage) * (F8 ? 1 : sizeof(bf16));
  static constexpr size_t kRing = size_t(W) * S * kStageBytes;
  // F8: each warp's widened K and V tiles (f16); none with F8R (codes read into registers).
  static constexpr size_t kWide = F8 && !F8R ? size_t(W) * kStage * sizeof(bf16) : 0;
  // The warp merge: [W][16] rows of D floats (F8R: D + 4) and the rows' m and l.
  static constexpr size_t kMerge = size_t(W) * 16 * (D + (F8R ? 6 : 2)) * sizeof(float);
  static constexpr size_t kSmem =
      1024 + ((kQ + kRing + kWide) > kMerge ? (kQ + kRing + kWide) : kMerge);
  // F8 copies: 16 codes per cp.async.
  static constexpr int CH8 = D / 16;
  static constexpr int RPI8 = 32 / CH8;
  static_assert(TK % 16 == 0 && TK % RPI == 0 && TK % RPI8 == 0,
                "chunk must be a multiple of 16 rows");
  static_assert(16 * D * 2 <= 4096, "Q tile");
};

// 16 E4M3 codes -> 16 f16 (exact), as two 16-byte pieces.
__device__ __forceinline__ void e4m3x16_to_f16(const uint4& c, uint4& lo, uint4& hi) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
  uint32_t out[8];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw hr =
          __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w[k] >> (16 * h)), __NV_E4M3);
      out[2 * k + h] = uint32_t(hr.x) | (uint32_t(hr.y) << 16);
    }
  }
  lo = make_uint4(out[0], out[1], out[2], out[3]);
  hi = make_uint4(out[4], out[5], out[6], out[7]);
}

// mma.sync m16n8k16 with fp32 accumulators: bf16 operands, or f16 (F16: the fp8 instances).
template <bool F16>
__device__ __forceinline__ void mma_k16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  if constexpr (F16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    mma16816(c, a, b0, b1);
  }
}
template <bool F16>
__device__ __forceinline__ uint32_t pack_k16(float lo, float hi) {
  if constexpr (F16) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    return pack_bf16(lo, hi);
  }
}
// A bf16x2 register as f16x2 (Q fragments of the fp8 instances).
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t x) {
  return pack_k16<true>(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
}

// Byte offset of (row r, column col % 8 == 0) in a chunk tile [TK][D], 16-byte chunk c of row
// r at c ^ (r & 7).
template <int D>
__device__ __forceinline__ uint32_t kv_off(int r, int col) {
  return uint32_t(swz<D>(r, col)) * 2;
}

// F8R: byte offset of the 16-byte piece p (0..7) of row r in a code tile [TK][128] (piece p at
// p ^ h(r); see the comment on top).
__device__ __forceinline__ uint32_t f8r_off(int r, int p) {
  return uint32_t(r * 128 + ((p ^ ((r & 6) ^ ((r & 1) << 2))) << 4));
}
// F8R: the two E4M3 codes in the low 16 bits of x as f16x2 (exact; the low byte in the low half).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t x) {
  const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(x & 0xffffu), __NV_E4M3);
  return uint32_t(hr.x) | (uint32_t(hr.y) << 16);
}

// F8R: merge_warps_store (attention_common.cuh) for o's permuted columns: o[dp][2 i + e] (row
// g8 + 8 i) is column 16 (2 t4 + e) + dp; rows of sO padded to D + 4 floats.
template <int D, int W>
__device__ __forceinline__ void merge_warps_store_f8r(const float (&o)[D / 8][4], const float (&m)[2],
                                                      const float (&l)[2], unsigned char* smem,
                                                      int G, int64_t row_base, int split, int nsplit,
                                                      int64_t total_rows, bf16* out, float* part_o,
                                                      float* part_lse) {
  static_assert(D == 128, "F8R: D = 128");
  constexpr int NT = W * 32, SD = D + 4;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, t4 = lane & 3;
  float* sO = reinterpret_cast<float*>(smem);  // [W][16][SD]
  float* sM = sO + W * 16 * SD;                // [W][16]
  float* sL = sM + W * 16;                     // [W][16]
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = g8 + 8 * i;
    if (r < G) {
      float* dst = sO + (warp * 16 + r) * SD;
#pragma unroll
      for (int nd = 0; nd < D / 8; ++nd)
#pragma unroll
        for (int e = 0; e < 2; ++e) dst[16 * (2 * t4 + e) + nd] = o[nd][2 * i + e];
      if (t4 == 0) {
        sM[warp * 16 + r] = m[i];
        sL[warp * 16 + r] = l[i];
      }
    }
  }
  __syncthreads();
  for (int idx = tid; idx < G * D; idx += NT) {
    const int g = idx / D, d = idx % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < W; ++w) mx = fmaxf(mx, sM[w * 16 + g]);
    const float mu = mx == -INFINITY ? 0.f : mx;
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float sc = exp2f(sM[w * 16 + g] - mu);
      num += sc * sO[(w * 16 + g) * SD + d];
      den += sc * sL[w * 16 + g];
    }
    const float val = den > 0.f ? num / den : 0.f;
    const int64_t gr = row_base + g;
    if (nsplit == 1) {
      out[gr * D + d] = __float2bfloat16(val);
    } else {
      part_o[(int64_t(split) * total_rows + gr) * D + d] = val;
      if (d == 0) part_lse[int64_t(split) * total_rows + gr] = den > 0.f ? mu + log2f(den) : -INFINITY;
    }
  }
}

template <int D, int W, int S, int TK, bool SKIP, bool EMIT, bool DYN, bool F8 = false,
          bool F8R = false>
__global__ void __launch_bounds__(W * 32) decode_v3_kernel(const AttnArgs a) {
  pdl_begin();  // pdl.cuh: first, before any global access
  using C = DecCfg<D, W, S, TK, F8, F8R>;
  static_assert(!F8R || (F8 && D == 128), "the direct fp8 path: fp8 instances at D = 128");
  static_assert(!(EMIT && SKIP) && !(DYN && SKIP),
                "BLASST skipping runs with neither score emission nor drawn chunks");
  static_assert(!(F8 && (SKIP || EMIT)), "the fp8 cache runs without BLASST and score emission");
  constexpr int CH = C::CH, RPI = C::RPI, NT = C::kThreads;
  extern __shared__ __align__(1024) unsigned char smem_dyn[];
  __shared__ int s_last;
  unsigned char* smem_raw = smem_dyn + ((1024 - (smem_u32(smem_dyn) & 1023)) & 1023);
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* ring = reinterpret_cast<bf16*>(smem_raw + C::kQ);
  unsigned char* ring8 = smem_raw + C::kQ;  // F8: the ring's stages as bytes

  // Grid (Hkv, items): CTAs start in item order, so every (sequence, KV head)'s split 0 is in
  // the first wave and, with drawn chunks, later splits take over the tails of earlier ones.
  const int4 item = a.items[blockIdx.y];
  const int seq = item.x, split = item.z;
  const int kvh = blockIdx.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int G = a.G, P = a.P;
  const int q0 = a.q_off[seq];
  const int L = a.kv_len[seq];
  const int* pt = a.page_table + a.page_off[seq];
  const int n_ch = (L + TK - 1) / TK;
  const int per = (n_ch + a.nsplit - 1) / a.nsplit;
  const int cb = split * per;
  const int n_cta = max(0, min(n_ch, cb + per) - cb);
  const int n_my = n_cta > warp ? (n_cta - warp + W - 1) / W : 0;  // chunks of this warp

  const int64_t head_stride = int64_t(P) * D;
  const int64_t page_stride = int64_t(a.Hkv) * head_stride;
  const int p_shift = (P & (P - 1)) == 0 ? __ffs(P) - 1 : -1;
  auto pdiv = [&](int j) { return p_shift >= 0 ? j >> p_shift : j / P; };
  auto pmod = [&](int j) { return p_shift >= 0 ? j & (P - 1) : j % P; };
  // Fast path: a chunk never straddles a page (one page id per chunk, rows contiguous).
  const bool fast = P % TK == 0;
  const int cc = lane % CH, rl = lane / CH;
  auto chunk_j0 = [&](int k) { return (cb + warp + k * W) * TK; };
  // F8: this lane's 16-byte piece of each copied row (column cc8 * 16, rows rl8 + i * RPI8).
  const int cc8 = lane % C::CH8, rl8 = lane / C::CH8;
  // (f16 elements behind the bf16 pointer type: 2-byte addressing only.)
  bf16* wide = reinterpret_cast<bf16*>(smem_raw + C::kQ + C::kRing) + warp * C::kStage;

  // parts: 1 = the K tile, 2 = the V tile, 3 = both (BLASST loads V only for kept chunks).
  auto issue_at = [&](int j0, int st, int pid, int parts = 3) {
    if constexpr (F8) {  // codes: rows of D bytes, unswizzled; K tile then V tile
      unsigned char* dK8 = ring8 + (warp * S + st) * C::kStageBytes;
      unsigned char* dV8 = dK8 + C::kTile;
      const unsigned char* k8 = reinterpret_cast<const unsigned char*>(a.k);
      const unsigned char* v8 = reinterpret_cast<const unsigned char*>(a.v);
#pragma unroll
      for (int i = 0; i < TK / C::RPI8; ++i) {
        const int r = rl8 + i * C::RPI8;
        const int j = j0 + r;
        const bool valid = j < L;
        int64_t off = 0;
        if (valid)
          off = int64_t(fast ? pid : pt[pdiv(j)]) * page_stride + kvh * head_stride +
                int64_t(pmod(j)) * D + cc8 * 16;
        if constexpr (F8R) {  // pieces swizzled (see the comment on top)
          cp_async16(dK8 + f8r_off(r, cc8), k8 + off, valid);
          cp_async16(dV8 + f8r_off(r, cc8), v8 + off, valid);
        } else {
          cp_async16(dK8 + r * D + cc8 * 16, k8 + off, valid);
          cp_async16(dV8 + r * D + cc8 * 16, v8 + off, valid);
        }
      }
      return;
    }
    bf16* dK = ring + (warp * S + st) * C::kStage;
    bf16* dV = dK + C::kTile;
    if (fast) {
      const int64_t base = int64_t(pid) * page_stride + kvh * head_stride +
                           int64_t(pmod(j0)) * D + cc * 8;
      const bf16* gk = a.k + base;
      const bf16* gv = a.v + base;
#pragma unroll
      for (int i = 0; i < TK / RPI; ++i) {
        const int r = rl + i * RPI;
        const bool valid = j0 + r < L;
        if (parts & 1) cp_async16(dK + swz<D>(r, cc * 8), valid ? gk + r * D : a.k, valid);
        if (parts & 2) cp_async16(dV + swz<D>(r, cc * 8), valid ? gv + r * D : a.v, valid);
      }
    } else {
#pragma unroll
      for (int i = 0; i < TK / RPI; ++i) {
        const int r = rl + i * RPI;
        const int j = j0 + r;
        const bool valid = j < L;
        int64_t off = 0;
        if (valid)
          off = int64_t(pt[pdiv(j)]) * page_stride + kvh * head_stride + int64_t(pmod(j)) * D +
                cc * 8;
        if (parts & 1) cp_async16(dK + swz<D>(r, cc * 8), a.k + off, valid);
        if (parts & 2) cp_async16(dV + swz<D>(r, cc * 8), a.v + off, valid);
      }
    }
  };
  auto issue = [&](int k, int st, int pid, int parts = 3) { issue_at(chunk_j0(k), st, pid, parts); };

  // BLASST seeds: K rows of the sequence's first (attention sink) and last (most recent) chunk,
  // any page size, into the K and V halves of ring stage S - 1 (unused until iteration 0).
  auto issue_keys = [&](int j0, bf16* dst) {
#pragma unroll
    for (int i = 0; i < TK / RPI; ++i) {
      const int r = rl + i * RPI;
      const int j = j0 + r;
      const bool valid = j < L;
      int64_t off = 0;
      if (valid)
        off = int64_t(pt[pdiv(j)]) * page_stride + kvh * head_stride + int64_t(pmod(j)) * D + cc * 8;
      cp_async16(dst + swz<D>(r, cc * 8), a.k + off, valid);
    }
  };

  // Q rows (the G heads of this KV head; rows >= G zero) go in the first commit group.
  for (int idx = tid; idx < 16 * CH; idx += NT) {
    const int r = idx / CH, c = idx % CH;
    const bool valid = r < G;
    const bf16* src = a.q + (int64_t(q0) * a.Hq + kvh * G + r) * D + c * 8;
    cp_async16(sQ + swz<D>(r, c * 8), valid ? src : a.q, valid);
  }
  if constexpr (SKIP) {  // in group 0 with Q
    bf16* seed = ring + (warp * S + S - 1) * C::kStage;
    issue_keys(0, seed);
    if (n_ch > 1) issue_keys((n_ch - 1) * TK, seed + C::kTile);
  }
  // DYN: the warp's chunks are cq[0..S-1] = (k * nsplit + split) * W + warp for k < S (a
  // static prefix, so the first loads need no round trip), then nsplit * W * S + t for the
  // tickets t this warp draws from the (sequence, KV head) counter, one per chunk, requested
  // one iteration before the chunk's page id is read and two before its copies are issued.
  // Warps (and CTAs) that stream faster take more chunks: no static tail. Each warp's chunk
  // indices increase, so once one is past the end the warp is done. Reset by the last CTA.
  int cq[S + 1];
  int t_raw = 0;  // lane 0: the ticket in flight
  int* tick = DYN ? a.tickets + (seq * a.Hkv + kvh) * kTicketStride : nullptr;
  const int dyn_base = a.nsplit * W * S;
  if constexpr (DYN) {
#pragma unroll
    for (int k = 0; k < S; ++k) cq[k] = (k * a.nsplit + split) * W + warp;
    cq[S] = n_ch;
    // Draw only while the warp still has chunks, so every drawn ticket is read (by the shfl of
    // the next iteration, which then runs) before the warp leaves the loop: no draw can land
    // after the counter's reset. Tickets are monotonic: past one invalid chunk, all are.
    t_raw = n_ch;
    if (lane == 0 && cq[S - 1] < n_ch) t_raw = atomicAdd(tick, 1);
  }
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if constexpr (SKIP) cp_async_commit();  // the (empty) V group of chunk s - S + 1
    if constexpr (DYN) {
      if (cq[s] < n_ch) issue_at(cq[s] * TK, s, fast ? pt[pdiv(cq[s] * TK)] : 0);
    } else {
      if (s < n_my) issue(s, s, fast ? pt[pdiv(chunk_j0(s))] : 0, SKIP ? 1 : 3);
    }
    cp_async_commit();
  }
  int pid_next = 0;  // page id of the next chunk to issue (S - 1), loaded one iteration early
  if constexpr (DYN) {
    if (fast && cq[S - 1] < n_ch) pid_next = pt[pdiv(cq[S - 1] * TK)];
  } else {
    if (fast && S - 1 < n_my) pid_next = pt[pdiv(chunk_j0(S - 1))];
  }
  if constexpr (SKIP) cp_async_wait<2 * S - 3>();  // Q (group 0) has landed
  else cp_async_wait<S - 2>();  // this thread's Q part (group 0) has landed
  __syncthreads();

  uint32_t qa[D / 16][4];
  if constexpr (F8R) {
    // K-step kk = 4 kk4 + j: slots 2 t4 + 0, 1 are d0 + 0, 1 and slots 2 t4 + 8, 9 are d0 + 2, 3
    // (d0 = 64 kk4 + 16 t4 + 4 j): the order the K fragments come in (see the comment on top).
    const int t4q = lane & 3, g8q = lane >> 2;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int d0 = 64 * (kk >> 2) + 16 * t4q + 4 * (kk & 3);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint2 v = *reinterpret_cast<const uint2*>(sQ + swz<D>(g8q + 8 * i, d0 & ~7) + (d0 & 7));
        qa[kk][i] = bf16x2_to_f16x2(v.x);
        qa[kk][2 + i] = bf16x2_to_f16x2(v.y);
      }
    }
  } else {
    const int mi = lane >> 3;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int r = (lane & 7) + ((mi & 1) ? 8 : 0);
      const int col = kk * 16 + ((mi & 2) ? 8 : 0);
      ldsm_x4(qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], sQ + swz<D>(r, col));
      if constexpr (F8) {  // the f16 mma's operands
#pragma unroll
        for (int e = 0; e < 4; ++e) qa[kk][e] = bf16x2_to_f16x2(qa[kk][e]);
      }
    }
  }
  const bool hi_rows = G > 8;  // rows 8..15 carry heads only when G > 8
  float o[D / 8][4];
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[nd][e] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int t4 = lane & 3, g8 = lane >> 2;
  // F8: K's scale folded into the log2 softmax scale (a power of two: exact).
  const float sl2 = F8 ? a.scale_log2 * a.k_scale[kvh] : a.scale_log2;

  const int mi = lane >> 3;
  // S = Q K^T of one chunk (two accumulator chains: even / odd k-steps).
  auto qk = [&](const unsigned char* bK, float (&sc)[TK / 8][4], float (&sc2)[TK / 8][4]) {
#pragma unroll
    for (int nb = 0; nb < TK / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[nb][e] = 0.f, sc2[nb][e] = 0.f;
    if constexpr (F8R) {  // K row 8 nb + g8, piece 4 kk4 + t4: 4 k-steps per lds.128
#pragma unroll
      for (int nb = 0; nb < TK / 8; ++nb) {
#pragma unroll
        for (int kk4 = 0; kk4 < D / 64; ++kk4) {
          const uint4 c = *reinterpret_cast<const uint4*>(bK + f8r_off(nb * 8 + g8, 4 * kk4 + t4));
          const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const uint32_t b0 = e4m3x2_to_f16x2(w[j]), b1 = e4m3x2_to_f16x2(w[j] >> 16);
            if (j & 1) mma_k16<true>(sc2[nb], qa[4 * kk4 + j], b0, b1);
            else mma_k16<true>(sc[nb], qa[4 * kk4 + j], b0, b1);
          }
        }
      }
    } else {  // bf16, or the widened f16 tile (ldmatrix)
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < TK / 16; ++np) {
        const int r = np * 16 + (lane & 7) + ((mi & 2) ? 8 : 0);
        const int col = kk * 16 + ((mi & 1) ? 8 : 0);
        uint32_t b0, b1, b2, b3;
        ldsm_x4(b0, b1, b2, b3, bK + kv_off<D>(r, col));
        if (kk & 1) {
          mma_k16<F8>(sc2[2 * np], qa[kk], b0, b1);
          mma_k16<F8>(sc2[2 * np + 1], qa[kk], b2, b3);
        } else {
          mma_k16<F8>(sc[2 * np], qa[kk], b0, b1);
          mma_k16<F8>(sc[2 * np + 1], qa[kk], b2, b3);
        }
      }
    }
    }
  };
  // P (bf16 A fragments) of one chunk from the probabilities in sc.
  auto pack_p = [&](const float (&sc)[TK / 8][4], uint32_t (&pa)[TK / 16][4]) {
#pragma unroll
    for (int k2 = 0; k2 < TK / 16; ++k2) {
      pa[k2][0] = pack_k16<F8>(sc[2 * k2][0], sc[2 * k2][1]);
      pa[k2][1] = pack_k16<F8>(sc[2 * k2][2], sc[2 * k2][3]);
      pa[k2][2] = pack_k16<F8>(sc[2 * k2 + 1][0], sc[2 * k2 + 1][1]);
      pa[k2][3] = pack_k16<F8>(sc[2 * k2 + 1][2], sc[2 * k2 + 1][3]);
    }
  };
  // O += P V (rows >= 8 carry junk when G <= 8; they are never written out).
  auto pv = [&](const uint32_t (&pa)[TK / 16][4], const unsigned char* bV) {
    if constexpr (F8R) {  // piece g8 (d = 16 g8 + dp) of rows 2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9
#pragma unroll
      for (int k2 = 0; k2 < TK / 16; ++k2) {
        const int r0 = 16 * k2 + 2 * t4;
        const uint4 c0 = *reinterpret_cast<const uint4*>(bV + f8r_off(r0, g8));
        const uint4 c1 = *reinterpret_cast<const uint4*>(bV + f8r_off(r0 + 1, g8));
        const uint4 c2 = *reinterpret_cast<const uint4*>(bV + f8r_off(r0 + 8, g8));
        const uint4 c3 = *reinterpret_cast<const uint4*>(bV + f8r_off(r0 + 9, g8));
        const uint32_t x0[4] = {c0.x, c0.y, c0.z, c0.w}, x1[4] = {c1.x, c1.y, c1.z, c1.w};
        const uint32_t x2[4] = {c2.x, c2.y, c2.z, c2.w}, x3[4] = {c3.x, c3.y, c3.z, c3.w};
#pragma unroll
        for (int wi = 0; wi < 4; ++wi) {
          // [row a byte b, row b byte b] pairs: bytes 0, 1 (0x5140) and 2, 3 (0x7362).
          const uint32_t lo01 = __byte_perm(x0[wi], x1[wi], 0x5140);
          const uint32_t hi01 = __byte_perm(x0[wi], x1[wi], 0x7362);
          const uint32_t lo23 = __byte_perm(x2[wi], x3[wi], 0x5140);
          const uint32_t hi23 = __byte_perm(x2[wi], x3[wi], 0x7362);
          mma_k16<true>(o[4 * wi + 0], pa[k2], e4m3x2_to_f16x2(lo01), e4m3x2_to_f16x2(lo23));
          mma_k16<true>(o[4 * wi + 1], pa[k2], e4m3x2_to_f16x2(lo01 >> 16),
                        e4m3x2_to_f16x2(lo23 >> 16));
          mma_k16<true>(o[4 * wi + 2], pa[k2], e4m3x2_to_f16x2(hi01), e4m3x2_to_f16x2(hi23));
          mma_k16<true>(o[4 * wi + 3], pa[k2], e4m3x2_to_f16x2(hi01 >> 16),
                        e4m3x2_to_f16x2(hi23 >> 16));
        }
      }
    } else {  // bf16, or the widened f16 tile (ldmatrix.trans)
#pragma unroll
    for (int k2 = 0; k2 < TK / 16; ++k2) {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        const int r = k2 * 16 + (lane & 7) + ((mi & 1) ? 8 : 0);
        const int col = dp * 16 + ((mi & 2) ? 8 : 0);
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(b0, b1, b2, b3, bV + kv_off<D>(r, col));
        mma_k16<F8>(o[2 * dp], pa[k2], b0, b1);
        mma_k16<F8>(o[2 * dp + 1], pa[k2], b2, b3);
      }
    }
    }
  };
  // Score emission (EMIT): the chunk's q.k products, per query head or as the group mean.
  auto emit_scores = [&](int j0, const float (&sc)[TK / 8][4], const float (&sc2)[TK / 8][4]) {
    // Rows 0..15 of a column live in the 8 lanes with the same t4 (row g8 in c[e], row
    // g8 + 8 in c[2 + e]); rows >= G have q = 0 and add 0.
    if (a.scores_per_head) {  // row g = query head kvh * G + g
      const float f = sl2 * 0.6931471805599453f;  // log2 units -> natural
      float* dst = a.scores_out + (int64_t(seq) * a.Hq + kvh * G) * a.scores_ld;
#pragma unroll
      for (int nb = 0; nb < TK / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = j0 + nb * 8 + 2 * t4 + e;
          if (j >= L) continue;
          if (g8 < G) dst[int64_t(g8) * a.scores_ld + j] = (sc[nb][e] + sc2[nb][e]) * f;
          if (g8 + 8 < G)
            dst[int64_t(g8 + 8) * a.scores_ld + j] = (sc[nb][2 + e] + sc2[nb][2 + e]) * f;
        }
    } else {  // group mean; log2 units -> natural / G
      store_group_mean_scores<TK>(sc, sc2, sl2 * 0.6931471805599453f / float(G),
                                  a.scores_out + (int64_t(seq) * a.Hkv + kvh) * a.scores_ld, j0, L);
    }
  };
  // Scale to log2 units, mask columns past L, row maxima of the chunk (quad-reduced).
  auto chunk_max = [&](int j0, float (&sc)[TK / 8][4], const float (&sc2)[TK / 8][4],
                       float (&mx)[2]) { scale_mask_chunk<TK>(sc, sc2, L - j0, sl2, hi_rows, mx); };
  // Online softmax (lazy rescale) of the chunk: sc becomes the probabilities.
  auto softmax = [&](float (&sc)[TK / 8][4], const float (&mx)[2]) {
    online_softmax_chunk<D, TK>(sc, mx, m, l, o, hi_rows);
  };

  // One chunk (K tile tK, V tile tV, first key j0) into the running softmax state.
  auto attend_chunk = [&](const bf16* tK, const bf16* tV, int j0) {
    float sc[TK / 8][4], sc2[TK / 8][4], mx[2];
    uint32_t pa[TK / 16][4];
    qk(reinterpret_cast<const unsigned char*>(tK), sc, sc2);
    if constexpr (EMIT) emit_scores(j0, sc, sc2);
    chunk_max(j0, sc, sc2, mx);
    softmax(sc, mx);
    pack_p(sc, pa);
    pv(pa, reinterpret_cast<const unsigned char*>(tV));
  };

  // F8: widens this lane's pieces of stage st (its own copies, complete after its wait) into
  // the warp's f16 tiles, then makes them visible to the warp.
  auto widen = [&](int st) {
    const unsigned char* sK8 = ring8 + (warp * S + st) * C::kStageBytes;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const unsigned char* src = sK8 + t * C::kTile;
      bf16* dst = wide + t * C::kTile;
#pragma unroll
      for (int i = 0; i < TK / C::RPI8; ++i) {
        const int r = rl8 + i * C::RPI8;
        const uint4 c = *reinterpret_cast<const uint4*>(src + r * D + cc8 * 16);
        uint4 lo, hi;
        e4m3x16_to_f16(c, lo, hi);
        *reinterpret_cast<uint4*>(dst + swz<D>(r, cc8 * 16)) = lo;
        *reinterpret_cast<uint4*>(dst + swz<D>(r, cc8 * 16 + 8)) = hi;
      }
    }
    __syncwarp();
  };

  if constexpr (DYN) {
    int st_issue = S - 1, st_use = 0;
    while (cq[0] < n_ch) {
      __syncwarp();  // every lane is done reading the stage about to be overwritten
      cq[S] = dyn_base + __shfl_sync(0xffffffffu, t_raw, 0);  // drawn one iteration ago
      t_raw = n_ch;
      if (lane == 0 && cq[S] < n_ch) t_raw = atomicAdd(tick, 1);
      if (cq[S - 1] < n_ch) issue_at(cq[S - 1] * TK, st_issue, pid_next);
      cp_async_commit();
      if (fast && cq[S] < n_ch) pid_next = pt[pdiv(cq[S] * TK)];
      const bf16* tK = ring + (warp * S + st_use) * C::kStage;
      const bf16* tV = tK + C::kTile;
      const int j0 = cq[0] * TK;
      cp_async_wait<S - 1>();
      __syncwarp();  // make every lane's copies of chunk cq[0] visible to the warp
      if constexpr (F8R) {  // the codes themselves (byte stages)
        const unsigned char* t8 = ring8 + (warp * S + st_use) * C::kStageBytes;
        attend_chunk(reinterpret_cast<const bf16*>(t8), reinterpret_cast<const bf16*>(t8 + C::kTile), j0);
      } else if constexpr (F8) {
        widen(st_use);
        attend_chunk(wide, wide + C::kTile, j0);
      } else {
        attend_chunk(tK, tV, j0);
      }
#pragma unroll
      for (int i = 0; i < S; ++i) cq[i] = cq[i + 1];
      st_issue = st_issue + 1 == S ? 0 : st_issue + 1;
      if (++st_use == S) st_use = 0;
    }
  } else if constexpr (!SKIP) {
  int st_issue = S - 1, st_use = 0;
  for (int k = 0; k < n_my; ++k) {
    __syncwarp();  // every lane is done reading the stage about to be overwritten
    const int kn = k + S - 1;
    if (kn < n_my) issue(kn, st_issue, pid_next);
    cp_async_commit();
    if (fast && kn + 1 < n_my) pid_next = pt[pdiv(chunk_j0(kn + 1))];
    const bf16* tK = ring + (warp * S + st_use) * C::kStage;
    const bf16* tV = tK + C::kTile;
    const int j0 = chunk_j0(k);
    cp_async_wait<S - 1>();
    __syncwarp();  // make every lane's copies of chunk k visible to the warp
    if constexpr (F8R) {  // the codes themselves (byte stages)
      const unsigned char* t8 = ring8 + (warp * S + st_use) * C::kStageBytes;
      attend_chunk(reinterpret_cast<const bf16*>(t8), reinterpret_cast<const bf16*>(t8 + C::kTile), j0);
    } else if constexpr (F8) {
      widen(st_use);
      attend_chunk(wide, wide + C::kTile, j0);
    } else {
      attend_chunk(tK, tV, j0);
    }
    st_issue = st_issue + 1 == S ? 0 : st_issue + 1;
    if (++st_use == S) st_use = 0;
  }
  } else {
    // BLASST: chunk k's V tile is loaded only if the chunk is kept, so P V runs one chunk
    // behind (P of chunk k waits in registers while V_k lands). Commit groups, in order:
    // per iteration k [V_k or empty] then [K_{k+S-1}] (prologue: [empty] [K_s]); hence K_k is
    // complete when <= 2S-4 groups are pending, V_{k-1} when <= 3 are (after iteration k's
    // two commits). K_{k+S-1} goes to stage (k-1) % S, whose V half still holds V_{k-1}: the
    // halves are disjoint, and V_{k-S} (the previous occupant of V half k % S) was consumed
    // in iteration k-S+1.
    const float thr = a.skip_per_length ? fminf(0.f, a.skip_log2 - log2f(float(L))) : a.skip_log2;
    // The skip test's running max (m, the softmax reference, lags it by up to 8), seeded with
    // the row maxima of the sequence's first and last chunks: with split-KV a warp may own
    // only a few chunks, and without a seed its first chunk could never be skipped. The
    // seed only sharpens the decisions; the softmax of the kept chunks stays exact.
    float mt[2] = {-INFINITY, -INFINITY};
    {
      const unsigned char* seed =
          reinterpret_cast<const unsigned char*>(ring + (warp * S + S - 1) * C::kStage);
      float sc[TK / 8][4], sc2[TK / 8][4];
      qk(seed, sc, sc2);
      chunk_max(0, sc, sc2, mt);
      if (n_ch > 1) {
        float mx[2];
        qk(seed + C::kTile * sizeof(bf16), sc, sc2);
        chunk_max((n_ch - 1) * TK, sc, sc2, mx);
        mt[0] = fmaxf(mt[0], mx[0]);
        mt[1] = fmaxf(mt[1], mx[1]);
      }
      __syncwarp();  // seed reads done before iteration 0 reuses stage S - 1
    }
    uint32_t pend[TK / 16][4];             // P of the kept chunk k-1
    bool have_pend = false;
    int st_use = 0, st_prev = S - 1;
    unsigned tiles = 0, skipped = 0;
    for (int k = 0; k < n_my; ++k) {
      __syncwarp();  // every lane is done with iteration k-1's shared-memory reads
      const int j0 = chunk_j0(k);
      const int pid_cur = fast ? pt[pdiv(j0)] : 0;  // for V_k (in flight during the wait)
      cp_async_wait<2 * S - 4>();
      __syncwarp();  // K_k visible to the warp
      bf16* tK = ring + (warp * S + st_use) * C::kStage;
      float sc[TK / 8][4], sc2[TK / 8][4], mx[2];
      qk(reinterpret_cast<const unsigned char*>(tK), sc, sc2);
      chunk_max(j0, sc, sc2, mx);
      // Skip vote (every lane of a quad holds its row's max; rows >= G do not vote).
      bool keep_row = false;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (i == 1 && !hi_rows) break;
        if (g8 + 8 * i < G && !(mx[i] - fmaxf(mt[i], mx[i]) < thr)) keep_row = true;
      }
      const bool keep = __any_sync(0xffffffffu, keep_row);
      ++tiles;
      if (keep) {
        issue(k, st_use, pid_cur, 2);
        mt[0] = fmaxf(mt[0], mx[0]);
        mt[1] = fmaxf(mt[1], mx[1]);
      } else {
        ++skipped;
      }
      cp_async_commit();  // [V_k] (empty when skipped)
      const int kn = k + S - 1;
      if (kn < n_my) issue(kn, st_prev, pid_next, 1);
      cp_async_commit();  // [K_{k+S-1}]
      if (fast && kn + 1 < n_my) pid_next = pt[pdiv(chunk_j0(kn + 1))];
      if (have_pend) {  // O += P_{k-1} V_{k-1}, before chunk k may rescale O
        cp_async_wait<3>();
        __syncwarp();
        pv(pend, reinterpret_cast<const unsigned char*>(ring + (warp * S + st_prev) * C::kStage +
                                                        C::kTile));
      }
      have_pend = keep;
      if (keep) {
        softmax(sc, mx);
        pack_p(sc, pend);
      }
      st_prev = st_use;
      if (++st_use == S) st_use = 0;
    }
    if (have_pend) {
      cp_async_wait<0>();
      __syncwarp();
      pv(pend, reinterpret_cast<const unsigned char*>(ring + (warp * S + st_prev) * C::kStage +
                                                      C::kTile));
    }
    if (a.skip_counts && lane == 0) {
      atomicAdd(a.skip_counts + 2 * kvh, (unsigned long long)tiles);
      atomicAdd(a.skip_counts + 2 * kvh + 1, (unsigned long long)skipped);
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
  if constexpr (F8) {  // V's scale (a power of two: exact)
    const float vs = a.v_scale[kvh];
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[nd][e] *= vs;
  }

  // Merge the W warps (rows < G) through shared memory (the ring is free now), then the split
  // combine by the last CTA of this (sequence, KV head) to finish.
  const int64_t row_base = int64_t(q0) * a.Hq + kvh * G;
  if constexpr (F8R) {
    merge_warps_store_f8r<D, W>(o, m, l, smem_raw, G, row_base, split, a.nsplit, a.total_rows,
                                a.out, a.part_o, a.part_lse);
  } else {
    merge_warps_store<D, W>(o, m, l, smem_raw, G, row_base, split, a.nsplit, a.total_rows, a.out,
                            a.part_o, a.part_lse);
  }
  if (a.nsplit == 1) {
    if (DYN && tid == 0) *tick = 0;  // the merge's barriers: every warp is done drawing
    return;
  }
  if (!last_split_cta(a.counters + seq * a.Hkv + kvh, a.nsplit, s_last)) return;
  if (DYN && tid == 0) *tick = 0;  // every CTA of this (sequence, KV head) is done drawing
  combine_splits<D, NT>(a.part_o, a.part_lse, a.total_rows, row_base, a.nsplit, G, a.out, smem_raw,
                        a.counters + seq * a.Hkv + kvh);
}

// Variant table (index v - 1): every variant auto (AttentionWorkspace::auto_variant,
// fitting_variant) picks somewhere. Shared memory at D = 128: 4 KB Q + W*S*8 KB + 1 KB.
constexpr DecodeVariant kVariants[] = {
    {"v3_w4s3", 4, 3, 16, false},   // 101 KB, 2 CTAs/SM, 8 warps/SM
    {"v3_w8s3", 8, 3, 16, false},   // 197 KB, 1 CTA/SM, 8 warps/SM
    {"v3d_w4s3", 4, 3, 16, true},   // v3 with chunks drawn from a counter (DYN)
    {"v3d_w8s3", 8, 3, 16, true},
    // Two-stage rings for GPUs with 99 KB of shared memory per block (sm_86 / 89: w4s3 needs
    // 101 KB at D = 128): 69 KB. Auto takes them only where the 3-stage ring does not fit
    // (AttentionWorkspace::fitting_variant); D = 64 runs its 3-stage ring (51 KB) everywhere.
    {"v3_w4s2", 4, 2, 16, false},
    {"v3d_w4s2", 4, 2, 16, true},
};
// Measured and dropped (docs/cuda.md): a 2-warp 6-stage TMA variant (-10..-16%), the
// cp.async L2::256B prefetch hint (-3..-7%), 4-warp 2-stage and 2-warp 4-stage rings (as the
// only ring; the 4-warp 2-stage one is back for 99 KB GPUs). The TMA twins of w4s3 / w8s3
// (v4, -5..-7%) are in bench/dev/attention_decode_tma.cu.
constexpr int kNumVariants = int(sizeof(kVariants) / sizeof(kVariants[0]));

template <int D, int W, int S, int TK, bool SKIP = false, bool EMIT = false, bool DYN = false,
          bool F8 = false, bool F8R = false>
struct Inst {
  using C = DecCfg<D, W, S, TK, F8, F8R>;
  static void prepare() {
    static PerDeviceOnce done;  // per device: tensor-parallel ranks as threads (per_device.h)
    if (done.pending()) {
      set_max_dynamic_smem(decode_v3_kernel<D, W, S, TK, SKIP, EMIT, DYN, F8, F8R>, int(C::kSmem));
      done.mark();
    }
  }
  static int occupancy() {
    if (C::kSmem > smem_optin_bytes()) return 0;  // does not fit this GPU (never launched here)
    prepare();
    int n = 0;
    SPADE_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &n, decode_v3_kernel<D, W, S, TK, SKIP, EMIT, DYN, F8, F8R>, C::kThreads, C::kSmem));
    return n;
  }
  static void launch(const AttnArgs& a, dim3 grid, cudaStream_t s) {
    prepare();
    launch_pdl(decode_v3_kernel<D, W, S, TK, SKIP, EMIT, DYN, F8, F8R>, grid, C::kThreads, C::kSmem, s, a);
    SPADE_CUDA_LAUNCH();
  }
};

// skip: the BLASST instance; emit: the score-emitting instance (TidalDecode, LessIsMore,
// LycheeDecode); allow_dyn: the DYN variants draw their chunks (else their static twins run).
// f8: the fp8-cache instances (one more ring stage than the variant's; neither skip nor emit);
// f8r: at D = 128 their direct twins (codes into registers, no widened tiles: the ring gets the
// freed bytes, 6 stages, or 4 for the two-stage variant; same shared memory as the variant).
template <typename F>
void dispatch(int D, int v, bool skip, bool emit, bool allow_dyn, F&& f, bool f8 = false,
              bool f8r = false) {
  const int vi = (v >= 1 && v <= kNumVariants ? v : 1) - 1;
  const DecodeVariant dv = kVariants[vi];
  const bool dyn = dv.dyn && allow_dyn && !skip;  // BLASST and deterministic runs: static twin
  if (f8) {
    SPADE_CHECK(!skip && !emit, "fp8 KV cache: the v3 decode kernel reads it without BLASST "
                                "skipping and score emission");
    if (f8r && D == 128) {
      if (dv.stages == 2) {
        if (dyn) return f(Inst<128, 4, 4, 16, false, false, true, true, true>{});
        return f(Inst<128, 4, 4, 16, false, false, false, true, true>{});
      }
      if (dv.warps == 8) {
        if (dyn) return f(Inst<128, 8, 6, 16, false, false, true, true, true>{});
        return f(Inst<128, 8, 6, 16, false, false, false, true, true>{});
      }
      if (dyn) return f(Inst<128, 4, 6, 16, false, false, true, true, true>{});
      return f(Inst<128, 4, 6, 16, false, false, false, true, true>{});
    }
    if (D == 64) {
      if (dyn) return f(Inst<64, 4, 4, 16, false, false, true, true>{});
      return f(Inst<64, 4, 4, 16, false, false, false, true>{});
    }
    if (dv.stages == 2) {
      if (dyn) return f(Inst<128, 4, 3, 16, false, false, true, true>{});
      return f(Inst<128, 4, 3, 16, false, false, false, true>{});
    }
    if (dv.warps == 8) {
      if (dyn) return f(Inst<128, 8, 4, 16, false, false, true, true>{});
      return f(Inst<128, 8, 4, 16, false, false, false, true>{});
    }
    if (dyn) return f(Inst<128, 4, 4, 16, false, false, true, true>{});
    return f(Inst<128, 4, 4, 16, false, false, false, true>{});
  }
  if (D == 64) {
    if (emit && dyn) return f(Inst<64, 4, 3, 16, false, true, true>{});
    if (emit) return f(Inst<64, 4, 3, 16, false, true>{});
    if (skip) return f(Inst<64, 4, 3, 16, true>{});
    if (dyn) return f(Inst<64, 4, 3, 16, false, false, true>{});
    return f(Inst<64, 4, 3, 16>{});
  }
  if (dv.stages == 2) {
    if (emit && dyn) return f(Inst<128, 4, 2, 16, false, true, true>{});
    if (emit) return f(Inst<128, 4, 2, 16, false, true>{});
    if (skip) return f(Inst<128, 4, 2, 16, true>{});
    if (dyn) return f(Inst<128, 4, 2, 16, false, false, true>{});
    return f(Inst<128, 4, 2, 16>{});
  }
  if (dv.warps == 8) {
    if (emit && dyn) return f(Inst<128, 8, 3, 16, false, true, true>{});
    if (emit) return f(Inst<128, 8, 3, 16, false, true>{});
    if (skip) return f(Inst<128, 8, 3, 16, true>{});
    if (dyn) return f(Inst<128, 8, 3, 16, false, false, true>{});
    return f(Inst<128, 8, 3, 16>{});
  }
  if (emit && dyn) return f(Inst<128, 4, 3, 16, false, true, true>{});
  if (emit) return f(Inst<128, 4, 3, 16, false, true>{});
  if (skip) return f(Inst<128, 4, 3, 16, true>{});
  if (dyn) return f(Inst<128, 4, 3, 16, false, false, true>{});
  return f(Inst<128, 4, 3, 16>{});
}

}  // namespace

int decode_v3_count() { return kNumVariants; }
DecodeVariant decode_v3_variant(int v) { return kVariants[(v >= 1 && v <= kNumVariants ? v : 1) - 1]; }
size_t decode_v3_smem(int D, int v) {
  size_t n = 0;
  dispatch(D, v, false, false, false, [&](auto inst) { n = decltype(inst)::C::kSmem; });
  return n;
}
int decode_v3_occupancy(int D, int v) {
  int n = 0;
  dispatch(D, v, false, false, true, [&](auto inst) { n = decltype(inst)::occupancy(); });
  return n;
}
void launch_decode_v3(int D, int v, const AttnArgs& a, dim3 grid, cudaStream_t s) {
  dispatch(D, v, a.skip_log2 > -INFINITY, a.scores_out != nullptr, a.tickets != nullptr,
           [&](auto inst) { decltype(inst)::launch(a, grid, s); }, a.k_scale != nullptr,
           tuning().fp8_direct);
}

bool encode_kv_tensor_map(CUtensorMap* map, const void* base, int D) {
  using Fn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                          const cuuint64_t*, const cuuint32_t*, const cuuint32_t*,
                          CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                          CUtensorMapFloatOOBfill);
  static Fn fn = nullptr;
  static bool tried = false;
  if (!tried) {
    tried = true;
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                           cudaEnableDefault, &q);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &q);
#endif
    if (e == cudaSuccess && q == cudaDriverEntryPointSuccess) fn = reinterpret_cast<Fn>(p);
    cudaGetLastError();
  }
  if (!fn || (reinterpret_cast<uintptr_t>(base) & 15)) return false;
  // Rows of D elements; the row count only bounds the coordinates (page ids index real pages).
  const cuuint64_t dims[2] = {cuuint64_t(D), cuuint64_t(1) << 31};
  const cuuint64_t strides[1] = {cuuint64_t(D) * 2};
  const cuuint32_t box[2] = {64, 16};
  const cuuint32_t estr[2] = {1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
            estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace spade::cuda::attn_detail
