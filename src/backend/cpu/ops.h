// CPU reference ops: fp32 in, fp32 accumulate, threaded over rows. These are the oracle
// the CUDA kernels are tested against, and are themselves tested against naive loops
// (tests/test_cpu_ops.cpp). Row-major everywhere; Linear weights are [out, in].
#pragma once
#include <cstdint>

#include "model/config.h"

namespace spade::cpu {

// y[M,N] = x[M,K] * W[N,K]^T (+ bias[N]). Uses BLAS sgemm for M > 1, a threaded GEMV else.
void matmul(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N,
            int64_t K);

// y[r,:] = x[r,:] / rms(x[r,:]) * w   (rms over n, eps inside the sqrt). y may alias x.
void rmsnorm(const float* x, const float* w, float eps, float* y, int64_t rows, int64_t n);

// Per-row inverse frequencies of RoPE for head_dim D (D/2 values), with llama3 / linear
// scaling applied as Hugging Face does.
void rope_inv_freq(const ModelConfig& cfg, float* inv_freq /*[D/2]*/);

// Rotate-halves RoPE in place on x[T, H, D] at positions pos[T].
void rope(float* x, const int32_t* pos, const float* inv_freq, int64_t T, int64_t H, int64_t D);

// out[i] = silu(gate[i]) * up[i]
void swiglu(const float* gate, const float* up, float* out, int64_t n);

// x[i] += y[i]
void add_inplace(float* x, const float* y, int64_t n);

// out[t,:] = table[ids[t],:]
void embedding(const float* table, const int32_t* ids, float* out, int64_t T, int64_t hidden,
               int64_t vocab);

}  // namespace spade::cpu
