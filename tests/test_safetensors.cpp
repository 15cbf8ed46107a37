// Safetensors reader: small files written here, every validation path, sharded index.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "core/error.h"
#include "core/half.h"
#include "gguf_test_writer.h"
#include "io/dequant.h"
#include "io/safetensors.h"
#include "safetensors_test_writer.h"

namespace spade {
namespace {

using test::StEntry;

std::unique_ptr<SafetensorsFile> parse(const std::vector<uint8_t>& b) {
  return SafetensorsFile::parse(b.data(), b.size(), "test.safetensors");
}

void expect_error(const std::vector<uint8_t>& b, std::initializer_list<const char*> parts) {
  try {
    parse(b);
    ADD_FAILURE() << "parsed without error; expected: " << *parts.begin();
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const char* p : parts) EXPECT_NE(msg.find(p), std::string::npos) << msg;
  }
}

std::vector<uint8_t> raw(const std::string& header, size_t data_bytes = 16) {
  return test::safetensors_raw(header, std::vector<uint8_t>(data_bytes, 0));
}

std::vector<uint8_t> sample() {
  return test::safetensors_image(
      {{"w", "F32", {2, 3}, test::f32_bytes({0, 1, 2, 3, 4, 5})},
       {"h", "F16", {4}, test::f16_bytes({0.5f, -2.f, 65504.f, 1e-7f})},
       {"b", "BF16", {2, 2}, test::bf16_bytes({1.f, -3.f, 0.15625f, 1e30f})},
       {"ids", "I64", {2}, std::vector<uint8_t>(16, 1)},
       {"scalar", "F32", {}, test::f32_bytes({7.f})}},
      {{"format", "pt"}});
}

TEST(Safetensors, ReadsTensorsAndMetadata) {
  auto bytes = sample();
  auto f = parse(bytes);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  ASSERT_EQ(f->tensors().size(), 5u);

  const SafetensorsTensor* w = f->find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dtype_name, "F32");
  EXPECT_EQ(w->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(w->nbytes, 24u);
  TensorView v = f->view(*w);
  EXPECT_EQ(v.dtype, DType::F32);
  EXPECT_EQ(v.shape_str(), "[2, 3]");
  for (int i = 0; i < 6; ++i) EXPECT_EQ(v.as<const float>()[i], float(i));

  TensorView h = f->view(*f->find("h"));
  std::vector<float> out(4);
  dequantize(h.dtype, h.data, out.data(), 4);
  EXPECT_EQ(out[0], 0.5f);
  EXPECT_EQ(out[1], -2.f);
  EXPECT_EQ(out[2], 65504.f);
  EXPECT_NEAR(out[3], 1e-7f, 6e-8f);  // f16 subnormal spacing is 2^-24

  TensorView b = f->view(*f->find("b"));
  dequantize(b.dtype, b.data, out.data(), 4);
  EXPECT_EQ(out[0], 1.f);
  EXPECT_EQ(out[1], -3.f);
  EXPECT_EQ(out[2], 0.15625f);
  EXPECT_NEAR(out[3], 1e30f, 1e30f * 4e-3f);  // bf16: 8 mantissa bits

  const SafetensorsTensor* s = f->find("scalar");
  EXPECT_TRUE(s->shape.empty());
  EXPECT_EQ(s->numel(), 1);
  EXPECT_EQ(f->view(*s).as<const float>()[0], 7.f);

  const SafetensorsTensor* ids = f->find("ids");
  EXPECT_FALSE(ids->dtype_known);
  try {
    f->view(*ids);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("I64"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'ids'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(f->find("nope"), nullptr);
}

TEST(SafetensorsErrors, HeaderLength) {
  expect_error({1, 2, 3}, {"test.safetensors", "truncated"});
  auto b = sample();
  uint64_t n = b.size();  // more than the bytes after the length field
  std::memcpy(b.data(), &n, 8);
  expect_error(b, {"header length", "exceeds the file size"});
  n = uint64_t(1) << 62;
  std::memcpy(b.data(), &n, 8);
  expect_error(b, {"header length", "limit"});
}

TEST(SafetensorsErrors, TruncatedAtEveryByte) {
  auto good = sample();
  for (size_t n = 0; n < good.size(); ++n) {
    std::vector<uint8_t> b(good.begin(), good.begin() + long(n));
    EXPECT_THROW(parse(b), Error) << "prefix of " << n << " bytes";
  }
  EXPECT_NO_THROW(parse(good));
}

TEST(SafetensorsErrors, BadJson) {
  expect_error(raw("[1, 2]  "), {"not a JSON object"});
  expect_error(raw("{\"a\": "), {"not valid JSON"});
  expect_error(raw("{\"a\": \"\xff\xfe\"}"), {"not valid JSON"});
  expect_error(raw("{\"a\":" + std::string(5000, '[') + std::string(5000, ']') + "}"),
               {"nested"});
  expect_error(raw("{\"__metadata__\": {\"k\": 3}}"), {"__metadata__", "'k'"});
  expect_error(raw("{\"__metadata__\": []}"), {"__metadata__"});
}

TEST(SafetensorsErrors, BadEntries) {
  auto entry = [](const std::string& body) { return raw("{\"t\": " + body + "}"); };
  expect_error(entry("3"), {"tensor 't'", "object"});
  expect_error(entry(R"({"shape": [1], "data_offsets": [0, 4]})"), {"tensor 't'", "dtype"});
  expect_error(entry(R"({"dtype": "F7", "shape": [1], "data_offsets": [0, 4]})"),
               {"tensor 't'", "unknown dtype 'F7'"});
  expect_error(entry(R"({"dtype": "F32", "data_offsets": [0, 4]})"), {"tensor 't'", "shape"});
  expect_error(entry(R"({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]})"),
               {"tensor 't'", "shape[0]"});
  expect_error(entry(R"({"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]})"),
               {"tensor 't'", "shape[0]"});
  expect_error(entry(R"({"dtype": "F32", "shape": [1,1,1,1,1,1,1,1,1], "data_offsets": [0, 4]})"),
               {"tensor 't'", "dimensions"});
  expect_error(entry(R"({"dtype": "F32", "shape": [1], "data_offsets": [0]})"),
               {"tensor 't'", "data_offsets"});
  expect_error(entry(R"({"dtype": "F32", "shape": [1], "data_offsets": [8, 4]})"),
               {"tensor 't'", "reversed"});
  expect_error(entry(R"({"dtype": "F32", "shape": [1], "data_offsets": [16, 20]})"),
               {"tensor 't'", "beyond the data section"});
  expect_error(entry(R"({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]})"),
               {"tensor 't'", "need 8 bytes"});
  expect_error(entry(R"({"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 4]})"),
               {"tensor 't'", "overflows"});
  expect_error(entry(R"({"dtype": "F64", "shape": [2305843009213693952], "data_offsets": [0, 4]})"),
               {"tensor 't'"});
  expect_error(entry(R"({"dtype": "F32", "shape": [1], "data_offsets": [0, 18446744073709551615]})"),
               {"tensor 't'"});
  expect_error(raw(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                       "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})"),
               {"overlap"});
}

