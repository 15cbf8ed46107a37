// Row / element ops. All are memory-bound and tiny next to the GEMMs and attention:
//   embedding   reads T*H bf16, writes T*H fp32
//   rmsnorm     reads R*H fp32 (+H weights), writes R*H bf16; one block per row
//   qkv_post    reads T*(Hq+2Hkv)*D fp32, writes the same count of bf16 (q out, k/v into
//               the paged cache [page][Hkv][P][D]); one warp per (token, head); with
//               k_int4 set, the K warps also write the row's INT4 copy (D/2 + 4 bytes,
//               Twilight; int4_keys.cuh); with quest_meta set, they read and write the
//               page-head's min / max rows (4*D bytes each way, Quest decode steps)
//   swiglu      reads T*2F fp32, writes T*F bf16
// For one decode token of Llama-3-8B these move < 0.5 MB per layer, against 436 MB of
// weights per step: launch count, not bytes, is what matters (CUDA graphs fix that).
#include "backend/cuda/ops.h"

#include "backend/cuda/int4_keys.cuh"
#include "backend/cuda/load_stream.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/qkv_post_pair.cuh"

namespace spade::cuda {
namespace {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__global__ void embedding_kernel(const bf16* table, const int32_t* ids, float* x, int H,
                                 int vocab) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int t = blockIdx.x;
  const int id = ids[t];
  float* xr = x + int64_t(t) * H;
  if (id < 0 || id >= vocab) {
    for (int i = threadIdx.x; i < H; i += blockDim.x) xr[i] = __int_as_float(0x7fc00000);
    return;
  }
  const bf16* tr = table + int64_t(id) * H;
  const bool vec = H % 8 == 0 && reinterpret_cast<uintptr_t>(table) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(x) % 16 == 0;
  if (!vec) {
    for (int i = threadIdx.x; i < H; i += blockDim.x) xr[i] = __bfloat162float(tr[i]);
    return;
  }
  // 16-byte loads, 4 per thread in flight before any store (a scalar loop waited for each
  // load: ~9 us per step at H = 4096 on an H200, as the step's first launch nothing hides it).
  float4* dst = reinterpret_cast<float4*>(xr);
  for_each_strided<4>(reinterpret_cast<const uint4*>(tr), H / 8, threadIdx.x, blockDim.x,
                      [&](const uint4& v, int c) {
                        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
                        float f[8];
#pragma unroll
                        for (int k = 0; k < 4; ++k) {  // a bf16 is the top half of its fp32
                          f[2 * k] = __uint_as_float(w[k] << 16);
                          f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
                        }
                        dst[2 * c] = make_float4(f[0], f[1], f[2], f[3]);
                        dst[2 * c + 1] = make_float4(f[4], f[5], f[6], f[7]);
                      });
}

// Each thread holds up to kNormPer elements (i = tid + j * blockDim) in registers: the norm
// weights (constant during a step) are requested before the PDL wait, so a decode step's norm,
// launched while the GEMV before it runs, starts with them in flight; x is read once. Rows past
// kNormPer * blockDim (H > 8192) take the loop. Both paths sum x^2 in the same order (i
// ascending per thread) and compute the same expressions.
constexpr int kNormPer = 8;
__global__ void rmsnorm_kernel(const float* x, const int32_t* rows, const float* w, float eps,
                               bf16* y, int H) {
  const int tid = threadIdx.x, nt = blockDim.x;
  const bool cached = H <= kNormPer * nt;
  float wv[kNormPer];
  if (cached) {
#pragma unroll
    for (int j = 0; j < kNormPer; ++j) wv[j] = tid + j * nt < H ? w[tid + j * nt] : 0.f;
  }
  pdl_begin();  // pdl.cuh: before any access to what other kernels write (w is constant)
  const int r = blockIdx.x;
  const int src = rows ? rows[r] : r;
  const float* xr = x + int64_t(src) * H;
  float xv[kNormPer];
  float ss = 0.f;
  if (cached) {
#pragma unroll
    for (int j = 0; j < kNormPer; ++j) xv[j] = tid + j * nt < H ? xr[tid + j * nt] : 0.f;
#pragma unroll
    for (int j = 0; j < kNormPer; ++j)
      if (tid + j * nt < H) ss = fmaf(xv[j], xv[j], ss);
  } else {
    for (int i = tid; i < H; i += nt) ss = fmaf(xr[i], xr[i], ss);
  }
  __shared__ float part[32];
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.f;
    v = warp_sum(v);
    if (threadIdx.x == 0) part[0] = v;
  }
  __syncthreads();
  const float scale = rsqrtf(part[0] / float(H) + eps);
  bf16* yr = y + int64_t(r) * H;
  if (cached) {
#pragma unroll
    for (int j = 0; j < kNormPer; ++j)
      if (tid + j * nt < H) yr[tid + j * nt] = __float2bfloat16(xv[j] * scale * wv[j]);
  } else {
    for (int i = tid; i < H; i += nt) yr[i] = __float2bfloat16(xr[i] * scale * w[i]);
  }
}

