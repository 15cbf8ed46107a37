// spade's kernels as free functions on raw buffers: the C++ side of the Python kernel API
// (python/spade/ops.py, docs/python.md "Kernel API"), FlashInfer's paged layout.
//
// Paged KV cache of one layer: k, v [n_pages][Hkv][P][D] (the CUDA cache's per-layer layout),
// request b owns pages indices[indptr[b] .. indptr[b + 1]) in token order and holds lens[b]
// tokens (token t of b: page indices[indptr[b] + t / P], slot t % P).
//
// Selection lists (sparse_attention, the selectors' output), CSR int32:
//   sel_off[n_lists + 1], sel_idx[sel_off[n_lists]]; list of (request b, KV head h) =
//   b * lists_per_req + (lists_per_req == 1 ? 0 : h): lists_per_req = Hkv (one list per
//   (request, KV head)) or 1 (one list shared by the KV heads of a request).
//   Entries: token positions in [0, lens[b]) (gran = 1) or units of `gran` tokens, entry u
//   naming tokens [u * gran, u * gran + gran) clipped to lens[b] (gran = P: pages of the
//   request, Quest's lists). Any order; a duplicate counts twice; a list must not be empty.
//
// CPU functions take fp32 or bf16 buffers (all of one call in the same dtype) and compute in
// fp32 (attention: cpu::attend_gathered, sums of the softmax in double); they check every
// index and throw spade::Error naming what is wrong. CUDA functions (SPADE_HAVE_CUDA builds;
// elsewhere they throw spade::Error) take device pointers, bf16, and launch the engine's
// kernels on `stream` (a cudaStream_t) of device `device`; they check sizes, not the contents
// of device buffers.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "sparse/cluster_index.h"

