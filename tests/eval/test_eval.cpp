// The evaluation library (include/moefq/eval.h) in-process: --layers parsing, the default sweep,
// the calibration file round trip and its errors, and a small run whose calibrated amax must equal
// what a recipe calibrated on its own collects (the reason calibration runs once per layer).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>

#include <functional>
#include <nlohmann/json.hpp>

#include "checkpoint_test_util.h"
#include "eval/layer_runner.h"
#include "moefq/eval.h"
#include "moefq/errors.h"
#include "moefq/qdq.h"
#include "moefq/router.h"
#include "moefq/safetensors.h"
#include "moefq/wire_bytes.h"
#include "test_util.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;

using test::error_of;

TEST(ParseLayers, Forms) {
  EXPECT_EQ(parse_layers("4"), (std::vector<int64_t>{4}));
  EXPECT_EQ(parse_layers("3-6"), (std::vector<int64_t>{3, 4, 5, 6}));
  EXPECT_EQ(parse_layers("7,3,5"), (std::vector<int64_t>{3, 5, 7}));
  EXPECT_EQ(parse_layers("1-2,2,9"), (std::vector<int64_t>{1, 2, 9}));
  EXPECT_EQ(parse_layers("0"), (std::vector<int64_t>{0}));
  for (const char* bad : {"", "a", "3-", "-3", "5-3", "1,,2", "1,", "1.5", " 1", "0-99999", "1-2-3"}) {
    const std::string msg = error_of([&] { parse_layers(bad); });
    EXPECT_NE(msg.find("--layers"), std::string::npos) << bad << ": " << msg;
  }
}

// The outlier output channels (no_outl's exclusions): RMS over the reference more than 6 times the
// median channel's (on sums of squares: more than 36 times), at most 1% of the channels, the largest.
TEST(OutlierChannels, SixTimesTheMedianRmsAtMostOnePercent) {
  std::vector<double> ref2(1000, 1.0);  // sums of squares; the median channel's RMS ratio is 1
  std::vector<bool> o = outlier_channels(ref2);
  EXPECT_EQ(std::count(o.begin(), o.end(), true), 0);
  ref2[7] = 36.5;   // RMS 6.04x the median's: an outlier
  ref2[11] = 35.5;  // 5.96x: not
  o = outlier_channels(ref2);
  EXPECT_TRUE(o[7]);
  EXPECT_FALSE(o[11]);
  EXPECT_EQ(std::count(o.begin(), o.end(), true), 1);
  // 20 channels far above: only the largest 10 (1% of 1000) count.
  for (size_t i = 0; i < 20; ++i) ref2[100 + i] = 1000.0 + double(i);
  o = outlier_channels(ref2);
  EXPECT_EQ(std::count(o.begin(), o.end(), true), 10);
  for (size_t i = 0; i < 20; ++i) EXPECT_EQ(o[100 + i], i >= 10) << i;
  EXPECT_FALSE(o[7]) << "beyond the 1% cap";
  // A width under 100 still allows one.
  std::vector<double> small(64, 2.0);
  small[3] = 2.0 * 40;
  o = outlier_channels(small);
  EXPECT_TRUE(o[3]);
  EXPECT_EQ(std::count(o.begin(), o.end(), true), 1);
}

TEST(DefaultSweep, ThirteenRecipes) {
  const auto sweep = default_sweep();
  ASSERT_EQ(sweep.size(), 13u);
  EXPECT_EQ(sweep[0].name, "none");
  EXPECT_TRUE(sweep[0].recipe.entries.empty());
  const std::vector<std::string> q = {"layers.0.mlp.experts.dispatch_quantizer", "layers.0.mlp.experts.combine_quantizer"};
  for (const NamedRecipe& r : sweep) {
    SCOPED_TRACE(r.name);
    const auto cfg = apply_recipe(r.recipe, q);
    const bool d = r.name.rfind("dispatch_", 0) == 0 || r.name.rfind("both_", 0) == 0;
    const bool c = r.name.rfind("combine_", 0) == 0 || r.name.rfind("both_", 0) == 0;
    EXPECT_EQ(cfg.at(q[0]).enable, d);
    EXPECT_EQ(cfg.at(q[1]).enable, c);
    if (d || c) {
      const std::string fmt = r.name.substr(r.name.find('_') + 1);
      EXPECT_EQ(format_name((d ? cfg.at(q[0]) : cfg.at(q[1])).spec.format), fmt);
    }
  }
}

std::string read_text_of(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

class EvalLib : public ::testing::Test {
 protected:
  void SetUp() override {
    std::random_device rd;
    root_ = fs::temp_directory_path() / ("moefq_evallib_" + std::to_string(::getpid()) + "_" + std::to_string(rd()));
    fs::create_directories(root_);
    std::ofstream(root_ / "config.json") << R"({"hidden_size": 256, "moe_intermediate_size": 128,
      "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
      "scoring_func": "sigmoid", "norm_topk_prob": true, "topk_method": "noaux_tc"})";
    o_.config_path = (root_ / "config.json").string();
    o_.ranks = 2;
    o_.tokens = 16;
    o_.calib_batches = 1;
    o_.eval_batches = 1;
    o_.layers = {0, 5};
  }
  void TearDown() override { fs::remove_all(root_); }

  // Layer 0 calibrated alone and saved to ROOT/cal.json (returned); its setup in `setup`.
  std::string saved_calibration(EvalSetup& setup) {
    o_.layers = {0};
    const CalibrationState cal = run_calibration(o_, &setup);
    const std::string file = (root_ / "cal.json").string();
    save_eval_calibration(file, cal, setup);
    return file;
  }

  fs::path root_;
  EvalOptions o_;
};

