// Selection lists built on the GPU for the model's sparse decode step (cuda_model.cpp):
// CSR offsets and entries from the device copy of the step's context lengths, so a decode
// step needs no host work between the selector and the attention. See sparse_attention.h.
#include <cmath>

#include "backend/cuda/sparse_attention.h"
#include "backend/cuda/pdl.cuh"

namespace spade::cuda {

namespace {

// Valid entries of request b's rows: min(k, units of its context), units of `unit` tokens.
__device__ __forceinline__ int list_len(const int32_t* kv_len, int b, int k, int unit) {
  const int nu = (kv_len[b] + unit - 1) / unit;
  return nu < k ? nu : k;
}

// One CTA per list row = b * Hkv + h. The row's CSR start is the sum of the lengths before
// it (B is small: a serial sum per CTA).
__global__ void topk_compact_kernel(const int32_t* strided, const int32_t* kv_len, int Hkv,
                                    int k, int unit, int n_rows, int32_t* off, int32_t* idx) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int row = blockIdx.x, b = row / Hkv, h = row % Hkv;
  int start = 0;
  for (int bb = 0; bb < b; ++bb) start += Hkv * list_len(kv_len, bb, k, unit);
  const int n = list_len(kv_len, b, k, unit);
  start += h * n;
  for (int j = threadIdx.x; j < n; j += blockDim.x)
    idx[start + j] = strided[int64_t(row) * k + j];
  if (threadIdx.x == 0) {
    off[row] = start;
    if (row == n_rows - 1) off[row + 1] = start + n;
  }
}

__global__ void row_lengths_kernel(const int32_t* kv_len, int n_rows, int Hkv, uint32_t heads,
                                   int32_t* out) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < n_rows) out[r] = (heads >> (r % Hkv)) & 1u ? kv_len[r / Hkv] : 0;
}

__global__ void streaming_lists_kernel(const int32_t* kv_len, int B, int budget, int sinks,
                                       int32_t* off, int32_t* idx) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int b = blockIdx.x;
  int start = 0;
  for (int bb = 0; bb < b; ++bb) start += min(kv_len[bb], budget);
  const int L = kv_len[b];
  const int n = min(L, budget);
  for (int j = threadIdx.x; j < n; j += blockDim.x)
    idx[start + j] = (L <= budget || j < sinks) ? j : L - budget + j;
  if (threadIdx.x == 0) {
    off[b] = start;
    if (b == B - 1) off[b + 1] = start + n;
  }
}

// One CTA per (request b, KV head h): for each of the G query heads g the row max and the sum
// of exp over [0, L) (block reductions), then W[j] = sum_g exp(s_g[j] - max_g) / sum_g.
// Reads G * L fp32 scores twice, writes L fp32 weights.
constexpr int kOwThreads = 1024;
__global__ void __launch_bounds__(kOwThreads) oracle_weights_kernel(const float* sc, int64_t ld,
                                                                     const int32_t* kv_len, int Hq,
                                                                     int Hkv, float* out) {
  pdl_begin();  // pdl.cuh: first, before any global access
  __shared__ float s_red[32];
  __shared__ float s_max[16], s_inv[16];
  const int row = blockIdx.x, b = row / Hkv, h = row % Hkv, G = Hq / Hkv;
  const int L = kv_len[b];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  auto block_reduce = [&](float v, bool is_max) {
    for (int o = 16; o > 0; o >>= 1) {
      const float y = __shfl_xor_sync(0xffffffffu, v, o);
      v = is_max ? fmaxf(v, y) : v + y;
    }
    if (lane == 0) s_red[warp] = v;
    __syncthreads();
    if (warp == 0) {
      v = lane < int(blockDim.x >> 5) ? s_red[lane] : (is_max ? -INFINITY : 0.f);
      for (int o = 16; o > 0; o >>= 1) {
        const float y = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, y) : v + y;
      }
      if (lane == 0) s_red[0] = v;
    }
    __syncthreads();
    const float r = s_red[0];
    __syncthreads();
    return r;
  };
  for (int g = 0; g < G; ++g) {
    const float* x = sc + (int64_t(b) * Hq + h * G + g) * ld;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < L; j += kOwThreads) m = fmaxf(m, x[j]);
    m = block_reduce(m, true);
    float sum = 0.f;
    for (int j = threadIdx.x; j < L; j += kOwThreads) sum += expf(x[j] - m);
    sum = block_reduce(sum, false);
    if (threadIdx.x == 0) s_max[g] = m, s_inv[g] = 1.f / sum;
  }
  __syncthreads();
  float* w = out + int64_t(row) * ld;
  for (int j = threadIdx.x; j < L; j += kOwThreads) {
    float acc = 0.f;
    for (int g = 0; g < G; ++g)
      acc += expf(sc[(int64_t(b) * Hq + h * G + g) * ld + j] - s_max[g]) * s_inv[g];
    w[j] = acc;
  }
}

}  // namespace

void oracle_group_weights(const float* scores, int64_t ld, const int32_t* kv_len, int B, int Hq,
                          int Hkv, float* out, cudaStream_t s) {
  SPADE_CHECK(Hq % Hkv == 0 && Hq / Hkv <= 16, "oracle_group_weights: G must be <= 16");
  launch_pdl(oracle_weights_kernel, B * Hkv, kOwThreads, 0, s, scores, ld, kv_len, Hq, Hkv, out);
  SPADE_CUDA(cudaGetLastError());
}

void quest_compact_lists(const int32_t* strided, const int32_t* kv_len, int B, int Hkv,
                         int k_pages, int32_t* sel_off, int32_t* sel_idx, cudaStream_t s) {
  launch_pdl(topk_compact_kernel, B * Hkv, 128, 0, s, strided, kv_len, Hkv, k_pages, 16, B * Hkv, sel_off,
                                              sel_idx);
  SPADE_CUDA(cudaGetLastError());
}

void token_compact_lists(const int32_t* strided, const int32_t* kv_len, int B, int Hkv, int k,
                         int32_t* sel_off, int32_t* sel_idx, cudaStream_t s) {
  launch_pdl(topk_compact_kernel, B * Hkv, 128, 0, s, strided, kv_len, Hkv, k, 1, B * Hkv, sel_off,
                                              sel_idx);
  SPADE_CUDA(cudaGetLastError());
}

void row_lengths(const int32_t* kv_len, int B, int Hkv, int32_t* out, cudaStream_t s,
                 uint32_t heads) {
  SPADE_CHECK(Hkv <= 32 || heads == ~0u, "row_lengths: a head mask needs Hkv <= 32");
  const int n = B * Hkv;
  launch_pdl(row_lengths_kernel, (n + 255) / 256, 256, 0, s, kv_len, n, Hkv, Hkv <= 32 ? heads : ~0u, out);
  SPADE_CUDA(cudaGetLastError());
}

void streaming_lists(const int32_t* kv_len, int B, int budget, int sinks, int32_t* sel_off,
                     int32_t* sel_idx, cudaStream_t s) {
  launch_pdl(streaming_lists_kernel, B, 256, 0, s, kv_len, B, budget, sinks, sel_off, sel_idx);
  SPADE_CUDA(cudaGetLastError());
}

}  // namespace spade::cuda
