// Tensor-parallel weight slices (shard.h): row slices and column slices of fp32 tensors and of
// matrices kept as stored.
#include "dist/shard.h"

#include <cstring>

#include "core/error.h"

namespace spade::dist {

namespace {

// rows [r0, r0 + n) of a row-major [rows, cols] tensor (empty stays empty).
HostTensor slice_rows(const HostTensor& t, int64_t rows, int64_t cols, int64_t r0, int64_t n,
                      const std::string& name) {
  if (!t.numel()) return {};
  SPADE_CHECK(t.numel() == rows * cols, "sharding ", name, ": ", t.numel(),
              " elements, expected ", rows, " x ", cols);
  HostTensor s = cols == 1 ? HostTensor({n}) : HostTensor({n, cols});
  std::memcpy(s.data(), t.data() + r0 * cols, sizeof(float) * size_t(n * cols));
  return s;
}

// columns [c0, c0 + n) of a row-major [rows, cols] tensor.
HostTensor slice_cols(const HostTensor& t, int64_t rows, int64_t cols, int64_t c0, int64_t n,
                      const std::string& name) {
  if (!t.numel()) return {};
  SPADE_CHECK(t.numel() == rows * cols, "sharding ", name, ": ", t.numel(),
              " elements, expected ", rows, " x ", cols);
  HostTensor s({rows, n});
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(s.data() + r * n, t.data() + r * cols + c0, sizeof(float) * size_t(n));
  return s;
}

HostTensor copy(const HostTensor& t) {
  if (!t.numel()) return {};
  HostTensor s({t.numel()});
  std::memcpy(s.data(), t.data(), sizeof(float) * size_t(t.numel()));
  s.view = t.view;  // the source's shape
  s.view.data = s.data();
  return s;
}

// Slices of matrices as stored, copied into `out.owned`.
struct StoredSlicer {
  ModelWeights& out;

  cpu::QuantMatrix keep(std::vector<uint8_t> bytes, DType t, int64_t rows, int64_t cols) {
    out.owned.push_back(std::move(bytes));  // the buffer moves, its address stays
    return cpu::QuantMatrix{t, out.owned.back().data(), rows, cols};
  }

  cpu::QuantMatrix rows(const cpu::QuantMatrix& q, int64_t r0, int64_t n) {
    if (!q) return {};
    SPADE_CHECK(r0 >= 0 && r0 + n <= q.rows, "sharding: rows ", r0, "..", r0 + n, " of a stored ",
                q.rows, "-row matrix");
    const int64_t rb = q.row_bytes();
    std::vector<uint8_t> b(size_t(n * rb));
    std::memcpy(b.data(), q.row(r0), b.size());
    return keep(std::move(b), q.dtype, n, q.cols);
  }

  cpu::QuantMatrix cols(const cpu::QuantMatrix& q, int64_t c0, int64_t n, int n_ranks,
                        const std::string& name) {
    if (!q) return {};
    SPADE_CHECK(c0 >= 0 && c0 + n <= q.cols, "sharding ", name, ": columns ", c0, "..", c0 + n,
                " of ", q.cols);
    const DTypeInfo& i = dtype_info(q.dtype);
    SPADE_CHECK(c0 % i.block_elems == 0 && n % i.block_elems == 0, "--tp ", n_ranks, ": ", name,
                " is stored as ", i.name, " in blocks of ", i.block_elems,
                " columns, and its split into ", n, " columns per rank does not fall on them; "
                "load the weights as fp32 (--cpu-weights f32)");
    const int64_t rb = q.row_bytes(), off = int64_t(dtype_bytes(q.dtype, size_t(c0))),
                  nb = int64_t(dtype_bytes(q.dtype, size_t(n)));
    std::vector<uint8_t> b(size_t(q.rows * nb));
    for (int64_t r = 0; r < q.rows; ++r)
      std::memcpy(b.data() + r * nb, static_cast<const uint8_t*>(q.data) + r * rb + off, size_t(nb));
    return keep(std::move(b), q.dtype, q.rows, n);
  }

