// CUDA combine kernels against the CPU, byte for byte: the plain combine against combine_rows, the
// combine quantizer against qdq_ref of each [1, H] row then combine_rows (fake_quant_moe.cpp's
// order), and the device-side layout check against the CPU comparison it replaces.
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda/combine_kernels.cuh"
#include "cuda_base/cuda_check.h"
#include "cuda_base/device_buffer.h"
#include "quant/cuda/qdq_rules.cuh"
#include "engine/expert_cpu.h"
#include "gpu_test.h"
#include "moefq/combine_qdq.h"
#include "moefq/qdq.h"
#include "test_util.h"

extern char** environ;

namespace moefq {
namespace {

using cuda::DeviceBuffer;

constexpr uint16_t kPoison = 0x7F7F;  // rows nobody wrote: a huge finite value that no sum absorbs

struct Shape {
  int64_t T, K, H;
  bool fused;
  int64_t num_tokens;
};

// One rank's buffer on the host: a workspace before the combine region (the offset), rows of
// inactive slots and of tokens past num_tokens left as poison, as the engine leaves them unwritten.
struct HostRows {
  Shape s;
  size_t offset = 0;
  std::vector<uint8_t> buffer;
  std::vector<int32_t> topk;  // [num_tokens, K]

  bf16* row(int64_t k, int64_t t) {
    return reinterpret_cast<bf16*>(buffer.data() + offset + size_t((k * s.T + t) * s.H) * 2);
  }
  const bf16* row(int64_t k, int64_t t) const { return const_cast<HostRows*>(this)->row(k, t); }
  bool active(int64_t t, int64_t k) const { return topk[size_t(t * s.K + k)] >= 0; }
};

// Random routing (`inactive` of the routed slots off, every `padding_every`-th token all padding)
// and rows of activations (with NaN, +-inf, +-0 and subnormals when specials).
HostRows make_rows(const Shape& s, uint64_t seed, bool specials, double inactive = 0.1, int64_t padding_every = 5,
                   std::optional<size_t> offset = std::nullopt) {
  HostRows r;
  r.s = s;
  r.offset = offset.value_or(4096 + 16 * (seed % 7));
  const int64_t slots = s.K + (s.fused ? 1 : 0);
  r.buffer.resize(r.offset + size_t(slots * s.T * s.H) * 2 + 64);
  for (size_t i = 0; i + 1 < r.buffer.size(); i += 2) std::memcpy(&r.buffer[i], &kPoison, 2);
  std::mt19937_64 rng(seed);
  r.topk.assign(size_t(s.num_tokens * s.K), -1);
  int64_t num_rows = 0;
  for (int64_t t = 0; t < s.num_tokens; ++t) {
    const bool padding = padding_every && t % padding_every == padding_every - 1;
    for (int64_t k = 0; k < s.K; ++k)
      if (!padding && double(rng() % 1000) >= inactive * 1000) r.topk[size_t(t * s.K + k)] = int32_t(rng() % 256);
  }
  for (int64_t t = 0; t < s.num_tokens; ++t)
    for (int64_t k = 0; k < slots; ++k) num_rows += (k == s.K || r.active(t, k)) ? 1 : 0;
  const std::vector<bf16> data = test::to_bf16(test::activations(num_rows, s.H, seed + 11, specials));
  int64_t next = 0;
  for (int64_t t = 0; t < s.num_tokens; ++t)
    for (int64_t k = 0; k < slots; ++k)
      if (k == s.K || r.active(t, k)) std::memcpy(r.row(k, t), data.data() + (next++) * s.H, size_t(s.H) * 2);
  return r;
}

// The CPU fake quantizer's combine (fake_quant_moe.cpp): each active routed row QDQ'd as a [1, H]
// bf16 tensor into a bf16 row (or copied when f is nullopt), then combine_rows with the shared row
// last and unquantized.
std::vector<bf16> reference(const HostRows& r, std::optional<Format> f, float amax) {
  const Shape& s = r.s;
  std::vector<bf16> y(size_t(s.num_tokens * s.H)), q(size_t(s.K * s.H));
  for (int64_t t = 0; t < s.num_tokens; ++t) {
    const bf16* rows[kMaxCombineRows];
    int n = 0;
    for (int64_t k = 0; k < s.K; ++k) {
      if (!r.active(t, k)) continue;
      if (f) {
        bf16* qr = q.data() + n * s.H;
        qdq_ref(*f, r.row(k, t), qr, 1, s.H, amax);
        rows[n++] = qr;
      } else {
        rows[n++] = r.row(k, t);
      }
    }
    if (s.fused) rows[n++] = r.row(s.K, t);
    combine_rows(rows, n, s.H, y.data() + t * s.H);
  }
  return y;
}

// max |x| over the active routed rows' finite values (what max calibration on finite data sees).
float routed_amax(const HostRows& r) {
  float m = 0.0f;
  for (int64_t t = 0; t < r.s.num_tokens; ++t)
    for (int64_t k = 0; k < r.s.K; ++k)
      if (r.active(t, k))
        for (int64_t h = 0; h < r.s.H; ++h) {
          const float v = abs_f32(to_f32(r.row(k, t)[h]));
          if (is_finite(v)) m = max_ignore_nan(m, v);
        }
  return m;
}

struct DeviceRows {
  DeviceBuffer<uint8_t> buffer;
  DeviceBuffer<int32_t> topk;
  cuda::CombineRows rows;

