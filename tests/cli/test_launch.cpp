// `moefq launch` end to end: the real binary starts /bin/sh scripts, and launch_test_rank (a rank
// program using include/moefq/dist_env.h), in a fresh directory per test, with TMPDIR there so the
// rendezvous directory can be seen and checked for removal. Every rank's environment and output
// lines; a failing, killed or hanging rank stops the others long before their `sleep 60` ends,
// processes the ranks started included; --timeout; SIGTERM and SIGINT to the launcher reach the
// ranks; bad arguments and programs that cannot run exit 2. Then rank_env() and the file
// rendezvous, in this process.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cli_test_util.h"
#include "moefq_binary.h"
#include "moefq/dist_env.h"
#include "moefq/errors.h"
#include "test_util.h"

#ifndef LAUNCH_TEST_RANK
#error "LAUNCH_TEST_RANK (the path of the launch_test_rank executable) must be defined by tests/CMakeLists.txt"
#endif

namespace moefq {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using test::describe, test::quote, test::read_text, test::RunResult, test::split_lines;

// Every job that must be stopped runs `sleep 60`; it must end long before that, even on a loaded
// 2-core machine.
constexpr double kStoppedWithin = 10;
// A safety net on those jobs: a launcher that fails to stop them still ends (exit 124).
const std::string kSafetyTimeout = "--timeout 40";

// The "[rank r] " prefix of a forwarded line and the rest; nullopt when the line has no prefix.
std::optional<std::pair<int, std::string>> split_prefix(const std::string& line) {
  const std::string head = "[rank ";
  const size_t close = line.find("] ");
  if (line.rfind(head, 0) != 0 || close == std::string::npos) return std::nullopt;
  const std::string digits = line.substr(head.size(), close - head.size());
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::pair<int, std::string>{std::stoi(digits), line.substr(close + 2)};
}

// True when process pid has ended (gone, or a zombie), waiting up to 10 s for it.
bool process_ends(long pid) {
  for (int i = 0; i < 200; ++i) {
    const std::string stat = read_text("/proc/" + std::to_string(pid) + "/stat");
    // The state is the field after the command name, which is in parentheses.
    const size_t close = stat.rfind(')');
    if (stat.empty() || close == std::string::npos || close + 2 >= stat.size()) return true;
    if (stat[close + 2] == 'Z' || stat[close + 2] == 'X') return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

class LaunchCli : public test::WorkDirTest {
 protected:
  LaunchCli() : WorkDirTest("moefq_launch_") {}

  void SetUp() override {
    WorkDirTest::SetUp();
    fs::create_directories(tmp());
    fs::create_directories(path("pids"));
  }

  fs::path tmp() const { return root_ / "tmp"; }

  // The words that run `moefq launch ARGS` with TMPDIR = tmp() and the variables env.
  std::string launch_command(const std::string& args, const std::string& env = "") const {
    return "TMPDIR=" + quote(tmp().string()) + " " + env + " " + test::moefq_command("launch " + args);
  }

  // Runs `moefq launch ARGS` in work_; seconds_: its wall time.
  RunResult launch(const std::string& args, const std::string& env = "") {
    const Clock::time_point start = Clock::now();
    RunResult r = run_in_work(launch_command(args, env));
    seconds_ = std::chrono::duration<double>(Clock::now() - start).count();
    return r;
  }

  // `moefq launch ARGS -- sh -c SCRIPT`
  RunResult launch_sh(const std::string& args, const std::string& script, const std::string& env = "") {
    return launch(args + " -- sh -c " + quote(script), env);
  }

  // What is left in TMPDIR: rendezvous directories the launcher did not remove.
  std::vector<std::string> tmp_entries() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(tmp())) names.push_back(e.path().filename().string());
    return names;
  }

  // The pid each rank but `except` wrote to pids/RANK.
  std::vector<long> recorded_pids(int num_ranks, int except) const {
    std::vector<long> pids;
    for (int r = 0; r < num_ranks; ++r)
      if (r != except) {
        const std::string text = read_text(path("pids") / std::to_string(r));
        EXPECT_FALSE(text.empty()) << "rank " << r << " did not record its sleep's pid";
        if (!text.empty()) pids.push_back(std::stol(text));
      }
    return pids;
  }

  double seconds_ = 0;
};

// A job of num_ranks where rank `failing` waits until every other rank runs `sleep 60` (the sleep's
// pid in pids/RANK), then runs `failure`; the others wait for their sleep. `prologue` runs first on
// every rank.
std::string stop_script(int num_ranks, int failing, const std::string& failure, const std::string& prologue = "") {
  std::string others;
  for (int r = 0; r < num_ranks; ++r)
    if (r != failing) others.append(" ").append(std::to_string(r));
  return prologue + "\n" +
         "if [ \"$RANK\" = " + std::to_string(failing) + " ]; then\n"
         "  for r in" + others + "; do while [ ! -f pids/$r ]; do sleep 0.05; done; done\n"
         "  " + failure + "\n"
         "fi\n"
         "sleep 60 & echo $! > pids/$RANK.tmp && mv pids/$RANK.tmp pids/$RANK\n"
         "wait\n";
}

// ------------------------------------------------------------------------------------------------
// Ranks that succeed.

TEST_F(LaunchCli, EveryRankGetsItsEnvironmentAndPrefix) {
  // Stale values under the launcher's names are replaced; anything else, CUDA_VISIBLE_DEVICES
  // included, is inherited as it is. The first line is written in two parts.
  const std::string script =
      "printf 'split '; sleep 0.2; echo \"line $RANK\"\n"
      "echo \"env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE ${CUDA_VISIBLE_DEVICES-unset} "
      "$MOEFQ_TEST_INHERITED\"\n"
      "echo \"rendezvous $MOEFQ_RENDEZVOUS $(stat -c %a \"$MOEFQ_RENDEZVOUS\")\"\n"
      "echo \"to stderr $RANK\" >&2\n";
  const RunResult r = launch_sh("-n 4", script,
                                "CUDA_VISIBLE_DEVICES=5,6 RANK=99 WORLD_SIZE=7 LOCAL_RANK=3 LOCAL_WORLD_SIZE=9 "
                                "MOEFQ_RENDEZVOUS=/stale MOEFQ_TEST_INHERITED=kept");
  ASSERT_EQ(r.status, 0) << describe(r);

  // Per rank, its lines in the order written; the rendezvous directory is the same for all.
  std::map<int, std::vector<std::string>> by_rank;
  for (const std::string& line : split_lines(r.out)) {
    const auto p = split_prefix(line);
    ASSERT_TRUE(p.has_value()) << "line without a rank prefix: '" << line << "'\n" << describe(r);
    by_rank[p->first].push_back(p->second);
  }
  ASSERT_EQ(by_rank.size(), 4u) << describe(r);
  const std::string rendezvous = by_rank[0].size() == 3 ? test::split_words(by_rank[0][2]).at(1) : "";
  EXPECT_EQ(fs::path(rendezvous).parent_path(), tmp()) << describe(r);
  EXPECT_EQ(fs::path(rendezvous).filename().string().rfind("moefq_launch_", 0), 0u) << rendezvous;
  for (int rank = 0; rank < 4; ++rank) {
    const std::string k = std::to_string(rank);
    EXPECT_EQ(by_rank[rank], (std::vector<std::string>{"split line " + k, "env " + k + " 4 " + k + " 4 5,6 kept",
                                                       "rendezvous " + rendezvous + " 700"}))
        << "rank " << rank << "\n" << describe(r);
  }
  std::vector<std::string> err = split_lines(r.err);
  std::sort(err.begin(), err.end());
  EXPECT_EQ(err, (std::vector<std::string>{"[rank 0] to stderr 0", "[rank 1] to stderr 1", "[rank 2] to stderr 2",
                                           "[rank 3] to stderr 3"}))
      << describe(r);
  EXPECT_FALSE(fs::exists(rendezvous)) << "the rendezvous directory was not removed";
  EXPECT_TRUE(tmp_entries().empty());
}

// torch.distributed's env:// initialisation needs MASTER_ADDR and MASTER_PORT as well: the launcher
// sets 127.0.0.1 and a port free when the job starts, the same for every rank, unless the caller
// set them (then theirs are kept).
TEST_F(LaunchCli, RanksGetMasterAddrAndPortForTorch) {
  const std::string script = "echo \"master ${MASTER_ADDR-unset} ${MASTER_PORT-unset}\"\n";
  const RunResult r = launch_sh("-n 3", script);
  ASSERT_EQ(r.status, 0) << describe(r);
  std::set<std::string> seen;
  for (const std::string& line : split_lines(r.out)) {
    const auto p = split_prefix(line);
    ASSERT_TRUE(p.has_value()) << describe(r);
    seen.insert(p->second);
  }
  ASSERT_EQ(seen.size(), 1u) << "every rank must see the same address and port\n" << describe(r);
  const std::vector<std::string> words = test::split_words(*seen.begin());
  ASSERT_EQ(words.size(), 3u) << describe(r);
  EXPECT_EQ(words[1], "127.0.0.1");
  ASSERT_EQ(words[2].find_first_not_of("0123456789"), std::string::npos) << words[2];
  const int port = std::stoi(words[2]);
  EXPECT_GT(port, 0);
  EXPECT_LT(port, 65536);

  const RunResult kept = launch_sh("-n 2", script, "MASTER_ADDR=10.1.2.3 MASTER_PORT=29500");
  ASSERT_EQ(kept.status, 0) << describe(kept);
  for (const std::string& line : split_lines(kept.out)) EXPECT_EQ(split_prefix(line)->second, "master 10.1.2.3 29500");
}

TEST_F(LaunchCli, LinesAreNeverMixed) {
  // awk writes its buffer in 4 KiB blocks, which cut lines anywhere; line i of rank r is
  // "r<r>-<i>-" and i % 97 x's. The last line has no newline.
  const int kLines = 20000;
  const std::string script = "awk -v n=" + std::to_string(kLines) +
                             " 'BEGIN { r = ENVIRON[\"RANK\"]; for (i = 0; i < n; i++) { x = \"\"; "
                             "for (j = 0; j < i % 97; j++) x = x \"x\"; printf \"r%s-%d-%s\\n\", r, i, x } "
                             "printf \"tail %s\", r }'";
  const RunResult r = launch_sh("-n 4", script);
  ASSERT_EQ(r.status, 0) << r.err;
  std::map<int, int> next;  // rank -> index of its next line; kLines + 1 after its tail
  size_t num_lines = 0;
  for (const std::string& line : split_lines(r.out)) {
    ++num_lines;
    const auto p = split_prefix(line);
    ASSERT_TRUE(p.has_value()) << "line " << num_lines << " without a rank prefix: '" << line.substr(0, 200) << "'";
    const auto [rank, text] = *p;
    int& i = next[rank];
    ASSERT_LE(i, kLines) << "rank " << rank << " wrote after its tail: '" << text.substr(0, 200) << "'";
    std::string expected = i == kLines ? "tail " : "r";
    expected += std::to_string(rank);
    if (i < kLines) expected.append("-").append(std::to_string(i)).append("-").append(size_t(i % 97), 'x');
    ASSERT_EQ(text, expected) << "rank " << rank << " line " << i;
    ++i;
  }
  EXPECT_EQ(num_lines, size_t(4 * (kLines + 1)));
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(next[rank], kLines + 1) << "rank " << rank;
}

// ------------------------------------------------------------------------------------------------
// Stopping a job.

TEST_F(LaunchCli, FailingRankStopsTheOthers) {
  const RunResult r = launch_sh("-n 4 " + kSafetyTimeout, stop_script(4, 2, "exit 3"));
  EXPECT_EQ(r.status, 3) << describe(r);
  EXPECT_LT(seconds_, kStoppedWithin) << describe(r);
  EXPECT_NE(r.err.find("moefq launch: rank 2 exited with code 3; sending SIGTERM to the 3 ranks still running"),
            std::string::npos)
      << describe(r);
  EXPECT_EQ(r.err.find("sending SIGKILL"), std::string::npos) << "SIGTERM was enough\n" << describe(r);
  // The sleeps are the ranks' children: stopping a rank stops its process group.
  for (long pid : recorded_pids(4, 2)) EXPECT_TRUE(process_ends(pid)) << "sleep " << pid << " still runs";
  EXPECT_TRUE(tmp_entries().empty());
}

TEST_F(LaunchCli, RankKilledBySignalStopsTheOthers) {
  const RunResult r = launch_sh("-n 3 " + kSafetyTimeout, stop_script(3, 1, "kill -USR1 $$"));
  EXPECT_EQ(r.status, 128 + SIGUSR1) << describe(r);
  EXPECT_LT(seconds_, kStoppedWithin) << describe(r);
  EXPECT_NE(r.err.find("moefq launch: rank 1 was killed by signal SIGUSR1; sending SIGTERM to the 2 ranks"),
            std::string::npos)
      << describe(r);
  for (long pid : recorded_pids(3, 1)) EXPECT_TRUE(process_ends(pid)) << "sleep " << pid << " still runs";
}

TEST_F(LaunchCli, RanksIgnoringSigtermAreKilledAfterTheGrace) {
  // The ignored SIGTERM is inherited by the sleeps: only SIGKILL ends them.
  const RunResult r = launch_sh("-n 3 --grace 1 " + kSafetyTimeout, stop_script(3, 0, "exit 5", "trap '' TERM"));
  EXPECT_EQ(r.status, 5) << describe(r);
  EXPECT_LT(seconds_, kStoppedWithin) << describe(r);
  EXPECT_NE(r.err.find("rank 0 exited with code 5; sending SIGTERM to the 2 ranks still running, SIGKILL after 1 s"),
            std::string::npos)
      << describe(r);
  EXPECT_NE(r.err.find("moefq launch: 2 ranks still running after --grace 1 s; sending SIGKILL"), std::string::npos)
      << describe(r);
  for (long pid : recorded_pids(3, 0)) EXPECT_TRUE(process_ends(pid)) << "sleep " << pid << " still runs";
}

TEST_F(LaunchCli, TimeoutStopsAHangingJob) {
  const RunResult r = launch_sh("-n 2 --timeout 1", "echo started; sleep 60");
  EXPECT_EQ(r.status, 124) << describe(r);
  EXPECT_GE(seconds_, 1.0);
  EXPECT_LT(seconds_, kStoppedWithin) << describe(r);
  EXPECT_NE(r.err.find("moefq launch: timeout: the job ran longer than --timeout 1 s; sending SIGTERM to the 2 ranks"),
            std::string::npos)
      << describe(r);
  std::vector<std::string> out = split_lines(r.out);
  std::sort(out.begin(), out.end());
  EXPECT_EQ(out, (std::vector<std::string>{"[rank 0] started", "[rank 1] started"}));
}

TEST_F(LaunchCli, SignalsToTheLauncherAreForwarded) {
  for (const std::string sig : {"INT", "TERM"}) {
    SCOPED_TRACE("SIG" + sig);
    fs::remove_all(work_);
    fs::create_directories(work_ / "pids");
    // A shell runs background jobs with SIGINT ignored, which the launcher would respect: env
    // restores the default. The ranks trap the signal and say so; the shell sends it once both
    // trap it. Their `sleep 60 &` ignores SIGINT too: it outlives its rank, and the launcher must
    // kill it after the grace.
    const std::string rank_script = "trap 'echo \"rank $RANK got " + sig + "\"; exit 7' " + sig +
                                    "; sleep 60 & echo $! > pids/$RANK; touch ready_$RANK; wait";
    const std::string script =
        "env --default-signal=INT " +
        launch_command("-n 2 --grace 1 " + kSafetyTimeout + " -- sh -c " + quote(rank_script)) + " & pid=$!\n" +
        "for r in 0 1; do i=0; while [ ! -f ready_$r ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; done\n" +
        "kill -" + sig + " $pid; wait $pid\n";
    const Clock::time_point start = Clock::now();
    const RunResult r = run_in_work("sh -c " + quote(script));
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    const int signo = sig == "INT" ? SIGINT : SIGTERM;
    EXPECT_EQ(r.status, 128 + signo) << describe(r);
    EXPECT_LT(seconds, kStoppedWithin) << describe(r);
    EXPECT_NE(r.err.find("moefq launch: got SIG" + sig + "; sending SIG" + sig + " to the 2 ranks still running"),
              std::string::npos)
        << describe(r);
    const bool killed = r.err.find("moefq launch: processes started by the ranks still running after --grace 1 s; "
                                   "sending SIGKILL") != std::string::npos;
    EXPECT_EQ(killed, sig == "INT") << describe(r);
    std::vector<std::string> out = split_lines(r.out);
    std::sort(out.begin(), out.end());
    EXPECT_EQ(out, (std::vector<std::string>{"[rank 0] rank 0 got " + sig, "[rank 1] rank 1 got " + sig}))
        << describe(r);
    for (long pid : recorded_pids(2, -1)) EXPECT_TRUE(process_ends(pid)) << "sleep " << pid << " still runs";
    EXPECT_TRUE(tmp_entries().empty());
  }
}

TEST_F(LaunchCli, ClosedStdoutStopsTheJob) {
  // As a program writing to a closed pipe gets SIGPIPE: without it the ranks would run forever.
  const std::string launcher = launch_command("-n 2 " + kSafetyTimeout + " -- sh -c " + quote("yes \"rank $RANK\""));
  const std::string script = "{ " + launcher + "; echo $? > status; } | head -n 3";
  const Clock::time_point start = Clock::now();
  const RunResult r = run_in_work("sh -c " + quote(script));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(r.status, 0) << describe(r);
  EXPECT_EQ(read_text(path("status")), std::to_string(128 + SIGPIPE) + "\n") << describe(r);
  EXPECT_LT(seconds, kStoppedWithin);
  EXPECT_NE(r.err.find("moefq launch: cannot write to stdout: Broken pipe; sending SIGTERM"), std::string::npos)
      << describe(r);
  const std::vector<std::string> out = split_lines(r.out);
  ASSERT_EQ(out.size(), 3u) << describe(r);
  for (const std::string& line : out) {
    const auto p = split_prefix(line);
    ASSERT_TRUE(p.has_value()) << line;
    EXPECT_EQ(p->second, "rank " + std::to_string(p->first));
  }
}

// ------------------------------------------------------------------------------------------------
// Bad input: exit status 2, a message naming the problem, no rank runs, nothing left behind.

TEST_F(LaunchCli, ProgramThatCannotRun) {
  std::ofstream(path("not_executable")) << "#!/bin/sh\necho ran\n";
  ::chmod(path("not_executable").c_str(), 0644);
  fs::create_directories(path("a_directory"));
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"no_such_program_for_moefq_launch",
       "cannot execute 'no_such_program_for_moefq_launch': No such file or directory (not found in PATH)"},
      {"/no/such/dir/program", "cannot execute '/no/such/dir/program': No such file or directory\n"},
      {"./not_executable", "cannot execute './not_executable': Permission denied"},
      {"./a_directory", "cannot execute './a_directory': Permission denied"},
  };
  for (const auto& [program, message] : cases) {
    const RunResult r = launch("-n 4 -- " + program + " arg");
    EXPECT_EQ(r.status, 2) << program << "\n" << describe(r);
    EXPECT_NE(r.err.find(message), std::string::npos) << program << "\n" << describe(r);
    EXPECT_EQ(r.out, "") << program;
    EXPECT_LT(seconds_, kStoppedWithin) << program;
    EXPECT_TRUE(tmp_entries().empty()) << program;
  }
}