  // Replicated: a stored matrix in the mapped file (kept alive by `storage`) is shared; one in
  // the source's own buffers is copied.
  cpu::QuantMatrix replicate(const cpu::QuantMatrix& q, const ModelWeights& src) {
    if (!q) return {};
    const auto* p = static_cast<const uint8_t*>(q.data);
    for (const std::vector<uint8_t>& b : src.owned)
      if (p >= b.data() && p < b.data() + b.size()) return rows(q, 0, q.rows);
    return q;
  }
};

}  // namespace

void check_shardable(const ModelConfig& c, int n) {
  SPADE_CHECK(n >= 1, "--tp must be at least 1, got ", n);
  SPADE_CHECK(c.n_kv_heads % n == 0, "--tp ", n, ": ", c.n_kv_heads,
              " KV heads are not divisible by ", n);
  SPADE_CHECK(c.n_heads % n == 0, "--tp ", n, ": ", c.n_heads,
              " attention heads are not divisible by ", n);
  SPADE_CHECK(c.ffn % n == 0, "--tp ", n, ": the feed-forward size ", c.ffn,
              " is not divisible by ", n);
}

ModelWeights shard_weights(const ModelWeights& w, int rank, int n) {
  const ModelConfig& c = w.config;
  check_shardable(c, n);
  SPADE_CHECK(rank >= 0 && rank < n, "--tp ", n, ": rank ", rank, " is outside [0, ", n, ")");
  SPADE_CHECK(int(w.layers.size()) == c.n_layers, "sharding: ", w.layers.size(),
              " layers, the config says ", c.n_layers);
  const int64_t H = c.hidden, D = c.head_dim, Hq = c.n_heads, Hkv = c.n_kv_heads, F = c.ffn;
  const int64_t hq = Hq / n, hkv = Hkv / n, f = c.ffn / n;
  // Rank r: KV heads [r hkv, (r+1) hkv) and the query heads of their groups, contiguous in HF
  // order (query head h reads KV head h / group).
  const int64_t q0 = rank * hq * D, kv0 = rank * hkv * D, f0 = rank * f;

  ModelWeights s;
  s.config = c;
  s.config.n_heads = int(hq);
  s.config.n_kv_heads = int(hkv);
  s.config.ffn = int(f);
  s.source = w.source;
  s.storage = w.storage;
  StoredSlicer st{s};
  s.tok_embeddings = copy(w.tok_embeddings);
  s.final_norm = copy(w.final_norm);
  s.lm_head = copy(w.lm_head);
  s.q_tok_embeddings = st.replicate(w.q_tok_embeddings, w);
  s.q_lm_head = st.replicate(w.q_lm_head, w);
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = w.layers[size_t(l)];
    const std::string at = cat("layer ", l, " ");
    LayerWeights o;
    o.attn_norm = copy(L.attn_norm);
    o.ffn_norm = copy(L.ffn_norm);
    o.q_norm = copy(L.q_norm);  // per head_dim: the same for every head
    o.k_norm = copy(L.k_norm);
    o.wq = slice_rows(L.wq, Hq * D, H, q0, hq * D, at + "q_proj");
    o.wk = slice_rows(L.wk, Hkv * D, H, kv0, hkv * D, at + "k_proj");
    o.wv = slice_rows(L.wv, Hkv * D, H, kv0, hkv * D, at + "v_proj");
    o.bq = slice_rows(L.bq, Hq * D, 1, q0, hq * D, at + "q_proj bias");
    o.bk = slice_rows(L.bk, Hkv * D, 1, kv0, hkv * D, at + "k_proj bias");
    o.bv = slice_rows(L.bv, Hkv * D, 1, kv0, hkv * D, at + "v_proj bias");
    o.wo = slice_cols(L.wo, H, Hq * D, q0, hq * D, at + "o_proj");
    o.w_gate = slice_rows(L.w_gate, F, H, f0, f, at + "gate_proj");
    o.w_up = slice_rows(L.w_up, F, H, f0, f, at + "up_proj");
    o.w_down = slice_cols(L.w_down, H, F, f0, f, at + "down_proj");
    o.qwq = st.rows(L.qwq, q0, hq * D);
    o.qwk = st.rows(L.qwk, kv0, hkv * D);
    o.qwv = st.rows(L.qwv, kv0, hkv * D);
    o.qwo = st.cols(L.qwo, q0, hq * D, n, at + "o_proj");
    o.qw_gate = st.rows(L.qw_gate, f0, f);
    o.qw_up = st.rows(L.qw_up, f0, f);
    o.qw_down = st.cols(L.qw_down, f0, f, n, at + "down_proj");
    s.layers.push_back(std::move(o));
  }
  return s;
}

}  // namespace spade::dist
