// Device helpers and the argument block shared by the attention kernels (attention.cu: the
// generic mma.sync kernel used for prefill and as the v2 decode; attention_decode.cu: the
// v3 decode kernels). Internal to src/backend/cuda/attention*.cu.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/cuda_common.h"

namespace spade::cuda::attn_detail {

// Ints between two DYN ticket counters: 256 bytes, so each counter has its own L2 line.
// Atomics on one line serialize in its L2 slice; with 8 counters in one line, the draws of a
// 128K batch-1 step (~500 per us on the H200) were bounded by that line (176 us vs 132 static).
constexpr int kTicketStride = 64;

struct AttnArgs {
  const bf16* q;
  bf16* out;
  const bf16* k;
  const bf16* v;
  const int32_t* page_table;
  const int32_t* page_off;
  const int32_t* kv_len;
  const int32_t* q_off;
  const int4* items;
  float* part_o;
  float* part_lse;
  int* counters;  // [batch][Hkv] split arrival counters (v3 decode; 0 between launches)
  // Chunk tickets of the DYN decode variants, one per (sequence, KV head) every kTicketStride
  // ints (0 between launches).
  int* tickets = nullptr;
  int Hq, Hkv, G, P, nsplit;
  int64_t total_rows;  // T * Hq
  float scale_log2;
  unsigned long long* trace = nullptr;  // prefill: per-CTA {start ns, end ns, smid, tiles} (bench)
  // BLASST (attention.h BlasstSkip): skip threshold in the kernels' log2 score units
  // (log2(lambda); -inf: the dense instantiation runs) and optional [Hkv][2] tile counters.
  float skip_log2 = -INFINITY;
  bool skip_per_length = false;  // threshold = min(0, skip_log2 - log2(kv_len)) per sequence
  // Decode score emission (attention.h DecodeScores): scores_out[(seq * Hkv + kvh) * ld + j] =
  // mean over the G query heads of q.k_j * scale (nullptr: none).
  // With scores_per_head: scores_out[(seq * Hq + hq) * ld + j] = q_hq.k_j * scale instead.
  float* scores_out = nullptr;
  int64_t scores_ld = 0;
  bool scores_per_head = false;
  unsigned long long* skip_counts = nullptr;
  // FP8 (E4M3) cache (--kv-dtype fp8, issue 40): k and v then hold one-byte codes in the same
  // [page][Hkv][P][D] layout, value = code x k_scale[kvh] (v_scale for V): this layer's [Hkv]
  // scales, powers of two (kv/fp8_e4m3.h). Null: bf16 cache. Only the v3 decode kernels (not
  // with BLASST skipping or score emission) read fp8; prefill runs over a bf16 copy of the
  // step's pages (AttentionWorkspace::run_fp8).
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
};

// v3 decode kernels (attention_decode.cu). Variant v (1-based) of the table there.
struct DecodeVariant {
  const char* name;
  int warps, stages, tokens;  // warps per CTA, ring depth per warp, tokens per stage
  bool dyn;                   // warps draw chunks from a per-(sequence, KV head) counter
};
int decode_v3_count();
DecodeVariant decode_v3_variant(int v);
// Dynamic shared memory of variant v at head dim D.
size_t decode_v3_smem(int D, int v);
// CTAs per SM for variant v at head dim D.
int decode_v3_occupancy(int D, int v);
// BLASST skipping when a.skip_log2 > -inf, score emission when a.scores_out, drawn chunks (DYN
// variants) when a.tickets; else the variant's static twin.
void launch_decode_v3(int D, int v, const AttnArgs& a, dim3 grid, cudaStream_t s);
// Encodes the tensor map of a paged cache (rows of D bf16 elements, 128-byte swizzle, box
// 64 x 16) for the TMA loads of the wgmma prefill.
bool encode_kv_tensor_map(CUtensorMap* map, const void* base, int D);

// wgmma prefill (attention_prefill.cu): D = 128 on compute capability 9.0 with the sm_90a
// image present; 128 packed rows per work item (as the generic prefill kernel).
bool prefill_wgmma_ok(int D);
// tmk, tmv (optional): tensor maps of the K and V caches (encode_kv_tensor_map); the kernels
// then load K and V tiles by TMA (P % 16 == 0; SPADE_PREFILL_TMA=0 turns it off).
void launch_prefill_wgmma(const AttnArgs& a, dim3 grid, cudaStream_t s, int stages,
                          const CUtensorMap* tmk = nullptr, const CUtensorMap* tmv = nullptr);

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
// Hopper-only PTX (mbarrier try_wait / expect_tx, bulk tensor copies): compiled for the
// compute capability 9.0+ device passes; the device passes of older targets (the fat binary's
// sm_80 / 86 / 89 images) get a trap instead, and the host never launches those instances
// there (the wgmma prefill and its TMA loads need 9.0).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define SPADE_SM90_ONLY(...) __trap()
#else
#define SPADE_SM90_ONLY(...) __VA_ARGS__
#endif
// Spins until the mbarrier's phase with the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();
#else
  uint32_t ok = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!ok);
