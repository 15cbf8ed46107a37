// See cuda_model.h. Per layer and step (T new tokens, bf16 weights W_*):
//   xn = rmsnorm(x)                      | qkv = xn Wqkv^T (fp32)
//   q, K/V append = qkv_post(qkv)        | att = attention(q, paged K/V)
//   x += att Wo^T  (GEMM epilogue)       | xn = rmsnorm(x)
//   gu = xn Wgu^T (gate|up, fp32)        | h = silu(gate) * up (bf16)
//   x += h Wdown^T (GEMM epilogue)
// Decode steps on the GEMV (T <= Gemm::small_m()): qkv + qkv_post and gate|up + SwiGLU are one
// launch each (gemv_qkv_post, gemv_swiglu; CudaModelOptions::fused_gemv), with the same values.
// Decode bytes per step (batch 1): all weights once (2 bytes/param) + K/V of the context;
// that sum over the measured HBM bandwidth is the floor the TPOT benchmark compares with.
#if defined(SPADE_HAVE_CUDA)
#include "model/cuda_model.h"
#include "core/tuning.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "backend/cpu/ops.h"
#include "backend/cuda/attention.h"
#include "backend/cuda/cluster_index.h"
#include "backend/cuda/cuda_common.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/ops.h"
#include "backend/cuda/sampling.h"
#include "backend/cuda/sparse_attention.h"
#include "backend/cuda/twilight.h"
#include "core/half.h"
#include "dist/device_collectives.h"
#include "kv/fp8_e4m3.h"
#include "kv/key_rotation.h"

namespace spade {

using cuda::bf16;

namespace {
int fused_gemv_mask(const CudaModelOptions& opt) {
  return tuning().fused_gemv >= 0 ? tuning().fused_gemv : opt.fused_gemv;
}
}  // namespace

struct CudaModel::Layer {
  float* attn_norm = nullptr;
  float* ffn_norm = nullptr;
  float* q_norm = nullptr;
  float* k_norm = nullptr;
  float* bqkv = nullptr;
  bf16* wqkv = nullptr;  // [(Hq + 2Hkv) D, H]
  bf16* wo = nullptr;    // [H, Hq D]
  bf16* wgu = nullptr;   // [2F, H]
  bf16* wdown = nullptr; // [H, F]
};

namespace {

cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }

void upload_bf16(bf16* dst, const float* src, size_t n) {
  std::vector<uint16_t> tmp(n);
  for (size_t i = 0; i < n; ++i) tmp[i] = f32_to_bf16(src[i]);
  SPADE_CUDA(cudaMemcpy(dst, tmp.data(), n * 2, cudaMemcpyHostToDevice));
}
void upload_f32(float* dst, const float* src, size_t n) {
  SPADE_CUDA(cudaMemcpy(dst, src, n * 4, cudaMemcpyHostToDevice));
}

}  // namespace

CudaModel::CudaModel(const ModelWeights& w, const CudaModelOptions& opt)
    : cfg_(w.config), opt_(opt), fused_gemv_(fused_gemv_mask(opt)) {
  init(&w, 0);
}

CudaModel::CudaModel(const ModelConfig& c, const CudaModelOptions& opt, uint64_t seed)
    : cfg_(c), opt_(opt), fused_gemv_(fused_gemv_mask(opt)) {
  init(nullptr, seed);
}

void CudaModel::drop_graphs() {
  for (auto& [k, g] : graphs_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(g.exec));
  graphs_.clear();
  graph_class_last_.clear();
}

void CudaModel::evict_lru_graph() {
  auto lru = graphs_.begin();
  for (auto it = graphs_.begin(); it != graphs_.end(); ++it)
    if (it->second.used < lru->second.used) lru = it;
  if (lru == graphs_.end()) return;
  // A class whose latest graph this is keeps no update base (the next capture instantiates).
  for (auto c = graph_class_last_.begin(); c != graph_class_last_.end();)
    c = c->second == lru->first ? graph_class_last_.erase(c) : std::next(c);
  cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(lru->second.exec));
  graphs_.erase(lru);
}

void CudaModel::log_capture(const std::vector<int>& key) {
  if (opt_.graph_log) opt_.graph_log->push_back(key);
  if (!graph_log_file_) return;
  for (size_t i = 0; i < key.size(); ++i) std::fprintf(graph_log_file_, i ? " %d" : "%d", key[i]);
  std::fputc('\n', graph_log_file_);
  std::fflush(graph_log_file_);
}

CudaModel::~CudaModel() {
  drop_graphs();
  if (graph_log_file_) std::fclose(graph_log_file_);
  if (ev0_) cudaEventDestroy(static_cast<cudaEvent_t>(ev0_));
  if (ev1_) cudaEventDestroy(static_cast<cudaEvent_t>(ev1_));
  if (ev_lanes_) cudaEventDestroy(static_cast<cudaEvent_t>(ev_lanes_));
  if (tok_host_) cudaFreeHost(tok_host_);
  if (sampled_host_) cudaFreeHost(sampled_host_);
  if (rows_host_) cudaFreeHost(rows_host_);
  if (upd_host_) cudaFreeHost(upd_host_);
  methods_.clear();
  gemm_.reset();
  arena_.reset();
  if (stream_) cudaStreamDestroy(S_(stream_));
}

size_t CudaModel::arena_bytes() const { return arena_ ? arena_->capacity() : 0; }

bool CudaModel::decode_draws_chunks() const {
  for (const auto& m : methods_)
    if (m && m->draws_chunks()) return true;
  return false;
}

GpuMethodContext CudaModel::method_context() const {
  GpuMethodContext x;
  x.cfg = cfg_;
  x.page_size = opt_.page_size;
  x.max_batch = opt_.max_batch;
  x.n_pages = n_pages_;
  x.kv_layer_elems = int64_t(kv_layer_elems());
  x.k_cache = k_cache_;  // null while only sizing (before the KV pool exists)
  x.seq_pages_cap = seq_pages_cap_;
  x.max_step_tokens = opt_.max_step_tokens;
  x.deterministic = opt_.deterministic;
  x.stream = stream_;
  x.hooks = hooks_;
  x.kv_fp8 = fp8_;
  x.kv_scales = kv_scales_dev_;
  x.k_wide = k_wide_;
  x.v_wide = v_wide_;
  if (opt_.tp && opt_.tp->size() > 1) {
    x.tp = opt_.tp;
    x.tp_hq0 = opt_.tp_kv0 * (cfg_.n_heads / cfg_.n_kv_heads);
    x.tp_Hq_all = opt_.tp_model.n_layers > 0 ? opt_.tp_model.n_heads : cfg_.n_heads;
  }
  return x;
}

