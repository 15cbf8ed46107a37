#include "model/config.h"

#include <sstream>

#include "core/error.h"

namespace spade {

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::Llama: return "llama";
    case Arch::Mistral: return "mistral";
    case Arch::Qwen2: return "qwen2";
    case Arch::Qwen3: return "qwen3";
  }
  return "unknown";
}

std::string ModelConfig::summary() const {
  std::ostringstream o;
  o << "architecture:      " << arch_name(arch) << " (" << arch_string << ")\n"
    << "layers:            " << n_layers << "\n"
    << "hidden:            " << hidden << "\n"
    << "heads:             " << n_heads << " query, " << n_kv_heads << " kv (group "
    << (n_kv_heads ? n_heads / n_kv_heads : 0) << ")\n"
    << "head_dim:          " << head_dim << "\n"
    << "ffn:               " << ffn << "\n"
    << "vocab:             " << vocab << "\n"
    << "context length:    " << max_context << "\n"
    << "rope theta:        " << rope_theta << "\n";
  o << "rope scaling:      ";
  if (!rope_scaling.freq_factors.empty())
    o << "per-frequency factors (" << rope_scaling.freq_factors.size() << " values)\n";
  else if (rope_scaling.llama3)
    o << "llama3 (factor " << rope_scaling.factor << ", low_freq_factor "
      << rope_scaling.low_freq_factor << ", high_freq_factor " << rope_scaling.high_freq_factor
      << ", original context " << rope_scaling.original_max_position << ")\n";
  else if (rope_scaling.linear)
    o << "linear (factor " << rope_scaling.factor << ")\n";
  else
    o << "none\n";
  o << "rms_norm_eps:      " << rms_eps << "\n"
    << "tied embeddings:   " << (tie_embeddings ? "yes" : "no") << "\n"
    << "qkv bias:          " << (qkv_bias ? "yes" : "no") << "\n"
    << "qk norm:           " << (qk_norm ? "yes" : "no") << "\n"
    << "bos token:         " << bos_token << "\n"
    << "eos token:         " << eos_token;
  for (int t : extra_eos_tokens) o << ", " << t;
  o << "\n";
  return o.str();
}

void ModelConfig::validate(const std::string& source) const {
  auto positive = [&](const char* what, int v) {
    if (v <= 0) fail(source, ": ", what, " must be positive, found ", v);
  };
  positive("number of layers", n_layers);
  positive("hidden size", hidden);
  positive("number of attention heads", n_heads);
  positive("number of kv heads", n_kv_heads);
  positive("head_dim", head_dim);
  positive("ffn (intermediate) size", ffn);
  positive("vocab size", vocab);
  positive("context length", max_context);
  if (n_heads % n_kv_heads != 0)
    fail(source, ": ", n_heads, " attention heads is not a multiple of ", n_kv_heads,
         " kv heads");
  if (head_dim % 2 != 0) fail(source, ": head_dim ", head_dim, " must be even for RoPE");
  if (!(rope_theta > 0)) fail(source, ": rope theta ", rope_theta, " must be positive");
  if (!(rms_eps >= 0)) fail(source, ": rms_norm_eps ", rms_eps, " must be non-negative");
  if (bos_token >= vocab) fail(source, ": bos token ", bos_token, " >= vocab ", vocab);
  if (eos_token >= vocab) fail(source, ": eos token ", eos_token, " >= vocab ", vocab);
}

}  // namespace spade
