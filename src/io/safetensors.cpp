#include "io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace spade {

namespace {

using json = nlohmann::json;

// The safetensors reference implementation caps the header at 100 MB.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;
// Nesting deeper than this cannot be a valid header (which is at most 3 deep); checked
// before parsing so a hostile header cannot exhaust the stack.
constexpr int kMaxJsonDepth = 16;
constexpr size_t kMaxDims = 8;

struct DtypeEntry {
  const char* name;
  int bits;
  bool known;
  DType dtype;
};

const DtypeEntry kDtypes[] = {
    {"F32", 32, true, DType::F32},      {"F16", 16, true, DType::F16},
    {"BF16", 16, true, DType::BF16},    {"I32", 32, true, DType::I32},
    {"I8", 8, true, DType::I8},         {"F64", 64, false, DType::F32},
    {"I64", 64, false, DType::F32},     {"U64", 64, false, DType::F32},
    {"U32", 32, false, DType::F32},     {"I16", 16, false, DType::F32},
    {"U16", 16, false, DType::F32},     {"U8", 8, false, DType::F32},
    {"BOOL", 8, false, DType::F32},     {"F8_E4M3", 8, false, DType::F32},
    {"F8_E5M2", 8, false, DType::F32},  {"F8_E8M0", 8, false, DType::F32},
    {"C64", 64, false, DType::F32},     {"F6_E2M3", 6, false, DType::F32},
    {"F6_E3M2", 6, false, DType::F32},  {"F4", 4, false, DType::F32},
};

const DtypeEntry* find_dtype(const std::string& s) {
  for (const DtypeEntry& e : kDtypes)
    if (s == e.name) return &e;
  return nullptr;
}

int json_depth(const char* p, size_t n) {
  int depth = 0, max_depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < n; ++i) {
    char ch = p[i];
    if (in_string) {
      if (ch == '\\') ++i;
      else if (ch == '"') in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '{' || ch == '[') {
      max_depth = std::max(max_depth, ++depth);
    } else if (ch == '}' || ch == ']') {
      --depth;
    }
  }
  return max_depth;
}

uint64_t read_u64(const std::string& file, const json& j, const std::string& field) {
  if (!j.is_number_unsigned())
    fail(file, ": ", field, " must be a non-negative integer, found ", j.type_name());
  return j.get<uint64_t>();
}

}  // namespace

int64_t SafetensorsTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // overflow excluded at parse time
  return n;
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->file_ = MappedFile(path);
  f->path_ = path;
  f->parse_image(f->file_.data(), f->file_.size());
  return f;
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::parse(const uint8_t* data, size_t size,
                                                        const std::string& name) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = name;
  f->parse_image(data, size);
  return f;
}