TEST(SafetensorsErrors, RandomMutationsNeverCrash) {
  auto good = sample();
  std::mt19937 rng(99);
  int parsed = 0;
  for (int it = 0; it < 3000; ++it) {
    auto b = good;
    int edits = 1 + int(rng() % 3);
    for (int e = 0; e < edits; ++e) {
      size_t at = rng() % b.size();
      b[at] = (rng() % 2) ? uint8_t(rng()) : uint8_t("{}[]\":,0123456789-e"[rng() % 19]);
    }
    try {
      auto f = parse(b);
      for (const auto& t : f->tensors()) {
        if (!t.dtype_known || t.shape.size() > 4) continue;
        TensorView v = f->view(t);
        if (v.dtype == DType::I32 || v.dtype == DType::I8) continue;
        std::vector<float> out(size_t(t.numel()));
        dequantize(v.dtype, v.data, out.data(), t.numel());
      }
      ++parsed;
    } catch (const Error&) {
    }
  }
  EXPECT_GT(parsed, 0);
}

TEST(SafetensorsModel, OpensSingleFileDirectory) {
  test::TempDir dir("st_single");
  test::write_file(dir.file("model.safetensors"), sample());
  auto m = SafetensorsModel::open(dir.path());
  EXPECT_EQ(m->shard_count(), 1u);
  EXPECT_EQ(m->view("w").as<const float>()[5], 5.f);
  EXPECT_EQ(m->tensors().size(), 5u);
  try {
    m->get("missing.weight");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.weight"), std::string::npos);
  }
  // A file path works too.
  EXPECT_EQ(SafetensorsModel::open(dir.file("model.safetensors"))->shard_count(), 1u);
}

