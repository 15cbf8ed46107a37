#include "engine/runner.h"

#include <algorithm>
#include <climits>
#include <cmath>

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

int64_t kv_pages_for_memory(const ModelConfig& c, int page_size, KvDtype t, double gib) {
  SPADE_CHECK(std::isfinite(gib) && gib > 0, "--kv-mem must be a positive number of GiB, got ", gib);
  const double page_bytes = 2.0 * double(c.n_layers) * c.n_kv_heads * double(page_size) *
                            c.head_dim * double(kv_dtype_bytes(t));
  const double pages = std::floor(gib * 1024.0 * 1024.0 * 1024.0 / page_bytes);
  SPADE_CHECK(pages >= 1, "--kv-mem ", gib, " GiB holds no KV page (one page of ", page_size,
              " tokens in ", kv_dtype_name(t), " is ", page_bytes / (1024.0 * 1024.0), " MiB)");
  SPADE_CHECK(pages <= double(INT32_MAX), "--kv-mem ", gib, " GiB is ", pages,
              " pages; page ids are 32-bit");
  return int64_t(pages);
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
