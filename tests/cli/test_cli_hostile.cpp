// The hostile-input suite: the moefq binary run as a careless script or a hostile file would run it
// (special files where files are expected, outputs over devices, links and inputs, sizes no
// machine holds, signals in the middle of a write, two runs on one output directory). Each test
// is one item of what docs/cli.md promises: exit 2 with a message naming the argument and nothing
// written, no hang, no crash, no half-written or mixed output. Every run has a time limit, so a
// run that waits on a FIFO fails the test instead of hanging it.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <functional>
#include <limits>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint_test_util.h"
#include "cli_test_util.h"
#include "moefq_binary.h"
#include "moefq/safetensors.h"
#include "moefq/weights.h"
#include "test_util.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::describe, test::quote, test::read_bytes, test::read_text, test::RunResult, test::span_of;

// Small eval settings (a second or two on 2 cores) on the small config.json.
const std::string kEvalBase = "--config config.json --device cpu --ranks 2 --calib-batches 1 --eval-batches 1 "
                              "--recipe moe_combine_fp8";
const std::string kEval = kEvalBase + " --tokens 32";
const std::string kCalibrate = "--config config.json --device cpu --ranks 2 --tokens 32 --calib-batches 1";
const std::string kQdq = "qdq --in a.safetensors --format fp8 --device cpu";

class Hostile : public test::WorkDirTest {
 protected:
  Hostile() : WorkDirTest("moefq_hostile_") {}

  void SetUp() override {
    WorkDirTest::SetUp();
    const std::vector<bf16> x = test::to_bf16(test::activations(4, 64, 3, /*specials=*/false));
    SafetensorsWriter w;
    w.add("x", StDtype::kBF16, {4, 64}, span_of(x));
    w.write(path("a.safetensors").string());
    std::ofstream(path("config.json")) << test::kSmallConfigJson;
    std::ofstream(path("keep.txt")) << "keep";
    ASSERT_EQ(::mkfifo(path("pipe").c_str(), 0600), 0);
    fs::create_directory(path("emptydir"));
  }

  // `[env] moefq ARGS` in work_, killed after 60 s (a hang fails the test, exit 137).
  RunResult moefq(const std::string& args, const std::string& env = "") const {
    // Not the last command of the shell, so that the shell waits and reports 128 + N for a signal.
    return run_in_work("(" + env + " timeout -s KILL 60 " + test::moefq_command(args) + "; exit $?)");
  }

  // Every path under work_ (links not followed) with its kind, sorted.
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& e : fs::recursive_directory_iterator(work_)) {
      const fs::file_status st = fs::symlink_status(e.path());
      const char* kind = fs::is_symlink(st) ? "link" : fs::is_fifo(st) ? "fifo" : fs::is_directory(st) ? "dir" : "file";
      names.push_back(fs::relative(e.path(), work_).string() + " " + kind);
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  // Exit 2, "moefq: error: " and every needle in the message, no result table, nothing changed.
  RunResult expect_refused(const std::string& args, const std::vector<std::string>& needles, const std::string& env = "") {
    SCOPED_TRACE("moefq " + args);
    const auto before = listing();
    const RunResult r = moefq(args, env);
    EXPECT_EQ(r.status, 2) << describe(r);
    EXPECT_NE(r.err.find("moefq: error: "), std::string::npos) << describe(r);
    for (const std::string& n : needles)
      EXPECT_NE(r.err.find(n), std::string::npos) << "the message lacks \"" << n << "\"\n" << describe(r);
    EXPECT_EQ(r.out.find("rel_l2"), std::string::npos) << "no table on bad input\n" << describe(r);
    EXPECT_EQ(listing(), before) << "bad input must leave the directory as it was";
    EXPECT_EQ(read_text(path("keep.txt")), "keep");
    return r;
  }

  void write_config(const std::string& name, const std::string& key, const std::string& value) const {
    json j = json::parse(test::kSmallConfigJson);
    j[key] = json::parse(value);
    std::ofstream(path(name)) << j.dump();
  }

  // The temporaries and leftovers a run may leave (PATH.tmp.*, PATH.old.*, probes).
  std::vector<std::string> leftovers() const {
    std::vector<std::string> v;
    for (const std::string& e : listing())
      if (e.find(".tmp.") != std::string::npos || e.find(".old.") != std::string::npos ||
          e.find(".moefq-probe.") != std::string::npos)
        v.push_back(e);
    return v;
  }
};

// 1. An output path that is a link, a FIFO, a directory or a device is refused; what is there stays.
TEST_F(Hostile, OutputsNeverReplaceNonRegularFiles) {
  fs::create_symlink("keep.txt", path("link.safetensors"));
  fs::create_symlink("nowhere", path("dangling"));
  for (const std::string out : {"link.safetensors", "dangling", "pipe", "emptydir"}) {
    expect_refused(kQdq + " --out " + out, {"--out " + out});
    expect_refused(kQdq + " --out b.safetensors --report " + out, {"--report " + out});
    expect_refused("calibrate " + kCalibrate + " --save " + out, {"--save " + out});
  }
  // A device node. As root, a private one (the null device's numbers) in the working directory:
  // a moefq that regressed would replace that one, not the system's /dev/null (which is what
  // happened). Others cannot replace /dev/null, so they test it directly. Root without the right
  // to create device nodes skips this part (test_fileio checks the refusal on /dev/null itself).
  const bool root = ::geteuid() == 0;
  const fs::path dev = root ? path("null_device") : fs::path("/dev/null");
  if (!root || ::mknod(dev.c_str(), S_IFCHR | 0666, ::makedev(1, 3)) == 0) {
    const std::string name = root ? "null_device" : dev.string();
    expect_refused(kQdq + " --out " + name, {"--out " + name, "character device"});
    expect_refused("calibrate " + kCalibrate + " --save " + name, {"--save " + name, "character device"});
    EXPECT_TRUE(fs::is_character_file(dev));
  }
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(path("link.safetensors"))));
  EXPECT_TRUE(fs::is_fifo(path("pipe")));
}