TEST(SafetensorsModel, OpensShardedIndex) {
  test::TempDir dir("st_sharded");
  test::write_file(dir.file("model-00001-of-00002.safetensors"),
                   test::safetensors_image({{"a", "F32", {2}, test::f32_bytes({1, 2})},
                                            {"b", "F32", {1}, test::f32_bytes({3})}}));
  test::write_file(dir.file("model-00002-of-00002.safetensors"),
                   test::safetensors_image({{"c", "BF16", {2}, test::bf16_bytes({4, 5})}}));
  test::write_file(dir.file("model.safetensors.index.json"), std::string(R"({
    "metadata": {"total_size": 16},
    "weight_map": {"a": "model-00001-of-00002.safetensors",
                   "b": "model-00001-of-00002.safetensors",
                   "c": "model-00002-of-00002.safetensors"}})"));
  auto m = SafetensorsModel::open(dir.path());
  EXPECT_EQ(m->shard_count(), 2u);
  EXPECT_EQ(m->view("a").as<const float>()[1], 2.f);
  EXPECT_EQ(m->view("b").as<const float>()[0], 3.f);
  EXPECT_EQ(m->get("c").dtype_name, "BF16");
  EXPECT_EQ(m->tensors().size(), 3u);
}

TEST(SafetensorsModel, IndexErrors) {
  auto setup = [](const test::TempDir& dir, const std::string& index) {
    test::write_file(dir.file("s1.safetensors"),
                     test::safetensors_image({{"a", "F32", {1}, test::f32_bytes({1})}}));
    test::write_file(dir.file("s2.safetensors"),
                     test::safetensors_image({{"a", "F32", {1}, test::f32_bytes({2})}}));
    test::write_file(dir.file("model.safetensors.index.json"), index);
  };
  auto expect_msg = [](const std::string& path, const char* part) {
    try {
      SafetensorsModel::open(path);
      ADD_FAILURE() << "opened; expected " << part;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  {
    test::TempDir d("st_idx1");
    setup(d, R"({"weight_map": {"a": "s1.safetensors", "zz": "s1.safetensors"}})");
    expect_msg(d.path(), "'zz'");
  }
  {
    test::TempDir d("st_idx2");
    setup(d, R"({"weight_map": {"a": "../s1.safetensors"}})");
    expect_msg(d.path(), "invalid shard");
  }
  {
    test::TempDir d("st_idx3");
    setup(d, R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})");
    expect_msg(d.path(), "appears in both");
  }
  {
    test::TempDir d("st_idx4");
    setup(d, R"({"weight_map": {"a": "missing.safetensors"}})");
    expect_msg(d.path(), "missing.safetensors");
  }
  {
    test::TempDir d("st_idx5");
    setup(d, R"({"weight_map": 3})");
    expect_msg(d.path(), "weight_map");
  }
  {
    test::TempDir d("st_empty");
    expect_msg(d.path(), "neither model.safetensors");
  }
}

}  // namespace
}  // namespace spade
