// moefq bench: benchmark programs (CUDA builds only).
#include <CLI/CLI.hpp>

#include <memory>

#include "cli/commands.h"
#include "moefq/errors.h"
#ifdef MOEFQ_HAS_CUDA
#include "bench/bench.h"
#endif

namespace moefq::cli {

std::function<int()> add_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks on the GPU, with the measured ceilings beside every figure.");
  bench->require_subcommand(1);
  CLI::App* qdq = bench->add_subcommand(
      "qdq", "QDQ kernels on [rows, cols] bf16: time, GB/s (read + write) and the ratio to a "
             "device-to-device copy of the same bytes, measured in the same run.");
#ifdef MOEFQ_HAS_CUDA
  auto o = std::make_shared<bench::QdqBenchOptions>();
  qdq->add_option("--rows", o->rows, "row counts (default 128 4096 32768)");
  qdq->add_option("--cols", o->cols, "hidden size (default 7168)");
  qdq->add_option("--formats", o->formats, "subset of fp8 nvfp4 mxfp8 mxfp4 int8 stage_e4m3 (default all)");
  qdq->add_option("--reps", o->reps, "timed graph replays; the median is reported")->check(CLI::Range(1, 10000));
  qdq->add_option("--launches", o->launches_per_graph, "launches captured per graph")->check(CLI::Range(1, 1000));
  qdq->add_option("--json", o->json, "also write the results as JSON to this file");
  qdq->footer("Example:\n  moefq bench qdq --rows 32768 --json bench_qdq.json");
  return [bench, qdq, o] { return qdq->parsed() ? bench::run_bench_qdq(*o) : 0; };
#else
  return [bench, qdq]() -> int {
    MOEFQ_CHECK(!qdq->parsed(), "moefq bench: this moefq was built without CUDA (no nvcc was found)");
    return 0;
  };
#endif
}

}  // namespace moefq::cli