#endif
}
// mbarrier arrive that also expects `bytes` of transaction (TMA) completion.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  SPADE_SM90_ONLY(asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
                               "r"(bytes)
                               : "memory"));
}
// One TMA box of a 2-D tensor map (encode_kv_tensor_map: {64 columns, 16 rows}, 128-byte
// swizzle) at coordinates (c0 = column, c1 = row) into shared memory dst, completing on bar.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            uint32_t bar) {
  SPADE_SM90_ONLY(asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory"));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                        const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                          uint32_t& r3, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Swizzled [rows][D] bf16 tile: 16-byte chunk c of row r lives at chunk c ^ (r & 7), so the
// 8 rows an ldmatrix reads hit 8 different bank groups.
template <int D>
__device__ __forceinline__ int swz(int r, int col) {
  return r * D + ((((col >> 3) ^ (r & 7))) << 3) + (col & 7);
}

// ---- Chunk math of the split-KV decode kernels (dense: attention_decode.cu; selections:
// sparse_attention.cu), one warp per TK-token chunk: S in the m16n8k16 accumulator layout (rows
// lane/4 and lane/4 + 8 = i 0 / 1, columns 8 nb + 2 (lane % 4) + e), rows >= 8 only when
// hi_rows (G > 8).

// Group-mean scores of one chunk of TK keys from the mma accumulators of Q K^T (s + s2: the
// even and odd k-steps, raw products): dst[j] = f * sum over the 16 rows, j in [j0, j0 + TK)
// and < L. Rows 0..15 of a column live in the 8 lanes with the same lane & 3 (row lane / 4 in
// [e], row lane / 4 + 8 in [2 + e]); rows >= G have q = 0 and add 0.
template <int TK>
__device__ __forceinline__ void store_group_mean_scores(const float (&s)[TK / 8][4],
                                                        const float (&s2)[TK / 8][4], float f,
                                                        float* dst, int j0, int L) {
  const int lane = threadIdx.x & 31, t4 = lane & 3;
#pragma unroll
  for (int nb = 0; nb < TK / 8; ++nb)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v = s[nb][e] + s2[nb][e] + s[nb][2 + e] + s2[nb][2 + e];
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      const int j = j0 + nb * 8 + 2 * t4 + e;
      if ((lane >> 2) == 0 && j < L) dst[j] = v * f;
    }
}

// s <- (s + s2) * sl2 (the two k-step chains, in log2 units), columns >= lim masked to -inf;
// mx[i] = the chunk's row maxima (quad-reduced).
template <int TK>
__device__ __forceinline__ void scale_mask_chunk(float (&s)[TK / 8][4], const float (&s2)[TK / 8][4],
                                                 int lim, float sl2, bool hi_rows, float (&mx)[2]) {
  const int t4 = threadIdx.x & 3;
  const bool mask = lim < TK;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = -INFINITY;
    if (i == 1 && !hi_rows) break;
#pragma unroll
    for (int nb = 0; nb < TK / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x = (s[nb][2 * i + e] + s2[nb][2 * i + e]) * sl2;
        if (mask && nb * 8 + 2 * t4 + e >= lim) x = -INFINITY;
        s[nb][2 * i + e] = x;
        mx[i] = fmaxf(mx[i], x);
      }
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
  }
}

