#include "bench/bench_combine.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <vector>

#include "bench/bench_cuda_util.cuh"
#include "bench/bench_memory.h"
#include "engine/cuda/combine_kernels.cuh"
#include "cuda_base/cuda_check.h"
#include "cuda_base/device_buffer.h"
#include "engine/expert_cpu.h"
#include "eval/layer_runner.h"
#include "moefq/cuda_device.h"
#include "moefq/fileio.h"
#include "moefq/qdq.h"
#include "moefq/quant_spec.h"
#include "moefq/synthetic.h"

namespace moefq::bench {
namespace {

using cuda::DeviceBuffer;

struct Variant {
  const char* name;
  bool fused;       // the fused shared slot is read too
  double inactive;  // fraction of routed slots set to -1
  bool check;       // the layout check runs in the same pass
};
constexpr Variant kVariants[] = {
    {"all", false, 0.0, false}, {"shared", true, 0.0, false}, {"10%-off", false, 0.1, false}, {"check", false, 0.0, true}};

// The first `sample` tokens of every slot hold distinct synthetic rows; later tokens repeat them
// (token t holds the rows of token t % sample), so the CPU reference needs only the sample.
struct Rows {
  int64_t T, K, H, sample;
  std::vector<std::vector<bf16>> host;  // [K + 1][sample * H]
  DeviceBuffer<uint8_t> buffer;         // [K + 1][T][H] bf16 from offset 0
};

// The rows: synthetic activations times 2^scale_exp (host copies refilled too).
void fill(Rows& r, int scale_exp) {
  const size_t row = size_t(r.H) * 2, slot = size_t(r.T) * row;
  for (int64_t k = 0; k <= r.K; ++k) {
    auto& h = r.host[size_t(k)];
    h.clear();
    for (float v : synthetic_activations(r.sample, r.H, 1000 + uint64_t(k))) h.push_back({bf16_round(std::ldexp(v, scale_exp))});
    uint8_t* base = r.buffer.get() + size_t(k) * slot;
    MOEFQ_CUDA_CHECK(cudaMemcpy(base, h.data(), size_t(r.sample) * row, cudaMemcpyHostToDevice));
    for (int64_t have = r.sample; have < r.T; have *= 2) {
      const int64_t n = std::min(have, r.T - have);
      MOEFQ_CUDA_CHECK(cudaMemcpy(base + size_t(have) * row, base, size_t(n) * row, cudaMemcpyDeviceToDevice));
    }
  }
}

// LogFMT casts only blocks below 1, and combine rows (expert outputs times router weights) mostly
// are; the synthetic activations reach 1 in most blocks, which would time the bf16 fallback. Its
// rows are scaled by 2^-6 (every group cast); the other formats keep the activations as they are.
int data_scale_exp(std::optional<Format> f) { return f == Format::kLogfmt10 ? -6 : 0; }

// The target ratio to copy bandwidth of a combine quantizer kernel with every slot active
// (docs/performance.md): fp8 0.90; logfmt10 no slower than it is (0.23: it stays bit-exact with
// the CPU, about 35 instructions per element where the copy rate leaves room for fewer than 20);
// nvfp4 and every other format 0.80; the plain combine (nullopt) has none (0).
double target_ratio(std::optional<Format> f) {
  if (!f) return 0.0;
  if (*f == Format::kFp8) return 0.90;
  if (*f == Format::kLogfmt10) return 0.23;
  return 0.80;
}

// The CPU fake quantizer's combine (fake_quant_moe.cpp) of the first `sample` tokens; weights
// ([T, K]): null, or each routed row's router weight (combine_weighting after).
std::vector<bf16> reference(const Rows& r, const std::vector<int32_t>& idx, bool fused, std::optional<Format> f,
                            float amax, const float* weights) {
  std::vector<bf16> y(size_t(r.sample * r.H)), q(size_t(r.K * r.H));
  for (int64_t t = 0; t < r.sample; ++t) {
    const auto row = [&](int64_t k) -> const bf16* {
      const bf16* src = r.host[size_t(k)].data() + t * r.H;
      if (k == r.K || !f) return src;
      qdq_ref(*f, src, q.data() + k * r.H, 1, r.H, amax);
      return q.data() + k * r.H;
    };
    combine_token(idx.data() + t * r.K, weights ? weights + t * r.K : nullptr, r.K, fused, r.H, row, y.data() + t * r.H);
  }
  return y;
}

}  // namespace

int run_bench_combine(const CombineBenchOptions& o) {
  const CombineWeighting weighting = combine_weighting_option(o.combine_weighting, "--combine-weighting");
  const bool after = weighting == CombineWeighting::kAfter;
  MOEFQ_CHECK(cuda::device_count() > 0, "moefq bench combine: no CUDA device is visible");
  MOEFQ_CHECK(o.tokens > 0, "--tokens must be positive");
  MOEFQ_CHECK(o.top_k >= 1 && o.top_k <= 32, "--top-k must be in 1..32");
  MOEFQ_CHECK(o.hidden > 0 && o.hidden % kStageBlock == 0, "--hidden must be a positive multiple of 128");
  std::vector<std::optional<Format>> cases;  // nullopt: the plain combine
  if (o.formats.empty()) {
    cases.push_back(std::nullopt);
    for (Format f : kAllFormats) cases.push_back(f);
  } else {
    for (const std::string& n : o.formats) {
      if (n == "combine") {
        cases.push_back(std::nullopt);
        continue;
      }
      const auto f = parse_format(n);
      MOEFQ_CHECK(f.has_value(), "--formats: unknown format '", n, "' (expected combine or ", format_choices(), ")");
      cases.push_back(*f);
    }
  }
  const int64_t T = o.tokens, K = o.top_k, H = o.hidden;
  // Every buffer below is sized by the plan's own function; a run that does not fit is refused
  // before the first allocation.
  register_cuda_layer_runner();  // the GPU memory query the plan asks
  check_combine_bench_memory(o);
  const CombineBenchSizes sz = combine_bench_sizes(o);
  const std::string device = cuda::device_description();
  std::fprintf(stderr, "moefq bench combine on %s, %s\n", device.c_str(), today().c_str());

  Rows r{T, K, H, sz.sample, std::vector<std::vector<bf16>>(size_t(K + 1)), DeviceBuffer<uint8_t>(size_t(sz.rows) * 2)};
  int scale_exp = 0;
  fill(r, scale_exp);
  // Routing: every slot active, or ~10% of the routed slots off (deterministic).
  std::vector<int32_t> idx_all(size_t(sz.routing)), idx_off(size_t(sz.routing));
  std::mt19937_64 rng(7);
  for (int64_t i = 0; i < T * K; ++i) {
    idx_all[size_t(i)] = int32_t(i % K);
    idx_off[size_t(i)] = rng() % 10 == 0 ? -1 : int32_t(i % K);
  }
  const DeviceBuffer<int32_t> d_all(idx_all), d_off(idx_off);
  // Router weights (after only): top-k-like values in (0, 1], distinct per slot and token.
  std::vector<float> weights(size_t(sz.routing));
  for (float& w : weights) w = float(rng() % 1024 + 1) / 1024.0f * 0.3f;
  const DeviceBuffer<float> d_weights(weights);
  // The calibrated amax: max |x| over the routed rows (the sample holds every distinct row). Only
  // the formats with a global amax use it, and their rows are never rescaled.
  float calibrated = 0.0f;
  for (int64_t k = 0; k < K; ++k)
    calibrated = max_ignore_nan(calibrated, amax_ref(r.host[size_t(k)].data(), r.sample * H));
  const DeviceBuffer<float> d_amax(std::vector<float>{calibrated});
  DeviceBuffer<bf16> y_engine(size_t(sz.y)), y_out(size_t(sz.y));
  DeviceBuffer<cuda::CheckRecord> record(1);
  cuda::reset_check_record(record.get(), nullptr);

  // The ceiling: a device-to-device copy moving the bytes of the all-active case (read + write).
  const double copy = copy_gbs(size_t(sz.copy_ceiling), o.launches_per_graph, o.reps);

  nlohmann::json report;
  report["tool"] = "moefq bench combine";
  report["version"] = MOEFQ_VERSION;
  report["device"] = device;
  report["date"] = today();
  report["tokens"] = T;
  report["top_k"] = K;
  report["hidden"] = H;
  report["copy_gbs"] = copy;
  report["combine_weighting"] = combine_weighting_name(weighting);
  std::printf("T=%lld K=%lld H=%lld, router weight applied %s the combine, copy %.1f GB/s\n", (long long)T,
              (long long)K, (long long)H, combine_weighting_name(weighting), copy);
  std::printf("%-18s  %-8s  %10s  %9s  %6s  %-11s  %s\n", "format", "variant", "time_us", "GB/s", "ratio", "target",
              "check");
  bool all_ok = true;
  for (const auto& f : cases) {
    const char* fname = f ? format_name(*f) : "combine";
    if (data_scale_exp(f) != scale_exp) fill(r, scale_exp = data_scale_exp(f));
    for (const Variant& v : kVariants) {
      const std::vector<int32_t>& idx = v.inactive > 0 ? idx_off : idx_all;
      cuda::CombineRows rows;
      rows.buffer = r.buffer.get();
      rows.max_tokens = T;
      rows.top_k = K;
      rows.hidden = H;
      rows.fused_shared = v.fused;
      rows.topk_idx = v.inactive > 0 ? d_off.get() : d_all.get();
      rows.topk_weights = after ? d_weights.get() : nullptr;
      rows.num_tokens = T;
      cuda::CombineCheck check;
      if (v.check) {
        cuda::launch_combine(rows, y_engine.get(), nullptr);  // the engine's output of these rows
        check = {y_engine.get(), record.get(), false};
      }
      auto launch = [&](cudaStream_t s) {
        if (!f && !v.check)
          cuda::launch_combine(rows, y_out.get(), s);
        else
          cuda::launch_combine_qdq(rows, f.has_value(), f.value_or(Format::kFp8), d_amax.get(), check, y_out.get(), s);
      };
      const double us = median_us([&](int, cudaStream_t s) { launch(s); }, o.launches_per_graph, o.reps);
      int64_t rows_read = T * (v.fused ? 1 : 0);
      for (int32_t e : idx) rows_read += e >= 0 ? 1 : 0;
      const double bytes = double(rows_read * H) * 2 + double(T * H) * 2 * (v.check ? 2 : 1) + (after ? double(T * K) * 4 : 0);
      // One correctness check of the benchmarked output, and of the check's record.
      launch(nullptr);
      std::vector<bf16> got(size_t(r.sample * H));
      MOEFQ_CUDA_CHECK(cudaMemcpy(got.data(), y_out.get(), got.size() * 2, cudaMemcpyDeviceToHost));
      const std::vector<bf16> want = reference(r, idx, v.fused, f, calibrated, after ? weights.data() : nullptr);
      bool ok = std::memcmp(want.data(), got.data(), got.size() * 2) == 0;
      if (v.check) ok = ok && !cuda::read_check(record.get(), H, nullptr).has_value();
      all_ok = all_ok && ok;
      const double gbs = bytes / us * 1e-3;
      // The target applies to the all-active case with the weights already applied (before).
      const double target = v.inactive == 0 && !v.fused && !v.check && !after ? target_ratio(f) : 0.0;
      char tcol[32] = "-";
      if (target > 0) std::snprintf(tcol, sizeof tcol, ">=%.2f %s", target, gbs / copy >= target ? "met" : "NOT");
      std::printf("%-18s  %-8s  %10.2f  %9.1f  %6.3f  %-11s  %s\n", fname, v.name, us, gbs, gbs / copy, tcol,
                  ok ? "ok" : "MISMATCH");
      std::fflush(stdout);
      nlohmann::json res = {{"format", fname}, {"variant", v.name}, {"time_us", us}, {"bytes", bytes},
                            {"gbs", gbs}, {"ratio_to_copy", gbs / copy}, {"check", ok ? "ok" : "mismatch"},
                            {"data_scale_exp", scale_exp}, {"combine_weighting", combine_weighting_name(weighting)}};
      if (target > 0) {
        res["target_ratio"] = target;
        res["target_met"] = gbs / copy >= target;
      }
      report["results"].push_back(res);
    }
  }
  if (!o.json.empty()) write_file_atomic(o.json, report.dump(2) + "\n");
  if (!all_ok) std::fprintf(stderr, "moefq bench combine: a correctness check FAILED\n");
  return all_ok ? 0 : 1;
}

}  // namespace moefq::bench
