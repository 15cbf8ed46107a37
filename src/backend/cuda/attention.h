// Full attention over the paged bf16 KV cache: decode (split-KV + log-sum-exp combine) and
// chunked causal prefill, one tensor-core kernel family (mma.sync m16n8k16, bf16 in, fp32
// accumulate), GQA-aware: a CTA owns one KV head and packs the G = Hq/Hkv query heads of
// that head (times the query tokens) into the rows of its tile, so each K/V row is read
// once per KV head for the whole group.
//
// Prefill: wgmma + warp-specialized kernel (attention_prefill.cu, D = 128 on Hopper) or the
// generic mma.sync kernel (attention.cu; D = 64, other devices, v2 reference).
// Decode kernels: v3 (attention_decode.cu, default): per-warp cp.async rings, split combine
// fused into the last CTA; v2 (the generic kernel of attention.cu in decode mode, kept for
// comparison): selectable with set_decode_kernel (0 = v2, 1 = auto (default), 2.. = v3
// variants) or the environment variable SPADE_ATTN_DECODE=<index> read at construction. The
// v4 (TMA) decode variants, never faster, are in bench/dev/ for A/B runs.
// Launches of one workspace must not overlap (split partials and arrival counters are shared):
// run() them on one stream.
//
// Usage: AttentionWorkspace (buffers from the arena, sized at start-up) -> plan(...) on the
// host for a batch (uploads page tables, lengths, work items; picks the split count) ->
// run(...) per layer. plan() is done once per step and reused by all layers.
#pragma once
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "backend/cuda/cuda_common.h"

namespace spade::cuda {

struct AttnSeq {
  const int32_t* pages = nullptr;  // host page ids in token order
  int n_pages = 0;
  int kv_len = 0;  // tokens in the cache, including this step's new tokens
  int q_len = 0;   // new tokens (queries) of this step; positions kv_len-q_len .. kv_len-1
};

struct AttnLimits {
  int max_batch = 256;
  int64_t max_q_tokens = 8192;   // query rows per step (sum of q_len)
  int64_t max_pages = 1 << 20;   // sum of n_pages over the batch
  int max_split = 64;
};

// BLASST tile skipping (Yuan et al., Algorithm 1) inside the v3 decode and the prefill kernels:
// a key tile is skipped when, for every query row the tile's warp (decode: a warp's 16-token
// chunk, rows = the G heads of the KV head; generic mma.sync prefill, D = 64 or no sm_90a: 32
// packed rows x 64 keys at D = 64, x 32 keys at D = 128) or consumer warpgroup (wgmma prefill:
// 64 packed rows x 128 keys) owns, (row max of the tile - running row max) < ln(lambda). A
// skipped tile costs only Q.K^T: no exp, no row sum, no P.V and, in decode and the wgmma
// prefill, no V load (the generic prefill loads each K/V tile once for its four warps). The running max is
// the warp's / warpgroup's own (split-K: each split starts afresh), as in a FlashAttention CTA.
struct BlasstSkip {
  float log_lambda = -INFINITY;          // natural log of lambda (<= 0); -inf: no skipping
  unsigned long long* counts = nullptr;  // optional device [Hkv][2]: tiles seen, tiles skipped
                                         // (accumulated; zero it yourself)
  // BLASST eq. 3, lambda = a / L: log_lambda holds ln(a) and each sequence's threshold is
  // ln(a) - ln(L) with L its kv_len (decode: the context; prefill: p0 + T, the context at the
  // end of the chunk), capped at 0 (lambda <= 1).
  bool per_length = false;
  bool active() const { return log_lambda > -INFINITY; }
};

// Decode only (v3 kernel): the attention also writes, for every cached token j of sequence b
// and KV head h, the group-mean score out[(b * Hkv + h) * ld + j] = mean over the G query
// heads of q.k_j * scale (fp32), from the same tensor-core products the softmax uses: no
// second pass over K (TidalDecode-style selection layers rank tokens by it).
// per_head: instead every query head's own score, out[(b * Hq + hq) * ld + j] = q_hq.k_j *
// scale (LessIsMore ranks tokens per query head).
struct DecodeScores {
  float* out = nullptr;
  int64_t ld = 0;  // >= the longest kv_len of the batch
  bool per_head = false;
};

// FP8 (E4M3) KV cache of one layer (--kv-dtype fp8, issue 40): k, v hold one-byte codes in the
// bf16 cache's layout [page][Hkv][P][D]; value = code x k_scale[h] (V: v_scale[h]), this layer's
// [Hkv] device scales, powers of two (kv/fp8_e4m3.h). k_wide / v_wide: bf16 caches with room for
// every page id the plan names ([pages][Hkv][P][D], e.g. one layer of the pool in bf16), used by
// the steps the fp8 decode kernel does not run (AttentionWorkspace::run_fp8).
struct KvFp8 {
  const uint8_t* k = nullptr;
  const uint8_t* v = nullptr;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  bf16* k_wide = nullptr;
  bf16* v_wide = nullptr;
};

class AttentionWorkspace {
 public:
  AttentionWorkspace(DeviceArena& arena, const AttnLimits& lim, int Hq, int Hkv, int D, int P);
  ~AttentionWorkspace();

