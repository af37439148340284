// Writing files so that a failure never leaves a half-written output: data goes to a temporary
// file beside the target, which is synced and renamed over the target only when complete.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace moefq {

class AtomicFile {
 public:
  // Creates the temporary file; throws moefq::Error (bad input) naming `path` when it cannot.
  explicit AtomicFile(std::string path);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  // Removes the temporary unless commit() succeeded; an existing target is never touched.
  ~AtomicFile();

  void write(const void* data, size_t size);  // all of it, retrying short writes
  void commit();                              // fsync, close, rename over the target

 private:
  std::string path_, tmp_path_;
  int fd_ = -1;
  bool committed_ = false;
};

// The whole file in one call.
void write_file_atomic(const std::string& path, std::string_view content);

}  // namespace moefq