void CudaModel::init(const ModelWeights* w, uint64_t seed) {
  const ModelConfig& c = cfg_;
  // Tensor parallelism: the own method was parsed for the whole model; its per-head tables
  // are the rank's slice from here on.
  if (opt_.tp_model.n_layers > 0) opt_.sparse = shard_spec(opt_.sparse, opt_.tp_kv0, c.n_kv_heads);
  SPADE_CHECK(cuda::device_available(), "--device cuda: no CUDA device is available");
  cuda::check_device_supported();
  SPADE_CHECK(opt_.max_graphs >= 1, "CudaModelOptions::max_graphs must be >= 1, got ", opt_.max_graphs);
  if (tuning().graph_min_uses > 0) opt_.graph_min_uses = tuning().graph_min_uses;
  SPADE_CHECK(opt_.graph_min_uses >= 1, "CudaModelOptions::graph_min_uses must be >= 1, got ",
              opt_.graph_min_uses);
  if (!tuning().graph_log.empty()) {
    graph_log_file_ = std::fopen(tuning().graph_log.c_str(), "a");
    SPADE_CHECK(graph_log_file_, "SPADE_GRAPH_LOG: cannot open '", tuning().graph_log, "' for appending");
  }
  SPADE_CHECK(c.head_dim == 64 || c.head_dim == 128, "CUDA backend: head_dim ", c.head_dim,
              " is not supported (64 and 128 are)");
  SPADE_CHECK(opt_.kv_dtype == KvDtype::BF16 || opt_.kv_dtype == KvDtype::FP8,
              "--device cuda: KV cache type ", kv_dtype_name(opt_.kv_dtype),
              " (the GPU cache is bf16 or fp8)");
  fp8_ = opt_.kv_dtype == KvDtype::FP8;
  SPADE_CHECK(!fp8_ || opt_.kv_scale == 0.f ||
                  (opt_.kv_scale >= kFp8ScaleMin && opt_.kv_scale <= kFp8ScaleMax &&
                   fp8_pow2_ceil(opt_.kv_scale) == opt_.kv_scale),
              "--kv-scale ", opt_.kv_scale,
              ": the fp8 scale must be a power of two in [2^-40, 2^40] (parse_kv_scale rounds up to one)");
  scales_set_ = !fp8_ || opt_.kv_scale > 0.f;
  const int64_t H = c.hidden, D = c.head_dim, Hq = c.n_heads, Hkv = c.n_kv_heads, F = c.ffn,
                V = c.vocab, NL = c.n_layers;
  const int64_t NQKV = (Hq + 2 * Hkv) * D;
  const int P = opt_.page_size;
  SPADE_CHECK(P > 0, "page size must be positive");
  n_pages_ = opt_.kv_pages > 0 ? opt_.kv_pages
                               : (opt_.max_tokens + P - 1) / P + int64_t(opt_.max_batch);
  max_rows_ = opt_.max_logit_rows > 0 ? opt_.max_logit_rows
                                      : std::max<int64_t>(opt_.max_batch, 64);
  const int64_t S = opt_.max_step_tokens;
  // --- Sizes (bytes) of everything the arena will hold.
  const bool tied = w ? w->lm_head.numel() == 0 : c.tie_embeddings;
  size_t wb = 0;
  wb += size_t(V * H) * 2 * (tied ? 1 : 2);
  wb += size_t(NL) * (size_t(NQKV * H + H * Hq * D + 2 * F * H + H * F) * 2);
  size_t small = size_t(NL) * (size_t(2 * H + 2 * D + NQKV) * 4 + 6 * 256) + size_t(H + D) * 4 + 4096;
  weight_bytes_ = wb;
  // K and V (bf16, or fp8 + one layer of bf16 scratch and the scales).
  size_t kv_bytes = size_t(NL) * kv_layer_elems() * kv_elem_bytes() * 2;
  if (fp8_) kv_bytes += kv_layer_elems() * 2 * 2 + size_t(NL) * size_t(Hkv) * 2 * 8 + 2048;
  const size_t ws_bytes =
      size_t(S) * (H * 4 + std::max(H, F) * 2 + NQKV * 4 + 2 * Hq * D * 2 + 2 * F * 4 + F * 2) +
      size_t(max_rows_) * V * 4 + size_t(4 * S + 4 * max_rows_ + 64) * 4 + (32u << 20) +
      size_t(64) * opt_.max_batch * Hq * (D + 1) * 4 + size_t(n_pages_ + 8 * S + 64 * opt_.max_batch) * 4 * 6 +
      (1u << 20) * 8;
  // The per-page data some methods read (every method's with any_method), kept on every
  // append: Quest's page key min/max, Twilight's INT4 keys; and the model's own method.
  const CudaSparse& sp = opt_.sparse;
  seq_pages_cap_ = std::min<int64_t>(n_pages_, (int64_t(c.max_context) + P - 1) / P + 1);
  upd_cap_ = S + opt_.max_batch;
  // (fp8: no method that reads them runs, check_gpu_kv_dtype.)
  const bool keep_meta = !fp8_ && ((opt_.any_method && P == 16) || sp.needs_quest_meta());
  const bool keep_int4 = !fp8_ && (opt_.any_method || sp.needs_int4_keys());
  size_t sp_bytes = 0;
  if (keep_meta) sp_bytes += size_t(NL) * size_t(n_pages_) * size_t(Hkv * 2 * D) * 2 + 256;
  if (keep_int4) sp_bytes += size_t(NL) * size_t(n_pages_) * size_t(Hkv * P) * size_t(D / 2 + 4) + 512;
  if (keep_meta || keep_int4) sp_bytes += size_t(2 * upd_cap_) * 4 + 256;
  {
    GpuMethodContext ctx = method_context();
    sp_bytes += GpuMethod::arena_bytes(ctx, sp);
  }
  const size_t total = wb + small + kv_bytes + ws_bytes + sp_bytes;
  {
    size_t free_b = 0, total_b = 0;
    SPADE_CUDA(cudaMemGetInfo(&free_b, &total_b));
    SPADE_CHECK(total <= free_b, "GPU memory: the model needs ", double(wb) / 1e9,
                " GB of bf16 weights + ", double(kv_bytes) / 1e9, " GB of KV cache (",
                n_pages_, " pages of ", P, " tokens) + ", double(ws_bytes) / 1e9,
                " GB of workspaces = ", double(total) / 1e9, " GB, but the device has ",
                double(free_b) / 1e9, " GB free of ", double(total_b) / 1e9,
                " GB. Lower --kv-pages / the context, or the batch.");
  }
  arena_ = std::make_unique<cuda::DeviceArena>(total);
  cudaStream_t st;
  SPADE_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  stream_ = st;
  cudaEvent_t e0, e1;
  SPADE_CUDA(cudaEventCreate(&e0));
  SPADE_CUDA(cudaEventCreate(&e1));
  ev0_ = e0;
  ev1_ = e1;
  cudaEvent_t el;
  SPADE_CUDA(cudaEventCreateWithFlags(&el, cudaEventDisableTiming));
  ev_lanes_ = el;
  auto& A = *arena_;
  // --- Weights.
  embed_ = A.alloc_n<bf16>(size_t(V * H), "token embeddings");
  lm_head_ = tied ? embed_ : A.alloc_n<bf16>(size_t(V * H), "lm_head");
  final_norm_ = A.alloc_n<float>(size_t(H), "final norm");
  inv_freq_ = A.alloc_n<float>(size_t(D / 2), "rope inv_freq");
  layers_.resize(size_t(NL));
  for (auto& L : layers_) {
    L.attn_norm = A.alloc_n<float>(size_t(H), "attn_norm");
    L.ffn_norm = A.alloc_n<float>(size_t(H), "ffn_norm");
    if (c.qk_norm) {
      L.q_norm = A.alloc_n<float>(size_t(D), "q_norm");
      L.k_norm = A.alloc_n<float>(size_t(D), "k_norm");
    }
    if (c.qkv_bias) L.bqkv = A.alloc_n<float>(size_t(NQKV), "qkv bias");
    L.wqkv = A.alloc_n<bf16>(size_t(NQKV * H), "wqkv");
    L.wo = A.alloc_n<bf16>(size_t(H * Hq * D), "wo");
    L.wgu = A.alloc_n<bf16>(size_t(2 * F * H), "w_gate|w_up");
    L.wdown = A.alloc_n<bf16>(size_t(H * F), "w_down");
  }
  std::vector<float> inv(size_t(D / 2));
  cpu::rope_inv_freq(c, inv.data());
  upload_f32(inv_freq_, inv.data(), inv.size());
  if (w) {
    upload_bf16(static_cast<bf16*>(embed_), w->tok_embeddings.data(), size_t(V * H));
    if (!tied) upload_bf16(static_cast<bf16*>(lm_head_), w->lm_head.data(), size_t(V * H));
    upload_f32(final_norm_, w->final_norm.data(), size_t(H));
    for (int64_t l = 0; l < NL; ++l) {
      const LayerWeights& src = w->layers[size_t(l)];
      Layer& L = layers_[size_t(l)];
      upload_f32(L.attn_norm, src.attn_norm.data(), size_t(H));
      upload_f32(L.ffn_norm, src.ffn_norm.data(), size_t(H));
      if (c.qk_norm) {
        upload_f32(L.q_norm, src.q_norm.data(), size_t(D));
        upload_f32(L.k_norm, src.k_norm.data(), size_t(D));
      }
      if (c.qkv_bias) {
        upload_f32(L.bqkv, src.bq.data(), size_t(Hq * D));
        upload_f32(L.bqkv + Hq * D, src.bk.data(), size_t(Hkv * D));
        upload_f32(L.bqkv + (Hq + Hkv) * D, src.bv.data(), size_t(Hkv * D));
      }
      upload_bf16(L.wqkv, src.wq.data(), size_t(Hq * D * H));
      upload_bf16(L.wqkv + Hq * D * H, src.wk.data(), size_t(Hkv * D * H));
      upload_bf16(L.wqkv + (Hq + Hkv) * D * H, src.wv.data(), size_t(Hkv * D * H));
      upload_bf16(L.wo, src.wo.data(), size_t(H * Hq * D));
      upload_bf16(L.wgu, src.w_gate.data(), size_t(F * H));
      upload_bf16(L.wgu + F * H, src.w_up.data(), size_t(F * H));
      upload_bf16(L.wdown, src.w_down.data(), size_t(H * F));
    }
  } else {
    // Synthetic: scaled so activations stay O(1) through the layers.
    auto rnd = [&](bf16* p, int64_t n, float scale, float mean = 0.f) {
      cuda::fill_random_bf16(p, n, seed++, scale, mean, st);
    };
    auto rndf = [&](float* p, int64_t n, float scale, float mean) {
      cuda::fill_random_f32(p, n, seed++, scale, mean, st);
    };
    const float s = 1.f / std::sqrt(float(H));
    rnd(static_cast<bf16*>(embed_), V * H, 1.f);
    if (!tied) rnd(static_cast<bf16*>(lm_head_), V * H, s);
    rndf(final_norm_, H, 0.1f, 1.f);
    for (auto& L : layers_) {
      rndf(L.attn_norm, H, 0.1f, 1.f);
      rndf(L.ffn_norm, H, 0.1f, 1.f);
      if (c.qk_norm) rndf(L.q_norm, D, 0.1f, 1.f), rndf(L.k_norm, D, 0.1f, 1.f);
      if (c.qkv_bias) rndf(L.bqkv, NQKV, 0.1f, 0.f);
      rnd(L.wqkv, NQKV * H, 2 * s);
      rnd(L.wo, H * Hq * D, 1.f / std::sqrt(float(Hq * D)));
      rnd(L.wgu, 2 * F * H, s);
      rnd(L.wdown, H * F, 1.f / std::sqrt(float(F)));
    }
    SPADE_CUDA(cudaStreamSynchronize(st));
  }
  // --- KV pool.
  const size_t kv_elems = size_t(NL) * kv_layer_elems();
  if (fp8_) {
    k_cache_ = A.alloc_n<uint8_t>(kv_elems, "KV cache (K, fp8)");
    v_cache_ = A.alloc_n<uint8_t>(kv_elems, "KV cache (V, fp8)");
    k_wide_ = A.alloc_n<bf16>(kv_layer_elems(), "fp8 KV: one layer of bf16 K (prefill)");
    v_wide_ = A.alloc_n<bf16>(kv_layer_elems(), "fp8 KV: one layer of bf16 V (prefill)");
    // Zeroed once: slots a prefill kernel may touch beyond what widening wrote stay finite.
    SPADE_CUDA(cudaMemset(k_wide_, 0, kv_layer_elems() * 2));
    SPADE_CUDA(cudaMemset(v_wide_, 0, kv_layer_elems() * 2));
    const size_t ns = size_t(NL) * 2 * size_t(Hkv);
    kv_scales_dev_ = A.alloc_n<float>(ns, "fp8 KV scales");
    kv_amax_ = A.alloc_n<unsigned int>(ns, "fp8 KV calibration maxima");
    const std::vector<float> s0(ns, opt_.kv_scale);  // 0 while auto scales are unset
    upload_f32(kv_scales_dev_, s0.data(), ns);
  } else {
    k_cache_ = A.alloc_n<bf16>(kv_elems, "KV cache (K)");
    v_cache_ = A.alloc_n<bf16>(kv_elems, "KV cache (V)");
  }
  free_.resize(size_t(n_pages_));
  for (int64_t i = 0; i < n_pages_; ++i) free_[size_t(i)] = int32_t(n_pages_ - 1 - i);
  // --- Workspaces.
  x_ = A.alloc_n<float>(size_t(S * H), "residual");
  xn_ = A.alloc_n<bf16>(size_t(S * std::max(H, F)), "normed activations");
  qkv_ = A.alloc_n<float>(size_t(S * NQKV), "qkv");
  q_ = A.alloc_n<bf16>(size_t(S * Hq * D), "q");
  att_ = A.alloc_n<bf16>(size_t(S * Hq * D), "attention out");
  gu_ = A.alloc_n<float>(size_t(S * 2 * F), "gate|up");
  h_ = A.alloc_n<bf16>(size_t(S * F), "mlp hidden");
  logits_ = A.alloc_n<float>(size_t(max_rows_ * V), "logits");
  step_off_ = (3 * S + max_rows_ + 1) / 2 * 2;
  tok_in_ = A.alloc_n<int32_t>(size_t(step_off_ + 4), "step inputs");
  sampled_ = A.alloc_n<int32_t>(size_t(std::max<int64_t>(opt_.max_batch, max_rows_)), "sampled ids");
  SPADE_CUDA(cudaMallocHost(&tok_host_, sizeof(int32_t) * size_t(step_off_ + 4)));
  SPADE_CUDA(cudaMallocHost(&sampled_host_, sizeof(int32_t) * size_t(std::max<int64_t>(opt_.max_batch, max_rows_))));
  rows_dev_ = A.alloc_n<cuda::GpuSamplingRow>(size_t(opt_.max_batch), "sampling rows");
  SPADE_CUDA(cudaMallocHost(&rows_host_, sizeof(cuda::GpuSamplingRow) * size_t(opt_.max_batch)));
  gemm_ = std::make_unique<cuda::Gemm>(A);
  gemm_->set_batch_invariant(opt_.deterministic);
  if (keep_meta) {
    const size_t me = size_t(NL) * size_t(n_pages_) * size_t(Hkv * 2 * D);
    hooks_.quest_meta = A.alloc_n<bf16>(me, "quest page metadata");
    SPADE_CUDA(cudaMemset(hooks_.quest_meta, 0, me * 2));
  }
  if (keep_int4) {
    const size_t rows = size_t(NL) * size_t(n_pages_) * size_t(Hkv * P);
    hooks_.k_int4 = A.alloc_n<uint8_t>(rows * size_t(D / 2), "INT4 keys");
    hooks_.k_int4_sz = A.alloc_n<uint32_t>(rows, "INT4 key scale/zero");
  }
  if (keep_meta || keep_int4) {
    upd_ = A.alloc_n<int32_t>(size_t(2 * upd_cap_), "page data updates");
    SPADE_CUDA(cudaMallocHost(&upd_host_, sizeof(int32_t) * size_t(2 * upd_cap_)));
  }
  methods_.push_back(GpuMethod::create(method_context(), sp, &A));
  method_keys_.emplace_back();
}

