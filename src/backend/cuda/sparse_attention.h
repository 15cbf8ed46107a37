// CUDA sparse decode (issue 9): attention over selections through the paged KV cache, and
// the Quest selector on the GPU. Decode only (q_len == 1 per request).
//
// Selections are CSR lists in device memory: sel_off[n_lists + 1], sel_idx[...]. The list of
// (request b, KV head h) is number b * lists_per_req + (lists_per_req == 1 ? 0 : h):
//   lists_per_req == Hkv -> one list per (request, KV head) (Quest, Tidal, ...)
//   lists_per_req == 1   -> one list shared by every KV head of a request (LessIsMore)
// Entries (SelGran):
//   Token   : token positions in [0, kv_len) (any order; duplicates count twice)
//   Chunk16 : u names tokens [16u, 16u + 16) clipped to kv_len (Quest pages at P = 16)
//   Block64 : u names tokens [64u, 64u + 64) clipped to kv_len
// Each selected K/V row is read once per KV head for the whole GQA group (the G query heads
// are the rows of one mma tile), split-K over the list with a log-sum-exp combine fused into
// the last CTA of each (request, KV head). Hybrid heads (LycheeDecode appendix C): KV heads
// flagged dense read their whole context in the same launch; the planner cuts every head's
// work into items of (nearly) equal chunk counts, so dense heads get more splits and do not
// set the critical path.
//
// Usage: SparseAttention (buffers from the arena) -> plan(...) on the host per step (uploads
// page tables, lengths, work items; list lengths only as upper bounds, the kernel reads the
// real ones from sel_off) -> run(...) per layer. Launches of one object must not overlap.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_common.h"

namespace spade::cuda {

enum class SelGran : int { Token = 0, Chunk16 = 1, Block64 = 2 };

struct SparseSeq {
  const int32_t* pages = nullptr;  // host page ids in token order
  int n_pages = 0;
  int kv_len = 0;  // tokens in the cache, this step's token included
};

// BLASST inside a selection (SparseAttention::run): threshold ln(lambda) <= 0 (-inf: off), or
// lambda = a / length with log_lambda = ln(a) and per_length (length: the (request, head)'s
// selected tokens when length_selected, else its context; lambda capped at 1). counts:
// optional device [Hkv][2] (chunks seen, chunks skipped), accumulated. A chunk = 16 entries of
// a warp's share of the list; each warp's first chunk is always kept (no seed).
struct SelSkip {
  float log_lambda = -INFINITY;
  bool per_length = false, length_selected = true;
  unsigned long long* counts = nullptr;
  bool active() const { return log_lambda > -INFINITY; }
};

class SparseAttention {
 public:
  // max_patterns: dense-head patterns one plan_patterns() may hold.
  // max_split: the most splits of one (request, head); split partials take one slot per work
  // item of a launch (about the GPU's CTA slots), not max_split x rows.
  SparseAttention(DeviceArena& arena, int max_batch, int64_t max_pages, int Hq, int Hkv, int D,
                  int P, int max_split = 256, int max_patterns = 1);
  // Arena bytes the constructor takes with these arguments (alignment included).
  static size_t arena_bytes(int max_batch, int64_t max_pages, int Hq, int Hkv, int D,
                            int max_split = 256, int max_patterns = 1);