  explicit DeviceRows(const HostRows& h) : buffer(h.buffer), topk(h.topk) {
    rows.buffer = buffer.get();
    rows.combine_offset = h.offset;
    rows.max_tokens = h.s.T;
    rows.top_k = h.s.K;
    rows.hidden = h.s.H;
    rows.fused_shared = h.s.fused;
    rows.topk_idx = topk.get();
    rows.num_tokens = h.s.num_tokens;
  }
  void upload(const HostRows& h) {
    buffer.upload(h.buffer);
    topk.upload(h.topk);
  }
};

std::string describe(const Shape& s) {
  return "T=" + std::to_string(s.T) + " K=" + std::to_string(s.K) + " H=" + std::to_string(s.H) +
         (s.fused ? " fused-shared" : "") + " num_tokens=" + std::to_string(s.num_tokens);
}

// num_tokens 0, 1 and T; H 384 (odd number of 128-column groups), 7168 and 128; K 1, 6, 8, 32.
const Shape kShapes[] = {
    {64, 8, 384, false, 64}, {64, 8, 384, true, 37}, {16, 8, 7168, true, 16}, {8, 32, 128, true, 8},
    {24, 6, 4096, false, 1}, {12, 1, 256, true, 12}, {16, 8, 384, true, 0}, {33, 4, 512, false, 33},
};

// The combine's sum-exact element rules (qdq_rules.cuh) against the numerics.h rules they stand
// for, on the device, on every input: equal bits, or both NaN, or both zero (the freedoms an fp32
// sum from +0 cannot see). Each QDQ result is compared after the bf16 rounding the CPU quantizer
// applies (and the combine applies wherever the rule says the result needs it).
__device__ bool same_in_sum(float a, float b) {
  if (is_nan(a) || is_nan(b)) return is_nan(a) && is_nan(b);
  return (a == 0.0f && b == 0.0f) || f32_bits(a) == f32_bits(b);
}
__device__ float bf16_value(float v) { return bf16_to_f32(bf16_round(v)); }

// Rounding cores on every a >= 0 and NaN (2^31 inputs, in slices).
__global__ void sum_cores_kernel(uint32_t base, unsigned long long* bad) {
  using namespace cuda::rules;
  const float a = f32_from_bits(base + blockIdx.x * blockDim.x + threadIdx.x);
  const float e4 = e4m3_decode(e4m3_encode_sat(a)), e2 = e2m1_round_sat(a);
  const float g4 = e4m3_round_sat_mag(a), g2 = e2m1_round_sat_mag(a);
  if (!(is_nan(e4) ? is_nan(g4) : f32_bits(e4) == f32_bits(g4))) atomicAdd(&bad[0], 1ull);
  if (!(is_nan(e2) ? is_nan(g2) : f32_bits(e2) == f32_bits(g2))) atomicAdd(&bad[1], 1ull);
}

// Every bf16 x (threads) against one parameter set (blockIdx.y): a global amax for fp8, int8 and
// nvfp4 (every block scale code under its global scale), or an mx block exponent.
__global__ void sum_rules_kernel(const float* amaxes, int num_amax, unsigned long long* bad) {
  using namespace cuda::rules;
  const float x = bf16_to_f32(uint16_t(blockIdx.x * blockDim.x + threadIdx.x));
  if (int(blockIdx.y) < num_amax) {
    const float amax = amaxes[blockIdx.y];
    const Fp8Params fp = fp8_params(amax);
    const float fp8_want = bf16_value(fp8_qdq(x, fp));
    if (!same_in_sum(fp8_want, bf16_value(fp8_qdq_sum(x, fp)))) atomicAdd(&bad[2], 1ull);
    const Int8Params ip = int8_params(amax);
    if (amax < 1.7014118e38f && !ip.zero) {
      const float rcp = div_rn(1.0f, ip.s), want = bf16_value(int8_qdq(x, ip));
      if (!same_in_sum(want, bf16_value(int8_qdq_sum(x, ip, rcp)))) atomicAdd(&bad[3], 1ull);
    }
    const float gs = nvfp4_global_scale(amax);
    for (int sf = 0; sf < 128; ++sf) {
      const float scale = nvfp4_scale_from_code(uint8_t(sf), gs), r = div_rn(1.0f, scale);
      if (scale == INFINITY) continue;  // unreachable: an infinite gs gives code 0 (a NaN scale)
      const float want = bf16_value(nvfp4_qdq(x, scale));
      if (!same_in_sum(want, bf16_value(nvfp4_qdq_sum_clamped(x, scale, r)))) atomicAdd(&bad[4], 1ull);
      if (!nvfp4_block_needs_clamp(abs_f32(x), r) && !same_in_sum(want, bf16_value(nvfp4_qdq_sum_unclamped(x, scale, r))))
        atomicAdd(&bad[4], 1ull);
      // The tame rule on every x a tame block can hold (|x| <= bmax, and the test is monotone in bmax).
      if (nvfp4_block_is_tame(abs_f32(x), r) && !same_in_sum(want, bf16_value(nvfp4_qdq_sum_tame(x, scale, r))))
        atomicAdd(&bad[9], 1ull);
    }
  } else {
    const int e = int(blockIdx.y) - num_amax - 127;
    const MxScale s = mx_scale(e);
    const float g8 = mxfp8_qdq_sum(x, s);
    if (!same_in_sum(bf16_value(mxfp8_qdq(x, s)), e < -124 ? bf16_value(g8) : g8)) atomicAdd(&bad[5], 1ull);
    if (!same_in_sum(bf16_value(mxfp4_qdq(x, s)), mxfp4_qdq_sum(x, s))) atomicAdd(&bad[6], 1ull);
    // The unscaled rules, where the combine takes them: on every x a block of exponent e can hold
    // (|x| <= M * 2^e, or NaN), the same value, and already a bf16 value.
    const auto unscaled_ok = [&](float want, float got) {
      return same_in_sum(want, got) && (is_nan(got) || (f32_bits(got) & 0xFFFFu) == 0);
    };
    const MxBounds b8 = mx_unscaled_bounds<true>(s.from_elem), b4 = mx_unscaled_bounds<false>(s.from_elem);
    if (mx_unscaled_ok<true>(e) && (is_nan(x) || abs_f32(x) <= b8.sat) &&
        !unscaled_ok(bf16_value(mxfp8_qdq(x, s)), mx_qdq_sum_unscaled<true>(x, b8)))
      atomicAdd(&bad[8], 1ull);
    if (mx_unscaled_ok<false>(e) && (is_nan(x) || abs_f32(x) <= b4.sat) &&
        !unscaled_ok(bf16_value(mxfp4_qdq(x, s)), mx_qdq_sum_unscaled<false>(x, b4)))
      atomicAdd(&bad[8], 1ull);
    // The packed rule (two elements per word), where the combine takes it: every x in the low half
    // and, in the high half, every x again in another order; a half the block cannot hold (|x| >
    // M * 2^e) is left 0 and not checked. Results are bf16 values by construction.
    const uint16_t xb = uint16_t(blockIdx.x * blockDim.x + threadIdx.x), yb = uint16_t(xb * 40503u + 17u);
    const float y = bf16_to_f32(yb);
    if (e >= kMxPackedMinExp && e <= kMxPackedMaxExp) {
      const auto packed_ok = [&](const MxBounds& b, float v, float want, uint16_t got) {
        return !(is_nan(v) || abs_f32(v) <= b.sat) || same_in_sum(want, bf16_to_f32(got));
      };
      const auto fits = [](const MxBounds& b, float v) { return is_nan(v) || abs_f32(v) <= b.sat; };
      const uint32_t f8 = f32_bits(b8.floor) >> 16, f4 = f32_bits(b4.floor) >> 16;
      const uint32_t w8 = (fits(b8, x) ? xb : 0u) | ((fits(b8, y) ? uint32_t(yb) : 0u) << 16);
      const uint32_t w4 = (fits(b4, x) ? xb : 0u) | ((fits(b4, y) ? uint32_t(yb) : 0u) << 16);
      const uint32_t g8 = mx_qdq_sum_unscaled_x2<true>(w8, f8 | (f8 << 16));
      const uint32_t g4 = mx_qdq_sum_unscaled_x2<false>(w4, f4 | (f4 << 16));
      if ((f32_bits(b8.floor) & 0xFFFFu) || (f32_bits(b4.floor) & 0xFFFFu) ||
          !packed_ok(b8, x, bf16_value(mxfp8_qdq(x, s)), uint16_t(g8)) ||
          !packed_ok(b8, y, bf16_value(mxfp8_qdq(y, s)), uint16_t(g8 >> 16)) ||
          !packed_ok(b4, x, bf16_value(mxfp4_qdq(x, s)), uint16_t(g4)) ||
          !packed_ok(b4, y, bf16_value(mxfp4_qdq(y, s)), uint16_t(g4 >> 16)))
        atomicAdd(&bad[10], 1ull);
    }
    // The division-free block exponent, on every bf16 block maximum (and +inf).
    if (e == 0 && x >= 0.0f && !is_nan(x)) {
      if (mx_block_exponent_bf16<true>(x) != mx_block_exponent(x, kE4m3Max)) atomicAdd(&bad[7], 1ull);
      if (mx_block_exponent_bf16<false>(x) != mx_block_exponent(x, kE2m1Max)) atomicAdd(&bad[7], 1ull);
      // Every element of a block with this maximum is within the unscaled rules' saturation.
      if (x > mx_unscaled_bounds<true>(exp2i(mx_block_exponent_bf16<true>(x))).sat) atomicAdd(&bad[8], 1ull);
      if (x > mx_unscaled_bounds<false>(exp2i(mx_block_exponent_bf16<false>(x))).sat) atomicAdd(&bad[8], 1ull);
    }
    // The packed rule's block parameters, on every bf16 maximum bits (sign and upper half ignored):
    // where accepted, the block exponent is mx_block_exponent_bf16's, inside the packed range, and
    // the floor is mx_unscaled_bounds' in both halves.
    if (e == 0) {
      const float bmax = abs_f32(x);
      const MxPacked p8 = mx_packed_block<true>(xb | 0xA5A50000u), p4 = mx_packed_block<false>(xb | 0x5A5A8000u);
      const auto same = [](const MxPacked& p, int pe, float floor) {
        const uint32_t fb = f32_bits(floor) >> 16;
        return pe >= kMxPackedMinExp && pe <= kMxPackedMaxExp && p.floor2 == (fb | (fb << 16));
      };
      const int e8 = mx_block_exponent_bf16<true>(bmax), e4 = mx_block_exponent_bf16<false>(bmax);
      if (p8.ok && (is_nan(x) || !same(p8, e8, mx_unscaled_bounds<true>(exp2i(e8)).floor))) atomicAdd(&bad[11], 1ull);
      if (p4.ok && (is_nan(x) || !same(p4, e4, mx_unscaled_bounds<false>(exp2i(e4)).floor))) atomicAdd(&bad[11], 1ull);
      // fp8_block128_ue8m0's blocks in the packed rule: where accepted, the exponent of its scale is
      // in the packed range, the floor is that exponent's, and the maximum is within the saturation
      // (so is every element of the block); every finite maximum with e <= 99 is accepted (e >= -22).
      if (!is_nan(x)) {
        const MxPacked pu = fp8_block128_ue8m0_packed(bmax);
        const MxScale su = fp8_block128_ue8m0_scale(bmax);
        const int eu = is_finite(su.from_elem) ? ceil_log2(su.from_elem) : 1000;
        const MxBounds bu = mx_unscaled_bounds<true>(su.from_elem);
        if (pu.ok && (!same(pu, eu, bu.floor) || !(bmax <= bu.sat))) atomicAdd(&bad[13], 1ull);
        if (!pu.ok && is_finite(bmax) && eu <= kMxPackedMaxExp) atomicAdd(&bad[13], 1ull);
      }
      // Every maximum of a finite, non-zero block in the packed range is accepted.
      if (!is_nan(x) && is_finite(x) && bmax > 0.0f) {
        if (!p8.ok && e8 >= kMxPackedMinExp && e8 <= kMxPackedMaxExp) atomicAdd(&bad[11], 1ull);
        if (!p4.ok && e4 >= kMxPackedMinExp && e4 <= kMxPackedMaxExp) atomicAdd(&bad[11], 1ull);
      }
    }
  }
}

// bf16x2_max_abs and bf16x2_min_abs on every pair of bf16 (a, b) (2^32 pairs, in slices), both
// halves and both orders: the magnitude is max or min(|a|, |b|) over the non-NaN of the two, NaN
// only when both are NaN.
__global__ void max_abs_kernel(uint32_t base, unsigned long long* bad) {
  const uint32_t i = base + blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t a = i & 0xFFFFu, b = i >> 16;
  const uint32_t r = bf16x2_max_abs(a | (b << 16), b | (a << 16));
  const float fa = abs_f32(bf16_to_f32(uint16_t(a))), fb = abs_f32(bf16_to_f32(uint16_t(b)));
  const float want = is_nan(fa) ? fb : (is_nan(fb) ? fa : (fa > fb ? fa : fb));
  const uint32_t rmin = bf16x2_min_abs(a | (b << 16), b | (a << 16));
  const float want_min = is_nan(fa) ? fb : (is_nan(fb) ? fa : (fa < fb ? fa : fb));
  for (int h = 0; h < 32; h += 16) {
    const float got = bf16_to_f32(uint16_t((r >> h) & 0x7FFFu));
    if (is_nan(want) ? !is_nan(got) : f32_bits(got) != f32_bits(want)) atomicAdd(&bad[12], 1ull);
    const float got_min = bf16_to_f32(uint16_t((rmin >> h) & 0x7FFFu));
    if (is_nan(want_min) ? !is_nan(got_min) : f32_bits(got_min) != f32_bits(want_min)) atomicAdd(&bad[12], 1ull);
  }
}

TEST(CombineCuda, SumExactRulesEqualTheQdqRulesOnEveryInput) {
  SKIP_WITHOUT_GPU();
  DeviceBuffer<unsigned long long> bad(std::vector<unsigned long long>(14, 0));
  for (uint64_t base = 0; base < (1ull << 31); base += (1ull << 28)) {
    sum_cores_kernel<<<(1u << 28) / 256, 256>>>(uint32_t(base), bad.get());
    MOEFQ_CUDA_CHECK_LAUNCH();
  }
  for (uint64_t base = 0; base < (1ull << 32); base += (1ull << 28)) {
    max_abs_kernel<<<(1u << 28) / 256, 256>>>(uint32_t(base), bad.get());
    MOEFQ_CUDA_CHECK_LAUNCH();
  }
  std::vector<float> amaxes = {0.0f, 1e-40f, 1e-30f, 5.9604644775390625e-08f, 6e-8f, 1e-6f, 0.5f, 1.0f, 448.0f,
                               2688.0f, 1e4f, 1.7e38f, 1.7014118e38f, 3e38f, INFINITY};
  std::mt19937 rng(5);
  for (int i = 0; i < 200; ++i) amaxes.push_back(std::ldexp(1.0f + float(rng() % 1000000) / 1e6f, int(rng() % 200) - 100));
  for (int i = 0; i < 100; ++i) amaxes.push_back(bf16_to_f32(uint16_t(rng() % 0x7F80)));
  const DeviceBuffer<float> d_amax(amaxes);
  sum_rules_kernel<<<dim3(65536 / 256, unsigned(amaxes.size()) + 255), 256>>>(d_amax.get(), int(amaxes.size()),
                                                                             bad.get());
  MOEFQ_CUDA_CHECK_LAUNCH();
  const auto b = bad.download();
  const char* names[] = {"e4m3 rounding core", "e2m1 rounding core", "fp8",          "int8",
                         "nvfp4",              "mxfp8",              "mxfp4",        "mx block exponent",
                         "mx unscaled",        "nvfp4 tame",         "mx packed",    "mx packed block",
                         "bf16x2 max/min abs", "fp8_block128_ue8m0 packed block"};
  for (int i = 0; i < 14; ++i) EXPECT_EQ(b[size_t(i)], 0u) << names[i] << ": inputs where the sum-exact rule differs";
}

TEST(CombineCuda, PlainCombineEqualsCpu) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 1;
  for (const Shape& s : kShapes)
    for (bool specials : {false, true}) {
      SCOPED_TRACE(describe(s) + (specials ? " specials" : ""));
      const HostRows h = make_rows(s, seed++, specials);
      DeviceRows d(h);
      DeviceBuffer<bf16> y(size_t(s.num_tokens * s.H));
      cuda::launch_combine(d.rows, y.get(), nullptr);
      MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(test::bytes_equal(reference(h, std::nullopt, 0.0f), y.download()));
    }
}

// One active routed slot per token (k = t % K), every element of row (k, t) = (k + 1) * 2^(t % 16 - 8):
// y[t] is that row exactly, so a row taken from the wrong slot or token names itself.
TEST(CombineCuda, RowsNameThemselves) {
  SKIP_WITHOUT_GPU();
  const Shape s{40, 8, 256, false, 40};
  HostRows h = make_rows(s, 3, false, 0.0, 0);
  std::vector<bf16> want(size_t(s.num_tokens * s.H));
  for (int64_t t = 0; t < s.num_tokens; ++t)
    for (int64_t k = 0; k < s.K; ++k) {
      const bool on = k == t % s.K;
      h.topk[size_t(t * s.K + k)] = on ? int32_t(k) : -1;
      const bf16 v{bf16_round(std::ldexp(float(k + 1), int(t % 16) - 8))};
      for (int64_t e = 0; e < s.H; ++e) {
        h.row(k, t)[e] = v;
        if (on) want[size_t(t * s.H + e)] = v;
      }
    }
  DeviceRows d(h);
  DeviceBuffer<bf16> y(want.size());
  cuda::launch_combine(d.rows, y.get(), nullptr);
  EXPECT_TRUE(test::bytes_equal(want, y.download()));
}

TEST(CombineCuda, QdqCombineEqualsCpuEveryFormat) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 100;
  for (const Shape& s : kShapes)
    for (bool specials : {false, true}) {
      const HostRows h = make_rows(s, seed++, specials);
      DeviceRows d(h);
      DeviceBuffer<bf16> y(size_t(s.num_tokens * s.H));
      const float calibrated = routed_amax(h);
      // calibrated, saturating (many blocks clamp), tiny (fp8 falls back to 1, int8 to zero),
      // +inf (NaN scales), and 2688 (nvfp4 global scale 1).
      for (float amax : {calibrated, calibrated / 500.0f, 0.0f, INFINITY, 2688.0f})
        for (Format f : kAllFormats) {
          if (!format_has_global_amax(f) && amax != calibrated) continue;
          SCOPED_TRACE(describe(s) + (specials ? " specials " : " ") + format_name(f) + " amax " + std::to_string(amax));
          DeviceBuffer<float> d_amax(std::vector<float>{amax});
          cuda::launch_combine_qdq(d.rows, true, f, format_has_global_amax(f) ? d_amax.get() : nullptr, {}, y.get(),
                                   nullptr);
          MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
          EXPECT_TRUE(test::bytes_equal(reference(h, f, amax), y.download()));
        }
    }
}

