// moefq bench moe on real ranks (bench_moe.h, run_bench_moe_ranks): one process per GPU under
// `moefq launch`, the layer's buffers in the comm layer's NCCL windows. Without NCCL it says so.
#include "bench/bench_moe.h"

#include "moefq/errors.h"

#if MOEFQ_HAS_NCCL
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>

#include "bench/bench_cuda_util.cuh"
#include "bench/bench_memory.h"
#include "bench/moe_inputs.h"
#include "comm/nccl_comm.cuh"
#include "engine/cuda/cuda_engine.cuh"
#include "moefq/cuda_device.h"
#include "eval/layer_runner.h"
#include "moefq/dist_env.h"
#include "moefq/fileio.h"
#include "moefq/synthetic.h"
#endif

namespace moefq::bench {

#if MOEFQ_HAS_NCCL
namespace {

using cuda::DeviceBuffer;

// Bytes rank d sends its peers in one call: its staged rows (e4m3, 1x128 scales, router weight)
// that expert ranks pull, the bf16 rows its experts store into the token ranks' combine regions,
// and its topk ids, which every peer's dispatch reads.
double bytes_sent(const std::vector<Routing>& all, int64_t d, int64_t T, int64_t K, int64_t H, int64_t el) {
  const int64_t N = int64_t(all.size());
  double bytes = double((N - 1) * T * K * 4);
  for (int64_t r = 0; r < N; ++r)
    for (int32_t e : all[size_t(r)].idx) {
      const int64_t owner = e / el;
      if (r == d && owner != d) bytes += double(H + H / 128 * 4 + 4);
      if (owner == d && r != d) bytes += double(2 * H);
    }
  return bytes;
}

// Every rank's value, on every rank: each fills its own slot, the others hold 0, and a MAX over
// the ranks merges them (non-negative floats order like their bits).
std::vector<double> gather(comm::NcclComm& comm, double v) {
  std::vector<uint32_t> bits(size_t(comm.num_ranks()), 0);
  bits[size_t(comm.rank())] = f32_bits(float(v));
  DeviceBuffer<uint32_t> d(bits);
  comm.all_reduce_max(d.get(), bits.size(), nullptr);
  std::vector<double> out;
  for (uint32_t b : d.download()) out.push_back(double(f32_from_bits(b)));
  return out;
}

// Blocks of y = peer (skipping this rank): this rank's n16 16-byte words into its own slot of
// that peer's buffer.
__global__ void all_to_all_store_kernel(uint8_t* const* bufs, const uint4* __restrict__ src, int64_t n16, int rank) {
  const int q = int(blockIdx.y) < rank ? int(blockIdx.y) : int(blockIdx.y) + 1;
  uint4* dst = reinterpret_cast<uint4*>(bufs[q]) + int64_t(rank) * n16;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n16; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// The NVLink ceiling of the layer's traffic: GB/s this rank stores into its peers when every rank
// writes `bytes` to each peer at once (16-byte stores through the same load/store pointers the
// engine uses), after a barrier.
double all_to_all_store_gbs(comm::NcclComm& comm, size_t bytes, int per_graph, int reps) {
  const int R = comm.num_ranks();
  DeviceBuffer<uint8_t*> bufs(comm.symmetric_buffers(bytes * size_t(R)));
  DeviceBuffer<uint8_t> src(bytes);
  MOEFQ_CUDA_CHECK(cudaMemset(src.get(), 1, bytes));
  int dev = 0, sms = 0;
  MOEFQ_CUDA_CHECK(cudaGetDevice(&dev));
  MOEFQ_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const dim3 grid(unsigned(std::max(1, 8 * sms / (R - 1))), unsigned(R - 1));
  const double us = median_us(
      [&](cudaStream_t s) {
        comm.barrier("bench: all-to-all stores", s);
        all_to_all_store_kernel<<<grid, 512, 0, s>>>(bufs.get(), reinterpret_cast<const uint4*>(src.get()),
                                                     int64_t(bytes / 16), comm.rank());
        MOEFQ_CUDA_CHECK_LAUNCH();
      },
      per_graph, reps);
  MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
  comm.check();
  return double(bytes) * double(R - 1) / us * 1e-3;
}

}  // namespace

int run_bench_moe_ranks(const MoeBenchOptions& o) {
  const RankEnv env = rank_env();
  const int64_t N = env.world_size, d = env.rank;
  MOEFQ_CHECK(o.configs.empty(), "--configs: the real-rank benchmark times the unquantized layer; leave --configs out");
  MOEFQ_CHECK(o.ep == N, "--ep ", o.ep, ": with real ranks the expert-parallel degree is the job's ", N,
              " ranks (moefq launch -n)");
  MOEFQ_CHECK(!o.tokens.empty(), "--tokens: no token counts");
  for (int64_t t : o.tokens) MOEFQ_CHECK(t >= 1, "--tokens: ", t, " is not a positive token count");
  for (const auto& p : o.presets) moe_rank_config(p, N);  // bad names and splits before any work
  MOEFQ_CHECK(cuda::device_count() > 0, "moefq bench moe: no CUDA device is visible");
  // Every rank plans its own GPU before the communicator exists; one that refuses stops the job.
  register_cuda_layer_runner();  // the GPU memory query the plan asks
  check_moe_bench_memory(o, N);
  const bool root = d == 0;
  std::optional<AtomicFile> out;  // the JSON path is checked before any work
  if (root && !o.json.empty()) out.emplace(o.json);
  comm::NcclComm comm(env);

  const std::string device = cuda::device_description();
  // The slowest rank's store rate bounds the layer's NVLink rate; no peers, no NVLink.
  double a2a = 0.0;
  if (N > 1) {
    const std::vector<double> rates = gather(comm, all_to_all_store_gbs(comm, size_t(32) << 20, 5, 7));
    a2a = *std::min_element(rates.begin(), rates.end());
  }
  if (root) {
    std::fprintf(stderr, "moefq bench moe, %lld real ranks, on %s, %s\n", (long long)N, device.c_str(), today().c_str());
    if (N > 1)
      std::printf("all-to-all NVLink stores: %.0f GB/s per rank (to its %lld peers at once, slowest rank)\n", a2a,
                  (long long)(N - 1));
  }
  nlohmann::json report = {{"device", device}, {"date", today()}, {"ranks", N}, {"all_to_all_store_gbs", a2a}};
  const int64_t tmax = *std::max_element(o.tokens.begin(), o.tokens.end());
  bool all_match = true;

  for (const std::string& name : o.presets) {
    const MoeConfig c = preset(name);
    const int64_t H = c.hidden, K = c.top_k, E = c.num_experts, el = E / N;
    // The same per-GPU work on this GPU alone: E/N local experts, every row routed locally.
    MoeConfig lone_cfg = c;
    lone_cfg.num_experts = el;
    lone_cfg.n_group = lone_cfg.topk_group = 1;
    std::vector<LayerWeights> w(1);
    const Staging staging = moe_bench_staging(o, c);
    w[0] = repeated_weights(c, d * el, el, moe_bench_weight_format(staging));
    cuda::CudaEngine real(c, comm, tmax, w[0], moe_bench_engine_options(staging, true));
    w[0].first_expert = 0;
    cuda::CudaEngine lone(lone_cfg, 1, tmax, w, moe_bench_engine_options(staging, true));
    w.clear();
    if (root) {
      std::printf("\n%s over %lld ranks: H %lld, I %lld, %lld experts (%lld per rank), K %lld, shared %lld\n",
                  name.c_str(), (long long)N, (long long)H, (long long)c.intermediate, (long long)E, (long long)el,
                  (long long)K, (long long)c.num_shared);
      std::printf("%6s  %10s  %10s  %10s  %8s  %9s  %11s  %7s\n", "tokens", "time_us", "fastest_us", "alone_us",
                  "of_alone", "sent_MB", "nvlink_GB/s", "of_a2a");
    }
    nlohmann::json pj = {{"preset", name}, {"hidden", H}, {"intermediate", c.intermediate}, {"experts", E},
                         {"local_experts", el}, {"top_k", K}};
    for (int64_t T : o.tokens) {
      std::vector<Routing> routing;
      for (int64_t r = 0; r < N; ++r) routing.push_back(uniform_routing(T, K, E, uint64_t(T) * 1024 + uint64_t(r)));
      const Routing& mine = routing[size_t(d)];
      const Routing alone = uniform_routing(T, K, el, uint64_t(T) * 1024 + uint64_t(N + d));
      std::vector<bf16> xh(size_t(T * H));
      const std::vector<float> xf = synthetic_activations(T, H, 7 + uint64_t(d));
      for (size_t i = 0; i < xh.size(); ++i) xh[i].bits = bf16_round(xf[i]);
      // With identical experts a routed row depends only on its token and router weight, so this
      // rank's output must equal the lone engine's on the same tokens and weights with slot k routed
      // to local expert k: a row lost or misplaced over NVLink shows up here.
      std::vector<int32_t> folded(mine.idx.size());
      for (size_t i = 0; i < folded.size(); ++i) folded[i] = int32_t(i % size_t(K));
      DeviceBuffer<bf16> x(xh), y(size_t(T * H)), y_alone(size_t(T * H));
      DeviceBuffer<int32_t> idx(mine.idx), idx_folded(folded), idx_alone(alone.idx);
      DeviceBuffer<float> wt(mine.wt), wt_alone(alone.wt);
      const cuda::DeviceBatch batch{x.get(), T, idx.get(), wt.get(), y.get()};
      const cuda::DeviceBatch check{x.get(), T, idx_folded.get(), wt.get(), y_alone.get()};
      const cuda::DeviceBatch lone_batch{x.get(), T, idx_alone.get(), wt_alone.get(), y_alone.get()};
      real.forward({&batch, 1}, nullptr);
      real.synchronize(nullptr);
      lone.forward({&check, 1}, nullptr);
      lone.synchronize(nullptr);
      const std::vector<bf16> got = y.download(), want = y_alone.download();
      double mismatches = 0;
      for (size_t i = 0; i < got.size(); ++i) mismatches += got[i].bits != want[i].bits;
      const std::vector<double> bad = gather(comm, mismatches);

      const std::vector<TimedCase> cases = {
          {nullptr, [&](int, cudaStream_t s) { real.forward({&batch, 1}, s); }},
          {nullptr, [&](int, cudaStream_t s) { lone.forward({&lone_batch, 1}, s); }}};
      const std::vector<double> us = interleaved_median_us(cases, o.calls_per_graph, o.reps);
      real.synchronize(nullptr);  // a barrier that timed out during the timing fails here
      const std::vector<double> times = gather(comm, us[0]), alone_times = gather(comm, us[1]);
      std::vector<double> sent;
      for (int64_t r = 0; r < N; ++r) sent.push_back(bytes_sent(routing, r, T, K, H, el));
      const double slowest = *std::max_element(times.begin(), times.end());
      const double fastest = *std::min_element(times.begin(), times.end());
      const double slowest_alone = *std::max_element(alone_times.begin(), alone_times.end());
      const double mean_sent = std::accumulate(sent.begin(), sent.end(), 0.0) / double(N);
      const double gbs = mean_sent / slowest * 1e-3;
      int64_t bad_ranks = 0;
      for (double b : bad) bad_ranks += b > 0;
      all_match = all_match && bad_ranks == 0;
      if (root) {
        std::printf("%6lld  %10.1f  %10.1f  %10.1f  %8.2f  %9.2f  %11.0f  %7.2f%s\n", (long long)T, slowest, fastest,
                    slowest_alone, slowest_alone / slowest, mean_sent * 1e-6, gbs, N > 1 ? gbs / a2a : 0.0,
                    bad_ranks ? "  OUTPUT MISMATCH" : "");
        if (bad_ranks)
          std::fprintf(stderr, "moefq bench moe: %lld ranks' outputs at %lld tokens differ from the same tokens on one GPU\n",
                       (long long)bad_ranks, (long long)T);
      }
      pj["runs"].push_back({{"tokens", T}, {"time_us", slowest}, {"rank_time_us", times}, {"alone_us", slowest_alone},
                            {"rank_alone_us", alone_times}, {"fraction_of_alone", slowest_alone / slowest},
                            {"sent_bytes", sent}, {"nvlink_gbs", gbs}, {"fraction_of_all_to_all", N > 1 ? gbs / a2a : 0.0},
                            {"output_mismatches", bad}});
    }
    report["presets"].push_back(pj);
  }
  if (out) {
    const std::string text = report.dump(2) + "\n";
    out->write(text.data(), text.size());
    out->commit();
  }
  return all_match ? 0 : 1;
}

#else

int run_bench_moe_ranks(const MoeBenchOptions&) {
  MOEFQ_FAIL(ErrorKind::kBadInput, "moefq bench moe --real-ranks: this moefq was built without NCCL (CMake found no "
             "NCCL 2.28+ with nccl_device.h, or MOEFQ_ENABLE_NCCL=OFF); see docs/multi_gpu.md");
}

#endif

}  // namespace moefq::bench
