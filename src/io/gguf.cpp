// GGUF reader. Layout (little-endian): magic "GGUF", u32 version, u64 tensor_count,
// u64 kv_count, kv_count x {string key, u32 type, value}, tensor_count x {string name,
// u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset}, padding to `general.alignment`,
// then the tensor data. Strings are u64 length + bytes (no terminator).
#include "io/gguf.h"

#include <bit>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "io/ggml_types.h"

static_assert(std::endian::native == std::endian::little,
              "the GGUF reader assumes a little-endian host");

namespace spade {

namespace {

constexpr uint32_t kMaxDims = 4;
constexpr uint32_t kMaxAlignment = 1u << 24;
// The smallest encodings of a kv pair (empty key, u8 value) and a 1-d tensor info: used to
// reject counts that the remaining bytes could not possibly hold before allocating.
constexpr uint64_t kMinKvBytes = 8 + 4 + 1;
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;

const char* value_type_name(GgufValueType t) {
  static const char* names[] = {"uint8", "int8",   "uint16", "int16", "uint32",
                                "int32", "float32", "bool",  "string", "array",
                                "uint64", "int64", "float64"};
  auto i = static_cast<uint32_t>(t);
  return i < 13 ? names[i] : "unknown";
}

// Size in bytes of a fixed-size scalar type; 0 for string/array.
size_t scalar_size(GgufValueType t) {
  switch (t) {
    case GgufValueType::UINT8: case GgufValueType::INT8: case GgufValueType::BOOL: return 1;
    case GgufValueType::UINT16: case GgufValueType::INT16: return 2;
    case GgufValueType::UINT32: case GgufValueType::INT32: case GgufValueType::FLOAT32: return 4;
    case GgufValueType::UINT64: case GgufValueType::INT64: case GgufValueType::FLOAT64: return 8;
    default: return 0;
  }
}

bool is_signed_int(GgufValueType t) {
  return t == GgufValueType::INT8 || t == GgufValueType::INT16 || t == GgufValueType::INT32 ||
         t == GgufValueType::INT64 || t == GgufValueType::BOOL;
}
bool is_unsigned_int(GgufValueType t) {
  return t == GgufValueType::UINT8 || t == GgufValueType::UINT16 ||
         t == GgufValueType::UINT32 || t == GgufValueType::UINT64;
}
bool is_float(GgufValueType t) {
  return t == GgufValueType::FLOAT32 || t == GgufValueType::FLOAT64;
}

// Bounds-checked sequential reader over the file image.
class Cursor {
 public:
  Cursor(const uint8_t* data, size_t size, const std::string& file)
      : data_(data), size_(size), file_(file) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  template <typename T>
  T read(const std::string& field) {
    if (remaining() < sizeof(T))
      fail(file_, ": truncated while reading ", field, " at offset ", pos_, " (needs ",
           sizeof(T), " bytes, ", remaining(), " left)");
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  // `index` >= 0 names an array element in errors; messages are built only on failure
  // because vocabularies hold ~10^5 strings.
  std::string read_string(const std::string& field, int64_t index = -1) {
    auto where = [&] { return index < 0 ? field : cat(field, "[", index, "]"); };
    if (remaining() < 8)
      fail(file_, ": truncated while reading ", where(), " (string length) at offset ", pos_);
    uint64_t len;
    std::memcpy(&len, data_ + pos_, 8);
    pos_ += 8;
    if (len > remaining())
      fail(file_, ": ", where(), ": string length ", len, " exceeds the ", remaining(),
           " bytes left in the file");
    std::string s(reinterpret_cast<const char*>(data_ + pos_), size_t(len));
    pos_ += size_t(len);
    return s;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& file_;
};

void read_scalar(Cursor& c, GgufValueType t, GgufValue& v, const std::string& field) {
  switch (t) {
    case GgufValueType::UINT8: v.u = c.read<uint8_t>(field); break;
    case GgufValueType::INT8: v.i = c.read<int8_t>(field); break;
    case GgufValueType::UINT16: v.u = c.read<uint16_t>(field); break;
    case GgufValueType::INT16: v.i = c.read<int16_t>(field); break;
    case GgufValueType::UINT32: v.u = c.read<uint32_t>(field); break;
    case GgufValueType::INT32: v.i = c.read<int32_t>(field); break;
    case GgufValueType::UINT64: v.u = c.read<uint64_t>(field); break;
    case GgufValueType::INT64: v.i = c.read<int64_t>(field); break;
    case GgufValueType::FLOAT32: v.f = c.read<float>(field); break;
    case GgufValueType::FLOAT64: v.f = c.read<double>(field); break;
    case GgufValueType::BOOL: v.i = c.read<uint8_t>(field) != 0; break;
    case GgufValueType::STRING: v.s = c.read_string(field); break;
    default: break;  // callers only pass scalar types
  }
}

double scalar_as_double(const GgufValue& v) {
  if (is_float(v.type)) return v.f;
  if (is_unsigned_int(v.type)) return double(v.u);
  return double(v.i);
}

GgufValueType read_type(Cursor& c, const std::string& file, const std::string& field) {
  uint32_t t = c.read<uint32_t>(field);
  if (t > uint32_t(GgufValueType::FLOAT64))
    fail(file, ": ", field, ": unknown GGUF value type ", t);
  return GgufValueType(t);
}

GgufValue read_value(Cursor& c, GgufValueType type, const std::string& file,
                     const std::string& field) {
  GgufValue v;
  v.type = type;
  if (type != GgufValueType::ARRAY) {
    read_scalar(c, type, v, field);
    return v;
  }
  v.elem_type = read_type(c, file, field + " (array element type)");
  // GGUF allows arrays of arrays, but no model uses them; rejecting them bounds recursion.
  if (v.elem_type == GgufValueType::ARRAY)
    fail(file, ": ", field, ": nested arrays are not supported");
  uint64_t n = c.read<uint64_t>(field + " (array length)");
  size_t elem = v.elem_type == GgufValueType::STRING ? 8 : scalar_size(v.elem_type);
  if (n > c.remaining() / elem)
    fail(file, ": ", field, ": array length ", n, " of ", value_type_name(v.elem_type),
         " exceeds the ", c.remaining(), " bytes left in the file");
  if (v.elem_type == GgufValueType::STRING) {
    v.strings.reserve(size_t(n));
    for (uint64_t k = 0; k < n; ++k)
      v.strings.push_back(c.read_string(field, int64_t(k)));
  } else {
    v.numbers.reserve(size_t(n));
    GgufValue e;
    e.type = v.elem_type;
    for (uint64_t k = 0; k < n; ++k) {
      read_scalar(c, v.elem_type, e, field);
      v.numbers.push_back(scalar_as_double(e));
    }
  }
  return v;
}

}  // namespace

int64_t GgufValue::as_int() const {
  if (is_signed_int(type)) return i;
  if (is_unsigned_int(type)) {
    if (u > uint64_t(std::numeric_limits<int64_t>::max()))
      fail("GGUF value ", u, " does not fit in int64");
    return int64_t(u);
  }
  fail("GGUF value of type ", value_type_name(type), " is not an integer");
}

double GgufValue::as_float() const {
  if (is_float(type) || is_signed_int(type) || is_unsigned_int(type)) return scalar_as_double(*this);
  fail("GGUF value of type ", value_type_name(type), " is not a number");
}

int64_t GgufTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;  // overflow excluded at parse time
  return n;
}

std::string GgufTensorInfo::type_name() const { return ggml_type_name(ggml_type); }

std::vector<int64_t> GgufTensorInfo::shape() const { return {ne.rbegin(), ne.rend()}; }

std::unique_ptr<GgufFile> GgufFile::open(const std::string& path) {
  std::unique_ptr<GgufFile> g(new GgufFile());
  g->file_ = MappedFile(path);
  g->path_ = path;
  g->parse_image(g->file_.data(), g->file_.size());
  return g;
}

std::unique_ptr<GgufFile> GgufFile::parse(const uint8_t* data, size_t size,
                                          const std::string& name) {
  std::unique_ptr<GgufFile> g(new GgufFile());
  g->path_ = name;
  g->parse_image(data, size);
  return g;
}

void GgufFile::parse_image(const uint8_t* data, size_t size) {
  const std::string& file = path_;
  size_ = size;
  Cursor c(data, size, file);

  uint32_t magic = c.read<uint32_t>("magic");
  if (std::memcmp(&magic, "GGUF", 4) != 0)
    fail(file, ": not a GGUF file (magic bytes are not 'GGUF')");
  version_ = c.read<uint32_t>("version");
  if (version_ == 1) fail(file, ": GGUF version 1 is not supported (only 2 and 3)");
  if (version_ == 0x02000000u || version_ == 0x03000000u)
    fail(file, ": big-endian GGUF files are not supported");
  if (version_ != 2 && version_ != 3)
    fail(file, ": unsupported GGUF version ", version_, " (only 2 and 3)");

  uint64_t n_tensors = c.read<uint64_t>("tensor_count");
  uint64_t n_kv = c.read<uint64_t>("metadata_kv_count");
  if (n_kv > c.remaining() / kMinKvBytes)
    fail(file, ": metadata_kv_count ", n_kv, " is impossible for a file of ", size, " bytes");
  if (n_tensors > c.remaining() / kMinTensorInfoBytes)
    fail(file, ": tensor_count ", n_tensors, " is impossible for a file of ", size, " bytes");

  for (uint64_t k = 0; k < n_kv; ++k) {
    std::string key = c.read_string(cat("metadata key #", k));
    std::string field = cat("metadata '", key, "'");
    GgufValueType type = read_type(c, file, field + " type");
    GgufValue v = read_value(c, type, file, field);
    if (!kv_.emplace(key, std::move(v)).second)
      fail(file, ": duplicate metadata key '", key, "'");
  }

  if (const GgufValue* a = find("general.alignment")) {
    if (a->is_array() || !(is_signed_int(a->type) || is_unsigned_int(a->type)) ||
        a->type == GgufValueType::BOOL)
      fail(file, ": metadata 'general.alignment' must be an integer, found ",
           value_type_name(a->type));
    if (is_signed_int(a->type) && a->i < 0)
      fail(file, ": metadata 'general.alignment' = ", a->i, " is negative");
    uint64_t al = is_unsigned_int(a->type) ? a->u : uint64_t(a->i);
    if (al == 0 || al > kMaxAlignment || (al & (al - 1)) != 0)
      fail(file, ": metadata 'general.alignment' = ", al, " is not a power of two in [1, ",
           kMaxAlignment, "]");
    alignment_ = uint32_t(al);
  }

  tensors_.reserve(size_t(n_tensors));
  for (uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensorInfo t;
    t.name = c.read_string(cat("tensor #", k, " name"));
    std::string field = cat("tensor '", t.name, "'");
    uint32_t n_dims = c.read<uint32_t>(field + " n_dims");
    if (n_dims == 0 || n_dims > kMaxDims)
      fail(file, ": ", field, ": n_dims ", n_dims, " is not in [1, ", kMaxDims, "]");
    int64_t numel = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t ne = c.read<uint64_t>(cat(field, " ne[", d, "]"));
      if (ne == 0 || ne > uint64_t(std::numeric_limits<int64_t>::max()))
        fail(file, ": ", field, ": ne[", d, "] = ", ne, " is not a positive int64");
      if (int64_t(ne) > std::numeric_limits<int64_t>::max() / numel)
        fail(file, ": ", field, ": element count overflows int64");
      numel *= int64_t(ne);
      t.ne.push_back(int64_t(ne));
    }
    t.ggml_type = c.read<uint32_t>(field + " type");
    t.offset = c.read<uint64_t>(field + " offset");
    if (!tensor_index_.emplace(t.name, tensors_.size()).second)
      fail(file, ": duplicate tensor name '", t.name, "'");
    tensors_.push_back(std::move(t));
  }

