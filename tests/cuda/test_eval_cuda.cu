// The device-resident evaluation (one runner per device on the GPU) against the layer facade driven
// from the host on the same engine (FakeQuantMoe::make(LayerDevice::kCuda): the same weights, the
// CPU router, so the calibrated amax bit for bit), against itself (a second run gives every figure
// bit for bit), and against the CPU engine (everything before the expert GEMMs identical: routing,
// the dispatch amax and statistics; the rest within the GEMM tolerance). And the memory plan
// refusing a run that does not fit the GPU, before any allocation.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>

#include <filesystem>
#include <fstream>

#include "checkpoint_test_util.h"
#include "cli/cli_test_util.h"
#include "cuda_base/cuda_check.h"
#include "cuda_base/device_buffer.h"
#include "engine/cuda/cuda_engine.cuh"
#include "fakequant/cuda/cuda_fake_quant.cuh"
#include "moefq/calibration_stats.h"
#include "moefq/cuda.h"
#include "moefq/wire_bytes.h"
#include "eval/layer_runner.h"
#include "gpu_test.h"
#include "moefq/errors.h"
#include "moefq/eval.h"
#include "moefq/fake_quant_moe.h"
#include "moefq/moe_config.h"
#include "moefq/router.h"
#include "moefq/safetensors.h"
#include "moefq/synthetic.h"

