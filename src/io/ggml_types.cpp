#include "io/ggml_types.h"

namespace spade {

namespace {

struct Entry {
  uint32_t id;
  GgmlTypeInfo info;
};

// Block geometry as defined by ggml (ggml-common.h); ids 4, 5, 31-33, 36-38 are retired.
const Entry kTypes[] = {
    {0, {"f32", 1, 4, true, DType::F32}},
    {1, {"f16", 1, 2, true, DType::F16}},
    {2, {"q4_0", 32, 18, true, DType::Q4_0}},
    {3, {"q4_1", 32, 20, true, DType::Q4_1}},
    {6, {"q5_0", 32, 22, false, DType::F32}},
    {7, {"q5_1", 32, 24, false, DType::F32}},
    {8, {"q8_0", 32, 34, true, DType::Q8_0}},
    {9, {"q8_1", 32, 36, false, DType::F32}},
    {10, {"q2_k", 256, 84, false, DType::F32}},
    {11, {"q3_k", 256, 110, false, DType::F32}},
    {12, {"q4_k", 256, 144, true, DType::Q4_K}},
    {13, {"q5_k", 256, 176, true, DType::Q5_K}},
    {14, {"q6_k", 256, 210, true, DType::Q6_K}},
    {15, {"q8_k", 256, 292, false, DType::F32}},
    {16, {"iq2_xxs", 256, 66, false, DType::F32}},
    {17, {"iq2_xs", 256, 74, false, DType::F32}},
    {18, {"iq3_xxs", 256, 98, false, DType::F32}},
    {19, {"iq1_s", 256, 50, false, DType::F32}},
    {20, {"iq4_nl", 32, 18, false, DType::F32}},
    {21, {"iq3_s", 256, 110, false, DType::F32}},
    {22, {"iq2_s", 256, 82, false, DType::F32}},
    {23, {"iq4_xs", 256, 136, false, DType::F32}},
    {24, {"i8", 1, 1, false, DType::F32}},
    {25, {"i16", 1, 2, false, DType::F32}},
    {26, {"i32", 1, 4, false, DType::F32}},
    {27, {"i64", 1, 8, false, DType::F32}},
    {28, {"f64", 1, 8, false, DType::F32}},
    {29, {"iq1_m", 256, 56, false, DType::F32}},
    {30, {"bf16", 1, 2, true, DType::BF16}},
    {34, {"tq1_0", 256, 54, false, DType::F32}},
    {35, {"tq2_0", 256, 66, false, DType::F32}},
    {39, {"mxfp4", 32, 17, false, DType::F32}},
    {40, {"nvfp4", 64, 36, false, DType::F32}},
    {41, {"q1_0", 128, 18, false, DType::F32}},
};

}  // namespace

const GgmlTypeInfo* ggml_type_info(uint32_t id) {
  for (const Entry& e : kTypes)
    if (e.id == id) return &e.info;
  return nullptr;
}

std::string ggml_type_name(uint32_t id) {
  if (const GgmlTypeInfo* t = ggml_type_info(id)) return t->name;
  return "ggml_type_" + std::to_string(id);
}

}  // namespace spade