// 2. Every size the CLI accepts is planned or refused with the figures; never std::bad_alloc.
TEST_F(Hostile, SizesBeyondMemoryAreRefused) {
  expect_refused("qdq --device cpu --sample-rows 1048576 --sample-cols 65536", {"needs about", "--sample-rows"});
  write_config("huge_hidden.json", "hidden_size", "1073741824");
  expect_refused("eval --config huge_hidden.json --device cpu", {"huge_hidden.json", "hidden_size", "larger than"});
  write_config("huge_experts.json", "n_routed_experts", "1099511627776");
  expect_refused("eval --config huge_experts.json --device cpu", {"n_routed_experts", "larger than"});
  write_config("huge_inter.json", "moe_intermediate_size", "1073741824");
  expect_refused("eval --config huge_inter.json --device cpu", {"moe_intermediate_size", "larger than"});
  expect_refused("eval --device cpu --tokens 1048576 --eval-batches 100000 --out rep", {"of host memory", "available"});
  // An allocation that fails anyway (here under a 1 GiB address-space limit, where the estimate
  // passed): a clear message and exit 2, not "internal error: std::bad_alloc".
  const RunResult r = expect_refused("qdq --device cpu --sample-rows 16384 --sample-cols 8192 --out s.safetensors",
                                     {"ran out of memory", "nothing was written"}, "ulimit -v 1048576;");
  EXPECT_EQ(r.err.find("internal error"), std::string::npos) << describe(r);
}

// 3. A file read whole has a size cap, and a device is refused before it is read.
TEST_F(Hostile, FilesReadWholeAreBounded) {
  expect_refused("eval " + kEval + " --load-calibration /dev/zero", {"--load-calibration /dev/zero", "character device"});
  std::ofstream(path("big.json")).close();
  fs::resize_file(path("big.json"), (uint64_t(64) << 20) + 1);
  expect_refused("eval " + kEval + " --load-calibration big.json", {"big.json", "over the limit"});
  test::write_checkpoint(path("ckpt"), {{1, 7}});
  fs::create_symlink("/dev/zero", path("ckpt/model.safetensors.index.json"));
  expect_refused("eval --checkpoint ckpt --layers 1 --device cpu", {"model.safetensors.index.json", "character device"});
  expect_refused("eval --config /dev/zero --device cpu", {"--config /dev/zero", "character device"});
}

// 4. A FIFO where a file is read is refused at once, naming it.
TEST_F(Hostile, FifosAreRefusedWithoutWaiting) {
  expect_refused("qdq --in pipe --out b.safetensors --format fp8 --device cpu", {"--in pipe", "FIFO"});
  expect_refused("eval " + kEval + " --activations pipe", {"--activations pipe", "FIFO"});
  expect_refused("eval " + kEval + " --load-calibration pipe", {"--load-calibration pipe", "FIFO"});
  expect_refused("eval --config pipe --device cpu", {"--config pipe", "FIFO"});
  expect_refused("eval " + kEval + " --recipe pipe", {"pipe", "FIFO"});
  test::write_checkpoint(path("ckpt"), {{1, 7}});
  ASSERT_EQ(::mkfifo(path("ckpt/model.safetensors.index.json").c_str(), 0600), 0);
  expect_refused("eval --checkpoint ckpt --layers 1 --device cpu", {"model.safetensors.index.json", "FIFO"});
  fs::remove(path("ckpt/model.safetensors.index.json"));
  fs::remove(path("ckpt/model.safetensors"));
  ASSERT_EQ(::mkfifo(path("ckpt/model.safetensors").c_str(), 0600), 0);
  expect_refused("eval --checkpoint ckpt --layers 1 --device cpu", {"model.safetensors", "is a FIFO"});
  fs::remove(path("ckpt/config.json"));
  ASSERT_EQ(::mkfifo(path("ckpt/config.json").c_str(), 0600), 0);
  expect_refused("eval --checkpoint ckpt --layers 1 --device cpu", {"config.json", "FIFO"});
}

// 5. One +inf under a dynamic amax makes every output NaN: the metrics say nan, never "perfect".
TEST_F(Hostile, NonFiniteOutputsGiveNanMetrics) {
  std::vector<float> x = test::activations(2, 64, 5, /*specials=*/false);
  x[7] = INFINITY;
  SafetensorsWriter w;
  w.add("x", StDtype::kF32, {2, 64}, span_of(x));
  w.write(path("inf.safetensors").string());
  const RunResult r = moefq("qdq --in inf.safetensors --out o.safetensors --format fp8 --device cpu --report r.json");
  ASSERT_EQ(r.status, 0) << describe(r);
  const json j = json::parse(read_text(path("r.json")));
  const json& m = j.at("results").at(0);
  for (const char* k : {"rel_l2", "cosine", "calc_diff", "max_abs", "snr_db"}) EXPECT_EQ(m.at(k), "nan") << k;
  EXPECT_EQ(m.at("skipped_nonfinite"), 1);
  const std::vector<std::string> lines = test::split_lines(r.out);
  const auto row = std::find_if(lines.begin(), lines.end(), [](const std::string& l) { return l.rfind("x ", 0) == 0; });
  ASSERT_NE(row, lines.end()) << describe(r);
  // tensor dtype shape format amax rel_l2 cosine calc_diff max_abs snr_db skipped B/row cast: the
  // amax is inf.
  EXPECT_EQ(test::split_words(*row), (std::vector<std::string>{"x", "F32", "[2,64]", "fp8", "inf", "nan", "nan", "nan",
                                                               "nan", "nan", "1", "64", "-"}));
}