// A checkpoint's weight format reaches the memory plan (bf16: 2 bytes per parameter, e4m3: 1 and
// the block scales, MXFP4: decoded to bf16 at load, so 2, and one tensor's packed bytes while it
// is decoded), on the CPU and, for every format, on the GPU.
TEST_F(EvalLib, TheCheckpointsFormatPlansMemory) {
  const fs::path e4m3 = root_ / "e4m3", bf16 = root_ / "bf16", mxfp4 = root_ / "mxfp4";
  test::write_checkpoint(e4m3, {{0, 3}});
  const MoeConfig cfg = test::small_config();
  for (const fs::path& d : {bf16, mxfp4}) {
    fs::create_directories(d);
    fs::copy_file(e4m3 / "config.json", d / "config.json");
  }
  test::FakeCheckpoint::from(cfg, synthetic_weights(cfg, WeightFormat::kBf16, 3, 0, cfg.num_experts), false,
                             test::TensorNaming::mlp(), 0)
      .write(bf16.string());
  LayerWeights decoded;
  test::mxfp4_checkpoint(cfg, 3, 0, decoded).write(mxfp4.string());
  const auto item = [](const MemoryPlan& plan, const std::string& prefix) {
    for (const MemoryItem& m : plan.items)
      if (m.what.rfind(prefix, 0) == 0) return m;
    ADD_FAILURE() << "no " << prefix << " in the plan\n" << plan.describe();
    return MemoryItem{};
  };
  const auto has = [](const MemoryPlan& plan, const std::string& prefix) {
    for (const MemoryItem& m : plan.items)
      if (m.what.rfind(prefix, 0) == 0) return true;
    return false;
  };
  // 8 routed experts and the shared one on each of the 2 ranks, 3 * H * I parameters each.
  const double params = (8.0 + 2.0) * 3.0 * 256.0 * 128.0;
  o_.config_path.clear();
  o_.layers = {0};
  for (const EvalDevice device : {EvalDevice::kCpu, EvalDevice::kCuda}) {
    SCOPED_TRACE(device == EvalDevice::kCpu ? "cpu" : "cuda");
    o_.device = device;
    const auto bytes = [&](const MemoryItem& m) { return device == EvalDevice::kCpu ? m.host_bytes : m.device_bytes; };
    o_.checkpoint_dir = e4m3.string();
    MemoryPlan plan = plan_eval_memory(o_);
    MemoryItem m = item(plan, "expert weights");
    EXPECT_EQ(m.what, "expert weights (e4m3, 1 layer)");
    EXPECT_EQ(bytes(m), params + params / (128.0 * 128.0) * 4.0);
    EXPECT_FALSE(has(plan, "mxfp4 tensor"));
    o_.checkpoint_dir = bf16.string();
    plan = plan_eval_memory(o_);
    m = item(plan, "expert weights");
    EXPECT_EQ(m.what, "expert weights (bf16, 1 layer)");
    EXPECT_EQ(bytes(m), 2.0 * params);
    o_.checkpoint_dir = mxfp4.string();
    plan = plan_eval_memory(o_);
    m = item(plan, "expert weights");
    EXPECT_EQ(m.what, "expert weights (mxfp4 as bf16, 1 layer)");
    EXPECT_EQ(bytes(m), 2.0 * params);
    // The packed tensor decoded at a time: one [I * S, H] projection, half a byte a value and a
    // byte per 32, on the host.
    EXPECT_EQ(item(plan, "mxfp4 tensor being decoded").host_bytes, 256.0 * 128.0 * (0.5 + 1.0 / 32.0));
    if (device == EvalDevice::kCuda) {  // the layer passes through the host, decoded
      EXPECT_EQ(item(plan, "checkpoint layer read on the host").host_bytes, 2.0 * params);
    }
  }
}

// An MXFP4 checkpoint runs through the CPU engine as the bf16 checkpoint of its decoded values
// does (the decode is exact, so every figure is the same), its source says what it was.
TEST_F(EvalLib, Mxfp4CheckpointRunsAsItsDecodedBf16) {
  const fs::path mxfp4 = root_ / "mxfp4", bf16 = root_ / "bf16";
  const MoeConfig cfg = test::small_config();
  LayerWeights decoded;
  for (const fs::path& d : {mxfp4, bf16}) {
    fs::create_directories(d);
    std::ofstream(d / "config.json") << test::kSmallConfigJson;
  }
  test::mxfp4_checkpoint(cfg, 9, 0, decoded).write(mxfp4.string());
  test::FakeCheckpoint::from(cfg, decoded, false, test::TensorNaming::mlp(), 0).write(bf16.string());
  o_.config_path.clear();
  o_.layers = {0};
  o_.staging = Staging::kNone;
  o_.recipes = {"moe_combine_fp8", "moe_dispatch_nvfp4"};
  o_.checkpoint_dir = mxfp4.string();
  const EvalResult a = run_eval(o_);
  o_.checkpoint_dir = bf16.string();
  const EvalResult b = run_eval(o_);
  EXPECT_EQ(a.setup.weights_source, "checkpoint " + mxfp4.string() + " (mxfp4, decoded to bf16 at load)");
  EXPECT_EQ(b.setup.weights_source, "checkpoint " + bf16.string() + " (bf16)");
  ASSERT_EQ(a.rows.size(), b.rows.size());
  ASSERT_EQ(a.rows.size(), 2u);
  for (size_t i = 0; i < a.rows.size(); ++i) {
    SCOPED_TRACE(a.rows[i].recipe);
    EXPECT_EQ(a.rows[i].recipe, b.rows[i].recipe);
    EXPECT_GT(a.rows[i].metrics.rel_l2, 0.0);
    EXPECT_EQ(a.rows[i].metrics.rel_l2, b.rows[i].metrics.rel_l2);
    EXPECT_EQ(a.rows[i].metrics.max_abs, b.rows[i].metrics.max_abs);
    EXPECT_EQ(a.rows[i].dispatch_amax, b.rows[i].dispatch_amax);
    EXPECT_EQ(a.rows[i].combine_amax, b.rows[i].combine_amax);
  }
  // Without --staging, an MXFP4 checkpoint follows its architecture (no model_type: e4m3), a bf16
  // one its format (none).
  o_.staging.reset();
  o_.recipes = {"moe_combine_fp8"};
  o_.checkpoint_dir = mxfp4.string();
  EXPECT_EQ(run_eval(o_).setup.staging, Staging::kE4m3);
  o_.checkpoint_dir = bf16.string();
  EXPECT_EQ(run_eval(o_).setup.staging, Staging::kNone);
}

// A DeepSeek-V4 checkpoint under its own names (MXFP4 routed experts, e4m3 shared expert) runs
// through the CPU engine as the Hugging Face-named bf16 checkpoint of its decoded values does.
TEST_F(EvalLib, DeepseekV4OwnCheckpointRunsAsItsDecodedBf16) {
  const fs::path own = root_ / "v4", bf16 = root_ / "v4_bf16";
  for (const fs::path& d : {own, bf16}) {
    fs::create_directories(d);
    std::ofstream(d / "config.json") << test::kSmallDeepseekV4ConfigJson;
  }
  const MoeConfig cfg = load_hf_config((own / "config.json").string());
  ASSERT_EQ(cfg.model_type, "deepseek_v4");
  LayerWeights decoded;
  test::deepseek_v4_checkpoint(cfg, 5, 2, decoded).write(own.string());
  test::FakeCheckpoint::from(cfg, decoded, false, test::TensorNaming::mlp(), 2).write(bf16.string());
  o_.config_path.clear();
  o_.layers = {2};
  o_.recipes = {"moe_combine_fp8", "moe_dispatch_nvfp4"};
  o_.checkpoint_dir = own.string();
  const EvalResult a = run_eval(o_);
  o_.checkpoint_dir = bf16.string();
  o_.staging = a.setup.staging;  // deepseek_v4: e4m3 (a bf16 checkpoint's own default is none)
  const EvalResult b = run_eval(o_);
  EXPECT_EQ(a.setup.staging, Staging::kE4m3);
  EXPECT_EQ(a.setup.weights_source, "checkpoint " + own.string() + " (mxfp4, decoded to bf16 at load)");
  ASSERT_EQ(a.rows.size(), 2u);
  ASSERT_EQ(b.rows.size(), 2u);
  for (size_t i = 0; i < a.rows.size(); ++i) {
    SCOPED_TRACE(a.rows[i].recipe);
    EXPECT_GT(a.rows[i].metrics.rel_l2, 0.0);
    EXPECT_EQ(a.rows[i].metrics.rel_l2, b.rows[i].metrics.rel_l2);
    EXPECT_EQ(a.rows[i].metrics.max_abs, b.rows[i].metrics.max_abs);
    EXPECT_EQ(a.rows[i].combine_amax, b.rows[i].combine_amax);
  }
}