// Blocks of every magnitude the formats' rules branch on, side by side in one warp: each 32-element
// block of a row gets its own exponent (2^-133 up to near bf16's maximum), and some hold inf, NaN,
// zeros or one huge outlier. This takes the mx rules' scalar fallback (zero, tiny, huge, inf and NaN
// maxima) next to the packed rule, and nvfp4's tame, unclamped and clamped rules in the same warp.
TEST(CombineCuda, QdqCombineEqualsCpuOnExtremeBlocks) {
  SKIP_WITHOUT_GPU();
  const Shape s{24, 8, 1024, true, 21};
  HostRows h = make_rows(s, 77, false);
  std::mt19937_64 rng(78);
  for (int64_t t = 0; t < s.num_tokens; ++t)
    for (int64_t k = 0; k <= s.K; ++k) {
      if (k < s.K && !h.active(t, k)) continue;
      bf16* row = h.row(k, t);
      for (int64_t c0 = 0; c0 < s.H; c0 += 32) {
        const int kind = int(rng() % 12);
        const int exp = int(rng() % 262) - 133;  // block magnitude 2^exp, [-133, 128]
        for (int64_t c = c0; c < c0 + 32; ++c) {
          float v = std::ldexp(float(rng() % 4096) / 2048.0f - 1.0f, exp - int(rng() % 12));
          if (kind == 0) v = 0.0f;
          if (kind == 1 && rng() % 4 == 0) v = (rng() % 2) ? INFINITY : -INFINITY;
          if (kind == 2 && rng() % 3 != 0) v = std::nanf("");
          if (kind == 3 && c == c0 + int64_t(rng() % 32)) v = 3e38f;
          row[c] = bf16{bf16_round(v)};
        }
      }
    }
  DeviceRows d(h);
  DeviceBuffer<bf16> y(size_t(s.num_tokens * s.H));
  const float calibrated = routed_amax(h);
  for (float amax : {calibrated, calibrated / 1e20f, 1e-30f, 2688.0f, INFINITY})
    for (Format f : kAllFormats) {
      if (!format_has_global_amax(f) && amax != calibrated) continue;
      SCOPED_TRACE(std::string(format_name(f)) + " amax " + std::to_string(amax));
      DeviceBuffer<float> d_amax(std::vector<float>{amax});
      cuda::launch_combine_qdq(d.rows, true, f, format_has_global_amax(f) ? d_amax.get() : nullptr, {}, y.get(),
                               nullptr);
      EXPECT_TRUE(test::bytes_equal(reference(h, f, amax), y.download()));
    }
}

