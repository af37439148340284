// moefq bench fake-quant: the accuracy cost of each dispatch/combine recipe on one MoE layer
// (CPU engine, synthetic weights and activations): calibrate on some batches, evaluate on
// held-out ones, error metrics of numerics.md against the unquantized layer.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "moefq/errors.h"
#include "moefq/fake_quant_moe.h"
#include "moefq/fileio.h"
#include "moefq/metrics.h"
#include "moefq/router.h"
#include "moefq/synthetic.h"

namespace moefq::bench {
namespace {

struct Batch {
  std::vector<std::vector<bf16>> x, y;  // per rank [T, H]
  std::vector<Routing> routing;
  std::vector<RankBatch> views() {
    std::vector<RankBatch> b;
    for (size_t r = 0; r < x.size(); ++r)
      b.push_back({x[r].data(), routing[r].num_tokens, routing[r].topk_idx.data(), routing[r].topk_weights.data(),
                   y[r].data()});
    return b;
  }
};

// The layer's output as the model sees it: routed part plus the separately run shared expert.
std::vector<float> layer_output(FakeQuantMoe& fq, Batch& b) {
  fq.forward(b.views());
  std::vector<float> out;
  const int64_t H = fq.backend().config().hidden;
  for (size_t r = 0; r < b.x.size(); ++r) {
    const int64_t T = b.routing[r].num_tokens;
    std::vector<bf16> shared(size_t(T * H));
    if (fq.backend().config().num_shared > 0) fq.backend().shared_expert(int64_t(r), b.x[r].data(), T, shared.data());
    for (int64_t i = 0; i < T * H; ++i)
      out.push_back(bf16_to_f32(bf16_round(add_rn(to_f32(b.y[r][size_t(i)]), to_f32(shared[size_t(i)])))));
  }
  return out;
}

}  // namespace

int run_bench_fake_quant(const FakeQuantBenchOptions& o) {
  MoeConfig cfg = preset(o.preset);
  if (o.experts > 0) {
    cfg.num_experts = o.experts;
    cfg.name += " (" + std::to_string(o.experts) + " experts)";
  }
  cfg.validate();
  MOEFQ_CHECK(cfg.num_experts % o.ranks == 0, "--ranks must divide the expert count (", cfg.num_experts, ")");
  const int64_t R = o.ranks, T = o.tokens, H = cfg.hidden, el = cfg.num_experts / R;
  std::fprintf(stderr, "moefq bench fake-quant: %s, %lld ranks x %lld tokens, generating weights...\n", cfg.name.c_str(),
               (long long)R, (long long)T);
  std::vector<LayerWeights> w;
  for (int64_t r = 0; r < R; ++r) w.push_back(synthetic_weights(cfg, WeightFormat::kE4m3, o.seed, r * el, el));
  // The shared expert runs unfused, as the model does, so dispatch quantization is allowed.
  FakeQuantMoe fq(make_expert_backend("mega_moe", cfg, R, T, w, {false, 0}), 0);
  std::vector<Batch> batches(size_t(o.calib_batches + o.eval_batches));
  for (size_t i = 0; i < batches.size(); ++i)
    for (int64_t r = 0; r < R; ++r) {
      Batch& b = batches[i];
      b.x.emplace_back();
      for (float v : synthetic_activations(T, H, o.seed * 1000 + i * 16 + uint64_t(r))) b.x.back().push_back({bf16_round(v)});
      b.y.emplace_back(size_t(T * H));
      b.routing.push_back(route(cfg, b.x.back().data(), T, w[0].gate, w[0].gate_bias));
    }
  auto eval = [&]() {
    std::vector<float> all;
    for (size_t i = size_t(o.calib_batches); i < batches.size(); ++i) {
      const auto y = layer_output(fq, batches[i]);
      all.insert(all.end(), y.begin(), y.end());
    }
    return all;
  };
  fq.configure({});
  std::fprintf(stderr, "  [1/%zu] none\n", size_t(13));
  const std::vector<float> reference = eval();

  struct Row {
    std::string recipe;
    float dispatch_amax = 0, combine_amax = 0;
    ErrorMetrics m;
  };
  std::vector<Row> rows(1);  // "none": error exactly 0 by construction, the baseline itself
  rows[0].recipe = "none";
  rows[0].m = compute_metrics(reference.data(), reference.data(), int64_t(reference.size()));
  const char* formats[] = {"fp8", "nvfp4", "mxfp8", "mxfp4"};
  const char* sides[] = {"dispatch", "combine", "both"};
  int step = 1;
  for (const char* f : formats)
    for (const char* side : sides) {
      const std::string name = std::string(side) + " " + f;
      std::fprintf(stderr, "  [%d/13] %s: calibrating, evaluating\n", ++step, name.c_str());
      std::string units = std::string(side) == "both"
                              ? std::string("moe_dispatch_") + f + ", moe_combine_" + f
                              : std::string("moe_") + side + "_" + f;
      const Recipe recipe = parse_recipe_text("$import: [" + units + "]\nalgorithm: max\n", name);
      fq.configure(apply_recipe(recipe, fq.quantizer_names()));
      fq.start_calibration();
      for (int i = 0; i < o.calib_batches; ++i) fq.forward(batches[size_t(i)].views());
      fq.finish_calibration();
      const std::vector<float> y = eval();
      Row row;
      row.recipe = name;
      const Quantizer& d = fq.dispatch_quantizer(0);
      const Quantizer& c = fq.combine_quantizer(0);
      row.dispatch_amax = d.enabled() && d.amax() ? *d.amax() : 0.0f;
      row.combine_amax = c.enabled() && c.amax() ? *c.amax() : 0.0f;
      row.m = compute_metrics(y.data(), reference.data(), int64_t(y.size()));
      rows.push_back(row);
    }
  std::printf("%s, %lld ranks x %lld tokens, %d calibration + %d evaluation batches, seed %llu\n", cfg.name.c_str(),
              (long long)R, (long long)T, o.calib_batches, o.eval_batches, (unsigned long long)o.seed);
  std::printf("%-16s %12s %12s %10s %10s %10s %10s %8s\n", "recipe", "disp_amax", "comb_amax", "rel_l2", "cosine",
              "calc_diff", "max_abs", "snr_db");
  nlohmann::json j = {{"tool", "moefq bench fake-quant"}, {"config", cfg.name}, {"ranks", R}, {"tokens", T}};
  for (const Row& r : rows) {
    std::printf("%-16s %12.6g %12.6g %10.4g %10.6f %10.4g %10.4g %8.2f\n", r.recipe.c_str(), r.dispatch_amax,
                r.combine_amax, r.m.rel_l2, r.m.cosine, r.m.calc_diff, r.m.max_abs, r.m.snr_db);
    j["results"].push_back({{"recipe", r.recipe}, {"dispatch_amax", r.dispatch_amax}, {"combine_amax", r.combine_amax},
                            {"rel_l2", r.m.rel_l2}, {"cosine", r.m.cosine}, {"calc_diff", r.m.calc_diff},
                            {"max_abs", r.m.max_abs}, {"snr_db", r.m.snr_db}});
  }
  if (!o.json.empty()) write_file_atomic(o.json, j.dump(2) + "\n");
  return 0;
}

}  // namespace moefq::bench
