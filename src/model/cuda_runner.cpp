// engine/runner.h's runner on the GPU: CudaModel behind CudaStepModel.
#if defined(SPADE_HAVE_CUDA)
#include <algorithm>

#include "engine/runner.h"
#include "model/cuda_model.h"
#include "model/cuda_step_model.h"
#include "sparse/gpu/method.h"

namespace spade {

Runner make_cuda_runner(const ModelWeights& w, const RunnerOptions& opt) {
  const ModelConfig& c = w.config;
  SPADE_CHECK(!opt.sparse.measure_recall, "--recall is CPU-only (--device cpu)");
  CudaModelOptions copt;
  copt.kv_pages = opt.kv_pages;
  copt.page_size = opt.page_size;
  copt.max_batch = opt.max_batch;
  copt.max_step_tokens = std::max<int64_t>(opt.max_step_tokens, opt.max_batch);
  copt.max_logit_rows = opt.max_logit_rows > 0 ? opt.max_logit_rows
                                               : std::max<int64_t>(opt.max_batch, 64);
  copt.deterministic = opt.deterministic;
  // KV cache: fp8 (E4M3, --kv-scale auto|X) or bf16; the other types (f32: eval's CPU reference
  // default, f16) keep the GPU's bf16 cache as before.
  const bool fp8 = opt.kv_dtype == KvDtype::FP8;
  copt.kv_dtype = fp8 ? KvDtype::FP8 : KvDtype::BF16;
  copt.kv_scale = fp8 ? opt.kv_scale : 0.f;
  copt.sparse = cuda_sparse_config(opt.sparse, c, opt.page_size);
  check_gpu_kv_dtype(fp8, copt.sparse);  // a method that does not read fp8 yet: named
  // Requests may name any GPU method: keep every method's per-page data (Quest's page
  // min/max, the INT4 keys Twilight reads) on every append.
  copt.any_method = opt.per_request_methods;
  auto model = std::make_shared<CudaModel>(w, copt);
  Runner r;
  r.model = std::make_unique<CudaStepModel>(*model);
  r.kv_mib = double(opt.kv_pages) * opt.page_size * c.n_layers * c.n_kv_heads * c.head_dim * 2 *
             (fp8 ? 1 : 2) / (1024.0 * 1024.0);
  r.max_logit_rows = copt.max_logit_rows;
  r.max_step_tokens = copt.max_step_tokens;
  if (opt.per_request_methods)
    r.check_method = [c, P = opt.page_size, fp8](const sparse::SparseConfig& s) {
      check_gpu_kv_dtype(fp8, cuda_sparse_config(s, c, P));
    };
  r.owned = std::move(model);
  return r;
}

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
