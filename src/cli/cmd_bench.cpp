// moefq bench: benchmark programs. The GPU ones exist in every build; without CUDA they fail with
// a message saying so (bench/gpu_stubs.cpp).
#include <CLI/CLI.hpp>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench.h"
#include "bench/bench_combine.h"
#include "bench/bench_gemm.h"
#include "bench/bench_moe.h"
#include "cli/commands.h"
#include "cli/table.h"
#include "moefq/dist_env.h"
#include "moefq/errors.h"
#include "moefq/fileio.h"
#include "moefq/qdq.h"

namespace moefq::cli {
namespace {

// Sizes are checked when the options are parsed, in every build, before any work: a bad one is
// exit 2 naming the option. Token and row counts go up to kMaxRows; H and I are multiples of the
// 128-element block, up to the largest a real MoE model has (docs/cli.md).
constexpr int64_t kMaxRows = int64_t(1) << 20;
constexpr int64_t kMaxHidden = 65536, kMaxInter = 131072;

const CLI::Validator& rows_range() {
  static const CLI::Validator v = CLI::Range(int64_t(1), kMaxRows);
  return v;
}

// A positive multiple of 128 up to `max`.
CLI::Validator block_multiple(int64_t max) {
  return CLI::Validator(
      [max](const std::string& text) -> std::string {
        int64_t v = 0;
        const bool number = CLI::detail::lexical_cast(text, v);
        if (number && v > 0 && v % 128 == 0 && v <= max) return {};
        return "expected a positive multiple of 128 up to " + std::to_string(max) + ", got '" + text + "'";
      },
      "a multiple of 128 in [128, " + std::to_string(max) + "]");
}

// " (default 15)": a help string's default, from the options' own initial value.
std::string default_is(int64_t value) { return " (default " + std::to_string(value) + ")"; }

// A subcommand, the file its --json names (empty when not given) and its action.
struct BenchCase {
  CLI::App* cmd;
  const std::string* json;
  std::function<int()> action;
};

// --staging e4m3|none into `staging` (unset: the model's default, weights.h's default_staging).
void add_staging_option(CLI::App* sub, std::optional<Staging>& staging) {
  sub->add_option_function<std::string>(
      "--staging", [&staging](const std::string& v) { staging = staging_from_name(v, "--staging"); },
      "activations into the expert GEMMs: e4m3 (1x128 scales) or none (bf16); default: as the model is served");
}

}  // namespace

std::function<int()> add_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks, with the measured ceilings beside every GPU figure.");
  bench->require_subcommand(1);
  // Each subcommand with its --json and the action to run when it was chosen.
  auto actions = std::make_shared<std::vector<BenchCase>>();

  CLI::App* ecpu = bench->add_subcommand("engine-cpu", "One MoE layer call of the CPU engine (all simulated ranks), timed.");
  auto eo = std::make_shared<bench::EngineCpuBenchOptions>();
  ecpu->add_option("--preset", eo->preset, "model preset (default tiny)");
  ecpu->add_option("--ranks", eo->ranks, "simulated ranks (default 4)")->check(CLI::Range(1, 64));
  ecpu->add_option("--tokens", eo->tokens, "tokens per rank (default 256)")->check(rows_range());
  ecpu->add_option("--threads", eo->threads, "CPU threads (default: all)")->check(CLI::Range(0, 1024));
  add_staging_option(ecpu, eo->staging);
  ecpu->add_option_function<std::string>(
      "--weights",
      [eo](const std::string& v) {
        MOEFQ_CHECK(v == "e4m3" || v == "bf16", "--weights: unknown format '", v, "' (expected e4m3 or bf16)");
        eo->format = v == "bf16" ? WeightFormat::kBf16 : WeightFormat::kE4m3;
      },
      "expert weight format: e4m3 (default, 128x128 block scales) or bf16");
  ecpu->add_option("--reps", eo->reps, "timed calls (default 5)")->check(CLI::Range(1, 1000));
  ecpu->add_option("--json", eo->json, "also write the result as JSON to this file");
  ecpu->footer("Example:\n  moefq bench engine-cpu --preset tiny --ranks 4 --tokens 256");
  actions->push_back({ecpu, &eo->json, [eo] { return bench::run_bench_engine_cpu(*eo); }});

