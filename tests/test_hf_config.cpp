// config.json (real configs of each supported architecture) and GGUF metadata -> ModelConfig.
#include <gtest/gtest.h>

#include <functional>

#include "core/error.h"
#include "gguf_test_writer.h"
#include "io/gguf.h"
#include "io/gguf_config.h"
#include "io/hf_config.h"

namespace spade {
namespace {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// meta-llama/Llama-3.1-8B-Instruct
const char* kLlama31 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
  "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "use_cache": true, "vocab_size": 128256})";

TEST(HfConfig, Llama31WithLlama3RopeScaling) {
  ModelConfig c = parse_hf_config(kLlama31, "config.json");
  EXPECT_EQ(c.arch, Arch::Llama);
  EXPECT_EQ(c.arch_string, "LlamaForCausalLM");
  EXPECT_EQ(c.n_layers, 32);
  EXPECT_EQ(c.hidden, 4096);
  EXPECT_EQ(c.n_heads, 32);
  EXPECT_EQ(c.n_kv_heads, 8);
  EXPECT_EQ(c.group_size(), 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.ffn, 14336);
  EXPECT_EQ(c.vocab, 128256);
  EXPECT_EQ(c.max_context, 131072);
  EXPECT_FLOAT_EQ(c.rope_theta, 500000.f);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-5f);
  EXPECT_TRUE(c.rope_scaling.llama3);
  EXPECT_FALSE(c.rope_scaling.linear);
  EXPECT_FLOAT_EQ(c.rope_scaling.factor, 8.f);
  EXPECT_FLOAT_EQ(c.rope_scaling.low_freq_factor, 1.f);
  EXPECT_FLOAT_EQ(c.rope_scaling.high_freq_factor, 4.f);
  EXPECT_EQ(c.rope_scaling.original_max_position, 8192);
  EXPECT_FALSE(c.tie_embeddings);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.bos_token, 128000);
  EXPECT_EQ(c.eos_token, 128001);
  EXPECT_EQ(c.extra_eos_tokens, (std::vector<int>{128008, 128009}));
}

TEST(HfConfig, SmolLM2TiedWithExplicitHeadDim) {
  ModelConfig c = parse_hf_config(R"({
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 576, "intermediate_size": 1536,
    "max_position_embeddings": 8192, "num_attention_heads": 9, "num_hidden_layers": 30,
    "num_key_value_heads": 3, "rms_norm_eps": 1e-05, "rope_scaling": null,
    "rope_theta": 100000, "tie_word_embeddings": true, "vocab_size": 49152})",
                                  "smol");
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.n_kv_heads, 3);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_FLOAT_EQ(c.rope_theta, 100000.f);
  EXPECT_FALSE(c.rope_scaling.llama3);
  EXPECT_EQ(c.eos_token, 2);
  EXPECT_TRUE(c.extra_eos_tokens.empty());
}

TEST(HfConfig, LlamaDefaultsAndLinearScaling) {
  // Only the sizes: transformers' LlamaConfig defaults fill the rest.
  ModelConfig c = parse_hf_config(R"({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
    "num_attention_heads": 8, "num_hidden_layers": 2, "vocab_size": 1000,
    "rope_scaling": {"type": "linear", "factor": 4}})",
                                  "cfg");
  EXPECT_EQ(c.n_kv_heads, 8);    // = heads when absent
  EXPECT_EQ(c.head_dim, 32);     // hidden / heads
  EXPECT_EQ(c.max_context, 2048);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-6f);
  EXPECT_FLOAT_EQ(c.rope_theta, 10000.f);
  EXPECT_FALSE(c.tie_embeddings);
  EXPECT_EQ(c.bos_token, 1);
  EXPECT_EQ(c.eos_token, 2);
  EXPECT_TRUE(c.rope_scaling.linear);
  EXPECT_FLOAT_EQ(c.rope_scaling.factor, 4.f);
}

TEST(HfConfig, Mistral7BSlidingWindowCapsContext) {
  ModelConfig c = parse_hf_config(R"({
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": false,
    "vocab_size": 32000})",
                                  "mistral");
  EXPECT_EQ(c.arch, Arch::Mistral);
  EXPECT_EQ(c.n_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.max_context, 4096);
  // v0.2+: no sliding window.
  ModelConfig c2 = parse_hf_config(R"({"architectures": ["MistralForCausalLM"],
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "vocab_size": 32768, "sliding_window": null,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0})",
                                   "mistral2");
  EXPECT_EQ(c2.max_context, 32768);
  EXPECT_EQ(c2.n_kv_heads, 8);  // MistralConfig's default
}