namespace moefq {
namespace {

EvalOptions small_run(EvalDevice device) {
  cuda::register_cuda_backends();
  register_cuda_layer_runner();
  EvalOptions o;
  o.preset = "tiny";
  o.ranks = 4;
  o.tokens = 64;
  o.calib_batches = 1;
  o.eval_batches = 1;
  o.layers = {0, 3};  // an early layer (super experts) and a middle one
  o.device = device;
  return o;
}

bool close(double a, double b, double rel) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return std::fabs(a - b) <= rel * std::max(std::fabs(a), std::fabs(b));
}

const EvalRow& row_of(const EvalResult& r, int64_t layer, const std::string& recipe) {
  for (const EvalRow& row : r.rows)
    if (row.layer == layer && row.recipe == recipe) return row;
  throw std::runtime_error("no row " + recipe);
}

// Every row of two device-resident runs: the same figures, bit for bit.
void expect_same_rows(const EvalResult& a_run, const EvalResult& b_run) {
  ASSERT_EQ(a_run.rows.size(), b_run.rows.size());
  for (const EvalRow& a : a_run.rows) {
    SCOPED_TRACE("layer " + std::to_string(a.layer) + " " + a.recipe);
    const EvalRow& b = row_of(b_run, a.layer, a.recipe);
    EXPECT_EQ(a.metrics.rel_l2, b.metrics.rel_l2);
    EXPECT_EQ(a.metrics.cosine, b.metrics.cosine);
    EXPECT_EQ(a.metrics.calc_diff, b.metrics.calc_diff);
    EXPECT_EQ(a.metrics.max_abs, b.metrics.max_abs);
    EXPECT_EQ(a.metrics.snr_db, b.metrics.snr_db);
    EXPECT_EQ(a.metrics.count, b.metrics.count);
    EXPECT_EQ(a.rel_l2_token_p50, b.rel_l2_token_p50);
    EXPECT_EQ(a.rel_l2_token_p99, b.rel_l2_token_p99);
    EXPECT_EQ(a.rel_l2_token_max, b.rel_l2_token_max);
    EXPECT_EQ(a.rel_l2_non_outlier, b.rel_l2_non_outlier);
    EXPECT_EQ(a.num_outlier_channels, b.num_outlier_channels);
    EXPECT_EQ(a.dispatch_clipped_fraction, b.dispatch_clipped_fraction);
    EXPECT_EQ(a.combine_clipped_fraction, b.combine_clipped_fraction);
    EXPECT_EQ(a.dispatch_amax, b.dispatch_amax);
    EXPECT_EQ(a.combine_amax, b.combine_amax);
    EXPECT_EQ(a.layout_check, b.layout_check);
  }
}

// The calibration of every layer of a device-resident run equals the layer facade's on the same
// engine driven from the host: every rank's weights and the layer's activations made or read on
// the host (rank_weights, layer_activations), routed by the CPU router, uploaded, one forward per
// calibration batch. The GPU generates the synthetic weights and activations and routes by itself:
// the same bits, or the amax would differ. Where the run kept statistics, the histograms and
// logfmt10's cast groups are recomputed on the host as the CPU runner's observer does, from what
// each quantizer saw on the same engine (the tokens with an active slot, the engine's active
// combine rows), and must equal the device's bit for bit.
void expect_calibration_equals_the_facade(const EvalOptions& o, const EvalResult& dev) {
  RunnerSetup s;
  s.config = dev.setup.config;
  s.ranks = o.ranks;
  s.tokens = o.tokens;
  s.calib_batches = o.calib_batches;
  s.seed = o.seed;
  s.synthetic = o.synthetic;
  s.checkpoint_dir = o.checkpoint_dir;
  std::optional<SafetensorsFile> acts;
  if (!o.activations_path.empty()) {
    acts.emplace(SafetensorsFile::open(o.activations_path));
    s.acts = &*acts;
    for (int64_t l : dev.setup.layers) s.act_tensor[l] = acts->find("layers." + std::to_string(l)) ? "layers." + std::to_string(l) : "hidden_states";
  }
  const int64_t R = s.ranks, T = s.tokens, H = s.config.hidden, K = s.config.top_k;
  EngineOptions eo;
  eo.fuse_shared = false;
  eo.combine_weighting = dev.setup.combine_weighting;
  eo.staging = dev.setup.staging;
  ASSERT_EQ(dev.calibration.layers.size(), dev.setup.layers.size());
  for (size_t l = 0; l < dev.setup.layers.size(); ++l) {
    const int64_t layer = dev.setup.layers[l];
    SCOPED_TRACE("layer " + std::to_string(layer));
    const LayerCalibration& a = dev.calibration.layers[l];
    const bool stats = a.dispatch_hist != nullptr;
    std::vector<LayerWeights> w = all_rank_weights(s, layer);
    const std::vector<float> gate = w[0].gate, bias = w[0].gate_bias;
    // The CUDA face (its engine's combine rows, for the statistics) of the one layer facade.
    cuda::CudaFakeQuantMoe layer_face(std::make_unique<cuda::CudaEngine>(s.config, R, T, w, eo), layer);
    FakeQuantMoe& fq = layer_face.layer();
    const std::vector<bf16> x = layer_activations(s, layer, 0, int64_t(s.calib_batches) * R * T);
    cuda::DeviceBuffer<bf16> dx(x), dy(size_t(R * T * H));
    std::vector<cuda::DeviceBuffer<int32_t>> idx;
    std::vector<cuda::DeviceBuffer<float>> wts;
    AbsHistogram hist[2];
    CastGroups cast[2];
    const auto observe = [&](int which, const bf16* row) {
      hist[which].add(row, H);
      cast[which].merge(logfmt10_cast_groups(row, 1, H));
    };
    // As the evaluation calibrates: both quantizers on (fp8, calibrated amax), no QDQ meanwhile.
    QuantizerConfig on;
    on.enable = true;
    on.configured = true;
    fq.configure({{FakeQuantMoe::dispatch_name(layer), on}, {FakeQuantMoe::combine_name(layer), on}});
    fq.start_calibration();
    for (int b = 0; b < s.calib_batches; ++b) {
      std::vector<RankBatch> batches;
      std::vector<Routing> routing;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t first = (int64_t(b) * R + r) * T;
        const Routing& rt = routing.emplace_back(route(s.config, x.data() + first * H, T, gate, bias));
        idx.emplace_back(rt.topk_idx);
        wts.emplace_back(rt.topk_weights);
        batches.push_back({dx.get() + first * H, T, idx.back().get(), wts.back().get(), dy.get() + r * T * H});
      }
      fq.forward(batches, nullptr);
      if (!stats) continue;
      for (int64_t r = 0; r < R; ++r) {
        cuda::CudaEngine& e = layer_face.engine();
        std::vector<bf16> rows(size_t(K * T * H));
        MOEFQ_CUDA_CHECK(cudaMemcpy(rows.data(), e.buffer(r) + layer_face.combine_offset(), rows.size() * 2,
                                    cudaMemcpyDeviceToHost));
        const std::vector<int32_t>& ids = routing[size_t(r)].topk_idx;
        for (int64_t t = 0; t < T; ++t) {
          bool active = false;
          for (int64_t k = 0; k < K; ++k) active = active || ids[size_t(t * K + k)] >= 0;
          if (active) observe(0, x.data() + ((int64_t(b) * R + r) * T + t) * H);
        }
        for (int64_t t = 0; t < T; ++t)
          for (int64_t k = 0; k < K; ++k)
            if (ids[size_t(t * K + k)] >= 0) observe(1, rows.data() + (k * T + t) * H);
      }
    }
    fq.finish_calibration();
    EXPECT_EQ(a.dispatch_amax, *fq.quantizers().dispatch(0).amax());
    EXPECT_EQ(a.combine_amax, *fq.quantizers().combine(0).amax());
    EXPECT_EQ(a.dispatch_rank_amax, fq.rank_amax(0));
    EXPECT_EQ(a.combine_rank_amax, fq.rank_amax(1));
    if (!stats) continue;
    for (int which = 0; which < 2; ++which) {
      SCOPED_TRACE(which == 0 ? "dispatch" : "combine");
      const AbsHistogram& got = which == 0 ? *a.dispatch_hist : *a.combine_hist;
      const CastGroups& got_cast = which == 0 ? a.dispatch_logfmt : a.combine_logfmt;
      EXPECT_GT(hist[which].total(), 0u);
      EXPECT_EQ(got.total(), hist[which].total());
      EXPECT_EQ(got.nonfinite(), hist[which].nonfinite());
      int64_t mismatches = 0, first = -1;
      for (int bin = 0; bin < AbsHistogram::kBins; ++bin)
        if (got.count(bin) != hist[which].count(bin) && mismatches++ == 0) first = bin;
      EXPECT_EQ(mismatches, 0) << "first at bin 0x" << std::hex << first;
      EXPECT_EQ(got_cast.cast, cast[which].cast);
      EXPECT_EQ(got_cast.total, cast[which].total);
    }
  }
}