void SafetensorsFile::parse_image(const uint8_t* data, size_t size) {
  const std::string& file = path_;
  if (size < 8) fail(file, ": truncated safetensors file (", size, " bytes, no header length)");
  uint64_t hlen;
  std::memcpy(&hlen, data, 8);
  if (hlen > kMaxHeaderBytes)
    fail(file, ": header length ", hlen, " exceeds the limit of ", kMaxHeaderBytes, " bytes");
  if (hlen > size - 8)
    fail(file, ": header length ", hlen, " exceeds the file size (", size, " bytes)");
  const char* hp = reinterpret_cast<const char*>(data + 8);
  if (hlen < 2 || hp[0] != '{')
    fail(file, ": header is not a JSON object (safetensors file expected)");
  if (json_depth(hp, size_t(hlen)) > kMaxJsonDepth)
    fail(file, ": header JSON is nested deeper than ", kMaxJsonDepth, " levels");

  json header;
  try {
    header = json::parse(hp, hp + hlen);
  } catch (const json::exception& e) {
    fail(file, ": header is not valid JSON: ", e.what());
  }
  if (!header.is_object()) fail(file, ": header is not a JSON object");

  const uint8_t* base = data + 8 + hlen;
  const uint64_t data_size = size - 8 - hlen;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail(file, ": __metadata__ must be an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          fail(file, ": __metadata__ '", m.key(), "' must be a string, found ",
               m.value().type_name());
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    std::string field = cat("tensor '", name, "'");
    if (!v.is_object()) fail(file, ": ", field, ": entry must be an object");
    SafetensorsTensor t;
    t.name = name;

    auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string()) fail(file, ": ", field, ": missing string 'dtype'");
    t.dtype_name = dt->get<std::string>();
    const DtypeEntry* de = find_dtype(t.dtype_name);
    if (!de) fail(file, ": ", field, ": unknown dtype '", t.dtype_name, "'");
    t.dtype_known = de->known;
    t.dtype = de->dtype;

    auto sh = v.find("shape");
    if (sh == v.end() || !sh->is_array()) fail(file, ": ", field, ": missing array 'shape'");
    if (sh->size() > kMaxDims)
      fail(file, ": ", field, ": ", sh->size(), " dimensions (at most ", kMaxDims, ")");
    uint64_t numel = 1;
    for (size_t d = 0; d < sh->size(); ++d) {
      uint64_t n = read_u64(file, (*sh)[d], cat(field, " shape[", d, "]"));
      if (n > uint64_t(std::numeric_limits<int64_t>::max()) ||
          (n != 0 && numel > uint64_t(std::numeric_limits<int64_t>::max()) / n))
        fail(file, ": ", field, ": element count overflows int64");
      numel *= n;
      t.shape.push_back(int64_t(n));
    }

    auto off = v.find("data_offsets");
    if (off == v.end() || !off->is_array() || off->size() != 2)
      fail(file, ": ", field, ": 'data_offsets' must be an array [begin, end]");
    t.begin = read_u64(file, (*off)[0], field + " data_offsets[0]");
    t.end = read_u64(file, (*off)[1], field + " data_offsets[1]");
    if (t.begin > t.end)
      fail(file, ": ", field, ": data_offsets [", t.begin, ", ", t.end, ") are reversed");
    if (t.end > data_size)
      fail(file, ": ", field, ": data_offsets [", t.begin, ", ", t.end,
           ") extend beyond the data section (", data_size, " bytes)");
    if (numel > std::numeric_limits<uint64_t>::max() / uint64_t(de->bits))
      fail(file, ": ", field, ": byte size overflows");
    uint64_t bits = numel * uint64_t(de->bits);
    if (bits % 8 != 0 || t.end - t.begin != bits / 8)
      fail(file, ": ", field, ": data_offsets span ", t.end - t.begin, " bytes but ",
           t.dtype_name, " ", numel, " elements need ", bits / 8, (bits % 8 ? "+" : ""),
           " bytes");
    t.nbytes = size_t(t.end - t.begin);
    t.data = base + t.begin;
    tensors_.push_back(std::move(t));
  }

  std::sort(tensors_.begin(), tensors_.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  for (size_t i = 1; i < tensors_.size(); ++i) {
    const SafetensorsTensor& a = tensors_[i - 1];
    const SafetensorsTensor& b = tensors_[i];
    if (b.begin < a.end)
      fail(file, ": tensors '", a.name, "' and '", b.name, "' overlap in the data section");
  }
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
}

const SafetensorsTensor* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

TensorView SafetensorsFile::view(const SafetensorsTensor& t) const {
  if (!t.dtype_known)
    fail(path_, ": tensor '", t.name, "' has dtype ", t.dtype_name,
         ", which spade cannot read (supported: F32, F16, BF16, I32, I8)");
  if (t.shape.size() > size_t(TensorView::kMaxDims))
    fail(path_, ": tensor '", t.name, "' has ", t.shape.size(), " dimensions (at most ",
         TensorView::kMaxDims, ")");
  TensorView v;
  v.data = const_cast<uint8_t*>(t.data);
  v.dtype = t.dtype;
  v.ndim = int(t.shape.size());
  for (int i = 0; i < v.ndim; ++i) v.shape[i] = t.shape[size_t(i)];
  v.set_contiguous_strides();
  return v;
}

}  // namespace spade
