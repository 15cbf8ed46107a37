#include "engine/runner.h"

#include <algorithm>

#include "core/error.h"
#include "dist/tp_runner.h"
#include "model/cpu_model.h"

namespace spade {

namespace {
struct CpuParts {
  std::unique_ptr<KVPool> kv;
  std::unique_ptr<CpuModel> model;
};
}  // namespace

int64_t default_kv_pages(int64_t context, int max_batch, int page_size) {
  const int64_t want = std::max<int64_t>(context, int64_t(max_batch) * std::min<int64_t>(context, 1024));
  return (want + page_size - 1) / page_size;
}

Runner make_runner(const ModelWeights& w, const RunnerOptions& opt) {
  SPADE_CHECK(opt.kv_pages >= 1, "runner: the KV cache needs at least one page");
  SPADE_CHECK(opt.page_size >= 1, "runner: page size must be positive");
  SPADE_CHECK(opt.tp >= 1, "--tp must be >= 1, got ", opt.tp);
  if (opt.tp > 1) return dist::make_tp_runner(w, opt);
  if (opt.device == "cuda") {
#if defined(SPADE_HAVE_CUDA)
    return make_cuda_runner(w, opt);
#else
    fail("--device cuda: this build has no CUDA backend");
#endif
  }
  SPADE_CHECK(opt.device == "cpu", "--device must be cpu or cuda, got '", opt.device, "'");
  const ModelConfig& c = w.config;
  auto parts = std::make_shared<CpuParts>();
  KVLayout lay{c.n_layers, c.n_kv_heads, c.head_dim, opt.page_size};
  lay.dtype = opt.kv_dtype;
  lay.kv_scale = opt.kv_scale;
  parts->kv = std::make_unique<KVPool>(lay, opt.kv_pages);
  parts->model = std::make_unique<CpuModel>(w, *parts->kv);
  Runner r;
  r.model = std::make_unique<CpuStepModel>(*parts->model);
  r.host_pool = parts->kv.get();
  r.kv_mib = double(parts->kv->bytes()) / (1024.0 * 1024.0);
  r.max_step_tokens = opt.max_step_tokens;
  r.owned = std::move(parts);
  return r;
}

}  // namespace spade
