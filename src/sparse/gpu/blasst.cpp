// BLASST over full attention on the GPU ("blasst"): the dense kernels skip key tiles below the
// running max (backend/cuda/attention.h BlasstSkip; decode tiles are each warp's 16-token
// chunks, prefill tiles 64 packed rows x 128 keys with the wgmma kernel or 32 x 64 with the
// generic one) with the CPU method's lambda (fixed, or a / L per sequence). The skip
// parameters and tile counters are the base's (method.cpp), so BLASST inside a selection
// (`X+blasst`, CudaSparse::blasst_sel) is X's class with the same plumbing; this class adds
// only lambda changes between runs (calibration sweeps: CudaModel::set_blasst).
//
// Layout / bytes: the base's (method.h): the dense AttentionWorkspace + 1 MiB + u64 tile
// counters [2 (decode, prefill)][NL][Hkv][2] + 1 KiB.
#if defined(SPADE_HAVE_CUDA)
#include "core/error.h"
#include "sparse/gpu/method.h"
#include "sparse/gpu/registry.h"

namespace spade {

namespace {

class GpuBlasst final : public GpuMethod {
 public:
  GpuBlasst(const GpuMethodContext& ctx, const CudaSparse& sp) : GpuMethod(ctx, sp) {}
  static size_t arena_bytes_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
    return base_bytes(ctx, sp);
  }
  static std::string describe_spec(const CudaSparse& sp) {
    const std::string lam = sp.blasst_lambda >= 0 ? cat("lambda=", sp.blasst_lambda)
                                                  : cat("lambda=", sp.blasst_a, "/L");
    const std::string plam =
        sp.blasst_lambda >= 0 ? lam : cat("lambda=", sp.blasst_prefill_a, "/L");
    return cat("blasst over full: decode ",
               sp.blasst_decode ? lam + " (tiles: 16-token warp chunks)" : "off", ", prefill ",
               !sp.blasst_prefill ? std::string("dense (prefill=1 turns skipping on)")
                                  : plam + cuda_prefill_tiles_text(sp.head_dim));
  }

  void set_blasst(const CudaSparse& s) override {
    SPADE_CHECK(s.method == CudaSparse::Method::Blasst,
                "set_blasst: the model was not built with BLASST");
    SPADE_CUDA(cudaStreamSynchronize(static_cast<cudaStream_t>(ctx_.stream)));
    sp_ = s;
  }
};

}  // namespace

const GpuMethodKind gpu_blasst = SPADE_GPU_METHOD_KIND(GpuBlasst);

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