void CudaModel::kv_scales(std::vector<float>& k, std::vector<float>& v) const {
  k.clear(), v.clear();
  if (!fp8_) return;
  const size_t NL = size_t(cfg_.n_layers), Hkv = size_t(cfg_.n_kv_heads);
  std::vector<float> all(NL * 2 * Hkv);
  SPADE_CUDA(cudaStreamSynchronize(S_(stream_)));
  SPADE_CUDA(cudaMemcpy(all.data(), kv_scales_dev_, all.size() * 4, cudaMemcpyDeviceToHost));
  for (size_t l = 0; l < NL; ++l) {
    k.insert(k.end(), all.begin() + long(l * 2 * Hkv), all.begin() + long(l * 2 * Hkv + Hkv));
    v.insert(v.end(), all.begin() + long(l * 2 * Hkv + Hkv), all.begin() + long((l + 1) * 2 * Hkv));
  }
}

void CudaModel::set_kv_scales(const std::vector<float>& k, const std::vector<float>& v) {
  SPADE_CHECK(fp8_, "set_kv_scales: the KV cache is ", kv_dtype_name(opt_.kv_dtype), " (only fp8 has scales)");
  const size_t NL = size_t(cfg_.n_layers), Hkv = size_t(cfg_.n_kv_heads);
  SPADE_CHECK(k.size() == NL * Hkv && v.size() == NL * Hkv, "set_kv_scales: ", k.size(), " K and ",
              v.size(), " V scales for ", NL, " layers x ", Hkv, " KV heads");
  std::vector<float> all(NL * 2 * Hkv);
  for (size_t l = 0; l < NL; ++l)
    for (size_t h = 0; h < Hkv; ++h) {
      for (float s : {k[l * Hkv + h], v[l * Hkv + h]})
        SPADE_CHECK(s >= kFp8ScaleMin && s <= kFp8ScaleMax && fp8_pow2_ceil(s) == s,
                    "set_kv_scales: scale ", s, " (layer ", l, ", head ", h,
                    ") is not a power of two in [2^-40, 2^40]");
      all[l * 2 * Hkv + h] = k[l * Hkv + h];
      all[l * 2 * Hkv + Hkv + h] = v[l * Hkv + h];
    }
  SPADE_CUDA(cudaStreamSynchronize(S_(stream_)));
  upload_f32(kv_scales_dev_, all.data(), all.size());
  scales_set_ = true;
}

