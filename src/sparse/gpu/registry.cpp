// The GPU methods' table (registry.h): one row per method with a GPU path, in the order
// cuda_method_list() prints them. Compiled in every build (the CPU-only one keeps the names,
// for has_cuda_path and its errors); the kinds exist with CUDA only.
#include "sparse/gpu/registry.h"

#include "core/error.h"
#include "model/cuda_methods.h"

namespace spade {

#if defined(SPADE_HAVE_CUDA)
#define SPADE_GPU(kind) &kind
#else
#define SPADE_GPU(kind) nullptr
#endif

const std::vector<GpuMethodRow>& gpu_methods() {
  using M = CudaSparse::Method;
  static const std::vector<GpuMethodRow> table = {
      {"full", M::None, SPADE_GPU(gpu_full)},
      {"streaming", M::Streaming, SPADE_GPU(gpu_streaming)},
      {"quest", M::Quest, SPADE_GPU(gpu_quest)},
      {"tidal", M::Tidal, SPADE_GPU(gpu_tidal)},
      {"lessismore", M::LessIsMore, SPADE_GPU(gpu_lessismore)},
      {"lycheedecode", M::LycheeDecode, SPADE_GPU(gpu_lycheedecode)},
      {"oracle-topk", M::OracleTopK, SPADE_GPU(gpu_oracle_topk)},
      {"blasst", M::Blasst, SPADE_GPU(gpu_blasst)},
      {"twilight", M::Twilight, SPADE_GPU(gpu_twilight)},
      {"lycheecluster", M::LycheeCluster, SPADE_GPU(gpu_lycheecluster)},
      {"oracle-topp", M::OracleTopP, SPADE_GPU(gpu_oracle_topp)},
  };
  return table;
}
#undef SPADE_GPU

const GpuMethodRow& find_gpu_method(const CudaSparse& sp) {
  for (const GpuMethodRow& r : gpu_methods())
    if (r.method == sp.method) {
      SPADE_CHECK(r.kind, "sparse method '", r.name, "': this build has no CUDA backend");
      return r;
    }
  fail("no GPU method for this sparse spec (GPU methods: ", cuda_method_list(), ")");
}

bool has_cuda_path(const std::string& method) {
  if (const size_t plus = method.find('+'); plus != std::string::npos)
    return has_cuda_path(method.substr(0, plus)) && has_cuda_path(method.substr(plus + 1));
  for (const GpuMethodRow& r : gpu_methods())
    if (method == r.name) return true;
  return false;
}

std::string cuda_method_list() {
  std::string s;
  for (const GpuMethodRow& r : gpu_methods()) s += (s.empty() ? "" : ", ") + std::string(r.name);
  return s;
}

}  // namespace spade
