// Read-only memory map of a whole file. Model weights are mapped, not read, so loading a
// model costs page faults only for the tensors actually touched.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace spade {

// Opens `path` for reading only if it is a regular file (a FIFO, device or directory gets a
// spade::Error naming it instead of a read that blocks forever or never ends); returns the
// descriptor, which the caller closes.
int open_regular_file(const std::string& path);
// The whole regular file `path` as bytes; throws spade::Error naming it.
std::string read_regular_file(const std::string& path);

class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const std::string& path);  // throws spade::Error naming the path
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

}  // namespace spade