void CudaModel::reset_kv_scales() {
  if (!fp8_ || opt_.kv_scale > 0.f) return;
  SPADE_CHECK(free_pages() == total_pages(), "reset_kv_scales with ", total_pages() - free_pages(),
              " pages in use");
  scales_set_ = false;
}

void CudaModel::reserve(PageTable& pt, int64_t new_length) {
  const int P = opt_.page_size;
  int64_t need = (new_length + P - 1) / P - int64_t(pt.pages.size());
  if (need <= 0) return;
  SPADE_CHECK(need <= free_pages(), "GPU KV cache full: need ", need, " more pages of ", P,
              " tokens for a sequence of ", new_length, " tokens, ", free_pages(), " of ",
              n_pages_, " pages free (raise --kv-pages)");
  for (int64_t i = 0; i < need; ++i) {
    pt.pages.push_back(free_.back());
    free_.pop_back();
  }
}

void CudaModel::release(PageTable& pt) {
  for (int32_t p : pt.pages) free_.push_back(p);
  pt.pages.clear();
  pt.length = 0;
}

void CudaModel::prepare(const std::vector<SeqInput>& batch, std::vector<int64_t>& row_of,
                        bool sample) {
  const ModelConfig& c = cfg_;
  const int P = opt_.page_size;
  SPADE_CHECK(!batch.empty() && int(batch.size()) <= opt_.max_batch, "CUDA forward: batch of ",
              batch.size(), " sequences (limit ", opt_.max_batch, ")");
  int64_t T = 0, R = 0;
  method_of_seq_.resize(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) method_of_seq_[i] = method_of(batch[i]);
  route_prefill_rows(batch);
  for (const SeqInput& s : batch) {
    SPADE_CHECK(s.n_tokens > 0 && s.pages, "forward: empty sequence input");
    SPADE_CHECK(!s.attention, "CUDA forward: custom attention functions are CPU-only");
    SPADE_CHECK(s.pages->length + s.n_tokens <= c.max_context, "sequence of ",
                s.pages->length + s.n_tokens, " tokens exceeds the model's context of ",
                c.max_context, " tokens");
    T += s.n_tokens;
    R += (s.all_logits && !sample) ? s.n_tokens : 1;
  }
  SPADE_CHECK(T <= opt_.max_step_tokens, "CUDA forward: ", T, " tokens in one step (limit ",
              opt_.max_step_tokens, "; prefill in chunks)");
  SPADE_CHECK(R <= max_rows_, "CUDA forward: ", R, " logit rows (limit ", max_rows_, ")");
  // Reserve pages first; undo on failure.
  {
    std::vector<size_t>& before = pages_before_;  // kept: no allocation once warm
    before.clear();
    try {
      for (const SeqInput& s : batch) {
        before.push_back(s.pages->pages.size());
        reserve(*s.pages, s.pages->length + s.n_tokens);
      }
    } catch (...) {
      for (size_t i = 0; i < before.size(); ++i) {
        PageTable& pt = *batch[i].pages;
        for (size_t j = before[i]; j < pt.pages.size(); ++j) free_.push_back(pt.pages[j]);
        pt.pages.resize(before[i]);
      }
      throw;
    }
  }
  const int64_t S = opt_.max_step_tokens;
  int32_t* ids = tok_host_;
  int32_t* pos = tok_host_ + S;
  int32_t* page = tok_host_ + 2 * S;
  int32_t* rows = tok_host_ + 3 * S;
  const size_t B = batch.size();
  // Step order: the sequences grouped by method (stable; the batch order when all share one),
  // so that each method's rows are contiguous; logit rows stay in batch order.
  order_.resize(B);
  for (size_t i = 0; i < B; ++i) order_[i] = int(i);
  bool one_method = true;
  for (size_t i = 1; i < B; ++i) one_method = one_method && method_of_seq_[i] == method_of_seq_[0];
  if (!one_method) {  // a counting sort by method id (stable; the vectors are kept)
    method_count_.assign(methods_.size() + 1, 0);
    for (size_t i = 0; i < B; ++i) ++method_count_[size_t(method_of_seq_[i]) + 1];
    for (size_t m = 1; m < method_count_.size(); ++m) method_count_[m] += method_count_[m - 1];
    for (size_t i = 0; i < B; ++i) order_[size_t(method_count_[size_t(method_of_seq_[i])]++)] = int(i);
  }
  tok_start_.resize(B);
  aseq_.resize(B);
  group_inputs_.resize(B);
  groups_.clear();
  int64_t t = 0;
  for (size_t k = 0; k < B; ++k) {
    const size_t i = size_t(order_[k]);
    const SeqInput& s = batch[i];
    const int64_t p0 = s.pages->length;
    for (int64_t j = 0; j < s.n_tokens; ++j) {
      const int32_t id = s.tokens[j];
      SPADE_CHECK(id >= 0 && id < c.vocab, "token id ", id, " outside the vocabulary (",
                  c.vocab, " tokens)");
      ids[t + j] = id;
      pos[t + j] = int32_t(p0 + j);
      page[t + j] = s.pages->pages[size_t((p0 + j) / P)];
    }
    tok_start_[i] = t;
    aseq_[k] = {s.pages->pages.data(), int(s.pages->pages.size()), int(p0 + s.n_tokens),
                int(s.n_tokens)};
    group_inputs_[k] = s;
    const int id = method_of_seq_[i];
    if (groups_.empty() || groups_.back().id != id)
      groups_.push_back({methods_[size_t(id)].get(), id, int(k), 0, t});
    ++groups_.back().n;
    t += s.n_tokens;
  }
  row_of.assign(B, 0);
  int64_t r = 0;
  for (size_t i = 0; i < B; ++i) {
    const SeqInput& s = batch[i];
    row_of[i] = r;
    const int64_t t0 = tok_start_[i];
    if (s.all_logits && !sample) {
      for (int64_t j = 0; j < s.n_tokens; ++j) rows[r++] = int32_t(t0 + j);
    } else {
      rows[r++] = int32_t(t0 + s.n_tokens - 1);
    }
  }
  T_ = int(T);
  R_ = int(R);
  cudaStream_t st = S_(stream_);
  SPADE_CUDA(cudaMemcpyAsync(tok_in_, ids, sizeof(int32_t) * size_t(T), cudaMemcpyHostToDevice, st));
  SPADE_CUDA(cudaMemcpyAsync(tok_in_ + S, pos, sizeof(int32_t) * size_t(T), cudaMemcpyHostToDevice, st));
  SPADE_CUDA(cudaMemcpyAsync(tok_in_ + 2 * S, page, sizeof(int32_t) * size_t(T), cudaMemcpyHostToDevice, st));
  SPADE_CUDA(cudaMemcpyAsync(tok_in_ + 3 * S, rows, sizeof(int32_t) * size_t(R), cudaMemcpyHostToDevice, st));
  // Quest page metadata of the pages this step writes: inside the KV append when every
  // sequence adds one token, else recomputed per layer for the listed pages.
  upd_n_ = 0;
  meta_in_append_ = hooks_.quest_meta != nullptr && T == int64_t(B);
  if (hooks_.quest_meta && !meta_in_append_) {
    for (const SeqInput& s : batch) {
      const int64_t p0 = s.pages->length, p1 = p0 + s.n_tokens;
      for (int64_t pg = p0 / P; pg * P < p1; ++pg) {
        upd_host_[upd_n_] = s.pages->pages[size_t(pg)];
        upd_host_[upd_cap_ + upd_n_] = int32_t(std::min<int64_t>(P, p1 - pg * P));
        ++upd_n_;
      }
    }
    SPADE_CUDA(cudaMemcpyAsync(upd_, upd_host_, sizeof(int32_t) * size_t(upd_n_),
                               cudaMemcpyHostToDevice, st));
    SPADE_CUDA(cudaMemcpyAsync(upd_ + upd_cap_, upd_host_ + upd_cap_,
                               sizeof(int32_t) * size_t(upd_n_), cudaMemcpyHostToDevice, st));
  }
  // Each method plans its rows: dense attention, and its selections when they decode.
  for (const Group& g : groups_) {
    g.m->trace = g.id == 0 ? quest_trace : nullptr;
    g.m->plan(group_inputs_.data() + g.b0, aseq_.data() + g.b0, g.n);
  }
  sync_stream();  // the pinned inputs above are consumed
  for (const SeqInput& s : batch) s.pages->length += s.n_tokens;
}