TEST_F(EvalLib, CalibrationIsSharedAndTheFileRoundTrips) {
  const EvalResult r = run_eval(o_);
  ASSERT_EQ(r.rows.size(), 26u);
  ASSERT_EQ(r.calibration.layers.size(), 2u);
  for (const LayerCalibration& c : r.calibration.layers) {
    ASSERT_EQ(c.dispatch_rank_amax.size(), 2u);
    EXPECT_EQ(c.dispatch_amax, std::max(c.dispatch_rank_amax[0], c.dispatch_rank_amax[1]));
    EXPECT_EQ(c.combine_amax, std::max(c.combine_rank_amax[0], c.combine_rank_amax[1]));
  }
  EXPECT_NE(r.calibration.layers[0].combine_amax, r.calibration.layers[1].combine_amax) << "layers differ";
  for (const EvalRow& row : r.rows) {
    if (row.recipe == "none") {
      EXPECT_EQ(row.metrics.rel_l2, 0.0);
      EXPECT_EQ(row.metrics.max_abs, 0.0);
    }
    // Every calibrated recipe uses the layer's one calibration.
    const LayerCalibration& c = *r.calibration.find(row.layer);
    if (row.combine_format == std::optional<std::string>("fp8")) {
      EXPECT_EQ(row.combine_amax, c.combine_amax);
    }
    if (row.dispatch_format == std::optional<std::string>("nvfp4")) {
      EXPECT_EQ(row.dispatch_amax, c.dispatch_amax);
    }
  }
  // calibrate alone collects the same state; saved and loaded, exactly.
  EvalSetup setup;
  const CalibrationState alone = run_calibration(o_, &setup);
  const std::string file = (root_ / "cal.json").string();
  save_eval_calibration(file, alone, setup);
  EvalSetup both = setup;
  both.layers = {5, 0};
  std::vector<std::string> warnings;
  const CalibrationState back = load_eval_calibration(file, both, &warnings);
  EXPECT_TRUE(warnings.empty()) << warnings[0];
  ASSERT_EQ(back.layers.size(), 2u);
  for (const LayerCalibration& c : r.calibration.layers) {
    const LayerCalibration& b = *back.find(c.layer);
    EXPECT_EQ(b.dispatch_amax, c.dispatch_amax);
    EXPECT_EQ(b.combine_amax, c.combine_amax);
    EXPECT_EQ(b.dispatch_rank_amax, c.dispatch_rank_amax);
    EXPECT_EQ(b.combine_rank_amax, c.combine_rank_amax);
  }
  // Errors name the file: a missing layer, another model, disagreeing amax bits.
  EvalSetup one = setup;
  one.layers = {1};
  EXPECT_NE(error_of([&] { load_eval_calibration(file, one); }).find("layer 1"), std::string::npos);
  EvalSetup other = setup;
  other.config.top_k = 4;
  EXPECT_NE(error_of([&] { load_eval_calibration(file, other); }).find("top_k"), std::string::npos);
  const std::string text = read_text_of(file);
  const auto edited = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    const size_t at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) t.replace(at, from.size(), to);
    const std::string path = (root_ / "edited.json").string();
    std::ofstream(path) << t;
    return path;
  };
  const size_t at = text.find("\"amax_bits\": \"0x");
  ASSERT_NE(at, std::string::npos);
  const std::string bits = text.substr(at, 25);  // "amax_bits": "0x........"
  EXPECT_NE(error_of([&] { load_eval_calibration(edited(bits, "\"amax_bits\": \"0x3F800000\""), both); })
                .find("disagree"),
            std::string::npos);
}

// A calibration file made for another setup is used, with a warning naming each difference; an
// amax of 0, negative or not finite, or per-rank lists of the wrong length, are errors.
TEST_F(EvalLib, CalibrationFilesMatchTheirUse) {
  EvalSetup setup;
  const std::string file = saved_calibration(setup);
  EvalSetup changed = setup;
  changed.seed = 7;
  changed.tokens = 32;
  changed.activations_source = "acts.safetensors";
  std::vector<std::string> warnings;
  load_eval_calibration(file, changed, &warnings);
  ASSERT_EQ(warnings.size(), 1u);
  for (const char* part : {"seed '1' (this run: '7')", "tokens_per_rank '16' (this run: '32')", "activations"})
    EXPECT_NE(warnings[0].find(part), std::string::npos) << warnings[0];

  // Edits of the file: the first quantizer's entry changed.
  const auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = nlohmann::json::parse(read_text_of(file));
    edit(j["quantizers"].begin().value());
    const std::string path = (root_ / "edited.json").string();
    std::ofstream(path) << j.dump(2);
    return path;
  };
  for (const double bad : {0.0, -1.0})
    EXPECT_NE(error_of([&] {
                load_eval_calibration(with([&](nlohmann::json& e) {
                                        e["amax"] = bad;
                                        e.erase("amax_bits");
                                        e.erase("rank_amax");
                                      }),
                                      setup);
              }).find(bad == 0.0 ? "finite and > 0" : ">= 0"),
              std::string::npos)
        << bad;
  EXPECT_NE(error_of([&] { load_eval_calibration(with([](nlohmann::json& e) { e["rank_amax"].push_back(1.0); }), setup); })
                .find("per-rank maxima"),
            std::string::npos);
}

// What a calibration file's use depends on is checked, not warned about: the combine weighting it
// was measured with (the combine rows differ), each rank_amax list against its amax (their max),
// the setup's integers as JSON integers, and the keys the check needs.
TEST_F(EvalLib, CalibrationFilesFromAnotherModeOrEditedAreRefused) {
  EvalSetup setup;
  const std::string file = saved_calibration(setup);
  EvalSetup after = setup;
  after.combine_weighting = CombineWeighting::kAfter;
  std::vector<std::string> warnings;
  std::string msg = error_of([&] { load_eval_calibration(file, after, &warnings); });
  for (const char* part : {"cal.json", "combine_weighting before", "after"})
    EXPECT_NE(msg.find(part), std::string::npos) << msg;
  EXPECT_TRUE(warnings.empty());

  const auto edited = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = nlohmann::json::parse(read_text_of(file));
    edit(j);
    const std::string path = (root_ / "edited.json").string();
    std::ofstream(path) << j.dump(2);
    return path;
  };
  // A rank's max above the amax, then all below it: the amax is not their max either way.
  for (const double scale : {2.0, 0.5}) {
    msg = error_of([&] {
      load_eval_calibration(edited([&](nlohmann::json& j) {
                              nlohmann::json& r = j["quantizers"].begin().value()["rank_amax"];
                              for (nlohmann::json& v : r) v = v.get<double>() * scale;
                            }),
                            setup);
    });
    EXPECT_NE(msg.find("rank_amax"), std::string::npos) << scale << ": " << msg;
  }
  msg = error_of([&] { load_eval_calibration(edited([](nlohmann::json& j) { j["setup"]["ranks"] = "2"; }), setup); });
  EXPECT_NE(msg.find("setup.ranks must be a JSON integer"), std::string::npos) << msg;
  for (const char* key : {"hidden", "ranks", "combine_weighting"}) {
    msg = error_of([&] { load_eval_calibration(edited([&](nlohmann::json& j) { j["setup"].erase(key); }), setup); });
    EXPECT_NE(msg.find("the setup has no '" + std::string(key) + "'"), std::string::npos) << msg;
  }
  // The file as saved still loads.
  EXPECT_EQ(load_eval_calibration(file, setup).layers.size(), 1u);
}

