#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <functional>
#include <nlohmann/json.hpp>
#include <vector>

#include "bench/bench.h"
#include "bench/bench_cuda_util.cuh"
#include "bench/bench_memory.h"
#include "cuda_base/cuda_check.h"
#include "cuda_base/device_buffer.h"
#include "quant/cuda/qdq_kernels.cuh"
#include "eval/layer_runner.h"
#include "moefq/cuda_device.h"
#include "moefq/fileio.h"
#include "moefq/qdq.h"
#include "moefq/synthetic.h"

namespace moefq::bench {
namespace {

using cuda::DeviceBuffer;

struct Case {
  std::string name;
  std::optional<Format> format;  // nullopt: the e4m3 staging cast
  bool dynamic = false;          // measure the amax pass too
  bool saturating = false;       // amax far below the data's max: many blocks saturate
};

}  // namespace

int run_bench_qdq(const QdqBenchOptions& o) {
  MOEFQ_CHECK(cuda::device_count() > 0, "moefq bench qdq: no CUDA device is visible");
  MOEFQ_CHECK(o.cols > 0 && o.cols % kStageBlock == 0, "--cols must be a positive multiple of 128");
  std::vector<Case> cases;
  if (o.formats.empty()) {
    for (Format f : kAllFormats) cases.push_back({format_name(f), f});
    cases.push_back({"fp8+amax", Format::kFp8, true});
    cases.push_back({"nvfp4-sat", Format::kNvfp4, false, true});
    cases.push_back({"stage_e4m3", std::nullopt});
  } else {
    for (const std::string& n : o.formats) {
      if (n == "stage_e4m3") { cases.push_back({n, std::nullopt}); continue; }
      const auto f = parse_format(n);
      MOEFQ_CHECK(f.has_value(), "--formats: unknown format '", n, "' (expected ", format_choices(), " or stage_e4m3)");
      cases.push_back({n, *f});
    }
  }
  MOEFQ_CHECK(!o.rows.empty(), "--rows: no row counts");
  for (int64_t rows : o.rows) MOEFQ_CHECK(rows > 0, "--rows must be positive");
  int dev = 0, l2 = 0;
  MOEFQ_CUDA_CHECK(cudaGetDevice(&dev));
  MOEFQ_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  // Every buffer below is sized by the plan's own function; a run that does not fit is refused
  // before the first allocation.
  register_cuda_layer_runner();  // the GPU memory query the plan asks
  check_qdq_bench_memory(o, l2);
  const std::string device = cuda::device_description();
  std::fprintf(stderr, "moefq bench qdq on %s, %s\n", device.c_str(), today().c_str());

  nlohmann::json report;
  report["tool"] = "moefq bench qdq";
  report["version"] = MOEFQ_VERSION;
  report["device"] = device;
  report["date"] = today();
  report["cols"] = o.cols;
  std::printf("%7s  %-18s  %10s  %9s  %9s  %6s  %s\n", "rows", "case", "time_us", "GB/s", "copy_GB/s", "ratio", "check");
  bool all_ok = true;
  for (int64_t rows : o.rows) {
    // Rotating over enough input sets that they do not fit in L2 together.
    const QdqBenchSizes sz = qdq_bench_sizes(o, rows, l2);
    const int64_t n = sz.elems;
    const size_t bytes = size_t(n) * 2;
    const int sets = sz.sets;
    const int64_t sample_rows = sz.sample_rows;
    std::vector<bf16> sample;
    for (float v : synthetic_activations(sample_rows, o.cols, uint64_t(rows))) sample.push_back({bf16_round(v)});
    std::vector<DeviceBuffer<bf16>> in, out;
    std::vector<DeviceBuffer<uint8_t>> out8;
    std::vector<DeviceBuffer<float>> scales;
    for (int s = 0; s < sets; ++s) {
      in.emplace_back(size_t(n));
      out.emplace_back(size_t(n));
      for (int64_t r = 0; r < rows; r += sample_rows) {
        const int64_t len = std::min(sample_rows, rows - r) * o.cols;
        MOEFQ_CUDA_CHECK(cudaMemcpy(in[s].get() + r * o.cols, sample.data(), size_t(len) * 2, cudaMemcpyHostToDevice));
      }
    }
    // The calibrated amax, held on the device: the max |x| of the data, as max calibration on it
    // gives. The "-sat" case uses 1/500 of it, so blocks holding outlier channels saturate.
    DeviceBuffer<float> amax(std::vector<float>{0.0f});
    cuda::launch_amax(DType::kBF16, in[0].get(), n, amax.get(), nullptr);
    const float calibrated = amax.download()[0];
    const float saturating = calibrated / 500.0f;
    // The copy ceiling: device-to-device copy of the same bytes.
    const double copy_us = median_us([&](int i, cudaStream_t s) {
      MOEFQ_CUDA_CHECK(cudaMemcpyAsync(out[i % sets].get(), in[i % sets].get(), bytes, cudaMemcpyDeviceToDevice, s));
    }, o.launches_per_graph, o.reps);
    const double copy_gbs = 2.0 * double(bytes) / copy_us * 1e-3;
    std::printf("%7lld  %-18s  %10.2f  %9.1f  %9.1f  %6.3f  %s\n", (long long)rows, "copy", copy_us, copy_gbs, copy_gbs, 1.0, "-");
    nlohmann::json row = {{"rows", rows}, {"copy_us", copy_us}, {"copy_gbs", copy_gbs}, {"sets", sets}};
    for (const Case& c : cases) {
      double us = 0, moved = 0;
      bool ok = true;
      if (!c.format) {
        MOEFQ_ASSERT(sz.stage, "moefq bench qdq: the memory plan left out the stage_e4m3 buffers");
        out8.clear();
        scales.clear();
        for (int s = 0; s < sets; ++s) {
          out8.emplace_back(size_t(n));
          scales.emplace_back(size_t(n / kStageBlock));
        }
        us = median_us([&](int i, cudaStream_t s) {
          cuda::launch_stage_e4m3(in[i % sets].get(), out8[i % sets].get(), scales[i % sets].get(), rows, o.cols, s);
        }, o.launches_per_graph, o.reps);
        moved = double(bytes) + double(n) + double(n / kStageBlock) * 4;
        cuda::launch_stage_e4m3(in[0].get(), out8[0].get(), scales[0].get(), rows, o.cols, nullptr);
        std::vector<uint8_t> want8(sample.size()), got8(sample.size());
        std::vector<float> want_s(sample.size() / kStageBlock), got_s(want_s.size());
        stage_e4m3_ref(sample.data(), want8.data(), want_s.data(), sample_rows, o.cols);
        MOEFQ_CUDA_CHECK(cudaMemcpy(got8.data(), out8[0].get(), got8.size(), cudaMemcpyDeviceToHost));
        MOEFQ_CUDA_CHECK(cudaMemcpy(got_s.data(), scales[0].get(), got_s.size() * 4, cudaMemcpyDeviceToHost));
        ok = want8 == got8 && std::memcmp(want_s.data(), got_s.data(), got_s.size() * 4) == 0;
      } else {
        const Format f = *c.format;
        const float case_amax = c.saturating ? saturating : calibrated;
        MOEFQ_CUDA_CHECK(cudaMemcpy(amax.get(), &case_amax, 4, cudaMemcpyHostToDevice));
        us = median_us([&](int i, cudaStream_t s) {
          if (c.dynamic) {
            MOEFQ_CUDA_CHECK(cudaMemsetAsync(amax.get(), 0, sizeof(float), s));
            cuda::launch_amax(DType::kBF16, in[i % sets].get(), n, amax.get(), s);
          }
          cuda::launch_qdq(f, DType::kBF16, in[i % sets].get(), out[i % sets].get(), rows, o.cols, amax.get(), s);
        }, o.launches_per_graph, o.reps);
        moved = double(bytes) * (c.dynamic ? 3 : 2);
        // One correctness check of the benchmarked output (its first sample_rows rows).
        cuda::launch_qdq(f, DType::kBF16, in[0].get(), out[0].get(), rows, o.cols, amax.get(), nullptr);
        float a = 0;
        MOEFQ_CUDA_CHECK(cudaMemcpy(&a, amax.get(), 4, cudaMemcpyDeviceToHost));
        std::vector<bf16> want(sample.size()), got(sample.size());
        qdq_ref(f, sample.data(), want.data(), sample_rows, o.cols, a);
        MOEFQ_CUDA_CHECK(cudaMemcpy(got.data(), out[0].get(), got.size() * 2, cudaMemcpyDeviceToHost));
        ok = std::memcmp(want.data(), got.data(), got.size() * 2) == 0;
      }
      const double gbs = moved / us * 1e-3;
      all_ok = all_ok && ok;
      std::printf("%7lld  %-18s  %10.2f  %9.1f  %9.1f  %6.3f  %s\n", (long long)rows, c.name.c_str(), us, gbs,
                  copy_gbs, gbs / copy_gbs, ok ? "ok" : "MISMATCH");
      row["cases"].push_back({{"case", c.name}, {"time_us", us}, {"bytes", moved}, {"gbs", gbs},
                              {"ratio_to_copy", gbs / copy_gbs}, {"check", ok ? "ok" : "mismatch"}});
    }
    report["results"].push_back(row);
    std::fflush(stdout);
  }
  if (!o.json.empty()) write_file_atomic(o.json, report.dump(2) + "\n");
  if (!all_ok) std::fprintf(stderr, "moefq bench qdq: a correctness check FAILED\n");
  return all_ok ? 0 : 1;
}

}  // namespace moefq::bench
