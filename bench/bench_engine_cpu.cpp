// moefq bench engine-cpu: one layer call of the CPU engine (all simulated ranks), timed.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <nlohmann/json.hpp>
#include <thread>

#include "bench/bench.h"
#include "tool/device_choice.h"
#include "eval/layer_runner.h"
#include "moefq/cpu_engine.h"
#include "moefq/errors.h"
#include "moefq/fileio.h"
#include "moefq/router.h"
#include "moefq/synthetic.h"

namespace moefq::bench {
namespace {

// Refuses, with the figures, a run that does not fit the host, before any allocation. The eval's
// plan of one batch of R x T tokens on the CPU engine counts what this benchmark holds: every
// rank's weights and router, the engine's buffers, the activations, the outputs, the GEMM scratch.
void check_memory(const MoeConfig& cfg, const EngineCpuBenchOptions& o) {
  RunnerSetup s;
  s.config = cfg;
  s.ranks = o.ranks;
  s.tokens = o.tokens;
  s.calib_batches = 1;  // one batch: the activations and their outputs
  s.weight_format = o.format;
  s.staging = o.staging.value_or(default_staging(cfg));
  s.num_threads = o.threads;
  require_memory_fits(plan_run_memory(s, EvalDevice::kCpu),
                     "moefq bench engine-cpu: --ranks " + std::to_string(o.ranks) + " --tokens " +
                         std::to_string(o.tokens) + " of " + cfg.name,
                     "use fewer --ranks or --tokens, or a smaller --preset");
}

}  // namespace

int run_bench_engine_cpu(const EngineCpuBenchOptions& o) {
  const MoeConfig cfg = preset(o.preset);
  MOEFQ_CHECK(o.ranks >= 1 && cfg.num_experts % o.ranks == 0, "--ranks must divide the expert count (",
              cfg.num_experts, ")");
  MOEFQ_CHECK(o.tokens >= 1, "--tokens must be >= 1");
  const int64_t R = o.ranks, T = o.tokens, H = cfg.hidden, el = cfg.num_experts / R;
  check_memory(cfg, o);
  const Staging staging = o.staging.value_or(default_staging(cfg));
  std::fprintf(stderr, "moefq bench engine-cpu: %s, %lld ranks x %lld tokens, %s weights, staging %s, generating...\n",
               cfg.name.c_str(), (long long)R, (long long)T, weight_format_name(o.format), staging_name(staging));
  std::vector<LayerWeights> w;
  for (int64_t r = 0; r < R; ++r) w.push_back(synthetic_weights(cfg, o.format, 1, r * el, el));
  EngineOptions eo;
  eo.num_threads = o.threads;
  eo.staging = staging;
  CpuEngine eng(cfg, R, T, w, eo);
  std::vector<std::vector<bf16>> x(static_cast<size_t>(R)), y(static_cast<size_t>(R));
  std::vector<Routing> routing;
  std::vector<RankBatch> batches;
  int64_t rows = 0;
  for (int64_t r = 0; r < R; ++r) {
    for (float v : synthetic_activations(T, H, uint64_t(100 + r))) x[size_t(r)].push_back({bf16_round(v)});
    y[size_t(r)].resize(size_t(T * H));
    routing.push_back(route(cfg, x[size_t(r)].data(), T, w[0].gate, w[0].gate_bias));
    for (int32_t e : routing.back().topk_idx) rows += e >= 0;
  }
  for (int64_t r = 0; r < R; ++r)
    batches.push_back({x[size_t(r)].data(), T, routing[size_t(r)].topk_idx.data(), routing[size_t(r)].topk_weights.data(),
                       y[size_t(r)].data()});
  std::vector<double> ms;
  for (int i = 0; i < o.reps + 1; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    eng.forward(batches);
    const auto t1 = std::chrono::steady_clock::now();
    if (i > 0) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());  // first call warms up
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  const int64_t Is = cfg.intermediate * cfg.num_shared;
  const double flops = double(rows) * 6.0 * double(H) * double(cfg.intermediate) + double(R * T) * 6.0 * double(H) * double(Is);
  const unsigned threads = o.threads > 0 ? unsigned(o.threads) : std::max(1u, std::thread::hardware_concurrency());
  std::printf("preset %s  ranks %lld  tokens/rank %lld  routed rows %lld  threads %u  weights %s  staging %s\n",
              cfg.name.c_str(), (long long)R, (long long)T, (long long)rows, threads, weight_format_name(o.format),
              staging_name(staging));
  std::printf("layer call: median %.2f ms (min %.2f, max %.2f, %d calls)  %.2f GFLOP/s  %.0f tokens/s\n", med,
              ms.front(), ms.back(), o.reps, flops / med * 1e-6, double(R * T) / med * 1e3);
  if (!o.json.empty()) {
    nlohmann::json j = {{"tool", "moefq bench engine-cpu"}, {"device", tool::cpu_device_name(o.threads)},
                        {"date", today()}, {"preset", cfg.name}, {"ranks", R}, {"tokens_per_rank", T},
                        {"routed_rows", rows}, {"threads", threads}, {"median_ms", med}, {"min_ms", ms.front()},
                        {"gflops", flops / med * 1e-6}, {"weights", weight_format_name(o.format)},
                        {"staging", staging_name(staging)}};
    write_file_atomic(o.json, j.dump(2) + "\n");
  }
  return 0;
}

}  // namespace moefq::bench