TEST_F(LaunchCli, BadArguments) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"-n 0 -- touch ran", "-n must be 1 to 1024 ranks, got 0"},
      {"-n -1 -- touch ran", "-n must be 1 to 1024 ranks, got -1"},
      {"-n 1025 -- touch ran", "-n must be 1 to 1024 ranks, got 1025"},
      {"-n abc -- touch ran", "num-ranks"},
      {"-- touch ran", "num-ranks"},
      {"-n 2", "missing the program to run"},
      {"-n 2 --", "missing the program to run"},
      {"-n 2 -- ''", "missing the program to run"},
      {"-n 2 --timeout 0 -- touch ran", "--timeout must be a number of seconds > 0"},
      {"-n 2 --timeout -1 -- touch ran", "--timeout must be a number of seconds > 0"},
      {"-n 2 --timeout 1e300 -- touch ran", "--timeout must be a number of seconds > 0"},
      {"-n 2 --timeout abc -- touch ran", "timeout"},
      {"-n 2 --grace -1 -- touch ran", "--grace must be a number of seconds >= 0"},
      {"-n 2 --grace nan -- touch ran", "grace"},
  };
  for (const auto& [args, message] : cases) {
    const RunResult r = launch(args);
    EXPECT_EQ(r.status, 2) << args << "\n" << describe(r);
    EXPECT_NE(r.err.find(message), std::string::npos) << args << "\n" << describe(r);
    EXPECT_EQ(r.out, "") << args;
    EXPECT_FALSE(fs::exists(path("ran"))) << args << ": a rank ran";
    EXPECT_TRUE(tmp_entries().empty()) << args;
  }
}

