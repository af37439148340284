#include "comm/nccl_comm.cuh"

#include <nccl_device.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

#include "comm/nccl_check.h"
#include "cuda_base/cuda_check.h"
#include "cuda_base/device_buffer.h"
#include "moefq/cuda_device.h"
#include "moefq/errors.h"

namespace moefq::comm {

// In this GPU's memory; the peers never touch it. The n-th barrier this rank enters carries
// epoch n. The error record is written once, by the first wait that timed out.
struct BarrierState {
  unsigned long long epoch;
  unsigned int failed;
  int name_id;   // the barrier that timed out (NcclComm::barrier_names_)
  int peer;      // the first rank found missing
  int missing;   // how many were missing
  unsigned long long failed_epoch;
};

namespace {

constexpr int kBarrierThreads = 64;
constexpr size_t kWindowAlignment = 4096;  // 2.28.9 names it NCCL_WIN_REQUIRED_ALIGNMENT; a literal builds with any 2.28

// One barrier, by value (a graph captures it). Rank q's inbox holds, at [p], the last epoch rank p
// arrived at; inboxes[q] is where this process stores into q's (over NVLink for a peer).
struct BarrierArgs {
  uint64_t* const* inboxes;  // device [num_ranks]
  const uint64_t* own_inbox;
  BarrierState* state;
  int rank, num_ranks, name_id;
  unsigned long long timeout_ns;
};

__device__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// One CTA. Thread q arrives at rank q (stores this barrier's epoch into q's inbox) and waits for
// rank q (its entry in our inbox reaching the epoch). Epochs only grow and a peer cannot pass
// barrier n + 1 before this rank arrives at it, so `>=` is exact and nothing is ever reset: a
// replayed graph keeps counting. A wait that passes the deadline records the error and returns.
__global__ void __launch_bounds__(kBarrierThreads) barrier_kernel(BarrierArgs a) {
  __shared__ unsigned long long epoch, start;
  __shared__ bool failed;
  if (threadIdx.x == 0) {
    epoch = a.state->epoch + 1;
    a.state->epoch = epoch;
    start = globaltimer_ns();
    failed = *static_cast<volatile unsigned*>(&a.state->failed) != 0;
  }
  __syncthreads();
  // Release at system scope: whatever this GPU wrote before the barrier (earlier kernels of the
  // stream: staged tokens, rows stored into the peers' combine regions) is visible to a peer
  // before our arrival is.
  __threadfence_system();
  for (int q = int(threadIdx.x); q < a.num_ranks; q += int(blockDim.x))
    if (q != a.rank) store_release_sys(a.inboxes[q] + a.rank, epoch);
  // After a timeout the ranks' epochs disagree: later barriers do not wait again, so the host
  // reaches its check without paying the timeout once per barrier.
  if (!failed)
    for (int q = int(threadIdx.x); q < a.num_ranks; q += int(blockDim.x)) {
      if (q == a.rank) continue;
      while (load_acquire_sys(a.own_inbox + q) < epoch) {
        if (globaltimer_ns() - start > a.timeout_ns) {
          atomicAdd(&a.state->missing, 1);
          if (atomicCAS(&a.state->failed, 0u, 1u) == 0u) {
            a.state->name_id = a.name_id;
            a.state->peer = q;
            a.state->failed_epoch = epoch;
          }
          break;
        }
        __nanosleep(256);
      }
    }
  // Acquire: no later read of this GPU sees a peer's memory older than the peer's arrival.
  __threadfence_system();
  __syncthreads();
}

// Every rank's part of a symmetric window as this process addresses it (peer = LSA rank: the
// constructor checked that the load/store team is the whole job, in rank order).
__global__ void lsa_pointers_kernel(ncclWindow_t win, int num_ranks, uint8_t** out) {
  for (int p = int(threadIdx.x); p < num_ranks; p += int(blockDim.x))
    out[p] = static_cast<uint8_t*>(ncclGetLsaPointer(win, 0, p));
}

std::string seconds(std::chrono::milliseconds t) {
  std::ostringstream os;
  os << double(t.count()) / 1000.0 << " s";
  return os.str();
}

std::string version_name(int code) {
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." + std::to_string(code % 100);
}

}  // namespace

NcclComm::NcclComm(const RankEnv& env, CommOptions options)
    : rank_(env.rank), num_ranks_(env.world_size), opt_(std::move(options)) {
  // NVLink multicast stays off unless the user asked for it: nothing here uses it, and NCCL's own
  // collectives would otherwise set it up on NVSwitch hosts.
  ::setenv("NCCL_NVLS_ENABLE", "0", 0);
  // Symmetric windows need NCCL's cuMem allocations, which NCCL 2.28 leaves off on some hosts
  // (virtual machines among them): the communicator then "does not support symmetric memory".
  ::setenv("NCCL_CUMEM_ENABLE", "1", 0);
  const int devices = cuda::device_count();
  MOEFQ_CHECK(env.local_rank < devices, "rank ", rank_, ": LOCAL_RANK ", env.local_rank, " needs GPU ", env.local_rank,
              ", but ", devices, " GPUs are visible (one process per GPU: at most as many ranks per host as GPUs)");
  int version = 0;
  MOEFQ_NCCL_CHECK(ncclGetVersion(&version));
  MOEFQ_CHECK(version == NCCL_VERSION_CODE, "NCCL: moefq was built with the headers of NCCL ",
              version_name(NCCL_VERSION_CODE), " but runs with libnccl ", version_name(version),
              "; the device API's structures differ between releases: build against the library it runs with "
              "(cmake -DNCCL_INCLUDE_DIR=... -DNCCL_LIBRARY=...) or put that library first in LD_LIBRARY_PATH");
  MOEFQ_CUDA_CHECK(cudaSetDevice(env.local_rank));
  ncclUniqueId id;
  if (rank_ == 0) {
    MOEFQ_NCCL_CHECK(ncclGetUniqueId(&id));
    rendezvous_publish(env, opt_.id_key, std::vector<uint8_t>(id.internal, id.internal + sizeof id.internal));
  } else {
    const std::vector<uint8_t> blob = rendezvous_fetch(env, opt_.id_key, opt_.timeout);
    MOEFQ_CHECK(blob.size() == sizeof id.internal, "rank ", rank_, ": the NCCL unique id '", opt_.id_key, "' has ",
                blob.size(), " bytes instead of ", sizeof id.internal);
    std::memcpy(id.internal, blob.data(), blob.size());
  }
  try {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // so that every wait on the peers below is bounded
    MOEFQ_NCCL_CHECK(ncclCommInitRankConfig(&comm_, num_ranks_, id, rank_, &config));
    wait_ready("NCCL communicator");
    // The device communicator tells the load/store (LSA) team: its lsaRank and lsaSize are the
    // fields NCCL documents as stable. Nothing else of it is needed (our barrier is our own), so
    // it asks for no resources, multimem included. A single rank is its own team and needs no
    // window (NCCL 2.28.3 gives a 1-rank communicator no symmetric memory: seen on an H200).
    if (num_ranks_ > 1) check_lsa_team();
    MOEFQ_CUDA_CHECK(cudaMalloc(&sync_word_, sizeof *sync_word_));
    MOEFQ_CUDA_CHECK(cudaMalloc(&state_, sizeof *state_));
    MOEFQ_CUDA_CHECK(cudaMemset(state_, 0, sizeof *state_));
    const Window& inbox = register_window(size_t(num_ranks_) * sizeof(uint64_t));
    MOEFQ_CUDA_CHECK(cudaMalloc(&inboxes_, size_t(num_ranks_) * sizeof *inboxes_));
    MOEFQ_CUDA_CHECK(cudaMemcpy(inboxes_, inbox.peers.data(), size_t(num_ranks_) * sizeof *inboxes_, cudaMemcpyHostToDevice));
    cuda::land_host_copies();  // the state's zeroing and the inboxes, before the barrier kernels read them
  } catch (...) {
    abort();
    throw;
  }
}

void NcclComm::check_lsa_team() {
  ncclDevCommRequirements reqs{};
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
  reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#endif
  ncclDevComm dev{};
  MOEFQ_NCCL_CHECK(ncclDevCommCreate(comm_, &reqs, &dev));
  wait_ready("NCCL device communicator");
  const int lsa_rank = dev.lsaRank, lsa_size = dev.lsaSize;
  MOEFQ_NCCL_CHECK(ncclDevCommDestroy(comm_, &dev));
  wait_ready("NCCL device communicator");
  MOEFQ_CHECK(lsa_size == num_ranks_ && lsa_rank == rank_, "rank ", rank_, ": NCCL reaches ", lsa_size, " of the ",
              num_ranks_, " ranks by loads and stores (this rank is its rank ", lsa_rank,
              "); real ranks need every GPU of the job connected peer to peer (one NVLink host)");
}

NcclComm::~NcclComm() {
  if (comm_ && !broken_) {
    try {
      MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());  // no kernel of this rank still uses a window
      for (auto w = windows_.rbegin(); w != windows_.rend(); ++w) {
        if (!w->handle) continue;  // a single rank's plain memory
        MOEFQ_NCCL_CHECK(ncclCommWindowDeregister(comm_, w->handle));
        wait_ready("NCCL window deregistration");
        w->handle = nullptr;
      }
      MOEFQ_NCCL_CHECK(ncclCommFinalize(comm_));
      wait_ready("NCCL communicator finalization");
      MOEFQ_NCCL_CHECK(ncclCommDestroy(comm_));
      comm_ = nullptr;
    } catch (const Error&) {
      // A peer is gone: abort() frees this rank's part without it.
    }
  }
  abort();
}

