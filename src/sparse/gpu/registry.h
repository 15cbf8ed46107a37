// The GPU methods' table: one row per method with a GPU path, keyed by the CPU registry's
// names (sparse/registry.h), read by has_cuda_path / cuda_method_list (model/cuda_methods.h),
// GpuMethod::create / arena_bytes and CudaSparse::describe. Adding a GPU method = one method
// file under src/sparse/gpu/ (a GpuMethod subclass and its GpuMethodKind) + its kernels + one
// row in registry.cpp (docs/sparse.md, "Adding a GPU method"). Builds without CUDA keep the
// names (the rows' kind is null there).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "sparse/gpu/cuda_sparse.h"

namespace spade {

struct GpuMethodContext;
class GpuMethod;

// What the registry knows of a GPU method class M: its arena bytes before construction, a new
// object (GpuMethod::create initializes it), the one-line description of its spec.
struct GpuMethodKind {
  size_t (*arena_bytes)(const GpuMethodContext& ctx, const CudaSparse& sp);
  std::unique_ptr<GpuMethod> (*make)(const GpuMethodContext& ctx, const CudaSparse& sp);
  std::string (*describe)(const CudaSparse& sp);
};

template <class M>
std::unique_ptr<GpuMethod> make_gpu_method(const GpuMethodContext& ctx, const CudaSparse& sp) {
  return std::unique_ptr<GpuMethod>(new M(ctx, sp));
}
// The kind of a class with static arena_bytes_of(ctx, sp) and describe_spec(sp).
#define SPADE_GPU_METHOD_KIND(M) {&M::arena_bytes_of, &make_gpu_method<M>, &M::describe_spec}

#if defined(SPADE_HAVE_CUDA)
// Each method file's kind (src/sparse/gpu/<name>.cpp), named by its registry row.
extern const GpuMethodKind gpu_full, gpu_streaming, gpu_quest, gpu_tidal, gpu_lessismore,
    gpu_lycheedecode, gpu_oracle_topk, gpu_blasst, gpu_twilight, gpu_lycheecluster,
    gpu_oracle_topp;
#endif

struct GpuMethodRow {
  const char* name;           // the CPU registry's name of the method
  CudaSparse::Method method;  // the spec cuda_sparse_config gives it
  const GpuMethodKind* kind;  // null in builds without CUDA
};

const std::vector<GpuMethodRow>& gpu_methods();
// The row of `sp` (a stack X+blasst is X's row: BLASST's skipping is the base class's).
const GpuMethodRow& find_gpu_method(const CudaSparse& sp);

}  // namespace spade