// Progress: within a layer's load the experts' weights made so far; the estimate waits until each
// kind of step still ahead (loads, calibrations, recipe batches) has been measured, as their
// durations differ by orders of magnitude.
TEST_F(EvalLib, ProgressToldWithinTheWeightsAndEstimatedByStepKind) {
  o_.recipes = {"moe_combine_fp8"};
  o_.num_threads = 1;  // groups of 4 experts: 2 ranks x (4 routed + the shared one) = 10 per layer
  o_.progress_every_seconds = 0;
  std::vector<std::string> lines;
  o_.progress = [&](const std::string& l) { lines.push_back(l); };
  (void)run_eval(o_);
  std::vector<std::string> steps, within;
  for (const std::string& l : lines) (l.rfind("[", 0) == 0 ? steps : within).push_back(l);
  // 2 layers x (load, calibration, 1 batch x (reference + 1 recipe)).
  ASSERT_EQ(steps.size(), 8u);
  EXPECT_EQ(steps[0].find('('), std::string::npos) << steps[0];
  for (size_t i : {size_t(1), size_t(2)}) {  // calibration, then the first batch: their kinds not yet measured
    EXPECT_NE(steps[i].find(" s)"), std::string::npos) << steps[i];
    EXPECT_EQ(steps[i].find("eta"), std::string::npos) << steps[i];
  }
  for (size_t i = 3; i < steps.size(); ++i) EXPECT_NE(steps[i].find(", eta "), std::string::npos) << steps[i];
  // 4, 5 and 9 of 10 experts per layer (10 of 10 ends the load, whose step line follows).
  ASSERT_EQ(within.size(), 6u) << (within.empty() ? "" : within[0]);
  for (size_t i = 0; i < within.size(); ++i) {
    const char* count = i % 3 == 0 ? "4/10 experts' weights" : i % 3 == 1 ? "5/10 experts' weights" : "9/10 experts' weights";
    EXPECT_NE(within[i].find(count), std::string::npos) << within[i];
    // Layer 0's load: only its own estimate; layer 5's: the whole run's.
    EXPECT_NE(within[i].find(i < 3 ? "this step's eta" : ", eta "), std::string::npos) << within[i];
  }
}

// The clipping warning: only where the clipped fraction is more than one element in ten thousand
// (held-out data exceeds a max calibration now and then), worded plainly.
TEST_F(EvalLib, ClippingWarnsAboveAThreshold) {
  o_.layers = {0};
  o_.tokens = 64;  // 2 x 64 x 256 dispatch elements: one of them is 3.1e-5
  o_.recipes = {"moe_combine_fp8", "moe_dispatch_fp8"};
  const EvalResult r = run_eval(o_);
  const auto max_fraction = [&](const EvalResult& res, bool dispatch) {
    double worst = 0;
    for (const EvalRow& row : res.rows)
      worst = std::max(worst, (dispatch ? row.dispatch_clipped_fraction : row.combine_clipped_fraction).value_or(0.0));
    return worst;
  };
  const auto warned = [&](const EvalResult& res, const std::string& side) {
    for (const std::string& w : res.warnings)
      if (w.find(side + " elements lie beyond") != std::string::npos) return true;
    return false;
  };
  for (const bool dispatch : {true, false}) {
    const double f = max_fraction(r, dispatch);
    EXPECT_EQ(warned(r, dispatch ? "dispatch" : "combine"), f > 1e-4) << f;
  }
  // Calibrations below the data's range (the dispatch amax scaled down): a few elements clip, which
  // is no warning, or many, which is one, worded plainly.
  EvalSetup setup;
  const CalibrationState cal = run_calibration(o_, &setup);
  const std::string file = (root_ / "cal.json").string();
  const auto scaled = [&](double scale) {
    save_eval_calibration(file, cal, setup);
    nlohmann::json j = nlohmann::json::parse(read_text_of(file));
    nlohmann::json& e = j["quantizers"]["layers.0.mlp.experts.dispatch_quantizer"];
    e.erase("amax_bits");
    e["amax"] = e["amax"].get<double>() * scale;
    for (nlohmann::json& v : e["rank_amax"]) v = v.get<double>() * scale;
    std::ofstream(file) << j.dump(2);
    EvalOptions low = o_;
    low.load_calibration = file;
    return run_eval(low);
  };
  const EvalResult few = scaled(0.97);
  EXPECT_GT(max_fraction(few, true), 0.0) << "the test data must clip a few elements";
  EXPECT_LE(max_fraction(few, true), 1e-4);
  EXPECT_FALSE(warned(few, "dispatch")) << few.warnings[0];
  const EvalResult c = scaled(1.0 / 64);
  EXPECT_GT(max_fraction(c, true), 1e-4);
  ASSERT_TRUE(warned(c, "dispatch"));
  bool worded = false;
  for (const std::string& w : c.warnings)
    worded = worded || w.find("calibrate on more data, or on data more like the evaluation's") != std::string::npos;
  EXPECT_TRUE(worded) << c.warnings[0];
}

// A run the host cannot hold is refused naming the running command; --device cuda is advised only
// where a GPU evaluation is registered (its memory query) and the run would fit that GPU.
TEST_F(EvalLib, MemoryRefusalAdvisesTheGpuOnlyWhereItFits) {
  o_.layers = {0};
  o_.tokens = int64_t(1) << 20;
  o_.calib_batches = 1000;  // 2 ranks x 2^20 tokens x 1000 batches x H 256 x 2 bytes: 1 TiB of activations
  set_device_memory_query({});
  std::string msg = error_of([&] { run_calibration(o_); });
  EXPECT_NE(msg.find("moefq calibrate: needs "), std::string::npos) << msg;
  EXPECT_EQ(msg.find("--device cuda"), std::string::npos) << "no GPU evaluation here\n" << msg;
  set_device_memory_query([] { return std::pair<double, double>(1e9, 1e9); });  // too small a GPU
  msg = error_of([&] { run_calibration(o_); });
  EXPECT_EQ(msg.find("--device cuda"), std::string::npos) << msg;
  set_device_memory_query([] { return std::pair<double, double>(1e16, 1e16); });  // one that holds it
  msg = error_of([&] { run_calibration(o_); });
  EXPECT_NE(msg.find("use --device cuda"), std::string::npos) << msg;
  o_.eval_batches = 1;
  msg = error_of([&] { run_eval(o_); });
  EXPECT_NE(msg.find("moefq eval: needs "), std::string::npos) << msg;
  set_device_memory_query({});
}

