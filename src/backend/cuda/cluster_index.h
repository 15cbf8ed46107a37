// LycheeCluster's hierarchical index on the GPU (the CPU reference: sparse/cluster_index.h,
// docs/lycheecluster.md; this file: docs/cuda_lycheecluster.md). Token bound space (the CPU
// default), fp16 centers, mean pooling, stride-seeded spherical k-means.
//
// One LcIndexGpu holds the indexes of `slots` (request, layer) pairs, each with Hkv heads,
// in fixed-capacity device arrays taken from a DeviceArena at construction:
//   per slot        starts[max_chunks + 1] int32 (absolute token positions, from the CPU
//                   chunker), n_chunks
//   per (slot, h)   fine  : c16 [D/8][max_fine][8] fp16 (piece-major: the 16-byte pieces of
//                           all nodes' dims 8p..8p+7 side by side), radius/tokens/count/head/
//                           tail/nch [max_fine]
//                   coarse: c16 [D/8][max_coarse][8] fp16, radius/tokens/count [max_coarse],
//                           first[max_coarse + 1] (fine ids of unit g: [first[g], first[g+1]))
//                   chunk : next[max_chunks] (per-fine linked lists in position order),
//                           fine_of[max_chunks]
//                   n_fine, n_coarse
// Build scratch (chunk keys, k-means state) is a separate arena region used by build() only.
//
// Build (one slot = one request's one layer; a launch sequence covers a group of slots, all
// Hkv heads of each: the k-means problems of every (slot, head) side by side):
//   pool      chunk means (double, token order: bit-identical to the CPU) -> unit chunk keys
//   k-means   fine: K = ceil(M / chunks_per_fine) over the chunk keys; coarse:
//             P = min(max_coarse, ceil(sqrt(NF))) over the fine centroids; per-head N, K live
//             on the device (no host sync inside the build)
//   assemble  fine ids renumbered (stable by coarse unit), per-fine chunk lists, centers
//             (token-weighted means of raw keys, fp16), covering radii over every token
//             (double distances, rounded up to float like round_up_float)
// Search (decode, one CTA per (request, KV head)): coarse bound max_g(q_g.c + |q_g| r), ranked
// (ties: lower id), k_g = coarse_topk or the auto cover rule; candidate fine clusters (fine
// ids ascending) ranked by the same bound (ties: lower candidate position = lower fine id);
// chunks of the ranked clusters in position order, a chunk that does not fit the remaining
// budget skipped. Output: Token lists = sink [0, sink) + chosen chunks (ascending) + the
// un-indexed tail [starts[n_chunks], kv_len), written strided then compacted to CSR
// (sel_off / sel_idx, lists_per_req = Hkv, as SparseAttention::run takes them).
// Lazy update (decode): new chunks (their boundaries appended on the host with
// append_chunks) inserted in order, one CTA per (slot, head): nearest coarse unit by cosine,
// nearest fine cluster of it, running-mean centers, r' = max(r + |c' - c|, max |k - c'|).
#pragma once
#include <cstdint>
#include <vector>

#include <cuda_fp16.h>

#include "backend/cuda/cuda_common.h"

