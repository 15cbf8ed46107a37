// Twilight pruner, stage 1 (twilight.h): estimated logits of every base token from INT4 keys.
//
// twl_estimate_kernel<D, NP>
//   reads  per base token D/2 code bytes + 4 scale/zero bytes (68 B at D = 128, a quarter of
//          the 256 B bf16 K row; the pruner's byte floor), the list's entries (4 B per entry),
//          q of the G heads once per warp
//   writes logits fp32 [list][G][max_slots] (4*G B per token: scratch, L2-resident)
//   CTA = 4 warps of one list (b, KV head); a warp takes 16-slot tiles `stride` apart
//   (twilight_estimate.cuh: integer tensor cores over the codes as bytes and q as three
//   signed 7-bit digits; Chunk16 lists stream through a per-warp cp.async ring, the grid
//   giving each warp 4 to 16 tiles, enough warps for ~16 per SM).
#include <algorithm>
#include <cstdlib>

#include "backend/cuda/pdl.cuh"
#include "core/tuning.h"
#include "backend/cuda/twilight.h"
#include "backend/cuda/twilight_estimate.cuh"

namespace spade::cuda {
namespace {

constexpr int kEstWarps = 4;
constexpr int kEstWarpsPerSm = 16;  // grid sizing target (resident estimate warps per SM)
constexpr int kEstMinWarpTiles = 4;  // the least tiles per warp (two stages)

template <int D, int NP>
__global__ void __launch_bounds__(kEstWarps * 32) twl_estimate_kernel(const TwilightStep st,
                                                                       float* __restrict__ logits,
                                                                       int Hq, int Hkv, int P,
                                                                       int max_slots) {
  pdl_begin();  // pdl.cuh: first, before any global access
  const int list = blockIdx.y, b = list / Hkv, h = list % Hkv;
  const int G = Hq / Hkv;
  const int warp = threadIdx.x >> 5;
  const int e0 = st.base_off[list], ne = st.base_off[list + 1] - e0;
  const int n_slots = min(st.gran == SelGran::Chunk16 ? 16 * ne : ne, max_slots);  // longer: caller's bug
  const int n_tiles = (n_slots + 15) / 16;
  const int first = blockIdx.x * kEstWarps + warp, stride = gridDim.x * kEstWarps;
  if (first >= n_tiles) return;
  __shared__ twl::EstRing<D / 32> ring_all[kEstWarps];
  twl::est_warp<D, NP>(st, ring_all[warp], list, Hkv, P, G, first, stride, n_tiles, n_slots,
                       st.q + (int64_t(b) * Hq + h * G) * D, logits + int64_t(list) * G * max_slots,
                       max_slots, 0);
}

}  // namespace

void TwilightPruner::estimate(const TwilightStep& st, cudaStream_t s) {
  SPADE_CHECK(st.B >= 1 && st.B <= max_batch_, "twilight: batch ", st.B);
  SPADE_CHECK(st.gran == SelGran::Token || (st.gran == SelGran::Chunk16 && P_ % 16 == 0),
              "twilight: base lists must be Token or Chunk16 (P % 16 == 0)");
  const int G = Hq_ / Hkv_, NP = (G + 3) / 4;
  const int tiles = (max_slots_ + 15) / 16;
  // Tiles per warp: enough warps to fill the GPU (kEstWarpsPerSm per SM), at most
  // kEstMaxWarpTiles / 2 (the Chunk16 pipeline's bound), at least kEstMinWarpTiles: q's
  // digits (twilight_estimate.cuh, ~1000 instructions per warp) are paid once per warp, so
  // batch 1 (all_tiles / warps ~ 2) takes fewer, longer warps (docs/cuda_twilight.md).
  // SPADE_TWL_EST_TPW overrides it (A/B runs).
  const int64_t all_tiles = int64_t(tiles) * st.B * Hkv_;
  static const int min_tpw =
      tuning().twilight_est_tiles > 0
          ? std::clamp(tuning().twilight_est_tiles, twl::kEstTilesPerWarp, twl::kEstMaxWarpTiles / 2)
          : kEstMinWarpTiles;
  const int tpw = int(std::clamp<int64_t>(all_tiles / (int64_t(n_sms_) * kEstWarpsPerSm), min_tpw,
                                          twl::kEstMaxWarpTiles / 2));
  dim3 grid(unsigned(std::max(1, (tiles + kEstWarps * tpw - 1) / (kEstWarps * tpw))),
            unsigned(st.B * Hkv_));
  auto go = [&](auto kernel) {
    launch_pdl(kernel, grid, kEstWarps * 32, 0, s, st, logits_, Hq_, Hkv_, P_, max_slots_);
  };
  if (D_ == 128) {
    if (NP == 1) go(twl_estimate_kernel<128, 1>);
    else if (NP == 2) go(twl_estimate_kernel<128, 2>);
    else if (NP <= 4) go(twl_estimate_kernel<128, 4>);
    else go(twl_estimate_kernel<128, 8>);
  } else {
    if (NP == 1) go(twl_estimate_kernel<64, 1>);
    else if (NP == 2) go(twl_estimate_kernel<64, 2>);
    else if (NP <= 4) go(twl_estimate_kernel<64, 4>);
    else go(twl_estimate_kernel<64, 8>);
  }
  SPADE_CUDA_LAUNCH();
}

}  // namespace spade::cuda
