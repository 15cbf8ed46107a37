// Decode schedule of the paged attention workspace (see attention.h): which decode kernel runs
// a batch (v2, the v3 variants or their DYN twins that draw their chunks) and with how
// many splits. Host code; the kernels are in attention.cu and attention_decode.cu.
#include <algorithm>

#include "backend/cuda/attention.h"
#include "core/tuning.h"
#include "backend/cuda/attention_common.cuh"

namespace spade::cuda {

using namespace attn_detail;

// Workspace decode-kernel index: 0 = v2, 1 = auto, 2.. = attention_decode.cu variant (index - 1):
// 2 v3_w4s3, 3 v3_w8s3, 4 v3d_w4s3, 5 v3d_w8s3, 6 v3_w4s2, 7 v3d_w4s2.
int AttentionWorkspace::decode_kernel_count() { return 2 + decode_v3_count(); }
const char* AttentionWorkspace::decode_kernel_name(int v) {
  return v == 0 ? "v2" : v == 1 ? "auto" : decode_v3_variant(v - 1).name;
}

// Auto: the 8-warp CTAs (one per SM, half the splits) only for very few (sequence, KV head)
// pairs at contexts up to 64K, else the 4-warp CTAs (two per SM). H100
// (bench/results/attention_h100_20261122.json, attention_decode_*_h100_20261122.json): batch 1
// (8 pairs) at 8K / 32K 8-warp 19.5 / 53.8 us vs 4-warp 21.0 / 55.2; at 128K 4-warp 190.5-192.9
// vs 193.6-196.1; batch 8 (64 pairs) 4-warp faster by 1-3% at 8K-128K (the H200 rule, 8-warp
// whenever pairs < SMs, lost there). H200, decode steps of Llama-3.1-8B
// (bench/results/attention_decode_w8_tpot_h200_20261126.json): batch 1 8-warp faster per token
// by 0.9% at 32K, 0.8% at 48K, 0.5% at 64K (0.4% at 128K, where the H100 prefers 4 warps);
// batch 2 (16 pairs) at 32K 4-warp faster by 0.3%. (The bound was max_kv <= 32768, which a 32K
// decode, at 32768 + generated tokens, missed.) The TMA (v4) twins were not faster and were
// never picked (bench/dev/attention_decode_tma.cu keeps them for A/B runs).
// Drawn chunks (the DYN twins, variants 3 / 4: warps take 16-token chunks from a per-(sequence,
// KV head) counter, so no split or warp waits for a slower one) whenever dyn_split finds a split
// count for them, unless the workspace is deterministic (their summation order varies from run
// to run). H100, same process, interleaved twice
// (bench/results/attention_decode_dyn_h100_20261127.json): one wave of CTAs, 128K B = 1 188.7 ->
// 183.5 us (8-warp twin), 32K B = 8 365.9 -> 359.0, 128K B = 8 1424 -> 1411; with fewer than 32
// chunks per warp the ticket round trips cost more than they balance (8K B = 1 18.7 -> 19.9).
// Two waves when one wave gives a pair fewer than 8 CTAs (the second wave's CTAs take over the
// first's tails): 32K B = 8 (8 splits) 357.7-358.3, 128K B = 8 1398-1401, 32K B = 32 (2 splits,
// which static runs without) 1401-1404 vs 1421-1422, 128K B = 32 5568-5583 vs 5631-5635; at
// batch 1 a second wave is slower (128K: 185.4-185.6 vs 183.5-184.6).
int AttentionWorkspace::auto_variant(int B, int max_kv) const {
  if (const int v = fp8_variant(); v > 0) return v;
  // (Each candidate as the device's shared memory allows: fitting_variant.)
  const bool few_pairs = int64_t(B) * Hkv_ <= 8;
  const int drawn = fitting_variant(few_pairs ? 4 : 3);
  if (may_draw() && dyn_split(drawn, B, max_kv) > 0) return drawn;
  return fitting_variant(few_pairs && max_kv <= 65536 ? 2 : 1);
}

// An fp8 cache at D = 128 with the direct kernel: v3_w4s2 (variant 5; 4-stage rings of codes,
// 3 CTAs / 12 warps per SM), static, for every batch and length: on the H200 it read 3.3-4.0 TB/s
// of codes (1.33-1.72x of SDPA's bf16) against 2.1-2.7 TB/s for the bf16 rule's picks (auto:
// 8-warp or drawn variants) at 32K / 128K x batch 1 / 8 / 32. 0 otherwise.
int AttentionWorkspace::fp8_variant() const {
  if (!fp8_cache_ || D_ != 128 || !tuning().fp8_direct) return 0;
  return fitting_variant(5);
}

// The split count of a DYN variant, 0 where drawing does not pay: the pairs must fit one wave
// of CTAs, and each warp must stream >= 32 chunks of 16 tokens.
int AttentionWorkspace::dyn_split(int variant, int B, int max_kv) const {
  const int64_t pairs = int64_t(B) * Hkv_;
  if (pairs > int64_t(sm_count()) * variant_occupancy(variant)) return 0;
  const int warps = decode_v3_variant(variant).warps;
  const int64_t chunks = (int64_t(max_kv) + 15) / 16;
  const int ns1 = split_for(variant, B, max_kv);
  const int ns2 = std::min(2 * ns1, lim_.max_split);
  if (ns1 < 8 && ns2 > ns1 && chunks >= 32LL * ns2 * warps) return ns2;
  if (ns1 > 1 && chunks >= 32LL * ns1 * warps) return ns1;
  return 0;
}

bool AttentionWorkspace::draws_chunks() const {
  return decode_ && variant_ > 0 && decode_v3_variant(variant_).dyn && may_draw();
}

int AttentionWorkspace::decode_warps() const {
  if (variant_ == 0) return 0;
  return D_ == 64 ? 4 : decode_v3_variant(variant_).warps;  // D = 64 has 4-warp kernels only
}

int AttentionWorkspace::resolve_variant(int B, int max_kv) const {
  return decode_kernel_ == 0 ? 0 : decode_kernel_ == 1 ? auto_variant(B, max_kv) : decode_kernel_ - 1;
}

// Variant v, or its nearest twin whose shared memory the device allows per block
// (smem_optin_bytes): 8 warps -> 4 warps, then a 3-stage ring -> 2 stages (same static / drawn
// schedule); at Hopper's and A100's limits every auto pick fits as it is.
int AttentionWorkspace::fitting_variant(int v) const {
  const size_t lim = smem_optin_bytes();
  auto fits = [&](int x) { return decode_v3_smem(D_, x) <= lim; };
  if (fits(v)) return v;
  const bool dyn = decode_v3_variant(v).dyn;
  const int w4s3 = dyn ? 3 : 1, w4s2 = dyn ? 6 : 5;
  if (fits(w4s3)) return w4s3;
  SPADE_CHECK(fits(w4s2), "attention: no decode kernel fits the GPU's ", lim >> 10,
              " KB of shared memory per block (head_dim ", D_, ")");
  return w4s2;
}

int AttentionWorkspace::schedule_kv(int max_kv) {
  if (max_kv <= 64) return 64;
  int pow2 = 64;
  while (pow2 <= max_kv / 2) pow2 *= 2;  // the largest power of two <= max_kv
  const int64_t step = std::max(64, pow2 / 8);
  return int(std::min<int64_t>((int64_t(max_kv) + step - 1) / step * step, 1 << 30));
}

int AttentionWorkspace::choose_split(int B, int max_kv) const {
  const int v = resolve_variant(B, max_kv);
  if (v > 0 && decode_v3_variant(v).dyn && may_draw())
    if (const int ns = dyn_split(v, B, max_kv); ns > 0) return ns;
  return split_for(v, B, max_kv);
}

int AttentionWorkspace::split_for(int variant, int B, int max_kv) const {
  const int slots = sm_count() * variant_occupancy(variant);
  const int base = B * Hkv_;
  if (variant == 0) {  // v2: one wave of CTAs, >= 2 tiles of 64 per split
    const int tiles = (max_kv + 63) / 64;
    int ns = base >= slots ? 1 : slots / base;
    ns = std::min({ns, lim_.max_split, std::max(1, tiles / 2)});
    return std::max(1, ns);
  }
  // v3: the smallest split count whose CTAs fill >= 96% of the CTA slots of their last wave
  // (best fill if none does), with >= 2 chunks of 16 tokens per warp.
  const int warps = decode_v3_variant(variant).warps;
  const int chunks = (max_kv + 15) / 16;
  const int ns_max = std::max(1, std::min(lim_.max_split, chunks / (2 * warps)));
  if (split_policy_ == 1) {
    // Exact waves: the smallest split count that makes the CTAs a whole number of waves
    // (every SM streams to the end), if each warp still gets >= 8 chunks.
    for (int ns = 1; ns <= ns_max; ++ns)
      if ((int64_t(base) * ns) % slots == 0) {
        if (chunks / (ns * warps) >= 8) return ns;
        break;
      }
  }
  int best = 1;
  double best_fill = 0;
  for (int ns = 1; ns <= ns_max; ++ns) {
    const int64_t ctas = int64_t(base) * ns;
    const int64_t waves = (ctas + slots - 1) / slots;
    const double fill = double(ctas) / double(waves * slots);
    if (fill >= 0.96) return ns;
    if (fill > best_fill + 1e-9) best_fill = fill, best = ns;
  }
  return best;
}

}  // namespace spade::cuda
