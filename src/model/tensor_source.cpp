#include "model/tensor_source.h"

#include <unistd.h>

#include <filesystem>

#include "core/error.h"
#include "core/mmap_file.h"
#include "io/gguf_config.h"
#include "io/hf_config.h"

namespace spade {

namespace fs = std::filesystem;

int64_t SourceTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A directory without config.json but with a single .gguf file loads that file. A .gguf
// entry that is not a regular file (a FIFO would block the read, a device never end it) is an
// error naming it.
std::string resolve_gguf_in_dir(const std::string& dir) {
  std::string found;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (!ends_with(e.path().string(), ".gguf")) continue;
    if (!e.is_regular_file()) ::close(open_regular_file(e.path().string()));  // throws
    if (!found.empty())
      fail("'", dir, "' has no config.json and more than one .gguf file; name one");
    found = e.path().string();
  }
  return found;
}

}  // namespace

std::unique_ptr<TensorSource> TensorSource::open(const std::string& path) {
  auto s = std::make_unique<TensorSource>();
  s->path_ = path;
  std::string gguf_path;
  // A Hugging Face model named by one of its files means its directory.
  fs::path p(path);
  if (!fs::is_directory(p) && (p.filename() == "config.json" || ends_with(path, ".safetensors") ||
                               ends_with(path, ".safetensors.index.json"))) {
    std::string dir = p.parent_path().empty() ? "." : p.parent_path().string();
    return open(dir);
  }
  if (fs::is_directory(path)) {
    if (!fs::exists(fs::path(path) / "config.json")) {
      gguf_path = resolve_gguf_in_dir(path);
      if (gguf_path.empty())
        fail("'", path, "' is neither a GGUF file nor a model directory (no config.json)");
    }
  } else if (!fs::exists(path)) {
    fail("model path '", path, "' does not exist");
  } else {
    gguf_path = path;  // any file: the GGUF magic check names the problem if it is not
  }

  if (!gguf_path.empty()) {
    s->format_ = Format::Gguf;
    s->path_ = gguf_path;
    s->gguf_ = GgufFile::open(gguf_path);
    s->config_ = config_from_gguf(*s->gguf_);
    for (const GgufTensorInfo& t : s->gguf_->tensors()) {
      SourceTensor st;
      st.name = t.name;
      st.shape = t.shape();
      st.type = t.type_name();
      st.readable = t.dtype_known && t.data;
      st.dtype = t.dtype;
      st.data = t.data;
      s->tensors_.push_back(std::move(st));
    }
  } else {
    s->format_ = Format::Safetensors;
    s->config_ = load_hf_config(path);
    s->st_ = SafetensorsModel::open(path);
    for (const SafetensorsTensor* t : s->st_->tensors()) {
      SourceTensor st;
      st.name = t->name;
      st.shape = t->shape;
      st.type = t->dtype_name;
      st.readable = t->dtype_known;
      st.dtype = t->dtype;
      st.data = t->data;
      s->tensors_.push_back(std::move(st));
    }
  }
  for (size_t i = 0; i < s->tensors_.size(); ++i) s->index_[s->tensors_[i].name] = i;
  return s;
}

std::string TensorSource::format_description() const {
  if (format_ == Format::Gguf)
    return cat("GGUF v", gguf_->version(), " (alignment ", gguf_->alignment(), ", ",
               gguf_->metadata().size(), " metadata keys)");
  size_t n = st_->shard_count();
  return cat("Hugging Face config.json + safetensors (", n, n == 1 ? " file)" : " shards)");
}

const SourceTensor* TensorSource::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::string TensorSource::name_of(WeightRole role, int layer) const {
  const bool g = format_ == Format::Gguf;
  const std::string blk = g ? cat("blk.", layer, ".") : cat("model.layers.", layer, ".");
  switch (role) {
    case WeightRole::Embed: return g ? "token_embd.weight" : "model.embed_tokens.weight";
    case WeightRole::FinalNorm: return g ? "output_norm.weight" : "model.norm.weight";
    case WeightRole::LmHead: return g ? "output.weight" : "lm_head.weight";
    case WeightRole::AttnNorm: return blk + (g ? "attn_norm.weight" : "input_layernorm.weight");
    case WeightRole::Q: return blk + (g ? "attn_q.weight" : "self_attn.q_proj.weight");
    case WeightRole::K: return blk + (g ? "attn_k.weight" : "self_attn.k_proj.weight");
    case WeightRole::V: return blk + (g ? "attn_v.weight" : "self_attn.v_proj.weight");
    case WeightRole::O: return blk + (g ? "attn_output.weight" : "self_attn.o_proj.weight");
    case WeightRole::QBias: return blk + (g ? "attn_q.bias" : "self_attn.q_proj.bias");
    case WeightRole::KBias: return blk + (g ? "attn_k.bias" : "self_attn.k_proj.bias");
    case WeightRole::VBias: return blk + (g ? "attn_v.bias" : "self_attn.v_proj.bias");
    case WeightRole::QNorm: return blk + (g ? "attn_q_norm.weight" : "self_attn.q_norm.weight");
    case WeightRole::KNorm: return blk + (g ? "attn_k_norm.weight" : "self_attn.k_norm.weight");
    case WeightRole::FfnNorm:
      return blk + (g ? "ffn_norm.weight" : "post_attention_layernorm.weight");
    case WeightRole::Gate: return blk + (g ? "ffn_gate.weight" : "mlp.gate_proj.weight");
    case WeightRole::Up: return blk + (g ? "ffn_up.weight" : "mlp.up_proj.weight");
    case WeightRole::Down: return blk + (g ? "ffn_down.weight" : "mlp.down_proj.weight");
  }
  return "";
}

}  // namespace spade