// logfmt10's cast groups in the combine: rows scaled below 1 so groups are cast, with a block >= 1
// in some rows (its whole group stays bf16); H a multiple of 1024 (a group is the CTA's 4 warps),
// of 512 only (2 warps), and 640 and 384 (a short last group, lanes past the row's end). Some rows
// are scaled to 2^-110 and below (grids reaching under 2^-126: the decode's general exp2 path,
// subnormal elements: log2 without the table) and some have zeros and NaN. Byte for byte against
// the CPU quantizer's re-sum, which must differ from the plain combine (cast rows).
TEST(CombineCuda, LogFmtCastGroupsEqualCpu) {
  SKIP_WITHOUT_GPU();
  const Shape shapes[] = {{32, 8, 1024, true, 32}, {16, 8, 7168, false, 16}, {24, 6, 1536, true, 24},
                          {24, 8, 640, false, 21}, {16, 4, 384, true, 16}};
  uint64_t seed = 900;
  for (const Shape& s : shapes) {
    HostRows h = make_rows(s, seed++, false);
    std::mt19937_64 rng(seed);
    for (int64_t t = 0; t < s.num_tokens; ++t)
      for (int64_t k = 0; k < s.K + (s.fused ? 1 : 0); ++k) {  // the shared row only when it is fused
        if (k < s.K && !h.active(t, k)) continue;
        bf16* row = h.row(k, t);
        const int shift = rng() % 5 == 0 ? -110 - int(rng() % 20) : -6;
        for (int64_t e = 0; e < s.H; ++e) row[e] = bf16{bf16_round(std::ldexp(to_f32(row[e]), shift))};
        if (rng() % 4 == 0) row[rng() % uint64_t(s.H)] = bf16{bf16_round(1.5f)};  // its group stays bf16
        if (rng() % 4 == 0) row[rng() % uint64_t(s.H)] = bf16{0};
        if (rng() % 8 == 0) row[rng() % uint64_t(s.H)] = bf16{kCanonicalNanBf16};
      }
    SCOPED_TRACE(describe(s));
    DeviceRows d(h);
    DeviceBuffer<bf16> y(size_t(s.num_tokens * s.H));
    cuda::launch_combine_qdq(d.rows, true, Format::kLogfmt10, nullptr, {}, y.get(), nullptr);
    MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<bf16> want = reference(h, Format::kLogfmt10, 0.0f);
    EXPECT_TRUE(test::bytes_equal(want, y.download()));
    EXPECT_FALSE(test::bytes_equal(want, reference(h, std::nullopt, 0.0f))) << "no group was cast";
  }
}

