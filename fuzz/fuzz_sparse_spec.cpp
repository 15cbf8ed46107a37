// libFuzzer: sparse-method options from untrusted input (a server request's "sparse" field,
// --sparse-opt). The input up to the first newline is a spec "name:k=v,k=v"
// (SparseConfig::parse_spec), the rest a JSON object (SparseConfig::merge_json); each, and the
// JSON merged over the spec, goes through reject_local_only_options (as the server does) and
// make_method for two models. spade::Error is the expected outcome for bad input; a crash, a
// sanitizer report or any other exception escaping is a bug. No model and no attention run:
// only what make_method and new_state() build, sized by the options.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "sparse/methods/blasst.h"
#include "sparse/registry.h"

using namespace spade;

namespace {

ModelConfig model(int layers, int hidden, int heads, int kv_heads, int head_dim) {
  ModelConfig c;
  c.arch = Arch::Llama;
  c.n_layers = layers;
  c.hidden = hidden;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.max_context = 8192;
  return c;
}

const ModelConfig kModels[] = {
    model(30, 576, 9, 3, 64),      // SmolLM2-135M
    model(32, 4096, 32, 8, 128),   // Llama-3-8B
};

void require(bool ok) {
  if (!ok) std::abort();
}

void build(const sparse::SparseConfig& cfg) {
  try {
    sparse::reject_local_only_options(cfg);  // the server's check: no file is ever read
  } catch (const Error&) {
    return;
  }
  for (const ModelConfig& m : kModels) {
    try {
      auto method = sparse::make_method(cfg, m);
      require(method && !method->describe().empty());
      method->new_state();
      if (const auto* b = sparse::as_blasst(*method)) {
        const auto& p = b->params();
        auto tile_ok = [](int64_t t) { return t >= 1 && t <= sparse::kMaxTile; };
        require(tile_ok(p.tile) && tile_ok(p.prefill_tile) && tile_ok(p.q_block));
        require(p.lambda <= 1);
      }
    } catch (const Error&) {
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 4096) return 0;
  const std::string in(reinterpret_cast<const char*>(data), size);
  const size_t nl = in.find('\n');
  const std::string spec = in.substr(0, nl);
  const std::string json = nl == std::string::npos ? std::string() : in.substr(nl + 1);
  sparse::SparseConfig from_spec;
  bool have_spec = false;
  try {
    from_spec = sparse::SparseConfig::parse_spec(spec);
    have_spec = true;
    build(from_spec);
  } catch (const Error&) {
  }
  if (json.empty()) return 0;
  try {
    sparse::SparseConfig c;
    c.merge_json(json, "fuzz");
    build(c);
  } catch (const Error&) {
  }
  if (!have_spec) return 0;
  try {
    from_spec.merge_json(json, "fuzz");  // a config file's values over the flags' method
    build(from_spec);
  } catch (const Error&) {
  }
  return 0;
}
