// Twilight on the GPU over Quest (`twilight:base=quest` / `quest+twilight`, the registry's
// "twilight" row): Quest's page selection (GpuQuest), then Twilight's pruning stage
// (twilight_stage.h, run by SelectingMethod over the Chunk16 page lists: top-p of an INT4
// estimate of the keys, the model's GpuPageHooks::k_int4, written by every KV append), then
// attention over the kept tokens. Twilight prunes even when Quest keeps every page (as the CPU
// method does). Twilight over the other GPU selectors (full, tidal, lessismore,
// lycheecluster) is that selector's class with CudaSparse::twilight_sel: the same stage.
//
// Layout / bytes: GpuQuest's, which include the stage's (SelectingMethod::twilight_bytes for
// Chunk16 lists of at most min(budget / 16, seq_pages_cap) pages: the pruner, the kept lists'
// SparseAttention + 4 MiB). Reads the INT4 codes [L][pages][Hkv][P][D/2] and their u32
// scale/zero [L][pages][Hkv][P].
#if defined(SPADE_HAVE_CUDA)
#include "core/error.h"
#include "sparse/gpu/quest.h"
#include "sparse/gpu/registry.h"

namespace spade {

namespace {

class GpuTwilight final : public GpuQuest {
 public:
  GpuTwilight(const GpuMethodContext& ctx, const CudaSparse& sp) : GpuQuest(ctx, sp) {}

  static size_t arena_bytes_of(const GpuMethodContext& ctx, const CudaSparse& sp) {
    return GpuQuest::arena_bytes_of(ctx, sp);
  }

  static std::string describe_spec(const CudaSparse& sp) {
    return cat("twilight p=", sp.twilight_p, " eps=", sp.twilight_eps,
               " head_combine=union keys=int4 (GPU: INT4 copy written by the KV append)"
               " dense_layers=", sp.dense_layers, " over [quest budget=", sp.budget,
               " page_size=16 pages=", sp.budget / 16, " group=max scores=",
               sp.quest_fast ? "fast" : "exact", "]");
  }
};

}  // namespace

const GpuMethodKind gpu_twilight = SPADE_GPU_METHOD_KIND(GpuTwilight);

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