TEST(EvalCuda, DeviceResidentEqualsTheLayerFacadeOnTheSameEngine) {
  SKIP_WITHOUT_GPU();
  const EvalOptions o = small_run(EvalDevice::kCuda);
  const EvalResult dev = run_eval(o);
  ASSERT_EQ(dev.calibration.layers.size(), 2u);
  expect_calibration_equals_the_facade(o, dev);
  expect_same_rows(dev, run_eval(o));
}

// The architectures beside DeepSeek-V3's: softmax routing with and without renormalisation, no
// shared expert (Qwen3-MoE, Mixtral with 8 experts and top 2, OLMoE), and GLM-4.5-Air's sigmoid
// routing with one group and a shared expert, at their presets' full sizes, one layer each.
TEST(EvalCuda, EveryArchitectureOnTheDeviceEqualsTheLayerFacade) {
  SKIP_WITHOUT_GPU();
  for (const char* name : {"qwen3-30b-a3b", "mixtral-8x7b", "olmoe-1b-7b", "glm-4.5-air"}) {
    SCOPED_TRACE(name);
    EvalOptions o = small_run(EvalDevice::kCuda);
    o.preset = name;
    o.preset_given = true;
    o.layers = {0};
    const EvalResult dev = run_eval(o);
    ASSERT_EQ(dev.calibration.layers.size(), 1u);
    expect_calibration_equals_the_facade(o, dev);
    expect_same_rows(dev, run_eval(o));
  }
}

// The device-resident run against the CPU engine's, with the preset's staging or the one given.
void expect_close_to_the_cpu_engine(std::optional<Staging> staging) {
  EvalOptions od = small_run(EvalDevice::kCuda), oc = small_run(EvalDevice::kCpu);
  od.staging = oc.staging = staging;
  const EvalResult dev = run_eval(od);
  const EvalResult cpu = run_eval(oc);
  EXPECT_EQ(dev.setup.staging, staging.value_or(Staging::kE4m3));
  EXPECT_EQ(cpu.setup.staging, dev.setup.staging);
  for (size_t l = 0; l < 2; ++l) {
    const LayerCalibration &a = dev.calibration.layers[l], &b = cpu.calibration.layers[l];
    // The dispatch amax is over the tokens: the same data, the same routing (which tokens are sent).
    EXPECT_EQ(a.dispatch_amax, b.dispatch_amax);
    EXPECT_EQ(a.dispatch_rank_amax, b.dispatch_rank_amax);
    // The combine amax is over the expert outputs: within the GEMMs' accumulation tolerance.
    EXPECT_TRUE(close(a.combine_amax, b.combine_amax, 2e-2)) << a.combine_amax << " vs " << b.combine_amax;
  }
  for (const EvalRow& a : dev.rows) {
    SCOPED_TRACE("layer " + std::to_string(a.layer) + " " + a.recipe);
    const EvalRow& b = row_of(cpu, a.layer, a.recipe);
    EXPECT_EQ(a.layout_check, b.layout_check);
    if (a.recipe == "none") {
      EXPECT_EQ(a.metrics.rel_l2, 0.0);
      EXPECT_EQ(b.metrics.rel_l2, 0.0);
      continue;
    }
    // The error of a recipe, measured on either engine's own reference: within 10% of each other
    // (the GEMMs' accumulation order moves both the reference and the quantized output).
    EXPECT_TRUE(close(a.metrics.rel_l2, b.metrics.rel_l2, 0.1)) << a.metrics.rel_l2 << " vs " << b.metrics.rel_l2;
    EXPECT_TRUE(close(a.rel_l2_token_p50, b.rel_l2_token_p50, 0.1));
  }
}