namespace spade::cuda {

struct LcIndexConfig {
  int slots = 1;           // (request, layer) indexes held
  int Hkv = 8, D = 128, P = 16;
  int max_chunks = 8192;   // chunks per slot, inserts included (<= 16384: block sorts)
  double chunks_per_fine = 2.0;
  int max_coarse = 64;
  int iterations = 10;
  // Build scratch in (slot, head) pairs: build_batch() builds this many heads per launch
  // sequence (a multiple of Hkv; 0 = Hkv, one slot at a time).
  int build_heads = 0;
  // Requests of one search() at most (0: slots). Where a block's shared memory cannot hold the
  // search's working arrays (sm_86 / 89 beyond ~4K chunks; never on Hopper up to 16384 chunks and
  // 8 query heads per KV head), they live in a global scratch of search_batch * Hkv regions of
  // up to ~210 KB.
  int search_batch = 0;
  // Tests: the search's working arrays (but q) and the build's block sorts in global memory, as
  // where the GPU's shared memory per block is too small for them (the same results).
  bool spill_smem = false;
};

// One (request, layer) index to build: chunks [0, n_chunks) of `starts` (host, n_chunks + 1
// absolute positions) from k_cache (that layer's [page][Hkv][P][D] bf16) through page_table
// (device page ids of the request in token order). Entries of one batch may share `starts`
// (the layers of one request): it is uploaded once.
struct LcBuild {
  int slot = 0;
  const bf16* k_cache = nullptr;
  const int32_t* page_table = nullptr;
  const int32_t* starts = nullptr;
  int n_chunks = 0;
};

// One request's lazy update: chunks [n_old, n_old + n_new) of `slot` end at new_ends[i]
// (host); page_table: the request's device page ids in token order.
struct LcInsert {
  int slot = 0;
  const int32_t* page_table = nullptr;
  int n_old = 0;
  const int32_t* new_ends = nullptr;
  int n_new = 0;
  const bf16* k_cache = nullptr;  // its layer's K cache; null: insert_batch's k_cache
};

constexpr int kLcTraceSlots = 16;  // LcSearchArgs::trace entries per list
struct LcSearchArgs {
  const bf16* q = nullptr;          // [B, Hq, D]
  const int32_t* slot = nullptr;    // [B] device: slot of each request
  const int32_t* kv_len = nullptr;  // [B] device
  int B = 0, Hq = 0;
  int64_t budget = 1024;
  bool budget_total = false;        // the budget includes the sink and the un-indexed tail
  int coarse_topk = 0;              // 0: auto cover rule
  double coarse_cover = 4.0;
  int sink = 16;
  int cap = 0;                      // entries per strided list (>= sink + budget + recent)
  int32_t* lists = nullptr;         // [B * Hkv][cap] strided output
  int32_t* counts = nullptr;        // [B * Hkv]
  int32_t* chosen = nullptr;        // optional [B * Hkv]: chunk tokens chosen
  unsigned long long* trace = nullptr;  // optional [B * Hkv][kLcTraceSlots]: phase timestamps (ns, bench)
};

class LcIndexGpu {
 public:
  LcIndexGpu(DeviceArena& arena, const LcIndexConfig& cfg);
  ~LcIndexGpu();
  LcIndexGpu(const LcIndexGpu&) = delete;
  LcIndexGpu& operator=(const LcIndexGpu&) = delete;
  // Arena bytes the constructor takes for `cfg` (sizing a DeviceArena up front).
  static size_t arena_bytes(const LcIndexConfig& cfg);
  // The largest build_heads for `cfg` (a multiple of Hkv, at most slots * Hkv, at least Hkv)
  // whose build scratch takes at most `bytes`.
  static int build_heads_within(const LcIndexConfig& cfg, size_t bytes);

  // Empties slot `slot` (async on s): no chunks, so search() lists every token [0, kv_len).
  // A (request, layer) slot handed to a new request is reset first.
  void reset(int slot, cudaStream_t s);

  // Builds slot `slot` over chunks [0, n_chunks) of `starts` (host, n_chunks + 1 entries,
  // absolute positions) from this layer's K cache (k: [page][Hkv][P][D] bf16; page_table:
  // device page ids of the request in token order). Uploads the starts (async on s).
  void build(int slot, const bf16* k_cache, const int32_t* page_table, const int32_t* starts,
             int n_chunks, cudaStream_t s);
  // Several builds (distinct slots; any requests and layers) in launch sequences of up to
  // config().build_heads (slot, head) pairs each: every k-means and assembly kernel covers the
  // whole group, so a request's first sparse step builds all its layers in a few sequences
  // instead of one per layer. The same result per slot as build().
  void build_batch(const std::vector<LcBuild>& builds, cudaStream_t s);
  // Appends chunk boundaries: the new chunks [n_old, n_old + n_new) end at new_ends[0..n_new)
  // (host), then inserts them (lazy update) into every head of the slot. n_old is the slot's
  // chunk count as known by the host.
  void insert(int slot, const bf16* k_cache, const int32_t* page_table, int n_old,
              const int32_t* new_ends, int n_new, cudaStream_t s);
  // The same for several requests or layers (distinct slots; each LcInsert's k_cache, or
  // `k_cache` where it is null) in one launch per 16 slots and <= 32 chunks each.
  void insert_batch(const std::vector<LcInsert>& reqs, const bf16* k_cache, cudaStream_t s);
  // Selection lists for a decode batch (strided; then compact() for CSR).
  void search(const LcSearchArgs& a, cudaStream_t s) const;
  // Strided lists -> CSR sel_off[n_lists + 1] / sel_idx (one CTA).
  static void compact(const int32_t* lists, const int32_t* counts, int n_lists, int cap,
                      int32_t* sel_off, int32_t* sel_idx, cudaStream_t s);

  // Bench: record events between the build phases (pool, fine k-means, coarse k-means,
  // assembly); build_phase_ms() synchronizes and returns the 4 durations of the last build.
  void set_build_timing(bool on);
  std::vector<float> build_phase_ms() const;