TEST_F(LaunchCli, HelpHasAnExample) {
  const RunResult r = run_in_work(test::moefq_command("launch --help"));
  EXPECT_EQ(r.status, 0) << describe(r);
  for (const char* text : {"-n,--num-ranks", "--timeout", "--grace", "Examples:", "moefq launch -n 4 -- sh -c"})
    EXPECT_NE(r.out.find(text), std::string::npos) << text << "\n" << r.out;
  const RunResult top = run_in_work(test::moefq_command("--help"));
  EXPECT_NE(top.out.find("\n  launch "), std::string::npos) << top.out;
}

// ------------------------------------------------------------------------------------------------
// The rendezvous between ranks (launch_test_rank).

TEST_F(LaunchCli, RendezvousAcrossFourRanks) {
  const RunResult r = launch("-n 4 " + kSafetyTimeout + " -- " + quote(LAUNCH_TEST_RANK) + " rendezvous nccl_id 30000");
  ASSERT_EQ(r.status, 0) << describe(r);
  std::map<int, std::vector<std::string>> by_rank;
  for (const std::string& line : split_lines(r.out)) {
    const auto p = split_prefix(line);
    ASSERT_TRUE(p.has_value()) << line;
    by_rank[p->first].push_back(p->second);
  }
  ASSERT_EQ(by_rank.size(), 4u) << describe(r);
  ASSERT_EQ(by_rank[0].size(), 2u) << describe(r);
  const std::string published = by_rank[0][1];
  ASSERT_EQ(published.rfind("published ", 0), 0u) << published;
  const std::string blob = published.substr(10);
  // 128 bytes: rank 0's pid, then 00 ff 0a.
  ASSERT_EQ(blob.size(), 256u);
  EXPECT_EQ(blob.substr(8, 6), "00ff0a");
  EXPECT_NE(blob.substr(0, 8), "00000000");
  for (int rank = 0; rank < 4; ++rank) {
    const std::string k = std::to_string(rank);
    EXPECT_EQ(by_rank[rank], (std::vector<std::string>{"rank " + k + " of 4 local " + k + " of 4",
                                                       (rank == 0 ? "published " : "fetched ") + blob}))
        << describe(r);
  }
  EXPECT_TRUE(tmp_entries().empty());
}