// Online softmax with a lazy rescale: the reference max m moves only when a row max exceeds it
// by > 8 (p <= 256), so o is rescaled rarely. s becomes the probabilities; l the row sums.
template <int D, int TK>
__device__ __forceinline__ void online_softmax_chunk(float (&s)[TK / 8][4], const float (&mx)[2],
                                                     float (&m)[2], float (&l)[2],
                                                     float (&o)[D / 8][4], bool hi_rows) {
  float alpha[2] = {1.f, 1.f};
  bool need = false;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (i == 1 && !hi_rows) break;
    if (mx[i] > m[i] + 8.f) {
      alpha[i] = exp2f(m[i] - mx[i]);
      m[i] = mx[i];
      need = true;
    }
    const float mu = m[i] == -INFINITY ? 0.f : m[i];
    float rs = 0.f;
#pragma unroll
    for (int nb = 0; nb < TK / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = exp2f(s[nb][2 * i + e] - mu);
        s[nb][2 * i + e] = p;
        rs += p;
      }
    l[i] = l[i] * alpha[i] + rs;
  }
  if (__any_sync(0xffffffffu, need)) {
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
      o[nd][0] *= alpha[0];
      o[nd][1] *= alpha[0];
      o[nd][2] *= alpha[1];
      o[nd][3] *= alpha[1];
    }
  }
}

// ---- Epilogue of the split-KV decode kernels (dense: attention_decode.cu; selections:
// sparse_attention.cu). Each of the W warps holds o[D/8][4] (mma accumulators: rows lane/4 and
// lane/4 + 8, columns 8 nd + 2 (lane % 4) + {0, 1}), its running row max m (log2 units) and row
// sum l, for the rows g < G of one (sequence, KV head, split).

