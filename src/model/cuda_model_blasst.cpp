// CudaModel's BLASST plumbing: the skip parameters of each attention launch (fixed lambda
// or a / L, decode vs prefill), the per-layer tile counters, and lambda changes between runs
// (calibration). The kernels: backend/cuda/attention_decode.cu, attention_prefill.cu.
#if defined(SPADE_HAVE_CUDA)
#include <cmath>

#include "backend/cuda/attention.h"
#include "backend/cuda/sparse_attention.h"
#include "core/error.h"
#include "model/cuda_model.h"

namespace spade {
namespace {
cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }
}  // namespace

cuda::BlasstSkip CudaModel::blasst_skip(int layer) const {
  const CudaSparse& sp = opt_.sparse;
  cuda::BlasstSkip k;
  const bool dec = attn_->decode();
  if (!sp.blasst_any() || !(dec ? sp.blasst_decode : blasst_prefill_active())) return k;
  if (sp.blasst_lambda >= 0) {
    if (sp.blasst_lambda > 0) k.log_lambda = float(std::log(sp.blasst_lambda));
  } else {
    const double a = dec ? sp.blasst_a : sp.blasst_prefill_a;
    if (a > 0) k.log_lambda = float(std::log(a)), k.per_length = true;
  }
  const int Hkv = cfg_.n_kv_heads;
  if (count_blasst_)
    k.counts = blasst_counts_ + (size_t(dec ? 0 : 1) * cfg_.n_layers + size_t(layer)) * Hkv * 2;
  return k;
}

cuda::SelSkip CudaModel::sel_skip(int layer) const {
  const CudaSparse& sp = opt_.sparse;
  cuda::SelSkip k;
  if (!sp.blasst_sel || !sp.blasst_decode) return k;
  const cuda::BlasstSkip b = blasst_skip(layer);
  k.log_lambda = b.log_lambda;
  k.per_length = b.per_length;
  k.length_selected = sp.blasst_len_selected;
  k.counts = b.counts;
  return k;
}

bool CudaModel::blasst_prefill_active() const {
  return opt_.sparse.blasst_any() && opt_.sparse.blasst_prefill;
}

std::vector<uint64_t> CudaModel::blasst_counts(bool prefill) const {
  const size_t n = size_t(cfg_.n_layers) * cfg_.n_kv_heads * 2;
  std::vector<uint64_t> h(n, 0);
  if (!blasst_counts_) return h;
  SPADE_CUDA(cudaStreamSynchronize(S_(stream_)));
  SPADE_CUDA(cudaMemcpy(h.data(), blasst_counts_ + (prefill ? n : 0), n * 8, cudaMemcpyDeviceToHost));
  return h;
}

void CudaModel::set_blasst(const CudaSparse& s) {
  SPADE_CHECK(opt_.sparse.method == CudaSparse::Method::Blasst && s.method == CudaSparse::Method::Blasst,
              "set_blasst: the model was not built with BLASST");
  SPADE_CUDA(cudaStreamSynchronize(S_(stream_)));
  opt_.sparse = s;
  drop_graphs();
}

void CudaModel::reset_blasst_counts() {
  if (!blasst_counts_) return;
  SPADE_CUDA(cudaStreamSynchronize(S_(stream_)));
  SPADE_CUDA(cudaMemset(blasst_counts_, 0, size_t(4) * cfg_.n_layers * cfg_.n_kv_heads * 8));
}

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