  // Host-side planning for one step: copies metadata into pinned memory and one async
  // upload on `s`. `force_split` > 0 fixes the split count (CUDA graphs, benchmarks);
  // splits are used only when every sequence has q_len == 1 (pure decode).
  // wait = false: returns without waiting for the upload; the caller synchronizes `s` before
  // the next plan() of this workspace (its pinned staging buffer is reused).
  void plan(const std::vector<AttnSeq>& batch, cudaStream_t s, int force_split = 0,
            bool wait = true);
  // Arena bytes the constructor takes with these arguments (alignment included).
  static size_t arena_bytes(const AttnLimits& lim, int Hq, int Hkv, int D);
  // out[T, Hq, D] = attention(q[T, Hq, D]) over this layer's cache (k, v: [page][Hkv][P][D]).
  // With skip.active(): BLASST skipping (decode: the v3 kernel; prefill: the wgmma or the
  // generic kernel); the v2 decode kernel throws spade::Error.
  // With scores (decode only, not with skip): also the group-mean scores (DecodeScores).
  void run(const bf16* q, const bf16* k_cache, const bf16* v_cache, bf16* out, float scale,
           cudaStream_t s, const BlasstSkip& skip = {}, const DecodeScores* scores = nullptr) const;
  // run() over an FP8 cache (KvFp8): decode steps with a v3 variant read the codes directly
  // (half the bytes; attention_decode.cu's F8 instances); every other step (prefill chunks,
  // mixed steps, the v2 decode kernel) first widens the plan's pages of this layer into
  // kv.k_wide / kv.v_wide (code x scale, exact in bf16; slots past each sequence's length
  // zeroed; the same page ids) and runs the bf16 kernels on them (attention_fp8.cu). Neither
  // BLASST skipping nor score emission.
  void run_fp8(const bf16* q, const KvFp8& kv, bf16* out, float scale, cudaStream_t s) const;
  // Whether run_fp8 of the last plan reads the fp8 codes directly (no widening into k_wide).
  bool fp8_direct() const { return decode_ && variant_ > 0; }

  int n_split() const { return n_split_; }
  bool decode() const { return decode_; }
  int n_items() const { return n_items_; }
  // Split count the planner would choose for a decode batch of `B` sequences whose longest
  // holds `max_kv` tokens (plan() passes schedule_kv(max_kv)).
  int choose_split(int B, int max_kv) const;
  // The context a decode schedule (kernel variant, split count) is chosen for: the longest
  // sequence's length rounded up to 1/8 of its power of two (>= 64 tokens), so that a batch
  // whose sequences grow by a token per step keeps its launch shape (hence its CUDA graph) for
  // hundreds of steps instead of changing splits whenever the length crosses a threshold.
  static int schedule_kv(int max_kv);

