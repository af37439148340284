// Helpers of the weight and synthetic-model suites: a small hand-built config and a byte
// comparison of two experts' weights.
#pragma once

#include <gtest/gtest.h>

#include "moefq/moe_config.h"
#include "moefq/weights.h"
#include "test_util.h"

namespace moefq::test {

#define EXPECT_HAS(message, part)                                               \
  EXPECT_NE(std::string(message).find(part), std::string::npos) << "expected \"" \
                                                                 << (part) << "\" in: " << (message)

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

}  // namespace moefq::test
