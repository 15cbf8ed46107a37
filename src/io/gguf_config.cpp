#include "io/gguf_config.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"

namespace spade {

namespace {

int to_int(const GgufFile& g, const std::string& key, int64_t v) {
  if (v < 0 || v > std::numeric_limits<int>::max())
    fail(g.path(), ": metadata '", key, "' = ", v, " is out of range");
  return int(v);
}

int req_int(const GgufFile& g, const std::string& key) {
  return to_int(g, key, g.get_int(key));
}

int opt_int(const GgufFile& g, const std::string& key, int def) {
  auto v = g.get_int_opt(key);
  return v ? to_int(g, key, *v) : def;
}

}  // namespace

ModelConfig config_from_gguf(const GgufFile& g) {
  const std::string& src = g.path();
  ModelConfig c;
  std::string a = g.get_string("general.architecture");
  c.arch_string = a;
  if (a == "llama") {
    c.arch = Arch::Llama;
  } else if (a == "qwen2") {
    c.arch = Arch::Qwen2;
    c.qkv_bias = true;
  } else if (a == "qwen3") {
    c.arch = Arch::Qwen3;
    c.qk_norm = true;
  } else {
    fail(src, ": GGUF architecture '", a, "' is not supported (supported: llama, qwen2, qwen3)");
  }

  c.n_layers = req_int(g, a + ".block_count");
  c.hidden = req_int(g, a + ".embedding_length");
  c.n_heads = req_int(g, a + ".attention.head_count");
  c.n_kv_heads = opt_int(g, a + ".attention.head_count_kv", c.n_heads);
  c.ffn = req_int(g, a + ".feed_forward_length");
  c.max_context = req_int(g, a + ".context_length");
  c.head_dim = opt_int(g, a + ".attention.key_length", c.n_heads > 0 ? c.hidden / c.n_heads : 0);
  int v_len = opt_int(g, a + ".attention.value_length", c.head_dim);
  if (v_len != c.head_dim)
    fail(src, ": attention.value_length ", v_len, " differs from key_length ", c.head_dim,
         " (not supported)");
  int rope_dim = opt_int(g, a + ".rope.dimension_count", c.head_dim);
  if (rope_dim != c.head_dim)
    fail(src, ": rope.dimension_count ", rope_dim, " differs from the head dim ", c.head_dim,
         " (partial rotary embeddings are not supported)");
  c.rope_theta = float(g.get_float_opt(a + ".rope.freq_base").value_or(10000.0));
  c.rms_eps = float(g.get_float_opt(a + ".attention.layer_norm_rms_epsilon").value_or(1e-5));

  // RoPE scaling: "linear" in metadata; llama3-style scaling arrives as a tensor of
  // per-frequency factors (rope_freqs.weight), which llama.cpp's converter precomputes.
  if (auto type = g.get_string_opt(a + ".rope.scaling.type")) {
    if (*type == "linear") {
      c.rope_scaling.linear = true;
      c.rope_scaling.factor = float(g.get_float(a + ".rope.scaling.factor"));
      if (!(c.rope_scaling.factor > 0) || !std::isfinite(c.rope_scaling.factor))
        fail(src, ": rope.scaling.factor ", c.rope_scaling.factor, " must be positive");
    } else if (*type != "none") {
      fail(src, ": rope.scaling.type '", *type, "' is not supported (supported: none, linear)");
    }
  }
  if (const GgufTensorInfo* rf = g.find_tensor("rope_freqs.weight")) {
    if (rf->ne.size() != 1 || rf->ne[0] != c.head_dim / 2)
      fail(src, ": tensor 'rope_freqs.weight' has shape ", rf->ne.size() == 1 ? rf->ne[0] : -1,
           ", expected [", c.head_dim / 2, "]");
    if (rf->ggml_type != 0 || !rf->data)
      fail(src, ": tensor 'rope_freqs.weight' must be f32, found ", rf->type_name());
    c.rope_scaling.freq_factors.resize(size_t(rf->ne[0]));
    std::memcpy(c.rope_scaling.freq_factors.data(), rf->data, rf->nbytes);
  }

  if (g.find("tokenizer.ggml.tokens")) {
    c.vocab = int(g.get_array_size("tokenizer.ggml.tokens"));
  } else if (g.find(a + ".vocab_size")) {
    c.vocab = req_int(g, a + ".vocab_size");
  } else if (const GgufTensorInfo* e = g.find_tensor("token_embd.weight");
             e && e->ne.size() == 2) {
    c.vocab = to_int(g, "token_embd.weight rows", e->ne[1]);
  }
  c.bos_token = opt_int(g, "tokenizer.ggml.bos_token_id", -1);
  c.eos_token = opt_int(g, "tokenizer.ggml.eos_token_id", -1);
  // End-of-turn / end-of-message tokens also end generation.
  for (const char* k : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"}) {
    int id = opt_int(g, k, -1);
    if (id >= 0 && id != c.eos_token &&
        (c.extra_eos_tokens.empty() || c.extra_eos_tokens[0] != id))
      c.extra_eos_tokens.push_back(id);
  }
  c.tie_embeddings = g.find_tensor("output.weight") == nullptr;
  c.validate(src);
  return c;
}

}  // namespace spade