void CudaModel::enqueue(bool sample, const cuda::GpuSampling* sp, uint64_t step) {
  const ModelConfig& c = cfg_;
  const int H = c.hidden, D = c.head_dim, Hq = c.n_heads, Hkv = c.n_kv_heads, F = c.ffn,
            V = c.vocab;
  const int NQKV = (Hq + 2 * Hkv) * D;
  const int64_t S = opt_.max_step_tokens;
  const int T = T_, R = R_;
  cudaStream_t st = S_(stream_);
  (void)step;
  bf16* xn = static_cast<bf16*>(xn_);
  bf16* q = static_cast<bf16*>(q_);
  bf16* att = static_cast<bf16*>(att_);
  bf16* h = static_cast<bf16*>(h_);
  const size_t layer_kv_bytes = kv_layer_elems() * kv_elem_bytes();
  const float scale = 1.f / std::sqrt(float(D));
  // fp8 with auto scales unset: this step sets them (each layer's from its rows, before its
  // append; launch() runs such a step eagerly).
  const bool calibrate = fp8_ && !scales_set_;
  if (calibrate)
    SPADE_CUDA(cudaMemsetAsync(kv_amax_, 0, sizeof(unsigned int) * layers_.size() * 2 * size_t(Hkv), st));
  cuda::embedding(static_cast<const bf16*>(embed_), tok_in_, x_, T, H, V, st);
  const size_t layer_rows = size_t(n_pages_) * size_t(Hkv) * opt_.page_size;
  const size_t layer_meta = size_t(n_pages_) * size_t(Hkv) * 2 * D;
  const size_t row_elems = size_t(Hq) * D;  // one token's q / attention output
  for (const Group& g : groups_) g.m->begin_step();
  // Tensor parallelism (CudaModelOptions::tp): rank 0 adds its o- / down-projection partial to
  // the residual, the other ranks write theirs alone; the all-reduce then sums residual and
  // partials on every rank.
  dist::DeviceCollectives* tp = opt_.tp && opt_.tp->size() > 1 ? opt_.tp : nullptr;
  const float beta_res = tp && tp->rank() > 0 ? 0.f : 1.f;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    // (fp8: uint8 codes behind the bf16 pointer type, QkvPostArgs::kv_scale.)
    bf16* kc = reinterpret_cast<bf16*>(static_cast<unsigned char*>(k_cache_) + l * layer_kv_bytes);
    bf16* vc = reinterpret_cast<bf16*>(static_cast<unsigned char*>(v_cache_) + l * layer_kv_bytes);
    cuda::rmsnorm(x_, nullptr, L.attn_norm, c.rms_eps, xn, T, H, st);
    cuda::QkvPostArgs a;
    a.qkv = qkv_;
    a.bias = L.bqkv;
    a.q_norm = L.q_norm;
    a.k_norm = L.k_norm;
    a.inv_freq = inv_freq_;
    a.pos = tok_in_ + S;
    a.page = tok_in_ + 2 * S;
    a.q_out = q;
    a.k_cache = kc;
    a.v_cache = vc;
    a.T = T, a.Hq = Hq, a.Hkv = Hkv, a.D = D, a.P = opt_.page_size, a.eps = c.rms_eps;
    // Per-page data of the methods: the INT4 copy of the appended keys (Twilight), and the
    // page key min / max with the new key (Quest, decode steps).
    a.k_int4 = hooks_.k_int4 ? hooks_.k_int4 + l * layer_rows * size_t(D / 2) : nullptr;
    a.k_int4_sz = hooks_.k_int4_sz ? hooks_.k_int4_sz + l * layer_rows : nullptr;
    bf16* meta = hooks_.quest_meta ? static_cast<bf16*>(hooks_.quest_meta) + l * layer_meta : nullptr;
    a.quest_meta = meta_in_append_ ? meta : nullptr;
    float* layer_scales = fp8_ ? kv_scales_dev_ + l * 2 * size_t(Hkv) : nullptr;
    a.kv_scale = layer_scales;
    a.rotate_qk = fp8_ && kv_rotates_keys(KvDtype::FP8, D);  // as the CPU pool (key_rotation.h)
    if (calibrate) {  // the maxima of this layer's K / V rows -> its scales, then the append
      gemm_->run_f32(xn, L.wqkv, qkv_, T, NQKV, H, 0.f, st);
      cuda::QkvPostArgs c = a;
      c.kv_scale = nullptr;
      c.kv_amax = kv_amax_ + l * 2 * size_t(Hkv);
      cuda::qkv_post(c, st);
      cuda::fp8_scales_from_amax(c.kv_amax, layer_scales, 2 * Hkv, st);
      cuda::qkv_post(a, st);
    } else if ((fused_gemv_ & CudaModelOptions::kFuseQkvPost) && gemm_->uses_gemv(T) &&
        cuda::gemv_qkv_post_supported(xn, L.wqkv, a, T, H)) {
      cuda::gemv_qkv_post(xn, L.wqkv, a, T, H, st);  // decode: one launch, same values
    } else {
      gemm_->run_f32(xn, L.wqkv, qkv_, T, NQKV, H, 0.f, st);
      cuda::qkv_post(a, st);
    }
    for (const Group& g : groups_) g.m->join();  // the previous layer's selections
    if (meta && upd_n_ > 0 && !meta_in_append_)  // several tokens per sequence: recompute
      cuda::quest_update_meta(kc, meta, upd_, upd_ + upd_cap_, upd_n_, Hkv, opt_.page_size, D, st);
    // Attention: each method over its own rows; several methods side by side, each on its
    // own stream (parallel branches of a captured graph), joined before the o-projection.
    if (groups_.size() == 1) {
      groups_[0].m->attend(int(l), q, kc, vc, att, scale);
    } else if (tp) {
      // Tensor parallelism: one stream (a method's collective must not run beside another).
      for (const Group& g : groups_)
        g.m->attend(int(l), q + size_t(g.t0) * row_elems, kc, vc, att + size_t(g.t0) * row_elems,
                    scale);
    } else {
      SPADE_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(ev_lanes_), st));
      for (const Group& g : groups_)
        g.m->attend_on_lane(ev_lanes_, int(l), q + size_t(g.t0) * row_elems, kc, vc,
                            att + size_t(g.t0) * row_elems, scale);
      for (const Group& g : groups_) g.m->join_lane();
    }
    gemm_->run_f32(att, L.wo, x_, T, H, Hq * D, beta_res, st);
    if (tp) tp->all_reduce_sum_on(x_, int64_t(T) * H, st);
    cuda::rmsnorm(x_, nullptr, L.ffn_norm, c.rms_eps, xn, T, H, st);
    if ((fused_gemv_ & CudaModelOptions::kFuseSwiglu) && gemm_->uses_gemv(T) &&
        cuda::gemv_supported(xn, L.wgu, T, H)) {
      cuda::gemv_swiglu(xn, L.wgu, h, T, F, H, st);  // decode: one launch, same values
    } else {
      gemm_->run_f32(xn, L.wgu, gu_, T, 2 * F, H, 0.f, st);
      cuda::swiglu(gu_, h, T, F, st);
    }
    gemm_->run_f32(h, L.wdown, x_, T, H, F, beta_res, st);
    if (tp) tp->all_reduce_sum_on(x_, int64_t(T) * H, st);
  }
  for (const Group& g : groups_) g.m->join();
  if (!opt_.logits) return;  // a tensor-parallel follower: rank 0 computes the logits
  cuda::rmsnorm(x_, tok_in_ + 3 * S, final_norm_, c.rms_eps, xn, R, H, st);
  gemm_->run_f32(xn, static_cast<const bf16*>(lm_head_), logits_, R, V, H, 0.f, st);
  if (sample && rows_mode_)
    cuda::sample_rows(logits_, R, V, rows_dev_, sampled_, st);
  else if (sample)
    cuda::sample(logits_, R, V, *sp, 0, sampled_, st,
                 reinterpret_cast<const uint64_t*>(tok_in_ + step_off_));
}

