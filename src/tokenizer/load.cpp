// Tokenizer::load: picks the loader from what the path is.
#include <filesystem>
#include <unistd.h>

#include <cerrno>
#include <string_view>

#include "core/error.h"
#include "core/mmap_file.h"
#include "io/gguf.h"
#include "tokenizer/tokenizer.h"

namespace spade {

namespace fs = std::filesystem;

namespace {

std::string read_file(const fs::path& p) { return read_regular_file(p.string()); }

bool has_gguf_magic(const fs::path& p) {
  const int fd = open_regular_file(p.string());  // a FIFO or device: an error, not a blocked read
  char m[4] = {};
  size_t got = 0;
  while (got < 4) {
    const ssize_t n = ::read(fd, m + got, 4 - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += size_t(n);
  }
  ::close(fd);
  return got == 4 && std::string_view(m, 4) == "GGUF";
}

std::unique_ptr<Tokenizer> load_hf_dir(const fs::path& dir, const fs::path& tj) {
  std::string cfg;
  if (fs::exists(dir / "tokenizer_config.json")) cfg = read_file(dir / "tokenizer_config.json");
  auto t = Tokenizer::from_hf_json(read_file(tj), cfg, tj.string());
  return t;
}

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& path) {
  fs::path p(path);
  SPADE_CHECK(fs::exists(p), path, ": no such file or directory");
  if (fs::is_directory(p)) {
    std::unique_ptr<Tokenizer> t;
    if (fs::exists(p / "tokenizer.json"))
      t = load_hf_dir(p, p / "tokenizer.json");
    else if (fs::exists(p / "tokenizer.model"))
      t = from_sentencepiece(read_file(p / "tokenizer.model"), (p / "tokenizer.model").string());
    else
      fail(path, ": directory has neither tokenizer.json nor tokenizer.model");
    // chat_template.jinja (newer transformers) takes precedence over the config's.
    if (fs::exists(p / "chat_template.jinja")) {
      t->chat_template_ =
          std::make_unique<ChatTemplate>(read_file(p / "chat_template.jinja"), t->template_tokens_);
    }
    return t;
  }
  if (has_gguf_magic(p)) {
    auto f = GgufFile::open(path);
    return from_gguf(*f);
  }
  if (p.filename() == "tokenizer.json" || p.extension() == ".json")
    return load_hf_dir(p.parent_path(), p);
  return from_sentencepiece(read_file(p), path);
}

}  // namespace spade