// 6a. A signal in the middle of a write removes the temporary; the earlier output stays whole.
TEST_F(Hostile, SignalsRemoveTemporaries) {
  std::ofstream(path("b.safetensors")) << "earlier";
  for (const char* sig : {"2", "15", "1"}) {
    SCOPED_TRACE(std::string("signal ") + sig);
    const auto before = listing();
    const RunResult r =
        moefq(kQdq + " --out b.safetensors", std::string("MOEFQ_TEST_RAISE=atomic-file-write:") + sig);
    EXPECT_EQ(r.status, 128 + std::stoi(sig)) << describe(r);
    EXPECT_EQ(listing(), before) << "a temporary was left";
    EXPECT_EQ(read_text(path("b.safetensors")), "earlier");
  }
  ASSERT_EQ(moefq("eval " + kEval + " --out rep").status, 0);
  const std::string json_before = read_text(path("rep/report.json"));
  // Killed with every report written but none published: the earlier set stays, whole.
  RunResult r = moefq("eval " + kEval + " --seed 2 --out rep", "MOEFQ_TEST_RAISE=atomic-dir-written:15");
  EXPECT_EQ(r.status, 128 + 15) << describe(r);
  EXPECT_EQ(read_text(path("rep/report.json")), json_before);
  EXPECT_TRUE(leftovers().empty()) << leftovers().front();
  // Killed right after publishing: the new set is there, whole; the earlier files are removed.
  r = moefq("eval " + kEval + " --seed 2 --out rep", "MOEFQ_TEST_RAISE=atomic-dir-published:2");
  EXPECT_EQ(r.status, 128 + 2) << describe(r);
  const json j = json::parse(read_text(path("rep/report.json")));
  EXPECT_EQ(j.at("config").at("seed"), 2);
  EXPECT_TRUE(leftovers().empty()) << leftovers().front();
  // SIGKILL cannot be handled: its temporary stays behind, but the published set is still whole.
  r = moefq("eval " + kEval + " --seed 3 --out rep", "MOEFQ_TEST_RAISE=atomic-dir-written:9");
  EXPECT_EQ(r.status, 128 + 9) << describe(r);
  EXPECT_EQ(json::parse(read_text(path("rep/report.json"))).at("config").at("seed"), 2);
}

// 6b. Two eval runs on one --out at once: run A is stopped (SIGSTOP) with its three reports
// written but not yet published, run B writes all of its reports meanwhile, then A goes on. Both
// succeed and the directory holds A's three reports, none of B's.
TEST_F(Hostile, ConcurrentEvalsNeverMixTheirReports) {
  ASSERT_EQ(moefq("eval " + kEvalBase + " --tokens 32 --out solo32").status, 0);
  ASSERT_EQ(moefq("eval " + kEvalBase + " --tokens 64 --out solo64").status, 0);
  const std::string bin = test::moefq_command("eval " + kEvalBase);
  const RunResult r = run_in_work(
      "( MOEFQ_TEST_RAISE=atomic-dir-written:19 " + bin + " --tokens 32 --out rep >o1 2>e1 & a=$!\n"
      "  i=0; while [ $i -lt 600 ] && [ -e /proc/$a ] && [ \"$(cut -d' ' -f3 /proc/$a/stat)\" != T ]; do\n"
      "    sleep 0.05; i=$((i + 1)); done\n"
      "  timeout -s KILL 60 " + bin + " --tokens 64 --out rep >o2 2>e2; echo \"B $?\"\n"
      "  kill -CONT $a; wait $a; echo \"A $?\" )");
  ASSERT_EQ(r.out, "B 0\nA 0\n") << describe(r) << read_text(path("e1")) << read_text(path("e2"));
  EXPECT_EQ(json::parse(read_text(path("rep/report.json"))).at("config").at("tokens_per_rank"), 32);
  EXPECT_EQ(read_text(path("rep/report.csv")), read_text(path("solo32/report.csv")));
  EXPECT_NE(read_text(path("rep/report.html")).find("2 x 32 per batch"), std::string::npos);
  EXPECT_TRUE(leftovers().empty()) << leftovers().front();
}

// 8. The output must not be the input, under any name.
TEST_F(Hostile, OutputEqualToInputIsRefused) {
  const auto input = read_bytes(path("a.safetensors"));
  expect_refused(kQdq + " --out a.safetensors", {"--out a.safetensors", "same file as --in"});
  expect_refused(kQdq + " --out ./a.safetensors", {"same file as --in"});
  fs::create_hard_link(path("a.safetensors"), path("hard.safetensors"));
  expect_refused(kQdq + " --out hard.safetensors", {"same file as --in"});
  expect_refused(kQdq + " --out b.safetensors --report a.safetensors", {"--report", "same file as --in"});
  expect_refused(kQdq + " --out b.safetensors --report b.safetensors", {"--report", "same file as --out"});
  EXPECT_EQ(read_bytes(path("a.safetensors")), input);
}

// 9. Outputs are checked before any work; an empty output path is an error, not "no output".
TEST_F(Hostile, OutputsAreCheckedBeforeAnyWork) {
  RunResult r = expect_refused(kQdq + " --out keep.txt/b.safetensors", {"--out keep.txt/b.safetensors"});
  EXPECT_EQ(r.err.find("[1/1]"), std::string::npos) << "the tensor was quantized before the check\n" << describe(r);
  r = expect_refused("eval " + kEval + " --out keep.txt/rep", {"--out keep.txt/rep"});
  EXPECT_EQ(r.err.find("running"), std::string::npos) << describe(r);
  expect_refused("eval " + kEval + " --out ''", {"--out: empty path"});
  expect_refused(kQdq + " --out ''", {"--out: empty path"});
  expect_refused(kQdq + " --out b.safetensors --report ''", {"--report: empty path"});
  expect_refused("calibrate " + kCalibrate + " --save ''", {"--save: empty path"});
  if (::geteuid() != 0) {  // root writes into a read-only directory
    fs::create_directory(path("ro"));
    fs::permissions(path("ro"), fs::perms::owner_read | fs::perms::owner_exec);
    r = expect_refused(kQdq + " --out ro/b.safetensors", {"--out ro/b.safetensors", "cannot create a file"});
    EXPECT_EQ(r.err.find("[1/1]"), std::string::npos) << describe(r);
    fs::permissions(path("ro"), fs::perms::owner_all);
  }
}

