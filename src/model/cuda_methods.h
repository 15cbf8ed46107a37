// The sparse methods that have a GPU path (CudaModel, cuda_sparse_config): the rows of the
// GPU registry (sparse/gpu/registry.h), whose names CPU-only builds keep too, so that they
// can name them in their errors.
#pragma once
#include <string>

namespace spade {

// A stack "a+b[+c]" (e.g. quest+blasst) has one when every stage has.
bool has_cuda_path(const std::string& method);

// "full, streaming, quest, tidal, lessismore, lycheedecode, oracle-topk, blasst, twilight,
// lycheecluster"
std::string cuda_method_list();

}  // namespace spade
