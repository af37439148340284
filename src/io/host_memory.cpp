#include "moefq/host_memory.h"

#include <cstdio>
#include <fstream>
#include <string>
#include <string_view>

namespace moefq {
namespace {

// The first line of a small /proc or /sys file as an unsigned number; nullopt for "max", an
// absent file or anything else.
std::optional<uint64_t> read_number(const char* path) {
  std::ifstream in(path);
  std::string s;
  if (!(in >> s) || s.empty() || s.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  try {
    return std::stoull(s);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::optional<uint64_t> meminfo_available() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    unsigned long long kib = 0;
    char unit[8] = {};
    if (std::sscanf(line.c_str(), "MemAvailable: %llu %7s", &kib, unit) == 2 && std::string_view(unit) == "kB")
      return uint64_t(kib) * 1024;
  }
  return std::nullopt;
}

// The cgroup's room: limit - usage (cgroup v2, else v1). A v1 "no limit" is a huge number, which
// min() below ignores.
std::optional<uint64_t> cgroup_available() {
  for (const auto& [limit_file, usage_file] :
       {std::pair<const char*, const char*>{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
        {"/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"}}) {
    const auto limit = read_number(limit_file), usage = read_number(usage_file);
    if (limit && usage) return *limit > *usage ? *limit - *usage : 0;
  }
  return std::nullopt;
}

}  // namespace

std::optional<uint64_t> available_host_memory() {
  const auto a = meminfo_available(), b = cgroup_available();
  if (a && b) return std::min(*a, *b);
  return a ? a : b;
}

std::string format_bytes(uint64_t bytes) {
  if (bytes < 1024) return std::to_string(bytes) + " B";
  const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = double(bytes) / 1024;
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

}  // namespace moefq
