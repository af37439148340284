// The element rules of the synthetic model (moefq/synthetic.h), written once as host+device
// functions: the CPU generator (engine/synthetic.cpp) and the CUDA one (engine/cuda/synthetic_kernels.cu)
// call exactly these, so a weight or activation is the same bits wherever it is generated.
// Counter-based: every value is a pure function of (stream key, element index), so any element
// can be generated alone, in any order, by any thread. Every fp32 operation is explicit
// (numerics.h's mul_rn / add_rn / div_rn, the portable log1p_f32 and sqrt_rn).
#pragma once

#include <cstdint>

#include "moefq/numerics.h"

namespace moefq::synth {

// splitmix64's finaliser: a bijection of 64-bit words whose output bits each depend on every
// input bit.
MOEFQ_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The key of one stream: a tensor kind (tag) and an index (expert id, token block, ...) under a
// seed. Distinct (seed, tag, index) give unrelated streams.
MOEFQ_HD uint64_t stream_key(uint64_t seed, uint64_t tag, uint64_t index) {
  uint64_t k = mix64(seed + 0x9E3779B97F4A7C15ull);
  k = mix64(k ^ (tag * 0xD1B54A32D192ED03ull + 0x632BE59BD9B4E019ull));
  return mix64(k ^ (index * 0xAEF17502108EF2D9ull + 0x8CB92BA72F3D8DD7ull));
}

// The 64 random bits of element `counter` of a stream.
MOEFQ_HD uint64_t draw(uint64_t key, uint64_t counter) { return mix64(key + counter * 0x9E3779B97F4A7C15ull); }

// A uniform in (0, 1) from the top 24 bits: (k + 1/2) / 2^24, never 0 or 1.
MOEFQ_HD float uniform_open(uint64_t bits) {
  return mul_rn(add_rn(float(uint32_t(bits >> 40)), 0.5f), 5.9604644775390625e-8f);
}

// Natural log of a positive normal x: x = 2^k m with m in [1, 2), log x = k ln2 + log1p(m - 1)
// (m - 1 is exact). Only for the generator's arguments (uniforms in (0, 1)).
MOEFQ_HD float log_pos_f32(float x) {
  const uint32_t u = f32_bits(x);
  const int k = int((u >> 23) & 0xFFu) - 127;
  const float m = f32_from_bits((u & 0x007FFFFFu) | 0x3F800000u);
  return add_rn(mul_rn(float(k), 0.693147180559945309f), log1p_f32(add_rn(m, -1.0f)));
}

// The standard normal quantile of p in (0, 1) by Acklam's rational approximation (relative error
// about 1e-9 in exact arithmetic, a few ulp here): a rational function of (p - 1/2)^2 in the
// centre, of sqrt(-2 log p) in the tails. Tails reach about +-5.4 at the extreme uniforms.
MOEFQ_HD float normal_quantile(float p) {
  constexpr float kLow = 0.02425f;
  const auto tail = [](float q) {
    // x = c(q) / d(q), c and d in Horner form.
    float c = -7.784894002430293e-03f;
    c = add_rn(mul_rn(c, q), -3.223964580411365e-01f);
    c = add_rn(mul_rn(c, q), -2.400758277161838e+00f);
    c = add_rn(mul_rn(c, q), -2.549732539343734e+00f);
    c = add_rn(mul_rn(c, q), 4.374664141464968e+00f);
    c = add_rn(mul_rn(c, q), 2.938163982698783e+00f);
    float d = 7.784695709041462e-03f;
    d = add_rn(mul_rn(d, q), 3.224671290700398e-01f);
    d = add_rn(mul_rn(d, q), 2.445134137142996e+00f);
    d = add_rn(mul_rn(d, q), 3.754408661907416e+00f);
    d = add_rn(mul_rn(d, q), 1.0f);
    return div_rn(c, d);
  };
  if (p < kLow) return tail(sqrt_rn(mul_rn(-2.0f, log_pos_f32(p))));
  if (p > 1.0f - kLow) return -tail(sqrt_rn(mul_rn(-2.0f, log_pos_f32(add_rn(1.0f, -p)))));
  const float q = add_rn(p, -0.5f), r = mul_rn(q, q);
  float a = -3.969683028665376e+01f;
  a = add_rn(mul_rn(a, r), 2.209460984245205e+02f);
  a = add_rn(mul_rn(a, r), -2.759285104469687e+02f);
  a = add_rn(mul_rn(a, r), 1.383577518672690e+02f);
  a = add_rn(mul_rn(a, r), -3.066479806614716e+01f);
  a = add_rn(mul_rn(a, r), 2.506628277459239e+00f);
  float b = -5.447609879822406e+01f;
  b = add_rn(mul_rn(b, r), 1.615858368580409e+02f);
  b = add_rn(mul_rn(b, r), -1.556989798598866e+02f);
  b = add_rn(mul_rn(b, r), 6.680131188771972e+01f);
  b = add_rn(mul_rn(b, r), -1.328068155288572e+01f);
  b = add_rn(mul_rn(b, r), 1.0f);
  return div_rn(mul_rn(a, q), b);
}

// The quantile table of the fast normal draws: kNormalCells cells of equal probability, entry i
// the quantile of i / kNormalCells (entries 1 .. kNormalCells - 1; the two outer cells are not
// interpolated). Built by the host with normal_quantile (deterministic), uploaded for kernels.
inline constexpr int kNormalCellBits = 12;
inline constexpr int kNormalCells = 1 << kNormalCellBits;
struct NormalTable {
  float q[kNormalCells + 1];
};

// The table, built once on the host (src/engine/synthetic.cpp).
const NormalTable& normal_table();

// A standard normal draw from 24 random bits u: cell i = u >> 12, position f = u & 4095 in it;
// inside, the quantile interpolated linearly between the cell's ends at (f + 1/2) / 4096; the two
// outer cells (the tails beyond +-3.4, probability 1/2048) the exact quantile of (u + 1/2) / 2^24.
MOEFQ_HD float gaussian24(uint32_t u, const float* table) {
  const uint32_t i = u >> (24 - kNormalCellBits), f = u & ((1u << (24 - kNormalCellBits)) - 1u);
  if (i == 0 || i == kNormalCells - 1)
    return normal_quantile(mul_rn(add_rn(float(u), 0.5f), 5.9604644775390625e-8f));
  const float t = mul_rn(add_rn(float(f), 0.5f), 2.44140625e-4f);  // (f + 1/2) / 4096, exact
  return add_rn(table[i], mul_rn(add_rn(table[i + 1], -table[i]), t));
}

// Element `index` of a normal stream: two draws per 64 random bits (the top 24 bits of each half).
MOEFQ_HD float normal_at(uint64_t key, uint64_t index, const float* table) {
  const uint64_t bits = draw(key, index >> 1);
  const uint32_t half = (index & 1u) ? uint32_t(bits >> 32) : uint32_t(bits);
  return gaussian24(half >> 8, table);
}

// A standard normal draw from 64 random bits by the exact quantile (for the few per-layer values).
MOEFQ_HD float gaussian(uint64_t bits) { return normal_quantile(uniform_open(bits)); }

// Tags of the streams (each kind of tensor has its own, so adding one never shifts another).
inline constexpr uint64_t kTagGateUp = 1, kTagDown = 2, kTagRouter = 3, kTagBias = 4, kTagShared = 5,
                          kTagActivation = 6, kTagInGain = 7, kTagOutGain = 8, kTagLayout = 9, kTagSink = 10;

// The index of an expert's stream: routed experts by global id, the shared expert after them.
MOEFQ_HD uint64_t expert_stream(int64_t expert, bool shared) { return shared ? (1ull << 40) : uint64_t(expert); }

// One weight element of an expert matrix before the e4m3 cast: N(0, 1) * (sigma * row gain) *
// column gain: the row gain is the output channel's for the down projection (1 for gate/up), the
// column gain a super expert's at the sink channels for gate/up (1 elsewhere). key: the matrix's
// stream key; index: row * cols + col.
MOEFQ_HD float weight_value(uint64_t key, uint64_t index, float sigma_row_gain, float col_gain, const float* table) {
  return mul_rn(mul_rn(normal_at(key, index, table), sigma_row_gain), col_gain);
}

// The e4m3 cast of one 128 x 128 block with bmax = max |v| over the block: the block's fp32
// scale bmax / 448 (so the block maximum lands on the top e4m3 code) and each code
// e4m3_sat(v * (448 / bmax)). An all-zero block has scale 1 and zero codes.
MOEFQ_HD float weight_block_scale(float bmax) { return bmax > 0.0f ? div_rn(bmax, kE4m3Max) : 1.0f; }
MOEFQ_HD float weight_block_inv(float bmax) { return bmax > 0.0f ? div_rn(kE4m3Max, bmax) : 0.0f; }
MOEFQ_HD uint8_t weight_code(float v, float inv) { return e4m3_encode_sat(mul_rn(v, inv)); }

// One activation element (before its bf16 rounding) of token `token` (its index in the layer's
// token stream), channel h: in_gain[h] * N(0, 1); on a sink token the sink value on its sink
// channels and the rest scaled by sink_scale (the token's RMS stays about 1, as after RMSNorm).
MOEFQ_HD float activation_value(uint64_t key, int64_t token, int64_t hidden, int64_t h, float in_gain,
                                const float* table) {
  return mul_rn(normal_at(key, uint64_t(token) * uint64_t(hidden) + uint64_t(h), table), in_gain);
}
MOEFQ_HD float sink_token_value(float ordinary, bool sink_channel, float sink_value, float sink_scale) {
  return sink_channel ? sink_value : mul_rn(ordinary, sink_scale);
}

}  // namespace moefq::synth