// The block-128 formats need H to be a multiple of 128.
TEST(CombineCuda, Block128FormatsRejectOtherHiddenSizes) {
  SKIP_WITHOUT_GPU();
  HostRows h = make_rows({8, 4, 160, false, 8}, 5, false);
  DeviceRows d(h);
  DeviceBuffer<bf16> y(size_t(8 * 160));
  for (Format f : kAllFormats)
    if (format_block_size(f) == 128)
      EXPECT_THROW(cuda::launch_combine_qdq(d.rows, true, f, nullptr, {}, y.get(), nullptr), Error) << format_name(f);
}

TEST(CombineCuda, QuantizeFalseIsThePlainCombine) {
  SKIP_WITHOUT_GPU();
  const Shape s{32, 8, 384, true, 32};
  const HostRows h = make_rows(s, 7, true);
  DeviceRows d(h);
  DeviceBuffer<bf16> y(size_t(s.num_tokens * s.H));
  cuda::launch_combine_qdq(d.rows, false, Format::kNvfp4, nullptr, {}, y.get(), nullptr);
  EXPECT_TRUE(test::bytes_equal(reference(h, std::nullopt, 0.0f), y.download()));
}

// The engine's output as the GPU engine would leave it: the plain combine of the same rows.
DeviceBuffer<bf16> engine_output(const DeviceRows& d) {
  DeviceBuffer<bf16> y(size_t(d.rows.num_tokens * d.rows.hidden));
  cuda::launch_combine(d.rows, y.get(), nullptr);
  return y;
}

DeviceBuffer<cuda::CheckRecord> new_record() {
  DeviceBuffer<cuda::CheckRecord> r(1);
  cuda::reset_check_record(r.get(), nullptr);
  return r;
}

TEST(CombineCuda, CheckPassesOnCorrectRowsEveryFormatAndInPlace) {
  SKIP_WITHOUT_GPU();
  const Shape s{48, 8, 1024, true, 45};
  const HostRows h = make_rows(s, 9, true);
  DeviceRows d(h);
  const float amax = routed_amax(h);
  DeviceBuffer<float> d_amax(std::vector<float>{amax});
  auto record = new_record();
  for (Format f : kAllFormats)
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(std::string(format_name(f)) + (in_place ? " in place" : ""));
      DeviceBuffer<bf16> y_engine = engine_output(d);
      DeviceBuffer<bf16> y_sep(y_engine.size());
      bf16* y_out = in_place ? y_engine.get() : y_sep.get();
      cuda::launch_combine_qdq(d.rows, true, f, d_amax.get(), {y_engine.get(), record.get(), false}, y_out, nullptr);
      const auto m = cuda::read_check(record.get(), s.H, nullptr);
      EXPECT_FALSE(m.has_value()) << "token " << m->token << " element " << m->element;
      std::vector<bf16> got(y_engine.size());
      MOEFQ_CUDA_CHECK(cudaMemcpy(got.data(), y_out, got.size() * 2, cudaMemcpyDeviceToHost));
      EXPECT_TRUE(test::bytes_equal(reference(h, f, amax), got));
    }
  // quantize = false with a check: output and re-sum are the same sum.
  DeviceBuffer<bf16> y_engine = engine_output(d);
  cuda::launch_combine_qdq(d.rows, false, Format::kFp8, nullptr, {y_engine.get(), record.get(), false},
                           y_engine.get(), nullptr);
  EXPECT_FALSE(cuda::read_check(record.get(), s.H, nullptr).has_value());
  EXPECT_TRUE(test::bytes_equal(reference(h, std::nullopt, 0.0f), y_engine.download()));
}

// The CPU's layout check on host data: first mismatching (token, element) of the engine output
// against the re-sum of the rows, and the number of mismatching elements.
struct Expected {
  int64_t token = -1, element = -1;
  uint16_t engine = 0, resum = 0;
  uint64_t count = 0;
};
Expected cpu_check(const HostRows& h, const std::vector<bf16>& y_engine) {
  const std::vector<bf16> resum = reference(h, std::nullopt, 0.0f);
  Expected e;
  for (size_t i = 0; i < resum.size(); ++i)
    if (resum[i].bits != y_engine[i].bits && e.count++ == 0) {
      e.token = int64_t(i) / h.s.H;
      e.element = int64_t(i) % h.s.H;
      e.engine = y_engine[i].bits;
      e.resum = resum[i].bits;
    }
  return e;
}

void expect_mismatch(const std::optional<cuda::CheckMismatch>& m, const Expected& e) {
  ASSERT_GT(e.count, 0u) << "the corruption changed no sum: the test data is wrong";
  ASSERT_TRUE(m.has_value()) << "the check missed " << e.count << " mismatches";
  EXPECT_EQ(m->token, e.token);
  EXPECT_EQ(m->element, e.element);
  EXPECT_EQ(m->engine_bits, e.engine);
  EXPECT_EQ(m->resum_bits, e.resum);
  EXPECT_EQ(m->count, e.count);
}