TEST(EvalCuda, DeviceResidentAgainstTheCpuEngine) {
  SKIP_WITHOUT_GPU();
  expect_close_to_the_cpu_engine(std::nullopt);  // tiny: e4m3 staging
}

// Staging none (bf16 activations, the preset's e4m3 weights used dequantized): the bf16 x e4m3
// GEMMs on the device against the CPU engine.
TEST(EvalCuda, StagingNoneDeviceResidentAgainstTheCpuEngine) {
  SKIP_WITHOUT_GPU();
  expect_close_to_the_cpu_engine(Staging::kNone);
}

// A checkpoint's layers, read on the host and copied through pinned staging buffers (the next one
// read ahead by a host thread), give the calibration of the layer facade on the same checkpoint,
// and the same figures in a second run.
TEST(EvalCuda, CheckpointLayersThroughPinnedStagingEqualTheLayerFacade) {
  SKIP_WITHOUT_GPU();
  const std::filesystem::path dir = test::unique_temp_path("moefq_ckpt_cuda_");
  test::write_checkpoint(dir, {{1, 7}, {2, 8}, {3, 9}});
  EvalOptions o = small_run(EvalDevice::kCuda);
  o.preset = "tiny";
  o.checkpoint_dir = dir.string();
  o.layers = {1, 2, 3};
  o.ranks = 2;
  o.tokens = 32;
  const EvalResult dev = run_eval(o);
  EXPECT_TRUE(dev.memory.streaming) << dev.memory.describe();
  expect_calibration_equals_the_facade(o, dev);
  expect_same_rows(dev, run_eval(o));
  std::filesystem::remove_all(dir);
}

// A bf16 checkpoint (as Qwen3-MoE, Mixtral, OLMoE and GLM-4.5 ship their experts) evaluated on the
// GPU, device-resident, under `staging`: bf16 weight sets filled through the pinned staging
// buffers. Against the layer facade on the same CUDA engine driven from the host (the same weights
// and kernels): the calibration bit for bit; against a second run: every figure; against the CPU
// engine: the routing and the dispatch amax
// identical, the rest within the GEMM tolerance of expect_close_to_the_cpu_engine.
void expect_bf16_checkpoint_on_the_device(Staging staging) {
  const std::filesystem::path dir = test::unique_temp_path("moefq_ckpt_bf16_cuda_");
  test::write_checkpoint(dir, {{1, 7}, {2, 8}}, WeightFormat::kBf16);
  const auto options = [&](EvalDevice device) {
    EvalOptions o = small_run(device);
    o.checkpoint_dir = dir.string();
    o.layers = {1, 2};
    o.ranks = 2;
    o.tokens = 32;
    o.staging = staging;
    return o;
  };
  const auto run = [&](EvalDevice device) { return run_eval(options(device)); };
  const EvalResult dev = run(EvalDevice::kCuda);
  const EvalResult same = run(EvalDevice::kCuda);  // a second run: every figure bit for bit
  const EvalResult cpu = run(EvalDevice::kCpu);
  expect_calibration_equals_the_facade(options(EvalDevice::kCuda), dev);
  EXPECT_NE(dev.setup.weights_source.find("(bf16)"), std::string::npos) << dev.setup.weights_source;
  EXPECT_EQ(dev.setup.staging, staging);
  EXPECT_NE(dev.memory.describe().find("expert weights (bf16"), std::string::npos) << dev.memory.describe();
  ASSERT_EQ(dev.calibration.layers.size(), 2u);
  ASSERT_EQ(cpu.calibration.layers.size(), 2u);
  for (size_t l = 0; l < 2; ++l) {
    const LayerCalibration &a = dev.calibration.layers[l], &b = same.calibration.layers[l], &c = cpu.calibration.layers[l];
    EXPECT_EQ(a.dispatch_amax, b.dispatch_amax);
    EXPECT_EQ(a.combine_amax, b.combine_amax);
    EXPECT_EQ(a.dispatch_amax, c.dispatch_amax);
    EXPECT_EQ(a.dispatch_rank_amax, c.dispatch_rank_amax);
    EXPECT_TRUE(close(a.combine_amax, c.combine_amax, 2e-2)) << a.combine_amax << " vs " << c.combine_amax;
  }
  expect_same_rows(dev, same);
  ASSERT_EQ(dev.rows.size(), cpu.rows.size());
  for (const EvalRow& a : dev.rows) {
    SCOPED_TRACE("layer " + std::to_string(a.layer) + " " + a.recipe);
    const EvalRow& c = row_of(cpu, a.layer, a.recipe);
    EXPECT_EQ(a.layout_check, c.layout_check);
    if (a.recipe == "none") {
      EXPECT_EQ(a.metrics.rel_l2, 0.0);
      continue;
    }
    EXPECT_GT(a.metrics.rel_l2, 0.0);  // a recipe that quantizes changes the output
    EXPECT_TRUE(close(a.metrics.rel_l2, c.metrics.rel_l2, 0.1)) << a.metrics.rel_l2 << " vs " << c.metrics.rel_l2;
    EXPECT_TRUE(close(a.rel_l2_token_p50, c.rel_l2_token_p50, 0.1));
  }
  std::filesystem::remove_all(dir);
}

