// The rank side of a multi-process job: where this process sits (the torchrun variables RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, as `moefq launch` sets them) and a file rendezvous in
// the job's private directory (MOEFQ_RENDEZVOUS) to hand one small blob, such as an NCCL unique
// id, from one rank to the others. A blob is either absent or complete: it is renamed into place.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace moefq {

struct RankEnv {
  int rank = 0;              // 0 <= rank < world_size
  int world_size = 1;        // processes in the job
  int local_rank = 0;        // 0 <= local_rank < local_world_size; the GPU this rank uses
  int local_world_size = 1;  // processes on this host, <= world_size
  std::string rendezvous;    // the job's rendezvous directory; empty when MOEFQ_RENDEZVOUS is unset
};

// Reads the variables. None set: rank 0 of 1. RANK and WORLD_SIZE come together; LOCAL_RANK and
// LOCAL_WORLD_SIZE come together and default to RANK and WORLD_SIZE (one host). Throws
// moefq::Error (bad input) naming the variable when a value is not a decimal integer, out of
// range, or inconsistent with the others.
RankEnv rank_env();

// Publishes bytes under key (letters, digits, '.', '_', '-'; not starting with '.') in the
// rendezvous directory, replacing an earlier blob of that key atomically. With a single rank and
// no rendezvous directory the blob stays in this process, so a 1-rank job runs the same code.
// Throws moefq::Error when the key is invalid, the directory is missing or cannot be written.
void rendezvous_publish(const RankEnv& env, const std::string& key, const std::vector<uint8_t>& bytes);

// The blob published under key, waiting for it up to timeout (polling the directory). Throws
// moefq::Error (failed check) naming the key, the directory and the timeout when it expires, so
// a rank whose peer died before publishing fails instead of hanging.
std::vector<uint8_t> rendezvous_fetch(const RankEnv& env, const std::string& key, std::chrono::milliseconds timeout);

}  // namespace moefq