TEST(CombineCuda, CheckNamesTheFirstMismatch) {
  SKIP_WITHOUT_GPU();
  const Shape s{32, 8, 768, true, 30};
  HostRows h = make_rows(s, 21, false, 0.1, 0);
  DeviceRows d(h);
  DeviceBuffer<bf16> y_engine = engine_output(d);
  const std::vector<bf16> engine_host = y_engine.download();
  // Corrupt a routed row of token 5 (element 600), then, in a lower slot, one of token 3 (element
  // 77) and the shared row of token 9: the first mismatch in position order is token 3, element 77.
  auto first_active = [&](int64_t t) {
    for (int64_t k = 0; k < s.K; ++k)
      if (h.active(t, k)) return k;
    return int64_t(-1);
  };
  ASSERT_GE(first_active(3), 0);
  ASSERT_GE(first_active(5), 0);
  int64_t k5 = s.K - 1;
  while (!h.active(5, k5)) --k5;
  h.row(k5, 5)[600] = bf16{bf16_round(4096.0f)};
  h.row(first_active(3), 3)[77] = bf16{bf16_round(4096.0f)};
  h.row(s.K, 9)[5] = bf16{bf16_round(4096.0f)};
  d.upload(h);
  const Expected want = cpu_check(h, engine_host);
  EXPECT_EQ(want.count, 3u);
  auto record = new_record();
  for (Format f : {Format::kNvfp4, Format::kMxfp4}) {
    SCOPED_TRACE(format_name(f));
    DeviceBuffer<float> d_amax(std::vector<float>{2688.0f});
    DeviceBuffer<bf16> y_out(y_engine.size());
    cuda::launch_combine_qdq(d.rows, true, f, d_amax.get(), {y_engine.get(), record.get(), false}, y_out.get(), nullptr);
    expect_mismatch(cuda::read_check(record.get(), s.H, nullptr), want);
    EXPECT_FALSE(cuda::read_check(record.get(), s.H, nullptr).has_value()) << "read_check did not reset the record";
    // The output is still the combine quantizer's (of the rows as they are).
    EXPECT_TRUE(test::bytes_equal(reference(h, f, 2688.0f), y_out.download()));
  }
  // The record accumulates over launches until it is read; the first stays the first.
  DeviceBuffer<bf16> y_scratch(y_engine.size());
  for (int i = 0; i < 3; ++i)
    cuda::launch_combine_qdq(d.rows, false, Format::kFp8, nullptr, {y_engine.get(), record.get(), false},
                             y_scratch.get(), nullptr);
  Expected thrice = want;
  thrice.count *= 3;
  expect_mismatch(cuda::read_check(record.get(), s.H, nullptr), thrice);
}

// MOEFQ_COMM_KERNEL_DEBUG=1 zeroes the buffer after the call: every non-zero output mismatches.
TEST(CombineCuda, CheckCatchesAZeroedBuffer) {
  SKIP_WITHOUT_GPU();
  const Shape s{16, 8, 384, true, 16};
  HostRows h = make_rows(s, 33, true, 0.1, 4);
  DeviceRows d(h);
  DeviceBuffer<bf16> y_engine = engine_output(d);
  const std::vector<bf16> engine_host = y_engine.download();
  std::fill(h.buffer.begin(), h.buffer.end(), uint8_t(0));
  d.upload(h);
  const Expected want = cpu_check(h, engine_host);
  auto record = new_record();
  DeviceBuffer<float> d_amax(std::vector<float>{100.0f});
  cuda::launch_combine_qdq(d.rows, true, Format::kFp8, d_amax.get(), {y_engine.get(), record.get(), false},
                           y_engine.get(), nullptr);
  expect_mismatch(cuda::read_check(record.get(), s.H, nullptr), want);
}

// The check captured in a CUDA graph: replays follow changed rows and routing; a corrupted layout
// surfaces through the record at the next sync point, and the context survives.
TEST(CombineCuda, GraphCaptureReplaysWithChangedRows) {
  SKIP_WITHOUT_GPU();
  const Shape s{64, 8, 512, true, 50};
  HostRows h = make_rows(s, 41, true);
  DeviceRows d(h);
  DeviceBuffer<float> d_amax(std::vector<float>{256.0f});
  DeviceBuffer<bf16> y_engine(size_t(s.num_tokens * s.H)), y_out(y_engine.size());
  auto record = new_record();
  cudaStream_t stream;
  MOEFQ_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOEFQ_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  cuda::launch_combine_qdq(d.rows, true, Format::kNvfp4, d_amax.get(), {y_engine.get(), record.get(), false},
                           y_out.get(), stream);
  MOEFQ_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MOEFQ_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (uint64_t seed : {41u, 42u, 43u}) {
    SCOPED_TRACE("rows of seed " + std::to_string(seed));
    h = make_rows(s, seed, true, 0.1, 5, d.rows.combine_offset);  // same layout, new rows and routing
    d.upload(h);
    cuda::launch_combine(d.rows, y_engine.get(), stream);
    MOEFQ_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    EXPECT_FALSE(cuda::read_check(record.get(), s.H, stream).has_value());
    EXPECT_TRUE(test::bytes_equal(reference(h, Format::kNvfp4, 256.0f), y_out.download()));
  }
  // Corrupt the layout: the engine output stays, the rows move by one token.
  const std::vector<bf16> engine_host = y_engine.download();
  std::memmove(h.buffer.data() + h.offset + size_t(s.H) * 2, h.buffer.data() + h.offset,
               h.buffer.size() - h.offset - size_t(s.H) * 2);
  d.upload(h);
  MOEFQ_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  MOEFQ_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  Expected want = cpu_check(h, engine_host);
  want.count *= 2;
  expect_mismatch(cuda::read_check(record.get(), s.H, stream), want);
  // The context survives: a further replay and a plain launch work.
  MOEFQ_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  MOEFQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_TRUE(cuda::read_check(record.get(), s.H, stream).has_value());
  cuda::launch_combine(d.rows, y_engine.get(), stream);
  MOEFQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_TRUE(test::bytes_equal(reference(h, std::nullopt, 0.0f), y_engine.download()));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

constexpr int kTrapExit = 77;

// Run only as a child of TrapIsOptInAndKillsOnlyTheContext: a mismatch with trap on.
TEST(CombineCudaChild, DISABLED_TrapOnMismatch) {
  if (std::getenv("MOEFQ_COMBINE_TRAP_CHILD") == nullptr) GTEST_SKIP() << "child of a trap test only";
  const Shape s{8, 4, 256, false, 8};
  HostRows h = make_rows(s, 5, false, 0.0, 0);
  DeviceRows d(h);
  DeviceBuffer<bf16> y_engine = engine_output(d);
  h.row(0, 2)[3] = bf16{bf16_round(4096.0f)};
  d.upload(h);
  auto record = new_record();
  cuda::launch_combine_qdq(d.rows, false, Format::kFp8, nullptr, {y_engine.get(), record.get(), true},
                           y_engine.get(), nullptr);
  const cudaError_t err = cudaDeviceSynchronize();
  std::fprintf(stderr, "child: %s\n", cudaGetErrorString(err));
  std::_Exit(err != cudaSuccess ? kTrapExit : 0);
}

TEST(CombineCuda, TrapIsOptInAndKillsOnlyTheContext) {
  SKIP_WITHOUT_GPU();
  std::string filter = "--gtest_filter=CombineCudaChild.DISABLED_TrapOnMismatch";
  std::string also = "--gtest_also_run_disabled_tests";
  char* argv[] = {const_cast<char*>("/proc/self/exe"), filter.data(), also.data(), nullptr};
  std::vector<std::string> env_s = {"MOEFQ_COMBINE_TRAP_CHILD=1"};
  for (char** e = environ; *e; ++e) env_s.emplace_back(*e);
  std::vector<char*> env;
  for (auto& e : env_s) env.push_back(e.data());
  env.push_back(nullptr);
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, env.data()), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), kTrapExit) << "the trap did not stop the kernel";
  // This process's context is untouched.
  DeviceBuffer<int> probe(std::vector<int>{1});
  MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
}