  CLI::App* ev = bench->add_subcommand(
      "eval", "The main job's pipeline (moefq eval, default sweep) timed per layer and stage: weights generated or "
              "loaded with activations and routing, calibration, reference, recipes, metrics.");
  auto vo = std::make_shared<bench::EvalBenchOptions>();
  ev->add_option("--preset", vo->preset, "model preset (default deepseek-v3)");
  ev->add_option("--layers", vo->layers, "layers (default 0-19)");
  ev->add_option("--ranks", vo->ranks, "simulated ranks (default 8)")->check(CLI::Range(1, 4096));
  ev->add_option("--tokens", vo->tokens, "tokens per rank per batch (default 256)")->check(rows_range());
  ev->add_option("--calib-batches", vo->calib_batches, "calibration batches (default 2)")->check(CLI::Range(1, 1000));
  ev->add_option("--eval-batches", vo->eval_batches, "evaluation batches (default 2)")->check(CLI::Range(1, 1000));
  ev->add_option("--device", vo->device, "auto | cpu | cuda (default auto)");
  add_staging_option(ev, vo->staging);
  ev->add_option("--json", vo->json, "also write the results as JSON to this file");
  ev->footer("Example:\n  moefq bench eval --preset deepseek-v3 --layers 0-19 --ranks 8 --tokens 256 --json bench_eval.json");
  actions->push_back({ev, &vo->json, [vo] { return bench::run_bench_eval(*vo); }});

  CLI::App* qdq = bench->add_subcommand(
      "qdq", "QDQ kernels on [rows, cols] bf16: time, GB/s (read + write) and the ratio to a "
             "device-to-device copy of the same bytes, measured in the same run.");
  auto qo = std::make_shared<bench::QdqBenchOptions>();
  qdq->add_option("--rows", qo->rows, "row counts (default 128 4096 32768)")->check(rows_range());
  qdq->add_option("--cols", qo->cols, "hidden size, a multiple of 128 (default 7168)")->check(block_multiple(kMaxHidden));
  qdq->add_option("--formats", qo->formats,
                  "any of " + format_choices() + " or stage_e4m3 (the engine's staging cast); default: every format, "
                  "stage_e4m3, fp8+amax (with the dynamic-amax pass) and nvfp4-sat (an amax 500x below the data's)");
  qdq->add_option("--reps", qo->reps, "timed graph replays; the median is reported" + default_is(qo->reps))
      ->check(CLI::Range(1, 10000));
  qdq->add_option("--launches", qo->launches_per_graph, "launches captured per graph" + default_is(qo->launches_per_graph))
      ->check(CLI::Range(1, 1000));
  qdq->add_option("--json", qo->json, "also write the results as JSON to this file");
  qdq->footer("Example:\n  moefq bench qdq --rows 32768 --json bench_qdq.json");
  actions->push_back({qdq, &qo->json, [qo] { return bench::run_bench_qdq(*qo); }});

  auto mo = std::make_shared<bench::MoeBenchOptions>();
  CLI::App* moe = bench->add_subcommand(
      "moe", "The fake-quantized MoE layer of one expert-parallel rank on the GPU: layer time, TFLOPS, weight GB/s, "
             "the roofline floor from the same run's ceilings, and each quantizer configuration's overhead.");
  moe->add_option("--preset", mo->presets, "model presets (repeatable; default deepseek-v3)");
  moe->add_option("--ep", mo->ep, "expert-parallel degree whose per-GPU share runs (default 8)")->check(CLI::Range(1, 1024));
  moe->add_option("--tokens", mo->tokens, "tokens per rank (default 8 128 512 1024 4096 8192)")->check(rows_range());
  moe->add_option("--configs", mo->configs,
                  "quantizer configurations, any of " + join(bench::moe_bench_configs(), "|") +
                      " (default all); none always runs, first");
  add_staging_option(moe, mo->staging);
  moe->add_option("--calls", mo->calls_per_graph, "layer calls captured per graph (default 3)")->check(CLI::Range(1, 100));
  moe->add_option("--reps", mo->reps, "timed graph replays; the median is reported (default 7)")->check(CLI::Range(1, 1000));
  moe->add_option("--json", mo->json, "also write the results as JSON to this file");
  moe->add_flag("--real-ranks", mo->real_ranks,
                "one rank of EP = WORLD_SIZE per process, over NCCL: run under moefq launch -n N (the default when "
                "WORLD_SIZE > 1); times the unquantized layer, NVLink GB/s and the same work on one GPU alone");
  moe->footer("Examples:\n  moefq bench moe --preset deepseek-v3 --tokens 128 4096 --json bench_moe.json\n"
              "  moefq launch -n 8 -- moefq bench moe --preset deepseek-v3 --preset deepseek-v4-pro --json ep8.json");
  actions->push_back({moe, &mo->json, [mo, moe] {
    const int64_t world = rank_env().world_size;
    if (!mo->real_ranks && world == 1) return bench::run_bench_moe(*mo);
    if (moe->count("--ep") == 0) mo->ep = world;  // real ranks: the job's size
    return bench::run_bench_moe_ranks(*mo);
  }});