// When one layer's weights alone exceed the machine, the refusal says so instead of suggesting
// fewer tokens.
TEST_F(EvalLib, MemoryRefusalSaysWhenTheWeightsAloneDoNotFit) {
  std::ofstream(root_ / "huge.json") << R"({"hidden_size": 7168, "moe_intermediate_size": 4096,
    "n_routed_experts": 8192, "num_experts_per_tok": 8, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "norm_topk_prob": true, "topk_method": "noaux_tc"})";
  o_.config_path = (root_ / "huge.json").string();  // 8192 experts x 88 MB: 720 GB of e4m3 weights
  o_.layers = {0};
  set_device_memory_query({});
  const std::string msg = error_of([&] { run_eval(o_); });
  EXPECT_NE(msg.find("expert weights alone need"), std::string::npos) << msg;
  EXPECT_NE(msg.find("fewer tokens or batches cannot help"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("use fewer --ranks, --tokens"), std::string::npos) << msg;
}

// Recipes that share a dispatch configuration share one engine call per batch (the others reuse
// its combine rows): each row equals the row of the same recipe evaluated alone, bit for bit.
TEST_F(EvalLib, SharedEngineCallsGiveTheSameRowsAsRecipesAlone) {
  o_.layers = {0};
  const EvalResult sweep = run_eval(o_);
  for (const char* name : {"both_fp8", "combine_nvfp4", "both_mxfp4", "dispatch_nvfp4"}) {
    SCOPED_TRACE(name);
    EvalOptions one = o_;
    const std::string side = std::string(name).substr(0, std::string(name).find('_'));
    const std::string fmt = std::string(name).substr(side.size() + 1);
    const std::string yaml = (root_ / (std::string(name) + ".yaml")).string();
    std::ofstream(yaml) << (side == "both" ? "$import: [moe_dispatch_" + fmt + ", moe_combine_" + fmt + "]\n"
                                           : "$import: [moe_" + side + "_" + fmt + "]\n")
                        << "algorithm: max\n";
    one.recipes = {yaml};
    const EvalResult alone = run_eval(one);
    ASSERT_EQ(alone.rows.size(), 1u);
    const EvalRow* in_sweep = nullptr;
    for (const EvalRow& r : sweep.rows)
      if (r.recipe == name) in_sweep = &r;
    ASSERT_NE(in_sweep, nullptr);
    const EvalRow& a = alone.rows[0];
    EXPECT_EQ(a.metrics.rel_l2, in_sweep->metrics.rel_l2);
    EXPECT_EQ(a.metrics.max_abs, in_sweep->metrics.max_abs);
    EXPECT_EQ(a.metrics.calc_diff, in_sweep->metrics.calc_diff);
    EXPECT_EQ(a.rel_l2_token_p99, in_sweep->rel_l2_token_p99);
    EXPECT_EQ(a.rel_l2_non_outlier, in_sweep->rel_l2_non_outlier);
    EXPECT_EQ(a.combine_clipped_fraction, in_sweep->combine_clipped_fraction);
    EXPECT_EQ(a.dispatch_clipped_fraction, in_sweep->dispatch_clipped_fraction);
  }
}

// The new rows: the error's shape, clipping and wire bytes are in every row, finite; a budget
// marks the rows over it and names the cheapest recipe within it.
TEST_F(EvalLib, RowsShowTheErrorsShapeAndTheBudgetsAnswer) {
  o_.layers = {0};
  o_.max_rel_l2 = 0.05;
  const EvalResult r = run_eval(o_);
  ASSERT_EQ(r.rows.size(), 13u);
  const int64_t H = 256;
  for (const EvalRow& row : r.rows) {
    SCOPED_TRACE(row.recipe);
    for (double v : {row.rel_l2_token_p50, row.rel_l2_token_p99, row.rel_l2_token_max, row.rel_l2_non_outlier})
      EXPECT_TRUE(std::isfinite(v));
    // The layer's outlier output channels, at most 1% of H; without any, no_outl is rel_l2 itself.
    EXPECT_EQ(row.num_outlier_channels, r.rows[0].num_outlier_channels);
    EXPECT_LE(row.num_outlier_channels, std::max<int64_t>(1, H / 100));
    if (row.num_outlier_channels == 0) {
      EXPECT_EQ(row.rel_l2_non_outlier, row.metrics.rel_l2);
    }
    EXPECT_LE(row.rel_l2_token_p50, row.rel_l2_token_p99);
    EXPECT_LE(row.rel_l2_token_p99, row.rel_l2_token_max);
    EXPECT_EQ(row.dispatch_clipped_fraction.has_value(), row.dispatch_amax.has_value());
    EXPECT_EQ(row.combine_clipped_fraction.has_value(), row.combine_amax.has_value());
    const double disp = row.dispatch_format == std::optional<std::string>("nvfp4") ? H / 2 + H / 16
                        : row.dispatch_format                                      ? -1
                                                                                   : 2 * H;
    if (disp > 0) {
      EXPECT_EQ(row.dispatch_wire_bytes_per_token, disp);
    }
    EXPECT_EQ(row.over_budget, !(row.metrics.rel_l2 <= 0.05));
    if (row.recipe == "none") {
      EXPECT_EQ(row.wire_saving, 0.0);
      EXPECT_EQ(row.rel_l2_token_max, 0.0);
    }
  }
  ASSERT_TRUE(r.cheapest_within_budget.has_value());
  // The answer: within the budget, and no recipe within it is cheaper.
  double best = 0;
  for (const EvalRow& row : r.rows)
    if (row.recipe == *r.cheapest_within_budget) {
      EXPECT_FALSE(row.over_budget);
      best = row.dispatch_wire_bytes_per_token + row.combine_wire_bytes_per_token;
    }
  for (const EvalRow& row : r.rows) {
    if (!row.over_budget) {
      EXPECT_GE(row.dispatch_wire_bytes_per_token + row.combine_wire_bytes_per_token, best) << row.recipe;
    }
  }
}