void NcclComm::abort() noexcept {
  if (comm_) ncclCommAbort(comm_);
  comm_ = nullptr;
  for (Window& w : windows_) {
    if (w.local && num_ranks_ == 1) cudaFree(w.local);
    else if (w.local) ncclMemFree(w.local);
  }
  windows_.clear();
  cudaFree(inboxes_);
  cudaFree(state_);
  cudaFree(sync_word_);
  inboxes_ = nullptr;
  state_ = nullptr;
  sync_word_ = nullptr;
}

void NcclComm::require_usable() const {
  MOEFQ_CHECK(!broken_, "rank ", rank_, ": the NCCL communicator is unusable after an earlier failure of a peer");
}

const NcclComm::Window& NcclComm::register_window(size_t bytes) {
  bytes = (bytes + kWindowAlignment - 1) / kWindowAlignment * kWindowAlignment;
  Window& w = windows_.emplace_back();
  if (num_ranks_ == 1) {  // no peer: plain device memory, the same pointers for the kernels
    MOEFQ_CUDA_CHECK(cudaMalloc(&w.local, bytes));
    MOEFQ_CUDA_CHECK(cudaMemset(w.local, 0, bytes));
    w.peers = {static_cast<uint8_t*>(w.local)};
    return w;
  }
  MOEFQ_NCCL_CHECK(ncclMemAlloc(&w.local, bytes));
  MOEFQ_CUDA_CHECK(cudaMemset(w.local, 0, bytes));
  MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
  MOEFQ_NCCL_CHECK(ncclCommWindowRegister(comm_, w.local, bytes, &w.handle, NCCL_WIN_COLL_SYMMETRIC));
  wait_ready("NCCL window registration");
  MOEFQ_CHECK(w.handle, "rank ", rank_, ": NCCL gave no symmetric window (it needs CUDA VMM, NCCL_CUMEM_ENABLE not 0, and "
              "direct peer-to-peer access between every pair of the job's GPUs)");
  cuda::DeviceBuffer<uint8_t*> ptrs{static_cast<size_t>(num_ranks_)};
  lsa_pointers_kernel<<<1, kBarrierThreads>>>(w.handle, num_ranks_, ptrs.get());
  MOEFQ_CUDA_CHECK_LAUNCH();
  w.peers = ptrs.download();
  w.peers[size_t(rank_)] = static_cast<uint8_t*>(w.local);  // this GPU's memory through its own address
  // No rank's kernels may store into a part that its owner has not zeroed yet.
  all_reduce_max(sync_word_, 1, nullptr);
  return w;
}

