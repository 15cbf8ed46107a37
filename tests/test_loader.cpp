// load_model: tiny random models written here (HF safetensors dirs and GGUF files), the
// q/k un-permutation of GGUF llama, shape and missing-tensor errors, describe_model, and
// the real SmolLM2-135M GGUF when it has been fetched.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "core/half.h"
#include "gguf_test_writer.h"
#include "io/dequant.h"
#include "io/gguf.h"
#include "model/inspect.h"
#include "model/loader.h"
#include "safetensors_test_writer.h"

namespace spade {
namespace {

struct Tiny {
  int L = 2, H = 64, Hq = 4, Hkv = 2, D = 16, F = 96, V = 100;
  bool tie = false, bias = false, qk_norm = false;
  std::string arch = "LlamaForCausalLM";
};

struct Tensor {
  std::vector<int64_t> shape;  // row-major (HF)
  std::vector<float> v;
  std::string dtype = "F32";   // how it is stored in safetensors
};

using TensorMap = std::map<std::string, Tensor>;

// HF-named random tensors; values pre-rounded to their storage dtype so loads are exact.
TensorMap tiny_tensors(const Tiny& t, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 0.5f);
  TensorMap m;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, const char* dtype) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    Tensor x{shape, std::vector<float>(size_t(n)), dtype};
    for (float& f : x.v) {
      f = nd(rng);
      if (x.dtype == "BF16") f = bf16_to_f32(f32_to_bf16(f));
      if (x.dtype == "F16") f = f16_to_f32(f32_to_f16(f));
    }
    m[name] = std::move(x);
  };
  const int64_t QD = t.Hq * t.D, KD = t.Hkv * t.D;
  add("model.embed_tokens.weight", {t.V, t.H}, "BF16");
  for (int l = 0; l < t.L; ++l) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {t.H}, "F32");
    add(p + "self_attn.q_proj.weight", {QD, t.H}, "F32");
    add(p + "self_attn.k_proj.weight", {KD, t.H}, "F16");
    add(p + "self_attn.v_proj.weight", {KD, t.H}, "F32");
    add(p + "self_attn.o_proj.weight", {t.H, QD}, "BF16");
    if (t.bias) {
      add(p + "self_attn.q_proj.bias", {QD}, "F32");
      add(p + "self_attn.k_proj.bias", {KD}, "F32");
      add(p + "self_attn.v_proj.bias", {KD}, "F32");
    }
    if (t.qk_norm) {
      add(p + "self_attn.q_norm.weight", {t.D}, "F32");
      add(p + "self_attn.k_norm.weight", {t.D}, "F32");
    }
    add(p + "post_attention_layernorm.weight", {t.H}, "F32");
    add(p + "mlp.gate_proj.weight", {t.F, t.H}, "F16");
    add(p + "mlp.up_proj.weight", {t.F, t.H}, "F32");
    add(p + "mlp.down_proj.weight", {t.H, t.F}, "BF16");
  }
  add("model.norm.weight", {t.H}, "F32");
  if (!t.tie) add("lm_head.weight", {t.V, t.H}, "F32");
  return m;
}

std::string hf_config_json(const Tiny& t) {
  nlohmann::json j = {{"architectures", {t.arch}},
                      {"hidden_size", t.H},
                      {"intermediate_size", t.F},
                      {"num_attention_heads", t.Hq},
                      {"num_key_value_heads", t.Hkv},
                      {"num_hidden_layers", t.L},
                      {"head_dim", t.D},
                      {"vocab_size", t.V},
                      {"max_position_embeddings", 512},
                      {"rms_norm_eps", 1e-5},
                      {"rope_theta", 10000.0},
                      {"tie_word_embeddings", t.tie},
                      {"bos_token_id", 1},
                      {"eos_token_id", 2}};
  return j.dump(2);
}

std::vector<uint8_t> encode(const Tensor& x) {
  if (x.dtype == "BF16") return test::bf16_bytes(x.v);
  if (x.dtype == "F16") return test::f16_bytes(x.v);
  return test::f32_bytes(x.v);
}

void write_hf_dir(const std::string& dir, const Tiny& t, const TensorMap& m) {
  test::write_file(dir + "/config.json", hf_config_json(t));
  std::vector<test::StEntry> entries;
  for (const auto& [name, x] : m) entries.push_back({name, x.dtype, x.shape, encode(x)});
  test::write_file(dir + "/model.safetensors", test::safetensors_image(entries));
}