// Merges the W warps through shared memory (W * 16 * (D + 2) floats at smem; the caller's ring
// must be drained) and writes row row_base + g, g < G: bf16 out[row][D] when nsplit == 1, else
// the fp32 partial part_o[split][row][D] and its log2-sum-exp part_lse[split][row].
template <int D, int W>
__device__ __forceinline__ void merge_warps_store(const float (&o)[D / 8][4], const float (&m)[2],
                                                  const float (&l)[2], unsigned char* smem, int G,
                                                  int64_t row_base, int split, int nsplit,
                                                  int64_t total_rows, bf16* out, float* part_o,
                                                  float* part_lse) {
  constexpr int NT = W * 32;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, t4 = lane & 3;
  float* sO = reinterpret_cast<float*>(smem);  // [W][16][D]
  float* sM = sO + W * 16 * D;                 // [W][16]
  float* sL = sM + W * 16;                     // [W][16]
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = g8 + 8 * i;
    if (r < G) {
      float* dst = sO + (warp * 16 + r) * D;
#pragma unroll
      for (int nd = 0; nd < D / 8; ++nd)
        *reinterpret_cast<float2*>(dst + nd * 8 + 2 * t4) = make_float2(o[nd][2 * i], o[nd][2 * i + 1]);
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
      num += sc * sO[(w * 16 + g) * D + d];
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

// After merge_warps_store with nsplit > 1: whether this CTA is the last of the nsplit CTAs of its
// (sequence, KV head) to finish (arrival counter; s_last: a __shared__ int of the kernel). The
// last one runs combine_splits and resets the counter.
__device__ __forceinline__ bool last_split_cta(int* counter, int nsplit, int& s_last) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(counter, 1) == nsplit - 1;
  __syncthreads();
  if (!s_last) return false;
  __threadfence();
  return true;
}

// out rows row_base + g (g < G, <= 16) = sum over the ns splits of softmax-weighted partials:
// one round of lse loads, then the partial rows as float4 with 8 loads in flight per thread
// (latency, not bytes, bounds it); when the G rows have fewer float4 items than threads, thread
// groups take interleaved splits and add up in shared memory. Shared memory at smem: NT float4
// + ns * G + 32 floats (NT * 16 + (ns * G + 32) * 4 bytes). Resets *counter.
template <int D, int NT>
__device__ __forceinline__ void combine_splits(const float* part_o, const float* part_lse,
                                               int64_t total_rows, int64_t row_base, int ns, int G,
                                               bf16* out, unsigned char* smem, int* counter,
                                               int64_t out_row_base = -1) {
  // out_row_base >= 0: the output rows start there instead of at row_base (partials indexed
  // by work item, sparse_attention.cu).
  const int64_t orb = out_row_base >= 0 ? out_row_base : row_base;
  const int tid = threadIdx.x;
  constexpr int V4 = D / 4;
  const int items = G * V4;  // float4 outputs
  const int groups = items >= NT ? 1 : NT / items;
  float4* sRed = reinterpret_cast<float4*>(smem);                  // [groups][items]
  float* sW = reinterpret_cast<float*>(smem + size_t(NT) * 16);    // [ns][G] lse -> weights
  float* sMu = sW + ns * G;                                        // [G]
  float* sInv = sMu + 16;                                          // [G]
  for (int idx = tid; idx < ns * G; idx += NT) {
    const int sp = idx / G, g = idx % G;
    sW[idx] = __ldcg(part_lse + int64_t(sp) * total_rows + row_base + g);
  }
  __syncthreads();
  if (tid < G) {
    float mx = -INFINITY;
    for (int sp = 0; sp < ns; ++sp) mx = fmaxf(mx, sW[sp * G + tid]);
    const float mu = mx == -INFINITY ? 0.f : mx;
    float den = 0.f;
    for (int sp = 0; sp < ns; ++sp) den += exp2f(sW[sp * G + tid] - mu);
    sMu[tid] = mu;
    sInv[tid] = den > 0.f ? 1.f / den : 0.f;
  }
  __syncthreads();
  for (int idx = tid; idx < ns * G; idx += NT) {
    const int g = idx % G;
    sW[idx] = exp2f(sW[idx] - sMu[g]) * sInv[g];
  }
  __syncthreads();
  const int64_t sstride4 = total_rows * V4;  // float4 stride between splits
  const float4* po4 = reinterpret_cast<const float4*>(part_o);
  // Sum over splits sp = s0, s0 + step, ... of w * partial for float4 item i (8 loads in flight).
  auto accum = [&](int i, int s0, int step) {
    const int g = i / V4;
    const float4* src = po4 + (row_base + g) * V4 + (i % V4);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    int sp = s0;
    for (; sp + 7 * step < ns; sp += 8 * step) {
      float4 v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = __ldcg(src + int64_t(sp + u * step) * sstride4);
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const float w = sW[(sp + u * step) * G + g];
        acc.x += w * v[u].x, acc.y += w * v[u].y, acc.z += w * v[u].z, acc.w += w * v[u].w;
      }
    }
    for (; sp < ns; sp += step) {
      const float4 v = __ldcg(src + int64_t(sp) * sstride4);
      const float w = sW[sp * G + g];
      acc.x += w * v.x, acc.y += w * v.y, acc.z += w * v.z, acc.w += w * v.w;
    }
    return acc;
  };
  auto store = [&](int i, float4 v) {
    const int g = i / V4;
    __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out + (orb + g) * D + (i % V4) * 4);
    dst[0] = __floats2bfloat162_rn(v.x, v.y);
    dst[1] = __floats2bfloat162_rn(v.z, v.w);
  };
  if (groups == 1) {
    for (int i = tid; i < items; i += NT) store(i, accum(i, 0, 1));
  } else {
    const int gi = tid / items;
    if (gi < groups) sRed[gi * items + tid % items] = accum(tid % items, gi, groups);
    __syncthreads();
    for (int i = tid; i < items; i += NT) {
      float4 v = sRed[i];
      for (int q = 1; q < groups; ++q) {
        const float4 u = sRed[q * items + i];
        v.x += u.x, v.y += u.y, v.z += u.z, v.w += u.w;
      }
      store(i, v);
    }
  }
  if (tid == 0) *counter = 0;  // ready for the next launch
}

}  // namespace spade::cuda::attn_detail