// Staging none, the default for a bf16 checkpoint: bf16 x bf16 GEMMs.
TEST(EvalCuda, Bf16CheckpointStagingNoneOnTheDevice) {
  SKIP_WITHOUT_GPU();
  expect_bf16_checkpoint_on_the_device(Staging::kNone);
}

// The FP8 Mega-MoE staging over bf16 weights: e4m3 activations x bf16 weights.
TEST(EvalCuda, Bf16CheckpointStagingE4m3OnTheDevice) {
  SKIP_WITHOUT_GPU();
  expect_bf16_checkpoint_on_the_device(Staging::kE4m3);
}

// An MXFP4 checkpoint on the GPU: decoded to bf16 on the host at load and copied in as bf16 weight
// sets, under either staging it gives exactly what the bf16 checkpoint of its decoded values gives
// there (the decode is exact: the same weights, the same engine); its calibration is the layer
// facade's on the same CUDA engine driven from the host, and a second run gives every figure.
TEST(EvalCuda, Mxfp4CheckpointOnTheDeviceEqualsItsDecodedBf16) {
  SKIP_WITHOUT_GPU();
  const std::filesystem::path mx = test::unique_temp_path("moefq_ckpt_mxfp4_cuda_"),
                              bf = test::unique_temp_path("moefq_ckpt_mxfp4_bf16_cuda_");
  const MoeConfig cfg = test::small_config();
  LayerWeights decoded;
  for (const std::filesystem::path& d : {mx, bf}) {
    std::filesystem::create_directories(d);
    std::ofstream(d / "config.json") << test::kSmallConfigJson;
  }
  test::mxfp4_checkpoint(cfg, 21, 1, decoded).write(mx.string());
  test::FakeCheckpoint::from(cfg, decoded, false, test::TensorNaming::mlp(), 1).write(bf.string());
  for (const Staging staging : {Staging::kNone, Staging::kE4m3}) {
    SCOPED_TRACE(staging_name(staging));
    const auto options = [&](const std::filesystem::path& dir) {
      EvalOptions o = small_run(EvalDevice::kCuda);
      o.checkpoint_dir = dir.string();
      o.layers = {1};
      o.ranks = 2;
      o.tokens = 32;
      o.staging = staging;
      return o;
    };
    const EvalResult a = run_eval(options(mx)), b = run_eval(options(bf)), again = run_eval(options(mx));
    expect_calibration_equals_the_facade(options(mx), a);
    EXPECT_NE(a.setup.weights_source.find("(mxfp4, decoded to bf16 at load)"), std::string::npos)
        << a.setup.weights_source;
    ASSERT_EQ(a.rows.size(), b.rows.size());
    for (size_t i = 0; i < a.rows.size(); ++i) {
      SCOPED_TRACE(a.rows[i].recipe);
      EXPECT_EQ(a.rows[i].metrics.rel_l2, b.rows[i].metrics.rel_l2);
      EXPECT_EQ(a.rows[i].metrics.max_abs, b.rows[i].metrics.max_abs);
      EXPECT_EQ(a.rows[i].combine_amax, b.rows[i].combine_amax);
      EXPECT_EQ(a.rows[i].dispatch_amax, b.rows[i].dispatch_amax);
    }
    expect_same_rows(a, again);
  }
  std::filesystem::remove_all(mx);
  std::filesystem::remove_all(bf);
}

