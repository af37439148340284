#include "moefq/dist_env.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>

#include "moefq/errors.h"
#include "moefq/fileio.h"

namespace moefq {
namespace {

// The variable's value, or nullopt when unset.
std::optional<std::string> env_value(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::optional<std::string>(v) : std::nullopt;
}

// A decimal integer >= min_value, the whole text (no sign, space or suffix).
int parse_env_int(const char* name, const std::string& text, int min_value) {
  int v = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  MOEFQ_CHECK(!text.empty() && text[0] != '-' && ec == std::errc() && ptr == end && v >= min_value, name, "='", text,
              "': expected a decimal integer >= ", min_value);
  return v;
}

// Reads a pair of variables (index, count) that must be set together; false when neither is.
bool read_pair(const char* index_name, const char* count_name, int& index, int& count) {
  const auto index_text = env_value(index_name), count_text = env_value(count_name);
  if (!index_text && !count_text) return false;
  MOEFQ_CHECK(index_text && count_text, index_text ? index_name : count_name, " is set but ",
              index_text ? count_name : index_name, " is not; set both (as torchrun and moefq launch do)");
  count = parse_env_int(count_name, *count_text, 1);
  index = parse_env_int(index_name, *index_text, 0);
  MOEFQ_CHECK(index < count, index_name, "=", index, " must be less than ", count_name, "=", count);
  return true;
}

bool valid_key(const std::string& key) {
  if (key.empty() || key[0] == '.') return false;
  for (char c : key)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) return false;
  return true;
}

// Where the blobs of a job live: true for this process (a single rank without a rendezvous
// directory), false for the directory. Checks the key and the directory first.
bool uses_local_store(const RankEnv& env, const std::string& key) {
  MOEFQ_CHECK(valid_key(key), "rendezvous: invalid key '", key,
              "' (use letters, digits, '.', '_' and '-', not starting with '.')");
  if (!env.rendezvous.empty()) {
    MOEFQ_CHECK(std::filesystem::is_directory(env.rendezvous), "rendezvous: the directory '", env.rendezvous,
                "' (MOEFQ_RENDEZVOUS) does not exist; was the job's launcher stopped?");
    return false;
  }
  MOEFQ_CHECK(env.world_size == 1, "rendezvous: MOEFQ_RENDEZVOUS is not set but WORLD_SIZE is ", env.world_size,
              ": start the ranks with `moefq launch -n ", env.world_size,
              " -- ...`, or set MOEFQ_RENDEZVOUS to a directory every rank can read and write");
  return true;
}

// The blobs of a single-rank job without a rendezvous directory.
struct LocalStore {
  std::mutex mutex;
  std::map<std::string, std::vector<uint8_t>> blobs;
};
LocalStore& local_store() {
  static LocalStore store;
  return store;
}

// The whole file, or nullopt while it does not exist. Blobs are renamed into place, so a file
// that exists is complete.
std::optional<std::vector<uint8_t>> try_read(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) return std::nullopt;
  MOEFQ_CHECK(fd >= 0, "rendezvous: cannot open ", path, ": ", std::strerror(errno));
  std::vector<uint8_t> bytes;
  uint8_t buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      MOEFQ_CHECK(n == 0, "rendezvous: cannot read ", path, ": ", std::strerror(err));
      return bytes;
    }
    bytes.insert(bytes.end(), buf, buf + n);
  }
}

}  // namespace

RankEnv rank_env() {
  RankEnv env;
  if (read_pair("RANK", "WORLD_SIZE", env.rank, env.world_size)) {
    env.local_rank = env.rank;
    env.local_world_size = env.world_size;
  }
  if (read_pair("LOCAL_RANK", "LOCAL_WORLD_SIZE", env.local_rank, env.local_world_size)) {
    MOEFQ_CHECK(env_value("RANK"),
                "LOCAL_RANK and LOCAL_WORLD_SIZE are set but RANK and WORLD_SIZE are not; set all four");
    MOEFQ_CHECK(env.local_world_size <= env.world_size, "LOCAL_WORLD_SIZE=", env.local_world_size,
                " must not exceed WORLD_SIZE=", env.world_size);
  }
  env.rendezvous = env_value("MOEFQ_RENDEZVOUS").value_or("");
  return env;
}

void rendezvous_publish(const RankEnv& env, const std::string& key, const std::vector<uint8_t>& bytes) {
  if (uses_local_store(env, key)) {
    LocalStore& store = local_store();
    std::lock_guard<std::mutex> lock(store.mutex);
    store.blobs[key] = bytes;
    return;
  }
  const std::string path = (std::filesystem::path(env.rendezvous) / key).string();
  write_file_atomic(path, std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

std::vector<uint8_t> rendezvous_fetch(const RankEnv& env, const std::string& key, std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  // Short enough that a rank waits little past the publish, long enough to cost no CPU to speak of.
  constexpr std::chrono::milliseconds kPollInterval{10};
  const bool local = uses_local_store(env, key);
  const std::string path = local ? std::string() : (std::filesystem::path(env.rendezvous) / key).string();
  // Clamped so that milliseconds::max() ("wait forever") does not overflow the clock.
  const auto wait = std::clamp(timeout, std::chrono::milliseconds(0),
                               std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::hours(1000000)));
  const Clock::time_point deadline = Clock::now() + wait;
  for (;;) {
    if (local) {
      LocalStore& store = local_store();
      std::lock_guard<std::mutex> lock(store.mutex);
      const auto it = store.blobs.find(key);
      if (it != store.blobs.end()) return it->second;
    } else if (auto bytes = try_read(path)) {
      return std::move(*bytes);
    }
    const Clock::time_point now = Clock::now();
    if (now >= deadline)
      MOEFQ_FAIL(ErrorKind::kFailedCheck, "rendezvous: no rank published '", key, "' in ",
                 local ? std::string("this process") : env.rendezvous, " within ", timeout.count(),
                 " ms (did the publishing rank fail or never reach its publish?)");
    std::this_thread::sleep_for(std::min<Clock::duration>(kPollInterval, deadline - now));
  }
}

}  // namespace moefq