  // Decode kernel: 0 = v2 (generic tile kernel + combine launch), 1 = auto (picks a v3
  // variant from the batch), 2..decode_kernel_count()-1 = fixed variant. Takes effect at the
  // next plan(); decode_variant() is the one the last plan() picked (0 = v2).
  void set_decode_kernel(int v);
  int decode_kernel() const { return decode_kernel_; }
  int decode_variant() const { return variant_; }
  // Warps per CTA of that variant (0 for v2): with n_split(), the work partition of a v3
  // decode (a CTA's chunks of 16 tokens go to its warps round-robin), e.g. to emulate BLASST
  // decisions, which each warp takes from its own running max.
  int decode_warps() const;
  // v3 split count: 0 = smallest count whose CTAs fill >= 96% of their last wave; 1 = exact
  // waves when each warp keeps >= 8 chunks (else as 0). Takes effect at the next plan().
  void set_split_policy(int p) { split_policy_ = p; }
  // Deterministic: every decode runs a static chunk schedule, so the same inputs give the same
  // bits on every run; and (auto kernel) one static variant with kInvariantSplit splits per
  // (sequence, KV head), each cutting the sequence's own length, so a sequence's bits do not
  // depend on the rest of its batch either (batch invariance; a plan() with force_split keeps
  // its count). Off (the default; env SPADE_DETERMINISTIC=1 turns it on), auto may pick
  // the DYN variants, whose warps draw chunks from a counter (faster at long contexts with
  // splits; the summation order, hence the last bits, varies between runs), and sizes the
  // splits to the batch. Takes effect at the next plan() (auto's choice) and run() (explicitly
  // chosen DYN variants).
  static constexpr int kInvariantSplit = 16;
  void set_deterministic(bool d) { deterministic_ = d; }
  bool deterministic() const { return deterministic_; }
  // Decode steps will run with BLASST skipping (BlasstSkip): plan the static schedule, whose
  // split count suits the skip kernel (it has no DYN twin). Takes effect at the next plan().
  void set_blasst_decode(bool b) { blasst_decode_ = b; }
  // The cache this workspace's decode steps read is fp8 (run_fp8): auto picks v3_w4s2 at D = 128
  // with the direct fp8 kernel (SPADE_FP8_DIRECT, default on), 1.61-1.72x of PyTorch SDPA's bf16
  // where auto's bf16 picks gave 1.13-1.28x (H200, bench/results/attention_fp8_h200_20261129b.json).
  // Takes effect at the next plan().
  void set_fp8_cache(bool f) { fp8_cache_ = f; }
  // Whether a run() of the last plan (without BLASST) draws its chunks: a DYN variant, neither
  // deterministic nor planned for BLASST. Two such runs may differ in the output's last bits.
  bool draws_chunks() const;
  static int decode_kernel_count();
  static const char* decode_kernel_name(int v);
  // Whether decode kernel v (as above; auto always) fits the device's shared memory per block
  // at head dim D (smem_optin_bytes: the 8-warp and v2 kernels need more than sm_86 / 89 give).
  static bool decode_kernel_fits(int v, int D);
  // Prefill kernel: 2 = wgmma with a 3-stage K/V ring and P V one tile behind (the default),
  // 1 = wgmma with a 2-stage ring (D = 128 on compute capability 9.0 with the sm_90a image;
  // else falls back), 0 = the generic mma.sync kernel (v2). Env: SPADE_ATTN_PREFILL=0|1|2.
  void set_prefill_kernel(int v);
  // Bench only: per-CTA {start ns, end ns, SM, tiles} of wgmma prefill launches (4 x u64 each).
  void set_trace(unsigned long long* t) { trace_ = t; }
  int prefill_kernel() const { return prefill_kernel_; }
  bool prefill_wgmma_active() const;

 private:
  int Hq_, Hkv_, D_, P_;
  AttnLimits lim_;
  // Device metadata (one contiguous int32 region so the upload is one copy).
  int32_t* meta_dev_ = nullptr;
  int32_t* meta_host_ = nullptr;  // pinned
  size_t meta_cap_ = 0;
  float* part_o_ = nullptr;    // [max_split][max_q_tokens * Hq][D]
  float* part_lse_ = nullptr;  // [max_split][max_q_tokens * Hq]
  int* counters_ = nullptr;    // [max_batch][Hkv] split arrival counters (v3)
  int* tickets_ = nullptr;     // [max_batch][Hkv][kTicketStride]: DYN chunk tickets
  // Offsets (in int32) of each array inside meta.
  int64_t off_page_table_ = 0, off_page_off_ = 0, off_kv_len_ = 0, off_q_off_ = 0,
          off_items_ = 0;
  int B_ = 0, n_items_ = 0, n_split_ = 1, total_q_ = 0;
  bool decode_ = false;
  int decode_kernel_ = 1;
  int variant_ = 0;
  int split_policy_ = 0;
  bool fp8_cache_ = false;
  bool deterministic_ = false;
  bool blasst_decode_ = false;
  bool may_draw() const { return !deterministic_ && !blasst_decode_; }
  bool tma_ok_ = false;
  mutable std::vector<int> occ_cache_;
  struct TensorMaps;
  std::unique_ptr<TensorMaps> tmaps_;
  int resolve_variant(int B, int max_kv) const;
  int fitting_variant(int v) const;
  int auto_variant(int B, int max_kv) const;
  int fp8_variant() const;  // auto's pick for an fp8 cache (set_fp8_cache), 0 = the bf16 rule
  int split_for(int variant, int B, int max_kv) const;  // one wave (v3), as documented above
  int dyn_split(int variant, int B, int max_kv) const;
  int variant_occupancy(int variant) const;
  int prefill_kernel_ = 2;
  unsigned long long* trace_ = nullptr;
  // run()'s body; k_scale / v_scale non-null: k_cache / v_cache hold fp8 codes (v3 decode only).
  void run_impl(const bf16* q, const bf16* k_cache, const bf16* v_cache, bf16* out, float scale,
                cudaStream_t s, const BlasstSkip& skip, const DecodeScores* scores,
                const float* k_scale, const float* v_scale) const;
};

}  // namespace spade::cuda