void expect_equal(const HostTensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.view.ndim, int(want.shape.size())) << what;
  for (size_t i = 0; i < want.shape.size(); ++i) ASSERT_EQ(got.view.shape[i], want.shape[i]) << what;
  ASSERT_EQ(got.storage.size(), want.v.size()) << what;
  for (size_t i = 0; i < want.v.size(); ++i)
    ASSERT_EQ(got.storage[i], want.v[i]) << what << " element " << i;
}

void expect_model_matches(const ModelWeights& w, const Tiny& t, const TensorMap& m) {
  expect_equal(w.tok_embeddings, m.at("model.embed_tokens.weight"), "embed");
  ASSERT_EQ(w.layers.size(), size_t(t.L));
  for (int l = 0; l < t.L; ++l) {
    const LayerWeights& L = w.layers[size_t(l)];
    std::string p = "model.layers." + std::to_string(l) + ".";
    expect_equal(L.attn_norm, m.at(p + "input_layernorm.weight"), p + "attn_norm");
    expect_equal(L.wq, m.at(p + "self_attn.q_proj.weight"), p + "wq");
    expect_equal(L.wk, m.at(p + "self_attn.k_proj.weight"), p + "wk");
    expect_equal(L.wv, m.at(p + "self_attn.v_proj.weight"), p + "wv");
    expect_equal(L.wo, m.at(p + "self_attn.o_proj.weight"), p + "wo");
    if (t.bias) {
      expect_equal(L.bq, m.at(p + "self_attn.q_proj.bias"), p + "bq");
      expect_equal(L.bk, m.at(p + "self_attn.k_proj.bias"), p + "bk");
      expect_equal(L.bv, m.at(p + "self_attn.v_proj.bias"), p + "bv");
    } else {
      EXPECT_EQ(L.bq.numel(), 0);
    }
    if (t.qk_norm) {
      expect_equal(L.q_norm, m.at(p + "self_attn.q_norm.weight"), p + "q_norm");
      expect_equal(L.k_norm, m.at(p + "self_attn.k_norm.weight"), p + "k_norm");
    } else {
      EXPECT_EQ(L.q_norm.numel(), 0);
    }
    expect_equal(L.ffn_norm, m.at(p + "post_attention_layernorm.weight"), p + "ffn_norm");
    expect_equal(L.w_gate, m.at(p + "mlp.gate_proj.weight"), p + "gate");
    expect_equal(L.w_up, m.at(p + "mlp.up_proj.weight"), p + "up");
    expect_equal(L.w_down, m.at(p + "mlp.down_proj.weight"), p + "down");
  }
  expect_equal(w.final_norm, m.at("model.norm.weight"), "final_norm");
  if (t.tie) {
    EXPECT_EQ(w.lm_head.numel(), 0);
    EXPECT_EQ(&w.output_weight(), &w.tok_embeddings);
  } else {
    expect_equal(w.lm_head, m.at("lm_head.weight"), "lm_head");
  }
  int64_t total = 0;
  for (const auto& [name, x] : m) total += int64_t(x.v.size());
  EXPECT_EQ(w.parameter_count(), total);
}

