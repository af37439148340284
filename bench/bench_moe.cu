#include "bench/bench_moe.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>

#include "bench/bench_cuda_util.cuh"
#include "bench/bench_memory.h"
#include "bench/ceilings.cuh"
#include "bench/moe_inputs.h"
#include "fakequant/cuda/cuda_fake_quant.cuh"
#include "moefq/cuda_device.h"
#include "eval/layer_runner.h"
#include "moefq/errors.h"
#include "moefq/fileio.h"
#include "moefq/recipe.h"
#include "moefq/synthetic.h"

namespace moefq::bench {
namespace {

using cuda::DeviceBuffer;

// The configurations. fp8 holds a constant amax; the block formats use the shipped units, whose
// global amax (nvfp4) comes from max calibration, run on the benchmark's own batch before timing.
// nvfp4-gs1 holds the constant amax 2688 (global scale 1) instead: for this layer's small
// outputs that puts many block scales into e4m3's subnormal range, where blocks are no longer
// "tame" (numerics.h) and the combine takes its slower rule, so timing depends on the scale.
struct BenchConfig {
  const char* recipe;
  bool calibrate;
};
const std::map<std::string, BenchConfig>& config_recipes() {
  static const std::map<std::string, BenchConfig> recipes = {
      {"none", {"quant_cfg:\n  - quantizer_name: '*'\n    enable: false\n", false}},
      {"dispatch-fp8",
       {"quant_cfg:\n  - quantizer_name: '*dispatch_quantizer'\n    cfg: {num_bits: e4m3, constant_amax: 1000}\n", false}},
      {"combine-fp8",
       {"quant_cfg:\n  - quantizer_name: '*combine_quantizer'\n    cfg: {num_bits: e4m3, constant_amax: 1000}\n", false}},
      {"both-fp8",
       {"quant_cfg:\n  - quantizer_name: '*dispatch_quantizer'\n    cfg: {num_bits: e4m3, constant_amax: 1000}\n"
        "  - quantizer_name: '*combine_quantizer'\n    cfg: {num_bits: e4m3, constant_amax: 1000}\n",
        false}},
      {"dispatch-nvfp4", {"$import: moe_dispatch_nvfp4\n", true}},
      {"combine-nvfp4", {"$import: moe_combine_nvfp4\n", true}},
      {"both-nvfp4", {"$import: [moe_dispatch_nvfp4, moe_combine_nvfp4]\n", true}},
      {"both-nvfp4-gs1",
       {"$import: [moe_dispatch_nvfp4, moe_combine_nvfp4]\nquant_cfg:\n  - quantizer_name: '*'\n"
        "    cfg: {num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3}, constant_amax: 2688}\n",
        false}},
      {"both-mxfp8", {"$import: [moe_dispatch_mxfp8, moe_combine_mxfp8]\n", false}},
  };
  return recipes;
}

// What a figure sits beside: DeepGEMM's SM90 FP8 Mega-MoE per-rank times published on 8 x H200
// (EP8, one fused kernel, NVLink traffic included; this benchmark runs one rank without
// communication), and this project's targets for the unquantized layer.
struct LayerReference {
  const char* preset;
  int64_t tokens;
  double published_us, target_us;  // 0: none
};
constexpr LayerReference kLayerReferences[] = {
    {"deepseek-v3", 8, 404, 0},         {"deepseek-v3", 128, 490, 400},      {"deepseek-v3", 1024, 1222, 0},
    {"deepseek-v3", 4096, 0, 3000},     {"deepseek-v3", 8192, 7492, 0},      {"deepseek-v4-flash", 8, 225, 0},
    {"deepseek-v4-flash", 512, 413, 340}, {"deepseek-v4-flash", 8192, 3269, 2600}, {"deepseek-v4-pro", 8, 637, 0},
    {"deepseek-v4-pro", 512, 1004, 0},  {"deepseek-v4-pro", 8192, 7939, 0},
};
LayerReference layer_reference(const std::string& preset, int64_t tokens) {
  for (const LayerReference& r : kLayerReferences)
    if (preset == r.preset && tokens == r.tokens) return r;
  return {nullptr, tokens, 0, 0};
}

}  // namespace

int run_bench_moe(const MoeBenchOptions& o) {
  check_moe_bench_options(o);  // bad names, counts and splits before any work
  std::vector<std::string> configs = o.configs.empty() ? moe_bench_configs() : o.configs;
  configs.erase(std::remove(configs.begin(), configs.end(), "none"), configs.end());
  configs.insert(configs.begin(), "none");  // the baseline of every overhead, first
  MOEFQ_CHECK(cuda::device_count() > 0, "moefq bench moe: no CUDA device is visible");
  // A preset whose layer does not fit is refused before the first allocation.
  register_cuda_layer_runner();  // the GPU memory query the plan asks
  check_moe_bench_memory(o);
  std::optional<AtomicFile> out;  // the JSON path is checked before any work
  if (!o.json.empty()) out.emplace(o.json);

  const std::string device = cuda::device_description();
  std::fprintf(stderr, "moefq bench moe on %s, %s\n", device.c_str(), today().c_str());
  const double copy = copy_gbs(size_t(1) << 30);
  nlohmann::json report = {{"device", device}, {"date", today()}, {"copy_gbs", copy}, {"ep", o.ep}};
  std::printf("device-to-device copy: %.0f GB/s\n", copy);
  int64_t tmax = *std::max_element(o.tokens.begin(), o.tokens.end());
  // The shared expert runs on a second stream beside the routed experts, as serving frameworks
  // overlap it: the layer's time is that of both branches.
  SideStream side;

  for (const std::string& name : o.presets) {
    const MoeConfig c = moe_rank_config(name, o.ep);
    const int64_t H = c.hidden, I = c.intermediate, K = c.top_k, E = c.num_experts, Is = I * c.num_shared;
    const Staging staging = moe_bench_staging(o, c);
    // The compute ceiling: cuBLASLt on the layer's largest GEMM at the largest token count, in the
    // layer's operand type: FP8 with staging e4m3, bf16 with staging none (bf16 weights and
    // activations, whose tensor-core rate is half FP8's).
    const bool bf16_layer = staging == Staging::kNone;
    const double peak_us = bf16_layer ? cublaslt_bf16_gemm_us(tmax * K, 2 * I, H, nullptr, nullptr)
                                      : cublaslt_fp8_gemm_us(tmax * K, 2 * I, H);
    const double peak_tflops = 2.0 * double(tmax * K) * double(2 * I) * double(H) / peak_us * 1e-6;
    std::printf("\n%s, one rank of EP%lld: H %lld, I %lld, %lld local experts, K %lld, shared %lld, staging %s; "
                "cuBLASLt %s %.0f TFLOPS at %lld x %lld x %lld\n",
                name.c_str(), (long long)o.ep, (long long)H, (long long)I, (long long)E, (long long)K,
                (long long)c.num_shared, staging_name(staging), bf16_layer ? "bf16" : "FP8", peak_tflops,
                (long long)(tmax * K), (long long)(2 * I), (long long)H);
    std::printf("%6s  %-13s  %10s  %8s  %8s  %8s  %9s  %7s  %8s  %9s  %9s  %7s  %8s  %7s\n", "tokens", "config",
                "time_us", "TFLOPS", "dg_TFLOP", "wt_GB/s", "floor_us", "of_floor", "overhead", "quant_us", "skip_us",
                "q_share", "publ_us", "target");
    nlohmann::json pj = {{"preset", name}, {"hidden", H}, {"intermediate", I}, {"local_experts", E}, {"top_k", K},
                         {bf16_layer ? "cublaslt_bf16_tflops" : "cublaslt_fp8_tflops", peak_tflops},
                         {"staging", staging_name(staging)}};
    // The host weights are freed once uploaded.
    cuda::CudaFakeQuantMoe fq(
        [&] {
          std::vector<LayerWeights> weights;
          weights.push_back(repeated_weights(c, 0, E, moe_bench_weight_format(staging)));
          return std::make_unique<cuda::CudaEngine>(c, 1, tmax, weights, moe_bench_engine_options(staging, false));
        }(),
        0);
    for (int64_t T : o.tokens) {
      // Uniform routing: K distinct local experts per token.
      const Routing routing = uniform_routing(T, K, E, static_cast<uint64_t>(T));
      const std::vector<int32_t>& idx = routing.idx;
      const std::vector<float>& wt = routing.wt;
      std::vector<bool> touched(size_t(E), false);
      for (int32_t e : idx) touched[size_t(e)] = true;
      const int64_t touched_n = std::count(touched.begin(), touched.end(), true);
      std::vector<bf16> xh(size_t(T * H));
      const std::vector<float> xf = synthetic_activations(T, H, 7);
      for (size_t i = 0; i < xh.size(); ++i) xh[i].bits = bf16_round(xf[i]);
      DeviceBuffer<bf16> x(xh), y(size_t(T * H)), ys(size_t(T * H));
      DeviceBuffer<int32_t> di(idx);
      DeviceBuffer<float> dw(wt);
      const cuda::DeviceBatch batch{x.get(), T, di.get(), dw.get(), y.get()};

      const double flops = 2.0 * double(T * K) * double(3 * I * H) + 2.0 * double(T) * double(3 * Is * H);
      // DeepGEMM's count: the routed rows' three GEMM shapes only (2 x rows x H x I x 3).
      const double dg_flops = 2.0 * double(T * K) * double(H) * double(I) * 3.0;
      const LayerReference ref = layer_reference(name, T);
      const double weight_bytes =
          (double(touched_n * 3 * I * H) + double(3 * Is * H)) * (staging == Staging::kNone ? 2.0 : 1.0);
      const double floor_us = std::max(flops / (peak_tflops * 1e6), weight_bytes / (copy * 1e3));
      // Every configuration captured in its own graph (after an eager call: the layout check,
      // once), then all timed round-robin so drifts of clock and temperature hit them alike.
      // The quantizers' own kernels are timed too: the end-to-end difference also carries the
      // GEMMs' data-dependent clock (quantized tokens change the tensor cores' power draw).
      // The configurations share one fake quantizer, whose device amax the graphs read at replay:
      // each graph first copies back its own configuration's values (saved after calibration).
      // A combine quantizer that passed its layout check makes the engine skip its own combine, so
      // that saving is timed as well (the engine's combine alone) and taken off its cost.
      std::vector<TimedCase> cases;
      std::vector<char> combine_on(configs.size(), 0);
      std::vector<DeviceBuffer<float>> saved_amax;
      saved_amax.reserve(configs.size());  // the graphs keep pointers into these
      for (size_t ci = 0; ci < configs.size(); ++ci) {
        const std::string& cfg = configs[ci];
        DeviceBuffer<float>& saved = saved_amax.emplace_back(fq.device_amax().size());
        const auto restore_amax = [&fq, &saved](cudaStream_t s) {
          MOEFQ_CUDA_CHECK(cudaMemcpyAsync(fq.device_amax().get(), saved.get(), saved.bytes(), cudaMemcpyDeviceToDevice, s));
        };
        auto prepare = [&fq, &batch, &saved, &on = combine_on[ci], cfg] {
          const BenchConfig& bc = config_recipes().at(cfg);
          fq.configure(apply_recipe(parse_recipe_text(bc.recipe, cfg), fq.quantizer_names()));
          if (bc.calibrate) {
            fq.start_calibration();
            fq.forward({&batch, 1}, nullptr);
            fq.finish_calibration();
          }
          fq.forward({&batch, 1}, nullptr);
          fq.synchronize(nullptr);
          MOEFQ_CUDA_CHECK(cudaMemcpy(saved.get(), fq.device_amax().get(), saved.bytes(), cudaMemcpyDeviceToDevice));
          on = fq.quantizers().combine(0).enabled();
        };
        cases.push_back({prepare, [&, restore_amax](int i, cudaStream_t s) {
                           if (i == 0) restore_amax(s);
                           if (c.num_shared == 0) return fq.forward({&batch, 1}, s);  // Qwen3, Mixtral, OLMoE
                           side.fork(s);
                           fq.engine().shared_expert(0, x.get(), T, ys.get(), side.stream);
                           fq.forward({&batch, 1}, s);
                           side.join(s);
                         }});
        cases.push_back({prepare, [&, restore_amax](int i, cudaStream_t s) {
                           if (i == 0) restore_amax(s);
                           fq.quantizers_only({&batch, 1}, s);
                         }});
      }
      cases.push_back({nullptr, [&](int, cudaStream_t s) { fq.engine().combine({&batch, 1}, s); }});
      const std::vector<double> times = interleaved_median_us(cases, o.calls_per_graph, o.reps);
      const double engine_combine_us = times.back();
      for (size_t i = 0; i < configs.size(); ++i) {
        const double us = times[2 * i], quant_us = i == 0 ? 0.0 : times[2 * i + 1];
        const double skip_us = combine_on[i] ? engine_combine_us : 0.0;
        const double overhead = us / times[0] - 1.0, kernel_overhead = (quant_us - skip_us) / times[0];  // configs[0]: none
        const auto ref_cell = [&](double v) { return i == 0 && v > 0 ? std::to_string(std::llround(v)) : std::string("-"); };
        std::printf("%6lld  %-13s  %10.1f  %8.1f  %8.1f  %8.0f  %9.1f  %7.2f  %+7.1f%%  %9.1f  %9.1f  %6.1f%%  %8s  %7s\n",
                    (long long)T, configs[i].c_str(), us, flops / us * 1e-6, dg_flops / us * 1e-6,
                    weight_bytes / us * 1e-3, floor_us, floor_us / us, 100.0 * overhead, quant_us, skip_us,
                    100.0 * kernel_overhead, ref_cell(ref.published_us).c_str(), ref_cell(ref.target_us).c_str());
        nlohmann::json run = {{"tokens", T}, {"config", configs[i]}, {"time_us", us}, {"tflops", flops / us * 1e-6},
                              {"deepgemm_tflops", dg_flops / us * 1e-6},
                              {"weight_gbs", weight_bytes / us * 1e-3}, {"floor_us", floor_us},
                              {"fraction_of_floor", floor_us / us}, {"overhead", overhead},
                              {"quantizer_us", quant_us}, {"skipped_engine_combine_us", skip_us},
                              {"quantizer_overhead", kernel_overhead},
                              {"touched_experts", touched_n}};
        if (i == 0 && ref.published_us > 0) run["published_ep8_us"] = ref.published_us;
        if (i == 0 && ref.target_us > 0) run["target_us"] = ref.target_us;
        pj["runs"].push_back(run);
      }
    }
    report["presets"].push_back(pj);
  }
  if (out) {
    const std::string text = report.dump(2) + "\n";
    out->write(text.data(), text.size());
    out->commit();
  }
  return 0;
}

}  // namespace moefq::bench
