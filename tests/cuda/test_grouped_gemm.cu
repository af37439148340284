// The grouped expert GEMMs (engine/cuda/grouped_gemm.cuh) against the CPU engine (engine/expert_cpu.h).
// Exact suite: inputs whose block dot products are exact in any order (e4m3 small integers,
// power-of-two scales; down weights with one nonzero per 128-block), so h8, h_scale and the bf16
// outputs must equal the CPU engine byte for byte, sentinel-filled unused rows included.
// Random suite: arbitrary e4m3 codes and scales, compared within stated tolerances.
// Each suite runs both load paths: bulk tensor (TMA: b_all and a_rows given, as the engine
// passes them) and the cp.async fallback (per-group weight pointers only). The bf16-activation
// kernels (staging none) run the exact suite too: A is then the bf16 of the e4m3 inputs' values
// (no scales), h is bf16.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <type_traits>
#include <vector>

#include "cuda_base/device_buffer.h"
#include "engine/cuda/grouped_gemm.cuh"
#include "moefq/qdq.h"
#include "gpu_test.h"
#include "engine/expert_cpu.h"
#include "engine/gemm_cpu.h"
#include "moefq/numerics.h"

namespace moefq::cuda {
namespace {

constexpr uint8_t kSentinel = 0xA5;

struct Case {
  int64_t H = 384, I = 256;
  std::vector<int32_t> counts;
  std::vector<int32_t> capacity;  // rows reserved per group (empty: count + 3 unused rows)
  WeightFormat format = WeightFormat::kE4m3;
  bool exact = true;
  std::optional<float> clamp;
  int tile_rows = 0;
  bool bulk = true;  // pass b_all / b_scale_all / a_rows (the TMA path); false: the cp.async path
  bool a_bf16 = false;  // staging none: bf16 A (the values of a8, unscaled) and bf16 h
  uint64_t seed = 1;
};

struct Host {
  std::vector<int32_t> counts, offsets;
  int64_t rows = 0;  // allocated rows, unused ones included
  std::vector<ExpertWeights> experts;
  std::vector<uint8_t> a8;     // [rows, H] e4m3
  std::vector<float> a_scale;  // [rows, H / 128]
  std::vector<bf16> a16;       // [rows, H]: a8's values (exact in bf16), the bf16-activation input
  std::vector<float> weight;   // [rows]
};

float pow2(int e) { return std::ldexp(1.0f, e); }

// Random e4m3 codes as real data has them: e4m3_sat(N(0, sigma)), 1% outliers 8x larger
// (saturating at 448), never NaN.
uint8_t random_code(std::mt19937_64& rng, float sigma) {
  std::normal_distribution<float> normal(0.0f, sigma);
  const float v = normal(rng) * (rng() % 100 == 0 ? 8.0f : 1.0f);
  return e4m3_encode_sat_sw(v);
}

Host make_host(const Case& c) {
  std::mt19937_64 rng(c.seed);
  auto uni = [&](int lo, int hi) { return lo + int(rng() % uint64_t(hi - lo + 1)); };
  auto unif = [&](float lo, float hi) { return lo + (hi - lo) * float(rng() >> 40) / float(1ull << 24); };
  Host h;
  const int G = int(c.counts.size());
  const int64_t H = c.H, I = c.I, hb = H / 128, ib = I / 128;
  h.counts = c.counts;
  for (int g = 0; g < G; ++g) {
    h.offsets.push_back(int32_t(h.rows));
    h.rows += c.capacity.empty() ? c.counts[g] + 3 : c.capacity[g];
  }
  h.a8.resize(size_t(h.rows * H));
  h.a_scale.resize(size_t(h.rows * hb));
  h.weight.resize(size_t(h.rows));
  for (auto& v : h.a8) v = c.exact ? e4m3_encode_sat_sw(float(uni(-2, 2))) : random_code(rng, 112.0f);
  for (auto& v : h.a_scale) v = c.exact ? pow2(uni(-3, 3)) : unif(1e-3f, 4e-3f);
  for (uint8_t v : h.a8) h.a16.push_back({bf16_round_sw(e4m3_decode(v))});
  for (size_t r = 0; r < h.weight.size(); ++r) h.weight[r] = r % 5 == 0 ? 1.0f : unif(0.05f, 1.5f);

  for (int g = 0; g < G; ++g) {
    ExpertWeights w;
    w.hidden = H;
    w.intermediate = I;
    w.format = c.format;
    std::vector<float> gu(size_t(2 * I * H)), gus(size_t(2 * ib * hb)), dn(size_t(H * I)), dns(size_t(hb * ib));
    for (auto& v : gus) v = c.exact ? pow2(uni(-6, -2)) : std::exp2(unif(-12.0f, -8.0f));
    for (auto& v : dns) v = c.exact ? pow2(uni(-4, 0)) : std::exp2(unif(-12.0f, -8.0f));
    for (auto& v : gu) v = c.exact ? float(uni(-2, 2)) : e4m3_decode(random_code(rng, 180.0f));
    for (int64_t n = 0; n < H; ++n)
      for (int64_t k = 0; k < I; ++k) {
        if (c.exact) {
          // One nonzero (+-1 or +-2) per 128-block of a row: every block sum is one exact product.
          const bool hit = k % 128 == (n * 7 + (k / 128) * 13 + g) % 128;
          dn[size_t(n * I + k)] = hit ? float((rng() & 1) ? 1 : 2) * ((rng() & 2) ? -1.0f : 1.0f) : 0.0f;
        } else {
          dn[size_t(n * I + k)] = e4m3_decode(random_code(rng, 180.0f));
        }
      }
    if (c.format == WeightFormat::kE4m3) {
      for (float v : gu) w.gate_up_e4m3.push_back(e4m3_encode_sat_sw(v));
      for (float v : dn) w.down_e4m3.push_back(e4m3_encode_sat_sw(v));
      w.gate_up_scale = gus;
      w.down_scale = dns;
    } else {
      // bf16 weights: the value times its block scale, rounded to bf16 (exact in the exact suite).
      for (int64_t n = 0; n < 2 * I; ++n)
        for (int64_t k = 0; k < H; ++k)
          w.gate_up_bf16.push_back({bf16_round_sw(gu[size_t(n * H + k)] * gus[size_t((n / 128) * hb + k / 128)])});
      for (int64_t n = 0; n < H; ++n)
        for (int64_t k = 0; k < I; ++k)
          w.down_bf16.push_back({bf16_round_sw(dn[size_t(n * I + k)] * dns[size_t((n / 128) * ib + k / 128)])});
    }
    h.experts.push_back(std::move(w));
  }
  return h;
}

struct Outputs {
  std::vector<uint8_t> h8;      // [rows, I]
  std::vector<float> h_scale;   // [rows, I / 128]
  std::vector<bf16> out;        // [rows, H]
  std::vector<bf16> h16;        // [rows, I] (bf16 activations)
};

Outputs sentinel_outputs(const Case& c, int64_t rows) {
  Outputs o;
  o.h8.assign(size_t(rows * c.I), kSentinel);
  o.h_scale.resize(size_t(rows * c.I / 128));
  o.out.resize(size_t(rows * c.H));
  o.h16.resize(size_t(rows * c.I));
  std::memset(o.h_scale.data(), kSentinel, o.h_scale.size() * 4);
  std::memset(o.out.data(), kSentinel, o.out.size() * 2);
  std::memset(o.h16.data(), kSentinel, o.h16.size() * 2);
  return o;
}

// The CPU engine on every row of every group.
Outputs run_cpu(const Case& c, const Host& h) {
  const int64_t H = c.H, I = c.I;
  std::vector<PreparedExpert> prep;
  for (const auto& w : h.experts) prep.emplace_back(w, H, I);
  Outputs o = sentinel_outputs(c, h.rows);
  std::vector<ExpertGroup> groups;
  for (size_t g = 0; g < h.counts.size(); ++g)
    for (int r = 0; r < h.counts[g]; ++r) {
      const int64_t row = h.offsets[g] + r;
      if (c.a_bf16)
        add_expert_row(groups, &prep[g], Staging::kNone, r == 0, &h.a16[size_t(row * H)], nullptr,
                       h.weight[size_t(row)], &o.h16[size_t(row * I)], nullptr, &o.out[size_t(row * H)]);
      else
        add_expert_row(groups, &prep[g], Staging::kE4m3, r == 0, &h.a8[size_t(row * H)],
                       &h.a_scale[size_t(row * H / 128)], h.weight[size_t(row)], &o.h8[size_t(row * I)],
                       &o.h_scale[size_t(row * I / 128)], &o.out[size_t(row * H)]);
    }
  run_expert_groups(groups, c.clamp, 4);
  return o;
}

struct Device {
  DeviceBuffer<int32_t> counts, offsets;
  DeviceBuffer<uint8_t> a8;
  DeviceBuffer<bf16> a16, h16;
  DeviceBuffer<float> a_scale, weight;
  // Every group's weights in one allocation per kind (group g's at + g * its size), as the
  // engine's expert sets hold them; the pointer arrays point into these.
  DeviceBuffer<uint8_t> gu8, dn8;
  DeviceBuffer<bf16> gu16, dn16;
  DeviceBuffer<float> gus, dns;
  int64_t rows = 0;
  DeviceBuffer<const void*> gu_ptr, dn_ptr;
  DeviceBuffer<const float*> gus_ptr, dns_ptr;
  DeviceBuffer<uint8_t> h8;
  DeviceBuffer<float> h_scale;
  DeviceBuffer<bf16> out;
  DeviceBuffer<bf16*> row_out;
};

void upload(const Case& c, const Host& h, Device& d) {
  d.counts = DeviceBuffer<int32_t>(h.counts);
  d.offsets = DeviceBuffer<int32_t>(h.offsets);
  d.a8 = DeviceBuffer<uint8_t>(h.a8);
  d.a16 = DeviceBuffer<bf16>(h.a16);
  d.h16 = DeviceBuffer<bf16>(size_t(h.rows * c.I));
  d.a_scale = DeviceBuffer<float>(h.a_scale);
  d.weight = DeviceBuffer<float>(h.weight);
  d.rows = h.rows;
  std::vector<const void*> gp, dp;
  std::vector<const float*> gsp, dsp;
  auto concat = [&](auto member) {
    std::remove_cvref_t<decltype(h.experts[0].*member)> all;
    for (const auto& w : h.experts) all.insert(all.end(), (w.*member).begin(), (w.*member).end());
    return all;
  };
  const int64_t G = int64_t(h.experts.size()), H = c.H, I = c.I;
  if (c.format == WeightFormat::kE4m3) {
    d.gu8 = DeviceBuffer<uint8_t>(concat(&ExpertWeights::gate_up_e4m3));
    d.dn8 = DeviceBuffer<uint8_t>(concat(&ExpertWeights::down_e4m3));
    d.gus = DeviceBuffer<float>(concat(&ExpertWeights::gate_up_scale));
    d.dns = DeviceBuffer<float>(concat(&ExpertWeights::down_scale));
    for (int64_t g = 0; g < G; ++g) {
      gp.push_back(d.gu8.get() + g * 2 * I * H);
      dp.push_back(d.dn8.get() + g * H * I);
      gsp.push_back(d.gus.get() + g * (2 * I / 128) * (H / 128));
      dsp.push_back(d.dns.get() + g * (H / 128) * (I / 128));
    }
  } else {
    d.gu16 = DeviceBuffer<bf16>(concat(&ExpertWeights::gate_up_bf16));
    d.dn16 = DeviceBuffer<bf16>(concat(&ExpertWeights::down_bf16));
    for (int64_t g = 0; g < G; ++g) {
      gp.push_back(d.gu16.get() + g * 2 * I * H);
      dp.push_back(d.dn16.get() + g * H * I);
    }
  }
  d.gu_ptr = DeviceBuffer<const void*>(gp);
  d.dn_ptr = DeviceBuffer<const void*>(dp);
  if (!gsp.empty()) {
    d.gus_ptr = DeviceBuffer<const float*>(gsp);
    d.dns_ptr = DeviceBuffer<const float*>(dsp);
  }
  d.h8 = DeviceBuffer<uint8_t>(size_t(h.rows * c.I));
  d.h_scale = DeviceBuffer<float>(size_t(h.rows * c.I / 128));
  d.out = DeviceBuffer<bf16>(size_t(h.rows * c.H));
  std::vector<bf16*> ro;
  for (int64_t r = 0; r < h.rows; ++r) ro.push_back(d.out.get() + r * c.H);
  d.row_out = DeviceBuffer<bf16*>(ro);
}

void reset_outputs(Device& d) {
  MOEFQ_CUDA_CHECK(cudaMemset(d.h8.get(), kSentinel, d.h8.bytes()));
  MOEFQ_CUDA_CHECK(cudaMemset(d.h_scale.get(), kSentinel, d.h_scale.bytes()));
  MOEFQ_CUDA_CHECK(cudaMemset(d.out.get(), kSentinel, d.out.bytes()));
  MOEFQ_CUDA_CHECK(cudaMemset(d.h16.get(), kSentinel, d.h16.bytes()));
}

// Gate/up GEMM with the SwiGLU epilogue, then the down GEMM on its h8 / h_scale.
void launch_both(const Case& c, const Host& h, Device& d, cudaStream_t s) {
  GroupedGemmArgs a;
  a.num_groups = int(h.counts.size());
  a.max_total_rows = h.rows;
  a.n = 2 * c.I;
  a.k = c.H;
  a.counts = d.counts.get();
  a.row_offset = d.offsets.get();
  a.a = d.a8.get();
  a.lda = c.H;
  a.a_scale = d.a_scale.get();
  a.lda_scale = c.H / 128;
  a.b_format = c.format;
  a.b = d.gu_ptr.get();
  a.b_scale = d.gus_ptr.get();
  a.tile_rows = c.tile_rows;
  const bool e4m3 = c.format == WeightFormat::kE4m3;
  if (c.bulk) {
    a.b_all = e4m3 ? static_cast<const void*>(d.gu8.get()) : static_cast<const void*>(d.gu16.get());
    a.b_scale_all = e4m3 ? d.gus.get() : nullptr;
    a.a_rows = d.rows;
  }
  SwigluEpilogue e;
  e.row_weight = d.weight.get();
  e.has_clamp = c.clamp.has_value();
  e.clamp = c.clamp.value_or(0.0f);
  e.h8 = d.h8.get();
  e.ldh = c.I;
  e.h_scale = d.h_scale.get();
  e.ldh_scale = c.I / 128;
  if (c.a_bf16) {  // bf16 x in, bf16 h out: no scales
    a.a_format = WeightFormat::kBf16;
    a.a = reinterpret_cast<const uint8_t*>(d.a16.get());
    a.a_scale = nullptr;
    e.h8 = nullptr;
    e.h_scale = nullptr;
    e.h16 = d.h16.get();
  }
  launch_gemm_swiglu(a, e, s);
  GroupedGemmArgs b = a;
  b.n = c.H;
  b.k = c.I;
  b.a = d.h8.get();
  b.lda = c.I;
  b.a_scale = d.h_scale.get();
  b.lda_scale = c.I / 128;
  if (c.a_bf16) {
    b.a = reinterpret_cast<const uint8_t*>(d.h16.get());
    b.a_scale = nullptr;
  }
  b.b = d.dn_ptr.get();
  b.b_scale = d.dns_ptr.get();
  if (c.bulk) {
    b.b_all = e4m3 ? static_cast<const void*>(d.dn8.get()) : static_cast<const void*>(d.dn16.get());
    b.b_scale_all = e4m3 ? d.dns.get() : nullptr;
  }
  StoreEpilogue so;
  so.row_out = d.row_out.get();
  launch_gemm_store(b, so, s);
}

Outputs download(Device& d) {
  MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
  return {d.h8.download(), d.h_scale.download(), d.out.download(), d.h16.download()};
}

// Byte-for-byte comparison, reporting the mismatch count and the first mismatching element.
template <class T>
void expect_same(const char* what, const std::vector<T>& want, const std::vector<T>& got, int64_t row_elems) {
  ASSERT_EQ(want.size(), got.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (std::memcmp(&want[i], &got[i], sizeof(T)) != 0 && bad++ == 0) first = i;
  if (bad == 0) return;
  uint32_t wb = 0, gb = 0;
  std::memcpy(&wb, &want[first], sizeof(T));
  std::memcpy(&gb, &got[first], sizeof(T));
  ADD_FAILURE() << what << ": " << bad << " of " << want.size() << " elements differ; first at row "
                << first / size_t(row_elems) << " col " << first % size_t(row_elems) << ": expected 0x" << std::hex
                << wb << ", got 0x" << gb << std::dec;
}

void expect_bit_exact(const Case& c) {
  const Host h = make_host(c);
  const Outputs want = run_cpu(c, h);
  Device d;
  upload(c, h, d);
  reset_outputs(d);
  launch_both(c, h, d, nullptr);
  const Outputs got = download(d);
  expect_same("h8", want.h8, got.h8, c.I);
  expect_same("h_scale", want.h_scale, got.h_scale, c.I / 128);
  expect_same("out", want.out, got.out, c.H);
  expect_same("h16", want.h16, got.h16, c.I);
}

const std::vector<int32_t> kEdgeCounts = {0, 1, 63, 64, 65, 300};

}  // namespace

TEST(GroupedGemm, BitExactE4m3AllTileShapesAndClamp) {
  SKIP_WITHOUT_GPU();
  for (bool bulk : {true, false})
  for (int tile : {64, 128})
    for (bool clamp : {false, true}) {
      SCOPED_TRACE(testing::Message() << (bulk ? "TMA, " : "cp.async, ") << "tile_rows " << tile
                                      << (clamp ? ", clamp 0.75" : ", no clamp"));
      Case c;
      c.counts = kEdgeCounts;
      c.bulk = bulk;
      c.tile_rows = tile;
      if (clamp) c.clamp = 0.75f;  // small enough to bite on these g and u
      c.seed = 11 + tile + clamp;
      expect_bit_exact(c);
    }
}

TEST(GroupedGemm, BitExactAutomaticTileChoice) {
  SKIP_WITHOUT_GPU();
  for (bool bulk : {true, false}) {
    SCOPED_TRACE(bulk ? "TMA" : "cp.async");
    Case c;
    c.bulk = bulk;
    c.counts = {2, 0, 7, 1};  // max_total_rows / G <= 64: the 64-row kernel
    c.H = 512;
    c.I = 384;
    expect_bit_exact(c);
    c.counts = {130, 257};  // too few 128-row tiles (5 x 3) to fill the SMs: the 64-row kernel
    c.seed = 5;
    expect_bit_exact(c);
    c.counts = {2900, 2700};  // gate/up: 45 x 3 tiles of 128 rows, more than the SMs: the 128-row kernel
    c.seed = 6;
    expect_bit_exact(c);
  }
}

// More groups than a warp's 32 lanes: the tile prefix is scanned 32 groups at a time (three
// scans here, the last one partial), empty groups among them.
TEST(GroupedGemm, BitExactSeventyGroups) {
  SKIP_WITHOUT_GPU();
  for (int tile : {64, 128}) {
    SCOPED_TRACE(testing::Message() << "tile_rows " << tile);
    Case c;
    for (int g = 0; g < 70; ++g) c.counts.push_back(g % 7 == 3 ? 0 : (g * 37) % 90 + 1);
    c.H = 256;
    c.I = 128;
    c.tile_rows = tile;
    c.seed = 31 + tile;
    expect_bit_exact(c);
  }
}

TEST(GroupedGemm, BitExactBf16Weights) {
  SKIP_WITHOUT_GPU();
  for (bool bulk : {true, false})
  for (int tile : {64, 128}) {
    SCOPED_TRACE(testing::Message() << (bulk ? "TMA, " : "cp.async, ") << "tile_rows " << tile);
    Case c;
    c.bulk = bulk;
    c.counts = kEdgeCounts;
    c.format = WeightFormat::kBf16;
    c.tile_rows = tile;
    c.clamp = 1.0f;
    c.seed = 23 + tile;
    expect_bit_exact(c);
  }
}

// bf16 activations (staging none): bf16 x bf16 (TMA or cp.async weights) and bf16 x e4m3 (the
// producer converts the weights, their block scales at the promotion), SwiGLU writing bf16 h.
TEST(GroupedGemm, BitExactBf16Activations) {
  SKIP_WITHOUT_GPU();
  for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kE4m3})
  for (bool bulk : {true, false})
  for (int tile : {64, 128})
    for (bool clamp : {false, true}) {
      SCOPED_TRACE(testing::Message() << weight_format_name(f) << " weights, " << (bulk ? "b_all, " : "pointers, ")
                                      << "tile_rows " << tile << (clamp ? ", clamp 0.75" : ", no clamp"));
      Case c;
      c.counts = kEdgeCounts;
      c.format = f;
      c.a_bf16 = true;
      c.bulk = bulk;
      c.tile_rows = tile;
      if (clamp) c.clamp = 0.75f;
      c.seed = 41 + tile + clamp;
      expect_bit_exact(c);
    }
  Case big;  // the automatic choice at a size that takes the 128-row kernel
  big.counts = {2900, 2700};
  big.H = 512;
  big.I = 384;
  big.a_bf16 = true;
  big.format = WeightFormat::kBf16;
  expect_bit_exact(big);
}

