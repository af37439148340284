// Expert weights: exact dequantization of e4m3 with block scales and of bf16, and the shape checks
// of a malformed expert. The checkpoint loader: test_checkpoint.cpp.
#include "moefq/weights.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "moefq/errors.h"
#include "test_util.h"
#include "weights_test_util.h"

namespace moefq {
namespace {

// The message of the moefq::Error that f throws ("" when it throws none).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// ---------------------------------------------------------------------------------------------
// Dequantization

// Independent oracle: the product of an e4m3 value (4 significant bits) and a binary32 scale is
// exact in binary64, so one rounding to binary32 gives the correctly rounded product.
float product_ref(uint8_t code, float scale) { return float(double(e4m3_decode(code)) * double(scale)); }

TEST(Dequant, E4m3BlocksHandBuilt) {
  ExpertWeights w;
  w.hidden = 256;
  w.intermediate = 128;  // gate_up [256, 256] -> scales [2, 2]; down [256, 128] -> scales [2, 1]
  w.format = WeightFormat::kE4m3;
  w.gate_up_e4m3.resize(256 * 256);
  for (size_t i = 0; i < w.gate_up_e4m3.size(); ++i) {
    const uint8_t c = uint8_t((i * 37) & 0xFF);
    w.gate_up_e4m3[i] = (c & 0x7F) == 0x7F ? 0x38 : c;  // no NaN codes
  }
  w.gate_up_scale = {1.0f, 2.0f, 0.1f, 3.0e-3f};
  w.down_e4m3.resize(256 * 128);
  for (size_t i = 0; i < w.down_e4m3.size(); ++i) w.down_e4m3[i] = uint8_t(i % 2 ? 0x7E : 0xB8);
  w.down_scale = {0.25f, 1.0e-3f};

  // Hand-checked elements: code 0x38 = 1.0, 0x40 = 2.0, 0x7E = 448, 0xB8 = -1.0, 0x01 = 2^-9.
  w.gate_up_e4m3[0] = 0x38;               // block (0, 0), scale 1
  w.gate_up_e4m3[200] = 0x40;             // block (0, 1), scale 2
  w.gate_up_e4m3[130 * 256 + 5] = 0x7E;   // block (1, 0), scale 0.1
  w.gate_up_e4m3[255 * 256 + 255] = 0x01; // block (1, 1), scale 3e-3
  const std::vector<float> gu = w.gate_up_f32();
  ASSERT_EQ(gu.size(), 256u * 256u);
  EXPECT_EQ(gu[0], 1.0f);
  EXPECT_EQ(gu[200], 4.0f);
  EXPECT_EQ(gu[130 * 256 + 5], 448.0f * 0.1f);
  EXPECT_EQ(gu[255 * 256 + 255], 0x1p-9f * 3.0e-3f);
  for (int64_t r = 0; r < 256; ++r)
    for (int64_t c = 0; c < 256; ++c) {
      const float s = w.gate_up_scale[size_t((r / 128) * 2 + c / 128)];
      ASSERT_EQ(f32_bits(gu[size_t(r * 256 + c)]), f32_bits(product_ref(w.gate_up_e4m3[size_t(r * 256 + c)], s)))
          << "gate_up[" << r << ", " << c << "]";
    }

  const std::vector<float> dn = w.down_f32();
  ASSERT_EQ(dn.size(), 256u * 128u);
  EXPECT_EQ(dn[0], -0.25f);
  EXPECT_EQ(dn[1], 112.0f);
  EXPECT_EQ(dn[128 * 128], -1.0e-3f);
  EXPECT_EQ(dn[128 * 128 + 1], 448.0f * 1.0e-3f);
}

TEST(Dequant, Bf16IsExact) {
  ExpertWeights w;
  w.hidden = 128;
  w.intermediate = 128;
  w.format = WeightFormat::kBf16;
  w.gate_up_bf16.resize(256 * 128);
  w.down_bf16.resize(128 * 128);
  for (size_t i = 0; i < w.gate_up_bf16.size(); ++i) w.gate_up_bf16[i].bits = uint16_t(i * 7919);
  for (size_t i = 0; i < w.down_bf16.size(); ++i) w.down_bf16[i].bits = uint16_t(0x3F80 + i);
  const auto gu = w.gate_up_f32();
  const auto dn = w.down_f32();
  ASSERT_EQ(gu.size(), w.gate_up_bf16.size());
  ASSERT_EQ(dn.size(), w.down_bf16.size());
  for (size_t i = 0; i < gu.size(); ++i) {
    const uint32_t want = uint32_t(w.gate_up_bf16[i].bits) << 16;
    if (is_nan(gu[i])) {
      ASSERT_TRUE(((want >> 23) & 0xFF) == 0xFF && (want & 0x7FFFFF) != 0) << i;
    } else {
      ASSERT_EQ(f32_bits(gu[i]), want) << i;
    }
  }
  EXPECT_EQ(dn[0], 1.0f);
  EXPECT_EQ(dn[1], 1.0f + 0x1p-7f);
}

TEST(Dequant, InconsistentShapesAreCaught) {
  ExpertWeights w;
  w.hidden = 256;
  w.intermediate = 128;
  w.gate_up_e4m3.resize(256 * 256);
  w.gate_up_scale.resize(3);  // should be [2, 2]
  w.down_e4m3.resize(100);    // should be [256, 128]
  w.down_scale.resize(2);
  EXPECT_HAS(error_of([&] { w.gate_up_f32(); }), "block scales");
  EXPECT_HAS(error_of([&] { w.down_f32(); }), "e4m3 codes");
  w.format = WeightFormat::kBf16;
  EXPECT_HAS(error_of([&] { w.down_f32(); }), "bf16 values");
}

}  // namespace
}  // namespace moefq
