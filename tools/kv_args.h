// --kv-dtype, shared by the commands that build a KV cache (generate, chat, serve, needle).
#pragma once
#include <string>

#include "args.h"
#include "core/error.h"
#include "kv/kv_dtype.h"

namespace spade::cli {

// The CPU cache's type (default bf16); with --device cuda only bf16 is accepted.
inline KvDtype kv_dtype_from_args(const Args& a, const std::string& device) {
  const KvDtype t = parse_kv_dtype(a.str("--kv-dtype", "bf16"));
  SPADE_CHECK(device == "cpu" || t == KvDtype::BF16, "--kv-dtype ", kv_dtype_name(t),
              ": the GPU KV cache is bf16 (other types are for --device cpu)");
  return t;
}

}  // namespace spade::cli
