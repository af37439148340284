// The link model (link_model.h): its arithmetic on figures worked out by hand, its edge cases, the
// named links and the option errors; and the transfer times of an eval's rows.
#include <gtest/gtest.h>

#include <cmath>

#include "moefq/errors.h"
#include "moefq/eval.h"
#include "moefq/link_model.h"
#include "moefq/qdq.h"

namespace moefq {
namespace {

TEST(LinkModel, ArithmeticByHand) {
  // 8 ranks, top-8: D = 8 (1 - (7/8)^8) = 5.2511286735534668 destination ranks per token; 7/8 of
  // them are other ranks: 256 tokens send 1176.2528228759766 rows of 7168 bytes = 8431380.234375
  // bytes; at 450 GB/s (3600 Gbit/s) that is 18.736400520833 us, plus 3 us.
  EXPECT_NEAR(mean_destination_ranks(8, 8), 5.2511286735534668, 1e-13);
  const LinkModel nv4 = make_link_model("nvlink4", 0);
  EXPECT_EQ(nv4.gbit_per_s, 3600);
  EXPECT_EQ(nv4.latency_us, 3);
  EXPECT_NEAR(transfer_us(nv4, 7168, 256, 8, 8), 21.736400520833335, 1e-9);
  // InfiniBand NDR: 400 Gbit/s = 50 GB/s, 5 us.
  EXPECT_NEAR(transfer_us(make_link_model("ib400", 0), 7168, 256, 8, 8), 173.6276046875, 1e-8);
  // A custom link: no latency; half the bytes, half the time.
  const LinkModel c = make_link_model("", 400);
  EXPECT_EQ(c.name, "custom");
  EXPECT_NEAR(transfer_us(c, 3584, 256, 8, 8), (173.6276046875 - 5) / 2, 1e-8);
}

TEST(LinkModel, EdgeCases) {
  EXPECT_EQ(mean_destination_ranks(1, 8), 1.0);
  EXPECT_EQ(mean_destination_ranks(64, 1), 1.0);
  EXPECT_NEAR(mean_destination_ranks(2, 2), 1.5, 1e-15);  // both experts on one rank with probability 1/2
  const LinkModel nv5 = make_link_model("nvlink5", 0);
  EXPECT_EQ(transfer_us(nv5, 7168, 256, 1, 8), 0.0) << "one rank sends nothing";
  EXPECT_EQ(transfer_us(nv5, 0, 256, 8, 8), 0.0) << "no bytes, no latency";
  EXPECT_EQ(transfer_us(LinkModel{}, 7168, 256, 8, 8), 0.0) << "no link, no time";
  EXPECT_FALSE(make_link_model("", 0).enabled());
  // Every named link resolves to itself, with a positive bandwidth.
  for (const NamedLink& l : named_links()) {
    const LinkModel m = make_link_model(l.name, 0);
    EXPECT_EQ(m.name, l.name);
    EXPECT_GT(m.gbit_per_s, 0);
  }
}

TEST(LinkModel, BadOptionsAreNamed) {
  for (const auto& [name, gbps, says] :
       {std::tuple<std::string, double, std::string>{"nvlink9", 0, "--link 'nvlink9' is not a known link"},
        {"nvlink4", 100, "--link and --link-gbps cannot be used together"},
        {"", -3, "--link-gbps must be a number > 0"},
        {"", NAN, "--link-gbps must be a number > 0"}}) {
    try {
      (void)make_link_model(name, gbps);
      FAIL() << name << " " << gbps;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kBadInput);
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  }
}

// An eval with a link: each row's times are the model's on its wire bytes, and the saving is
// against bf16 both ways.
TEST(LinkModel, EvalRowsCarryTheTimes) {
  EvalOptions o;
  o.recipes = {"none", "moe_dispatch_fp8", "moe_combine_nvfp4"};
  o.tokens = 32;
  o.calib_batches = o.eval_batches = 1;
  o.link = "ib400";
  const EvalResult r = run_eval(o);
  ASSERT_EQ(r.rows.size(), 3u);
  EXPECT_TRUE(r.setup.link.enabled());
  const int64_t H = r.setup.config.hidden, K = r.setup.config.top_k, R = r.setup.ranks;
  const LinkModel link = make_link_model("ib400", 0);
  const double bf16 = transfer_us(link, 2.0 * double(H), 32, R, K);
  for (const EvalRow& row : r.rows) {
    SCOPED_TRACE(row.recipe);
    EXPECT_EQ(row.dispatch_us, transfer_us(link, row.dispatch_wire_bytes_per_token, 32, R, K));
    EXPECT_EQ(row.combine_us, transfer_us(link, row.combine_wire_bytes_per_token, 32, R, K));
    EXPECT_NEAR(row.saved_us, 2 * bf16 - row.dispatch_us - row.combine_us, 1e-9);
    if (row.recipe == "none") EXPECT_EQ(row.saved_us, 0.0);
    if (row.recipe == "moe_dispatch_fp8") EXPECT_GT(row.saved_us, 0.0);
  }
}

}  // namespace
}  // namespace moefq