// 10. Messages say what is wrong: the kind of file, the number as written, the accepted range.
TEST_F(Hostile, MessagesSayWhatIsWrong) {
  RunResult r = expect_refused("eval --config /dev/zero --device cpu", {"is a character device"});
  EXPECT_EQ(r.err.find("no such file"), std::string::npos) << describe(r);
  r = expect_refused("eval " + kEval + " --load-calibration emptydir", {"--load-calibration emptydir", "is a directory"});
  EXPECT_EQ(r.err.find("JSON"), std::string::npos) << describe(r);
  write_config("u64.json", "hidden_size", "18446744073709551615");
  r = expect_refused("eval --config u64.json --device cpu", {"hidden_size", "18446744073709551615"});
  EXPECT_EQ(r.err.find("-1"), std::string::npos) << describe(r);
  std::ofstream(path("v.json")) << R"({"version": 18446744073709551615, "quantizers": {}})";
  r = expect_refused("eval " + kEval + " --load-calibration v.json", {"version 18446744073709551615"});
  r = expect_refused("eval --seed 1e3 --device cpu", {"--seed", "9223372036854775807"});
  r = expect_refused("eval --seed 9223372036854775808 --device cpu", {"--seed", "9223372036854775807"});
  EXPECT_EQ(r.err.find("1797693134862315"), std::string::npos) << "the bound of a double\n" << describe(r);
  for (const std::string amax : {"0x10", "inf", " 5", "5 ", "1e", "+", ".", "nan", "0x1p4"})
    expect_refused(kQdq + " --out b.safetensors --amax=" + quote(amax), {"--amax", "decimal"});
}

// 11. An output is never a file of the checkpoint read: its index, a shard the index names, its one
// model.safetensors, under any name; nor is eval --out a directory one of whose reports is an input
// (replacing the directory would remove it).
TEST_F(Hostile, OutputsNeverReplaceACheckpointFile) {
  test::write_checkpoint(path("single"), {{1, 7}});
  const std::string cal = "calibrate --device cpu --ranks 2 --tokens 32 --calib-batches 1 --layers 1 ";
  expect_refused(cal + "--checkpoint single --save single/model.safetensors",
                 {"--save single/model.safetensors", "is the same file as a --checkpoint file"});
  fs::create_directories(path("sharded"));
  std::ofstream(path("sharded/config.json")) << test::kSmallConfigJson;
  const MoeConfig cfg = test::small_config();
  test::FakeCheckpoint ckpt;
  ckpt.add_layer(cfg, synthetic_weights(cfg, WeightFormat::kE4m3, 7, 0, cfg.num_experts), 1);
  ckpt.write(path("sharded").string(), /*with_index=*/true);
  fs::create_hard_link(path("sharded") / test::FakeCheckpoint::shard_name(2), path("shard_link.safetensors"));
  for (const std::string& out :
       std::vector<std::string>{"sharded/model.safetensors.index.json", "sharded/" + test::FakeCheckpoint::shard_name(1),
                                "sharded/" + test::FakeCheckpoint::shard_name(2), "shard_link.safetensors"})
    expect_refused(cal + "--checkpoint sharded --save " + out, {"--save " + out, "is the same file as"});
  // A --config that is one of the reports eval --out would replace.
  fs::create_directory(path("rep"));
  std::ofstream(path("rep/report.json")) << test::kSmallConfigJson;
  expect_refused("eval --config rep/report.json --device cpu --ranks 2 --tokens 32 --calib-batches 1 --eval-batches 1 "
                 "--recipe moe_combine_fp8 --out rep",
                 {"--out rep", "its report.json is --config rep/report.json"});
}

// 12. A reader that closes stdout early (`| head`) loses only the table: the outputs are published
// before anything is printed, the closed pipe ends nothing and the exit status is the command's
// own. A stdout that cannot be written for another reason (a full disk) is exit 2, outputs kept.
TEST_F(Hostile, AClosedStdoutLosesOnlyTheTable) {
  SafetensorsWriter w;
  const std::vector<float> x = test::activations(1, 128, 9, /*specials=*/false);
  for (int i = 0; i < 300; ++i) w.add("t" + std::to_string(i), StDtype::kF32, {1, 128}, span_of(x));
  w.write(path("many.safetensors").string());
  // `:` exits at once: every write to stdout after it finds the pipe closed.
  const auto piped = [&](const std::string& args) {
    return run_in_work("{ timeout -s KILL 60 " + test::moefq_command(args) + "; echo $? >status; } | :");
  };
  RunResult r = piped("qdq --in many.safetensors --out x.safetensors --format fp8 --device cpu --report r.json");
  EXPECT_EQ(read_text(path("status")), "0\n") << describe(r);
  ASSERT_TRUE(fs::exists(path("x.safetensors"))) << describe(r);
  EXPECT_EQ(SafetensorsFile::open(path("x.safetensors").string(), "x").header().tensors.size(), 300u);
  EXPECT_EQ(json::parse(read_text(path("r.json"))).at("results").size(), 300u);
  r = piped("eval " + kEval + " --out rep");
  EXPECT_EQ(read_text(path("status")), "0\n") << describe(r);
  EXPECT_TRUE(fs::exists(path("rep/report.json"))) << describe(r);
  r = piped("calibrate " + kCalibrate + " --save cal.json");
  EXPECT_EQ(read_text(path("status")), "0\n") << describe(r);
  EXPECT_TRUE(fs::exists(path("cal.json"))) << describe(r);
  // A full disk under stdout: the outputs are there, the lost table is an error.
  r = run_in_work("(timeout -s KILL 60 " +
                  test::moefq_command("qdq --in many.safetensors --out y.safetensors --format fp8 --device cpu") +
                  " >/dev/full)");
  EXPECT_EQ(r.status, 2) << describe(r);
  EXPECT_NE(r.err.find("moefq: error: stdout: the results could not be written in full"), std::string::npos)
      << describe(r);
  EXPECT_TRUE(fs::exists(path("y.safetensors"))) << describe(r);
  EXPECT_TRUE(leftovers().empty()) << leftovers().front();
}