// A DeepSeek-V4 checkpoint under its own names (MXFP4 routed experts, e4m3 shared expert, both held
// as bf16) on the GPU with its default staging (e4m3): the device-resident run's calibration equals
// the layer facade's on the same CUDA engine driven from the host, and a second run gives every
// figure.
TEST(EvalCuda, DeepseekV4OwnCheckpointOnTheDevice) {
  SKIP_WITHOUT_GPU();
  const std::filesystem::path dir = test::unique_temp_path("moefq_ckpt_v4_cuda_");
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << test::kSmallDeepseekV4ConfigJson;
  const MoeConfig cfg = load_hf_config((dir / "config.json").string());
  LayerWeights decoded;
  test::deepseek_v4_checkpoint(cfg, 8, 3, decoded).write(dir.string());
  EvalOptions o = small_run(EvalDevice::kCuda);
  o.checkpoint_dir = dir.string();
  o.layers = {3};
  o.ranks = 2;
  o.tokens = 32;
  const EvalResult dev = run_eval(o), again = run_eval(o);
  expect_calibration_equals_the_facade(o, dev);
  EXPECT_EQ(dev.setup.staging, Staging::kE4m3);
  EXPECT_NE(dev.setup.weights_source.find("(mxfp4, decoded to bf16 at load)"), std::string::npos)
      << dev.setup.weights_source;
  expect_same_rows(dev, again);
  std::filesystem::remove_all(dir);
}

// A checkpoint layer read for the GPU on the calling thread tells its progress like the host
// runner's: the experts read so far of the 2 ranks x (4 routed + the shared one).
TEST(EvalCuda, CheckpointReadTellsTheExpertsRead) {
  SKIP_WITHOUT_GPU();
  const std::filesystem::path dir = test::unique_temp_path("moefq_ckpt_cuda_");
  test::write_checkpoint(dir, {{1, 7}});
  EvalOptions o = small_run(EvalDevice::kCuda);
  o.checkpoint_dir = dir.string();
  o.layers = {1};
  o.ranks = 2;
  o.tokens = 32;
  o.recipes = {"moe_combine_fp8"};
  o.progress_every_seconds = 0;
  std::vector<std::string> lines;
  o.progress = [&](const std::string& l) { lines.push_back(l); };
  (void)run_eval(o);
  int told = 0;
  for (const std::string& l : lines) told += l.find("/10 experts' weights") != std::string::npos;
  EXPECT_EQ(told, 9) << "1..9 of 10 experts read (10 ends the load)";
  std::filesystem::remove_all(dir);
}

// The calibration statistics of two runs on the same rows: the histograms bin by bin, logfmt10's
// cast groups, nvfp4's block pairs (their error at several amax, bit for bit), and every derived
// amax with its clipped fraction and error. combine_too = false: the dispatch side only (the CPU
// engine's combine rows differ within the GEMM tolerance), with the combine side's totals.
void expect_same_statistics(const LayerCalibration& a, const LayerCalibration& b, bool combine_too) {
  ASSERT_TRUE(a.dispatch_hist && a.combine_hist && b.dispatch_hist && b.combine_hist);
  for (int which = 0; which < 2; ++which) {
    SCOPED_TRACE(which == 0 ? "dispatch" : "combine");
    const AbsHistogram &ha = which == 0 ? *a.dispatch_hist : *a.combine_hist, &hb = which == 0 ? *b.dispatch_hist : *b.combine_hist;
    const CastGroups &ga = which == 0 ? a.dispatch_logfmt : a.combine_logfmt, &gb = which == 0 ? b.dispatch_logfmt : b.combine_logfmt;
    const Nvfp4Blocks *na = which == 0 ? a.dispatch_nvfp4.get() : a.combine_nvfp4.get(),
                      *nb = which == 0 ? b.dispatch_nvfp4.get() : b.combine_nvfp4.get();
    ASSERT_EQ(na == nullptr, nb == nullptr);
    EXPECT_GT(ha.total(), 0u);
    EXPECT_EQ(ha.total(), hb.total());
    EXPECT_EQ(ha.nonfinite(), hb.nonfinite());
    EXPECT_EQ(ga.total, gb.total);
    if (na) EXPECT_EQ(na->num_rows(), nb->num_rows());
    if (which == 1 && !combine_too) continue;
    int64_t mismatches = 0, first = -1;
    for (int bin = 0; bin < AbsHistogram::kBins; ++bin)
      if (ha.count(bin) != hb.count(bin) && mismatches++ == 0) first = bin;
    EXPECT_EQ(mismatches, 0) << "first at bin 0x" << std::hex << first << std::dec << ": " << ha.count(int(first))
                             << " vs " << hb.count(int(first));
    EXPECT_EQ(ga.cast, gb.cast);
    if (na) {
      EXPECT_EQ(na->num_elements(), nb->num_elements());
      EXPECT_EQ(na->num_pairs(), nb->num_pairs());
      for (float amax : {1e-3f, 0.5f, 7.0f, ha.max(), 3 * ha.max()})
        EXPECT_EQ(na->qdq_squared_error(amax), nb->qdq_squared_error(amax)) << "amax " << amax;
    }
  }
  std::vector<const DerivedCalibration*> da, db;
  for (const DerivedCalibration& d : a.derived)
    if (combine_too || d.quantizer == "dispatch") da.push_back(&d);
  for (const DerivedCalibration& d : b.derived)
    if (combine_too || d.quantizer == "dispatch") db.push_back(&d);
  ASSERT_EQ(da.size(), db.size());
  for (size_t i = 0; i < da.size(); ++i) {
    SCOPED_TRACE(da[i]->quantizer + " " + da[i]->method + " " + da[i]->format);
    EXPECT_EQ(da[i]->quantizer, db[i]->quantizer);
    EXPECT_EQ(da[i]->method, db[i]->method);
    EXPECT_EQ(da[i]->format, db[i]->format);
    EXPECT_EQ(da[i]->amax.amax, db[i]->amax.amax);
    EXPECT_EQ(da[i]->amax.clipped_fraction, db[i]->amax.clipped_fraction);
    EXPECT_EQ(da[i]->amax.rel_error, db[i]->amax.rel_error);
  }
}