  // max_entries[b * lists_per_req + l]: host upper bound of each list's length (entries);
  // dense_heads (optional, size Hkv): heads that ignore their list and read all of
  // [0, kv_len). force_split > 0 gives every (request, head) that many splits.
  void plan(const std::vector<SparseSeq>& batch, SelGran gran, int lists_per_req,
            const std::vector<int>& max_entries, const std::vector<uint8_t>* dense_heads,
            cudaStream_t s, int force_split = 0);
  // plan() for several dense-head patterns at once (each of size Hkv; LycheeDecode: one per
  // distinct set of retrieval heads among the layers): run(..., pattern = i) uses patterns[i].
  void plan_patterns(const std::vector<SparseSeq>& batch, SelGran gran, int lists_per_req,
                     const std::vector<int>& max_entries,
                     const std::vector<std::vector<uint8_t>>& patterns, cudaStream_t s,
                     int force_split = 0);
  // Deterministic (batch-invariant): a (request, head)'s split count depends on its own list
  // bound only (one split per kInvariantChunks chunks of 16 entries), not on the batch's
  // balance, so its bits do not depend on the rest of the batch. Takes effect at the next
  // plan(); a force_split keeps its count. (CudaModelOptions::deterministic.)
  static constexpr int kInvariantChunks = 64;
  void set_deterministic(bool d) { deterministic_ = d; }
  bool deterministic() const { return deterministic_; }
  // out[B, Hq, D] = attention of q[B, Hq, D] over the selected rows of this layer's cache
  // (k, v: [page][Hkv][P][D] bf16). dense_scores (optional): the dense heads also write their
  // group-mean scores dense_scores[(b * Hkv + h) * scores_ld + j] = mean over the G query heads
  // of q.k_j * scale for every j < kv_len (as the dense kernel's DecodeScores; LycheeDecode's
  // retrieval heads), from the same products: no second pass over K.
  // skip: BLASST inside the selection (not together with dense_scores).
  // sel_cnt (optional): list i is the sel_cnt[i] entries at sel_idx + sel_off[i] instead of
  // [sel_off[i], sel_off[i + 1]) (lists written at a fixed stride need no compaction).
  void run(const bf16* q, const bf16* k_cache, const bf16* v_cache, const int32_t* sel_off,
           const int32_t* sel_idx, bf16* out, float scale, cudaStream_t s, int pattern = 0,
           float* dense_scores = nullptr, int64_t scores_ld = 0, const SelSkip& skip = {},
           const int32_t* sel_cnt = nullptr) const;

  int n_items() const { return n_items_; }  // of pattern 0
  // Work items of each pattern of the last plan (launch shapes: a CUDA graph's key).
  const std::vector<int>& pattern_items() const { return pattern_count_; }
  // Device copies of the last plan's page table / per-request page offsets / lengths (valid
  // in stream order after plan()), for selectors that read them (QuestArgs).
  const int32_t* dev_page_table() const { return meta_dev_ + off_pt_; }
  const int32_t* dev_page_off() const { return meta_dev_ + off_po_; }
  const int32_t* dev_kv_len() const { return meta_dev_ + off_len_; }
  int max_split_used() const { return max_split_used_; }
  int ctas_per_sm() const { return ctas_per_sm_; }
  // Diagnostics (bench_sparse trace mode): while set, every run() writes 8 uint64 per work item
  // at trace[8 * item]: globaltimer ns at entry, past the PDL wait, once the ring prologue is
  // issued, after warp 0's chunk loop, after the warp merge, at the end (after the split
  // combine for the CTA that ran it), then smid | combined << 32, and the CTA's chunk count.
  void set_trace(unsigned long long* trace) { trace_ = trace; }

 private:

