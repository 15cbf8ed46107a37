// Row / element ops. All are memory-bound and tiny next to the GEMMs and attention:
//   embedding   reads T*H bf16, writes T*H fp32
//   rmsnorm     reads R*H fp32 (+H weights), writes R*H bf16; one block per row (the sum of
//               squares in norm_sum.cuh's order, which the decode GEMVs reproduce)
//   qkv_post    reads T*(Hq+2Hkv)*D fp32, writes the same count of bf16 (q out, k/v into
//               the paged cache [page][Hkv][P][D]); one warp per (token, head); with
//               k_int4 set, the K warps also write the row's INT4 copy (D/2 + 4 bytes,
//               Twilight; int4_keys.cuh); with quest_meta set, they read and write the
//               page-head's min / max rows (4*D bytes each way, Quest decode steps)
//   swiglu      reads T*2F fp32, writes T*F bf16
// For one decode token of Llama-3-8B these move < 0.5 MB per layer, against 436 MB of
// weights per step: launch count, not bytes, is what matters (CUDA graphs fix that).
#include "backend/cuda/ops.h"

#include <algorithm>

#include "backend/cuda/int4_keys.cuh"
#include "backend/cuda/norm_sum.cuh"
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
  const uint4* src = reinterpret_cast<const uint4*>(tr);
  float4* dst = reinterpret_cast<float4*>(xr);
  const int n8 = H / 8, nt = blockDim.x;
  for (int c0 = threadIdx.x; c0 < n8; c0 += 4 * nt) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (c0 + u * nt < n8) v[u] = src[c0 + u * nt];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (c0 + u * nt >= n8) continue;
      const uint32_t w[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
      float f[8];
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // a bf16 is the top half of its fp32
        f[2 * k] = __uint_as_float(w[k] << 16);
        f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
      }
      dst[2 * (c0 + u * nt)] = make_float4(f[0], f[1], f[2], f[3]);
      dst[2 * (c0 + u * nt) + 1] = make_float4(f[4], f[5], f[6], f[7]);
    }
  }
}

// One row per block. The sum of squares in norm_sum.cuh's order (the decode GEMVs that take
// the norm in reproduce it bit for bit): thread i sums group i (8 consecutive elements) into
// shared memory, then norm_finish. Rows of at most 8 x blockDim elements are held in registers
// (each thread its group: the norm weights, constant during a step, are requested before the
// PDL wait, so a decode step's norm, launched while the GEMV before it runs, starts with them in
// flight; x is read once); longer rows loop over groups and read x twice, same expressions.
// 16-byte loads and stores where H % 8 == 0 and the rows are 16-byte aligned.
__device__ __forceinline__ void load_group(const float* p, int g, int H, bool vec,
                                           float (&v)[kNormGroup]) {
  if (vec) {
    const float4 a = reinterpret_cast<const float4*>(p)[2 * g];
    const float4 b = reinterpret_cast<const float4*>(p)[2 * g + 1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    return;
  }
#pragma unroll
  for (int i = 0; i < kNormGroup; ++i) v[i] = kNormGroup * g + i < H ? p[kNormGroup * g + i] : 0.f;
}
__device__ __forceinline__ void store_group(bf16* p, int g, int H, bool vec, const float (&x)[kNormGroup],
                                            float scale, const float (&w)[kNormGroup]) {
  if (vec) {
    uint32_t u[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const __nv_bfloat162 b =
          __floats2bfloat162_rn(x[2 * k] * scale * w[2 * k], x[2 * k + 1] * scale * w[2 * k + 1]);
      u[k] = *reinterpret_cast<const uint32_t*>(&b);
    }
    reinterpret_cast<uint4*>(p)[g] = make_uint4(u[0], u[1], u[2], u[3]);
    return;
  }
#pragma unroll
  for (int i = 0; i < kNormGroup; ++i)
    if (kNormGroup * g + i < H) p[kNormGroup * g + i] = __float2bfloat16(x[i] * scale * w[i]);
}

__global__ void rmsnorm_kernel(const float* x, const int32_t* rows, const float* w, float eps,
                               bf16* y, int H) {
  extern __shared__ float group_ss[];  // [G]
  __shared__ float red[9];
  const int tid = threadIdx.x, nt = blockDim.x;
  const int G = (H + kNormGroup - 1) / kNormGroup;
  const bool cached = G <= nt;
  const auto al16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = H % kNormGroup == 0 && al16(x) && al16(w) && al16(y);
  float wv[kNormGroup], xv[kNormGroup];
  if (cached && tid < G) load_group(w, tid, H, vec, wv);
  pdl_begin();  // pdl.cuh: before any access to what other kernels write (w is constant)
  const int r = blockIdx.x;
  const int src = rows ? rows[r] : r;
  const float* xr = x + int64_t(src) * H;
  auto group_n = [&](int g) { return min(kNormGroup, H - kNormGroup * g); };
  if (cached) {
    if (tid < G) {
      load_group(xr, tid, H, vec, xv);
      group_ss[tid] = norm_group_ss(xv, group_n(tid));
    }
  } else {
    for (int g = tid; g < G; g += nt) {
      float v[kNormGroup];
      load_group(xr, g, H, vec, v);
      group_ss[g] = norm_group_ss(v, group_n(g));
    }
  }
  __syncthreads();
  const float ss = norm_finish([&](int g) { return group_ss[g]; }, G, red);
  const float scale = rsqrtf(ss / float(H) + eps);
  bf16* yr = y + int64_t(r) * H;
  if (cached) {
    if (tid < G) store_group(yr, tid, H, vec, xv, scale, wv);
  } else {
    for (int g = tid; g < G; g += nt) {
      float v[kNormGroup], u[kNormGroup];
      load_group(xr, g, H, vec, v);
      load_group(w, g, H, vec, u);
      store_group(yr, g, H, vec, v, scale, u);
    }
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
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int i = lane + 32 * j;
    if (i < half) qkv_post_pair(a, t, head, i, dst, lo[j], hi[j]);
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
  // One thread per group of 8, at least the 256 threads norm_finish needs, at most 1024.
  const int G = (H + kNormGroup - 1) / kNormGroup;
  const int threads = std::max(kNormTreeThreads, std::min(1024, (G + 31) / 32 * 32));
  SPADE_CHECK(size_t(G) * sizeof(float) <= 48 * 1024, "rmsnorm: hidden size ", H, " too large");
  launch_pdl(rmsnorm_kernel, R, threads, size_t(G) * sizeof(float), s, x, rows, w, eps, y, H);
  SPADE_CUDA_LAUNCH();
}

void qkv_post(const QkvPostArgs& a, cudaStream_t s) {
  SPADE_CHECK(a.D % 2 == 0 && a.D <= 256, "qkv_post: head_dim ", a.D, " unsupported");
  SPADE_CHECK(!a.k_int4 == !a.k_int4_sz && (!a.k_int4 || a.D % 4 == 0),
              "qkv_post: INT4 keys need both outputs and D % 4 == 0");
  if (a.T == 0) return;
  const int nh = a.Hq + 2 * a.Hkv, warps = 4;
  dim3 grid((nh + warps - 1) / warps, a.T);
  launch_pdl(qkv_post_kernel, grid, 32 * warps, 0, s, a);
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