TEST_F(LaunchCli, RendezvousFetchTimesOut) {
  const RunResult r = launch("-n 2 " + kSafetyTimeout + " -- " + quote(LAUNCH_TEST_RANK) + " fetch nccl_id 300");
  EXPECT_EQ(r.status, 1) << describe(r);
  EXPECT_LT(seconds_, kStoppedWithin) << describe(r);
  EXPECT_NE(r.err.find("] error: rendezvous: no rank published 'nccl_id' in " + tmp().string()), std::string::npos)
      << describe(r);
  EXPECT_NE(r.err.find("within 300 ms"), std::string::npos) << describe(r);
  EXPECT_NE(r.err.find("exited with code 1"), std::string::npos) << describe(r);
  EXPECT_TRUE(tmp_entries().empty());
}

// ------------------------------------------------------------------------------------------------
// rank_env(), in this process.

constexpr const char* kRankVariables[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MOEFQ_RENDEZVOUS"};

// Each test starts with none of the variables set; their values are restored at the end.
class RankEnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : kRankVariables) {
      const char* v = std::getenv(name);
      saved_.emplace_back(name, v ? std::optional<std::string>(v) : std::nullopt);
      ::unsetenv(name);
    }
  }
  void TearDown() override {
    for (const auto& [name, value] : saved_) {
      if (value) ::setenv(name.c_str(), value->c_str(), 1);
      else ::unsetenv(name.c_str());
    }
  }
  // Sets exactly the given variables (of kRankVariables).
  static void set(const std::map<std::string, std::string>& vars) {
    for (const char* name : kRankVariables) ::unsetenv(name);
    for (const auto& [name, value] : vars) ::setenv(name.c_str(), value.c_str(), 1);
  }

  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

