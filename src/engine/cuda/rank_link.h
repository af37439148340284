// What one real rank of the CUDA engine needs from a communication layer (comm::NcclComm
// implements it; the engine and the fake quantizer sit below the comm layer and see only this):
// symmetric buffers that every rank can load from and store to, a device-side barrier of all
// ranks, and a MAX all-reduce. Every rank makes the same calls in the same order.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace moefq::cuda {

class RankLink {
 public:
  virtual ~RankLink() = default;

  virtual int rank() const = 0;       // this process's rank, 0 <= rank() < num_ranks()
  virtual int num_ranks() const = 0;  // R, one process per GPU

  // Collective (every rank, the same bytes): allocates this rank's buffer of `bytes`, zeroed,
  // and returns every rank's buffer as this process addresses it, [num_ranks()] device pointers:
  // [rank()] is this GPU's memory, the others load/store pointers into the peers' memory. The
  // buffers live as long as the link: it outlives every engine that uses them.
  virtual std::vector<uint8_t*> symmetric_buffers(size_t bytes) = 0;

  // Enqueues a barrier of all ranks on `stream` (no host synchronisation; capturable in a CUDA
  // graph, replays stay correct). Kernels enqueued after it see every write (to any rank's buffer)
  // that a rank enqueued before its own matching barrier. A rank whose peer does not arrive in
  // time records a device-side error and goes on; check() raises it. `name` says where the
  // barrier stands, for that error.
  virtual void barrier(const char* name, cudaStream_t stream) = 0;

  // Raises (moefq::Error, kFailedCheck) the first barrier timeout recorded so far, naming this
  // rank, the barrier and the peer that did not arrive. Reads device memory: call it after
  // synchronising the stream the barriers ran on.
  virtual void check() = 0;

  // In place MAX over every rank of `count` uint32 words in device memory, enqueued on `stream`
  // and waited for (bounded by the link's timeout).
  virtual void all_reduce_max(uint32_t* words, size_t count, cudaStream_t stream) = 0;
};

}  // namespace moefq::cuda