// 13. Outputs get the permissions the umask gives any new file (0666, a directory 0777, less the
// umask); one that replaces an earlier file or report directory keeps that one's permissions.
TEST_F(Hostile, OutputPermissionsFollowTheUmask) {
  const auto mode = [&](const std::string& name) {
    struct stat st {};
    EXPECT_EQ(::stat(path(name).c_str(), &st), 0) << name;
    return st.st_mode & 07777;
  };
  RunResult r = moefq(kQdq + " --out b.safetensors --report r.json", "umask 027;");
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_EQ(mode("b.safetensors"), 0640u);
  EXPECT_EQ(mode("r.json"), 0640u);
  r = moefq("eval " + kEval + " --out rep", "umask 027;");
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_EQ(mode("rep"), 0750u);
  EXPECT_EQ(mode("rep/report.json"), 0640u);
  ::chmod(path("b.safetensors").c_str(), 0600);
  ::chmod(path("rep").c_str(), 0700);
  r = moefq(kQdq + " --out b.safetensors --report r2.json", "umask 002;");
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_EQ(mode("b.safetensors"), 0600u) << "the replaced file's permissions";
  EXPECT_EQ(mode("r2.json"), 0664u);
  r = moefq("eval " + kEval + " --out rep", "umask 002;");
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_EQ(mode("rep"), 0700u) << "the replaced directory's permissions";
  EXPECT_EQ(mode("rep/report.csv"), 0664u);
}

// 14. bench --json follows the rules of every output, checked before the benchmark runs; an
// existing regular file is replaced, as by every output.
TEST_F(Hostile, BenchJsonIsCheckedBeforeTheRun) {
  const std::string ecpu = "bench engine-cpu --ranks 2 --tokens 8 --reps 1";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"nodir/x.json", "does not exist"}, {"keep.txt/x.json", "keep.txt is not a directory"},
      {"pipe", "FIFO"},                   {"emptydir", "is a directory"},
      {"/dev/null", "character device"}};
  for (const auto& [out, why] : cases) {
    const RunResult r = expect_refused(ecpu + " --json " + out, {"--json " + out, why});
    EXPECT_EQ(r.out.find("layer call"), std::string::npos) << "the benchmark ran first\n" << describe(r);
  }
  expect_refused(ecpu + " --json ''", {"--json: empty path"});
  expect_refused("bench eval --preset tiny --layers 0 --ranks 2 --tokens 8 --calib-batches 1 --eval-batches 1 "
                 "--device cpu --json ''",
                 {"--json: empty path"});
  for (const std::string gpu : {"qdq", "moe", "gemm", "combine"})
    expect_refused("bench " + gpu + " --json ''", {"--json: empty path"});
  std::ofstream(path("b.json")) << "earlier";
  const RunResult r = moefq(ecpu + " --json b.json");
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_EQ(json::parse(read_text(path("b.json"))).at("tool"), "moefq bench engine-cpu");
}

// 15. Benchmark sizes are checked as the options are parsed, in every build, before any device
// is touched: exit 2 naming the option.
TEST_F(Hostile, BenchSizesAreCheckedByOption) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"bench gemm --hidden 0", "--hidden"},       {"bench gemm --hidden=-128", "--hidden"},
      {"bench gemm --hidden 100", "--hidden"},     {"bench gemm --inter 0", "--inter"},
      {"bench gemm --tokens=-5", "--tokens"},      {"bench gemm --tokens 1 0", "--tokens"},
      {"bench qdq --rows 0", "--rows"},            {"bench qdq --cols 100", "--cols"},
      {"bench combine --hidden 0", "--hidden"},    {"bench combine --hidden 131072", "--hidden"},
      {"bench moe --tokens 8 0", "--tokens"},      {"bench engine-cpu --tokens 0", "--tokens"},
      {"bench moe --ep 3", "--ep 3: deepseek-v3's 256 experts do not split into 3 ranks"},
      {"bench moe --preset nope", "nope"},         {"bench moe --configs bogus", "--configs"}};
  for (const auto& [args, option] : cases) {
    const RunResult r = expect_refused(args, {option});
    EXPECT_EQ(r.err.find("CUDA"), std::string::npos) << "the sizes before the device\n" << describe(r);
  }
}

// 16. bench engine-cpu plans its memory like eval: a run that cannot fit is refused with the
// figures before it allocates (the address-space limit makes an unplanned run fail fast).
TEST_F(Hostile, BenchEngineCpuPlansItsMemory) {
  const RunResult r = expect_refused("bench engine-cpu --preset deepseek-v3 --ranks 8 --tokens 1048576",
                                     {"--tokens 1048576", "needs", "available", "memory plan"}, "ulimit -v 1048576;");
  EXPECT_EQ(r.err.find("ran out of memory"), std::string::npos) << describe(r);
  EXPECT_EQ(r.err.find("generating"), std::string::npos) << describe(r);
}