void expect_ranks(const RankEnv& env, int rank, int world_size, int local_rank, int local_world_size) {
  EXPECT_EQ(env.rank, rank);
  EXPECT_EQ(env.world_size, world_size);
  EXPECT_EQ(env.local_rank, local_rank);
  EXPECT_EQ(env.local_world_size, local_world_size);
}

TEST_F(RankEnvTest, NoVariablesIsRankZeroOfOne) {
  const RankEnv env = rank_env();
  expect_ranks(env, 0, 1, 0, 1);
  EXPECT_EQ(env.rendezvous, "");
}

TEST_F(RankEnvTest, AllFourVariables) {
  set({{"RANK", "5"}, {"WORLD_SIZE", "16"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "8"},
       {"MOEFQ_RENDEZVOUS", "/tmp/x"}});
  const RankEnv env = rank_env();
  expect_ranks(env, 5, 16, 1, 8);
  EXPECT_EQ(env.rendezvous, "/tmp/x");
}

TEST_F(RankEnvTest, WithoutLocalVariablesOneHost) {
  set({{"RANK", "3"}, {"WORLD_SIZE", "4"}});
  expect_ranks(rank_env(), 3, 4, 3, 4);
}

TEST_F(RankEnvTest, MalformedOrInconsistentValues) {
  const std::vector<std::pair<std::map<std::string, std::string>, std::string>> cases = {
      {{{"RANK", "abc"}, {"WORLD_SIZE", "4"}}, "RANK='abc': expected a decimal integer >= 0"},
      {{{"RANK", ""}, {"WORLD_SIZE", "4"}}, "RANK='': expected a decimal integer >= 0"},
      {{{"RANK", " 1"}, {"WORLD_SIZE", "4"}}, "RANK=' 1'"},
      {{{"RANK", "1x"}, {"WORLD_SIZE", "4"}}, "RANK='1x'"},
      {{{"RANK", "+1"}, {"WORLD_SIZE", "4"}}, "RANK='+1'"},
      {{{"RANK", "-1"}, {"WORLD_SIZE", "4"}}, "RANK='-1'"},
      {{{"RANK", "1.0"}, {"WORLD_SIZE", "4"}}, "RANK='1.0'"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "99999999999"}}, "WORLD_SIZE='99999999999': expected a decimal integer >= 1"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE='0': expected a decimal integer >= 1"},
      {{{"RANK", "4"}, {"WORLD_SIZE", "4"}}, "RANK=4 must be less than WORLD_SIZE=4"},
      {{{"RANK", "0"}}, "RANK is set but WORLD_SIZE is not"},
      {{{"WORLD_SIZE", "2"}}, "WORLD_SIZE is set but RANK is not"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}, "LOCAL_RANK is set but LOCAL_WORLD_SIZE is not"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
       "LOCAL_WORLD_SIZE is set but LOCAL_RANK is not"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "x"}, {"LOCAL_WORLD_SIZE", "2"}}, "LOCAL_RANK='x'"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
       "LOCAL_RANK=2 must be less than LOCAL_WORLD_SIZE=2"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "4"}},
       "LOCAL_WORLD_SIZE=4 must not exceed WORLD_SIZE=2"},
      {{{"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "1"}}, "RANK and WORLD_SIZE are not; set all four"},
  };
  for (const auto& [vars, message] : cases) {
    set(vars);
    std::string what;
    for (const auto& [k, v] : vars) what += k + "='" + v + "' ";
    const std::string err = test::error_of([] { rank_env(); });
    EXPECT_NE(err.find(message), std::string::npos) << what << "\ngot: " << err;
  }
}

// ------------------------------------------------------------------------------------------------
// The file rendezvous, in this process.

class RendezvousTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::unique_temp_path("moefq_rendezvous_");
    fs::create_directories(dir_);
    env_.world_size = 2;
    env_.local_world_size = 2;
    env_.rendezvous = dir_.string();
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  // 128 bytes that include 0x00, 0xff and '\n' and depend on seed.
  static std::vector<uint8_t> blob(int seed) {
    std::vector<uint8_t> b(128);
    for (size_t i = 0; i < b.size(); ++i) b[i] = uint8_t(i * 37 + size_t(seed));
    b[1] = 0x00;
    b[2] = 0xff;
    b[3] = '\n';
    return b;
  }

  fs::path dir_;
  RankEnv env_;
};