// The shared rows may live apart from the buffer (CombineRows::shared, as the Python binding's
// combine_qdq_resum passes them): the same bits as from slot K, and slot K (poisoned here) unread.
TEST(CombineCuda, SharedRowsFromTheirOwnPointer) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 700;
  for (const Shape& s : kShapes) {
    if (!s.fused) continue;
    const HostRows h = make_rows(s, seed++, true);
    HostRows poisoned = h;
    std::vector<bf16> shared(size_t(s.T * s.H));
    for (int64_t t = 0; t < s.T; ++t) {
      std::memcpy(shared.data() + t * s.H, h.row(s.K, t), size_t(s.H) * 2);
      for (int64_t i = 0; i < s.H; ++i) std::memcpy(poisoned.row(s.K, t) + i, &kPoison, 2);
    }
    DeviceRows d(poisoned);
    DeviceBuffer<bf16> d_shared(shared), y(size_t(s.num_tokens * s.H));
    cuda::CombineRows r = d.rows;
    r.shared = d_shared.get();
    const float amax = routed_amax(h);
    DeviceBuffer<float> d_amax(std::vector<float>{amax});
    for (Format f : kAllFormats) {
      SCOPED_TRACE(describe(s) + " " + format_name(f));
      cuda::launch_combine_qdq(r, true, f, format_has_global_amax(f) ? d_amax.get() : nullptr, {}, y.get(), nullptr);
      MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(test::bytes_equal(reference(h, f, amax), y.download()));
    }
    cuda::launch_combine(r, y.get(), nullptr);
    MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(test::bytes_equal(reference(h, std::nullopt, 0.0f), y.download())) << describe(s);
    if (s.num_tokens == 0) continue;  // nothing is launched, nothing checked
    r.shared = d_shared.get() + 1;    // 2 bytes off: not 16-byte aligned
    EXPECT_THROW(cuda::launch_combine(r, y.get(), nullptr), Error);
  }
}

TEST(CombineCuda, RejectsWhatTheLayoutCannotHold) {
  SKIP_WITHOUT_GPU();
  const Shape s{8, 4, 256, false, 8};
  const HostRows h = make_rows(s, 5, false);
  DeviceRows d(h);
  DeviceBuffer<bf16> y(size_t(s.num_tokens * s.H));
  cuda::CombineRows r = d.rows;
  r.hidden = 200;
  EXPECT_THROW(cuda::launch_combine(r, y.get(), nullptr), Error);
  r = d.rows;
  r.top_k = 33;
  EXPECT_THROW(cuda::launch_combine(r, y.get(), nullptr), Error);
  r = d.rows;
  r.num_tokens = r.max_tokens + 1;
  EXPECT_THROW(cuda::launch_combine(r, y.get(), nullptr), Error);
  r = d.rows;
  r.combine_offset += 2;
  EXPECT_THROW(cuda::launch_combine(r, y.get(), nullptr), Error);
  EXPECT_THROW(cuda::launch_combine_qdq(d.rows, true, Format::kNvfp4, nullptr, {}, y.get(), nullptr), Error);
  EXPECT_THROW(cuda::launch_combine_qdq(d.rows, true, Format::kMxfp8, nullptr, {y.get(), nullptr, false}, y.get(), nullptr),
               Error);
  // No tokens: nothing is launched and nothing is checked.
  r = d.rows;
  r.num_tokens = 0;
  EXPECT_NO_THROW(cuda::launch_combine(r, nullptr, nullptr));
}

// ---------------------------------------------------------------------------------------------
// combine_weighting after: CombineRows::topk_weights set, each (QDQ'd) routed row added as one fma
// with its router weight; the CPU side is combine_qdq_ref with topk_weights.

// [num_tokens, K] router weights: top-k-like values, one negative now and then, and 1.0.
std::vector<float> router_weights(const Shape& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> w(size_t(s.num_tokens * s.K));
  for (float& v : w) {
    const uint64_t u = rng() % 1000;
    v = u == 0 ? 1.0f : u == 1 ? -0.375f : float(u) / 1000.0f * 0.7f;
  }
  return w;
}

std::vector<bf16> weighted_reference(const HostRows& h, std::optional<Format> f, float amax,
                                     const std::vector<float>& weights) {
  const Shape& s = h.s;
  std::vector<bf16> y(size_t(s.num_tokens * s.H));
  HostCombineRows r;
  r.rows = h.row(0, 0);
  r.slot_stride = s.T * s.H;
  r.top_k = s.K;
  r.num_tokens = s.num_tokens;
  r.hidden = s.H;
  r.topk_idx = h.topk.data();
  r.shared = s.fused ? h.row(s.K, 0) : nullptr;
  r.topk_weights = weights.data();
  combine_qdq_ref(r, f, amax, y.data());
  return y;
}

TEST(CombineCuda, WeightedCombineEqualsCpuEveryFormat) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 300;
  for (const Shape& s : kShapes)
    for (bool specials : {false, true}) {
      const HostRows h = make_rows(s, seed++, specials);
      const std::vector<float> weights = router_weights(s, seed);
      DeviceRows d(h);
      const DeviceBuffer<float> d_weights(weights);
      cuda::CombineRows rows = d.rows;
      rows.topk_weights = d_weights.get();
      DeviceBuffer<bf16> y(size_t(s.num_tokens * s.H));
      SCOPED_TRACE(describe(s) + (specials ? " specials" : ""));
      cuda::launch_combine(rows, y.get(), nullptr);
      MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(test::bytes_equal(weighted_reference(h, std::nullopt, 0.0f, weights), y.download())) << "plain combine";
      const float amax = routed_amax(h);
      DeviceBuffer<float> d_amax(std::vector<float>{amax});
      for (Format f : kAllFormats) {
        if (format_block_size(f) > kMxBlock && s.H % format_block_size(f) != 0) continue;
        cuda::launch_combine_qdq(rows, true, f, d_amax.get(), {}, y.get(), nullptr);
        MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
        EXPECT_TRUE(test::bytes_equal(weighted_reference(h, f, amax, weights), y.download())) << format_name(f);
      }
    }
}