std::vector<uint8_t*> NcclComm::symmetric_buffers(size_t bytes) {
  require_usable();
  return register_window(bytes).peers;
}

void NcclComm::barrier(const char* name, cudaStream_t stream) {
  require_usable();
  const auto it = std::find(barrier_names_.begin(), barrier_names_.end(), name);
  const int id = int(it - barrier_names_.begin());
  if (it == barrier_names_.end()) barrier_names_.emplace_back(name);
  const BarrierArgs a{inboxes_,  static_cast<const uint64_t*>(windows_[0].local), state_, rank_, num_ranks_, id,
                      static_cast<unsigned long long>(std::chrono::nanoseconds(opt_.barrier_timeout).count())};
  barrier_kernel<<<1, kBarrierThreads, 0, stream>>>(a);
  MOEFQ_CUDA_CHECK_LAUNCH();
}

void NcclComm::check() {
  BarrierState s{};
  MOEFQ_CUDA_CHECK(cudaMemcpy(&s, state_, sizeof s, cudaMemcpyDeviceToHost));
  if (!s.failed) return;
  broken_ = true;
  MOEFQ_FAIL(ErrorKind::kFailedCheck, "rank ", rank_, ": device barrier '", barrier_names_[size_t(s.name_id)],
             "' (barrier ", s.failed_epoch, " of this rank) timed out after ", seconds(opt_.barrier_timeout),
             " waiting for rank ", s.peer, s.missing > 1 ? " and " + std::to_string(s.missing - 1) + " more" : "",
             "; a peer rank died, hung or skipped a call, and this communicator cannot be used any more");
}