// One warp per (token, head); heads ordered q (Hq), k (Hkv), v (Hkv).
__global__ void qkv_post_kernel(QkvPostArgs a) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nh = a.Hq + 2 * a.Hkv;
  const int head = blockIdx.x * (blockDim.x >> 5) + warp;
  const int t = blockIdx.y;
  if (head >= nh) return;
  const int D = a.D, half = D / 2;
  const float* src = a.qkv + (int64_t(t) * nh + head) * D;
  const float* bias = a.bias ? a.bias + int64_t(head) * D : nullptr;
  const bool is_q = head < a.Hq, is_k = !is_q && head < a.Hq + a.Hkv;
  bf16* dst = qkv_post_dst(a, t, head);
  // Each lane holds pairs (i, i + D/2) for i = lane, lane + 32, ... (D <= 256).
  float lo[4], hi[4];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int i = lane + 32 * j;
    lo[j] = hi[j] = 0.f;
    if (i < half) {
      lo[j] = src[i] + (bias ? bias[i] : 0.f);
      hi[j] = src[i + half] + (bias ? bias[i + half] : 0.f);
      ss += lo[j] * lo[j] + hi[j] * hi[j];
    }
  }
  const float* nw = is_q ? a.q_norm : (is_k ? a.k_norm : nullptr);
  if (nw) {
    const float scale = rsqrtf(warp_sum(ss) / float(D) + a.eps);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = lane + 32 * j;
      if (i < half) {
        lo[j] = lo[j] * scale * nw[i];
        hi[j] = hi[j] * scale * nw[i + half];
      }
    }
  }
  if (a.rotate_qk && head < a.Hq + a.Hkv) {  // warp-uniform: fp8 keys rotated, q alike
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = lane + 32 * j;
      if (i < half) qkv_post_rope(a, t, head, i, lo[j], hi[j]);
    }
    rotate_key_warp(lo, hi, D, lane);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = lane + 32 * j;
      if (i < half) qkv_post_store(a, t, head, i, dst, lo[j], hi[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = lane + 32 * j;
      if (i < half) qkv_post_pair(a, t, head, i, dst, lo[j], hi[j]);
    }
  }
  if (!is_q && a.kv_amax) {  // warp-uniform: fp8 calibration pass, the head's largest |value|
    float mx = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = lane + 32 * j;
      if (i < half) {
        const float u = fabsf(lo[j]), v = fabsf(hi[j]);
        if (u <= 3.4028234663852886e38f) mx = fmaxf(mx, u);  // finite only (NaN, inf left out)
        if (v <= 3.4028234663852886e38f) mx = fmaxf(mx, v);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) atomicMax(a.kv_amax + (head - a.Hq), __float_as_uint(mx));
    return;
  }
  if (is_k && a.k_int4) {  // warp-uniform
    const int64_t row = (int64_t(a.page[t]) * a.Hkv + (head - a.Hq)) * a.P + a.pos[t] % a.P;
    int4_quantize_row_warp(lo, hi, half, a.k_int4 + row * half, a.k_int4_sz + row);
  }
  if (is_k && a.quest_meta) {  // warp-uniform: the page's min / max rows with this key
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = lane + 32 * j;
      if (i < half) qkv_post_meta_pair(a, t, head, i, lo[j], hi[j]);
    }
  }
}

__global__ void swiglu_kernel(const float* gu, bf16* out, int F, int64_t n) {
  pdl_begin();  // pdl.cuh: first, before any global access
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = idx / F, i = idx % F;
    const float g = gu[t * 2 * F + i], u = gu[t * 2 * F + F + i];
    out[idx] = __float2bfloat16(g / (1.f + __expf(-g)) * u);
  }
}

__global__ void f32_to_bf16_kernel(const float* x, bf16* y, int64_t n) {
  pdl_begin();  // pdl.cuh: first, before any global access
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __float2bfloat16(x[i]);
}
__global__ void bf16_to_f32_kernel(const bf16* x, float* y, int64_t n) {
  pdl_begin();  // pdl.cuh: first, before any global access
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __bfloat162float(x[i]);
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// Approximately normal: sum of 4 uniforms, centered and scaled to unit variance.
__device__ __forceinline__ float hash_normal(uint64_t seed, int64_t i) {
  uint64_t h = mix64(seed * 0x632be59bd9b4e019ull + uint64_t(i));
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) s += float((h >> (16 * k)) & 0xffff) * (1.f / 65536.f);
  return (s - 2.f) * 1.7320508f;
}
template <typename T>
__global__ void fill_random_kernel(T* y, int64_t n, uint64_t seed, float scale, float mean) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float v = hash_normal(seed, i) * scale + mean;
    if constexpr (sizeof(T) == 2) y[i] = __float2bfloat16(v); else y[i] = v;
  }
}