TEST(GroupedGemm, AllGroupsEmptyWritesNothing) {
  SKIP_WITHOUT_GPU();
  for (bool bulk : {true, false}) {
    Case c;
    c.bulk = bulk;
    c.counts = {0, 0, 0};
    c.capacity = {70, 70, 70};
    expect_bit_exact(c);  // the CPU writes nothing either: all sentinel
  }
}

namespace {

struct RowErrors {
  double gpu = 0, cpu = 0;  // relative L2 errors of the bf16 row against the double reference
};

// One row of a GEMM: a ([k] element values, [k / 128] scales) times w ([n, k] values, [n / 128,
// k / 128] scales); the GPU's bf16 result `got` and the CPU engine's gemm_rows (rounded to bf16)
// against a double-precision reference.
RowErrors row_errors(const std::vector<float>& a, const float* as, const std::vector<float>& w, const float* ws,
                     int64_t n, int64_t k, const bf16* got) {
  const int64_t kb = k / 128;
  std::vector<float> cpu(static_cast<size_t>(n));
  const float* ap = a.data();
  float* cp = cpu.data();
  gemm_rows(1, &ap, &as, w.data(), ws, n, k, &cp);
  double eg = 0, ec = 0, r2 = 0;
  for (int64_t j = 0; j < n; ++j) {
    double ref = 0;
    for (int64_t b = 0; b < kb; ++b) {
      double part = 0;
      for (int64_t i = b * 128; i < b * 128 + 128; ++i) part += double(a[size_t(i)]) * w[size_t(j * k + i)];
      ref += part * as[b] * ws[size_t((j / 128) * kb + b)];
    }
    const double vg = to_f32(got[j]), vc = bf16_to_f32(bf16_round_sw(cpu[size_t(j)]));
    eg += (vg - ref) * (vg - ref);
    ec += (vc - ref) * (vc - ref);
    r2 += ref * ref;
  }
  return {std::sqrt(eg / r2), std::sqrt(ec / r2)};
}

}  // namespace