// The wire formats of the expert-parallel libraries, named by unit: a row each, with their wire
// bytes (H = 256: two fp32 scales, two ue8m0 scales, logfmt10's 320 + 8) and a finite error, above
// 0 for the fp8 combine rows. fp8_block128 on the dispatch is the engine's own e4m3 staging of
// its input (1 x 128 blocks, amax floored at 1e-4), so there it may change nothing at all.
TEST_F(EvalLib, WireFormatUnitsHaveRowsAndWireBytes) {
  o_.layers = {0};
  o_.recipes = {"moe_combine_fp8_block128", "moe_combine_fp8_block128_ue8m0", "moe_combine_logfmt10",
                "moe_dispatch_fp8_block128"};
  const EvalResult r = run_eval(o_);
  ASSERT_EQ(r.rows.size(), 4u);
  const std::map<std::string, std::pair<double, double>> bytes = {
      {"moe_combine_fp8_block128", {512.0, 256.0 + 8.0}},
      {"moe_combine_fp8_block128_ue8m0", {512.0, 256.0 + 2.0}},
      {"moe_combine_logfmt10", {512.0, 320.0 + 8.0}},
      {"moe_dispatch_fp8_block128", {256.0 + 8.0, 512.0}}};
  for (const EvalRow& row : r.rows) {
    SCOPED_TRACE(row.recipe);
    ASSERT_TRUE(bytes.count(row.recipe));
    EXPECT_EQ(row.dispatch_wire_bytes_per_token, bytes.at(row.recipe).first);
    if (row.recipe == "moe_combine_logfmt10") {
      // What was sent: the cast groups compressed, the others bf16, at the fraction cast on the
      // calibration data (counted there, group by group).
      const CastGroups& g = r.calibration.layers[0].combine_logfmt;
      ASSERT_GT(g.total, 0u);
      ASSERT_TRUE(row.combine_cast_fraction.has_value());
      EXPECT_EQ(*row.combine_cast_fraction, g.fraction());
      EXPECT_EQ(row.combine_wire_bytes_per_token, g.fraction() * bytes.at(row.recipe).second + (1 - g.fraction()) * 512.0);
      EXPECT_FALSE(row.dispatch_cast_fraction.has_value());
      continue;
    }
    EXPECT_FALSE(row.combine_cast_fraction.has_value());
    EXPECT_EQ(row.combine_wire_bytes_per_token, bytes.at(row.recipe).second);
    EXPECT_TRUE(std::isfinite(row.metrics.rel_l2));
    if (row.recipe == "moe_combine_fp8_block128" || row.recipe == "moe_combine_fp8_block128_ue8m0") {
      EXPECT_GT(row.metrics.rel_l2, 0.0);
    }
    EXPECT_LT(row.metrics.rel_l2, 0.1);
  }
}

// --sweep peers: every peer recipe once (none once), each row with its peer and wire bytes; DeepEP's
// recipes run with combine_weighting after and give the rows of a run of them alone in that mode,
// the others the rows of a run alone in before. The sweep and explicit recipes exclude each other.
TEST_F(EvalLib, PeersSweepRunsEachPeerInItsWeighting) {
  o_.layers = {0};
  o_.sweep = "peers";
  const EvalResult sweep = run_eval(o_);
  const std::vector<NamedRecipe> all = peers_sweep();
  ASSERT_EQ(sweep.rows.size(), all.size());
  ASSERT_EQ(sweep.summary.size(), all.size());
  for (const NamedRecipe& r : all)
    EXPECT_EQ(std::count_if(sweep.rows.begin(), sweep.rows.end(), [&](const EvalRow& e) { return e.recipe == r.name; }), 1)
        << r.name;
  EXPECT_EQ(peer_of("deepep_ll_logfmt10"), "DeepEP");
  EXPECT_EQ(peer_of("mori_fp4_blockwise"), "MoRI");
  EXPECT_EQ(peer_of("flashinfer_fp4_combine"), "FlashInfer");
  EXPECT_EQ(peer_of("both_fp8"), "");
  for (const char* name : {"deepep_ll_logfmt10", "mori_fp8_blockwise", "sglang_deepgemm_fp8_combine"}) {
    SCOPED_TRACE(name);
    EvalOptions one = o_;
    one.sweep.clear();
    one.recipes = {std::string("configs/ptq/presets/peers/") + name};
    const EvalResult alone = run_eval(one);
    ASSERT_EQ(alone.rows.size(), 1u);
    EXPECT_EQ(alone.setup.combine_weighting,
              peer_of(name) == "DeepEP" ? CombineWeighting::kAfter : CombineWeighting::kBefore);
    const auto in_sweep = std::find_if(sweep.rows.begin(), sweep.rows.end(), [&](const EvalRow& e) { return e.recipe == name; });
    ASSERT_NE(in_sweep, sweep.rows.end());
    EXPECT_EQ(alone.rows[0].metrics.rel_l2, in_sweep->metrics.rel_l2);
    EXPECT_EQ(alone.rows[0].combine_wire_bytes_per_token, in_sweep->combine_wire_bytes_per_token);
    EXPECT_GT(in_sweep->metrics.rel_l2, 0.0);
  }
  // With a weighting, only the peers meant for it.
  EvalOptions after = o_;
  after.combine_weighting = CombineWeighting::kAfter;
  const EvalResult a = run_eval(after);
  for (const EvalRow& row : a.rows) EXPECT_TRUE(row.recipe == "none" || peer_of(row.recipe) == "DeepEP") << row.recipe;
  EvalOptions both = o_;
  both.recipes = {"moe_combine_fp8"};
  EXPECT_NE(error_of([&] { run_eval(both); }).find("--sweep peers and --recipe"), std::string::npos);
  EvalOptions bad = o_;
  bad.sweep = "friends";
  EXPECT_NE(error_of([&] { run_eval(bad); }).find("unknown sweep"), std::string::npos);
}

