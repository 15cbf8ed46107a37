// The sparse methods that have a GPU path (CudaModel, cuda_sparse_config), as plain data so
// that CPU-only builds can name them in their errors too.
#pragma once
#include <string>

namespace spade {

inline constexpr const char* kCudaSparseMethods[] = {
    "full",         "streaming",   "quest",  "tidal",   "lessismore",
    "lycheedecode", "oracle-topk", "blasst", "twilight", "lycheecluster"};

// A stack "a+b[+c]" (e.g. quest+blasst) has one when every stage has.
inline bool has_cuda_path(const std::string& method) {
  if (const size_t plus = method.find('+'); plus != std::string::npos)
    return has_cuda_path(method.substr(0, plus)) && has_cuda_path(method.substr(plus + 1));
  for (const char* m : kCudaSparseMethods)
    if (method == m) return true;
  return false;
}

// "full, streaming, quest, tidal, lessismore, lycheedecode, oracle-topk, blasst, twilight,
// lycheecluster"
inline std::string cuda_method_list() {
  std::string s;
  for (const char* m : kCudaSparseMethods) s += (s.empty() ? "" : ", ") + std::string(m);
  return s;
}

}  // namespace spade