// Activations whose rows are scaled by 1, 2^-6 and 2^-12 (logfmt10 then casts some groups of the
// dispatch and not others), for every row small_run uses, written to a file the options name.
void use_scaled_activations(EvalOptions& o, const std::filesystem::path& file) {
  const int64_t H = 1024, N = int64_t(o.calib_batches + o.eval_batches) * o.ranks * o.tokens;  // tiny: H 1024
  const std::vector<float> raw = synthetic_activations(N, H, 11);
  std::vector<bf16> x(raw.size());
  for (int64_t i = 0; i < N * H; ++i)
    x[size_t(i)] = bf16{bf16_round(std::ldexp(raw[size_t(i)], -6 * int((i / H) % 3)))};
  SafetensorsWriter w;
  w.add("hidden_states", StDtype::kBF16, {N, H}, {reinterpret_cast<const uint8_t*>(x.data()), x.size() * 2});
  w.write(file.string());
  o.activations_path = file.string();
}

// Calibration beyond max on the device: the histograms accumulated there, logfmt10's cast groups
// counted there and nvfp4's sampled rows gathered there give what the host path on the same engine
// gives, bit for bit: every statistic, every derived amax (max, percentile, mse of fp8 and nvfp4),
// and every row, its cast fraction and wire bytes included. Then with a bound of 7 rows, so the
// device picks the sampled rows among many.
TEST(EvalCuda, CalibrationMethodsAndCastGroupsOnTheDeviceEqualTheLayerFacade) {
  SKIP_WITHOUT_GPU();
  const std::filesystem::path file = test::unique_temp_path("moefq_acts_cuda_");
  for (int64_t bound : {kNvfp4SampleElements, int64_t(7 * 1024)}) {
    SCOPED_TRACE("nvfp4 sample bound " + std::to_string(bound));
    EvalOptions o = small_run(EvalDevice::kCuda);
    o.calib_batches = 2;
    use_scaled_activations(o, file);
    o.recipes = {"moe_dispatch_fp8", "moe_combine_fp8", "moe_dispatch_nvfp4", "moe_combine_nvfp4",
                 "moe_combine_logfmt10"};
    o.calibration = parse_calibration_methods("max,percentile:99.9,mse", "--calibration");
    o.nvfp4_sample_elements = bound;
    const EvalResult dev = run_eval(o), again = run_eval(o);
    ASSERT_EQ(dev.calibration.layers.size(), 2u);
    // The amax, histograms and cast groups against the facade on the same engine driven from the
    // host; everything, the sampled nvfp4 blocks and derived amax included, against a second run.
    expect_calibration_equals_the_facade(o, dev);
    for (size_t l = 0; l < 2; ++l) {
      SCOPED_TRACE("layer " + std::to_string(dev.calibration.layers[l].layer));
      const LayerCalibration &a = dev.calibration.layers[l], &b = again.calibration.layers[l];
      EXPECT_EQ(a.dispatch_amax, b.dispatch_amax);
      EXPECT_EQ(a.combine_amax, b.combine_amax);
      expect_same_statistics(a, b, true);
      EXPECT_EQ(a.derived.size(), 2u * 3u + 2u * 3u);  // {dispatch, combine} x {fp8, nvfp4} x 3 methods
      EXPECT_GT(a.dispatch_logfmt.cast, 0u);
      EXPECT_LT(a.dispatch_logfmt.cast, a.dispatch_logfmt.total);
      if (bound < kNvfp4SampleElements) {
        EXPECT_LE(a.combine_nvfp4->num_rows(), 7u);
        EXPECT_GT(a.combine_nvfp4->num_rows(), 0u);
      } else {
        EXPECT_EQ(a.combine_nvfp4->num_elements(), a.combine_hist->total()) << "every row fits the sample";
      }
    }
    expect_same_rows(dev, again);
    for (const EvalRow& r : dev.rows) {
      SCOPED_TRACE("layer " + std::to_string(r.layer) + " " + r.recipe);
      const EvalRow& h = row_of(again, r.layer, r.recipe);
      EXPECT_EQ(r.calibration, h.calibration);
      EXPECT_EQ(r.dispatch_cast_fraction, h.dispatch_cast_fraction);
      EXPECT_EQ(r.combine_cast_fraction, h.combine_cast_fraction);
      EXPECT_EQ(r.dispatch_wire_bytes_per_token, h.dispatch_wire_bytes_per_token);
      EXPECT_EQ(r.combine_wire_bytes_per_token, h.combine_wire_bytes_per_token);
      if (r.recipe == "moe_combine_logfmt10") {
        EXPECT_TRUE(r.combine_cast_fraction.has_value()) << "the device run reports the cast fraction";
      }
    }
  }
  std::filesystem::remove_all(file);
}

