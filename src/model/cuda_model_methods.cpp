// See cuda_model.h: the model's sparse methods as objects (GpuMethod, sparse/gpu/method.h):
// adding one per request configuration (add_method, kept up to CudaModelOptions::max_methods,
// unused ones evicted), the request states that name them, each sequence's method in a step
// and the routing of a step's dense prefill rows to the full-attention method, and BLASST's
// pass-throughs to the model's own method.
#if defined(SPADE_HAVE_CUDA)
#include <algorithm>
#include <string>
#include <vector>

#include "model/cuda_model.h"
#include "sparse/gpu/method.h"

namespace spade {

namespace {
cudaStream_t S_(void* p) { return static_cast<cudaStream_t>(p); }
}  // namespace

int CudaModel::methods_kept() const {
  int n = 0;
  for (const auto& m : methods_) n += m ? 1 : 0;
  return n;
}

int CudaModel::add_method(const std::string& key, const CudaSparse& sp) {
  for (size_t i = 0; i < methods_.size(); ++i)
    if (methods_[i] && !method_keys_[i].empty() && method_keys_[i] == key) return int(i);
  // A free id: an evicted one, a new one, or the least useful kept one nobody uses.
  int id = -1;
  for (size_t i = 1; i < methods_.size() && id < 0; ++i)
    if (!methods_[i]) id = int(i);
  if (id < 0 && methods_kept() >= std::max(1, opt_.max_methods)) {
    for (size_t i = 1; i < methods_.size() && id < 0; ++i)
      if (methods_[i] && *methods_[i]->live == 0) id = int(i);
    SPADE_CHECK(id >= 0, "--device cuda: ", opt_.max_methods, " sparse method configurations "
                "are in use by running requests; '", key, "' must wait until one finishes");
    SPADE_CUDA(cudaStreamSynchronize(S_(stream_)));
    drop_graphs();  // their launches hold the evicted method's buffers
    methods_[size_t(id)].reset();
  }
  auto m = GpuMethod::create(method_context(), sp, nullptr);
  if (id < 0) {
    id = int(methods_.size());
    methods_.push_back(nullptr);
    method_keys_.emplace_back();
  }
  methods_[size_t(id)] = std::move(m);
  method_keys_[size_t(id)] = key;
  return id;
}

CudaSparse CudaModel::shard_spec(CudaSparse sp, int kv0, int n_kv) {
  // The rank's KV heads' columns of the model's roles.
  for (std::vector<uint8_t>& layer : sp.retrieval) {
    SPADE_CHECK(kv0 >= 0 && int64_t(layer.size()) >= int64_t(kv0) + n_kv, "lycheedecode: roles "
                "for ", layer.size(), " KV heads, the rank holds [", kv0, ", ", kv0 + n_kv, ")");
    layer = std::vector<uint8_t>(layer.begin() + kv0, layer.begin() + kv0 + n_kv);
  }
  return sp;
}

CudaSparse CudaModel::method_spec(const sparse::SparseConfig& cfg) const {
  if (opt_.tp_model.n_layers == 0) return cuda_sparse_config(cfg, cfg_, opt_.page_size);
  return shard_spec(cuda_sparse_config(cfg, opt_.tp_model, opt_.page_size), opt_.tp_kv0,
                    cfg_.n_kv_heads);
}

std::unique_ptr<sparse::MethodState> CudaModel::new_request_state(int method) {
  SPADE_CHECK(method >= 0 && size_t(method) < methods_.size() && methods_[size_t(method)],
              "CudaModel: no method ", method);
  GpuMethod& m = *methods_[size_t(method)];
  return std::make_unique<GpuRequestState>(method, m.live, m.new_request_state());
}

int CudaModel::method_of(const SeqInput& s) const {
  if (!s.device_state) return 0;
  const auto* g = dynamic_cast<const GpuRequestState*>(s.device_state);
  SPADE_CHECK(g && g->method >= 0 && size_t(g->method) < methods_.size() &&
                  methods_[size_t(g->method)] &&
                  g->counter() == methods_[size_t(g->method)]->live.get(),
              "CUDA forward: SeqInput::device_state is not a request state of this model");
  return g->method;
}

void CudaModel::route_prefill_rows(const std::vector<SeqInput>& batch) {
  auto decodes = [](const SeqInput& s) { return s.n_tokens == 1 && !s.dense; };
  // A row moves when its method attends sparsely, has a decode row in this step, and attends
  // this row plainly densely (BLASST's prefill skipping keeps its prefill rows; a cache
  // correction chunk is dense by definition).
  auto plain = [](const CudaSparse& sp) {
    return sp.method == CudaSparse::Method::None && !sp.blasst_any();
  };
  method_decodes_.assign(methods_.size(), 0);
  for (size_t i = 0; i < batch.size(); ++i)
    if (decodes(batch[i])) method_decodes_[size_t(method_of_seq_[i])] = 1;
  auto moves = [&](size_t i) {
    const int id = method_of_seq_[i];
    const GpuMethod& m = *methods_[size_t(id)];
    return !decodes(batch[i]) && method_decodes_[size_t(id)] && !plain(m.spec()) &&
           (batch[i].dense || !m.blasst_prefill_active());
  };
  bool mixed = false;
  for (size_t i = 0; i < batch.size() && !mixed; ++i) mixed = moves(i);
  if (!mixed) return;
  if (dense_method_ < 0 || size_t(dense_method_) >= methods_.size() || !methods_[size_t(dense_method_)] ||
      !plain(methods_[size_t(dense_method_)]->spec())) {
    dense_method_ = -1;
    for (size_t i = 0; i < methods_.size() && dense_method_ < 0; ++i)
      if (methods_[i] && plain(methods_[i]->spec())) dense_method_ = int(i);
    if (dense_method_ < 0) {
      const sparse::SparseConfig full = sparse::SparseConfig::parse_spec("full");
      try {
        dense_method_ = add_method(full.to_string(), cuda_sparse_config(full, cfg_, opt_.page_size));
      } catch (const Error&) {
        return;  // every method slot is busy: the groups stay as they are (dense mixed steps)
      }
    }
  }
  // (moves(i) reads only row i's own method id, so rewriting earlier rows changes nothing.)
  for (size_t i = 0; i < batch.size(); ++i)
    if (moves(i)) method_of_seq_[i] = dense_method_;
}

std::vector<uint64_t> CudaModel::blasst_counts(bool prefill) const {
  return methods_[0]->blasst_counts(prefill);
}
void CudaModel::reset_blasst_counts() { methods_[0]->reset_blasst_counts(); }
bool CudaModel::blasst_prefill_active() const { return methods_[0]->blasst_prefill_active(); }
void CudaModel::set_blasst(const CudaSparse& s) {
  methods_[0]->set_blasst(s);
  opt_.sparse = s;
  drop_graphs();
}

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
