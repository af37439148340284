#include "moefq/fileio.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

#include "moefq/errors.h"

namespace moefq {

void write_file_atomic(const std::string& path, std::string_view content) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::random_device rd;
  const fs::path tmp = dir / ("." + target.filename().string() + ".tmp" + std::to_string(rd()));
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  MOEFQ_CHECK(f != nullptr, path, ": cannot write: ", std::strerror(errno));
  const bool ok = std::fwrite(content.data(), 1, content.size(), f) == content.size();
  const bool closed = std::fclose(f) == 0;
  std::error_code ec;
  if (!ok || !closed) {
    fs::remove(tmp, ec);
    MOEFQ_FAIL(ErrorKind::kBadInput, path, ": write failed (disk full?)");
  }
  fs::rename(tmp, target, ec);
  if (ec) {
    fs::remove(tmp, ec);
    MOEFQ_FAIL(ErrorKind::kBadInput, path, ": cannot rename the temporary file into place");
  }
}

}  // namespace moefq