void CudaModel::graph_class(bool sample) {
  // What a graph update cannot change: the batch size, sampling, and the methods (in order).
  std::vector<int>& k = graph_class_;
  k.clear();
  k.push_back(T_ * 4 + (sample ? 1 : 0) + (sample && rows_mode_ ? 2 : 0));
  for (const Group& g : groups_) k.push_back(g.id);
}

void CudaModel::graph_key(bool sample) {
  // Batch size and whether the step samples, the page-data updates, and per method group its
  // id, rows and launch shapes (GpuMethod::append_graph_key).
  std::vector<int>& k = graph_key_;
  k.clear();
  k.push_back(T_ * 4 + (sample ? 1 : 0) + (sample && rows_mode_ ? 2 : 0));
  k.push_back(upd_n_);
  k.push_back(meta_in_append_ ? 1 : 0);
  for (const Group& g : groups_) {
    k.push_back(g.id);
    k.push_back(g.n);
    g.m->append_graph_key(k);
  }
}

void CudaModel::launch(bool sample, const cuda::GpuSampling* sp, uint64_t step) {
  cudaStream_t st = S_(stream_);
  if (sample) {
    uint64_t* sh = reinterpret_cast<uint64_t*>(tok_host_ + step_off_);
    *sh = step;
    SPADE_CUDA(cudaMemcpyAsync(tok_in_ + step_off_, sh, 8,
                               cudaMemcpyHostToDevice, st));
  }
  SPADE_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(ev0_), st));
  const auto t_host = std::chrono::steady_clock::now();
  auto host_ns = [&] {
    return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - t_host).count());
  };
  // Decode steps replay a graph captured for their launch shape (graph_key); sparse steps
  // too: every launch reads its step-dependent inputs (lengths, page tables, work items,
  // metadata updates) from device buffers at fixed addresses that prepare() refilled. Traced
  // steps (tests) copy to the host between layers and run eagerly.
  bool graphable = opt_.cuda_graphs && !quest_trace && T_ == int(order_.size()) && scales_set_;
  for (const Group& g : groups_) graphable = graphable && g.m->graphable();
  if (graphable) {
    graph_key(sample);
    const std::vector<int>& key = graph_key_;
    auto it = graphs_.find(key);
    if (it == graphs_.end() && opt_.graph_min_uses > 1) {
      // Not captured yet: eager until the shape has come back graph_min_uses times.
      if (graph_seen_.size() >= 4 * size_t(opt_.max_graphs)) graph_seen_.clear();
      int& seen = graph_seen_[key];
      if (++seen < opt_.graph_min_uses) graphable = false;
      else graph_seen_.erase(key);
    }
  }
  if (graphable) {
    const std::vector<int>& key = graph_key_;
    auto it = graphs_.find(key);
    const bool captured =
        it == graphs_.end() ||
        (sample && !rows_mode_ && std::memcmp(&graph_sampling_, sp, sizeof(*sp)) != 0);
    if (captured) {
      if (it != graphs_.end()) {
        cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(it->second.exec));
        graphs_.erase(it);
      }
      // First use of this batch size or of a method: run eagerly (plans GEMM algorithms and
      // other first-use host work outside any capture), then capture. The replay below redoes
      // this step, so the eager run does not count BLASST tiles. Once warm, capture directly.
      bool warm = eager_T_.count(T_) > 0;
      for (const Group& g : groups_) warm = warm && g.m->warm;
      if (!warm) {
        for (const Group& g : groups_) g.m->count_blasst = false;
        enqueue(sample, sp, step);
        for (const Group& g : groups_) g.m->count_blasst = true, g.m->warm = true;
        eager_T_.insert(T_);
        sync_stream();
      }
      cudaGraph_t g;
      SPADE_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      enqueue(sample, sp, step);
      SPADE_CUDA(cudaStreamEndCapture(st, &g));
      // A graph of the same methods and batch size whose launch shapes changed (a method's rows,
      // split counts, work items): update it in place, which costs far less than instantiating
      // (a server's batch composition changes every few steps); else instantiate.
      graph_class(sample);
      cudaGraphExec_t ge = nullptr;
      // Tensor parallelism: no update in place. NCCL ties each captured collective's resources
      // to the graph captured (a user object), and an update would leave the exec on the
      // resources of the graph it was instantiated from: always instantiate.
      const bool tp_graph = opt_.tp && opt_.tp->size() > 1;
      if (auto c = graph_class_last_.find(graph_class_); !tp_graph && c != graph_class_last_.end()) {
        auto old = graphs_.find(c->second);
        if (old != graphs_.end()) {
          cudaGraphExecUpdateResultInfo info;
          if (cudaGraphExecUpdate(static_cast<cudaGraphExec_t>(old->second.exec), g, &info) == cudaSuccess) {
            ge = static_cast<cudaGraphExec_t>(old->second.exec);
            graphs_.erase(old);
          } else {
            (void)cudaGetLastError();  // not updatable (another topology): instantiate
          }
        }
      }
      ++graph_counters_.captures;
      log_capture(key);
      if (ge) ++graph_counters_.updates;
      else ++graph_counters_.instantiations;
      if (!ge) {
        // A new entry: past max_graphs, the least recently replayed graph goes first (after
        // the update attempt, so the class's update base is not the one evicted).
        if (graphs_.size() >= size_t(opt_.max_graphs)) evict_lru_graph();
        SPADE_CUDA(cudaGraphInstantiate(&ge, g, 0));
      }
      SPADE_CUDA(cudaGraphDestroy(g));
      graphs_[key].exec = ge;
      graph_class_last_[graph_class_] = key;
      if (sample && !rows_mode_) graph_sampling_ = *sp;
      // An eager run already did this step's work (the KV append is idempotent: the
      // replay below rewrites the same slots with the same values).
    }
    CachedGraph& cg = graphs_[key];
    cg.used = ++graph_clock_;
    SPADE_CUDA(cudaGraphLaunch(static_cast<cudaGraphExec_t>(cg.exec), st));
    ++graph_counters_.replays;
    (captured ? graph_counters_.capture_host_ns : graph_counters_.replay_host_ns) += host_ns();
    last_eager_ = false;
  } else {
    ++graph_counters_.eager;
    enqueue(sample, sp, step);
    scales_set_ = true;  // fp8 auto: this step set them
    for (const Group& g : groups_) g.m->warm = true;
    eager_T_.insert(T_);
    graph_counters_.eager_host_ns += host_ns();
    last_eager_ = true;
  }
  SPADE_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(ev1_), st));
}