// Random e4m3 data (Gaussian codes with outliers, arbitrary scales). Hopper's fp8 wgmma adds
// products inside a 128-block with less than fp32 precision, so only tolerances apply here:
// - Each GEMM (gate/up run through the store epilogue, and down on the GPU's own h8): per row,
//   the relative L2 error of the bf16 output against a double-precision reference is at most
//   4e-3, for the GPU and for the CPU engine's gemm_rows alike (bf16 rounding alone is up to 2^-9
//   per element).
// - SwiGLU, GPU vs CPU: a one-ulp change of bf16(g) or bf16(u) moves h by 2^-8 and can flip its
//   e4m3 code by one step, so per row the relative L2 difference of the dequantized h is at most
//   3e-2, at most 5% of codes differ, and h_scale differs by at most 2e-2 relative.
TEST(GroupedGemm, RandomDataWithinTolerance) {
  SKIP_WITHOUT_GPU();
  for (bool bulk : {true, false})
  for (int tile : {64, 128}) {
    SCOPED_TRACE(testing::Message() << (bulk ? "TMA, " : "cp.async, ") << "tile_rows " << tile);
    Case c;
    c.H = 1024;
    c.I = 512;
    c.counts = {5, 130, 0, 200};
    c.exact = false;
    c.bulk = bulk;
    c.tile_rows = tile;
    c.seed = 99 + tile;
    const Host h = make_host(c);
    const Outputs cpu = run_cpu(c, h);
    Device d;
    upload(c, h, d);
    reset_outputs(d);
    launch_both(c, h, d, nullptr);
    const Outputs gpu = download(d);
    const int64_t H = c.H, I = c.I, hb = H / 128, ib = I / 128;

    // The gate/up GEMM alone: the store epilogue on n = 2I.
    DeviceBuffer<bf16> up_out(static_cast<size_t>(h.rows * 2 * I));
    std::vector<bf16*> up_rows;
    for (int64_t r = 0; r < h.rows; ++r) up_rows.push_back(up_out.get() + r * 2 * I);
    DeviceBuffer<bf16*> up_rows_d(up_rows);
    GroupedGemmArgs a;
    a.num_groups = int(h.counts.size());
    a.max_total_rows = h.rows;
    a.n = 2 * I;
    a.k = H;
    a.counts = d.counts.get();
    a.row_offset = d.offsets.get();
    a.a = d.a8.get();
    a.lda = H;
    a.a_scale = d.a_scale.get();
    a.lda_scale = hb;
    a.b = d.gu_ptr.get();
    a.b_scale = d.gus_ptr.get();
    a.tile_rows = tile;
    if (bulk) {
      a.b_all = d.gu8.get();
      a.b_scale_all = d.gus.get();
      a.a_rows = h.rows;
    }
    StoreEpilogue so;
    so.row_out = up_rows_d.get();
    launch_gemm_store(a, so, nullptr);
    MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<bf16> up = up_out.download();

    size_t codes = 0, diff = 0;
    double worst_scale = 0, worst_h = 0;
    RowErrors worst_up, worst_down;
    std::vector<float> gu_dec, dn_dec, a_dec(static_cast<size_t>(H)), h_dec(static_cast<size_t>(I));
    for (size_t g = 0; g < h.counts.size(); ++g) {
      const ExpertWeights& w = h.experts[g];
      gu_dec.resize(w.gate_up_e4m3.size());
      dn_dec.resize(w.down_e4m3.size());
      for (size_t i = 0; i < gu_dec.size(); ++i) gu_dec[i] = e4m3_decode(w.gate_up_e4m3[i]);
      for (size_t i = 0; i < dn_dec.size(); ++i) dn_dec[i] = e4m3_decode(w.down_e4m3[i]);
      for (int r = 0; r < h.counts[g]; ++r) {
        const int64_t row = h.offsets[g] + r;
        for (int64_t i = 0; i < H; ++i) a_dec[size_t(i)] = e4m3_decode(h.a8[size_t(row * H + i)]);
        const RowErrors eu = row_errors(a_dec, &h.a_scale[size_t(row * hb)], gu_dec, w.gate_up_scale.data(), 2 * I, H,
                                        &up[size_t(row * 2 * I)]);
        worst_up.gpu = std::max(worst_up.gpu, eu.gpu);
        worst_up.cpu = std::max(worst_up.cpu, eu.cpu);

        double d2 = 0, r2 = 0;
        for (int64_t i = 0; i < I; ++i) {
          const uint8_t cg = gpu.h8[size_t(row * I + i)], cc = cpu.h8[size_t(row * I + i)];
          ++codes;
          diff += cg != cc;
          const double vg = double(e4m3_decode(cg)) * gpu.h_scale[size_t(row * ib + i / 128)];
          const double vc = double(e4m3_decode(cc)) * cpu.h_scale[size_t(row * ib + i / 128)];
          d2 += (vg - vc) * (vg - vc);
          r2 += vc * vc;
        }
        worst_h = std::max(worst_h, std::sqrt(d2 / std::max(r2, 1e-300)));
        for (int64_t b = 0; b < ib; ++b) {
          const double s0 = cpu.h_scale[size_t(row * ib + b)], s1 = gpu.h_scale[size_t(row * ib + b)];
          worst_scale = std::max(worst_scale, std::abs(s1 - s0) / s0);
        }

        // Down GEMM on the GPU's h8 / h_scale.
        for (int64_t i = 0; i < I; ++i) h_dec[size_t(i)] = e4m3_decode(gpu.h8[size_t(row * I + i)]);
        const RowErrors ed = row_errors(h_dec, &gpu.h_scale[size_t(row * ib)], dn_dec, w.down_scale.data(), H, I,
                                        &gpu.out[size_t(row * H)]);
        worst_down.gpu = std::max(worst_down.gpu, ed.gpu);
        worst_down.cpu = std::max(worst_down.cpu, ed.cpu);
      }
    }
    EXPECT_LE(worst_up.gpu, 4e-3) << "GPU gate/up GEMM, worst row relative L2 error";
    EXPECT_LE(worst_up.cpu, 4e-3) << "CPU gate/up GEMM, worst row relative L2 error";
    EXPECT_LE(worst_down.gpu, 4e-3) << "GPU down GEMM, worst row relative L2 error";
    EXPECT_LE(worst_down.cpu, 4e-3) << "CPU down GEMM, worst row relative L2 error";
    EXPECT_LE(worst_h, 3e-2) << "dequantized h, GPU vs CPU, worst row relative L2 difference";
    EXPECT_LE(double(diff), 0.05 * double(codes)) << diff << " of " << codes << " h8 codes differ";
    EXPECT_LE(worst_scale, 2e-2) << "h_scale relative difference";
    std::printf("[random, %s, tile_rows %d] worst row relative L2 error vs double: gate/up GEMM GPU %.3g CPU %.3g, "
                "down GEMM GPU %.3g CPU %.3g; SwiGLU GPU vs CPU: h %.3g, %zu of %zu h8 codes differ, "
                "h_scale %.3g\n",
                bulk ? "TMA" : "cp.async", tile, worst_up.gpu, worst_up.cpu, worst_down.gpu, worst_down.cpu, worst_h, diff, codes, worst_scale);
  }
}

