// End-to-end tests of `moefq bench`'s own surface on any build: the help names every choice an
// option accepts and its defaults, and the CPU benchmarks' JSON carries the device and the date
// as the GPU ones' does.
#include <gtest/gtest.h>

#include <ctime>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>

#include "cli_test_util.h"
#include "moefq/qdq.h"
#include "moefq_binary.h"

namespace moefq {
namespace {

using nlohmann::json;
using test::describe, test::read_text, test::RunResult;

class CliBench : public test::WorkDirTest {
 protected:
  CliBench() : WorkDirTest("moefq_cli_bench_") {}
  RunResult moefq(const std::string& args) const { return run_in_work(test::moefq_command(args)); }

  // The help of `option` in `moefq bench SUB --help`: its line and the description, which CLI11
  // puts on the next line after a long option name.
  std::string help_line(const std::string& sub, const std::string& option) const {
    const RunResult r = moefq("bench " + sub + " --help");
    EXPECT_EQ(r.status, 0) << describe(r);
    const size_t at = r.out.find("  " + option + " ");
    if (at == std::string::npos) return "";
    return r.out.substr(at, r.out.find("\n  -", at) - at);
  }
};

TEST_F(CliBench, HelpNamesEveryFormatAndConfiguration) {
  const std::string qdq = help_line("qdq", "--formats"), comb = help_line("combine", "--formats");
  for (Format f : kAllFormats) {
    EXPECT_NE(qdq.find(format_name(f)), std::string::npos) << format_name(f) << "\n" << qdq;
    EXPECT_NE(comb.find(format_name(f)), std::string::npos) << format_name(f) << "\n" << comb;
  }
  EXPECT_NE(qdq.find("stage_e4m3"), std::string::npos) << qdq;
  EXPECT_NE(comb.find("combine"), std::string::npos) << comb;
  // The configurations: the '|'-separated list after "any of ", every one bench moe runs.
  const std::string moe = help_line("moe", "--configs");
  const size_t any = moe.find("any of ");
  ASSERT_NE(any, std::string::npos) << moe;
  const size_t from = any + 7, to = moe.find(' ', from);
  std::set<std::string> listed;
  std::stringstream list(moe.substr(from, to - from));
  for (std::string name; std::getline(list, name, '|');) listed.insert(name);
  const std::set<std::string> all = {"none",          "dispatch-fp8", "combine-fp8",    "both-fp8",  "dispatch-nvfp4",
                                     "combine-nvfp4", "both-nvfp4",   "both-nvfp4-gs1", "both-mxfp8"};
  EXPECT_EQ(listed, all) << moe;
}

TEST_F(CliBench, HelpShowsTheDefaults) {
  EXPECT_NE(help_line("qdq", "--reps").find("(default 15)"), std::string::npos) << help_line("qdq", "--reps");
  EXPECT_NE(help_line("qdq", "--launches").find("(default 20)"), std::string::npos) << help_line("qdq", "--launches");
  EXPECT_NE(help_line("combine", "--reps").find("(default 15)"), std::string::npos) << help_line("combine", "--reps");
  EXPECT_NE(help_line("combine", "--launches").find("(default 10)"), std::string::npos)
      << help_line("combine", "--launches");
}

// bench gemm's --weights names both choices and refuses another one before any work (exit 2),
// in every build (no GPU is needed to be refused).
TEST_F(CliBench, GemmWeightsChoices) {
  const std::string help = help_line("gemm", "--weights");
  for (const char* w : {"e4m3", "bf16", "cuBLASLt bf16"}) EXPECT_NE(help.find(w), std::string::npos) << w << "\n" << help;
  const RunResult r = moefq("bench gemm --weights fp16 --tokens 1");
  EXPECT_EQ(r.status, 2) << describe(r);
  EXPECT_NE(r.err.find("--weights"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("fp16"), std::string::npos) << r.err;
}

// Today's date (UTC) as the JSON writes it; `before` guards a run across midnight.
std::string utc_date() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&now));
  return buf;
}

TEST_F(CliBench, CpuBenchJsonHasDeviceAndDate) {
  const std::string before = utc_date();
  const struct {
    std::string args, device;
  } cases[] = {
      {"bench engine-cpu --ranks 2 --tokens 8 --reps 1 --threads 1 --json b.json", "cpu (1 thread)"},
      {"bench eval --preset tiny --layers 0 --ranks 2 --tokens 8 --calib-batches 1 --eval-batches 1 --device cpu "
       "--json b.json",
       "cpu ("},
  };
  for (const auto& c : cases) {
    const RunResult r = moefq(c.args);
    ASSERT_EQ(r.status, 0) << describe(r);
    const json j = json::parse(read_text(path("b.json")));
    ASSERT_TRUE(j.contains("device") && j.at("device").is_string()) << c.args << "\n" << j.dump(2);
    EXPECT_EQ(j.at("device").get<std::string>().rfind(c.device, 0), 0u) << c.args << "\n" << j.dump(2);
    ASSERT_TRUE(j.contains("date") && j.at("date").is_string()) << c.args << "\n" << j.dump(2);
    const std::string date = j.at("date").get<std::string>();
    EXPECT_TRUE(date == before || date == utc_date()) << c.args << ": " << date;
  }
}

}  // namespace
}  // namespace moefq
