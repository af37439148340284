#include "bench/bench_gemm.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_cuda_util.cuh"
#include "bench/bench_memory.h"
#include "bench/ceilings.cuh"
#include "bench/gpu_telemetry.h"
#include "cuda_base/cuda_check.h"
#include "cuda_base/device_buffer.h"
#include "engine/cuda/grouped_gemm.cuh"
#include "moefq/cuda_device.h"
#include "engine/gemm_cpu.h"
#include "eval/layer_runner.h"
#include "moefq/fileio.h"
#include "moefq/numerics.h"

namespace moefq::bench {
namespace {

using cuda::DeviceBuffer;

// Deterministic fill: e4m3 codes of N(0, 0.4 * 448)-like magnitudes (no NaN), or fp32 scales.
__global__ void fill_e4m3_kernel(uint8_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    p[i] = e4m3_encode_sat(bench_triangular(i, seed) * 400.0f);
  }
}
__global__ void fill_scale_kernel(float* p, int64_t n, uint64_t seed, float lo_exp, float hi_exp) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t h = bench_hash(i, seed);
    p[i] = exp2f(lo_exp + (hi_exp - lo_exp) * float(h >> 8) / 16777216.0f);
  }
}
void fill_e4m3(uint8_t* p, int64_t n, uint64_t seed) {
  fill_e4m3_kernel<<<1024, 256>>>(p, n, seed);
  MOEFQ_CUDA_CHECK_LAUNCH();
}
void fill_scale(float* p, int64_t n, uint64_t seed, float lo, float hi) {
  fill_scale_kernel<<<256, 256>>>(p, n, seed, lo, hi);
  MOEFQ_CUDA_CHECK_LAUNCH();
}

}  // namespace