// Each weighted row is one fma: w0 * x0 = -(1 + 2^-7 + 2^-20 + 2^-27) rounds to -(1 + 2^-7 + 2^-20),
// and w2 * x2 is its exact negation, so token 0 sums to 2^-27 (the product rounded before the add
// would give +0); token 1 is 0.5 * (1 + 2^-7) + 0.25 * 2. The inactive slot 1 holds poison.
TEST(CombineCuda, WeightedSumIsOneFmaPerRow) {
  SKIP_WITHOUT_GPU();
  const Shape s{2, 3, 128, false, 2};
  HostRows h = make_rows(s, 31, false, 0.0, 0);
  const float x = 1.0f + std::ldexp(1.0f, -7), w = 1.0f + std::ldexp(1.0f, -20);
  h.topk = {0, -1, 2, 0, -1, 2};
  for (int64_t t = 0; t < 2; ++t)
    for (int64_t e = 0; e < s.H; ++e) {
      h.row(0, t)[e].bits = bf16_round(x);
      h.row(1, t)[e].bits = kPoison;
      h.row(2, t)[e].bits = bf16_round(t == 0 ? x : 2.0f);
    }
  const std::vector<float> weights = {-w, 9.0f, w, 0.5f, 9.0f, 0.25f};
  DeviceRows d(h);
  DeviceBuffer<float> d_weights(weights);
  cuda::CombineRows rows = d.rows;
  rows.topk_weights = d_weights.get();
  DeviceBuffer<bf16> y(size_t(2 * s.H));
  cuda::launch_combine(rows, y.get(), nullptr);
  const std::vector<bf16> got = y.download();
  for (int64_t e = 0; e < s.H; ++e) {
    EXPECT_EQ(got[size_t(e)].bits, bf16_round(std::ldexp(1.0f, -27))) << "token 0 element " << e;
    EXPECT_EQ(got[size_t(s.H + e)].bits, bf16_round(0.5f * x + 0.5f)) << "token 1 element " << e;
  }
  EXPECT_TRUE(test::bytes_equal(weighted_reference(h, std::nullopt, 0.0f, weights), got));
}

// The layout check weights its unquantized re-sum the same way: it passes against a weighted
// engine output, and fails when the engine output is the other mode's.
TEST(CombineCuda, WeightedCheckPassesAndCatchesTheOtherMode) {
  SKIP_WITHOUT_GPU();
  const Shape s{48, 8, 1024, true, 45};
  const HostRows h = make_rows(s, 41, true);
  const std::vector<float> weights = router_weights(s, 42);
  DeviceRows d(h);
  DeviceBuffer<float> d_weights(weights);
  cuda::CombineRows weighted = d.rows;
  weighted.topk_weights = d_weights.get();
  const float amax = routed_amax(h);
  DeviceBuffer<float> d_amax(std::vector<float>{amax});
  auto record = new_record();
  for (Format f : {Format::kNvfp4, Format::kMxfp8, Format::kFp8Block128}) {
    SCOPED_TRACE(format_name(f));
    DeviceBuffer<bf16> y_engine(size_t(s.num_tokens * s.H)), y_out(y_engine.size());
    cuda::launch_combine(weighted, y_engine.get(), nullptr);
    cuda::launch_combine_qdq(weighted, true, f, d_amax.get(), {y_engine.get(), record.get(), false}, y_out.get(), nullptr);
    EXPECT_FALSE(cuda::read_check(record.get(), s.H, nullptr).has_value());
    EXPECT_TRUE(test::bytes_equal(weighted_reference(h, f, amax, weights), y_out.download()));
    // Mixed: the unweighted check against the weighted engine output, and the other way round.
    cuda::launch_combine_qdq(d.rows, true, f, d_amax.get(), {y_engine.get(), record.get(), false}, y_out.get(), nullptr);
    EXPECT_TRUE(cuda::read_check(record.get(), s.H, nullptr).has_value());
    cuda::launch_combine(d.rows, y_engine.get(), nullptr);
    cuda::launch_combine_qdq(weighted, true, f, d_amax.get(), {y_engine.get(), record.get(), false}, y_out.get(), nullptr);
    EXPECT_TRUE(cuda::read_check(record.get(), s.H, nullptr).has_value());
  }
}

// The peers' rules (numerics.h PeerRule) where they branch, per block of 128 side by side in one
// warp: maxima below 1e-4 (the SGLang fork keeps them, DeepGEMM's floor does not) and down to bf16
// subnormals, around 448 (MoRI scales only above it; the NaN cast turns the excess into NaN), far
// above, zero blocks, and blocks holding NaN or inf; around FlashInfer's mask (d = bmax / 6 near
// 1e-30). Byte for byte against the CPU quantizer.
TEST(CombineCuda, PeerFormatsEqualCpuAtTheirEdges) {
  SKIP_WITHOUT_GPU();
  const Shape s{24, 8, 1024, true, 21};
  HostRows h = make_rows(s, 177, false);
  std::mt19937_64 rng(178);
  const float peaks[] = {0.0f,   1e-38f, 5e-31f, 6e-30f, 7e-30f, 3e-5f, 9.9e-5f, 1e-4f,
                         0.5f,   447.0f, 448.0f, 450.0f, 464.0f, 1e4f,  3e38f};
  for (int64_t t = 0; t < s.num_tokens; ++t)
    for (int64_t k = 0; k <= s.K; ++k) {
      if (k < s.K && !h.active(t, k)) continue;
      bf16* row = h.row(k, t);
      for (int64_t c0 = 0; c0 < s.H; c0 += 128) {
        const float peak = peaks[rng() % std::size(peaks)];
        const int kind = int(rng() % 10);
        for (int64_t c = c0; c < c0 + 128; ++c) {
          float v = peak * (float(rng() % 4096) / 2048.0f - 1.0f);
          if (c == c0 + 5) v = peak;
          if (kind == 0 && rng() % 16 == 0) v = std::nanf("");
          if (kind == 1 && c == c0 + 9) v = (rng() % 2) ? INFINITY : -INFINITY;
          if (kind == 2 && rng() % 8 == 0) v = std::ldexp(float(rng() % 127 + 1), -140);  // bf16 subnormal
          row[c] = bf16{bf16_round(v)};
        }
      }
    }
  DeviceRows d(h);
  DeviceBuffer<bf16> y(size_t(s.num_tokens * s.H));
  const std::vector<float> weights = router_weights(s, 179);
  const DeviceBuffer<float> d_weights(weights);
  for (Format f : kAllFormats) {
    if (!peer_rule(f)) continue;
    SCOPED_TRACE(format_name(f));
    cuda::launch_combine_qdq(d.rows, true, f, nullptr, {}, y.get(), nullptr);
    EXPECT_TRUE(test::bytes_equal(reference(h, f, 0.0f), y.download()));
    cuda::CombineRows weighted = d.rows;
    weighted.topk_weights = d_weights.get();
    cuda::launch_combine_qdq(weighted, true, f, nullptr, {}, y.get(), nullptr);
    EXPECT_TRUE(test::bytes_equal(weighted_reference(h, f, 0.0f, weights), y.download())) << "weighted";
  }
}

}  // namespace
}  // namespace moefq