// Calibration methods beyond max: one calibration pass per layer (its histograms hold every
// dispatch element of the calibration batches, nvfp4's blocks every row when they fit), each recipe
// with a calibrated amax once per method; the max rows are those of a plain run, bit for bit.
TEST_F(EvalLib, CalibrationMethodsFromOnePass) {
  o_.layers = {0};
  o_.tokens = 64;
  o_.recipes = {"moe_dispatch_fp8", "moe_combine_nvfp4", "moe_dispatch_mxfp8"};
  const EvalResult plain = run_eval(o_);
  o_.calibration = parse_calibration_methods("max,percentile:99.9,mse", "--calibration");
  const EvalResult r = run_eval(o_);
  EXPECT_EQ(r.setup.calibration, "max, percentile 99.9, mse");
  std::map<std::string, const EvalRow*> rows;
  for (const EvalRow& row : r.rows) rows[row.recipe] = &row;
  const std::vector<std::string> want = {"moe_combine_nvfp4@max", "moe_combine_nvfp4@mse", "moe_combine_nvfp4@p99.9",
                                         "moe_dispatch_fp8@max",  "moe_dispatch_fp8@mse",  "moe_dispatch_fp8@p99.9",
                                         "moe_dispatch_mxfp8"};
  std::vector<std::string> have;
  for (const auto& [name, row] : rows) have.push_back(name);
  EXPECT_EQ(have, want);

  ASSERT_EQ(r.calibration.layers.size(), 1u);
  const LayerCalibration& cal = r.calibration.layers[0];
  ASSERT_TRUE(cal.dispatch_hist && cal.combine_hist);
  EXPECT_EQ(cal.dispatch_hist->total(), uint64_t(o_.calib_batches * o_.ranks * o_.tokens * 256));
  EXPECT_EQ(cal.dispatch_hist->max(), cal.dispatch_amax) << "the histogram and the running max see the same data";
  EXPECT_EQ(cal.combine_hist->max(), cal.combine_amax);
  // nvfp4's blocks: every calibration row fits the sample, so they hold what the histograms count.
  ASSERT_TRUE(cal.dispatch_nvfp4 && cal.combine_nvfp4);
  EXPECT_EQ(cal.dispatch_nvfp4->num_elements(), cal.dispatch_hist->total());
  EXPECT_EQ(cal.combine_nvfp4->num_elements(), cal.combine_hist->total());
  EXPECT_NE(*rows["moe_combine_nvfp4@mse"]->combine_amax, cal.combine_amax);
  // Each row's amax is its method's, derived from the histograms.
  for (const auto& [name, side, format] :
       {std::tuple<std::string, int, Format>{"moe_dispatch_fp8@", 0, Format::kFp8}, {"moe_combine_nvfp4@", 1, Format::kNvfp4}})
    for (const char* m : {"max", "percentile:99.9", "mse"}) {
      const CalibrationMethod method = parse_calibration_method(m, "t");
      const std::string row_name = name + method.short_name();
      if (!rows.count(row_name)) continue;
      SCOPED_TRACE(row_name);
      const EvalRow& row = *rows[row_name];
      EXPECT_EQ(row.calibration, method.name());
      const AbsHistogram& h = side == 0 ? *cal.dispatch_hist : *cal.combine_hist;
      const Nvfp4Blocks* blocks = side == 0 ? cal.dispatch_nvfp4.get() : cal.combine_nvfp4.get();
      const float amax = *(side == 0 ? row.dispatch_amax : row.combine_amax);
      EXPECT_EQ(amax, derive_amax(h, method, format, "t", blocks).amax);
    }
  EXPECT_LT(*rows["moe_dispatch_fp8@p99.9"]->dispatch_amax, cal.dispatch_amax);
  EXPECT_GT(*rows["moe_dispatch_fp8@p99.9"]->dispatch_clipped_fraction, 0.0);
  // The max rows are the plain run's.
  for (const EvalRow& p : plain.rows) {
    SCOPED_TRACE(p.recipe);
    const std::string name = p.recipe == "moe_dispatch_mxfp8" ? p.recipe : p.recipe + "@max";
    ASSERT_TRUE(rows.count(name));
    EXPECT_EQ(rows[name]->metrics.rel_l2, p.metrics.rel_l2);
    EXPECT_EQ(rows[name]->dispatch_amax, p.dispatch_amax);
    EXPECT_EQ(rows[name]->combine_amax, p.combine_amax);
  }
  EXPECT_NE(rows["moe_dispatch_fp8@p99.9"]->metrics.rel_l2, rows["moe_dispatch_fp8@max"]->metrics.rel_l2);
  // The derived list has each (quantizer, method, format) once; nvfp4's with its error on the rows.
  EXPECT_EQ(cal.derived.size(), 3u + 3u);
  for (const DerivedCalibration& d : cal.derived) EXPECT_TRUE(d.amax.rel_error.has_value()) << d.format << " " << d.method;

  // What cannot be combined is refused before any work.
  EvalOptions loaded = o_;
  loaded.load_calibration = (root_ / "none.json").string();
  EXPECT_THROW((void)run_eval(loaded), Error);
}

// The statistics of the calibration pass against the calibration rows counted directly: the dispatch
// tokens (an activations file whose rows are scaled by 1, 2^-6 and 2^-12, so logfmt10 casts some
// groups and not others; routed again here) bin by bin, their logfmt10 cast groups group by group,
// nvfp4's blocks from every row or, with a small bound, from the rows SampleRows keeps; the combine
// side's totals from the active routed slots.
TEST_F(EvalLib, CalibrationStatisticsAreTheRowsCountedDirectly) {
  o_.layers = {0};
  o_.calib_batches = 2;
  o_.recipes = {"moe_combine_logfmt10", "moe_dispatch_nvfp4"};
  o_.calibration = {parse_calibration_method("mse", "t")};
  RunnerSetup s;
  s.config = load_hf_config(o_.config_path);
  s.ranks = o_.ranks;
  s.tokens = o_.tokens;
  s.calib_batches = o_.calib_batches;
  s.eval_batches = o_.eval_batches;
  s.seed = o_.seed;
  const int64_t R = s.ranks, T = s.tokens, H = s.config.hidden, K = s.config.top_k;
  const int64_t N = s.num_tokens();
  const std::vector<float> raw = synthetic_activations(N, H, 11);
  std::vector<bf16> x(raw.size());
  for (int64_t i = 0; i < N * H; ++i)
    x[size_t(i)] = bf16{bf16_round(std::ldexp(raw[size_t(i)], -6 * int((i / H) % 3)))};
  SafetensorsWriter acts;
  acts.add("hidden_states", StDtype::kBF16, {N, H}, {reinterpret_cast<const uint8_t*>(x.data()), x.size() * 2});
  acts.write((root_ / "acts.safetensors").string());
  o_.activations_path = (root_ / "acts.safetensors").string();
  const LayerWeights w = rank_weights(s, 0, 0);
  AbsHistogram hist;
  CastGroups cast;
  std::vector<bf16> sent;          // every dispatch row, in position order
  std::vector<uint64_t> position;  // [sent rows]
  uint64_t combine_rows = 0;
  for (int64_t b = 0; b < s.calib_batches; ++b)
    for (int64_t r = 0; r < R; ++r) {
      const bf16* xr = x.data() + (b * R + r) * T * H;
      const Routing routing = route(s.config, xr, T, w.gate, w.gate_bias);
      for (int64_t t = 0; t < T; ++t) {
        int64_t active = 0;
        for (int64_t k = 0; k < K; ++k) active += routing.topk_idx[size_t(t * K + k)] >= 0 ? 1 : 0;
        combine_rows += uint64_t(active);
        if (!active) continue;
        hist.add(xr + t * H, H);
        cast.merge(logfmt10_cast_groups(xr + t * H, 1, H));
        sent.insert(sent.end(), xr + t * H, xr + (t + 1) * H);
        position.push_back(uint64_t((b * R + r) * T + t));
      }
    }
  const int64_t groups = H % 1024 == 0 ? H / 1024 : (H + 511) / 512;  // logfmt10's cast groups per row

  const EvalResult all = run_eval(o_);
  ASSERT_EQ(all.calibration.layers.size(), 1u);
  const LayerCalibration& c = all.calibration.layers[0];
  ASSERT_TRUE(c.dispatch_hist && c.combine_hist && c.dispatch_nvfp4 && c.combine_nvfp4);
  EXPECT_EQ(c.dispatch_hist->total(), hist.total());
  for (int bin = 0; bin < AbsHistogram::kBins; ++bin)
    ASSERT_EQ(c.dispatch_hist->count(bin), hist.count(bin)) << "bin " << bin;
  EXPECT_EQ(c.dispatch_logfmt.cast, cast.cast);
  EXPECT_EQ(c.dispatch_logfmt.total, cast.total);
  EXPECT_GT(cast.cast, 0u);
  EXPECT_LT(cast.cast, cast.total) << "the data has groups of both kinds";
  EXPECT_EQ(c.combine_hist->total(), combine_rows * uint64_t(H));
  EXPECT_EQ(c.combine_logfmt.total, combine_rows * uint64_t(groups));
  // The row's figures are the counts'.
  for (const EvalRow& row : all.rows)
    if (row.recipe == "moe_combine_logfmt10") {
      ASSERT_TRUE(row.combine_cast_fraction.has_value());
      EXPECT_EQ(*row.combine_cast_fraction, c.combine_logfmt.fraction());
    }
  const Nvfp4Blocks every(sent.data(), nullptr, int64_t(position.size()), H);
  EXPECT_EQ(c.dispatch_nvfp4->num_rows(), position.size());
  EXPECT_EQ(c.combine_nvfp4->num_rows(), combine_rows);
  for (float a : {0.1f, 1.0f, c.dispatch_amax})
    EXPECT_EQ(c.dispatch_nvfp4->qdq_squared_error(a), every.qdq_squared_error(a)) << a;

  // A bound of 5 rows: the rows SampleRows keeps of the sent tokens, no others.
  o_.nvfp4_sample_elements = 5 * H;
  const EvalResult few = run_eval(o_);
  const LayerCalibration& f = few.calibration.layers[0];
  const SampleRows plan = SampleRows::plan(uint64_t(s.calib_batches * R * T), H, 5 * H);
  std::vector<bf16> kept;
  for (size_t i = 0; i < position.size(); ++i)
    if (plan.slot(position[i]) >= 0) kept.insert(kept.end(), sent.begin() + int64_t(i) * H, sent.begin() + int64_t(i + 1) * H);
  ASSERT_TRUE(f.dispatch_nvfp4 && f.combine_nvfp4);
  EXPECT_EQ(f.dispatch_nvfp4->num_rows(), kept.size() / size_t(H));
  EXPECT_GT(f.dispatch_nvfp4->num_rows(), 0u);
  EXPECT_LE(f.combine_nvfp4->num_rows(), 5u);
  const Nvfp4Blocks sample(kept.data(), nullptr, int64_t(kept.size()) / H, H);
  for (float a : {0.1f, 1.0f, f.dispatch_amax}) EXPECT_EQ(f.dispatch_nvfp4->qdq_squared_error(a), sample.qdq_squared_error(a));
  // The mse row's amax is derived from the sample; the histograms are those of the full run.
  for (const EvalRow& row : few.rows) {
    if (row.recipe == "moe_dispatch_nvfp4") {
      EXPECT_EQ(*row.dispatch_amax, derive_amax(*f.dispatch_hist, o_.calibration[0], Format::kNvfp4, "t", &sample).amax);
    }
  }
  EXPECT_EQ(f.dispatch_hist->total(), hist.total());
  o_.nvfp4_sample_elements = 0;
  EXPECT_NE(error_of([&] { run_eval(o_); }).find("nvfp4_sample_elements must be > 0"), std::string::npos);
}