// The SwiGLU epilogue reads silu of the bf16 gate from a table the host fills with silu_f32: that
// is only right if the host's silu_f32 gives the device's bits, on every bf16 value (NaN: any NaN,
// which the e4m3 re-staging turns into its NaN code whatever the payload).
__global__ void silu_kernel(float* out) {
  const uint32_t b = blockIdx.x * blockDim.x + threadIdx.x;
  out[b] = silu_f32(bf16_to_f32(uint16_t(b)));
}

TEST(GroupedGemm, HostSiluEqualsDeviceSiluOnEveryBf16) {
  SKIP_WITHOUT_GPU();
  DeviceBuffer<float> d(size_t(1) << 16);
  silu_kernel<<<256, 256>>>(d.get());
  MOEFQ_CUDA_CHECK_LAUNCH();
  const std::vector<float> got = d.download();
  int64_t bad = 0, first = -1;
  for (uint32_t b = 0; b < got.size(); ++b) {
    const float want = silu_f32(bf16_to_f32(uint16_t(b)));
    const bool same = is_nan(want) ? is_nan(got[b]) : f32_bits(want) == f32_bits(got[b]);
    if (!same && bad++ == 0) first = b;
  }
  EXPECT_EQ(bad, 0) << "first at bf16 0x" << std::hex << first;
}

