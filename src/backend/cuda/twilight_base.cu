// Twilight's base lists (twilight_base.h).
//
// twl_full_lists_kernel
//   reads  kv_len [B] (int32; each CTA sums the lengths before its request: B is small)
//   writes list b * Hkv + h: ceil(kv_len[b] / 16) int32 chunk indices 0, 1, ... and its CSR
//          offset (the last CTA also the end offset): 4 B per 16 tokens per KV head
//   CTA = one (request, KV head) list, 256 threads striding its entries.
// twl_expand_lists_kernel
//   reads  src_off [B + 1] and request b's shared list (4 B per entry, once per KV head)
//   writes its Hkv copies: list b * Hkv + h at Hkv * src_off[b] + h * n_b, and the offsets
//   CTA = one (request, KV head) list, 256 threads striding its entries.
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/twilight_base.h"

namespace spade::cuda {
namespace {

__global__ void twl_full_lists_kernel(const int32_t* kv_len, int Hkv, int n_lists, int32_t* off,
                                      int32_t* idx) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int list = blockIdx.x, b = list / Hkv, h = list % Hkv;
  int start = 0;
  for (int bb = 0; bb < b; ++bb) start += Hkv * ((kv_len[bb] + 15) / 16);
  const int n = (kv_len[b] + 15) / 16;
  start += h * n;
  for (int j = threadIdx.x; j < n; j += blockDim.x) idx[start + j] = j;
  if (threadIdx.x == 0) {
    off[list] = start;
    if (list == n_lists - 1) off[list + 1] = start + n;
  }
}

__global__ void twl_expand_lists_kernel(const int32_t* src_off, const int32_t* src_idx, int Hkv,
                                        int n_lists, int32_t* off, int32_t* idx) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int list = blockIdx.x, b = list / Hkv, h = list % Hkv;
  const int s0 = src_off[b], n = src_off[b + 1] - s0;
  const int start = Hkv * s0 + h * n;
  for (int j = threadIdx.x; j < n; j += blockDim.x) idx[start + j] = src_idx[s0 + j];
  if (threadIdx.x == 0) {
    off[list] = start;
    if (list == n_lists - 1) off[list + 1] = start + n;
  }
}

}  // namespace

void twilight_full_lists(const int32_t* kv_len, int B, int Hkv, int32_t* off, int32_t* idx,
                         cudaStream_t s) {
  if (B <= 0) return;
  const int n_lists = B * Hkv;
  launch_pdl(twl_full_lists_kernel, n_lists, 256, 0, s, kv_len, Hkv, n_lists, off, idx);
  SPADE_CUDA(cudaGetLastError());
}

void twilight_expand_lists(const int32_t* src_off, const int32_t* src_idx, int B, int Hkv,
                           int32_t* off, int32_t* idx, cudaStream_t s) {
  if (B <= 0) return;
  const int n_lists = B * Hkv;
  launch_pdl(twl_expand_lists_kernel, n_lists, 256, 0, s, src_off, src_idx, Hkv, n_lists, off,
             idx);
  SPADE_CUDA(cudaGetLastError());
}

}  // namespace spade::cuda