  auto go = std::make_shared<bench::GemmBenchOptions>();
  CLI::App* gemm = bench->add_subcommand(
      "gemm", "Grouped expert GEMMs (gate/up + SwiGLU, down + store) with e4m3 weights: time, TFLOPS, the ratio to "
              "cuBLASLt FP8 on the same operands (batched over the experts, each with its own weights; and on one "
              "expert's weights) and to reading the touched experts' weights once; --weights bf16: bf16 weights "
              "and activations against cuBLASLt bf16.");
  gemm->add_option("--tokens", go->tokens, "tokens per rank; rows = tokens * top-k (default 1 128 512 4096)")
      ->check(rows_range());
  gemm->add_option("--hidden", go->hidden, "H, a multiple of 128 (default 7168)")->check(block_multiple(kMaxHidden));
  gemm->add_option("--inter", go->inter, "I, a multiple of 128 (default 2048)")->check(block_multiple(kMaxInter));
  gemm->add_option("--experts", go->experts, "local experts = groups (default 32)")->check(CLI::Range(1, 4096));
  gemm->add_option("--top-k", go->top_k, "rows per token (default 8)")->check(CLI::Range(1, 64));
  gemm->add_option("--reps", go->reps, "timed graph replays; the median is reported (default 20)")->check(CLI::Range(1, 10000));
  gemm->add_option("--weights", go->weights,
                   "e4m3 (default: e4m3 weights and activations, against cuBLASLt FP8) or bf16 (bf16 weights and "
                   "activations, staging none, against cuBLASLt bf16)")
      ->check(CLI::IsMember({"e4m3", "bf16"}));
  gemm->add_option("--json", go->json, "also write the results as JSON to this file");
  gemm->footer("Examples:\n  moefq bench gemm --tokens 1 4096 --json bench_gemm.json\n"
               "  moefq bench gemm --weights bf16 --hidden 4096 --inter 1536 --experts 16 --tokens 4096");
  actions->push_back({gemm, &go->json, [go] {
    return go->weights == "bf16" ? bench::run_bench_gemm_bf16(*go) : bench::run_bench_gemm(*go);
  }});

  auto co = std::make_shared<bench::CombineBenchOptions>();
  CLI::App* comb = bench->add_subcommand(
      "combine", "Combine kernels on [K][T][H] bf16 rows (plain combine, and the combine quantizer's QDQ + re-sum with "
                 "and without its layout check): time, GB/s and the ratio to a device-to-device copy.");
  comb->add_option("--tokens", co->tokens, "T = num_tokens (default 4096)")->check(rows_range());
  comb->add_option("--top-k", co->top_k, "K (default 8)")->check(CLI::Range(1, 32));
  comb->add_option("--hidden", co->hidden, "H, a multiple of 128 (default 7168)")->check(block_multiple(kMaxHidden));
  comb->add_option("--formats", co->formats,
                   "combine (the plain combine) or any of " + format_choices() + "; default: combine and every format");
  comb->add_option("--combine-weighting", co->combine_weighting,
                   "before (default: the rows are already weighted) or after (the kernels weight each routed row)");
  comb->add_option("--reps", co->reps, "timed graph replays; the median is reported" + default_is(co->reps))
      ->check(CLI::Range(1, 10000));
  comb->add_option("--launches", co->launches_per_graph, "launches captured per graph" + default_is(co->launches_per_graph))
      ->check(CLI::Range(1, 1000));
  comb->add_option("--json", co->json, "also write the results as JSON to this file");
  comb->footer("Example:\n  moefq bench combine --formats combine fp8 nvfp4 --json bench_combine.json");
  actions->push_back({comb, &co->json, [co] { return bench::run_bench_combine(*co); }});

  return [actions] {
    for (const BenchCase& c : *actions) {
      if (!c.cmd->parsed()) continue;
      // The same rules as every output, before any work: an empty path is an error, not "no file".
      if (c.cmd->get_option("--json")->count() > 0) check_output_path(*c.json, "--json");
      const int status = c.action();
      finish_stdout();
      return status;
    }
    return 0;
  };
}

}  // namespace moefq::cli