void NcclComm::all_reduce_max(uint32_t* words, size_t count, cudaStream_t stream) {
  require_usable();
  MOEFQ_NCCL_CHECK(ncclAllReduce(words, words, count, ncclUint32, ncclMax, comm_, stream));
  wait_ready("NCCL all-reduce");  // non-blocking: the call may return before it is enqueued
  wait_stream(stream, "NCCL all-reduce");
}

bool NcclComm::comm_done(const char* what) {
  ncclResult_t state = ncclInProgress;
  MOEFQ_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
  if (state == ncclSuccess || state == ncclInProgress) return state == ncclSuccess;
  broken_ = true;
  MOEFQ_FAIL(ErrorKind::kFailedCheck, "rank ", rank_, ": ", what, " failed: ", ncclGetErrorString(state), " (",
             ncclGetLastError(comm_), "); a peer rank may have died");
}

void NcclComm::wait_ready(const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + opt_.timeout;
  while (!comm_done(what)) {
    if (std::chrono::steady_clock::now() > deadline) fail_timeout(what);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void NcclComm::wait_stream(cudaStream_t stream, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + opt_.timeout;
  for (;;) {
    const cudaError_t done = cudaStreamQuery(stream);
    if (done == cudaSuccess) return;
    if (done != cudaErrorNotReady) MOEFQ_CUDA_CHECK(done);
    comm_done(what);  // raises an error NCCL noticed (a peer that died) instead of waiting it out
    if (std::chrono::steady_clock::now() > deadline) fail_timeout(what);
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void NcclComm::fail_timeout(const char* what) {
  broken_ = true;
  MOEFQ_FAIL(ErrorKind::kFailedCheck, "rank ", rank_, ": ", what, " not ready after ", seconds(opt_.timeout),
             "; a peer rank died or hung");
}

}  // namespace moefq::comm
