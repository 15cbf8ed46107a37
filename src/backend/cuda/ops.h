// Element-wise and row ops of the CUDA backend (the attention kernels live in attention.h,
// GEMMs in gemm.h, sampling in sampling.h). Activations: the residual stream is fp32,
// GEMM inputs are bf16, GEMM outputs fp32; norm weights and RoPE frequencies are fp32.
// Every function launches on `stream` and checks the launch.
#pragma once
#include <cstdint>

#include "backend/cuda/cuda_common.h"

namespace spade::cuda {

// x[t,:] = float(table[ids[t],:]);  table bf16 [vocab, H]. Ids outside [0,vocab) give a
// row of NaN (checked on the host before upload by the model runner).
void embedding(const bf16* table, const int32_t* ids, float* x, int T, int H, int vocab,
               cudaStream_t s);

// y[r,:] = bf16(x[src,:] * rsqrt(mean(x[src,:]^2) + eps) * w), src = rows ? rows[r] : r.
void rmsnorm(const float* x, const int32_t* rows, const float* w, float eps, bf16* y, int R,
             int H, cudaStream_t s);

// Post-QKV-projection: one pass over qkv fp32 [T, (Hq + 2 Hkv) * D] that adds the bias
// (Qwen2), applies q/k RMSNorm over D (Qwen3), rotates q and k (RoPE, rotate-halves,
// angle = float(pos) * inv_freq[i] in fp32), writes q as bf16 [T, Hq, D] and appends k, v
// (bf16) to the paged cache at slot (page[t], pos[t] % P), layout [page][Hkv][P][D].
struct QkvPostArgs {
  const float* qkv = nullptr;
  const float* bias = nullptr;     // nullable, [(Hq + 2Hkv) * D]
  const float* q_norm = nullptr;   // nullable, [D]
  const float* k_norm = nullptr;   // nullable, [D]
  const float* inv_freq = nullptr; // [D/2]
  const int32_t* pos = nullptr;    // [T]
  const int32_t* page = nullptr;   // [T]: page id holding token t's slot
  bf16* q_out = nullptr;           // [T, Hq, D]
  bf16* k_cache = nullptr;         // this layer's K pages
  bf16* v_cache = nullptr;
  // Optional (Twilight): the INT4 copy of each appended key row, quantized from its bf16
  // value in the same pass (format and layout in int4_keys.cuh / twilight.h): codes
  // [page][Hkv][P][D/2], sz [page][Hkv][P]. Both null: no INT4 keys. Needs D % 4 == 0.
  uint8_t* k_int4 = nullptr;
  uint32_t* k_int4_sz = nullptr;
  // Optional (Quest decode steps): this layer's page metadata [page][Hkv][2][D] bf16 (min row,
  // max row), updated with each appended key: element-wise min / max with the page's stored
  // rows (a page's first row sets them), the same values, in the same order of operations, as
  // quest_update_meta's recompute over the page. Only when no two tokens of the launch write
  // the same page-head (one token per sequence) and the stored metadata covers the page's
  // earlier rows.
  bf16* quest_meta = nullptr;
  // FP8 cache (--kv-dtype fp8, issue 40): non-null: k_cache / v_cache point at one-byte E4M3
  // codes in the same layout (reinterpret them as uint8_t), and each K / V value x (fp32, after
  // bias, norm and RoPE) is stored as fp8_e4m3_from_f32(x / scale), scale = kv_scale[kh] for K,
  // kv_scale[Hkv + kh] for V (this layer's device [2][Hkv], powers of two): what the CPU pool's
  // write() stores for the same fp32 values, bit for bit (kv/fp8_e4m3.h). Not with k_int4 or
  // quest_meta (no method keeps per-page data over an fp8 cache yet).
  const float* kv_scale = nullptr;
  // Auto scales, the calibration pass (non-null; K/V caches untouched, q still written): each
  // K / V head's largest finite |value| of the launch (after bias, norm and RoPE, in fp32) is
  // max-reduced into kv_amax[kh] (K) / kv_amax[Hkv + kh] (V) as float bits (zero it first).
  // Not with the fused qkv GEMV.
  unsigned int* kv_amax = nullptr;
  // FP8 cache whose keys are stored rotated (kv/key_rotation.h, kv_rotates_keys: D 64 / 128 /
  // 256): each q and k row, after RoPE, is rotated (qkv_post_pair.cuh rotate_key_warp, the CPU's
  // rotate_key_row bit for bit) before its store, quantization or calibration maximum. Not with
  // the fused qkv GEMV.
  bool rotate_qk = false;
  int T = 0, Hq = 0, Hkv = 0, D = 0, P = 16;
  float eps = 1e-5f;
};
void qkv_post(const QkvPostArgs& a, cudaStream_t s);

// scales[i] = fp8_e4m3_scale_for_amax(float bits amax[i]) for i < n: the `--kv-scale auto` rule
// (kv/fp8_e4m3.h) on the maxima of qkv_post's calibration pass; the same rule as the CPU pool's
// calibrate_scales, on the GPU's values.
void fp8_scales_from_amax(const unsigned int* amax, float* scales, int n, cudaStream_t s);
// Fills n E4M3 codes with e4m3(N(0, 1) sample) from a counter-based hash (benchmarks:
// fill_kv_random of an fp8 cache with scale 1).
void fill_random_fp8(uint8_t* y, int64_t n, uint64_t seed, cudaStream_t s);

// out[t, i] = bf16(silu(gu[t, i]) * gu[t, F + i]);  gu fp32 [T, 2F] (gate | up).
void swiglu(const float* gu, bf16* out, int T, int F, cudaStream_t s);

// Conversions (weights at load time, tests).
void f32_to_bf16(const float* x, bf16* y, int64_t n, cudaStream_t s);
void bf16_to_f32(const bf16* x, float* y, int64_t n, cudaStream_t s);
// Fills bf16 / fp32 buffers with N(0, scale^2) + mean from a counter-based hash (synthetic
// weights, benchmark inputs): deterministic for a given seed, no host traffic.
void fill_random_bf16(bf16* y, int64_t n, uint64_t seed, float scale, float mean, cudaStream_t s);
void fill_random_f32(float* y, int64_t n, uint64_t seed, float scale, float mean, cudaStream_t s);

}  // namespace spade::cuda
