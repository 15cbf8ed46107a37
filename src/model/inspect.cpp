#include "model/inspect.h"

#include <algorithm>
#include <sstream>

#include "core/error.h"
#include "model/tensor_source.h"

namespace spade {

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// 134515008 -> "134,515,008"
std::string grouped(int64_t n) {
  std::string d = std::to_string(n), out;
  for (size_t i = 0; i < d.size(); ++i) {
    if (i && (d.size() - i) % 3 == 0) out += ',';
    out += d[i];
  }
  return out;
}

void gguf_details(const GgufFile& g, std::ostream& o) {
  for (const char* key : {"general.name", "general.basename", "general.size_label",
                          "general.license", "tokenizer.ggml.model", "tokenizer.ggml.pre"}) {
    if (const GgufValue* v = g.find(key); v && v->type == GgufValueType::STRING)
      o << "  " << key << ": " << v->s << "\n";
  }
  if (const GgufValue* v = g.find("general.file_type"); v && !v->is_array())
    o << "  general.file_type: " << v->as_int() << "\n";
  if (g.find("tokenizer.ggml.tokens"))
    o << "  tokenizer.ggml.tokens: " << g.get_array_size("tokenizer.ggml.tokens")
      << " entries\n";
  if (const GgufValue* v = g.find("tokenizer.ggml.merges"); v && v->is_array())
    o << "  tokenizer.ggml.merges: " << v->strings.size() << " entries\n";
}

}  // namespace

std::string describe_model(const std::string& path) {
  std::unique_ptr<TensorSource> src = TensorSource::open(path);
  const ModelConfig& c = src->config();
  std::ostringstream o;
  o << "file:              " << src->path() << "\n"
    << "format:            " << src->format_description() << "\n";
  if (const GgufFile* g = src->gguf()) gguf_details(*g, o);
  o << c.summary();

  int64_t params = 0;
  std::map<std::string, int64_t> by_type;
  size_t width = 0;
  for (const SourceTensor& t : src->tensors()) {
    params += t.numel();
    by_type[t.type] += 1;
    width = std::max(width, t.name.size());
  }
  o << "parameters:        " << grouped(params) << "\n"
    << "tensor types:     ";
  for (const auto& [type, n] : by_type) o << " " << type << " x" << n;
  o << "\n";
  o << "tensors (" << src->tensors().size() << ", row-major shapes"
    << (src->format() == TensorSource::Format::Gguf ? ", ggml ne reversed" : "") << "):\n";
  for (const SourceTensor& t : src->tensors()) {
    o << "  " << t.name << std::string(width - t.name.size() + 2, ' ') << t.type << " "
      << shape_str(t.shape) << (t.readable ? "" : "  (unsupported type)") << "\n";
  }
  return o.str();
}

}  // namespace spade