__global__ void fill_random_fp8_kernel(uint8_t* y, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] = fp8_e4m3_from_f32(hash_normal(seed, i));
}

__global__ void fp8_scales_kernel(const unsigned int* amax, float* scales, int n) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) scales[i] = fp8_e4m3_scale_for_amax(__uint_as_float(amax[i]));
}

int grid_for(int64_t n, int threads) {
  int64_t b = (n + threads - 1) / threads;
  return int(b < 65536 ? (b > 0 ? b : 1) : 65536);
}

}  // namespace

void embedding(const bf16* table, const int32_t* ids, float* x, int T, int H, int vocab,
               cudaStream_t s) {
  if (T == 0) return;
  launch_pdl(embedding_kernel, T, 256, 0, s, table, ids, x, H, vocab);
  SPADE_CUDA_LAUNCH();
}

void rmsnorm(const float* x, const int32_t* rows, const float* w, float eps, bf16* y, int R,
             int H, cudaStream_t s) {
  if (R == 0) return;
  int threads = H >= 1024 ? 1024 : ((H + 31) / 32) * 32;
  launch_pdl(rmsnorm_kernel, R, threads, 0, s, x, rows, w, eps, y, H);
  SPADE_CUDA_LAUNCH();
}

void qkv_post(const QkvPostArgs& a, cudaStream_t s) {
  SPADE_CHECK(a.D % 2 == 0 && a.D <= 256, "qkv_post: head_dim ", a.D, " unsupported");
  SPADE_CHECK(!a.k_int4 == !a.k_int4_sz && (!a.k_int4 || a.D % 4 == 0),
              "qkv_post: INT4 keys need both outputs and D % 4 == 0");
  SPADE_CHECK(!(a.kv_scale || a.kv_amax) || (!a.k_int4 && !a.quest_meta),
              "qkv_post: an fp8 cache keeps neither INT4 keys nor Quest metadata");
  SPADE_CHECK(!a.rotate_qk || (kv_rotates_keys(KvDtype::FP8, a.D) && (a.kv_scale || a.kv_amax)),
              "qkv_post: the key rotation is for fp8 caches of head_dim 64, 128 or 256 (got ", a.D, ")");
  if (a.T == 0) return;
  const int nh = a.Hq + 2 * a.Hkv, warps = 4;
  dim3 grid((nh + warps - 1) / warps, a.T);
  launch_pdl(qkv_post_kernel, grid, 32 * warps, 0, s, a);
  SPADE_CUDA_LAUNCH();
}

void fp8_scales_from_amax(const unsigned int* amax, float* scales, int n, cudaStream_t s) {
  if (n == 0) return;
  launch_pdl(fp8_scales_kernel, (n + 127) / 128, 128, 0, s, amax, scales, n);
  SPADE_CUDA_LAUNCH();
}

void fill_random_fp8(uint8_t* y, int64_t n, uint64_t seed, cudaStream_t s) {
  if (n == 0) return;
  fill_random_fp8_kernel<<<grid_for(n, 256), 256, 0, s>>>(y, n, seed);
  SPADE_CUDA_LAUNCH();
}

void swiglu(const float* gu, bf16* out, int T, int F, cudaStream_t s) {
  const int64_t n = int64_t(T) * F;
  if (n == 0) return;
  launch_pdl(swiglu_kernel, grid_for(n, 256), 256, 0, s, gu, out, F, n);
  SPADE_CUDA_LAUNCH();
}

void f32_to_bf16(const float* x, bf16* y, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  launch_pdl(f32_to_bf16_kernel, grid_for(n, 256), 256, 0, s, x, y, n);
  SPADE_CUDA_LAUNCH();
}
void bf16_to_f32(const bf16* x, float* y, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  launch_pdl(bf16_to_f32_kernel, grid_for(n, 256), 256, 0, s, x, y, n);
  SPADE_CUDA_LAUNCH();
}
void fill_random_bf16(bf16* y, int64_t n, uint64_t seed, float scale, float mean,
                      cudaStream_t s) {
  if (n == 0) return;
  fill_random_kernel<<<grid_for(n, 256), 256, 0, s>>>(y, n, seed, scale, mean);
  SPADE_CUDA_LAUNCH();
}
void fill_random_f32(float* y, int64_t n, uint64_t seed, float scale, float mean,
                     cudaStream_t s) {
  if (n == 0) return;
  fill_random_kernel<<<grid_for(n, 256), 256, 0, s>>>(y, n, seed, scale, mean);
  SPADE_CUDA_LAUNCH();
}

}  // namespace spade::cuda