namespace spade::api::ops {

enum class DType : int { F32 = 0, BF16 = 1 };

struct Paged {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t n_pages = 0;
  int Hkv = 0, P = 0, D = 0;
  const int32_t* indptr = nullptr;   // [B + 1]
  const int32_t* indices = nullptr;  // [indptr[B]]
  const int32_t* lens = nullptr;     // [B]
  int B = 0;
};

struct Lists {
  const int32_t* off = nullptr;  // [n_lists + 1]
  const int32_t* idx = nullptr;
  int lists_per_req = 0;  // Hkv or 1
  int gran = 1;           // tokens per entry
};

// Whether this build has the CUDA backend.
bool have_cuda();

// ---- CPU ----
// out[B, Hq, D] = softmax(q . k * scale) . v of each request's query heads (GQA: query head hq
// reads KV head hq / (Hq / Hkv)) over all its tokens (lists == nullptr) or over its list.
void cpu_attention(DType dt, const void* q, int Hq, const Paged& kv, const Lists* lists,
                   float scale, void* out);
// Quest page metadata: meta[page][Hkv][2][D] (min row, then max row; the dtype of k) of the
// first n_valid[i] rows of pages page_ids[i], i < n (an empty page: +inf / -inf).
void cpu_quest_meta(DType dt, const void* k, int64_t n_pages, int Hkv, int P, int D,
                    const int32_t* page_ids, const int32_t* n_valid, int n, void* meta);
// Quest selection (the engine's QuestMethod, group=max, at the KV page size): per (b, h),
// score of page i < n_pages - 1 = max over the G query heads of
// sum_d max(q_d kmax_d, q_d kmin_d) (fp32, d in order); the k_pages - 1 best (ties: lower
// page; NaN last) in ascending order, then the last page; n_pages <= k_pages: every page.
// Writes sel_off[B * Hkv + 1] and the entries (request page numbers) to sel_idx
// (capacity B * Hkv * k_pages).
void cpu_quest_select(DType dt, const void* q, int Hq, const void* meta, const Paged& kv,
                      int k_pages, int32_t* sel_off, int32_t* sel_idx);
// Per-row top-k over scores[r * ld + i], i < n[r] (fp32): the k best (higher score, ties the
// lower index, NaN last) ascending; rows with n[r] <= k get 0..n[r]-1. Writes CSR
// sel_off[n_rows + 1] / sel_idx (capacity n_rows * k).
void cpu_topk_rows(const float* scores, int64_t ld, const int32_t* n, int n_rows, int64_t k,
                   int32_t* sel_off, int32_t* sel_idx);
// LessIsMore (the engine's LessIsMoreMethod::on_scores): per request b of length L from the
// per-query-head scores [B * Hq][ld]: L <= budget: all of [0, L); else the sinks [0, sinks),
// the n_uni = budget - n_recent - sinks tokens of the merge of the heads' top lists over
// [sinks, L - n_recent) by (rank within head, head) without duplicates (ascending), and
// [L - n_recent, L). Writes sel_off[B + 1] / sel_idx (capacity B * budget).
void cpu_lessismore_select(const float* scores, int64_t ld, const int32_t* lens, int B, int Hq,
                           int64_t budget, int64_t n_recent, int64_t sinks, int32_t* sel_off,
                           int32_t* sel_idx);

// Twilight's pruner (the engine's twilight method, keys=int4, head_combine=union): for each
// per-head list (lists->lists_per_req == Hkv; gran 1 or P, page entries expanded to their
// tokens below lens[b]), q.k of every listed token is estimated from the INT4 copy of its key
// (int4_quantize_row of the fp32 key; int4_dot), times `scale`; per query head softmax_weights
// and topp_binary_search(p, eps) keep {w >= threshold}; the KV head keeps the union of its
// G heads' sets in list order. Writes token lists kept_off[B * Hkv + 1] / kept_idx
// (capacity: the lists' tokens).
void cpu_twilight_prune(DType dt, const void* q, int Hq, const Paged& kv, const Lists& lists,
                        double p, double eps, float scale, int32_t* kept_off, int32_t* kept_idx);

// LycheeCluster's hierarchical index of one (layer, KV head), CPU (sparse::ClusterIndex):
// build over the chunks [starts[c], starts[c + 1]) of fp32 keys [L][D] (positions), insert
// the next chunk, search for the G query heads q [G][D]: the token positions (ascending) of
// the chunks chosen within `budget` tokens. The keys are read only during build / insert.
class ClusterIndexOp {
 public:
  void build(const float* keys, int64_t L, int D, const int32_t* starts, int32_t n_chunks,
             const sparse::ClusterIndexOptions& opt);
  void insert(const float* keys, int64_t L, int D, const int32_t* starts, int32_t n_starts);
  std::vector<int32_t> search(const float* q, int G, int D, const sparse::SearchParams& p,
                              const int32_t* starts, int32_t n_starts) const;
  const sparse::ClusterIndex& index() const { return ix_; }

