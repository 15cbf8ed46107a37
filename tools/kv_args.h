// --kv-dtype and --kv-scale, shared by the commands that build a KV cache (generate, chat, serve,
// needle, eval).
#pragma once
#include <string>

#include "args.h"
#include "core/error.h"
#include "kv/kv_dtype.h"

namespace spade::cli {

// The KV cache's type (default `dflt`): any type with --device cpu; with --device cuda bf16 or
// fp8 (E4M3 codes, issue 40; a GPU method that does not read fp8 yet is refused by name where
// the model or the runner meets it: sparse/gpu/method.h's check_gpu_kv_dtype).
// `option`: the flag read (eval agree's --ref-kv-dtype takes the same values).
inline KvDtype kv_dtype_from_args(const Args& a, const std::string& device,
                                  const char* dflt = "bf16", const char* option = "--kv-dtype") {
  const KvDtype t = parse_kv_dtype(a.str(option, dflt), option);
  SPADE_CHECK(device == "cpu" || t == KvDtype::BF16 || t == KvDtype::FP8, option, " ",
              kv_dtype_name(t), ": the GPU KV cache is bf16 or fp8 (other types are for --device cpu)");
  return t;
}

// --kv-scale auto|X: the fp8 cache's scales (KVLayout::kv_scale: 0 = auto, else X rounded up
// to a power of two); refused with another type.
inline float kv_scale_from_args(const Args& a, KvDtype t) {
  if (!a.has("--kv-scale")) return 0.f;
  SPADE_CHECK(t == KvDtype::FP8, "--kv-scale is for --kv-dtype fp8 (this cache is ",
              kv_dtype_name(t), ")");
  return parse_kv_scale(a.str("--kv-scale"));
}


}  // namespace spade::cli
