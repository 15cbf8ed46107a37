// GpuMethod's BLASST plumbing: the skip parameters of each attention launch (fixed lambda
// or a / L, decode vs prefill), the per-layer tile counters, and lambda changes between runs
// (calibration). The kernels: backend/cuda/attention_decode.cu, attention_prefill.cu.
#if defined(SPADE_HAVE_CUDA)
#include <cmath>

#include "backend/cuda/attention.h"
#include "backend/cuda/sparse_attention.h"
#include "core/error.h"
#include "sparse/gpu/gpu_method.h"

namespace spade {
namespace {
cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }
}  // namespace

cuda::BlasstSkip GpuMethod::blasst_skip(int layer) const {
  const CudaSparse& sp = sp_;
  cuda::BlasstSkip k;
  const bool dec = attn_->decode();
  if (!sp.blasst_any() || !(dec ? sp.blasst_decode : blasst_prefill_active())) return k;
  if (sp.blasst_lambda >= 0) {
    if (sp.blasst_lambda > 0) k.log_lambda = float(std::log(sp.blasst_lambda));
  } else {
    const double a = dec ? sp.blasst_a : sp.blasst_prefill_a;
    if (a > 0) k.log_lambda = float(std::log(a)), k.per_length = true;
  }
  const int Hkv = ctx_.cfg.n_kv_heads;
  if (count_blasst)
    k.counts = blasst_counts_ + (size_t(dec ? 0 : 1) * ctx_.cfg.n_layers + size_t(layer)) * Hkv * 2;
  return k;
}

cuda::SelSkip GpuMethod::sel_skip(int layer) const {
  const CudaSparse& sp = sp_;
  cuda::SelSkip k;
  if (!sp.blasst_sel || !sp.blasst_decode) return k;
  const cuda::BlasstSkip b = blasst_skip(layer);
  k.log_lambda = b.log_lambda;
  k.per_length = b.per_length;
  k.length_selected = sp.blasst_len_selected;
  k.counts = b.counts;
  return k;
}

bool GpuMethod::blasst_prefill_active() const {
  return sp_.blasst_any() && sp_.blasst_prefill;
}

std::vector<uint64_t> GpuMethod::blasst_counts(bool prefill) const {
  const size_t n = size_t(ctx_.cfg.n_layers) * ctx_.cfg.n_kv_heads * 2;
  std::vector<uint64_t> h(n, 0);
  if (!blasst_counts_) return h;
  SPADE_CUDA(cudaStreamSynchronize(S_(ctx_.stream)));
  SPADE_CUDA(cudaMemcpy(h.data(), blasst_counts_ + (prefill ? n : 0), n * 8, cudaMemcpyDeviceToHost));
  return h;
}

void GpuMethod::set_blasst(const CudaSparse& s) {
  SPADE_CHECK(sp_.method == CudaSparse::Method::Blasst && s.method == CudaSparse::Method::Blasst,
              "set_blasst: the model was not built with BLASST");
  SPADE_CUDA(cudaStreamSynchronize(S_(ctx_.stream)));
  sp_ = s;
}

void GpuMethod::reset_blasst_counts() {
  if (!blasst_counts_) return;
  SPADE_CUDA(cudaStreamSynchronize(S_(ctx_.stream)));
  SPADE_CUDA(cudaMemset(blasst_counts_, 0, size_t(4) * ctx_.cfg.n_layers * ctx_.cfg.n_kv_heads * 8));
}

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
