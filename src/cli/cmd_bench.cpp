// moefq bench: benchmark programs (the GPU ones in CUDA builds only).
#include <CLI/CLI.hpp>

#include <memory>

#include "cli/commands.h"
#include "bench/bench.h"
#include "moefq/errors.h"

namespace moefq::cli {

std::function<int()> add_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks, with the measured ceilings beside every GPU figure.");
  bench->require_subcommand(1);
  CLI::App* ecpu = bench->add_subcommand("engine-cpu", "One MoE layer call of the CPU engine (all simulated ranks), timed.");
  auto eo = std::make_shared<bench::EngineCpuBenchOptions>();
  ecpu->add_option("--preset", eo->preset, "model preset (default tiny)");
  ecpu->add_option("--ranks", eo->ranks, "simulated ranks (default 4)")->check(CLI::Range(1, 64));
  ecpu->add_option("--tokens", eo->tokens, "tokens per rank (default 256)")->check(CLI::Range(1, 1 << 20));
  ecpu->add_option("--threads", eo->threads, "CPU threads (default: all)")->check(CLI::Range(0, 1024));
  ecpu->add_option("--reps", eo->reps, "timed calls (default 5)")->check(CLI::Range(1, 1000));
  ecpu->add_option("--json", eo->json, "also write the result as JSON to this file");
  ecpu->footer("Example:\n  moefq bench engine-cpu --preset tiny --ranks 4 --tokens 256");
  CLI::App* fqb = bench->add_subcommand("fake-quant", "Accuracy cost of each dispatch/combine recipe on one MoE layer (CPU).");
  auto fo = std::make_shared<bench::FakeQuantBenchOptions>();
  fqb->add_option("--preset", fo->preset, "model preset (default tiny)");
  fqb->add_option("--experts", fo->experts, "use this many routed experts instead of the preset's")->check(CLI::Range(1, 4096));
  fqb->add_option("--ranks", fo->ranks, "simulated ranks (default 4)")->check(CLI::Range(1, 64));
  fqb->add_option("--tokens", fo->tokens, "tokens per rank per batch (default 64)")->check(CLI::Range(1, 1 << 16));
  fqb->add_option("--calib-batches", fo->calib_batches, "calibration batches (default 2)")->check(CLI::Range(1, 1000));
  fqb->add_option("--eval-batches", fo->eval_batches, "held-out evaluation batches (default 2)")->check(CLI::Range(1, 1000));
  fqb->add_option("--seed", fo->seed, "seed of weights and activations (default 1)");
  fqb->add_option("--json", fo->json, "also write the table as JSON to this file");
  fqb->footer("Example:\n  moefq bench fake-quant --preset deepseek-v3 --experts 16 --ranks 2 --tokens 16");
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
  return [qdq, o, ecpu, eo, fqb, fo] {
    if (ecpu->parsed()) return bench::run_bench_engine_cpu(*eo);
    if (fqb->parsed()) return bench::run_bench_fake_quant(*fo);
    return qdq->parsed() ? bench::run_bench_qdq(*o) : 0;
  };
#else
  return [qdq, ecpu, eo, fqb, fo]() -> int {
    if (ecpu->parsed()) return bench::run_bench_engine_cpu(*eo);
    if (fqb->parsed()) return bench::run_bench_fake_quant(*fo);
    MOEFQ_CHECK(!qdq->parsed(), "moefq bench qdq: this moefq was built without CUDA (no nvcc was found)");
    return 0;
  };
#endif
}

}  // namespace moefq::cli