TEST_F(RendezvousTest, PublishThenFetch) {
  rendezvous_publish(env_, "nccl_id", blob(1));
  EXPECT_TRUE(test::bytes_equal(blob(1), rendezvous_fetch(env_, "nccl_id", std::chrono::milliseconds(0))));
  // The blob is the file of that name, and no temporary file is left.
  EXPECT_TRUE(test::bytes_equal(blob(1), test::read_bytes(dir_ / "nccl_id")));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{"nccl_id"});
  // Publishing again replaces it; an empty blob is a blob.
  rendezvous_publish(env_, "nccl_id", blob(2));
  EXPECT_TRUE(test::bytes_equal(blob(2), rendezvous_fetch(env_, "nccl_id", std::chrono::milliseconds(0))));
  rendezvous_publish(env_, "empty", {});
  EXPECT_TRUE(rendezvous_fetch(env_, "empty", std::chrono::milliseconds(0)).empty());
}

TEST_F(RendezvousTest, FetchWaitsForALaterPublish) {
  std::thread publisher([this] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    rendezvous_publish(env_, "late-key.1", blob(3));
  });
  const Clock::time_point start = Clock::now();
  const std::vector<uint8_t> got = rendezvous_fetch(env_, "late-key.1", std::chrono::milliseconds::max());
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  publisher.join();
  EXPECT_TRUE(test::bytes_equal(blob(3), got));
  EXPECT_GE(seconds, 0.25);
}

