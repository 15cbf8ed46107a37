// The GPU ranks of tensor parallelism (tp_runner.h, issue 39): a CudaModel of the rank's shard
// on its own GPU, its all-reduces over NCCL (CudaModelOptions::tp). Compiled in every build;
// without CUDA or NCCL the functions throw spade::Error naming what is missing. Untested until
// a multi-GPU run (tests/gpu/test_cuda_tp.cpp, tests/e2e/test_tp_cuda.py).
#include <algorithm>
#include <memory>

#include "core/error.h"
#include "dist/tp_runner.h"

#if defined(SPADE_HAVE_CUDA)
#include <cuda_runtime.h>

#include "model/cuda_model.h"
#include "model/cuda_step_model.h"
#endif
#if defined(SPADE_HAVE_CUDA) && defined(SPADE_HAVE_NCCL)
#include "dist/nccl_communicator.h"
#endif

namespace spade::dist {

namespace {

#if defined(SPADE_HAVE_CUDA)
int visible_gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}
#endif

}  // namespace

void check_cuda_tp(int tp, bool local) {
#if !defined(SPADE_HAVE_CUDA)
  (void)local;
  fail("--tp ", tp, " --device cuda: this build has no CUDA backend");
#elif !defined(SPADE_HAVE_NCCL)
  (void)local;
  fail("--tp ", tp, " --device cuda: this build has no NCCL (CMake found no nccl.h / libnccl: "
       "set SPADE_NCCL_INCLUDE_DIR / SPADE_NCCL_LIBRARY, or use --device cpu)");
#else
  const int n = visible_gpus();
  SPADE_CHECK(n >= 1, "--tp ", tp, " --device cuda: no CUDA device is visible");
  SPADE_CHECK(!local || n >= tp, "--tp ", tp, " needs ", tp, " GPUs, ", n, " visible");
#endif
}

int cuda_device_of_rank(int rank) {
#if defined(SPADE_HAVE_CUDA)
  const int n = visible_gpus();
  SPADE_CHECK(n >= 1, "tensor-parallel rank ", rank, ": no CUDA device is visible");
  return rank % n;
#else
  fail("tensor-parallel rank ", rank, " --device cuda: this build has no CUDA backend");
#endif
}

TpRankModel make_cuda_rank(const ModelWeights& shard, const ModelConfig& full,
                           Communicator& bootstrap, const TpInit& init, int device) {
#if defined(SPADE_HAVE_CUDA) && defined(SPADE_HAVE_NCCL)
  // Before this thread's first CUDA work: the rank's own GPU (a follower process has done no
  // CUDA work before; rank 0 runs on device 0, the default).
  SPADE_CHECK(cudaSetDevice(device) == cudaSuccess, "tensor-parallel rank ", bootstrap.rank(),
              ": cannot select GPU ", device);
  struct Owned {
    std::unique_ptr<NcclCommunicator> nccl;  // destroyed after the model (declared first)
    std::unique_ptr<CudaModel> model;
  };
  auto o = std::make_shared<Owned>();
  o->nccl = std::make_unique<NcclCommunicator>(bootstrap, device);
  // make_cuda_runner's options (model/cuda_runner.cpp) from what rank 0 sent: the same on every
  // rank, so every rank's page allocator is the same.
  CudaModelOptions copt;
  copt.kv_pages = init.kv_pages;
  copt.page_size = init.page_size;
  copt.max_batch = init.max_batch;
  copt.max_step_tokens = std::max<int64_t>(init.max_step_tokens, init.max_batch);
  copt.max_logit_rows = init.max_logit_rows > 0 ? init.max_logit_rows
                                                : std::max<int64_t>(init.max_batch, 64);
  copt.deterministic = init.deterministic != 0;
  const bool fp8 = KvDtype(init.kv_dtype) == KvDtype::FP8;
  copt.kv_dtype = fp8 ? KvDtype::FP8 : KvDtype::BF16;
  copt.kv_scale = fp8 ? init.kv_scale : 0.f;
  copt.tp = o->nccl.get();
  copt.logits = bootstrap.rank() == 0;
  // Sparse methods: parsed for the whole model, run on this rank's heads (method_spec).
  copt.tp_model = full;
  copt.tp_kv0 = bootstrap.rank() * shard.config.n_kv_heads;
  copt.any_method = init.any_method != 0;
  o->model = std::make_unique<CudaModel>(shard, copt);
  const ModelConfig& c = shard.config;
  TpRankModel r;
  r.step = std::make_unique<CudaStepModel>(*o->model);
  CudaModel* m = o->model.get();
  r.reserve = [m](PageTable& pt, int64_t n) { m->reserve(pt, n); };
  r.kv_mib = double(m->total_pages()) * init.page_size * c.n_layers * c.n_kv_heads * c.head_dim *
             2 * (fp8 ? 1 : 2) / (1024.0 * 1024.0);
  r.max_logit_rows = copt.max_logit_rows;
  r.max_step_tokens = copt.max_step_tokens;
  r.owned = std::move(o);
  return r;
#else
  (void)shard, (void)full, (void)init, (void)device;
  check_cuda_tp(int(bootstrap.size()), false);  // names what this build lacks
  fail("tensor parallelism on the GPU is not available in this build");
#endif
}

}  // namespace spade::dist
