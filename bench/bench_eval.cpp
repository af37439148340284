// moefq bench eval: the main job's pipeline timed per layer and stage (include/moefq/eval.h's
// StageTimes), on the GPU (device-resident) or the CPU.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "tool/device_choice.h"
#include "moefq/errors.h"
#include "moefq/eval.h"
#include "moefq/fileio.h"
#ifdef MOEFQ_HAS_CUDA
#include "moefq/cuda.h"
#include "eval/layer_runner.h"
#endif

namespace moefq::bench {

// The longest CPU run bench eval starts.
constexpr double kBenchEvalCpuLimitSeconds = 3600;

int run_bench_eval(const EvalBenchOptions& o) {
  EvalOptions e;
  e.preset = o.preset;
  e.preset_given = true;
  e.layers = parse_layers(o.layers);
  e.ranks = o.ranks;
  e.tokens = o.tokens;
  e.calib_batches = o.calib_batches;
  e.eval_batches = o.eval_batches;
  e.staging = o.staging;
#ifdef MOEFQ_HAS_CUDA
  register_cuda_layer_runner();  // a refused CPU run's plan asks the GPU's free memory, as eval's
#endif
  if (tool::use_cuda(o.device)) {
#ifdef MOEFQ_HAS_CUDA
    e.device = EvalDevice::kCuda;
    e.device_name = cuda::device_description();
#endif
  } else {
    e.device_name = tool::cpu_device_name(0);
  }
  e.progress = [](const std::string& line) { std::fprintf(stderr, "  %s\n", line.c_str()); };
  // bench eval times the pipeline; on a CPU a full-size preset takes minutes per layer: run_eval
  // tells the estimate before the work, and a run beyond an hour is refused here (moefq eval runs
  // it when the numbers are wanted).
  if (const std::optional<RunEstimate> est = estimate_eval_time(e)) {
    MOEFQ_CHECK(est->total() <= kBenchEvalCpuLimitSeconds, "moefq bench eval: on this CPU the run would take ",
                est->describe(), "; bench eval times the GPU pipeline: use --device cuda, fewer --layers or --tokens, ",
                "or moefq eval for the numbers themselves");
  }
  const EvalResult r = run_eval(e);
  std::printf("moefq bench eval: %s, %zu layers, %lld ranks x %lld tokens, %d + %d batches, %zu recipes; %s\n",
              o.preset.c_str(), r.setup.layers.size(), (long long)o.ranks, (long long)o.tokens, o.calib_batches,
              o.eval_batches, r.setup.recipe_names.size(), r.setup.device.c_str());
  std::printf("%s\n\n", r.memory.describe().c_str());
  std::printf("%6s %9s %10s %10s %9s %9s %9s\n", "layer", "load_s", "calib_s", "ref_s", "recipes_s", "metrics_s",
              "total_s");
  StageTimes sum;
  for (const StageTimes& t : r.stage_times) {
    std::printf("%6lld %9.3f %10.3f %10.3f %9.3f %9.3f %9.3f\n", (long long)t.layer, t.load, t.calibrate, t.reference,
                t.recipes, t.metrics, t.total);
    sum.load += t.load;
    sum.calibrate += t.calibrate;
    sum.reference += t.reference;
    sum.recipes += t.recipes;
    sum.metrics += t.metrics;
    sum.total += t.total;
  }
  std::printf("%6s %9.3f %10.3f %10.3f %9.3f %9.3f %9.3f\n", "all", sum.load, sum.calibrate, sum.reference,
              sum.recipes, sum.metrics, sum.total);
  const double first = r.stage_times.empty() ? 0 : r.stage_times[0].total;
  const double setup = r.wall_seconds - sum.total;
  std::printf("\nwall %.2f s (first layer %.2f s, everything before the first layer %.2f s); %.2f s per layer\n",
              r.wall_seconds, first, setup, r.wall_seconds / double(std::max<size_t>(1, r.stage_times.size())));
  if (!o.json.empty()) {
    nlohmann::json j = {{"benchmark", "eval"},        {"preset", o.preset},       {"layers", r.setup.layers},
                        {"ranks", o.ranks},           {"tokens", o.tokens},       {"calib_batches", o.calib_batches},
                        {"eval_batches", o.eval_batches}, {"device", r.setup.device}, {"date", today()}, {"recipes", r.setup.recipe_names.size()},
                        {"wall_seconds", r.wall_seconds}, {"streaming", r.memory.streaming},
                        {"staging", staging_name(r.setup.staging)}};
    for (const StageTimes& t : r.stage_times)
      j["layers_seconds"].push_back({{"layer", t.layer}, {"load", t.load}, {"calibrate", t.calibrate},
                                     {"reference", t.reference}, {"recipes", t.recipes}, {"metrics", t.metrics},
                                     {"total", t.total}});
    write_file_atomic(o.json, j.dump(2) + "\n");
  }
  return 0;
}

}  // namespace moefq::bench
