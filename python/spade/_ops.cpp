// spade._core's kernel functions (src/api/ops.h) for python/spade/ops.py: raw pointers (a torch
// tensor's data_ptr()), sizes and a CUDA stream handle, never a torch type (the extension does
// not link libtorch). ops.py checks the tensors; these check the sizes and (CPU) the indices.
// Every call releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "api/ops.h"

namespace py = pybind11;
using namespace spade::api::ops;

namespace {

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// (k, v, n_pages, Hkv, P, D, indptr, indices, lens, B)
Paged paged(uintptr_t k, uintptr_t v, int64_t n_pages, int Hkv, int P, int D, uintptr_t indptr,
            uintptr_t indices, uintptr_t lens, int B) {
  Paged p;
  p.k = ptr<const void>(k);
  p.v = ptr<const void>(v);
  p.n_pages = n_pages;
  p.Hkv = Hkv, p.P = P, p.D = D;
  p.indptr = ptr<const int32_t>(indptr);
  p.indices = ptr<const int32_t>(indices);
  p.lens = ptr<const int32_t>(lens);
  p.B = B;
  return p;
}

// SPADE_PY_KEEP_GIL: every call keeps the GIL (a diagnostic build of bench/py_crash_diag.sh).
#ifdef SPADE_PY_KEEP_GIL
using Release = py::call_guard<>;
#else
using Release = py::call_guard<py::gil_scoped_release>;
#endif

}  // namespace

