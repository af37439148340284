// The memory a process of this host can still take (for commands that refuse work that would not
// fit, with figures), and byte counts written for people.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace moefq {

// Bytes this process can allocate without pushing the host (or its cgroup) into swapping or the
// OOM killer: the smaller of /proc/meminfo's MemAvailable and the cgroup's limit less its usage.
// nullopt when neither can be read.
std::optional<uint64_t> available_host_memory();

// "512 B", "3.0 KiB", "1.5 GiB", ...
std::string format_bytes(uint64_t bytes);

}  // namespace moefq