 private:
  sparse::ClusterIndex ix_;
};

// ---- CUDA ----
// Plan/run decode attention: a cuda::AttentionWorkspace in its own device arena (allocated
// once at construction), sized for max_batch decode requests of up to max_pages pages in all.
class CudaDecode {
 public:
  CudaDecode(int device, int max_batch, int64_t max_pages, int Hq, int Hkv, int D, int P);
  ~CudaDecode();
  // Host metadata of a batch (kv.k / kv.v unused); uploads it on `stream` and waits for it.
  void plan(const Paged& kv, uintptr_t stream);
  // out[B, Hq, D] (bf16, device) over the planned batch; launches only (no allocation).
  void run(const void* q, const void* k, const void* v, void* out, float scale,
           uintptr_t stream) const;
  int batch() const;
  size_t arena_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Plan/run sparse decode attention over device lists (cuda::SparseAttention). plan() takes
// host page tables and each list's upper bound of entries (max_entries[n_lists]).
class CudaSparse {
 public:
  CudaSparse(int device, int max_batch, int64_t max_pages, int Hq, int Hkv, int D, int P);
  ~CudaSparse();
  void plan(const Paged& kv, int gran, int lists_per_req, const std::vector<int>& max_entries,
            uintptr_t stream);
  void run(const void* q, const void* k, const void* v, const int32_t* sel_off,
           const int32_t* sel_idx, void* out, float scale, uintptr_t stream) const;
  int batch() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// LycheeCluster's index on the GPU (cuda::LcIndexGpu in an arena of its own): `slots`
// (request, layer) indexes of Hkv heads each, built from a layer's paged bf16 K cache through a
// request's device page table over host chunk starts (absolute positions, n_chunks + 1),
// lazily updated with new chunk ends, searched for a decode batch into Token lists per
// (request, KV head): the sink [0, sink) + the chosen chunks + the un-indexed tail
// [starts[n_chunks], kv_len), CSR sel_off[B * Hkv + 1] / sel_idx (capacity B * Hkv * cap).
// build / insert wait for their uploads (the host arrays may go after the call).
class CudaClusterIndex {
 public:
  CudaClusterIndex(int device, int slots, int Hkv, int D, int P, int max_chunks,
                   double chunks_per_fine, int max_coarse, int iterations);
  ~CudaClusterIndex();
  void reset(int slot, uintptr_t stream);
  void build(int slot, const void* k_cache, const int32_t* page_table, const int32_t* starts,
             int n_chunks, uintptr_t stream);
  void insert(int slot, const void* k_cache, const int32_t* page_table, int n_old,
              const int32_t* new_ends, int n_new, uintptr_t stream);
  // q [B, Hq, D] bf16; slot / kv_len [B] device; lists [B * Hkv * cap], counts [B * Hkv]
  // device scratch.
  void search(const void* q, const int32_t* slot, const int32_t* kv_len, int B, int Hq,
              int64_t budget, int coarse_topk, double coarse_cover, int sink, int cap,
              int32_t* lists, int32_t* counts, int32_t* sel_off, int32_t* sel_idx,
              uintptr_t stream) const;
  size_t arena_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Device pointers: as the CPU twins, bf16. scores: fp32 scratch [B * Hkv * max_pages].
void cuda_quest_meta(int device, const void* k, int Hkv, int P, int D, const int32_t* page_ids,
                     const int32_t* n_valid, int n, void* meta, uintptr_t stream);
void cuda_quest_select(int device, const void* q, int Hq, const void* meta, const Paged& kv,
                       int max_pages, int k_pages, float* scores, int32_t* sel_off,
                       int32_t* sel_idx, uintptr_t stream);
// Rows r = b * H + h of scores [B * H][ld] over the first lens[b] entries; scratch:
// row_n [B * H], strided [B * H * k] int32.
void cuda_topk_rows(int device, const float* scores, int64_t ld, const int32_t* lens, int B,
                    int H, int k, int32_t* row_n, int32_t* strided, int32_t* sel_off,
                    int32_t* sel_idx, uintptr_t stream);
// Twilight's pruner on the GPU (cuda::TwilightPruner in an arena of its own, built per call):
// INT4 keys of the pages page_ids[n] (n_valid rows each) into codes [pages][Hkv][P][D/2] /
// sz [pages][Hkv][P], then estimate + top-p + compaction of the per-head lists (gran 1 or
// 16) into kept_off[B * Hkv + 1] / kept_idx (capacity B * Hkv * max_slots; max_slots: the
// longest list's tokens).
void cuda_twilight_prune(int device, const void* q, int Hq, const Paged& kv,
                         const int32_t* page_ids, const int32_t* n_valid, int n, uint8_t* codes,
                         uint32_t* sz, const int32_t* sel_off, const int32_t* sel_idx, int gran,
                         int max_slots, double p, double eps, float scale, int32_t* kept_off,
                         int32_t* kept_idx, uintptr_t stream);
// Scratch bytes (device) cuda_lessismore_select needs, one buffer.
size_t cuda_lessismore_scratch_bytes(int B, int Hq, int64_t ld, int64_t n_uni);
void cuda_lessismore_select(int device, const float* scores, int64_t ld, const int32_t* lens,
                            int B, int Hq, int budget, int n_recent, int sinks, void* scratch,
                            int32_t* sel_off, int32_t* sel_idx, uintptr_t stream);

}  // namespace spade::api::ops
