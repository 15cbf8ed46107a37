#include "io/hf_config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/mmap_file.h"

namespace spade {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// The constructor defaults of transformers' config classes, used for absent keys.
struct ArchDefaults {
  const char* hf_name;
  Arch arch;
  int vocab, hidden, ffn, layers, heads;
  int kv_heads;  // used when the key is absent; an explicit null means "= heads"
  int head_dim;  // 0: hidden / heads
  int max_pos;
  int bos, eos;  // -1: none
};

const ArchDefaults kArchs[] = {
    {"LlamaForCausalLM", Arch::Llama, 32000, 4096, 11008, 32, 32, 0, 0, 2048, 1, 2},
    {"MistralForCausalLM", Arch::Mistral, 32000, 4096, 14336, 32, 32, 8, 0, 4096 * 32, 1, 2},
    {"Qwen2ForCausalLM", Arch::Qwen2, 151936, 4096, 22016, 32, 32, 32, 0, 32768, -1, -1},
    {"Qwen3ForCausalLM", Arch::Qwen3, 151936, 4096, 22016, 32, 32, 32, 128, 32768, -1, -1},
};

std::string supported_list() {
  std::string s;
  for (const ArchDefaults& a : kArchs) s += (s.empty() ? "" : ", ") + std::string(a.hf_name);
  return s;
}

class Reader {
 public:
  Reader(const json& j, const std::string& src) : j_(j), src_(src) {}

  bool has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }

  int integer(const char* key, int def) const {
    if (!has(key)) return def;
    const json& v = j_[key];
    if (!v.is_number_integer())
      fail(src_, ": '", key, "' must be an integer, found ", v.type_name());
    int64_t x = v.get<int64_t>();
    if (x < std::numeric_limits<int>::min() || x > std::numeric_limits<int>::max())
      fail(src_, ": '", key, "' = ", x, " is out of range");
    return int(x);
  }
  double number(const json& obj, const char* key, double def) const {
    if (!obj.contains(key) || obj[key].is_null()) return def;
    if (!obj[key].is_number())
      fail(src_, ": '", key, "' must be a number, found ", obj[key].type_name());
    return obj[key].get<double>();
  }
  double number(const char* key, double def) const { return number(j_, key, def); }
  bool boolean(const char* key, bool def) const {
    if (!has(key)) return def;
    if (!j_[key].is_boolean())
      fail(src_, ": '", key, "' must be true or false, found ", j_[key].type_name());
    return j_[key].get<bool>();
  }
  // Token ids may be an int, a list of ints, or null.
  std::vector<int> token_ids(const char* key, int def) const {
    if (!j_.contains(key)) return def >= 0 ? std::vector<int>{def} : std::vector<int>{};
    const json& v = j_[key];
    std::vector<int> out;
    if (v.is_null()) return out;
    auto one = [&](const json& e) {
      if (!e.is_number_integer() || e.get<int64_t>() < 0 ||
          e.get<int64_t>() > std::numeric_limits<int>::max())
        fail(src_, ": '", key, "' must hold non-negative integer token ids");
      out.push_back(int(e.get<int64_t>()));
    };
    if (v.is_array()) {
      for (const json& e : v) one(e);
    } else {
      one(v);
    }
    return out;
  }

 private:
  const json& j_;
  const std::string& src_;
};

void parse_rope_scaling(const json& rs, const Reader& r, ModelConfig& c,
                        const std::string& src) {
  if (rs.is_null()) return;
  if (!rs.is_object()) fail(src, ": 'rope_scaling' must be an object or null");
  std::string type;
  for (const char* k : {"rope_type", "type"}) {
    if (rs.contains(k) && rs[k].is_string()) {
      type = rs[k].get<std::string>();
      break;
    }
  }
  if (type.empty() || type == "default") return;
  RopeScaling& s = c.rope_scaling;
  if (type == "linear") {
    s.linear = true;
    s.factor = float(r.number(rs, "factor", 1.0));
  } else if (type == "llama3") {
    s.llama3 = true;
    s.factor = float(r.number(rs, "factor", 8.0));
    s.low_freq_factor = float(r.number(rs, "low_freq_factor", 1.0));
    s.high_freq_factor = float(r.number(rs, "high_freq_factor", 4.0));
    double orig = r.number(rs, "original_max_position_embeddings", 8192.0);
    if (!(orig >= 1 && orig <= 1e9)) fail(src, ": rope_scaling original_max_position_embeddings ",
                                          orig, " is out of range");
    s.original_max_position = int(orig);
    if (!(s.high_freq_factor > s.low_freq_factor))
      fail(src, ": rope_scaling high_freq_factor (", s.high_freq_factor,
           ") must exceed low_freq_factor (", s.low_freq_factor, ")");
  } else {
    fail(src, ": rope_scaling type '", type,
         "' is not supported (supported: default, linear, llama3)");
  }
  if (!(s.factor > 0) || !std::isfinite(s.factor))
    fail(src, ": rope_scaling factor ", s.factor, " must be positive");
}

std::string read_text(const std::string& path) { return read_regular_file(path); }

}  // namespace

