// moefq eval and moefq calibrate: the main job. eval calibrates (or loads a calibration), runs every
// recipe of the sweep on held-out batches and prints the error metrics per recipe, best first;
// --out writes report.json, report.csv and report.html. calibrate saves the amax state that
// eval --load-calibration reuses. The pipeline is in src/eval, the report writers in src/report.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "cli/commands.h"
#include "cli/eval_table.h"
#include "cli/table.h"
#include "tool/device_choice.h"
#include "moefq/checkpoint.h"
#include "moefq/errors.h"
#include "moefq/eval.h"
#include "moefq/fileio.h"
#include "moefq/moe_config.h"
#include "moefq/report.h"
#ifdef MOEFQ_HAS_CUDA
#include "moefq/cuda.h"
#include "eval/layer_runner.h"
#endif

namespace moefq::cli {
namespace {

namespace fs = std::filesystem;

struct EvalCliOptions {
  EvalOptions eval;
  std::string layers, device = "auto", out, save, synthetic = "model", pipeline, combine_weighting;
  std::string staging, calibration;
  int64_t seed = 1;  // parsed signed so that a negative seed is an error, not a wrapped value
  double max_rel_l2 = 0;
  bool wide = false;  // eval: every column of the rows in the terminal table
};

// The options both commands share: the model, its data and the device.
void add_model_options(CLI::App* sub, EvalCliOptions& o) {
  std::string presets, model_types;
  for (const std::string& n : preset_names()) presets += (presets.empty() ? "" : ", ") + n;
  for (const std::string& t : hf_model_types()) model_types += (model_types.empty() ? "" : ", ") + t;
  sub->add_option("--preset", o.eval.preset, "model preset (default tiny): " + presets);
  sub->add_option("--config", o.eval.config_path,
                  "a Hugging Face config.json (model_type " + model_types + "); synthetic weights");
  sub->add_option("--checkpoint", o.eval.checkpoint_dir,
                  "a Hugging Face checkpoint directory (config.json and safetensors shards; e4m3 with block scales, "
                  "or bf16 with --device cpu); needs --layers");
  sub->add_option("--layers", o.layers,
                  "layers to evaluate: 4, 3-10, 3,5,7 or 1-2,6 (default 0; required with --checkpoint)");
  sub->add_option("--activations", o.eval.activations_path,
                  "hidden states captured from a real model: a safetensors file with a [tokens, H] BF16/F32 tensor "
                  "'layers.{i}' per layer, or one 'hidden_states' used for every layer (default: synthetic)");
  sub->add_option("--synthetic", o.synthetic,
                  "synthetic data: model (default: shaped like a real model's, see docs/eval.md) or gaussian "
                  "(plain N(0, 1) activations and N(0, 0.02) weights)");
  sub->add_option("--ranks", o.eval.ranks, "simulated expert-parallel ranks, must divide the expert count (default 4)")
      ->check(CLI::Range(1, 4096));
  sub->add_option("--tokens", o.eval.tokens, "tokens per rank per batch (default 256)")->check(CLI::Range(1, 1 << 20));
  sub->add_option("--calib-batches", o.eval.calib_batches, "calibration batches (default 2)")->check(CLI::Range(1, 100000));
  sub->add_option("--calibration", o.calibration,
                  "how the calibrated amax is chosen: max (default), percentile (99.99), percentile:P, or mse (the "
                  "amax minimizing the QDQ error; nvfp4's on a sample of the calibration rows); eval takes a "
                  "comma-separated list and evaluates each recipe once per method (default: each recipe's own "
                  "algorithm)");
  sub->add_option("--seed", o.seed, "seed of the synthetic weights and activations (default 1)")
      ->check(seed_range());
  sub->add_option("--device", o.device, "auto | cpu | cuda (default auto: cuda when a GPU is visible)");
  sub->add_option("--threads", o.eval.num_threads, "CPU engine threads (default 0: all)")->check(CLI::Range(0, 1024));
  sub->add_option("--combine-weighting", o.combine_weighting,
                  "where the layer applies the router weight: before (default: the combine rows are weighted) or "
                  "after (the combine weights the unweighted rows, after their QDQ); default: the recipes' own");
  sub->add_option("--staging", o.staging,
                  "the activations into the expert GEMMs, i.e. the baseline: e4m3 (1x128 scales, the FP8 Mega-MoE "
                  "engine) or none (bf16, as a bf16 model is served); default: as the model is served (e4m3 for "
                  "e4m3 checkpoints and DeepSeek-V3/V4, Kimi; none for bf16 checkpoints, Qwen3, Mixtral, OLMoE, GLM)");
  // Removed (one runner per device): kept hidden so that an old script gets resolve()'s message.
  sub->add_option("--pipeline", o.pipeline)->group("");
}

// Resolves --device, --layers and the preset flag into the library options.
void resolve(EvalCliOptions& o, const CLI::App* sub) {
  MOEFQ_CHECK(sub->get_option("--pipeline")->count() == 0, "--pipeline ", o.pipeline, ": the option was removed; "
              "the device runner gives the same bits the host pipeline gave (--device cuda runs it, --device cpu "
              "runs the CPU engine): drop --pipeline");
  o.eval.preset_given = sub->get_option("--preset")->count() > 0;
  o.eval.seed = uint64_t(o.seed);
  const auto kind = parse_synthetic_kind(o.synthetic);
  MOEFQ_CHECK(kind.has_value(), "--synthetic: unknown kind '", o.synthetic, "' (expected model or gaussian)");
  o.eval.synthetic = *kind;
  if (sub->get_option_no_throw("--max-rel-l2") && sub->get_option("--max-rel-l2")->count() > 0)
    o.eval.max_rel_l2 = o.max_rel_l2;
  if (!o.layers.empty() || sub->get_option("--layers")->count() > 0) o.eval.layers = parse_layers(o.layers);
  if (sub->get_option("--calibration")->count() > 0)
    o.eval.calibration = parse_calibration_methods(o.calibration, "--calibration");
  if (sub->get_option("--combine-weighting")->count() > 0)
    o.eval.combine_weighting = combine_weighting_option(o.combine_weighting, "--combine-weighting");
  if (sub->get_option("--staging")->count() > 0) o.eval.staging = staging_from_name(o.staging, "--staging");
#ifdef MOEFQ_HAS_CUDA
  // The GPU runner and its memory query, for a CPU run too: the plan of a refused CPU run asks the
  // GPU's free memory (only then) to say whether --device cuda would fit.
  register_cuda_layer_runner();
#endif
  const bool cuda = tool::use_cuda(o.device);
  if (cuda) {
#ifdef MOEFQ_HAS_CUDA
    o.eval.device = EvalDevice::kCuda;
    o.eval.device_name = cuda::device_description();
#endif
  } else {
    o.eval.device = EvalDevice::kCpu;
    o.eval.device_name = tool::cpu_device_name(o.eval.num_threads);
  }
  o.eval.progress = [](const std::string& line) { std::fprintf(stderr, "  %s\n", terminal_safe(line).c_str()); };
}

// The inputs an output must not replace: the files named on the command line and every file of
// the checkpoint (its config.json, index and shards, or its one model.safetensors). A recipe given
// by unit name is no path here, and is skipped by the checks as a path that does not exist.
std::vector<NamedPath> inputs_of(const EvalCliOptions& o) {
  std::vector<NamedPath> in = {{"--config", o.eval.config_path},
                               {"--activations", o.eval.activations_path},
                               {"--load-calibration", o.eval.load_calibration}};
  for (const std::string& r : o.eval.recipes) in.push_back({"--recipe", r});
  if (!o.eval.checkpoint_dir.empty()) {
    in.push_back({"--checkpoint's config.json", (fs::path(o.eval.checkpoint_dir) / "config.json").string()});
    // A checkpoint that cannot be read is refused by the run, with the options checked first and
    // before anything is written: here it simply has no files to protect.
    try {
      for (const std::string& f : checkpoint_files(o.eval.checkpoint_dir)) in.push_back({"a --checkpoint file", f});
    } catch (const Error&) {
    }
  }
  return in;
}

std::string layer_list(const std::vector<int64_t>& layers) {
  std::string s;
  for (int64_t l : layers) {
    if (!s.empty()) s += ',';
    s += std::to_string(l);
  }
  return s;
}

void print_header(const char* tool, const EvalSetup& s) {
  const std::string evals = s.eval_batches > 0 ? " + " + std::to_string(s.eval_batches) + " evaluation" : "";
  std::printf("%s: %s, %s %s, %lld ranks x %lld tokens, %d calibration%s batches, seed %llu\n", tool,
              terminal_safe(s.model_source).c_str(), s.layers.size() == 1 ? "layer" : "layers", layer_list(s.layers).c_str(),
              (long long)s.ranks, (long long)s.tokens, s.calib_batches, evals.c_str(), (unsigned long long)s.seed);
  std::printf("weights: %s\nactivations: %s\ndevice: %s; router weight applied %s the combine\n",
              terminal_safe(s.weights_source).c_str(), terminal_safe(s.activations_source).c_str(), s.device.c_str(),
              combine_weighting_name(s.combine_weighting));
  std::printf("baseline: staging %s, %s\n", staging_name(s.staging), staging_baseline(s.staging));
  if (s.link.enabled())
    std::printf("link: %s, %lld ranks x %lld tokens per batch (transfer times: docs/eval.md)\n",
                s.link.describe().c_str(), (long long)s.ranks, (long long)s.tokens);
}

int run_eval_command(EvalCliOptions& o, const CLI::App* sub) {
  resolve(o, sub);
  const bool want_reports = sub->get_option("--out")->count() > 0;  // an empty --out is an error, not "no reports"
  if (want_reports) check_output_dir(o.out, "--out", kEvalReportFiles, inputs_of(o));
  std::fprintf(stderr, "moefq eval: running (progress below; the table follows on stdout)\n");
  const EvalResult r = run_eval(o.eval);
  // The reports first: a reader that closes stdout early (`| head`) loses only the table.
  if (want_reports) {
    write_eval_reports(r, o.out);
    std::fprintf(stderr, "moefq eval: wrote %s/report.json, report.csv, report.html\n", o.out.c_str());
  }
  print_header("moefq eval", r.setup);
  std::printf("calibration: %s\n\n", terminal_safe(r.calibration.source).c_str());
  for (const std::string& line : eval_table_lines(r, o.wide)) std::printf("%s\n", line.c_str());
  for (const std::string& line : eval_footer_lines(r, o.wide)) std::printf("%s\n", line.c_str());
  for (const std::string& w : r.warnings) std::fprintf(stderr, "moefq eval: warning: %s\n", terminal_safe(w, true).c_str());
  finish_stdout();
  return 0;
}

int run_calibrate_command(EvalCliOptions& o, const CLI::App* sub) {
  resolve(o, sub);
  check_output_path(o.save, "--save", inputs_of(o));
  std::fprintf(stderr, "moefq calibrate: running\n");
  EvalSetup setup;
  const CalibrationState state = run_calibration(o.eval, &setup);
  save_eval_calibration(o.save, state, setup);
  print_header("moefq calibrate", setup);
  std::printf("\n");
  Table t({"layer", "dispatch_amax", "combine_amax", "dispatch_rank_amax", "combine_rank_amax"});
  const auto list = [](const std::vector<float>& v) {
    std::string s;
    for (float x : v) {
      if (!s.empty()) s += ',';
      s += fmt_num(x, 6);
    }
    return s;
  };
  for (const LayerCalibration& c : state.layers)
    t.add({std::to_string(c.layer), fmt_num(c.dispatch_amax, 6), fmt_num(c.combine_amax, 6), list(c.dispatch_rank_amax),
           list(c.combine_rank_amax)});
  t.print();
  std::printf("\nsaved to %s (use: moefq eval --load-calibration %s with the same model options)\n", o.save.c_str(),
              o.save.c_str());
  finish_stdout();
  return 0;
}

}  // namespace

std::function<int()> add_eval_command(CLI::App& app) {
  auto o = std::make_shared<EvalCliOptions>();
  CLI::App* sub = app.add_subcommand(
      "eval", "The main job: which dispatch/combine formats can a MoE model afford? Calibrates once per layer, "
              "evaluates every recipe on held-out batches against the unquantized layer and prints the error "
              "metrics per recipe, best first. Without arguments: the tiny preset, synthetic weights and "
              "activations, 4 ranks, the default sweep of 13 recipes.");
  add_model_options(sub, *o);
  sub->add_option("--eval-batches", o->eval.eval_batches, "held-out evaluation batches (default 2)")
      ->check(CLI::Range(1, 100000));
  sub->add_option("--recipe", o->eval.recipes,
                  "a recipe file or unit name (repeatable), or none (the unquantized layer); replaces the default "
                  "sweep (none + fp8, nvfp4, mxfp8, mxfp4 for dispatch, combine and both)");
  sub->add_option("--sweep", o->eval.sweep,
                  "without --recipe, which recipes run: default (the 13 above) or peers (none + each expert-parallel "
                  "system's dispatch and combine as it computes them, with its router-weight placement: DeepEP, "
                  "DeepGEMM and its SGLang fork, MoRI, vLLM, FlashInfer; recipes/configs/ptq/presets/peers)");
  sub->add_option("--link", o->eval.link,
                  "turn the wire bytes into dispatch/combine transfer time per batch on this link: " + link_choices() +
                      " (bandwidths and latencies in docs/eval.md)");
  sub->add_option("--link-gbps", o->eval.link_gbps,
                  "the same on a link of this many gigabits per second per GPU, one direction (no latency)")
      ->check(positive_number());
  sub->add_option("--recipe-root", o->eval.recipe_root,
                  "the directory holding configs/ that recipe imports (configs/numerics/nvfp4, ...) are looked up "
                  "in first (then the recipe file's own tree, then the shipped recipes)")->check(CLI::ExistingDirectory);
  sub->add_option("--load-calibration", o->eval.load_calibration,
                  "reuse the amax saved by 'moefq calibrate --save' instead of calibrating");
  sub->add_option("--out", o->out, "write report.json, report.csv and report.html into this directory");
  sub->add_option("--max-rel-l2", o->max_rel_l2,
                  "an accuracy budget: rows whose rel_l2 exceeds it are marked, and the answer names the recipe with "
                  "the fewest wire bytes within it on every layer")
      ->check(positive_number());
  sub->add_flag("--wide", o->wide,
                "print every column of the rows in the table (adds " + join(eval_wide_only_columns(), ", ") +
                    "); the default table keeps those that say what each recipe costs and saves");
  sub->footer(
      "Examples:\n"
      "  moefq eval                                    # the built-in default (tiny preset, 13 recipes)\n"
      "  moefq eval --out report                       # also report/report.{json,csv,html}\n"
      "  moefq eval --checkpoint /models/DeepSeek-V3 --layers 3-10 --activations acts.safetensors \\\n"
      "             --recipe moe_combine_nvfp4 --recipe my_recipe.yaml --device cuda --out report\n"
      "  moefq calibrate --save calib.json && moefq eval --load-calibration calib.json\n"
      "  moefq eval --preset deepseek-v3 --ranks 8 --device cuda --max-rel-l2 0.05\n"
      "  moefq eval --sweep peers --out report                 # every peer's wire formats side by side\n"
      "  moefq eval --calibration max,percentile:99.99,mse --link ib400\n"
      "Formats (a recipe's num_bits): " + format_choices() + " (docs/numerics.md; the peers' formats "
      "after logfmt10).\n"
      "Exit status: 0 success, 1 a failed check (a layout mismatch), 2 bad input (nothing is written then).");
  return [sub, o]() { return sub->parsed() ? run_eval_command(*o, sub) : 0; };
}

std::function<int()> add_calibrate_command(CLI::App& app) {
  auto c = std::make_shared<EvalCliOptions>();
  CLI::App* cal = app.add_subcommand(
      "calibrate", "Max calibration of the dispatch and combine quantizers of each layer (the amax does not depend "
                   "on the recipe); saves the amax state that 'moefq eval --load-calibration' reuses.");
  add_model_options(cal, *c);
  cal->add_option("--save", c->save, "write the calibration (JSON) to this file")->required();
  cal->footer(
      "Examples:\n"
      "  moefq calibrate --save calib.json\n"
      "  moefq calibrate --checkpoint /models/DeepSeek-V3 --layers 3-10 --activations acts.safetensors --save calib.json\n"
      "  moefq eval --load-calibration calib.json      # same model options: the same numbers as one eval\n"
      "Exit status: 0 success, 1 a failed check (a layout mismatch), 2 bad input (nothing is written then).");
  return [cal, c]() { return cal->parsed() ? run_calibrate_command(*c, cal) : 0; };
}

}  // namespace moefq::cli
