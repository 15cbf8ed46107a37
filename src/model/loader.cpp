#include "model/loader.h"

#include <cstring>
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
    const SourceTensor* t = check(role, layer, want, required);
    if (!t) return {};
    HostTensor h = want.size() == 1 ? HostTensor({want[0]}) : HostTensor({want[0], want[1]});
    dequantize(t->dtype, t->data, h.data(), h.numel());
    return h;
  }

  // The [rows, cols] weight for `role` as stored when its type is not fp32 (empty otherwise,
  // then the caller loads it as fp32).
  cpu::QuantMatrix stored(WeightRole role, int layer, std::vector<int64_t> want) {
    const SourceTensor* t = check(role, layer, want, true);
    if (t->dtype == DType::F32) return {};
    return cpu::QuantMatrix{t->dtype, t->data, want[0], want[1]};
  }

  // Whether any tensor of `role` (any layer) is block-quantized.
  bool quantized(WeightRole role, int layer) const {
    const SourceTensor* t = src_.find(src_.name_of(role, layer));
    return t && t->readable && dtype_info(t->dtype).block_elems > 1;
  }

 private:
  const SourceTensor* check(WeightRole role, int layer, const std::vector<int64_t>& want,
                            bool required) {
    std::string name = src_.name_of(role, layer);
    const SourceTensor* t = src_.find(name);
    if (!t) {
      if (!required) return nullptr;
      fail(src_.path(), ": missing tensor '", name, "' (expected shape ", shape_str(want), ")");
    }
    if (t->shape != want)
      fail(src_.path(), ": tensor '", name, "' has shape ", shape_str(t->shape), ", expected ",
           shape_str(want), " from the model config");
    if (!t->readable)
      fail(src_.path(), ": tensor '", name, "' has type ", t->type,
           ", which spade cannot convert to fp32");
    return t;
  }

  const TensorSource& src_;
};

// unpermute_rope_rows on a stored matrix: whole rows of bytes move, copied into `owned`.
cpu::QuantMatrix unpermute_stored(const cpu::QuantMatrix& q, int64_t n_heads, int64_t head_dim,
                                  std::vector<std::vector<uint8_t>>& owned) {
  SPADE_CHECK(head_dim % 2 == 0, "RoPE row permutation: head_dim ", head_dim, " is odd");
  const size_t rb = size_t(q.row_bytes());
  std::vector<uint8_t> out(rb * size_t(q.rows));
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < n_heads; ++h)
    for (int64_t i = 0; i < half; ++i)
      for (int64_t j = 0; j < 2; ++j)  // GGUF row h*D + 2i + j is HF row h*D + j*D/2 + i
        std::memcpy(out.data() + size_t(h * head_dim + j * half + i) * rb,
                    q.row(h * head_dim + 2 * i + j), rb);
  owned.push_back(std::move(out));
  return cpu::QuantMatrix{q.dtype, owned.back().data(), q.rows, q.cols};
}

}  // namespace

CpuWeights parse_cpu_weights(const std::string& s, const std::string& option) {
  if (s == "f32") return CpuWeights::F32;
  if (s == "native") return CpuWeights::Native;
  if (s == "auto") return CpuWeights::Auto;
  fail(option, " must be f32, native or auto, got '", s, "'");
}

std::unique_ptr<ModelWeights> load_model(const std::string& path, CpuWeights mode) {
  std::shared_ptr<TensorSource> src = TensorSource::open(path);
  const ModelConfig& c = src->config();
  auto w = std::make_unique<ModelWeights>();
  w->config = c;
  w->source = src->path();

  const int64_t H = c.hidden, D = c.head_dim, V = c.vocab, F = c.ffn;
  const int64_t QD = int64_t(c.n_heads) * D, KD = int64_t(c.n_kv_heads) * D;
  // GGUF "llama" q/k rows are in interleaved-RoPE order (see rope_permute.h).
  const bool unpermute = src->format() == TensorSource::Format::Gguf && c.arch_string == "llama";

  Loader ld(*src);
  if (mode == CpuWeights::Auto) {
    mode = CpuWeights::F32;
    for (int l = 0; l < c.n_layers && mode == CpuWeights::F32; ++l)
      for (WeightRole r : {WeightRole::Q, WeightRole::K, WeightRole::V, WeightRole::O,
                           WeightRole::Gate, WeightRole::Up, WeightRole::Down})
        if (ld.quantized(r, l)) mode = CpuWeights::Native;
  }
  const bool native = mode == CpuWeights::Native;
  // A [rows, cols] weight: as stored (native, non-fp32 type) or dequantized to fp32.
  auto linear = [&](HostTensor& f, cpu::QuantMatrix& q, WeightRole role, int layer, int64_t rows,
                    int64_t cols) {
    if (native) q = ld.stored(role, layer, {rows, cols});
    if (!q) f = ld.load(role, layer, {rows, cols});
  };
  linear(w->tok_embeddings, w->q_tok_embeddings, WeightRole::Embed, 0, V, H);
  w->layers.resize(size_t(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeights& L = w->layers[size_t(l)];
    L.attn_norm = ld.load(WeightRole::AttnNorm, l, {H});
    linear(L.wq, L.qwq, WeightRole::Q, l, QD, H);
    linear(L.wk, L.qwk, WeightRole::K, l, KD, H);
    linear(L.wv, L.qwv, WeightRole::V, l, KD, H);
    linear(L.wo, L.qwo, WeightRole::O, l, H, QD);
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
    linear(L.w_gate, L.qw_gate, WeightRole::Gate, l, F, H);
    linear(L.w_up, L.qw_up, WeightRole::Up, l, F, H);
    linear(L.w_down, L.qw_down, WeightRole::Down, l, H, F);
    if (unpermute) {
      if (L.qwq)
        L.qwq = unpermute_stored(L.qwq, c.n_heads, D, w->owned);
      else
        unpermute_rope_rows(L.wq.data(), c.n_heads, D, H);
      if (L.qwk)
        L.qwk = unpermute_stored(L.qwk, c.n_kv_heads, D, w->owned);
      else
        unpermute_rope_rows(L.wk.data(), c.n_kv_heads, D, H);
    }
  }
  w->final_norm = ld.load(WeightRole::FinalNorm, 0, {H});
  if (!c.tie_embeddings) linear(w->lm_head, w->q_lm_head, WeightRole::LmHead, 0, V, H);
  if (w->native()) w->storage = src;  // the stored weights point into its mapping
  return w;
}

}  // namespace spade