  const LcIndexConfig& config() const { return cfg_; }
  int build_heads() const { return build_heads_; }
  int max_fine() const { return max_fine_; }

  // Device views (tests): per (slot, head) arrays.
  struct Host {  // downloaded copy of one (slot, head)
    int n_fine = 0, n_coarse = 0, n_chunks = 0;
    std::vector<float> fine_c, coarse_c;  // [n][D] as stored (fp16 -> float)
    std::vector<float> fine_r, coarse_r;
    std::vector<int32_t> fine_tokens, coarse_tokens, fine_count, coarse_count;
    std::vector<int32_t> coarse_first;    // [n_coarse + 1]
    std::vector<int32_t> fine_of;         // [n_chunks] fine cluster of each chunk
    std::vector<std::vector<int32_t>> fine_chunks;  // walked lists
  };
  Host download(int slot, int h) const;
  size_t device_bytes() const { return bytes_; }

 private:
  // arena null: only sizes the arrays (bytes_), for arena_bytes().
  LcIndexGpu(DeviceArena* arena, const LcIndexConfig& cfg);
  // One launch sequence over nb <= build_heads / Hkv builds (checked by build_batch).
  // host: its region of the pinned staging (stage_stride() bytes).
  void build_group(const LcBuild* b, int nb, void* host, cudaStream_t s);
  size_t stage_stride() const;
  LcIndexConfig cfg_;
  int max_fine_ = 0, sort_cap_ = 0;
  bool timing_ = false;
  cudaEvent_t ev_[5] = {};
  size_t bytes_ = 0;
  // Persistent index, all [slots][Hkv][...] unless noted.
  int32_t* starts_ = nullptr;      // [slots][max_chunks + 1]
  int32_t* n_chunks_ = nullptr;    // [slots][Hkv]
  int32_t* n_fine_ = nullptr;      // [slots][Hkv]
  int32_t* n_coarse_ = nullptr;    // [slots][Hkv]
  __half* fc_ = nullptr;           // [..][D/8][max_fine][8] (piece-major)
  float* fr_ = nullptr;
  int32_t *ftok_ = nullptr, *fcnt_ = nullptr, *fhead_ = nullptr, *ftail_ = nullptr,
          *fnch_ = nullptr;
  __half* gc_ = nullptr;           // [..][D/8][max_coarse][8] (piece-major)
  float* gr_ = nullptr;
  int32_t *gtok_ = nullptr, *gcnt_ = nullptr, *gfirst_ = nullptr;  // first: [max_coarse + 1]
  int32_t *cnext_ = nullptr, *cfine_ = nullptr;                    // [max_chunks]
  int build_heads_ = 0;             // (slot, head) pairs per build sequence
  // Build scratch ([build_heads][...]).
  float* X_ = nullptr;             // chunk keys [max_chunks][D]
  double* mean_ = nullptr;         // chunk means [max_chunks][D]
  float* C_ = nullptr;             // centroids being iterated [max_fine][D]
  float* FC_ = nullptr;            // final fine centroids [max_fine][D]
  float* GC_ = nullptr;            // final coarse centroids [max_coarse][D]
  double* sum_ = nullptr;          // [max_fine][D] (also node accumulators)
  double* acc_ = nullptr;          // [max_fine + max_coarse][D] center accumulators
  unsigned long long* rad2_ = nullptr;  // [max_fine + max_coarse] double bits of max distance
  int32_t *cnt_ = nullptr, *assign_ = nullptr, *fassign_ = nullptr, *gassign_ = nullptr,
          *remap_ = nullptr, *newid_ = nullptr, *gof_ = nullptr;
  float* best_ = nullptr;
  int32_t* ctl_ = nullptr;         // [2][build_heads][8]: N, K, active, changed, Kout, ...
  void* grp_ = nullptr;            // lc_detail::LcGroupDev [build_heads / Hkv]
  int32_t* sbuf_ = nullptr;        // [build_heads / Hkv][max_chunks + 1] staged starts
  unsigned long long* sort_keys_ = nullptr;  // [build_heads][sort_cap_]: block sorts past the
                                             // device's shared memory (else null)
  char* search_scratch_ = nullptr;  // [search_ctas_][search_stride_] (else null): search()
  size_t search_stride_ = 0;
  int search_ctas_ = 0;
  void* stage_ = nullptr;          // pinned host staging of build_batch (grows)
  size_t stage_bytes_ = 0;
  void* stage_ev_ = nullptr;       // cudaEvent_t: the last build_batch's uploads were issued
};

}  // namespace spade::cuda