// 17. The outputs of one command are published together, after all were written: --report failing
// (here over the file size limit, which also must not kill the run with SIGXFSZ) leaves --out as
// it was. Under `ulimit -f` every command ends with exit 2 and a message, and no temporary.
TEST_F(Hostile, OutputsArePublishedTogetherAndFileSizeLimitsAreFullDisks) {
  // Many zero-size tensors: a small --out (a header), a large --report (a row per tensor).
  SafetensorsWriter w;
  for (int i = 0; i < 120; ++i) w.add("t" + std::to_string(i), StDtype::kBF16, {1, 0}, {});
  w.write(path("zeros.safetensors").string());
  std::ofstream(path("b.safetensors")) << "earlier";
  const std::string qdq = "qdq --in zeros.safetensors --format fp8 --device cpu --out b.safetensors --report r.json";
  RunResult r = expect_refused(qdq, {"r.json", "File too large", "nothing was written"}, "ulimit -f 16;");
  EXPECT_EQ(read_text(path("b.safetensors")), "earlier") << describe(r);
  // The report small enough: both are published.
  r = moefq(qdq);
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_EQ(json::parse(read_text(path("r.json"))).at("results").size(), 120u);
  EXPECT_NE(read_text(path("b.safetensors")), "earlier");
  // The file size limit reached by each command's output (1 block of 512 bytes).
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"qdq --device cpu --sample-rows 64 --sample-cols 128 --out big.safetensors", "big.safetensors"},
      {"eval " + kEval + " --out rep2", "rep2"},
      {"calibrate " + kCalibrate + " --save cal2.json", "cal2.json"}};
  for (const auto& [args, out] : cases) {
    SCOPED_TRACE(args);
    // The limit for moefq only: its messages go through a pipe to the log, which the limit
    // would cut short.
    r = run_in_work("((ulimit -f 1; timeout -s KILL 60 " + test::moefq_command(args) +
                    " 2>&1; echo \"status $?\") | cat)");
    EXPECT_NE(r.out.find("status 2\n"), std::string::npos) << describe(r);
    EXPECT_NE(r.out.find("File too large"), std::string::npos) << describe(r);
    EXPECT_FALSE(fs::exists(path(out))) << describe(r);
    EXPECT_TRUE(leftovers().empty()) << leftovers().front();
  }
}

// 18. Any name the file system allows works for an output (its temporary's name is cut short); a
// name it does not allow, or a mount point, is refused before any work.
TEST_F(Hostile, AnyLegalOutputNameWorksAndMountPointsAreRefused) {
  for (const size_t len : {245u, 250u, 255u}) {
    const std::string name(len, 'n');
    RunResult r = moefq(kQdq + " --out " + name + " --report r" + name.substr(1));
    ASSERT_EQ(r.status, 0) << len << "\n" << describe(r);
    EXPECT_TRUE(fs::exists(path(name)));
    EXPECT_TRUE(fs::exists(path("r" + name.substr(1))));
    r = moefq("eval " + kEval + " --out d" + name.substr(1));
    ASSERT_EQ(r.status, 0) << len << "\n" << describe(r);
    EXPECT_TRUE(fs::exists(path("d" + name.substr(1)) / "report.json"));
    r = moefq("eval " + kEval + " --out d" + name.substr(1));  // replacing it: the exchange's temporary
    ASSERT_EQ(r.status, 0) << len << "\n" << describe(r);
    r = moefq("eval " + kEval + " --out d" + name.substr(1), "MOEFQ_TEST_NO_RENAMEAT2=1");
    ASSERT_EQ(r.status, 0) << len << "\n" << describe(r);
    EXPECT_TRUE(leftovers().empty()) << leftovers().front();
  }
  RunResult r = expect_refused(kQdq + " --out " + std::string(256, 'n'), {"--out", "File name too long"});
  EXPECT_EQ(r.err.find("[1/1]"), std::string::npos) << describe(r);
  expect_refused("eval " + kEval + " --out " + std::string(256, 'd'), {"--out", "File name too long"});
  // A regular file that is a mount point (a container's /etc/hosts, say), if this machine has one:
  // refused up front, not after the work with "Device or resource busy".
  std::ifstream mounts("/proc/self/mountinfo");
  std::string line;
  while (std::getline(mounts, line)) {
    std::istringstream fields(line);
    std::string id, parent, devno, root, point;
    fields >> id >> parent >> devno >> root >> point;
    if (!fs::is_regular_file(fs::symlink_status(point)) || ::access(fs::path(point).parent_path().c_str(), W_OK) != 0)
      continue;
    r = expect_refused(kQdq + " --out " + point, {"--out " + point, "mount point"});
    EXPECT_EQ(r.err.find("[1/1]"), std::string::npos) << describe(r);
    break;
  }
}

// 19. A zero-size tensor costs nothing, whatever its other dimensions: every format copies it at
// once (logfmt10 once looped over 2^40 rows), and a shape whose other dimensions overflow is fine.
TEST_F(Hostile, ZeroSizeTensorsCostNothing) {
  SafetensorsWriter w;
  w.add("wide", StDtype::kBF16, {int64_t{1} << 40, 0}, {});
  w.add("huge", StDtype::kBF16, {3, int64_t{1} << 62, 0}, {});
  w.add("f", StDtype::kF32, {0, int64_t{1} << 62}, {});
  w.write(path("z.safetensors").string());
  for (const char* f : {"logfmt10", "fp8", "nvfp4", "mxfp4", "fp8_block128", "int8"}) {
    SCOPED_TRACE(f);
    const RunResult r = moefq(std::string("qdq --in z.safetensors --out zq.safetensors --device cpu --format ") + f);
    ASSERT_EQ(r.status, 0) << describe(r);
    const SafetensorsFile out = SafetensorsFile::open(path("zq.safetensors").string(), "zq");
    ASSERT_NE(out.find("huge"), nullptr);
    EXPECT_EQ(out.find("huge")->shape, (std::vector<int64_t>{3, int64_t{1} << 62, 0}));
  }
}