void CudaModel::sync_stream() {
  if (opt_.tp)
    opt_.tp->synchronize(stream_);
  else
    SPADE_CUDA(cudaStreamSynchronize(S_(stream_)));
}

void CudaModel::step_done() {
  SPADE_CUDA(cudaEventElapsedTime(&last_ms_, static_cast<cudaEvent_t>(ev0_),
                                  static_cast<cudaEvent_t>(ev1_)));
  const auto ns = uint64_t(double(last_ms_) * 1e6);
  (last_eager_ ? graph_counters_.eager_device_ns : graph_counters_.graph_device_ns) += ns;
}

const std::vector<float>& CudaModel::forward(const std::vector<SeqInput>& batch,
                                             std::vector<int64_t>& row_of) {
  prepare(batch, row_of, false);
  launch(false, nullptr, 0);
  if (!opt_.logits) {  // a tensor-parallel follower: no rows
    logits_host_.clear();
    sync_stream();
    step_done();
    return logits_host_;
  }
  logits_host_.resize(size_t(R_) * cfg_.vocab);
  SPADE_CUDA(cudaMemcpyAsync(logits_host_.data(), logits_, sizeof(float) * logits_host_.size(),
                             cudaMemcpyDeviceToHost, S_(stream_)));
  sync_stream();
  step_done();
  return logits_host_;
}