  int Hq_, Hkv_, D_, P_, max_batch_, max_split_, max_patterns_, ctas_per_sm_ = 1;
  int64_t max_pages_;
  int32_t* meta_dev_ = nullptr;
  int32_t* meta_host_ = nullptr;
  size_t meta_cap_ = 0;
  float* part_o_ = nullptr;
  float* part_lse_ = nullptr;
  int* counters_ = nullptr;
  int64_t off_pt_ = 0, off_po_ = 0, off_len_ = 0, off_items_ = 0;
  int B_ = 0, n_items_ = 0, max_split_used_ = 0, lists_per_req_ = 1;
  bool deterministic_ = false;
  int64_t part_items_ = 0;  // split partial slots
  SelGran gran_ = SelGran::Token;
  unsigned long long* trace_ = nullptr;
  std::vector<int> pattern_first_, pattern_count_;  // work items of each planned pattern
  std::vector<int> nch_;                            // planning scratch (kept: no per-step allocation)
  std::vector<std::vector<uint8_t>> one_pattern_;
};

// ---- Quest on the GPU (quest_select.cu) ----
// Per-page key metadata: meta[page][Hkv][2][D] bf16 (min row, then max row) of the keys
// written into each physical page; min/max of bf16 keys are bf16 values, so it is exact.
// Updates pages page_ids[i] (device) with their first n_valid[i] slots (device), e.g. the
// last page of every request after an append, or every page after a prefill.
void quest_update_meta(const bf16* k_cache, bf16* meta, const int32_t* page_ids,
                       const int32_t* n_valid, int n, int Hkv, int P, int D, cudaStream_t s);

// Quest selection for a decode batch (Quest page = 16 tokens = the KV page, P == 16):
// score[b][h][i] = max_g sum_d max(q_g[d] kmax[d], q_g[d] kmin[d]) over pages i < n_pages-1
// (fp32, summed in d order like the CPU's quest_page_bound), then per (b, h) the
// k_pages - 1 best pages by score (ties: lower page; radix select, no sort) in ascending
// order plus the last page: sel_idx[(b * Hkv + h) * k_pages + j] (SelGran::Chunk16 entries;
// a request with n_pages <= k_pages gets all its pages). page_table / page_off / kv_len as
// in SparseAttention (device). scores: scratch [B * Hkv * max_pages] fp32.
struct QuestArgs {
  const bf16* q;          // [B, Hq, D]
  const bf16* meta;       // [page][Hkv][2][D]
  const int32_t* page_table;
  const int32_t* page_off;
  const int32_t* kv_len;
  float* scores;
  int32_t* sel_idx;
  int B, Hq, Hkv, D, max_pages, k_pages;
  // 0: CUDA cores, the CPU's summation order (bit-identical scores and selections);
  // 1: tensor cores (quest_score_mma.cu): scores to fp32 rounding, selections equal except
  //    where two pages tie to ~1e-6 relative.
  int fast = 0;
  // Optional: the top-k writes CSR directly (csr_off[B * Hkv + 1], entries into sel_idx at
  // the row's start), the lists quest_compact_lists would make from the strided form, so no
  // compaction launch is needed.
  int32_t* csr_off = nullptr;
};
void quest_select(const QuestArgs& a, cudaStream_t s);
// The two stages separately (timing): scoring, then top-k.
void quest_score(const QuestArgs& a, cudaStream_t s);
void quest_topk(const QuestArgs& a, cudaStream_t s);
void quest_score_fast(const QuestArgs& a, cudaStream_t s);  // tensor cores (a.fast)

// Generic per-row top-k (token-level selectors): rows r < n_rows of scores[r * ld + i],
// i < n[r] (device), k best (ties: lower index; NaN last) written ascending to
// out[r * k + j]; rows with n[r] <= k get 0..n[r]-1.
void topk_rows(const float* scores, int64_t ld, const int32_t* n, int n_rows, int k,
               int32_t* out, cudaStream_t s);

// topk_rows for rows longer than its shared-memory cache (ld > 40960 entries: 128K contexts),
// in two stages: the k best of every 32768-entry chunk of a row (one CTA per chunk and row,
// cached), then the k best of those candidates; the same answer as topk_rows (the global top
// k lies in the union of the chunks' top k, and candidates keep position order for ties).
// Applies when topk_long_applies(ld, k); scratch: topk_long_scratch_bytes(n_rows, ld, k)
// bytes of device memory (256-byte aligned).
bool topk_long_applies(int64_t ld, int k);
size_t topk_long_scratch_bytes(int n_rows, int64_t ld, int k);
void topk_rows_long(const float* scores, int64_t ld, const int32_t* n, int n_rows, int k,
                    int32_t* out, void* scratch, cudaStream_t s);

// Model decode step helpers (sparse_lists.cu), lists built from the device lengths kv_len[B]:
// quest_compact_lists: quest_select's output (k_pages entries per (b, h) row at stride k_pages,
// min(k_pages, pages of b) of them valid) -> CSR sel_off[B * Hkv + 1] / sel_idx (Chunk16).
void quest_compact_lists(const int32_t* strided, const int32_t* kv_len, int B, int Hkv,
                         int k_pages, int32_t* sel_off, int32_t* sel_idx, cudaStream_t s);
// token_compact_lists: topk_rows' output for rows b * Hkv + h (k entries per row at stride k,
// min(k, kv_len[b]) of them valid) -> CSR sel_off[B * Hkv + 1] / sel_idx (Token).
void token_compact_lists(const int32_t* strided, const int32_t* kv_len, int B, int Hkv, int k,
                         int32_t* sel_off, int32_t* sel_idx, cudaStream_t s);
// row_lengths: out[b * Hkv + h] = kv_len[b] (topk_rows' per-row counts) for the heads h whose
// bit is set in `heads` (Hkv <= 32 for a mask), 0 for the others (topk_rows leaves those rows
// untouched: LycheeDecode's sparse heads keep their sets).
void row_lengths(const int32_t* kv_len, int B, int Hkv, int32_t* out, cudaStream_t s,
                 uint32_t heads = ~0u);
// streaming_lists: one shared Token list per request (lists_per_req = 1): all of [0, L) when
// L <= budget, else the first `sinks` tokens and the last budget - sinks (StreamingMethod).
void streaming_lists(const int32_t* kv_len, int B, int budget, int sinks, int32_t* sel_off,
                     int32_t* sel_idx, cudaStream_t s);

// oracle_group_weights (oracle-topk): from per-query-head scores [B * Hq][ld] (DecodeScores
// per_head), out[(b * Hkv + h) * ld + j] = sum over the G query heads g of h of their true
// softmax weight on token j (over [0, kv_len[b])): the CPU's OracleTopKMethod W. G <= 16.
void oracle_group_weights(const float* scores, int64_t ld, const int32_t* kv_len, int B, int Hq,
                          int Hkv, float* out, cudaStream_t s);

// ---- LessIsMore on the GPU (lessismore_select.cu) ----
// One Token list per request (lists_per_req = 1) from a selection layer's per-query-head
// scores (DecodeScores::per_head), exactly the CPU's LessIsMoreMethod::on_scores on the same
// scores: sinks [0, sinks), the n_uni = budget - n_recent - sinks tokens of the merge of the
// heads' top lists over [sinks, L - n_recent) by (rank within head, head), and the last
// n_recent positions; a request with L <= budget gets all of [0, L). sel_off[B + 1] /
// sel_idx[B * budget] (CSR; entries ascending within each part).
constexpr int kLessIsMoreMaxUnified = 8192;  // n_uni limit (the rank sort's shared memory)
struct LessIsMoreArgs {
  const float* scores = nullptr;  // [B * Hq][ld] per query head
  int64_t ld = 0;                 // >= every kv_len
  const int32_t* kv_len = nullptr;  // [B] device
  int B = 0, Hq = 0;
  int budget = 0, n_recent = 0, sinks = 0, n_uni = 0;
  // scratch (device): row_n [B * Hq + B], head_top [B * Hq * n_uni], keys [B * ld],
  // merged_top [B * n_uni]
  int32_t* row_n = nullptr;
  int32_t* head_top = nullptr;
  float* keys = nullptr;
  int32_t* merged_top = nullptr;
  int32_t* sel_off = nullptr;
  int32_t* sel_idx = nullptr;
  // optional: topk_long_scratch_bytes(B * Hq, ld, n_uni) bytes; with it, rows beyond
  // topk_rows' cache (128K contexts) take topk_rows_long.
  void* topk_scratch = nullptr;
  // Tensor parallelism: the Hq heads are the model's [hq0, hq0 + Hq) of Hq_key (0: Hq), so
  // that the merge keys rank * Hq_key + (hq0 + hq) are the one-rank keys.
  int hq0 = 0, Hq_key = 0;
};
void lessismore_select(const LessIsMoreArgs& a, cudaStream_t s);
// lessismore_select in two halves, for a gather of the merge keys between them (tensor
// parallelism): keys = init, the per-head top-k and the rank keys (int, keys[b][0, L): the
// smallest key of each position over this rank's heads, INT_MAX where none); lists = the
// merged top-k over the keys and the lists.
void lessismore_keys(const LessIsMoreArgs& a, cudaStream_t s);
void lessismore_lists(const LessIsMoreArgs& a, cudaStream_t s);
// The gather of the keys over `ranks` ranks through a sum all-reduce of
// gather[ranks][B][ld] (fp32): scatter writes this rank's keys into its slot (INT_MAX as
// +inf; positions >= L too) and zeros into the others, so the sum holds every rank's keys
// exactly; min then sets keys[b][j] to the smallest over the slots (the one-rank key).
void lessismore_keys_scatter(const LessIsMoreArgs& a, float* gather, int rank, int ranks,
                             cudaStream_t s);
void lessismore_keys_min(const LessIsMoreArgs& a, const float* gather, int ranks, cudaStream_t s);

}  // namespace spade::cuda