// 20. NaN or inf in a checkpoint's block scales, weights or router: the error names the tensor and
// its file, not the NaN it would become in a rank's calibration data.
TEST_F(Hostile, NonFiniteCheckpointTensorsAreNamed) {
  const MoeConfig cfg = test::small_config();
  const auto write = [&](const std::string& dir, const std::function<void(LayerWeights&)>& spoil) {
    fs::create_directories(path(dir));
    std::ofstream(path(dir) / "config.json") << test::kSmallConfigJson;
    LayerWeights lw = synthetic_weights(cfg, WeightFormat::kE4m3, 7, 0, cfg.num_experts);
    spoil(lw);
    test::FakeCheckpoint ckpt;
    ckpt.add_layer(cfg, lw, 1);
    ckpt.write(path(dir).string(), /*with_index=*/false);
  };
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  write("nan_scale", [&](LayerWeights& lw) { lw.experts[3].down_scale[1] = nan; });
  write("inf_scale", [&](LayerWeights& lw) { lw.shared[0].gate_up_scale[0] = -inf; });
  write("nan_code", [&](LayerWeights& lw) { lw.experts[5].gate_up_e4m3[17] = 0x7f; });
  write("inf_gate", [&](LayerWeights& lw) { lw.gate[2] = inf; });
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"nan_scale", "tensor model.layers.1.mlp.experts.3.down_proj.weight_scale_inv in nan_scale/model.safetensors"},
      {"inf_scale", "model.layers.1.mlp.shared_experts.gate_proj.weight_scale_inv in inf_scale/model.safetensors"},
      {"nan_code", "model.layers.1.mlp.experts.5.gate_proj.weight in nan_code/model.safetensors: element 17 is NaN"},
      {"inf_gate", "model.layers.1.mlp.gate.weight in inf_gate/model.safetensors"}};
  for (const auto& [dir, needle] : cases) {
    const RunResult r = expect_refused("eval --checkpoint " + dir + " --layers 1 --device cpu --ranks 2 --tokens 16 "
                                       "--calib-batches 1 --eval-batches 1 --recipe moe_combine_fp8",
                                       {needle, "must be finite"});
    EXPECT_EQ(r.err.find("calibration data"), std::string::npos) << describe(r);
  }
  // All-zero block scales are finite, but every recipe would look perfect: a warning, on stderr
  // beside the table and in the report.
  write("zero_scales", [](LayerWeights& lw) {
    for (auto* experts : {&lw.experts, &lw.shared})
      for (ExpertWeights& e : *experts) {
        std::fill(e.gate_up_scale.begin(), e.gate_up_scale.end(), 0.0f);
        std::fill(e.down_scale.begin(), e.down_scale.end(), 0.0f);
      }
  });
  const RunResult r = moefq("eval --checkpoint zero_scales --layers 1 --device cpu --ranks 2 --tokens 16 "
                            "--calib-batches 1 --eval-batches 1 --recipe moe_combine_fp8 --out zrep");
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_NE(r.err.find("warning: layer 1: the reference output is all zero"), std::string::npos) << describe(r);
  const json report = json::parse(read_text(path("zrep/report.json")));
  ASSERT_EQ(report.at("warnings").size(), 1u) << report.at("warnings").dump();
  EXPECT_NE(report.at("warnings")[0].get<std::string>().find("reference output is all zero"), std::string::npos);
}

// 21. Exit status 3 is for internal errors only, and a path the system refuses (a symbolic link
// loop, a name too long) is bad input naming it, exit 2.
TEST_F(Hostile, PathsTheSystemRefusesAreBadInput) {
  // Outside the work directory, whose listing (before and after each run) would stumble on the loops.
  const fs::path loops = path("..") / "loops";
  fs::create_directories(loops / "ck");
  fs::create_symlink("loop", loops / "loop");
  fs::create_symlink("config.json", loops / "ck/config.json");
  const std::string loop = (loops / "loop").string(), ck = (loops / "ck").string();
  for (const std::string& dir : std::vector<std::string>{loop, ck, std::string(300, 'c'), loop + "/x"}) {
    const RunResult r = expect_refused("eval --checkpoint " + dir + " --layers 1 --device cpu", {});
    EXPECT_EQ(r.err.find("internal error"), std::string::npos) << describe(r);
  }
  for (const std::string& f : std::vector<std::string>{loop, std::string(300, 'c') + ".json"}) {
    expect_refused("eval --config " + f + " --device cpu", {"--config"});
    expect_refused(kQdq + " --out b.safetensors --in " + f, {"--in"});
  }
}

// 22. Names from files are printed escaped: a tensor name with a newline or a terminal escape
// cannot forge lines or drive the terminal, in progress lines, the table or messages.
TEST_F(Hostile, NamesAreEscapedWhenPrinted) {
  SafetensorsWriter w;
  const std::vector<bf16> x = test::to_bf16(test::activations(2, 64, 3, /*specials=*/false));
  w.add("evil\nrel_l2 0\x1b[2J\x1b]0;title\x07", StDtype::kBF16, {2, 64}, span_of(x));
  w.write(path("evil.safetensors").string());
  RunResult r = moefq("qdq --in evil.safetensors --out e.safetensors --format fp8 --device cpu");
  ASSERT_EQ(r.status, 0) << describe(r);
  for (const std::string& s : {r.out, r.err}) {
    EXPECT_EQ(s.find('\x1b'), std::string::npos) << describe(r);
    EXPECT_EQ(s.find('\x07'), std::string::npos) << describe(r);
  }
  EXPECT_NE(r.out.find("evil\\nrel_l2 0\\x1b[2J"), std::string::npos) << describe(r);
  EXPECT_NE(r.err.find("evil\\nrel_l2 0\\x1b[2J"), std::string::npos) << describe(r);
  r = expect_refused("qdq --in evil.safetensors --out e2.safetensors --format fp8 --device cpu "
                     "--tensor \"$(printf 'a\\033[31mb')\"",
                     {"a\\x1b[31mb"});
  EXPECT_EQ(r.err.find('\x1b'), std::string::npos) << describe(r);
  // A recipe named so: eval's progress lines and table.
  fs::copy_file(fs::path(MOEFQ_RECIPE_DIR) / "configs/ptq/units/moe_combine_fp8.yaml", path("ev\x1b[31mil.yaml"));
  r = moefq("eval " + kEvalBase + " --tokens 32 --recipe \"$(printf 'ev\\033[31mil.yaml')\"");
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_EQ(r.out.find('\x1b'), std::string::npos) << describe(r);
  EXPECT_EQ(r.err.find('\x1b'), std::string::npos) << describe(r);
  EXPECT_NE(r.out.find("ev\\x1b[31mil"), std::string::npos) << describe(r);
}