std::vector<int32_t> CudaModel::forward_sample(const std::vector<SeqInput>& batch,
                                               const cuda::GpuSampling& sp, uint64_t step) {
  SPADE_CHECK(opt_.logits, "forward_sample: this model computes no logits (CudaModelOptions::logits)");
  std::vector<int64_t> row_of;
  prepare(batch, row_of, true);
  rows_mode_ = false;
  launch(true, &sp, step);
  SPADE_CUDA(cudaMemcpyAsync(sampled_host_, sampled_, sizeof(int32_t) * size_t(R_),
                             cudaMemcpyDeviceToHost, S_(stream_)));
  sync_stream();
  step_done();
  return std::vector<int32_t>(sampled_host_, sampled_host_ + R_);
}

const std::vector<int32_t>& CudaModel::forward_sample_rows(
    const std::vector<SeqInput>& batch, const std::vector<cuda::GpuSamplingRow>& rows) {
  forward_sample_rows_launch(batch, rows);
  return forward_sample_rows_wait();
}

void CudaModel::forward_sample_rows_launch(const std::vector<SeqInput>& batch,
                                           const std::vector<cuda::GpuSamplingRow>& rows) {
  SPADE_CHECK(opt_.logits, "forward_sample_rows: this model computes no logits (CudaModelOptions::logits)");
  SPADE_CHECK(rows.size() == batch.size(), "forward_sample_rows: ", rows.size(),
              " parameter rows for ", batch.size(), " sequences");
  for (const SeqInput& s : batch)
    SPADE_CHECK(!s.all_logits, "forward_sample_rows: all_logits is not supported");
  prepare(batch, row_of_scratch_, true);
  std::copy(rows.begin(), rows.end(), rows_host_);
  SPADE_CUDA(cudaMemcpyAsync(rows_dev_, rows_host_, sizeof(cuda::GpuSamplingRow) * rows.size(),
                             cudaMemcpyHostToDevice, S_(stream_)));
  rows_mode_ = true;
  launch(true, nullptr, 0);
  rows_mode_ = false;
  SPADE_CUDA(cudaMemcpyAsync(sampled_host_, sampled_, sizeof(int32_t) * size_t(R_),
                             cudaMemcpyDeviceToHost, S_(stream_)));
}

const std::vector<int32_t>& CudaModel::forward_sample_rows_wait() {
  sync_stream();
  step_done();
  sampled_rows_.assign(sampled_host_, sampled_host_ + R_);
  return sampled_rows_;
}

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
