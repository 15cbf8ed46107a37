// AttentionWorkspace::run_fp8 (attention.h): attention over an FP8 (E4M3) KV cache (issue 40).
//
// Decode steps with a v3 variant read the codes directly (attention_decode.cu, F8 instances:
// cp.async of the codes, widened to bf16 in shared memory, the scales folded into the softmax
// scale and the output). Every other step (prefill chunks and mixed steps through the prefill
// kernels, the v2 decode kernel) takes the simplest correct path: widen_pages_kernel writes the
// plan's pages of this layer as bf16 (code x scale: exact, since E4M3 has 4 significant bits
// and the scales are powers of two) into the caller's bf16 scratch cache at the same page ids,
// slots at or past each sequence's length zeroed, and the bf16 kernels run on that scratch
// unchanged. Cost: one read of the step's fp8 pages and one bf16 write per layer, on top of the
// prefill's own reads (prefill is compute-bound; a prefill kernel that widens on load is the
// next step).
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "backend/cuda/attention.h"
#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/pdl.cuh"

namespace spade::cuda {
namespace {

// Grid (x: blocks per (sequence, KV head), y: sequence, z: KV head). Each thread converts
// 16-byte pieces (16 codes) of the sequence's used pages of one KV head, K and V.
__global__ void widen_pages_kernel(const uint8_t* k8, const uint8_t* v8, const float* k_scale,
                                   const float* v_scale, bf16* kw, bf16* vw,
                                   const int32_t* page_table, const int32_t* page_off,
                                   const int32_t* kv_len, int Hkv, int P, int D) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int b = blockIdx.y, h = blockIdx.z;
  const int L = kv_len[b];
  const int* pt = page_table + page_off[b];
  const int n_pages = (L + P - 1) / P;
  const int pieces_row = D / 16;
  const int64_t pieces = int64_t(n_pages) * P * pieces_row;
  const float ks = k_scale[h], vs = v_scale[h];
  const int64_t head_stride = int64_t(P) * D, page_stride = int64_t(Hkv) * head_stride;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < pieces;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / pieces_row;  // token of the sequence
    const int c = int(i % pieces_row);
    const int pi = int(row / P), slot = int(row % P);
    const int64_t off = int64_t(pt[pi]) * page_stride + h * head_stride + int64_t(slot) * D + c * 16;
    const bool valid = row < L;
    for (int t = 0; t < 2; ++t) {
      const uint8_t* src = (t ? v8 : k8) + off;
      bf16* dst = (t ? vw : kw) + off;
      const float sc = t ? vs : ks;
      uint4 out[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
      if (valid) {
        const uint4 cv = *reinterpret_cast<const uint4*>(src);
        const uint32_t w[4] = {cv.x, cv.y, cv.z, cv.w};
        uint32_t o[8];
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const __half2_raw hr =
                __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w[k] >> (16 * hh)), __NV_E4M3);
            __half2 hv;
            hv = hr;
            const float2 f = __half22float2(hv);
            o[2 * k + hh] = attn_detail::pack_bf16(f.x * sc, f.y * sc);
          }
        out[0] = make_uint4(o[0], o[1], o[2], o[3]);
        out[1] = make_uint4(o[4], o[5], o[6], o[7]);
      }
      reinterpret_cast<uint4*>(dst)[0] = out[0];
      reinterpret_cast<uint4*>(dst)[1] = out[1];
    }
  }
}

}  // namespace

void AttentionWorkspace::run_fp8(const bf16* q, const KvFp8& kv, bf16* out, float scale,
                                 cudaStream_t s) const {
  SPADE_CHECK(kv.k && kv.v && kv.k_scale && kv.v_scale, "attention: fp8 cache without its codes or scales");
  if (fp8_direct()) {
    run_impl(q, reinterpret_cast<const bf16*>(kv.k), reinterpret_cast<const bf16*>(kv.v), out,
             scale, s, {}, nullptr, kv.k_scale, kv.v_scale);
    return;
  }
  SPADE_CHECK(kv.k_wide && kv.v_wide,
              "attention: this fp8 step (prefill, or the v2 decode kernel) needs a bf16 scratch cache");
  const int blocks_x = 16;  // per (sequence, KV head); grid-stride over its pieces
  launch_pdl(widen_pages_kernel, dim3(blocks_x, unsigned(B_), unsigned(Hkv_)), 256, 0, s, kv.k,
             kv.v, kv.k_scale, kv.v_scale, kv.k_wide, kv.v_wide,
             static_cast<const int32_t*>(meta_dev_ + off_page_table_),
             static_cast<const int32_t*>(meta_dev_ + off_page_off_),
             static_cast<const int32_t*>(meta_dev_ + off_kv_len_), Hkv_, P_, D_);
  SPADE_CUDA_LAUNCH();
  run_impl(q, kv.k_wide, kv.v_wide, out, scale, s, {}, nullptr, nullptr, nullptr);
}

}  // namespace spade::cuda