std::string load_error(const std::string& path) {
  try {
    load_model(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(LoaderHf, TinyLlamaLoadsExactly) {
  Tiny t;
  TensorMap m = tiny_tensors(t, 1);
  test::TempDir dir("ld_llama");
  write_hf_dir(dir.path(), t, m);
  auto w = load_model(dir.path());
  EXPECT_EQ(w->config.arch, Arch::Llama);
  EXPECT_EQ(w->config.head_dim, 16);
  EXPECT_EQ(w->source, dir.path());
  expect_model_matches(*w, t, m);
  // Naming one of the directory's files means the directory.
  EXPECT_EQ(load_model(dir.file("config.json"))->layers.size(), 2u);
  EXPECT_EQ(load_model(dir.file("model.safetensors"))->layers.size(), 2u);
}

TEST(LoaderHf, TiedQwen2WithBiasesAndQwen3WithQkNorm) {
  Tiny q2;
  q2.arch = "Qwen2ForCausalLM";
  q2.tie = true;
  q2.bias = true;
  TensorMap m2 = tiny_tensors(q2, 2);
  test::TempDir d2("ld_qwen2");
  write_hf_dir(d2.path(), q2, m2);
  auto w2 = load_model(d2.path());
  EXPECT_TRUE(w2->config.qkv_bias);
  expect_model_matches(*w2, q2, m2);

  Tiny q3;
  q3.arch = "Qwen3ForCausalLM";
  q3.qk_norm = true;
  q3.D = 32;  // head_dim != hidden / heads, as in real Qwen3
  TensorMap m3 = tiny_tensors(q3, 3);
  test::TempDir d3("ld_qwen3");
  write_hf_dir(d3.path(), q3, m3);
  auto w3 = load_model(d3.path());
  EXPECT_TRUE(w3->config.qk_norm);
  expect_model_matches(*w3, q3, m3);
}

TEST(LoaderHf, ShardedDirectory) {
  Tiny t;
  TensorMap m = tiny_tensors(t, 4);
  test::TempDir dir("ld_sharded");
  test::write_file(dir.file("config.json"), hf_config_json(t));
  std::vector<test::StEntry> a, b;
  nlohmann::json wm;
  for (const auto& [name, x] : m) {
    bool first = name.find("layers.1.") == std::string::npos;
    (first ? a : b).push_back({name, x.dtype, x.shape, encode(x)});
    wm[name] = first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  test::write_file(dir.file("model-00001-of-00002.safetensors"), test::safetensors_image(a));
  test::write_file(dir.file("model-00002-of-00002.safetensors"), test::safetensors_image(b));
  test::write_file(dir.file("model.safetensors.index.json"),
                   nlohmann::json({{"metadata", nlohmann::json::object()}, {"weight_map", wm}}).dump());
  auto w = load_model(dir.path());
  expect_model_matches(*w, t, m);
}

TEST(LoaderHf, ErrorsNameTheTensor) {
  Tiny t;
  {
    TensorMap m = tiny_tensors(t, 5);
    m.erase("model.layers.1.mlp.up_proj.weight");
    test::TempDir dir("ld_missing");
    write_hf_dir(dir.path(), t, m);
    std::string e = load_error(dir.path());
    EXPECT_NE(e.find("missing tensor 'model.layers.1.mlp.up_proj.weight'"), std::string::npos) << e;
    EXPECT_NE(e.find("[96, 64]"), std::string::npos) << e;
  }
  {
    TensorMap m = tiny_tensors(t, 6);
    Tensor& k = m["model.layers.0.self_attn.k_proj.weight"];
    k.shape = {2 * 16 + 1, 64};
    k.v.resize(33 * 64);
    test::TempDir dir("ld_shape");
    write_hf_dir(dir.path(), t, m);
    std::string e = load_error(dir.path());
    EXPECT_NE(e.find("'model.layers.0.self_attn.k_proj.weight'"), std::string::npos) << e;
    EXPECT_NE(e.find("[33, 64]"), std::string::npos) << e;
    EXPECT_NE(e.find("expected [32, 64]"), std::string::npos) << e;
  }
  {
    TensorMap m = tiny_tensors(t, 7);
    m.erase("lm_head.weight");  // config says untied
    test::TempDir dir("ld_nohead");
    write_hf_dir(dir.path(), t, m);
    std::string e = load_error(dir.path());
    EXPECT_NE(e.find("'lm_head.weight'"), std::string::npos) << e;
  }
  {
    TensorMap m = tiny_tensors(t, 8);
    test::TempDir dir("ld_dtype");
    write_hf_dir(dir.path(), t, m);
    // Store the final norm as I64 (64 values x 8 bytes): a dtype spade does not read.
    std::vector<test::StEntry> entries;
    for (const auto& [name, x] : m) {
      if (name == "model.norm.weight")
        entries.push_back({name, "I64", x.shape, std::vector<uint8_t>(size_t(64 * 8))});
      else
        entries.push_back({name, x.dtype, x.shape, encode(x)});
    }
    test::write_file(dir.file("model.safetensors"), test::safetensors_image(entries));
    std::string e = load_error(dir.path());
    EXPECT_NE(e.find("'model.norm.weight'"), std::string::npos) << e;
    EXPECT_NE(e.find("I64"), std::string::npos) << e;
  }
  EXPECT_NE(load_error("/nonexistent/model.gguf").find("does not exist"), std::string::npos);
}

// --- GGUF --------------------------------------------------------------------------

// HF name -> GGUF name.
std::string gguf_name(const std::string& hf) {
  static const std::vector<std::pair<std::string, std::string>> parts = {
      {"self_attn.q_proj.", "attn_q."}, {"self_attn.k_proj.", "attn_k."},
      {"self_attn.v_proj.", "attn_v."}, {"self_attn.o_proj.", "attn_output."},
      {"self_attn.q_norm.", "attn_q_norm."}, {"self_attn.k_norm.", "attn_k_norm."},
      {"input_layernorm.", "attn_norm."}, {"post_attention_layernorm.", "ffn_norm."},
      {"mlp.gate_proj.", "ffn_gate."}, {"mlp.up_proj.", "ffn_up."}, {"mlp.down_proj.", "ffn_down."}};
  if (hf == "model.embed_tokens.weight") return "token_embd.weight";
  if (hf == "model.norm.weight") return "output_norm.weight";
  if (hf == "lm_head.weight") return "output.weight";
  std::string s = hf;
  s.replace(0, std::string("model.layers.").size(), "blk.");
  for (const auto& [from, to] : parts)
    if (auto p = s.find(from); p != std::string::npos) s.replace(p, from.size(), to);
  return s;
}

// convert_hf_to_gguf's permute(): rows viewed as (heads, 2, D/2) are stored as (heads, D/2, 2).
std::vector<float> converter_permute(const std::vector<float>& w, int heads, int64_t cols) {
  int64_t rows = int64_t(w.size()) / cols, D = rows / heads, half = D / 2;
  std::vector<float> out(w.size());
  for (int h = 0; h < heads; ++h)
    for (int64_t j = 0; j < 2; ++j)
      for (int64_t i = 0; i < half; ++i)
        for (int64_t c = 0; c < cols; ++c)
          out[size_t(((h * half + i) * 2 + j) * cols + c)] = w[size_t(((h * 2 + j) * half + i) * cols + c)];
  return out;
}

std::vector<uint8_t> gguf_model(const std::string& arch, const Tiny& t, const TensorMap& m,
                                bool permute_qk) {
  test::GgufWriter w;
  w.kv_str("general.architecture", arch);
  w.kv_u32(arch + ".block_count", uint32_t(t.L));
  w.kv_u32(arch + ".embedding_length", uint32_t(t.H));
  w.kv_u32(arch + ".attention.head_count", uint32_t(t.Hq));
  w.kv_u32(arch + ".attention.head_count_kv", uint32_t(t.Hkv));
  w.kv_u32(arch + ".attention.key_length", uint32_t(t.D));
  w.kv_u32(arch + ".feed_forward_length", uint32_t(t.F));
  w.kv_u32(arch + ".context_length", 512);
  w.kv_f32(arch + ".attention.layer_norm_rms_epsilon", 1e-5f);
  w.kv_str_array("tokenizer.ggml.tokens", std::vector<std::string>(size_t(t.V), "x"));
  for (const auto& [name, x] : m) {
    std::vector<float> v = x.v;
    bool is_q = name.find("q_proj.weight") != std::string::npos;
    bool is_k = name.find("k_proj.weight") != std::string::npos;
    if (permute_qk && (is_q || is_k)) v = converter_permute(v, is_q ? t.Hq : t.Hkv, t.H);
    std::vector<uint64_t> ne(x.shape.rbegin(), x.shape.rend());
    w.tensor_f32(gguf_name(name), ne, v);
  }
  return w.build();
}

TEST(LoaderGguf, LlamaQkRowsAreUnpermuted) {
  Tiny t;
  TensorMap m = tiny_tensors(t, 9);
  test::TempDir dir("ld_gguf");
  test::write_file(dir.file("m.gguf"), gguf_model("llama", t, m, true));
  auto w = load_model(dir.file("m.gguf"));
  EXPECT_EQ(w->config.arch_string, "llama");
  expect_model_matches(*w, t, m);  // wq/wk equal the HF originals again
}

TEST(LoaderGguf, Qwen2IsNotPermuted) {
  Tiny t;
  t.arch = "Qwen2ForCausalLM";
  t.bias = true;
  t.tie = true;
  TensorMap m = tiny_tensors(t, 10);
  test::TempDir dir("ld_gguf_q2");
  test::write_file(dir.file("m.gguf"), gguf_model("qwen2", t, m, false));
  auto w = load_model(dir.file("m.gguf"));
  EXPECT_TRUE(w->config.tie_embeddings);
  expect_model_matches(*w, t, m);
}

TEST(LoaderGguf, QuantizedTensorsAreDequantized) {
  Tiny t;
  t.tie = true;
  TensorMap m = tiny_tensors(t, 11);
  test::GgufWriter w;
  w.kv_str("general.architecture", "qwen3");
  w.kv_u32("qwen3.block_count", uint32_t(t.L));
  w.kv_u32("qwen3.embedding_length", uint32_t(t.H));
  w.kv_u32("qwen3.attention.head_count", uint32_t(t.Hq));
  w.kv_u32("qwen3.attention.head_count_kv", uint32_t(t.Hkv));
  w.kv_u32("qwen3.feed_forward_length", uint32_t(t.F));
  w.kv_u32("qwen3.context_length", 512);
  w.kv_u32("qwen3.vocab_size", uint32_t(t.V));
  std::mt19937 rng(12);
  std::map<std::string, std::vector<uint8_t>> raw;
  for (int l = 0; l < t.L; ++l) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    m[p + "self_attn.q_norm.weight"] = {{t.D}, std::vector<float>(size_t(t.D), 1.f)};
    m[p + "self_attn.k_norm.weight"] = {{t.D}, std::vector<float>(size_t(t.D), 2.f)};
  }
  for (auto& [name, x] : m) {
    if (name.find("mlp.") == std::string::npos) {
      std::vector<uint64_t> ne(x.shape.rbegin(), x.shape.rend());
      w.tensor_f32(gguf_name(name), ne, x.v);
      continue;
    }
    // Q8_0 blocks with random codes and scale d = 1/64 (f16 0x2400).
    int64_t blocks = int64_t(x.v.size()) / 32;
    std::vector<uint8_t> b;
    for (int64_t k = 0; k < blocks; ++k) {
      b.push_back(0x00);
      b.push_back(0x24);
      for (int j = 0; j < 32; ++j) b.push_back(uint8_t(rng()));
    }
    dequantize_serial(DType::Q8_0, b.data(), x.v.data(), int64_t(x.v.size()));
    for (int j = 0; j < 32; ++j)  // spot-check against the definition
      ASSERT_EQ(x.v[size_t(j)], float(int8_t(b[size_t(2 + j)])) / 64.f);
    test::GgufTensorSpec s{gguf_name(name), {uint64_t(x.shape[1]), uint64_t(x.shape[0])}, 8, b, {}, {}};
    w.tensor(s);
  }
  t.qk_norm = true;
  test::TempDir dir("ld_gguf_q8");
  test::write_file(dir.file("m.gguf"), w.build());
  auto wt = load_model(dir.file("m.gguf"));
  expect_model_matches(*wt, t, m);
}

TEST(LoaderGguf, ShapeErrorNamesGgufTensor) {
  Tiny t;
  TensorMap m = tiny_tensors(t, 13);
  m["model.layers.1.mlp.down_proj.weight"].shape = {t.F, t.H};  // transposed
  test::TempDir dir("ld_gguf_bad");
  test::write_file(dir.file("m.gguf"), gguf_model("llama", t, m, true));
  std::string e = load_error(dir.file("m.gguf"));
  EXPECT_NE(e.find("'blk.1.ffn_down.weight'"), std::string::npos) << e;
  EXPECT_NE(e.find("[96, 64]"), std::string::npos) << e;
  EXPECT_NE(e.find("expected [64, 96]"), std::string::npos) << e;
}

TEST(Inspect, DescribesHfAndGguf) {
  Tiny t;
  TensorMap m = tiny_tensors(t, 14);
  test::TempDir dir("inspect");
  write_hf_dir(dir.path(), t, m);
  std::string d = describe_model(dir.path());
  EXPECT_NE(d.find("safetensors"), std::string::npos) << d;
  EXPECT_NE(d.find("LlamaForCausalLM"), std::string::npos) << d;
  EXPECT_NE(d.find("model.layers.1.mlp.down_proj.weight"), std::string::npos) << d;
  EXPECT_NE(d.find("BF16 [64, 96]"), std::string::npos) << d;
  int64_t total = 0;
  for (const auto& [name, x] : m) total += int64_t(x.v.size());
  ASSERT_EQ(total, 74560);  // 2 x 6400 (embed, head) + 2 layers x 30848 + 64
  EXPECT_NE(d.find("parameters:        74,560"), std::string::npos) << d;

  test::write_file(dir.file("m.gguf"), gguf_model("llama", t, m, true));
  std::string g = describe_model(dir.file("m.gguf"));
  EXPECT_NE(g.find("GGUF v3"), std::string::npos) << g;
  EXPECT_NE(g.find("blk.0.attn_q.weight"), std::string::npos) << g;
  EXPECT_NE(g.find("f32 [64, 64]"), std::string::npos) << g;
  EXPECT_NE(g.find("context length:    512"), std::string::npos) << g;
}

// --- The real default model ----------------------------------------------------------

const char* kSmol = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

std::string smol_path() { return std::string(SPADE_SOURCE_DIR) + "/" + kSmol; }

TEST(RealModel, SmolLM2MetadataAndLoad) {
  if (!std::filesystem::exists(smol_path()))
    GTEST_SKIP() << kSmol << " not present; fetch it with `bash scripts/fetch_model.sh`";
  auto g = GgufFile::open(smol_path());
  EXPECT_EQ(g->version(), 3u);
  EXPECT_EQ(g->tensors().size(), 272u);
  EXPECT_EQ(g->get_string("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(g->get_string("tokenizer.ggml.pre"), "smollm");
  EXPECT_EQ(g->find_tensor("token_embd.weight")->type_name(), "q8_0");
  EXPECT_EQ(g->find_tensor("blk.0.attn_q.weight")->type_name(), "q4_1");

  auto w = load_model(smol_path());
  const ModelConfig& c = w->config;
  EXPECT_EQ(c.arch, Arch::Llama);
  EXPECT_EQ(c.n_layers, 30);
  EXPECT_EQ(c.hidden, 576);
  EXPECT_EQ(c.n_heads, 9);
  EXPECT_EQ(c.n_kv_heads, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.ffn, 1536);
  EXPECT_EQ(c.vocab, 49152);
  EXPECT_EQ(c.max_context, 8192);
  EXPECT_FLOAT_EQ(c.rope_theta, 100000.f);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-5f);
  EXPECT_EQ(c.bos_token, 1);
  EXPECT_EQ(c.eos_token, 2);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_EQ(w->lm_head.numel(), 0);
  EXPECT_EQ(w->parameter_count(), 134515008);

  // Values from gguf-py's dequantizer (q/k rows after the inverse of the converter's
  // permutation, computed with numpy); f32 compare with 1e-6 relative tolerance.
  auto near = [](float got, double want) { EXPECT_NEAR(got, want, 1e-6 * std::fabs(want) + 1e-9); };
  const float* e = w->tok_embeddings.data();
  near(e[0], -0.10654449462890625);
  near(e[3], -0.022830963134765625);
  near(e[1234 * 576 + 100], -0.50384521484375);
  near(e[49151 * 576 + 575], -0.0417022705078125);
  const float* q = w->layers[0].wq.data();
  near(q[1 * 576 + 0], -0.1591796875);
  near(q[1 * 576 + 1], 0.39794921875);
  near(q[32 * 576 + 2], -0.19281005859375);
  near(q[575 * 576 + 575], -0.255859375);
  const float* k = w->layers[0].wk.data();
  near(k[1 * 576 + 0], 0.203369140625);
  near(k[191 * 576 + 574], 0.1881103515625);
  const float* dn = w->layers[29].w_down.data();
  near(dn[0], -0.2733154296875);
  near(dn[575 * 1536 + 1535], 0.056640625);
  near(w->final_norm.data()[1], 1.8203125);
  near(w->layers[0].attn_norm.data()[2], -0.019775390625);

  std::string d = describe_model(smol_path());
  EXPECT_NE(d.find("134,515,008"), std::string::npos) << d;
  EXPECT_NE(d.find("token_embd.weight"), std::string::npos);
}

}  // namespace
}  // namespace spade
