// A rank program for tests/cli/test_launch.cpp, started by `moefq launch`:
//   launch_test_rank rendezvous KEY MS   prints "rank R of W local L of LW" (rank_env()); rank 0
//                                        publishes a 128-byte blob under KEY, the others fetch it
//                                        (timeout MS); each prints "published HEX" or "fetched HEX"
//   launch_test_rank fetch KEY MS        every rank fetches KEY, which nobody publishes
// Errors go to stderr as `moefq` prints them, with its exit statuses (1 failed check, 2 bad input).
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "moefq/dist_env.h"
#include "moefq/errors.h"

namespace {

std::string hex(const std::vector<uint8_t>& bytes) {
  std::string s;
  char buf[3];
  for (uint8_t b : bytes) {
    std::snprintf(buf, sizeof buf, "%02x", b);
    s += buf;
  }
  return s;
}

// The size of an NCCL unique id. Starts with the publisher's pid (little endian), so a blob names
// the process it came from, then 0x00, 0xff and '\n', then a byte pattern.
std::vector<uint8_t> blob_of_this_process() {
  std::vector<uint8_t> bytes(128);
  const uint32_t pid = uint32_t(::getpid());
  for (int i = 0; i < 4; ++i) bytes[size_t(i)] = uint8_t(pid >> (8 * i));
  bytes[4] = 0x00;
  bytes[5] = 0xff;
  bytes[6] = '\n';
  for (size_t i = 7; i < bytes.size(); ++i) bytes[i] = uint8_t(i * 53 + 7);
  return bytes;
}

int run(int argc, char** argv) {
  if (argc != 4 || (std::strcmp(argv[1], "rendezvous") != 0 && std::strcmp(argv[1], "fetch") != 0)) {
    std::fprintf(stderr, "usage: launch_test_rank rendezvous|fetch KEY TIMEOUT_MS\n");
    return 2;
  }
  const moefq::RankEnv env = moefq::rank_env();
  const std::string key = argv[2];
  const std::chrono::milliseconds timeout(std::atoi(argv[3]));
  std::printf("rank %d of %d local %d of %d\n", env.rank, env.world_size, env.local_rank, env.local_world_size);
  std::fflush(stdout);
  if (std::strcmp(argv[1], "rendezvous") == 0 && env.rank == 0) {
    const std::vector<uint8_t> bytes = blob_of_this_process();
    moefq::rendezvous_publish(env, key, bytes);
    std::printf("published %s\n", hex(bytes).c_str());
  } else {
    std::printf("fetched %s\n", hex(moefq::rendezvous_fetch(env, key, timeout)).c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const moefq::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return e.kind() == moefq::ErrorKind::kFailedCheck ? 1 : 2;
  }
}
