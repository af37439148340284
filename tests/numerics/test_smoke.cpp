#include <gtest/gtest.h>
#include "moefq/numerics.h"
TEST(Smoke, Bf16) { EXPECT_EQ(moefq::bf16_round(1.0f), 0x3F80); }