  // The data section starts at the next multiple of the alignment.
  uint64_t pos = c.pos();
  data_offset_ = (pos + alignment_ - 1) / alignment_ * alignment_;
  if (!tensors_.empty() && data_offset_ > size)
    fail(file, ": tensor data section (offset ", data_offset_, ") starts beyond the end of ",
         "the file (", size, " bytes)");

  for (GgufTensorInfo& t : tensors_) {
    std::string field = cat("tensor '", t.name, "'");
    if (t.offset % alignment_ != 0)
      fail(file, ": ", field, ": offset ", t.offset, " is not a multiple of the alignment ",
           alignment_);
    if (t.offset > size - data_offset_)
      fail(file, ": ", field, ": offset ", t.offset, " lies outside the file (data section has ",
           size - data_offset_, " bytes)");
    const GgmlTypeInfo* ti = ggml_type_info(t.ggml_type);
    if (!ti) continue;  // unknown id: an error when the data is requested
    t.dtype_known = ti->has_dtype;
    t.dtype = ti->dtype;
    // ggml quantizes rows independently, so blocks must tile the innermost dimension.
    if (t.ne[0] % ti->block_elems != 0)
      fail(file, ": ", field, ": ne[0] = ", t.ne[0], " is not a multiple of the ",
           ti->name, " block size ", ti->block_elems);
    uint64_t blocks = uint64_t(t.numel()) / uint64_t(ti->block_elems);
    if (blocks > std::numeric_limits<uint64_t>::max() / uint64_t(ti->block_bytes))
      fail(file, ": ", field, ": byte size overflows");
    uint64_t nbytes = blocks * uint64_t(ti->block_bytes);
    uint64_t avail = size - data_offset_ - t.offset;
    if (nbytes > avail)
      fail(file, ": ", field, ": data [", t.offset, ", +", nbytes, ") of type ", ti->name,
           " extends beyond the end of the file (", avail, " bytes available)");
    t.nbytes = size_t(nbytes);
    t.data = data + data_offset_ + t.offset;
  }
}

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {
const GgufValue& require(const GgufFile& g, const std::string& key) {
  const GgufValue* v = g.find(key);
  if (!v) fail(g.path(), ": missing metadata key '", key, "'");
  return *v;
}
[[noreturn]] void wrong_type(const GgufFile& g, const std::string& key, const GgufValue& v,
                             const char* want) {
  fail(g.path(), ": metadata '", key, "' has type ",
       v.is_array() ? cat("array of ", value_type_name(v.elem_type)) : value_type_name(v.type),
       ", expected ", want);
}
}  // namespace

std::string GgufFile::get_string(const std::string& key) const {
  const GgufValue& v = require(*this, key);
  if (v.type != GgufValueType::STRING) wrong_type(*this, key, v, "string");
  return v.s;
}

int64_t GgufFile::get_int(const std::string& key) const {
  const GgufValue& v = require(*this, key);
  if (!is_signed_int(v.type) && !is_unsigned_int(v.type)) wrong_type(*this, key, v, "integer");
  if (is_unsigned_int(v.type) && v.u > uint64_t(std::numeric_limits<int64_t>::max()))
    fail(path_, ": metadata '", key, "' = ", v.u, " does not fit in int64");
  return v.as_int();
}

double GgufFile::get_float(const std::string& key) const {
  const GgufValue& v = require(*this, key);
  if (!is_float(v.type) && !is_signed_int(v.type) && !is_unsigned_int(v.type))
    wrong_type(*this, key, v, "number");
  return v.as_float();
}

std::optional<int64_t> GgufFile::get_int_opt(const std::string& key) const {
  if (!find(key)) return std::nullopt;
  return get_int(key);
}

std::optional<double> GgufFile::get_float_opt(const std::string& key) const {
  if (!find(key)) return std::nullopt;
  return get_float(key);
}

std::optional<std::string> GgufFile::get_string_opt(const std::string& key) const {
  if (!find(key)) return std::nullopt;
  return get_string(key);
}

size_t GgufFile::get_array_size(const std::string& key) const {
  const GgufValue& v = require(*this, key);
  if (!v.is_array()) wrong_type(*this, key, v, "array");
  return v.elem_type == GgufValueType::STRING ? v.strings.size() : v.numbers.size();
}

TensorView GgufFile::view(const GgufTensorInfo& t) const {
  if (!t.dtype_known || !t.data)
    fail(path_, ": tensor '", t.name, "' has ggml type ", t.type_name(), " (id ", t.ggml_type,
         "), which spade cannot read (supported: f32, f16, bf16, q8_0, q4_0, q4_1, q4_k, "
         "q5_k, q6_k)");
  TensorView v;
  v.data = const_cast<uint8_t*>(t.data);
  v.dtype = t.dtype;
  v.ndim = int(t.ne.size());
  for (int i = 0; i < v.ndim; ++i) v.shape[i] = t.ne[size_t(v.ndim - 1 - i)];
  v.set_contiguous_strides();
  return v;
}

TensorView GgufFile::view(const std::string& name) const {
  const GgufTensorInfo* t = find_tensor(name);
  if (!t) fail(path_, ": no tensor named '", name, "'");
  return view(*t);
}

}  // namespace spade
