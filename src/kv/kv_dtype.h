// Element type of the KV cache (`--kv-dtype`). The CPU front ends (generate, chat, serve,
// needle, the Python API) default to bf16: half the bytes a decode step reads at long context,
// the GPU cache's type; f32 is the reference (the HF parity tests, KVLayout's default) and f16
// the type llama.cpp keeps. Values are rounded to nearest even on write; readers widen to fp32
// and compute in fp32. The enum is kept open for an 8-bit type (FP8 E4M3 with scales, issue
// 40): a new value gets a name here, an element size, and a branch in kv_to_f32/kv_from_f32.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace spade {

enum class KvDtype : uint8_t { F32 = 0, BF16 = 1, F16 = 2 };

const char* kv_dtype_name(KvDtype t);   // "f32", "bf16", "f16"
size_t kv_dtype_bytes(KvDtype t);       // bytes per element
// "f32" | "bf16" | "f16" (also "fp32", "float32", "bfloat16", "fp16", "float16"); anything
// else throws spade::Error naming `option` and the accepted values.
KvDtype parse_kv_dtype(const std::string& s, const std::string& option = "--kv-dtype");
// The names parse_kv_dtype accepts, for help texts: "f32|bf16|f16".
const char* kv_dtype_choices();

// n elements of type t at src -> fp32 (exact widening), and back (round to nearest even).
void kv_to_f32(KvDtype t, const void* src, int64_t n, float* dst);
void kv_from_f32(KvDtype t, const float* src, int64_t n, void* dst);

}  // namespace spade
