// Architecture description of a decoder-only GQA transformer, filled from a Hugging Face
// config.json or from GGUF metadata. Everything the layer loop needs, nothing else.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace spade {

enum class Arch { Llama, Mistral, Qwen2, Qwen3 };

const char* arch_name(Arch a);

struct RopeScaling {
  // type "llama3" (Llama-3.1+): frequency-dependent scaling of inv_freq.
  bool llama3 = false;
  float factor = 1.f;
  float low_freq_factor = 1.f;
  float high_freq_factor = 4.f;
  int original_max_position = 8192;
  // type "linear": positions divided by factor.
  bool linear = false;
  // Per-frequency divisors of inv_freq (inv_freq[i] /= freq_factors[i], i < head_dim/2),
  // as stored in GGUF's `rope_freqs.weight` (llama.cpp's encoding of llama3 scaling).
  // Empty unless the file has them; when set, the llama3 fields above are not used.
  std::vector<float> freq_factors;
};

struct ModelConfig {
  Arch arch = Arch::Llama;
  std::string arch_string;  // as written in the file (e.g. "LlamaForCausalLM", "llama")
  int n_layers = 0;
  int hidden = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int ffn = 0;
  int vocab = 0;
  int max_context = 0;
  float rope_theta = 10000.f;
  RopeScaling rope_scaling;
  float rms_eps = 1e-5f;
  bool tie_embeddings = false;
  bool qkv_bias = false;  // Qwen2
  bool qk_norm = false;   // Qwen3: RMSNorm over head_dim on q and k before RoPE
  int bos_token = -1;
  int eos_token = -1;
  std::vector<int> extra_eos_tokens;

  int group_size() const { return n_heads / n_kv_heads; }
  std::string summary() const;  // one line per field, for `spade inspect`
  // Throws spade::Error naming `source` when a field is out of range or inconsistent
  // (non-positive sizes, heads not a multiple of kv heads, odd head_dim, ...).
  void validate(const std::string& source) const;
};

}  // namespace spade
