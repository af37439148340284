// The communication layer of real ranks over NCCL 2.28+ (one process per GPU, one host): the
// communicator bootstrapped from the job's rank environment (moefq/dist_env.h), symmetric
// buffers registered as NCCL windows with load/store (LSA) pointers to every peer's, a
// device-side barrier with a timeout, and the MAX all-reduce of calibration. Every wait on a peer
// is bounded: a rank that dies or hangs makes the others fail with an error that names it. NVLink
// multicast is never requested (and NCCL_NVLS_ENABLE defaults to 0).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/cuda/rank_link.h"
#include "moefq/dist_env.h"

namespace moefq::comm {

struct BarrierState;  // nccl_comm.cu: this rank's barrier count and error record, on the device

struct CommOptions {
  // Host-side waits for peers: the unique id, the communicator's set-up, every collective call.
  std::chrono::milliseconds timeout{60000};
  // A device-side barrier's wait for its peers, counted from when it starts on this GPU.
  std::chrono::milliseconds barrier_timeout{60000};
  // The rendezvous key of the unique id: one per communicator of a job.
  std::string id_key = "nccl_id";
};

class NcclComm final : public cuda::RankLink {
 public:
  // Collective: every rank of env builds its NcclComm with the same options. Selects GPU
  // env.local_rank. Throws moefq::Error when the NCCL library is not the one moefq was built
  // with, when a peer never arrives within options.timeout (the communicator is aborted), or when
  // the ranks cannot all reach each other's memory by loads and stores.
  explicit NcclComm(const RankEnv& env, CommOptions options = {});
  ~NcclComm() override;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override { return rank_; }
  int num_ranks() const override { return num_ranks_; }
  std::vector<uint8_t*> symmetric_buffers(size_t bytes) override;
  // One barrier kernel; barriers of one NcclComm are enqueued on one stream at a time, in the same
  // order on every rank. After a timeout the communicator is unusable (check() says so).
  void barrier(const char* name, cudaStream_t stream) override;
  void check() override;
  void all_reduce_max(uint32_t* words, size_t count, cudaStream_t stream) override;

 private:
  struct Window {
    void* local = nullptr;  // this GPU's part: ncclMemAlloc (a single rank: cudaMalloc, no handle)
    ncclWindow_t handle = nullptr;
    std::vector<uint8_t*> peers;  // [num_ranks]: load/store pointers; [rank] is `local`
  };
  // Allocates, zeroes and registers one window (collective) and finds every rank's part of it.
  const Window& register_window(size_t bytes);
  // Checks (collective, more than one rank) that every rank reaches every other by loads and stores.
  void check_lsa_team();
  void require_usable() const;
  // Whether the communicator's pending operation completed; throws when NCCL reports an error.
  bool comm_done(const char* what);
  // Polls comm_done until it is; throws when that takes longer than the timeout.
  void wait_ready(const char* what);
  // Waits for `stream`, bounded by the timeout (a collective on it waits for every peer).
  void wait_stream(cudaStream_t stream, const char* what);
  [[noreturn]] void fail_timeout(const char* what);
  // Frees everything without talking to the peers (after a failure, or when the teardown fails).
  void abort() noexcept;

  int rank_ = 0, num_ranks_ = 1;
  CommOptions opt_;
  ncclComm_t comm_ = nullptr;
  bool broken_ = false;  // a peer failed us: no collective teardown
  std::vector<Window> windows_;  // [0]: the barriers' inboxes, then the symmetric buffers
  uint64_t** inboxes_ = nullptr;  // device [num_ranks]: every rank's inbox (windows_[0].peers)
  BarrierState* state_ = nullptr;  // device: this rank's barrier count and error record
  uint32_t* sync_word_ = nullptr;  // device: the host-side barrier's all-reduce operand
  std::vector<std::string> barrier_names_;  // a barrier's id is its index
};

}  // namespace moefq::comm
