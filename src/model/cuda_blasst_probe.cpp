#include "model/cuda_blasst_probe.h"
#if defined(SPADE_HAVE_CUDA)
#include <algorithm>

#include "core/error.h"

namespace spade {
namespace {

// BLASST over full attention, or inside `placement`'s selection (X+blasst) when given.
CudaSparse blasst_config(double lambda, double a, bool decode, const CudaSparse* placement) {
  CudaSparse s;
  if (placement) s = *placement;
  else s.method = CudaSparse::Method::Blasst;
  s.blasst_lambda = lambda;
  s.blasst_a = s.blasst_prefill_a = std::max(0.0, a);
  s.blasst_decode = decode;
  s.blasst_prefill = !decode;
  return s;
}

}  // namespace

CudaBlasstProbe::CudaBlasstProbe(const ModelWeights& w, int64_t max_tokens, bool decode_phase,
                                 const CudaSparse* placement)
    : decode_(decode_phase) {
  if (placement) {
    SPADE_CHECK(placement->blasst_sel, "calibrate --device cuda --sparse: '",
                placement->describe(), "' is not BLASST inside a GPU selector (X+blasst)");
    SPADE_CHECK(decode_phase, "calibrate --device cuda --sparse X+blasst: --phase decode only "
                "(prefill skipping runs the dense prefill kernels whatever the selector: "
                "calibrate the prefill without --sparse)");
    placement_ = std::make_unique<CudaSparse>(*placement);
  }
  CudaModelOptions o;
  o.max_tokens = max_tokens;
  o.max_batch = 1;
  o.max_step_tokens = 4096;
  o.sparse = blasst_config(0.0, 0.0, decode_phase, placement_.get());
  o.sparse.head_dim = w.config.head_dim;
  model_ = std::make_unique<CudaModel>(w, o);
  SPADE_CHECK(decode_ || model_->blasst_prefill_active(), "calibrate --device cuda --phase prefill: "
              "prefill skipping is not active");
}

CudaBlasstProbe::~CudaBlasstProbe() {
  for (auto& [k, pt] : prefixes_) model_->release(pt);
}

double CudaBlasstProbe::measure(int key, const std::vector<int32_t>& toks, int64_t L,
                                int64_t steps, double lambda, double a,
                                std::vector<double>* per_layer) {
  CudaModel& m = *model_;
  std::vector<int64_t> rows;
  // A method with per-request state (LycheeCluster's index) gets a fresh request, prefilled
  // for this measurement alone: its state follows the tokens it was fed, so a prefix rewound
  // for the next lambda would meet an index that already holds the later chunks.
  std::unique_ptr<sparse::MethodState> state = m.new_request_state();
  auto run = [&](PageTable& pt, const int32_t* t, int64_t n) {
    for (int64_t off = 0; off < n; off += 4096) {
      const int64_t k = std::min<int64_t>(4096, n - off);
      m.forward({{&pt, t + off, k, false, nullptr, state.get()}}, rows);
    }
  };
  PageTable scratch;
  PageTable* pt = &scratch;
  if (decode_ && state) {
    SPADE_CHECK(int64_t(toks.size()) >= L + steps, "calibration sample shorter than L + steps");
    m.set_blasst(blasst_config(0.0, 0.0, true, placement_.get()));  // dense prefill (lambda 0)
    run(scratch, toks.data(), L);
  } else if (decode_) {
    SPADE_CHECK(int64_t(toks.size()) >= L + steps, "calibration sample shorter than L + steps");
    auto it = prefixes_.find({key, L});
    if (it == prefixes_.end()) {
      m.set_blasst(blasst_config(0.0, 0.0, true, placement_.get()));  // dense prefill (lambda 0)
      it = prefixes_.emplace(std::make_pair(key, L), PageTable{}).first;
      run(it->second, toks.data(), L);
    }
    pt = &it->second;
    pt->length = L;  // rewind: the steps below rewrite the slots after the prefix
  }
  m.set_blasst(blasst_config(lambda, a, decode_, placement_.get()));
  m.reset_blasst_counts();
  if (decode_)
    for (int64_t i = 0; i < steps; ++i) run(*pt, toks.data() + L + i, 1);
  else
    run(*pt, toks.data(), L);
  const std::vector<uint64_t> c = m.blasst_counts(!decode_);
  if (!decode_ || state) m.release(scratch);
  const int NL = m.config().n_layers, Hkv = m.config().n_kv_heads;
  uint64_t t = 0, k = 0;
  if (per_layer) per_layer->assign(size_t(NL), 0.0);
  for (int l = 0; l < NL; ++l) {
    uint64_t lt = 0, lk = 0;
    for (int h = 0; h < Hkv; ++h) {
      lt += c[(size_t(l) * Hkv + h) * 2];
      lk += c[(size_t(l) * Hkv + h) * 2 + 1];
    }
    if (per_layer) (*per_layer)[size_t(l)] = lt ? double(lk) / double(lt) : 0.0;
    t += lt, k += lk;
  }
  return t ? double(k) / double(t) : 0.0;
}

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
