// Quest on the GPU (the CPU's QuestMethod with group=max and page_size == KV page size == 16):
// per-page key min/max kept by the model on every KV append (GpuPageHooks::quest_meta), page
// scores + radix top-k writing the CSR lists (Chunk16 entries: pages), attention over them.
// Twilight (twilight.cpp, selecting.h's TwilightStage) prunes this selection further.
//
// Layout / bytes (after SelectingMethod's lists, selecting.h): f32 page scores
// [max_batch * Hkv][seq_pages_cap] + 256 B; lists of at most max(1, min(budget / 16,
// seq_pages_cap)) pages per (request, KV head); with Twilight (twilight_any), its stage
// (SelectingMethod::twilight_bytes). Reads the model's bf16 metadata [L][pages][Hkv][2][D].
#pragma once
#if defined(SPADE_HAVE_CUDA)
#include <string>
#include <vector>

#include "sparse/gpu/selecting.h"

namespace spade {

class GpuQuest : public SelectingMethod {
 public:
  GpuQuest(const GpuMethodContext& ctx, const CudaSparse& sp) : SelectingMethod(ctx, sp) {}
  static size_t arena_bytes_of(const GpuMethodContext& ctx, const CudaSparse& sp);
  static std::string describe_spec(const CudaSparse& sp);

 protected:
  static int64_t quest_sel_cap(const GpuMethodContext& ctx, const CudaSparse& sp);
  static size_t quest_bytes(const GpuMethodContext& ctx);
  void check() const override;
  int64_t sel_cap() const override { return quest_sel_cap(ctx_, sp_); }
  void alloc_state(cuda::DeviceArena& A) override;
  cuda::SelGran gran() const override { return cuda::SelGran::Chunk16; }
  void list_entries(const SeqInput* seqs, int n, bool& any_sparse) override;
  int64_t list_rows(int l, int64_t L) const override;
  void attend_lists(int layer, const void* q, const void* kc, const void* vc, void* att,
                    float scale) override;
  // The layer's page selection into the CSR lists (and the trace).
  void select_pages(int layer, const void* q);
  // Twilight over Quest: the layer's page selection (Chunk16 lists).
  TwilightBaseLists twilight_base(int layer, const void* q, const void* kc) override;

  float* quest_scores_ = nullptr;
};

}  // namespace spade
#endif  // SPADE_HAVE_CUDA
