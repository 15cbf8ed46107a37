// Full attention on the GPU ("full"): the base GpuMethod as it is, the dense attention
// workspace over the method's rows in every layer (split-KV decode, tensor-core prefill).
//
// Layout / bytes: the base's only (method.h): the dense AttentionWorkspace + 1 MiB.
#if defined(SPADE_HAVE_CUDA)
#include "sparse/gpu/method.h"
#include "sparse/gpu/registry.h"

namespace spade {

namespace {

class GpuFull final : public GpuMethod {
 public:
  GpuFull(const GpuMethodContext& ctx, const CudaSparse& sp) : GpuMethod(ctx, sp) {}
  static size_t arena_bytes_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
    return base_bytes(ctx, sp);
  }
  static std::string describe_spec(const CudaSparse&) { return "full"; }
};

}  // namespace

const GpuMethodKind gpu_full = SPADE_GPU_METHOD_KIND(GpuFull);

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
