// Element type of the KV cache (`--kv-dtype`). The CPU front ends (generate, chat, serve,
// needle, the Python API) default to bf16: half the bytes a decode step reads at long context,
// the GPU cache's type; f32 is the reference (the HF parity tests, KVLayout's default) and f16
// the type llama.cpp keeps. Values are rounded to nearest even on write; readers widen to fp32
// and compute in fp32. fp8 (issue 40) is OCP FP8 E4M3 (kv/fp8_e4m3.h) with a scale per (layer,
// KV head), K and V apart, that the pool keeps (kv/kv_pool.h: `--kv-scale auto|X`): stored
// code = e4m3(x / scale), value read = e4m3 value * scale, exactly (scales are powers of two);
// keys of a 64..512 head dim are stored rotated (kv/key_rotation.h).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace spade {

enum class KvDtype : uint8_t { F32 = 0, BF16 = 1, F16 = 2, FP8 = 3 };

const char* kv_dtype_name(KvDtype t);   // "f32", "bf16", "f16", "fp8"
size_t kv_dtype_bytes(KvDtype t);       // bytes per element
// "f32" | "bf16" | "f16" | "fp8" (also "fp32", "float32", "bfloat16", "fp16", "float16",
// "fp8_e4m3"); anything else throws spade::Error naming `option` and the accepted values.
KvDtype parse_kv_dtype(const std::string& s, const std::string& option = "--kv-dtype");
// The names parse_kv_dtype accepts, for help texts: "f32|bf16|f16|fp8".
const char* kv_dtype_choices();

// `--kv-scale`: "auto" -> 0 (each scale set from the first prefill the pool sees), or a positive
// finite number X -> the smallest power of two >= X (fp8_pow2_ceil), which must lie in
// [2^-40, 2^40]; anything else throws spade::Error naming `option`.
float parse_kv_scale(const std::string& s, const std::string& option = "--kv-scale");

// n elements of type t at src -> fp32 (exact widening), and back (round to nearest even).
// `scale` is fp8's (a power of two: value = e4m3 value * scale, code = e4m3(x / scale),
// saturating at +-448 scale); the other types ignore it.
void kv_to_f32(KvDtype t, const void* src, int64_t n, float* dst, float scale = 1.f);
void kv_from_f32(KvDtype t, const float* src, int64_t n, void* dst, float scale = 1.f);

}  // namespace spade