ModelConfig parse_hf_config(const std::string& json_text, const std::string& source) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    fail(source, ": not valid JSON: ", e.what());
  }
  if (!j.is_object()) fail(source, ": config must be a JSON object");

  std::string arch_str;
  if (j.contains("architectures") && j["architectures"].is_array() &&
      !j["architectures"].empty() && j["architectures"][0].is_string())
    arch_str = j["architectures"][0].get<std::string>();
  if (arch_str.empty())
    fail(source, ": no 'architectures' entry (supported: ", supported_list(), ")");
  const ArchDefaults* ad = nullptr;
  for (const ArchDefaults& a : kArchs)
    if (arch_str == a.hf_name) ad = &a;
  if (!ad)
    fail(source, ": architecture '", arch_str, "' is not supported (supported: ",
         supported_list(), ")");

  Reader r(j, source);
  ModelConfig c;
  c.arch = ad->arch;
  c.arch_string = arch_str;
  c.vocab = r.integer("vocab_size", ad->vocab);
  c.hidden = r.integer("hidden_size", ad->hidden);
  c.ffn = r.integer("intermediate_size", ad->ffn);
  c.n_layers = r.integer("num_hidden_layers", ad->layers);
  c.n_heads = r.integer("num_attention_heads", ad->heads);
  // transformers: an absent key takes the class default, an explicit null means MHA.
  int kv_default = j.contains("num_key_value_heads") || ad->kv_heads == 0 ? c.n_heads
                                                                          : ad->kv_heads;
  c.n_kv_heads = r.integer("num_key_value_heads", kv_default);
  int hd_default = ad->head_dim ? ad->head_dim : (c.n_heads > 0 ? c.hidden / c.n_heads : 0);
  c.head_dim = r.integer("head_dim", hd_default);
  c.max_context = r.integer("max_position_embeddings", ad->max_pos);
  c.rms_eps = float(r.number("rms_norm_eps", 1e-6));
  c.tie_embeddings = r.boolean("tie_word_embeddings", false);

  // Newer transformers nest RoPE settings in "rope_parameters".
  const json* rope = j.contains("rope_parameters") && j["rope_parameters"].is_object()
                         ? &j["rope_parameters"]
                         : nullptr;
  c.rope_theta = float(r.number(rope ? *rope : j, "rope_theta", r.number("rope_theta", 10000.0)));
  if (rope)
    parse_rope_scaling(*rope, r, c, source);
  else if (j.contains("rope_scaling"))
    parse_rope_scaling(j["rope_scaling"], r, c, source);

  c.qkv_bias = c.arch == Arch::Qwen2;
  c.qk_norm = c.arch == Arch::Qwen3;
  if (c.arch != Arch::Qwen2 && r.boolean("attention_bias", false))
    fail(source, ": attention_bias=true (bias on q/k/v/o projections) is not supported for ",
         arch_str);
  if (r.boolean("mlp_bias", false)) fail(source, ": mlp_bias=true is not supported");
  if (j.contains("hidden_act") && j["hidden_act"] != "silu")
    fail(source, ": hidden_act ", j["hidden_act"].dump(), " is not supported (only silu)");
  if (c.arch == Arch::Qwen2 || c.arch == Arch::Qwen3) {
    if (r.boolean("use_sliding_window", false))
      fail(source, ": use_sliding_window=true is not supported");
  }
  // Mistral's sliding window equals full attention up to the window length: cap the
  // context there rather than silently attend beyond it.
  if (c.arch == Arch::Mistral && r.has("sliding_window")) {
    int w = r.integer("sliding_window", 0);
    if (w > 0 && w < c.max_context) c.max_context = w;
  }

  std::vector<int> bos = r.token_ids("bos_token_id", ad->bos);
  std::vector<int> eos = r.token_ids("eos_token_id", ad->eos);
  if (!bos.empty()) c.bos_token = bos[0];
  if (!eos.empty()) {
    c.eos_token = eos[0];
    c.extra_eos_tokens.assign(eos.begin() + 1, eos.end());
  }
  c.validate(source);
  return c;
}

ModelConfig load_hf_config(const std::string& path) {
  bool is_dir = fs::is_directory(path);
  std::string cfg = is_dir ? (fs::path(path) / "config.json").string() : path;
  if (is_dir && !fs::exists(cfg)) fail("'", path, "' has no config.json");
  ModelConfig c = parse_hf_config(read_text(cfg), cfg);

  // generation_config.json may list more end-of-turn tokens (Llama 3 instruct models).
  fs::path gen = fs::path(cfg).parent_path() / "generation_config.json";
  if (fs::exists(gen)) {
    json g;
    try {
      g = json::parse(read_text(gen.string()));
    } catch (const json::exception& e) {
      fail(gen.string(), ": not valid JSON: ", e.what());
    }
    if (g.is_object() && g.contains("eos_token_id")) {
      std::vector<int> ids = Reader(g, gen.string()).token_ids("eos_token_id", -1);
      for (int id : ids) {
        if (c.eos_token < 0) {
          c.eos_token = id;
        } else if (id != c.eos_token &&
                   std::find(c.extra_eos_tokens.begin(), c.extra_eos_tokens.end(), id) ==
                       c.extra_eos_tokens.end()) {
          c.extra_eos_tokens.push_back(id);
        }
      }
    }
  }
  return c;
}

}  // namespace spade