TEST(HfConfig, Qwen25HasQkvBias) {
  ModelConfig c = parse_hf_config(R"({
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": true, "use_sliding_window": false,
    "vocab_size": 151936})",
                                  "qwen2");
  EXPECT_EQ(c.arch, Arch::Qwen2);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.group_size(), 7);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_FLOAT_EQ(c.rope_theta, 1e6f);
  EXPECT_EQ(c.bos_token, 151643);
  EXPECT_EQ(c.eos_token, 151645);
}

TEST(HfConfig, Qwen3ExplicitHeadDimAndQkNorm) {
  ModelConfig c = parse_hf_config(R"({
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
    "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": null,
    "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": true,
    "use_sliding_window": false, "vocab_size": 151936})",
                                  "qwen3");
  EXPECT_EQ(c.arch, Arch::Qwen3);
  EXPECT_EQ(c.head_dim, 128);  // not hidden / heads (= 64)
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.max_context, 40960);
  EXPECT_EQ(c.n_layers, 28);
  // Qwen3Config's head_dim default is 128 too.
  ModelConfig d = parse_hf_config(R"({"architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_hidden_layers": 2, "vocab_size": 1000})",
                                  "qwen3b");
  EXPECT_EQ(d.head_dim, 128);
}

TEST(HfConfig, RopeParametersForm) {
  ModelConfig c = parse_hf_config(R"({"architectures": ["LlamaForCausalLM"],
    "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
    "num_hidden_layers": 2, "vocab_size": 1000,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})",
                                  "v5");
  EXPECT_FLOAT_EQ(c.rope_theta, 500000.f);
  EXPECT_TRUE(c.rope_scaling.llama3);
  EXPECT_FLOAT_EQ(c.rope_scaling.factor, 32.f);
}

TEST(HfConfig, Errors) {
  std::string m = error_of([] { parse_hf_config(R"({"architectures": ["GPT2LMHeadModel"]})", "gpt2.json"); });
  EXPECT_NE(m.find("GPT2LMHeadModel"), std::string::npos) << m;
  EXPECT_NE(m.find("gpt2.json"), std::string::npos) << m;
  for (const char* a : {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
    EXPECT_NE(m.find(a), std::string::npos) << m;

  m = error_of([] { parse_hf_config("{}", "c"); });
  EXPECT_NE(m.find("architectures"), std::string::npos) << m;
  m = error_of([] { parse_hf_config("{not json", "c"); });
  EXPECT_NE(m.find("not valid JSON"), std::string::npos) << m;
  const std::string base = R"("architectures": ["LlamaForCausalLM"], "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "vocab_size": 1000, )";
  m = error_of([&] { parse_hf_config("{" + base + R"("num_attention_heads": 8, "num_key_value_heads": 3})", "c"); });
  EXPECT_NE(m.find("not a multiple"), std::string::npos) << m;
  m = error_of([&] { parse_hf_config("{" + base + R"("num_attention_heads": 8, "rope_scaling": {"rope_type": "yarn", "factor": 4}})", "c"); });
  EXPECT_NE(m.find("yarn"), std::string::npos) << m;
  m = error_of([&] { parse_hf_config("{" + base + R"("num_attention_heads": "8"})", "c"); });
  EXPECT_NE(m.find("num_attention_heads"), std::string::npos) << m;
  m = error_of([&] { parse_hf_config("{" + base + R"("num_attention_heads": 8, "hidden_act": "gelu"})", "c"); });
  EXPECT_NE(m.find("gelu"), std::string::npos) << m;
  m = error_of([&] { parse_hf_config("{" + base + R"("num_attention_heads": 8, "attention_bias": true})", "c"); });
  EXPECT_NE(m.find("attention_bias"), std::string::npos) << m;
  m = error_of([&] { parse_hf_config("{" + base + R"("num_attention_heads": 8, "eos_token_id": [2, "x"]})", "c"); });
  EXPECT_NE(m.find("eos_token_id"), std::string::npos) << m;
  m = error_of([&] { parse_hf_config("{" + base + R"("num_attention_heads": 0})", "c"); });
  EXPECT_NE(m.find("attention heads"), std::string::npos) << m;
}

TEST(HfConfig, LoadFromDirectoryMergesGenerationConfigEos) {
  test::TempDir dir("hfcfg");
  test::write_file(dir.file("config.json"), std::string(kLlama31));
  test::write_file(dir.file("generation_config.json"),
                   std::string(R"({"bos_token_id": 128000, "eos_token_id": [128001, 128009, 128010]})"));
  ModelConfig c = load_hf_config(dir.path());
  EXPECT_EQ(c.eos_token, 128001);
  EXPECT_EQ(c.extra_eos_tokens, (std::vector<int>{128008, 128009, 128010}));
  EXPECT_THROW(load_hf_config(dir.file("nope")), Error);
}

// --- GGUF metadata -------------------------------------------------------------------

test::GgufWriter gguf_meta(const std::string& arch) {
  test::GgufWriter w;
  w.kv_str("general.architecture", arch);
  w.kv_u32(arch + ".block_count", 4);
  w.kv_u32(arch + ".embedding_length", 256);
  w.kv_u32(arch + ".attention.head_count", 8);
  w.kv_u32(arch + ".attention.head_count_kv", 2);
  w.kv_u32(arch + ".feed_forward_length", 640);
  w.kv_u32(arch + ".context_length", 4096);
  w.kv_f32(arch + ".rope.freq_base", 500000.f);
  w.kv_f32(arch + ".attention.layer_norm_rms_epsilon", 1e-6f);
  w.kv_str_array("tokenizer.ggml.tokens", std::vector<std::string>(300, "t"));
  w.kv_u32("tokenizer.ggml.bos_token_id", 1);
  w.kv_u32("tokenizer.ggml.eos_token_id", 2);
  w.kv_u32("tokenizer.ggml.eot_token_id", 7);
  return w;
}

ModelConfig gguf_config(const test::GgufWriter& w) {
  auto bytes = w.build();
  auto g = GgufFile::parse(bytes.data(), bytes.size(), "m.gguf");
  return config_from_gguf(*g);
}

TEST(GgufConfig, LlamaFields) {
  test::GgufWriter w = gguf_meta("llama");
  w.tensor_f32("output.weight", {1}, {0.f});
  ModelConfig c = gguf_config(w);
  EXPECT_EQ(c.arch, Arch::Llama);
  EXPECT_EQ(c.arch_string, "llama");
  EXPECT_EQ(c.n_layers, 4);
  EXPECT_EQ(c.hidden, 256);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.ffn, 640);
  EXPECT_EQ(c.max_context, 4096);
  EXPECT_EQ(c.vocab, 300);
  EXPECT_FLOAT_EQ(c.rope_theta, 500000.f);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-6f);
  EXPECT_EQ(c.bos_token, 1);
  EXPECT_EQ(c.eos_token, 2);
  EXPECT_EQ(c.extra_eos_tokens, (std::vector<int>{7}));
  EXPECT_FALSE(c.tie_embeddings);  // output.weight present
  EXPECT_FALSE(c.qkv_bias);
}

