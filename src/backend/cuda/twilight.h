// Twilight on the GPU (select-then-prune, sparse/methods/twilight.h): a base selector (Quest
// on the GPU: Chunk16 CSR lists; or any Token CSR lists) picks a conservative set per
// (request, KV head); the pruner estimates q.k for every selected token from an INT4 copy of
// the keys, softmaxes per query head over the selection, finds each query head's top-p
// threshold by Algorithm 1's binary search on the weight (no sort), and emits the union of
// the G heads' kept sets as Token CSR lists for SparseAttention (sparse_attention.h).
//
// INT4 keys (int4_keys.cuh): per layer, codes [page][Hkv][P][D/2] uint8 and
// sz [page][Hkv][P] uint32 (fp16 scale | fp16 zero << 16), bit-identical to
// kv/int4_keys.h's int4_quantize_row of the bf16 key. Written by qkv_post (QkvPostArgs::
// k_int4, fused into the KV append) or, for keys already in the cache, int4_quantize_pages.
//
// Pruner launches, all on one stream, no host sync, no allocation (buffers from the arena):
//   1. estimate: logits[list][g][slot] = scale * (zero * sum(q_g) + s * q_g . code) fp32,
//      integer tensor cores (u8 codes x q as three exact s8 digits, s32 sums;
//      twilight_estimate.cuh); slot = entry (Token) or
//      16 * entry + row (Chunk16); slots past kv_len are -inf.
//   2. top-p: one CTA per (list, query head): softmax, then Algorithm 1 as
//      sparse::topp_binary_search (same double bisection, same termination test), eight
//      steps per pass over the weights (an interval tree, topp_tree_search.cuh); each writes
//      its kept mask, and the last CTA of the list compacts the union of { w_g >= t_g } in
//      selection order into kept_strided[list][slot]. Lists of <= 512 slots: one CTA per
//      list, a warp per query head, the same thresholds (twilight_topp_warp.h).
// run() = 1 + 2: the attention reads the strided lists with their counts (sel_cnt).
//   3. compact (optional): kept_strided + kept_count -> CSR kept_off[B * Hkv + 1] / kept_idx.
// Only head_combine=union is implemented (the CPU method's default).
#pragma once
#include <cstdint>

#include "backend/cuda/sparse_attention.h"

namespace spade::cuda {

// Quantizes the first n_valid[i] slots of pages page_ids[i] (device arrays, n pages) of one
// layer's bf16 K cache [page][Hkv][P][D] into codes / sz (layout above). D % 4 == 0, D <= 256.
void int4_quantize_pages(const bf16* k_cache, uint8_t* codes, uint32_t* sz,
                         const int32_t* page_ids, const int32_t* n_valid, int n, int Hkv, int P,
                         int D, cudaStream_t s);

struct TwilightStep {
  const bf16* q = nullptr;          // [B, Hq, D]
  const uint8_t* codes = nullptr;   // this layer's INT4 codes
  const uint32_t* sz = nullptr;     // this layer's scale / zero
  const int32_t* page_table = nullptr, *page_off = nullptr, *kv_len = nullptr;  // device
  const int32_t* base_off = nullptr;  // [B * Hkv + 1] base CSR (one list per (b, KV head))
  const int32_t* base_idx = nullptr;
  SelGran gran = SelGran::Chunk16;   // Token or Chunk16
  int B = 0;
  float scale = 0.f;  // softmax scale (1/sqrt(D))
};

class TwilightPruner {
 public:
  // max_slots: the most base tokens of one list (Chunk16: 16 * entries); the kernels clip
  // longer lists to it (a caller error, not checked on the host: the lists live on the GPU).
  TwilightPruner(DeviceArena& arena, int max_batch, int Hq, int Hkv, int D, int P,
                 int max_slots, double p = 0.95, double eps = 1e-6);
  // Arena bytes the constructor takes (with alignment slack).
  static size_t arena_bytes(int max_batch, int Hq, int Hkv, int max_slots);
  void set_p(double p) { p_ = p; }
  // Top-p by the step-per-pass bisection alone (the reference the tree search is tested and
  // timed against; the thresholds are the same).
  void set_topp_bisection_only(bool on) { topp_bisection_only_ = on; }
  // Diagnostics (bench_twilight's SPADE_TWL_TRACE; a build of twilight.cu with
  // -DSPADE_TOPP_TRACE, else a non-null trace is an error): while set, every top-p launch
  // writes globaltimer stamps, 16 uint64 per CTA (one CTA per (list, query head)) at
  // trace[16 * cta]: entry, past the PDL wait, softmax max done, sum done, pass 1 binned, tree
  // passes 1-4 done, search done, masks stored, handoff decided, end (the list's last CTA).
  void set_trace(unsigned long long* trace);
  // estimate + top-p: the kept lists at a fixed stride (kept_strided_*, kept_count), which
  // SparseAttention::run reads with sel_cnt = kept_count() (no compaction launch).
  void run(const TwilightStep& st, cudaStream_t s);
  // The stages separately (timing, tests).
  void estimate(const TwilightStep& st, cudaStream_t s);
  void topp(const TwilightStep& st, cudaStream_t s);

  // After run(): the kept lists as CSR (kept_off / kept_idx), for consumers without counts.
  void compact(const TwilightStep& st, cudaStream_t s);

  // List i: kept_count()[i] positions at kept_strided_idx() + kept_strided_off()[i]
  // (offsets i * max_slots(), constant).
  const int32_t* kept_strided_off() const { return kept_strided_off_; }  // [B * Hkv + 1]
  const int32_t* kept_strided_idx() const { return kept_strided_; }
  const int32_t* kept_count() const { return kept_cnt_; }  // [B * Hkv]
  const int32_t* kept_off() const { return kept_off_; }  // [B * Hkv + 1], after compact()
  const int32_t* kept_idx() const { return kept_idx_; }  // token positions, after compact()
  const float* logits() const { return logits_; }      // [list][G][max_slots()] (tests)
  const float* thresholds() const { return thr_; }      // [list][G] (tests)
  int max_slots() const { return max_slots_; }
  // Bytes the pruner must move per step for n_tokens base tokens over all lists (the
  // floor: INT4 rows read once, q read, kept indices written; scratch traffic not counted).
  int64_t floor_bytes(int64_t n_tokens, int64_t n_kept) const {
    return n_tokens * (D_ / 2 + 4) + n_kept * 4;
  }

 private:
  int max_batch_, Hq_, Hkv_, D_, P_, max_slots_;
  int n_sms_ = 0;
  double p_, eps_;
  bool topp_bisection_only_ = false;
  unsigned long long* trace_ = nullptr;
  float* logits_ = nullptr;
  float* wglob_ = nullptr;  // top-p weights of lists over the shared-memory cap
  uint32_t* mask_ = nullptr;  // kept bits [list][G][ceil(max_slots / 32)]
  int* counters_ = nullptr;
  float* thr_ = nullptr;
  int32_t* kept_strided_ = nullptr;
  int32_t* kept_strided_off_ = nullptr;
  int32_t* kept_cnt_ = nullptr;
  int32_t* kept_off_ = nullptr;
  int32_t* kept_idx_ = nullptr;
};

}  // namespace spade::cuda