// 23. The terminating signals a user or a scheduler sends (SIGQUIT, SIGUSR1, SIGALRM...) remove the
// temporaries too; the earlier output stays whole.
TEST_F(Hostile, OtherTerminatingSignalsRemoveTemporaries) {
  std::ofstream(path("b.safetensors")) << "earlier";
  for (const int sig : {SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM}) {
    SCOPED_TRACE("signal " + std::to_string(sig));
    const auto before = listing();
    const RunResult r = moefq(kQdq + " --out b.safetensors",
                              "ulimit -c 0; MOEFQ_TEST_RAISE=atomic-file-write:" + std::to_string(sig));
    EXPECT_EQ(r.status, 128 + sig) << describe(r);
    EXPECT_EQ(listing(), before) << "a temporary was left";
    EXPECT_EQ(read_text(path("b.safetensors")), "earlier");
  }
}

// 24. A deeply nested recipe, calibration file or checkpoint index is refused before a parser
// recurses into it, even under a small stack; the files a parser reads cannot take memory far
// beyond their size.
TEST_F(Hostile, DeepAndWideDocumentsAreRefusedBeforeParsing) {
  std::string yaml = "quant_cfg:\n";
  for (int i = 0; i < 1000; ++i) yaml += std::string(size_t(i + 1), ' ') + "k:\n";
  std::ofstream(path("deep.yaml")) << yaml;
  std::ofstream(path("flow.yaml")) << "quant_cfg: " << std::string(5000, '[') << std::string(5000, ']') << "\n";
  std::ofstream(path("dash.yaml")) << "quant_cfg:\n" << [] {
    std::string s;
    for (int i = 0; i < 5000; ++i) s += "- ";
    return s + "x\n";
  }();
  for (const char* f : {"deep.yaml", "flow.yaml", "dash.yaml"})
    expect_refused("eval " + kEvalBase + " --tokens 32 --recipe " + f, {f, "nests more than"}, "ulimit -s 256;");
  std::ofstream(path("cal.json")) << std::string(1 << 20, '[');
  expect_refused("eval " + kEval + " --load-calibration cal.json", {"cal.json", "nests deeper"}, "ulimit -s 256;");
  // Wide: a million empty objects, 3 bytes of text each, far more as a tree.
  std::string wide = "{\"version\": 2, \"quantizers\": [{}";
  for (int i = 1; i < 1'000'000; ++i) wide += ",{}";
  wide += "]}";
  std::ofstream(path("wide.json")) << wide;
  expect_refused("eval " + kEval + " --load-calibration wide.json", {"wide.json", "JSON values"});
  std::ofstream(path("deep_config.json")) << std::string(1 << 20, '{');
  expect_refused("eval --config deep_config.json --device cpu", {"deep_config.json", "nests deeper"},
                 "ulimit -s 256;");
  test::write_checkpoint(path("ckpt"), {{1, 7}});
  fs::remove(path("ckpt/model.safetensors"));
  std::ofstream(path("ckpt/model.safetensors.index.json")) << std::string(1 << 20, '{');
  expect_refused("eval --checkpoint ckpt --layers 1 --device cpu", {"model.safetensors.index.json", "nests deeper"},
                 "ulimit -s 256;");
}

// 25. Recipe imports are linear in the size of what they import, and a file imported by several
// units is read once per load: a numerics file of 100k keys imported through 8 units loads in a
// moment (each import took seconds, and the loads added up).
TEST_F(Hostile, LargeImportsLoadOnce) {
  fs::create_directories(path("root/configs/numerics"));
  fs::create_directories(path("root/configs/ptq/units"));
  std::ofstream numerics(path("root/configs/numerics/big.yml"));
  numerics << "# modelopt-schema: modelopt.torch.quantization.config.QuantizerAttributeConfig\n";
  for (int i = 0; i < 100'000; ++i) numerics << "k" << i << ": 0\n";  // 0.9 MB, under the 1 MiB cap
  numerics.close();
  std::string recipe = "imports:\n";
  for (int u = 0; u < 8; ++u) {
    std::ofstream(path("root/configs/ptq/units/u" + std::to_string(u) + ".yml"))
        << "# modelopt-schema: modelopt.torch.quantization.config.QuantizerCfgListConfig\n"
        << "imports:\n  big: configs/numerics/big\n---\n- quantizer_name: '*combine_quantizer'\n  cfg:\n"
        << "    $import: big\n";
  }
  recipe = "quant_cfg:\n";
  for (int u = 0; u < 8; ++u) recipe += "  - $import: u" + std::to_string(u) + "\n";
  std::ofstream(path("root/r.yml")) << recipe;
  // A quadratic merge of these keys took seconds per import: the run's time limit would end it.
  expect_refused("eval " + kEval + " --recipe-root root --recipe root/r.yml", {"k0"});
}

}  // namespace
}  // namespace moefq