int run_bench_gemm(const GemmBenchOptions& o) {
  const int64_t H = o.hidden, I = o.inter, G = o.experts, hb = H / 128, ib = I / 128;
  MOEFQ_CHECK(cuda::device_count() > 0, "moefq bench gemm: no CUDA device is visible");
  // The CLI checks these when it parses the options (src/cli/cmd_bench.cpp); here for other callers.
  MOEFQ_CHECK(H > 0 && H % 128 == 0, "--hidden ", H, ": expected a positive multiple of 128");
  MOEFQ_CHECK(I > 0 && I % 128 == 0, "--inter ", I, ": expected a positive multiple of 128");
  MOEFQ_CHECK(G > 0, "--experts ", G, ": expected at least 1");
  MOEFQ_CHECK(o.top_k >= 1, "--top-k ", o.top_k, ": expected at least 1");
  MOEFQ_CHECK(!o.tokens.empty(), "--tokens: no token counts");
  for (int64_t t : o.tokens) MOEFQ_CHECK(t >= 1, "--tokens: ", t, " is not a positive token count");
  // Every buffer below is sized by the plan's own function; a run that does not fit is refused
  // before the first allocation.
  register_cuda_layer_runner();  // the GPU memory query the plan asks
  check_gemm_bench_memory(o);
  const GemmBenchSizes sz = gemm_bench_sizes(o);
  const int64_t max_rows = sz.max_rows;
  cudaDeviceProp prop;
  MOEFQ_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const std::string date = today();
  std::printf("moefq bench gemm: %s (%d SMs), %s; H=%lld I=%lld, %lld local experts, top-%lld\n", prop.name,
              prop.multiProcessorCount, date.c_str(), (long long)H, (long long)I, (long long)G, (long long)o.top_k);

  // Weights of all local experts (contiguous per kind) and activations, filled on the device.
  const int64_t gu_elems = 2 * I * H, dn_elems = H * I, gu_sc = 2 * ib * hb, dn_sc = hb * ib;
  DeviceBuffer<uint8_t> gu(size_t(sz.gate_up)), dn(size_t(sz.down));
  DeviceBuffer<float> gus(size_t(sz.gate_up_scales)), dns(size_t(sz.down_scales));
  // cuBLASLt multiplies M padded to 16 rows; the activations hold at least that many (op_rows), so
  // that it runs on the same data: all rows against one expert's weights, or G experts' equal
  // shares (ceil(rows / G), padded) each against its own expert's weights.
  DeviceBuffer<uint8_t> x8(size_t(sz.x8)), h8(size_t(sz.h8));
  DeviceBuffer<float> xs(size_t(sz.x_scales)), hs(size_t(sz.h_scales)), rw(size_t(sz.row_weights));
  DeviceBuffer<bf16> out(size_t(sz.out));
  fill_e4m3(gu.get(), int64_t(gu.size()), o.seed * 4 + 1);
  fill_e4m3(dn.get(), int64_t(dn.size()), o.seed * 4 + 2);
  fill_e4m3(x8.get(), int64_t(x8.size()), o.seed * 4 + 3);
  fill_e4m3(h8.get(), int64_t(h8.size()), o.seed * 4 + 4);  // gate/up overwrites its rows before down reads them
  fill_scale(gus.get(), int64_t(gus.size()), o.seed * 8 + 5, -12.0f, -8.0f);
  fill_scale(dns.get(), int64_t(dns.size()), o.seed * 8 + 6, -12.0f, -8.0f);
  fill_scale(xs.get(), int64_t(xs.size()), o.seed * 8 + 7, -8.0f, -6.0f);
  fill_scale(rw.get(), int64_t(rw.size()), o.seed * 8 + 8, -3.0f, -0.5f);
  std::vector<const void*> gp, dp;
  std::vector<const float*> gsp, dsp;
  for (int64_t g = 0; g < G; ++g) {
    gp.push_back(gu.get() + g * gu_elems);
    dp.push_back(dn.get() + g * dn_elems);
    gsp.push_back(gus.get() + g * gu_sc);
    dsp.push_back(dns.get() + g * dn_sc);
  }
  DeviceBuffer<const void*> gp_d(gp), dp_d(dp);
  DeviceBuffer<const float*> gsp_d(gsp), dsp_d(dsp);
  std::vector<bf16*> ro;
  ro.reserve(size_t(sz.row_out));  // exactly the planned bytes (no doubling as it grows)
  for (int64_t r = 0; r < sz.row_out; ++r) ro.push_back(out.get() + r * H);
  DeviceBuffer<bf16*> ro_d(ro);
  DeviceBuffer<int32_t> counts_d(size_t(sz.groups)), offsets_d(size_t(sz.groups));
  MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
  cuda::prepare_grouped_gemm();

  // The SM clock while our kernels and cuBLASLt's run (NVML; absent where it cannot be opened).
  int dev = 0;
  char bus_id[32] = {};
  MOEFQ_CUDA_CHECK(cudaGetDevice(&dev));
  MOEFQ_CUDA_CHECK(cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, dev));
  GpuTelemetry telemetry(bus_id);
  const auto timed = [&telemetry](const std::function<double()>& run, TelemetrySummary& clock) {
    telemetry.start();
    const double us = run();
    clock = telemetry.stop();
    return us;
  };

  // Ceilings measured now: device copy bandwidth (bytes read + written) and cuBLASLt FP8.
  const double copy_bw = copy_gbs(size_t(sz.copy_ceiling)) * 1e9;  // bytes / s
  std::printf("device copy: %.0f GB/s (read + write)\n", copy_bw * 1e-9);

  nlohmann::json report = {{"device", prop.name}, {"date", date}, {"hidden", H}, {"inter", I}, {"experts", G},
                           {"top_k", o.top_k}, {"copy_gbs", copy_bw * 1e-9}, {"cases", nlohmann::json::array()}};
  std::mt19937_64 rng(o.seed);
  bool all_ok = true;
  std::printf("\n%-7s %-7s %-8s %-5s %10s %8s %10s %8s %6s %10s %6s %10s %10s %8s %10s %6s %7s %9s\n", "tokens", "rows",
              "gemm",
              "exp", "time_us", "TFLOPS", "cub_g_us", "TFLOPS", "ratio", "cub_1w_us", "r_1w", "cub_c_us", "wread_us",
              "t/wread", "cpasync_us", "MHz", "cub_MHz", "check");
  for (const int64_t tokens : o.tokens) {
    const int64_t rows = tokens * o.top_k;
    const std::vector<int32_t> counts = route_counts(rows, G, rng);
    const GroupOffsets go = group_offsets(counts);
    const std::vector<int32_t>& offsets = go.offsets;
    const int64_t touched = go.touched;
    counts_d.upload(counts);
    offsets_d.upload(offsets);
    cuda::GroupedGemmArgs a;
    a.num_groups = int(G);
    a.max_total_rows = rows;
    a.counts = counts_d.get();
    a.row_offset = offsets_d.get();
    cuda::GroupedGemmArgs up = a;
    up.n = 2 * I;
    up.k = H;
    up.a = x8.get();
    up.lda = H;
    up.a_scale = xs.get();
    up.lda_scale = hb;
    up.b = gp_d.get();
    up.b_scale = gsp_d.get();
    up.b_all = gu.get();  // as the engine passes them: the bulk tensor (TMA) path
    up.b_scale_all = gus.get();
    up.a_rows = max_rows;
    cuda::SwigluEpilogue se;
    se.row_weight = rw.get();
    se.h8 = h8.get();
    se.ldh = I;
    se.h_scale = hs.get();
    se.ldh_scale = ib;
    cuda::GroupedGemmArgs down = a;
    down.n = H;
    down.k = I;
    down.a = h8.get();
    down.lda = I;
    down.a_scale = hs.get();
    down.lda_scale = ib;
    down.b = dp_d.get();
    down.b_scale = dsp_d.get();
    down.b_all = dn.get();
    down.b_scale_all = dns.get();
    down.a_rows = max_rows;
    // The cp.async fallback (no b_all): timed beside, for the record.
    cuda::GroupedGemmArgs up_cp = up, down_cp = down;
    up_cp.b_all = down_cp.b_all = nullptr;
    up_cp.b_scale_all = down_cp.b_scale_all = nullptr;
    up_cp.a_rows = down_cp.a_rows = 0;
    cuda::StoreEpilogue so;
    so.row_out = ro_d.get();

    struct Kind {
      const char* name;
      int64_t n, k;
      std::function<void(cudaStream_t)> launch, launch_cp;
      const uint8_t* a;   // activations [rows, k]
      const uint8_t* w0;  // the experts' weights [G * n, k], expert 0's first
      int64_t weight_bytes;
    };
    const Kind kinds[2] = {
        {"gate_up", 2 * I, H, [&](cudaStream_t s) { cuda::launch_gemm_swiglu(up, se, s); },
         [&](cudaStream_t s) { cuda::launch_gemm_swiglu(up_cp, se, s); }, x8.get(), gu.get(),
         touched * (gu_elems + 4 * gu_sc)},
        {"down", H, I, [&](cudaStream_t s) { cuda::launch_gemm_store(down, so, s); },
         [&](cudaStream_t s) { cuda::launch_gemm_store(down_cp, so, s); }, h8.get(), dn.get(),
         touched * (dn_elems + 4 * dn_sc)},
    };
    for (const Kind& kd : kinds) {
      const double cp_us = median_us(kd.launch_cp, o.launches_per_graph, o.reps);
      TelemetrySummary clock, cub_clock;
      const double us = timed([&] { return median_us(kd.launch, o.launches_per_graph, o.reps); },
                              clock);  // last: its output is checked
      // cuBLASLt on this GEMM's own activations: the grouped ceiling (G equal shares of the rows,
      // each against its own expert's weights, so every expert's weights are read as here); all
      // rows against expert 0's weights only (which stay in L2); constant operands (the clock).
      const int64_t m_grp = cublaslt_group_rows(rows, G), m_cub = cublaslt_rows(rows);
      const double cub_us =
          timed([&] { return cublaslt_fp8_gemm_us(m_grp, kd.n, kd.k, kd.a, kd.w0, int(G)); }, cub_clock);
      const double cub_1w_us = cublaslt_fp8_gemm_us(m_cub, kd.n, kd.k, kd.a, kd.w0);
      const double cub_const_us = cublaslt_fp8_gemm_us(m_cub, kd.n, kd.k);
      // TFLOPS of m rows times this GEMM's weights in t microseconds.
      const auto tflops = [&](int64_t m, double t) {
        return 2.0 * double(m) * double(kd.n) * double(kd.k) / (t * 1e-6) * 1e-12;
      };
      const double tf = tflops(rows, us), cub_tf = tflops(G * m_grp, cub_us), cub_1w_tf = tflops(m_cub, cub_1w_us);
      const double wread_us = double(kd.weight_bytes) / copy_bw * 1e6;

      // One check of the benchmarked output: the last row against the CPU reference.
      bool ok = true;
      double err = 0;
      if (rows > 0) {
        MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
        const int64_t row = rows - 1;
        int64_t g = G - 1;
        while (g > 0 && offsets[size_t(g)] > row) --g;
        const bool is_up = kd.n == 2 * I;
        const int64_t n = kd.n, k = kd.k, kb = k / 128;
        std::vector<uint8_t> a8(static_cast<size_t>(k)), w8(static_cast<size_t>(n * k));
        std::vector<float> as(static_cast<size_t>(kb)), wsc(static_cast<size_t>((n / 128) * kb));
        MOEFQ_CUDA_CHECK(cudaMemcpy(a8.data(), kd.a + row * k, size_t(k), cudaMemcpyDeviceToHost));
        MOEFQ_CUDA_CHECK(cudaMemcpy(as.data(), (is_up ? xs.get() : hs.get()) + row * kb, size_t(kb) * 4, cudaMemcpyDeviceToHost));
        MOEFQ_CUDA_CHECK(cudaMemcpy(w8.data(), kd.w0 + g * n * k, size_t(n * k), cudaMemcpyDeviceToHost));
        MOEFQ_CUDA_CHECK(cudaMemcpy(wsc.data(), (is_up ? gus.get() + g * gu_sc : dns.get() + g * dn_sc), wsc.size() * 4,
                                    cudaMemcpyDeviceToHost));
        std::vector<float> af(static_cast<size_t>(k)), wf(static_cast<size_t>(n * k)), ref(static_cast<size_t>(n));
        for (int64_t i = 0; i < k; ++i) af[size_t(i)] = e4m3_decode(a8[size_t(i)]);
        for (size_t i = 0; i < wf.size(); ++i) wf[i] = e4m3_decode(w8[i]);
        const float* ap = af.data();
        const float* asp = as.data();
        float* rp = ref.data();
        gemm_rows(1, &ap, &asp, wf.data(), wsc.data(), n, k, &rp);
        if (is_up) {
          // The epilogue on the CPU's accumulators; the GPU's dequantized h within 3e-2 (relative
          // L2) of it, as tests/cuda/test_grouped_gemm.cu allows for fp8 accumulation order.
          float wgt = 0;
          MOEFQ_CUDA_CHECK(cudaMemcpy(&wgt, rw.get() + row, 4, cudaMemcpyDeviceToHost));
          std::vector<uint8_t> got(static_cast<size_t>(I));
          std::vector<float> got_s(static_cast<size_t>(ib));
          MOEFQ_CUDA_CHECK(cudaMemcpy(got.data(), h8.get() + row * I, size_t(I), cudaMemcpyDeviceToHost));
          MOEFQ_CUDA_CHECK(cudaMemcpy(got_s.data(), hs.get() + row * ib, size_t(ib) * 4, cudaMemcpyDeviceToHost));
          double d2 = 0, r2 = 0;
          for (int64_t b = 0; b < ib; ++b) {
            float hv[128], m = 0;
            for (int i = 0; i < 128; ++i) {
              const float gv = bf16_to_f32(bf16_round(ref[size_t(b * 128 + i)]));
              const float uv = bf16_to_f32(bf16_round(ref[size_t(I + b * 128 + i)]));
              hv[i] = mul_rn(mul_rn(silu_f32(gv), uv), wgt);
              m = max_ignore_nan(m, abs_f32(hv[i]));
            }
            const float sf = stage_scale(m), inv = div_rn(1.0f, sf);
            for (int i = 0; i < 128; ++i) {
              const double vc = double(e4m3_decode(stage_encode(hv[i], inv))) * sf;
              const double vg = double(e4m3_decode(got[size_t(b * 128 + i)])) * got_s[size_t(b)];
              d2 += (vg - vc) * (vg - vc);
              r2 += vc * vc;
            }
          }
          err = std::sqrt(d2 / std::max(r2, 1e-300));
          ok = err <= 3e-2;
        } else {
          std::vector<bf16> got(static_cast<size_t>(H));
          MOEFQ_CUDA_CHECK(cudaMemcpy(got.data(), out.get() + row * H, size_t(H) * 2, cudaMemcpyDeviceToHost));
          double e2 = 0, r2 = 0;
          for (int64_t i = 0; i < H; ++i) {
            const double d = double(to_f32(got[size_t(i)])) - double(ref[size_t(i)]);
            e2 += d * d;
            r2 += double(ref[size_t(i)]) * double(ref[size_t(i)]);
          }
          err = std::sqrt(e2 / std::max(r2, 1e-30));
          ok = err <= 4e-3;
        }
      }
      all_ok = all_ok && ok;
      char check[32];
      std::snprintf(check, sizeof(check), "%s %.1e", ok ? "ok" : "FAIL", err);
      const auto mhz = [](const TelemetrySummary& c) {
        return c.samples > 0 ? std::to_string(int(c.sm_mhz + 0.5)) : std::string("-");
      };
      std::printf("%-7lld %-7lld %-8s %-5lld %10.1f %8.1f %10.1f %8.1f %6.2f %10.1f %6.2f %10.1f %10.1f %8.2f "
                  "%10.1f %6s %7s %9s\n",
                  (long long)tokens, (long long)rows, kd.name, (long long)touched, us, tf, cub_us, cub_tf, tf / cub_tf,
                  cub_1w_us, tf / cub_1w_tf, cub_const_us, wread_us, us / wread_us, cp_us, mhz(clock).c_str(),
                  mhz(cub_clock).c_str(), check);
      // Clock, power and limit reasons of a timed window (null where nothing was sampled).
      const auto clock_json = [](const TelemetrySummary& c) {
        return c.samples > 0 ? nlohmann::json{{"sm_mhz", c.sm_mhz}, {"power_w", c.power_w}, {"samples", c.samples},
                                              {"limits", clock_limit_text(c.reasons)}}
                             : nlohmann::json(nullptr);
      };
      report["cases"].push_back({{"tokens", tokens},
                                 {"rows", rows},
                                 {"gemm", kd.name},
                                 {"n", kd.n},
                                 {"k", kd.k},
                                 {"experts_touched", touched},
                                 {"time_us", us},
                                 {"cp_async_time_us", cp_us},
                                 {"tflops", tf},
                                 {"cublaslt_group_rows", m_grp},
                                 {"cublaslt_us", cub_us},
                                 {"cublaslt_tflops", cub_tf},
                                 {"rate_vs_cublaslt", tf / cub_tf},
                                 {"cublaslt_one_weight_rows", m_cub},
                                 {"cublaslt_one_weight_us", cub_1w_us},
                                 {"rate_vs_cublaslt_one_weight", tf / cub_1w_tf},
                                 {"cublaslt_constant_data_us", cub_const_us},
                                 {"clock", clock_json(clock)},
                                 {"cublaslt_clock", clock_json(cub_clock)},
                                 {"weight_bytes", kd.weight_bytes},
                                 {"weight_read_us", wread_us},
                                 {"time_vs_weight_read", us / wread_us},
                                 {"check_ok", ok},
                                 {"check_error", err}});
    }
  }
  std::printf("\nratio = our TFLOPS / cuBLASLt TFLOPS on the same operands: cub_g_us, one strided-batched call of "
              "%lld GEMMs, ceil(rows / %lld) rows each (padded to 16) against each expert's own weights; cub_1w_us, "
              "r_1w: all rows against expert 0's weights only, which stay in L2; cub_c_us: cuBLASLt on constant "
              "operands (a higher clock: the tensor cores' power depends on the data); wread = touched "
              "experts' weight bytes / copy bandwidth; time_us: bulk tensor (TMA) path, as the engine "
              "launches it; cpasync_us: the cp.async fallback; MHz, cub_MHz: mean SM clock (NVML, every 2 ms while "
              "the GPU is busy) during our timed replays and cuBLASLt's grouped ones (JSON: power and clock limit "
              "reasons too). check: relative L2 difference of the last row vs the CPU reference: gate_up "
              "= dequantized h8 (<= 3e-2), down = bf16 output (<= 4e-3)\n",
              (long long)G, (long long)G);
  if (!o.json.empty()) write_file_atomic(o.json, report.dump(2) + "\n");
  return all_ok ? 0 : 1;
}

}  // namespace moefq::bench
