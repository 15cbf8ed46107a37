// spade's CUDA kernels as free functions and plan/run objects on raw device buffers (ops.h):
// decode and sparse attention, Quest, the token selectors, Twilight, LycheeCluster's GPU index;
// in a build without nvcc every entry point throws spade::Error. The CPU paths and the shared
// argument checks are in ops.cpp / ops_checks.h.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>

#include "api/ops.h"
#include "api/ops_checks.h"
#include "core/error.h"

#if SPADE_HAVE_CUDA
#include "backend/cuda/attention.h"
#include "backend/cuda/cluster_index.h"
#include "backend/cuda/cuda_common.h"
#include "backend/cuda/sparse_attention.h"
#include "backend/cuda/twilight.h"
#endif

namespace spade::api::ops {
using namespace detail;

#if SPADE_HAVE_CUDA
namespace {

// Makes `device` current for the scope (restores the caller's device after).
struct DeviceScope {
  int prev = 0;
  explicit DeviceScope(int device) {
    SPADE_CUDA(cudaGetDevice(&prev));
    if (prev != device) SPADE_CUDA(cudaSetDevice(device));
  }
  ~DeviceScope() {
    int cur = 0;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
  }
};

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

void host_batch(const Paged& kv, std::vector<cuda::AttnSeq>& out) {
  check_paged(kv);
  out.resize(size_t(kv.B));
  for (int b = 0; b < kv.B; ++b) {
    cuda::AttnSeq& s = out[size_t(b)];
    s.pages = kv.indices + kv.indptr[b];
    s.n_pages = int(pages_of(kv.lens[b], kv.P));
    s.kv_len = kv.lens[b];
    s.q_len = 1;
  }
}

}  // namespace

namespace {

// What the plan / run ops (DecodeAttention, SparseAttention) are made for: the device, the
// largest batch and page count a plan may take, the heads and page shape; B: the planned batch.
struct OpShape {
  int device = 0, max_batch = 0, Hq = 0, Hkv = 0, D = 0, P = 0;
  int64_t max_pages = 0;
  std::unique_ptr<cuda::DeviceArena> arena;
  int B = -1;
};

// Checks the constructor's arguments of op `name` (a clear error for each), that the current
// device is supported (the caller holds a DeviceScope of `device`), and records them.
void init_shape(OpShape& m, const char* name, int device, int max_batch, int64_t max_pages, int Hq,
                int Hkv, int D, int P) {
  SPADE_CHECK(max_batch >= 1 && max_pages >= 1, name, ": max_batch and max_pages must be >= 1");
  SPADE_CHECK(Hq > 0 && Hkv > 0 && Hq % Hkv == 0, "query heads (", Hq,
              ") must be a multiple of the KV heads (", Hkv, ")");
  cuda::check_device_supported();
  m.device = device, m.max_batch = max_batch, m.Hq = Hq, m.Hkv = Hkv, m.D = D, m.P = P;
  m.max_pages = max_pages;
}

}  // namespace

struct CudaDecode::Impl : OpShape {
  std::unique_ptr<cuda::AttentionWorkspace> ws;
  std::vector<cuda::AttnSeq> seqs;
};

CudaDecode::CudaDecode(int device, int max_batch, int64_t max_pages, int Hq, int Hkv, int D, int P)
    : impl_(std::make_unique<Impl>()) {
  DeviceScope ds(device);
  Impl& m = *impl_;
  init_shape(m, "DecodeAttention", device, max_batch, max_pages, Hq, Hkv, D, P);
  cuda::AttnLimits lim;
  lim.max_batch = max_batch;
  lim.max_q_tokens = max_batch;  // decode: one query token per request
  lim.max_pages = max_pages;
  m.arena = std::make_unique<cuda::DeviceArena>(cuda::AttentionWorkspace::arena_bytes(lim, Hq, Hkv, D));
  m.ws = std::make_unique<cuda::AttentionWorkspace>(*m.arena, lim, Hq, Hkv, D, P);
}

CudaDecode::~CudaDecode() {
  if (impl_) {
    DeviceScope ds(impl_->device);
    impl_->ws.reset();
    impl_->arena.reset();
  }
}

void CudaDecode::plan(const Paged& kv, uintptr_t stream) {
  Impl& m = *impl_;
  SPADE_CHECK(kv.B >= 1 && kv.B <= m.max_batch, "DecodeAttention.plan: batch ", kv.B,
              " is outside [1, max_batch = ", m.max_batch, "]");
  SPADE_CHECK(kv.Hkv == m.Hkv && kv.P == m.P && kv.D == m.D, "DecodeAttention.plan: KV shape differs from the constructor's");
  host_batch(kv, m.seqs);
  int64_t total = 0;
  for (const auto& s : m.seqs) total += s.n_pages;
  SPADE_CHECK(total <= m.max_pages, "DecodeAttention.plan: the batch reads ", total,
              " pages, more than max_pages = ", m.max_pages);
  DeviceScope ds(m.device);
  m.ws->plan(m.seqs, as_stream(stream));
  m.B = kv.B;
}

void CudaDecode::run(const void* q, const void* k, const void* v, void* out, float scale,
                     uintptr_t stream) const {
  const Impl& m = *impl_;
  SPADE_CHECK(m.B >= 1, "DecodeAttention.run before plan()");
  DeviceScope ds(m.device);
  m.ws->run(static_cast<const cuda::bf16*>(q), static_cast<const cuda::bf16*>(k),
            static_cast<const cuda::bf16*>(v), static_cast<cuda::bf16*>(out), scale,
            as_stream(stream));
}

int CudaDecode::batch() const { return impl_->B; }
size_t CudaDecode::arena_bytes() const { return impl_->arena->capacity(); }

struct CudaSparse::Impl : OpShape {
  std::unique_ptr<cuda::SparseAttention> sp;
  std::vector<cuda::SparseSeq> seqs;
};

CudaSparse::CudaSparse(int device, int max_batch, int64_t max_pages, int Hq, int Hkv, int D, int P)
    : impl_(std::make_unique<Impl>()) {
  DeviceScope ds(device);
  Impl& m = *impl_;
  init_shape(m, "SparseAttention", device, max_batch, max_pages, Hq, Hkv, D, P);
  m.arena = std::make_unique<cuda::DeviceArena>(
      cuda::SparseAttention::arena_bytes(max_batch, max_pages, Hq, Hkv, D));
  m.sp = std::make_unique<cuda::SparseAttention>(*m.arena, max_batch, max_pages, Hq, Hkv, D, P);
}

CudaSparse::~CudaSparse() {
  if (impl_) {
    DeviceScope ds(impl_->device);
    impl_->sp.reset();
    impl_->arena.reset();
  }
}

void CudaSparse::plan(const Paged& kv, int gran, int lists_per_req,
                      const std::vector<int>& max_entries, uintptr_t stream) {
  Impl& m = *impl_;
  SPADE_CHECK(kv.B >= 1 && kv.B <= m.max_batch, "SparseAttention.plan: batch ", kv.B,
              " is outside [1, max_batch = ", m.max_batch, "]");
  SPADE_CHECK(kv.Hkv == m.Hkv && kv.P == m.P && kv.D == m.D, "SparseAttention.plan: KV shape differs from the constructor's");
  SPADE_CHECK(lists_per_req == m.Hkv || lists_per_req == 1, "lists per request must be ", m.Hkv,
              " or 1, not ", lists_per_req);
  SPADE_CHECK(int64_t(max_entries.size()) == int64_t(kv.B) * lists_per_req,
              "SparseAttention.plan: ", max_entries.size(), " list bounds for ",
              int64_t(kv.B) * lists_per_req, " lists");
  cuda::SelGran g;
  if (gran == 1) g = cuda::SelGran::Token;
  else if (gran == 16) g = cuda::SelGran::Chunk16;
  else if (gran == 64) g = cuda::SelGran::Block64;
  else fail("the CUDA sparse attention reads lists of tokens, 16-token or 64-token units, not ", gran, "-token units");
  check_paged(kv);
  m.seqs.resize(size_t(kv.B));
  int64_t total = 0;
  for (int b = 0; b < kv.B; ++b) {
    cuda::SparseSeq& s = m.seqs[size_t(b)];
    s.pages = kv.indices + kv.indptr[b];
    s.n_pages = int(pages_of(kv.lens[b], kv.P));
    s.kv_len = kv.lens[b];
    total += s.n_pages;
  }
  SPADE_CHECK(total <= m.max_pages, "SparseAttention.plan: the batch reads ", total,
              " pages, more than max_pages = ", m.max_pages);
  DeviceScope ds(m.device);
  m.sp->plan(m.seqs, g, lists_per_req, max_entries, nullptr, as_stream(stream));
  SPADE_CUDA(cudaStreamSynchronize(as_stream(stream)));
  m.B = kv.B;
}

void CudaSparse::run(const void* q, const void* k, const void* v, const int32_t* sel_off,
                     const int32_t* sel_idx, void* out, float scale, uintptr_t stream) const {
  const Impl& m = *impl_;
  SPADE_CHECK(m.B >= 1, "SparseAttention.run before plan()");
  DeviceScope ds(m.device);
  m.sp->run(static_cast<const cuda::bf16*>(q), static_cast<const cuda::bf16*>(k),
            static_cast<const cuda::bf16*>(v), sel_off, sel_idx, static_cast<cuda::bf16*>(out),
            scale, as_stream(stream));
}

int CudaSparse::batch() const { return impl_->B; }

void cuda_quest_meta(int device, const void* k, int Hkv, int P, int D, const int32_t* page_ids,
                     const int32_t* n_valid, int n, void* meta, uintptr_t stream) {
  if (n == 0) return;
  DeviceScope ds(device);
  cuda::quest_update_meta(static_cast<const cuda::bf16*>(k), static_cast<cuda::bf16*>(meta),
                          page_ids, n_valid, n, Hkv, P, D, as_stream(stream));
}

void cuda_quest_select(int device, const void* q, int Hq, const void* meta, const Paged& kv,
                       int max_pages, int k_pages, float* scores, int32_t* sel_off,
                       int32_t* sel_idx, uintptr_t stream) {
  SPADE_CHECK(kv.P == 16, "the CUDA quest_select works on pages of 16 tokens (page_size ", kv.P, ")");
  SPADE_CHECK(k_pages >= 1 && max_pages >= 1, "quest_select: k_pages and max_pages must be >= 1");
  DeviceScope ds(device);
  cuda::QuestArgs a{static_cast<const cuda::bf16*>(q), static_cast<const cuda::bf16*>(meta),
                    kv.indices, kv.indptr, kv.lens, scores, sel_idx, kv.B, Hq, kv.Hkv, kv.D,
                    max_pages, k_pages};
  a.csr_off = sel_off;
  cuda::quest_select(a, as_stream(stream));
}

void cuda_topk_rows(int device, const float* scores, int64_t ld, const int32_t* lens, int B,
                    int H, int k, int32_t* row_n, int32_t* strided, int32_t* sel_off,
                    int32_t* sel_idx, uintptr_t stream) {
  SPADE_CHECK(k >= 1, "top-k: k must be >= 1 (got ", k, ")");
  DeviceScope ds(device);
  cudaStream_t s = as_stream(stream);
  cuda::row_lengths(lens, B, H, row_n, s);
  cuda::topk_rows(scores, ld, row_n, B * H, k, strided, s);
  cuda::token_compact_lists(strided, lens, B, H, k, sel_off, sel_idx, s);
}

void cuda_twilight_prune(int device, const void* q, int Hq, const Paged& kv,
                         const int32_t* page_ids, const int32_t* n_valid, int n, uint8_t* codes,
                         uint32_t* sz, const int32_t* sel_off, const int32_t* sel_idx, int gran,
                         int max_slots, double p, double eps, float scale, int32_t* kept_off,
                         int32_t* kept_idx, uintptr_t stream) {
  SPADE_CHECK(gran == 1 || gran == 16, "the CUDA twilight_prune reads token lists or 16-token "
              "pages, not ", gran, "-token units");
  SPADE_CHECK(max_slots >= 1 && kv.B >= 1, "twilight_prune: bad sizes");
  DeviceScope ds(device);
  cudaStream_t s = as_stream(stream);
  if (n > 0)
    cuda::int4_quantize_pages(static_cast<const cuda::bf16*>(kv.k), codes, sz, page_ids, n_valid,
                              n, kv.Hkv, kv.P, kv.D, s);
  cuda::DeviceArena arena(cuda::TwilightPruner::arena_bytes(kv.B, Hq, kv.Hkv, max_slots));
  cuda::TwilightPruner pr(arena, kv.B, Hq, kv.Hkv, kv.D, kv.P, max_slots, p, eps);
  cuda::TwilightStep st;
  st.q = static_cast<const cuda::bf16*>(q);
  st.codes = codes;
  st.sz = sz;
  st.page_table = kv.indices, st.page_off = kv.indptr, st.kv_len = kv.lens;
  st.base_off = sel_off, st.base_idx = sel_idx;
  st.gran = gran == 1 ? cuda::SelGran::Token : cuda::SelGran::Chunk16;
  st.B = kv.B;
  st.scale = scale;
  pr.run(st, s);
  pr.compact(st, s);
  const size_t lists = size_t(kv.B) * size_t(kv.Hkv);
  SPADE_CUDA(cudaMemcpyAsync(kept_off, pr.kept_off(), sizeof(int32_t) * (lists + 1),
                             cudaMemcpyDeviceToDevice, s));
  SPADE_CUDA(cudaMemcpyAsync(kept_idx, pr.kept_idx(), sizeof(int32_t) * lists * size_t(max_slots),
                             cudaMemcpyDeviceToDevice, s));
  SPADE_CUDA(cudaStreamSynchronize(s));  // the arena goes with this call
}

struct CudaClusterIndex::Impl {
  int device;
  std::unique_ptr<cuda::DeviceArena> arena;
  std::unique_ptr<cuda::LcIndexGpu> ix;
};

CudaClusterIndex::CudaClusterIndex(int device, int slots, int Hkv, int D, int P, int max_chunks,
                                   double chunks_per_fine, int max_coarse, int iterations)
    : impl_(std::make_unique<Impl>()) {
  SPADE_CHECK(slots >= 1 && Hkv >= 1 && max_chunks >= 1, "CudaClusterIndex: bad sizes");
  DeviceScope ds(device);
  cuda::check_device_supported();
  cuda::LcIndexConfig c;
  c.slots = slots, c.Hkv = Hkv, c.D = D, c.P = P, c.max_chunks = max_chunks;
  c.chunks_per_fine = chunks_per_fine, c.max_coarse = max_coarse, c.iterations = iterations;
  impl_->device = device;
  impl_->arena = std::make_unique<cuda::DeviceArena>(cuda::LcIndexGpu::arena_bytes(c));
  impl_->ix = std::make_unique<cuda::LcIndexGpu>(*impl_->arena, c);
}

CudaClusterIndex::~CudaClusterIndex() {
  if (impl_) {
    DeviceScope ds(impl_->device);
    impl_->ix.reset();
    impl_->arena.reset();
  }
}

void CudaClusterIndex::reset(int slot, uintptr_t stream) {
  SPADE_CHECK(slot >= 0 && slot < impl_->ix->config().slots, "CudaClusterIndex: slot ", slot,
              " outside [0, ", impl_->ix->config().slots, ")");
  DeviceScope ds(impl_->device);
  impl_->ix->reset(slot, as_stream(stream));
}

void CudaClusterIndex::build(int slot, const void* k_cache, const int32_t* page_table,
                             const int32_t* starts, int n_chunks, uintptr_t stream) {
  const cuda::LcIndexConfig& c = impl_->ix->config();
  SPADE_CHECK(slot >= 0 && slot < c.slots, "CudaClusterIndex: slot ", slot, " outside [0, ",
              c.slots, ")");
  SPADE_CHECK(n_chunks >= 1 && n_chunks <= c.max_chunks, "CudaClusterIndex.build: ", n_chunks,
              " chunks, outside [1, max_chunks = ", c.max_chunks, "]");
  check_starts(starts, n_chunks + 1, INT32_MAX);
  DeviceScope ds(impl_->device);
  impl_->ix->build(slot, static_cast<const cuda::bf16*>(k_cache), page_table, starts, n_chunks,
                   as_stream(stream));
  SPADE_CUDA(cudaStreamSynchronize(as_stream(stream)));
}

void CudaClusterIndex::insert(int slot, const void* k_cache, const int32_t* page_table, int n_old,
                              const int32_t* new_ends, int n_new, uintptr_t stream) {
  const cuda::LcIndexConfig& c = impl_->ix->config();
  SPADE_CHECK(slot >= 0 && slot < c.slots, "CudaClusterIndex: slot ", slot, " outside [0, ",
              c.slots, ")");
  SPADE_CHECK(n_new >= 1 && n_old >= 1 && n_old + n_new <= c.max_chunks,
              "CudaClusterIndex.insert: ", n_old, " + ", n_new, " chunks, past max_chunks = ",
              c.max_chunks, " (or nothing to insert)");
  for (int i = 1; i < n_new; ++i)
    SPADE_CHECK(new_ends[i] > new_ends[i - 1], "CudaClusterIndex.insert: new chunk ends must "
                "increase strictly");
  DeviceScope ds(impl_->device);
  impl_->ix->insert(slot, static_cast<const cuda::bf16*>(k_cache), page_table, n_old, new_ends,
                    n_new, as_stream(stream));
  SPADE_CUDA(cudaStreamSynchronize(as_stream(stream)));
}

void CudaClusterIndex::search(const void* q, const int32_t* slot, const int32_t* kv_len, int B,
                              int Hq, int64_t budget, int coarse_topk, double coarse_cover,
                              int sink, int cap, int32_t* lists, int32_t* counts,
                              int32_t* sel_off, int32_t* sel_idx, uintptr_t stream) const {
  const cuda::LcIndexConfig& c = impl_->ix->config();
  SPADE_CHECK(B >= 1 && Hq >= c.Hkv && Hq % c.Hkv == 0, "CudaClusterIndex.search: bad batch / heads");
  DeviceScope ds(impl_->device);
  cuda::LcSearchArgs a;
  a.q = static_cast<const cuda::bf16*>(q);
  a.slot = slot, a.kv_len = kv_len, a.B = B, a.Hq = Hq;
  a.budget = budget, a.coarse_topk = coarse_topk, a.coarse_cover = coarse_cover;
  a.sink = sink, a.cap = cap, a.lists = lists, a.counts = counts;
  impl_->ix->search(a, as_stream(stream));
  cuda::LcIndexGpu::compact(lists, counts, B * c.Hkv, cap, sel_off, sel_idx, as_stream(stream));
}

size_t CudaClusterIndex::arena_bytes() const { return impl_->arena->capacity(); }

namespace {
struct LimScratch {
  size_t row_n, head_top, keys, merged, topk, total;
};
LimScratch lim_scratch(int B, int Hq, int64_t ld, int64_t n_uni) {
  LimScratch s{};
  size_t o = 0;
  auto take = [&](size_t bytes) {
    const size_t at = o;
    o = cuda::align_up(o + bytes, 256);
    return at;
  };
  s.row_n = take(sizeof(int32_t) * size_t(B * Hq + B));
  s.head_top = take(sizeof(int32_t) * size_t(B * Hq) * size_t(n_uni));
  s.keys = take(sizeof(float) * size_t(B) * size_t(ld));
  s.merged = take(sizeof(int32_t) * size_t(B) * size_t(n_uni));
  s.topk = cuda::topk_long_applies(ld, int(n_uni))
               ? take(cuda::topk_long_scratch_bytes(B * Hq, ld, int(n_uni)))
               : SIZE_MAX;
  s.total = o;
  return s;
}
}  // namespace

size_t cuda_lessismore_scratch_bytes(int B, int Hq, int64_t ld, int64_t n_uni) {
  return lim_scratch(B, Hq, ld, n_uni).total;
}

void cuda_lessismore_select(int device, const float* scores, int64_t ld, const int32_t* lens,
                            int B, int Hq, int budget, int n_recent, int sinks, void* scratch,
                            int32_t* sel_off, int32_t* sel_idx, uintptr_t stream) {
  const int n_uni = budget - n_recent - sinks;
  SPADE_CHECK(n_recent >= 0 && sinks >= 0 && n_uni >= 1, "lessismore_select: budget (", budget,
              ") must exceed n_recent (", n_recent, ") + sinks (", sinks, ")");
  const LimScratch sc = lim_scratch(B, Hq, ld, n_uni);
  char* base = static_cast<char*>(scratch);
  cuda::LessIsMoreArgs a;
  a.scores = scores, a.ld = ld, a.kv_len = lens, a.B = B, a.Hq = Hq;
  a.budget = budget, a.n_recent = n_recent, a.sinks = sinks, a.n_uni = n_uni;
  a.row_n = reinterpret_cast<int32_t*>(base + sc.row_n);
  a.head_top = reinterpret_cast<int32_t*>(base + sc.head_top);
  a.keys = reinterpret_cast<float*>(base + sc.keys);
  a.merged_top = reinterpret_cast<int32_t*>(base + sc.merged);
  a.topk_scratch = sc.topk == SIZE_MAX ? nullptr : base + sc.topk;
  a.sel_off = sel_off, a.sel_idx = sel_idx;
  DeviceScope ds(device);
  cuda::lessismore_select(a, as_stream(stream));
}

#else  // !SPADE_HAVE_CUDA

namespace {
[[noreturn]] void no_cuda() {
  fail("this spade build has no CUDA backend (built without nvcc): CUDA tensors are not supported");
}
}  // namespace

struct CudaDecode::Impl {};
CudaDecode::CudaDecode(int, int, int64_t, int, int, int, int) { no_cuda(); }
CudaDecode::~CudaDecode() = default;
void CudaDecode::plan(const Paged&, uintptr_t) { no_cuda(); }
void CudaDecode::run(const void*, const void*, const void*, void*, float, uintptr_t) const { no_cuda(); }
int CudaDecode::batch() const { return -1; }
size_t CudaDecode::arena_bytes() const { return 0; }
struct CudaSparse::Impl {};
CudaSparse::CudaSparse(int, int, int64_t, int, int, int, int) { no_cuda(); }
CudaSparse::~CudaSparse() = default;
void CudaSparse::plan(const Paged&, int, int, const std::vector<int>&, uintptr_t) { no_cuda(); }
void CudaSparse::run(const void*, const void*, const void*, const int32_t*, const int32_t*, void*,
                     float, uintptr_t) const {
  no_cuda();
}
int CudaSparse::batch() const { return -1; }
void cuda_quest_meta(int, const void*, int, int, int, const int32_t*, const int32_t*, int, void*,
                     uintptr_t) {
  no_cuda();
}
void cuda_quest_select(int, const void*, int, const void*, const Paged&, int, int, float*,
                       int32_t*, int32_t*, uintptr_t) {
  no_cuda();
}
void cuda_topk_rows(int, const float*, int64_t, const int32_t*, int, int, int, int32_t*,
                    int32_t*, int32_t*, int32_t*, uintptr_t) {
  no_cuda();
}
void cuda_twilight_prune(int, const void*, int, const Paged&, const int32_t*, const int32_t*, int,
                         uint8_t*, uint32_t*, const int32_t*, const int32_t*, int, int, double,
                         double, float, int32_t*, int32_t*, uintptr_t) {
  no_cuda();
}
struct CudaClusterIndex::Impl {};
CudaClusterIndex::CudaClusterIndex(int, int, int, int, int, int, double, int, int) { no_cuda(); }
CudaClusterIndex::~CudaClusterIndex() = default;
void CudaClusterIndex::reset(int, uintptr_t) { no_cuda(); }
void CudaClusterIndex::build(int, const void*, const int32_t*, const int32_t*, int, uintptr_t) {
  no_cuda();
}
void CudaClusterIndex::insert(int, const void*, const int32_t*, int, const int32_t*, int,
                              uintptr_t) {
  no_cuda();
}
void CudaClusterIndex::search(const void*, const int32_t*, const int32_t*, int, int, int64_t, int,
                              double, int, int, int32_t*, int32_t*, int32_t*, int32_t*,
                              uintptr_t) const {
  no_cuda();
}
size_t CudaClusterIndex::arena_bytes() const { return 0; }
size_t cuda_lessismore_scratch_bytes(int, int, int64_t, int64_t) { return 0; }
void cuda_lessismore_select(int, const float*, int64_t, const int32_t*, int, int, int, int, int,
                            void*, int32_t*, int32_t*, uintptr_t) {
  no_cuda();
}

#endif

}  // namespace spade::api::ops