TEST(GgufConfig, Qwen3KeyLengthTiedAndRopeFreqs) {
  test::GgufWriter w = gguf_meta("qwen3");
  w.kv_u32("qwen3.attention.key_length", 64);
  w.kv_u32("qwen3.attention.value_length", 64);
  std::vector<float> ff(32);
  for (int i = 0; i < 32; ++i) ff[size_t(i)] = 1.f + float(i);
  w.tensor_f32("rope_freqs.weight", {32}, ff);
  ModelConfig c = gguf_config(w);
  EXPECT_EQ(c.arch, Arch::Qwen3);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_EQ(c.rope_scaling.freq_factors, ff);

  test::GgufWriter q2 = gguf_meta("qwen2");
  q2.kv_str("qwen2.rope.scaling.type", "linear");
  q2.kv_f32("qwen2.rope.scaling.factor", 2.f);
  ModelConfig c2 = gguf_config(q2);
  EXPECT_TRUE(c2.qkv_bias);
  EXPECT_TRUE(c2.rope_scaling.linear);
  EXPECT_FLOAT_EQ(c2.rope_scaling.factor, 2.f);
}

TEST(GgufConfig, Errors) {
  std::string m = error_of([] { gguf_config(gguf_meta("gpt2")); });
  EXPECT_NE(m.find("'gpt2'"), std::string::npos) << m;
  EXPECT_NE(m.find("qwen3"), std::string::npos) << m;

  test::GgufWriter w;
  w.kv_str("general.architecture", "llama");
  w.kv_u32("llama.block_count", 4);
  m = error_of([&] { gguf_config(w); });
  EXPECT_NE(m.find("llama.embedding_length"), std::string::npos) << m;
  EXPECT_NE(m.find("m.gguf"), std::string::npos) << m;

  test::GgufWriter y = gguf_meta("llama");
  y.kv_str("llama.rope.scaling.type", "yarn");
  m = error_of([&] { gguf_config(y); });
  EXPECT_NE(m.find("yarn"), std::string::npos) << m;

  test::GgufWriter r = gguf_meta("llama");
  r.kv_u32("llama.rope.dimension_count", 16);
  m = error_of([&] { gguf_config(r); });
  EXPECT_NE(m.find("rope.dimension_count"), std::string::npos) << m;

  test::GgufWriter bad = gguf_meta("llama");
  bad.tensor_f32("rope_freqs.weight", {5}, {1, 1, 1, 1, 1});
  m = error_of([&] { gguf_config(bad); });
  EXPECT_NE(m.find("rope_freqs.weight"), std::string::npos) << m;
}

}  // namespace
}  // namespace spade