TEST(GroupedGemm, GraphReplayReadsCountsOnTheDevice) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.counts = {70, 0, 5, 130};
  c.capacity = {200, 200, 200, 200};
  c.clamp = 2.0f;
  Host h = make_host(c);
  Device d;
  upload(c, h, d);
  prepare_grouped_gemm();
  const test::CapturedGraph graph([&](cudaStream_t s) { launch_both(c, h, d, s); });
  for (const std::vector<int32_t>& counts : {std::vector<int32_t>{70, 0, 5, 130}, std::vector<int32_t>{3, 150, 0, 64},
                                             std::vector<int32_t>{200, 1, 199, 65}}) {
    SCOPED_TRACE(testing::Message() << "counts " << counts[0] << " " << counts[1] << " " << counts[2] << " " << counts[3]);
    h.counts = counts;
    d.counts.upload(counts);
    reset_outputs(d);
    graph.launch();
    MOEFQ_CUDA_CHECK(cudaStreamSynchronize(graph.stream()));
    const Outputs want = run_cpu(c, h);
    const Outputs got = download(d);
    expect_same("h8", want.h8, got.h8, c.I);
    expect_same("h_scale", want.h_scale, got.h_scale, c.I / 128);
    expect_same("out", want.out, got.out, c.H);
  }
}

}  // namespace moefq::cuda
