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
};

// v3/v4 decode kernels (attention_decode.cu). Variant v (1-based) of the table there.
struct DecodeVariant {
  const char* name;
  int warps, stages, tokens;  // warps per CTA, ring depth per warp, tokens per stage
  bool tma;                   // v4: K/V page-heads by the bulk tensor copy engine
};
int decode_v3_count();
DecodeVariant decode_v3_variant(int v);
// CTAs per SM for variant v at head dim D.
int decode_v3_occupancy(int D, int v);
// tmk/tmv: tensor maps of the K/V caches (rows of D bf16, 128-byte swizzle, box 64 x 16) for
// the TMA variants; when null (or P % 16 != 0) the cp.async twin of the variant runs.
void launch_decode_v3(int D, int v, const AttnArgs& a, dim3 grid, cudaStream_t s,
                      const CUtensorMap* tmk, const CUtensorMap* tmv);
// Encodes the tensor map of a paged cache (rows of D bf16 elements) for the TMA variants.
bool encode_kv_tensor_map(CUtensorMap* map, const void* base, int D);

// wgmma prefill (attention_prefill.cu): D = 128 on compute capability 9.0 with the sm_90a
// image present; 128 packed rows per work item (as the generic prefill kernel).
bool prefill_wgmma_ok(int D);
void launch_prefill_wgmma(const AttnArgs& a, dim3 grid, cudaStream_t s, int stages);

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
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

}  // namespace spade::cuda::attn_detail
