// Helpers of the weight, checkpoint and synthetic-model suites: a small hand-built config and byte
// comparisons of two experts' and two layers' weights.
#pragma once

#include <gtest/gtest.h>

#include "moefq/moe_config.h"
#include "moefq/weights.h"
#include "test_util.h"

namespace moefq::test {

// A config built by hand (the presets live elsewhere): E=4, H=256, I=128, K=2, one shared expert.
inline MoeConfig small_weights_config(bool noaux_tc = true) {
  MoeConfig c;
  c.name = "test";
  c.hidden = 256;
  c.intermediate = 128;
  c.num_experts = 4;
  c.top_k = 2;
  c.num_shared = 1;
  c.noaux_tc = noaux_tc;
  return c;
}

inline void expect_same_expert(const ExpertWeights& a, const ExpertWeights& b) {
  EXPECT_EQ(a.hidden, b.hidden);
  EXPECT_EQ(a.intermediate, b.intermediate);
  EXPECT_EQ(a.format, b.format);
  EXPECT_TRUE(bytes_equal(a.gate_up_e4m3, b.gate_up_e4m3));
  EXPECT_TRUE(bytes_equal(a.down_e4m3, b.down_e4m3));
  EXPECT_TRUE(bytes_equal(a.gate_up_scale, b.gate_up_scale));
  EXPECT_TRUE(bytes_equal(a.down_scale, b.down_scale));
  EXPECT_TRUE(bytes_equal(a.gate_up_bf16, b.gate_up_bf16));
  EXPECT_TRUE(bytes_equal(a.down_bf16, b.down_bf16));
}

inline void expect_layers_equal(const LayerWeights& want, const LayerWeights& got) {
  EXPECT_EQ(want.first_expert, got.first_expert);
  ASSERT_EQ(want.experts.size(), got.experts.size());
  for (size_t e = 0; e < want.experts.size(); ++e) {
    SCOPED_TRACE("expert " + std::to_string(want.first_expert + int64_t(e)));
    expect_same_expert(want.experts[e], got.experts[e]);
  }
  ASSERT_EQ(want.shared.size(), got.shared.size());
  if (!want.shared.empty()) expect_same_expert(want.shared[0], got.shared[0]);
  EXPECT_TRUE(bytes_equal(want.gate, got.gate));
  EXPECT_TRUE(bytes_equal(want.gate_bias, got.gate_bias));
}

}  // namespace moefq::test
