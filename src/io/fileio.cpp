#include "moefq/fileio.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "moefq/errors.h"

namespace moefq {

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  // Same directory as the target, so the final rename stays within one file system.
  std::string tmpl = path_ + ".tmp.XXXXXX";
  fd_ = ::mkstemp(tmpl.data());
  const std::filesystem::path dir = std::filesystem::path(path_).parent_path();
  MOEFQ_CHECK(fd_ >= 0, path_, ": cannot write: cannot create a temporary file in ",
              dir.empty() ? std::string(".") : dir.string(), ": ", std::strerror(errno));
  tmp_path_ = tmpl;
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_path_.c_str());
}

void AtomicFile::write(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd_, p, size);
    if (n < 0 && errno == EINTR) continue;
    MOEFQ_CHECK(n > 0, path_, ": write failed: ", n < 0 ? std::strerror(errno) : "wrote nothing");
    p += n;
    size -= static_cast<size_t>(n);
  }
}

void AtomicFile::commit() {
  // mkstemp creates 0600; give the output ordinary permissions.
  MOEFQ_CHECK(::fchmod(fd_, 0644) == 0, tmp_path_, ": chmod failed: ", std::strerror(errno));
  MOEFQ_CHECK(::fsync(fd_) == 0, tmp_path_, ": fsync failed: ", std::strerror(errno));
  const int close_rc = ::close(fd_);
  fd_ = -1;
  MOEFQ_CHECK(close_rc == 0, tmp_path_, ": close failed: ", std::strerror(errno));
  MOEFQ_CHECK(::rename(tmp_path_.c_str(), path_.c_str()) == 0, path_, ": cannot rename ", tmp_path_,
              " into place: ", std::strerror(errno));
  committed_ = true;
}

void write_file_atomic(const std::string& path, std::string_view content) {
  AtomicFile f(path);
  f.write(content.data(), content.size());
  f.commit();
}

}  // namespace moefq
