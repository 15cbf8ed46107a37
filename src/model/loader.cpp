#include "model/loader.h"

#include <vector>

#include "core/error.h"
#include "io/dequant.h"
#include "model/rope_permute.h"
#include "model/tensor_source.h"

namespace spade {

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

class Loader {
 public:
  explicit Loader(const TensorSource& src) : src_(src) {}

  // The tensor for `role` as fp32, after checking its shape; an empty tensor when it is
  // absent and not `required`.
  HostTensor load(WeightRole role, int layer, std::vector<int64_t> want, bool required = true) {
    std::string name = src_.name_of(role, layer);
    const SourceTensor* t = src_.find(name);
    if (!t) {
      if (!required) return {};
      fail(src_.path(), ": missing tensor '", name, "' (expected shape ", shape_str(want), ")");
    }
    if (t->shape != want)
      fail(src_.path(), ": tensor '", name, "' has shape ", shape_str(t->shape), ", expected ",
           shape_str(want), " from the model config");
    if (!t->readable)
      fail(src_.path(), ": tensor '", name, "' has type ", t->type,
           ", which spade cannot convert to fp32");
    HostTensor h = want.size() == 1 ? HostTensor({want[0]}) : HostTensor({want[0], want[1]});
    dequantize(t->dtype, t->data, h.data(), h.numel());
    return h;
  }

 private:
  const TensorSource& src_;
};

}  // namespace

std::unique_ptr<ModelWeights> load_model(const std::string& path) {
  std::unique_ptr<TensorSource> src = TensorSource::open(path);
  const ModelConfig& c = src->config();
  auto w = std::make_unique<ModelWeights>();
  w->config = c;
  w->source = src->path();

  const int64_t H = c.hidden, D = c.head_dim, V = c.vocab, F = c.ffn;
  const int64_t QD = int64_t(c.n_heads) * D, KD = int64_t(c.n_kv_heads) * D;
  // GGUF "llama" q/k rows are in interleaved-RoPE order (see rope_permute.h).
  const bool unpermute = src->format() == TensorSource::Format::Gguf && c.arch_string == "llama";

  Loader ld(*src);
  w->tok_embeddings = ld.load(WeightRole::Embed, 0, {V, H});
  w->layers.resize(size_t(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeights& L = w->layers[size_t(l)];
    L.attn_norm = ld.load(WeightRole::AttnNorm, l, {H});
    L.wq = ld.load(WeightRole::Q, l, {QD, H});
    L.wk = ld.load(WeightRole::K, l, {KD, H});
    L.wv = ld.load(WeightRole::V, l, {KD, H});
    L.wo = ld.load(WeightRole::O, l, {H, QD});
    if (c.qkv_bias) {
      L.bq = ld.load(WeightRole::QBias, l, {QD});
      L.bk = ld.load(WeightRole::KBias, l, {KD});
      L.bv = ld.load(WeightRole::VBias, l, {KD});
    }
    if (c.qk_norm) {
      L.q_norm = ld.load(WeightRole::QNorm, l, {D});
      L.k_norm = ld.load(WeightRole::KNorm, l, {D});
    }
    L.ffn_norm = ld.load(WeightRole::FfnNorm, l, {H});
    L.w_gate = ld.load(WeightRole::Gate, l, {F, H});
    L.w_up = ld.load(WeightRole::Up, l, {F, H});
    L.w_down = ld.load(WeightRole::Down, l, {H, F});
    if (unpermute) {
      unpermute_rope_rows(L.wq.data(), c.n_heads, D, H);
      unpermute_rope_rows(L.wk.data(), c.n_kv_heads, D, H);
    }
  }
  w->final_norm = ld.load(WeightRole::FinalNorm, 0, {H});
  if (!c.tie_embeddings) w->lm_head = ld.load(WeightRole::LmHead, 0, {V, H});
  return w;
}

}  // namespace spade