// Against the CPU engine: the dispatch side sees the same tokens with the same routing, so its
// statistics and derived amax are the same bit for bit; the combine side's rows differ within the
// GEMM tolerance, but not their number.
TEST(EvalCuda, CalibrationStatisticsOnTheDeviceAgainstTheCpuEngine) {
  SKIP_WITHOUT_GPU();
  const std::filesystem::path file = test::unique_temp_path("moefq_acts_cuda_");
  const auto run = [&](EvalDevice device) {
    EvalOptions o = small_run(device);
    use_scaled_activations(o, file);
    o.recipes = {"moe_dispatch_fp8", "moe_dispatch_nvfp4", "moe_combine_logfmt10"};
    o.calibration = parse_calibration_methods("percentile:99.99,mse", "--calibration");
    o.nvfp4_sample_elements = 50 * 1024;
    return run_eval(o);
  };
  const EvalResult dev = run(EvalDevice::kCuda), cpu = run(EvalDevice::kCpu);
  ASSERT_EQ(dev.calibration.layers.size(), cpu.calibration.layers.size());
  for (size_t l = 0; l < dev.calibration.layers.size(); ++l) {
    SCOPED_TRACE("layer " + std::to_string(dev.calibration.layers[l].layer));
    expect_same_statistics(dev.calibration.layers[l], cpu.calibration.layers[l], false);
  }
  for (const EvalRow& r : dev.rows)
    if (r.dispatch_amax) {
      SCOPED_TRACE("layer " + std::to_string(r.layer) + " " + r.recipe);
      EXPECT_EQ(r.dispatch_amax, row_of(cpu, r.layer, r.recipe).dispatch_amax);
    }
  std::filesystem::remove_all(file);
}

TEST(EvalCuda, MemoryPlanRefusesARunThatDoesNotFit) {
  SKIP_WITHOUT_GPU();
  EvalOptions o = small_run(EvalDevice::kCuda);
  o.preset = "deepseek-v3";
  o.preset_given = true;
  o.ranks = 8;
  o.tokens = 1 << 17;  // 8 ranks x 131072 tokens: terabytes of buffers
  o.layers = {0};
  try {
    run_eval(o);
    ADD_FAILURE() << "not refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kBadInput);
    const std::string m = e.what();
    EXPECT_NE(m.find("GiB of GPU memory"), std::string::npos) << m;
    EXPECT_NE(m.find("memory plan"), std::string::npos) << m;
  }
  // The plan of the target run fits an H200-class GPU.
  o.tokens = 256;
  const MemoryPlan plan = plan_eval_memory(o);
  EXPECT_GT(plan.device_bytes, 10e9);  // one layer's weights alone are 11 GB
  std::printf("%s\n", plan.describe().c_str());
}

}  // namespace
}  // namespace moefq
