// Format properties of qdq.h: names, block sizes and the bytes a row occupies on the wire.
#include <gtest/gtest.h>

#include <optional>

#include "moefq/qdq.h"

namespace moefq {
namespace {

TEST(Formats, NamesRoundTrip) {
  for (Format f : kAllFormats) {
    const auto back = parse_format(format_name(f));
    ASSERT_TRUE(back.has_value()) << format_name(f);
    EXPECT_EQ(*back, f);
    EXPECT_NE(format_choices().find(format_name(f)), std::string::npos) << format_name(f);
  }
  EXPECT_FALSE(parse_format("fp7").has_value());
  EXPECT_FALSE(parse_format("").has_value());
}

// The deepseek-v3 hidden size, counted by hand: elements plus one scale per block.
TEST(Formats, WireBytesOfAFullRow) {
  constexpr int64_t kH = 7168;
  EXPECT_EQ(wire_bytes_per_row(std::nullopt, kH), 14336.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kFp8, kH), 7168.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kInt8, kH), 7168.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kNvfp4, kH), 3584.0 + 448.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kMxfp8, kH), 7168.0 + 224.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kMxfp4, kH), 3584.0 + 224.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kFp8Block128, kH), 7168.0 + 56.0 * 4.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kFp8Block128Ue8m0, kH), 7168.0 + 56.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kLogfmt10, kH), 8960.0 + 56.0 * 4.0);  // 10 bits + bf16 amax, amin
}

// A short final block carries a whole scale; an odd count of 4-bit elements takes a whole byte.
TEST(Formats, WireBytesOfShortBlocks) {
  EXPECT_EQ(wire_bytes_per_row(std::nullopt, 7), 14.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kFp8, 7), 7.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kNvfp4, 7), 4.0 + 1.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kNvfp4, 17), 9.0 + 2.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kMxfp8, 33), 33.0 + 2.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kMxfp4, 33), 17.0 + 2.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kFp8Block128, 129), 129.0 + 8.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kFp8Block128Ue8m0, 129), 129.0 + 2.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kLogfmt10, 129), 162.0 + 8.0);  // 1290 bits in 162 bytes
  for (Format f : kAllFormats) EXPECT_EQ(wire_bytes_per_row(f, 0), 0.0) << format_name(f);
}

// Every format ships fewer bytes than bf16 once a row holds a few blocks.
TEST(Formats, EveryFormatIsSmallerThanBf16) {
  for (Format f : kAllFormats)
    for (int64_t cols : {128, 4096, 7168})
      EXPECT_LT(wire_bytes_per_row(f, cols), wire_bytes_per_row(std::nullopt, cols)) << format_name(f) << " " << cols;
}

}  // namespace
}  // namespace moefq