TEST_F(RendezvousTest, FetchTimesOutNamingTheKey) {
  const Clock::time_point start = Clock::now();
  try {
    rendezvous_fetch(env_, "nccl_id", std::chrono::milliseconds(250));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kFailedCheck);
    const std::string what = e.what();
    EXPECT_NE(what.find("no rank published 'nccl_id' in " + dir_.string() + " within 250 ms"), std::string::npos)
        << what;
  }
  EXPECT_GE(std::chrono::duration<double>(Clock::now() - start).count(), 0.25);
}

TEST_F(RendezvousTest, BadKeysAndDirectories) {
  for (const std::string key : {"", ".hidden", "a/b", "../x", "a b", "key\n"}) {
    EXPECT_NE(test::error_of([&] { rendezvous_publish(env_, key, blob(1)); }).find("invalid key"), std::string::npos)
        << "'" << key << "'";
    EXPECT_NE(test::error_of([&] { rendezvous_fetch(env_, key, std::chrono::milliseconds(0)); }).find("invalid key"),
              std::string::npos)
        << "'" << key << "'";
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 0) << "a bad key wrote a file";

  RankEnv gone = env_;
  gone.rendezvous = (dir_ / "no_such_dir").string();
  EXPECT_NE(test::error_of([&] { rendezvous_publish(gone, "k", blob(1)); }).find("'" + gone.rendezvous + "'"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { rendezvous_fetch(gone, "k", std::chrono::milliseconds(0)); }).find("does not exist"),
            std::string::npos);

  // Several ranks need a directory they all see.
  RankEnv no_dir = env_;
  no_dir.rendezvous.clear();
  EXPECT_NE(test::error_of([&] { rendezvous_publish(no_dir, "k", blob(1)); }).find("MOEFQ_RENDEZVOUS is not set"),
            std::string::npos);
}

TEST_F(RendezvousTest, SingleRankWithoutDirectoryKeepsTheBlobInProcess) {
  const RankEnv single;  // rank 0 of 1, no directory: as with no variables set
  rendezvous_publish(single, "single_rank_key", blob(4));
  EXPECT_TRUE(test::bytes_equal(blob(4), rendezvous_fetch(single, "single_rank_key", std::chrono::milliseconds(0))));
  try {
    rendezvous_fetch(single, "never_published", std::chrono::milliseconds(50));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'never_published' in this process within 50 ms"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace moefq