// moefq calibrate --calibration percentile: the file says so, holds the percentile's amax (no
// per-rank maxima, which no longer bound it) and loads back; mse (format-dependent) is refused.
TEST_F(EvalLib, CalibratePercentileFileRoundTrips) {
  o_.layers = {0};
  o_.tokens = 64;
  EvalSetup setup;
  const CalibrationState max = run_calibration(o_, &setup);
  o_.calibration = {parse_calibration_method("percentile:99.9", "t")};
  const CalibrationState p = run_calibration(o_, &setup);
  EXPECT_EQ(p.algorithm, "percentile 99.9");
  EXPECT_EQ(p.source.rfind("percentile 99.9 calibration on", 0), 0u) << p.source;
  ASSERT_EQ(p.layers.size(), 1u);
  EXPECT_LT(p.layers[0].dispatch_amax, max.layers[0].dispatch_amax);
  EXPECT_EQ(p.layers[0].dispatch_amax,
            derive_amax(*p.layers[0].dispatch_hist, o_.calibration[0], Format::kFp8, "t").amax);
  const std::string file = (root_ / "p.json").string();
  save_eval_calibration(file, p, setup);
  const nlohmann::json j = nlohmann::json::parse(read_text_of(file));
  EXPECT_EQ(j.at("algorithm"), "percentile 99.9");
  EXPECT_FALSE(j.at("quantizers").at("layers.0.mlp.experts.dispatch_quantizer").contains("rank_amax"));
  const CalibrationState back = load_eval_calibration(file, setup);
  EXPECT_EQ(back.algorithm, "percentile 99.9");
  EXPECT_EQ(back.layers[0].dispatch_amax, p.layers[0].dispatch_amax);
  EXPECT_EQ(back.layers[0].combine_amax, p.layers[0].combine_amax);
  // An eval on that file says whose amax its rows use.
  EvalOptions e = o_;
  e.calibration.clear();
  e.load_calibration = file;
  e.recipes = {"moe_dispatch_fp8"};
  const EvalResult r = run_eval(e);
  EXPECT_EQ(r.setup.calibration, "percentile 99.9 (loaded)");
  ASSERT_EQ(r.rows.size(), 1u);
  EXPECT_EQ(r.rows[0].calibration, "percentile 99.9 (loaded)");
  EXPECT_EQ(*r.rows[0].dispatch_amax, p.layers[0].dispatch_amax);
  o_.calibration = {parse_calibration_method("mse", "t")};
  EXPECT_NE(error_of([&] { run_calibration(o_); }).find("the MSE-optimal amax depends on the recipe's format"),
            std::string::npos);
}

// A recipe names its calibration as Model Optimizer does.
TEST(RecipeCalibration, AlgorithmMethods) {
  const Recipe p = parse_recipe_text("$import: [moe_dispatch_fp8]\nalgorithm: {method: percentile, percentile: 99.9}\n", "t");
  EXPECT_EQ(p.algorithm, "percentile");
  EXPECT_EQ(p.calibration.name(), "percentile 99.9");
  const Recipe m = parse_recipe_text("$import: [moe_dispatch_fp8]\nalgorithm: {method: mse, step_size: 0.5}\n", "t");
  EXPECT_EQ(m.calibration.kind, CalibrationMethod::Kind::kMse);
  EXPECT_EQ(m.calibration.mse_multipliers().size(), 9u);  // ceil(3.75 / 0.5) + 1
  EXPECT_EQ(parse_recipe_text("$import: [moe_dispatch_fp8]\nalgorithm: mse\n", "t").calibration.name(), "mse");
  for (const char* bad : {"algorithm: {method: mse, percentile: 99}\n", "algorithm: {method: percentile, percentile: 101}\n",
                          "algorithm: awq_lite\n"})
    EXPECT_THROW((void)parse_recipe_text(std::string("$import: [moe_dispatch_fp8]\n") + bad, "t"), Error) << bad;
}

}  // namespace
}  // namespace moefq