void bind_ops(py::module_& m) {
  m.def("ops_have_cuda", &have_cuda);
  m.def(
      "ops_cpu_attention",
      [](int dt, uintptr_t q, int Hq, uintptr_t k, uintptr_t v, int64_t n_pages, int Hkv, int P,
         int D, uintptr_t indptr, uintptr_t indices, uintptr_t lens, int B, uintptr_t sel_off,
         uintptr_t sel_idx, int lists_per_req, int gran, float scale, uintptr_t out) {
        const Paged kv = paged(k, v, n_pages, Hkv, P, D, indptr, indices, lens, B);
        Lists l{ptr<const int32_t>(sel_off), ptr<const int32_t>(sel_idx), lists_per_req, gran};
        cpu_attention(DType(dt), ptr<const void>(q), Hq, kv, sel_off ? &l : nullptr, scale,
                      ptr<void>(out));
      },
      Release());
  m.def(
      "ops_cpu_quest_meta",
      [](int dt, uintptr_t k, int64_t n_pages, int Hkv, int P, int D, uintptr_t page_ids,
         uintptr_t n_valid, int n, uintptr_t meta) {
        cpu_quest_meta(DType(dt), ptr<const void>(k), n_pages, Hkv, P, D,
                       ptr<const int32_t>(page_ids), ptr<const int32_t>(n_valid), n, ptr<void>(meta));
      },
      Release());
  m.def(
      "ops_cpu_quest_select",
      [](int dt, uintptr_t q, int Hq, uintptr_t meta, int64_t n_pages, int Hkv, int P, int D,
         uintptr_t indptr, uintptr_t indices, uintptr_t lens, int B, int k_pages,
         uintptr_t sel_off, uintptr_t sel_idx) {
        const Paged kv = paged(0, 0, n_pages, Hkv, P, D, indptr, indices, lens, B);
        cpu_quest_select(DType(dt), ptr<const void>(q), Hq, ptr<const void>(meta), kv, k_pages,
                         ptr<int32_t>(sel_off), ptr<int32_t>(sel_idx));
      },
      Release());
  m.def(
      "ops_cpu_topk_rows",
      [](uintptr_t scores, int64_t ld, uintptr_t n, int n_rows, int64_t k, uintptr_t sel_off,
         uintptr_t sel_idx) {
        cpu_topk_rows(ptr<const float>(scores), ld, ptr<const int32_t>(n), n_rows, k,
                      ptr<int32_t>(sel_off), ptr<int32_t>(sel_idx));
      },
      Release());
  m.def(
      "ops_cpu_lessismore_select",
      [](uintptr_t scores, int64_t ld, uintptr_t lens, int B, int Hq, int64_t budget,
         int64_t n_recent, int64_t sinks, uintptr_t sel_off, uintptr_t sel_idx) {
        cpu_lessismore_select(ptr<const float>(scores), ld, ptr<const int32_t>(lens), B, Hq,
                              budget, n_recent, sinks, ptr<int32_t>(sel_off), ptr<int32_t>(sel_idx));
      },
      Release());

  py::class_<ClusterIndexOp>(m, "ClusterIndexOp")
      .def(py::init<>())
      .def(
          "build",
          [](ClusterIndexOp& c, uintptr_t keys, int64_t L, int D, uintptr_t starts, int n_chunks,
             double chunks_per_fine, int max_coarse, int coarse_units, int kmeans_iterations,
             const std::string& pooling, const std::string& space, bool f16_centers) {
            spade::sparse::ClusterIndexOptions o;
            o.chunks_per_fine = chunks_per_fine;
            o.max_coarse = max_coarse;
            o.coarse_units = coarse_units;
            o.kmeans.iterations = kmeans_iterations;
            o.pooling = pooling == "max" ? spade::sparse::Pooling::Max : spade::sparse::Pooling::Mean;
            o.space = space == "chunk" ? spade::sparse::BoundSpace::Chunk
                                       : spade::sparse::BoundSpace::Token;
            o.f16_centers = f16_centers;
            c.build(ptr<const float>(keys), L, D, ptr<const int32_t>(starts), n_chunks, o);
          },
          Release())
      .def(
          "insert",
          [](ClusterIndexOp& c, uintptr_t keys, int64_t L, int D, uintptr_t starts, int n_starts) {
            c.insert(ptr<const float>(keys), L, D, ptr<const int32_t>(starts), n_starts);
          },
          Release())
      .def(
          "search",
          [](const ClusterIndexOp& c, uintptr_t q, int G, int D, int64_t budget, int coarse_topk,
             double coarse_cover, const std::string& group, const std::string& rank,
             uintptr_t starts, int n_starts) {
            spade::sparse::SearchParams p;
            p.budget = budget;
            p.coarse_topk = coarse_topk;
            p.coarse_cover = coarse_cover;
            p.group = group == "sum" ? spade::sparse::GroupAgg::Sum : spade::sparse::GroupAgg::Max;
            p.rank = rank == "center" ? spade::sparse::RankBy::Center : spade::sparse::RankBy::Bound;
            return c.search(ptr<const float>(q), G, D, p, ptr<const int32_t>(starts), n_starts);
          },
          Release())
      .def("n_chunks", [](const ClusterIndexOp& c) { return c.index().n_chunks(); })
      .def("n_fine", [](const ClusterIndexOp& c) { return c.index().n_fine(); })
      .def("n_coarse", [](const ClusterIndexOp& c) { return c.index().n_coarse(); })
      .def("built", [](const ClusterIndexOp& c) { return c.index().built(); })
      .def("bytes", [](const ClusterIndexOp& c) { return c.index().bytes(); });

  py::class_<CudaClusterIndex>(m, "CudaClusterIndex")
      .def(py::init<int, int, int, int, int, int, double, int, int>(), Release())
      .def("reset", &CudaClusterIndex::reset, Release())
      .def(
          "build",
          [](CudaClusterIndex& c, int slot, uintptr_t k, uintptr_t pages, uintptr_t starts,
             int n_chunks, uintptr_t stream) {
            c.build(slot, ptr<const void>(k), ptr<const int32_t>(pages),
                    ptr<const int32_t>(starts), n_chunks, stream);
          },
          Release())
      .def(
          "insert",
          [](CudaClusterIndex& c, int slot, uintptr_t k, uintptr_t pages, int n_old,
             uintptr_t new_ends, int n_new, uintptr_t stream) {
            c.insert(slot, ptr<const void>(k), ptr<const int32_t>(pages), n_old,
                     ptr<const int32_t>(new_ends), n_new, stream);
          },
          Release())
      .def(
          "search",
          [](const CudaClusterIndex& c, uintptr_t q, uintptr_t slot, uintptr_t kv_len, int B,
             int Hq, int64_t budget, int coarse_topk, double coarse_cover, int sink, int cap,
             uintptr_t lists, uintptr_t counts, uintptr_t sel_off, uintptr_t sel_idx,
             uintptr_t stream) {
            c.search(ptr<const void>(q), ptr<const int32_t>(slot), ptr<const int32_t>(kv_len), B,
                     Hq, budget, coarse_topk, coarse_cover, sink, cap, ptr<int32_t>(lists),
                     ptr<int32_t>(counts), ptr<int32_t>(sel_off), ptr<int32_t>(sel_idx), stream);
          },
          Release())
      .def("arena_bytes", &CudaClusterIndex::arena_bytes);

  py::class_<CudaDecode>(m, "CudaDecode")
      .def(py::init<int, int, int64_t, int, int, int, int>(), py::arg("device"),
           py::arg("max_batch"), py::arg("max_pages"), py::arg("Hq"), py::arg("Hkv"),
           py::arg("D"), py::arg("P"), Release())
      .def(
          "plan",
          [](CudaDecode& c, int64_t n_pages, int Hkv, int P, int D, uintptr_t indptr,
             uintptr_t indices, uintptr_t lens, int B, uintptr_t stream) {
            c.plan(paged(0, 0, n_pages, Hkv, P, D, indptr, indices, lens, B), stream);
          },
          Release())
      .def(
          "run",
          [](const CudaDecode& c, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out,
             float scale, uintptr_t stream) {
            c.run(ptr<const void>(q), ptr<const void>(k), ptr<const void>(v), ptr<void>(out),
                  scale, stream);
          },
          Release())
      .def("batch", &CudaDecode::batch)
      .def("arena_bytes", &CudaDecode::arena_bytes);

  py::class_<CudaSparse>(m, "CudaSparse")
      .def(py::init<int, int, int64_t, int, int, int, int>(), py::arg("device"),
           py::arg("max_batch"), py::arg("max_pages"), py::arg("Hq"), py::arg("Hkv"),
           py::arg("D"), py::arg("P"), Release())
      .def(
          "plan",
          [](CudaSparse& c, int64_t n_pages, int Hkv, int P, int D, uintptr_t indptr,
             uintptr_t indices, uintptr_t lens, int B, int gran, int lists_per_req,
             const std::vector<int>& max_entries, uintptr_t stream) {
            c.plan(paged(0, 0, n_pages, Hkv, P, D, indptr, indices, lens, B), gran, lists_per_req,
                   max_entries, stream);
          },
          Release())
      .def(
          "run",
          [](const CudaSparse& c, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t sel_off,
             uintptr_t sel_idx, uintptr_t out, float scale, uintptr_t stream) {
            c.run(ptr<const void>(q), ptr<const void>(k), ptr<const void>(v),
                  ptr<const int32_t>(sel_off), ptr<const int32_t>(sel_idx), ptr<void>(out), scale,
                  stream);
          },
          Release())
      .def("batch", &CudaSparse::batch);

  m.def(
      "ops_cuda_quest_meta",
      [](int device, uintptr_t k, int Hkv, int P, int D, uintptr_t page_ids, uintptr_t n_valid,
         int n, uintptr_t meta, uintptr_t stream) {
        cuda_quest_meta(device, ptr<const void>(k), Hkv, P, D, ptr<const int32_t>(page_ids),
                        ptr<const int32_t>(n_valid), n, ptr<void>(meta), stream);
      },
      Release());
  m.def(
      "ops_cuda_quest_select",
      [](int device, uintptr_t q, int Hq, uintptr_t meta, int64_t n_pages, int Hkv, int P, int D,
         uintptr_t indptr, uintptr_t indices, uintptr_t lens, int B, int max_pages, int k_pages,
         uintptr_t scores, uintptr_t sel_off, uintptr_t sel_idx, uintptr_t stream) {
        const Paged kv = paged(0, 0, n_pages, Hkv, P, D, indptr, indices, lens, B);
        cuda_quest_select(device, ptr<const void>(q), Hq, ptr<const void>(meta), kv, max_pages,
                          k_pages, ptr<float>(scores), ptr<int32_t>(sel_off),
                          ptr<int32_t>(sel_idx), stream);
      },
      Release());
  m.def(
      "ops_cuda_topk_rows",
      [](int device, uintptr_t scores, int64_t ld, uintptr_t lens, int B, int H, int k,
         uintptr_t row_n, uintptr_t strided, uintptr_t sel_off, uintptr_t sel_idx,
         uintptr_t stream) {
        cuda_topk_rows(device, ptr<const float>(scores), ld, ptr<const int32_t>(lens), B, H, k,
                       ptr<int32_t>(row_n), ptr<int32_t>(strided), ptr<int32_t>(sel_off),
                       ptr<int32_t>(sel_idx), stream);
      },
      Release());
  m.def(
      "ops_cpu_twilight_prune",
      [](int dt, uintptr_t q, int Hq, uintptr_t k, int64_t n_pages, int Hkv, int P, int D,
         uintptr_t indptr, uintptr_t indices, uintptr_t lens, int B, uintptr_t sel_off,
         uintptr_t sel_idx, int gran, double p, double eps, float scale, uintptr_t kept_off,
         uintptr_t kept_idx) {
        const Paged kv = paged(k, 0, n_pages, Hkv, P, D, indptr, indices, lens, B);
        const Lists l{ptr<const int32_t>(sel_off), ptr<const int32_t>(sel_idx), Hkv, gran};
        cpu_twilight_prune(DType(dt), ptr<const void>(q), Hq, kv, l, p, eps, scale,
                           ptr<int32_t>(kept_off), ptr<int32_t>(kept_idx));
      },
      Release());
  m.def(
      "ops_cuda_twilight_prune",
      [](int device, uintptr_t q, int Hq, uintptr_t k, int64_t n_pages, int Hkv, int P, int D,
         uintptr_t indptr, uintptr_t indices, uintptr_t lens, int B, uintptr_t page_ids,
         uintptr_t n_valid, int n, uintptr_t codes, uintptr_t sz, uintptr_t sel_off,
         uintptr_t sel_idx, int gran, int max_slots, double p, double eps, float scale,
         uintptr_t kept_off, uintptr_t kept_idx, uintptr_t stream) {
        const Paged kv = paged(k, 0, n_pages, Hkv, P, D, indptr, indices, lens, B);
        cuda_twilight_prune(device, ptr<const void>(q), Hq, kv, ptr<const int32_t>(page_ids),
                            ptr<const int32_t>(n_valid), n, ptr<uint8_t>(codes),
                            ptr<uint32_t>(sz), ptr<const int32_t>(sel_off),
                            ptr<const int32_t>(sel_idx), gran, max_slots, p, eps, scale,
                            ptr<int32_t>(kept_off), ptr<int32_t>(kept_idx), stream);
      },
      Release());
  m.def("ops_cuda_lessismore_scratch_bytes", &cuda_lessismore_scratch_bytes);
  m.def(
      "ops_cuda_lessismore_select",
      [](int device, uintptr_t scores, int64_t ld, uintptr_t lens, int B, int Hq, int budget,
         int n_recent, int sinks, uintptr_t scratch, uintptr_t sel_off, uintptr_t sel_idx,
         uintptr_t stream) {
        cuda_lessismore_select(device, ptr<const float>(scores), ld, ptr<const int32_t>(lens), B,
                               Hq, budget, n_recent, sinks, ptr<void>(scratch),
                               ptr<int32_t>(sel_off), ptr<int32_t>(sel_idx), stream);
      },
      Release());
}
