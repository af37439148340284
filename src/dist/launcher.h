// The process launcher behind `moefq launch`: one process per rank on this host with the torchrun
// environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; MASTER_ADDR=127.0.0.1 and a free
// MASTER_PORT unless the caller set them) and MOEFQ_RENDEZVOUS, a private
// directory that exists for the job's lifetime. Output is forwarded line by line with a
// "[rank r] " prefix. When a rank fails, the job times out or the launcher gets SIGINT/SIGTERM,
// every rank is stopped (SIGTERM to its process group, SIGKILL after a grace period); no rank is
// left running when launch() returns or throws. While it runs, launch() owns the process's
// children and signal handling (it reaps any child, and is the subreaper of the ranks' descendants).
// POSIX (Linux) only.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace moefq::dist {

constexpr int kMaxRanks = 1024;
constexpr int kTimeoutExitStatus = 124;  // as timeout(1)

struct LaunchOptions {
  int num_ranks = 1;                 // 1 .. kMaxRanks
  std::vector<std::string> command;  // PROGRAM ARGS...; a PROGRAM without '/' is looked up in PATH
  std::optional<double> timeout_s;   // seconds the whole job may run; none: no limit
  double grace_s = 5;                // seconds from SIGTERM to SIGKILL when the job is stopped
};

// Runs the job to its end and returns the launcher's exit status: 0 when every rank exited 0;
// otherwise the first failing rank's exit code (128 + signal number when a signal killed it),
// kTimeoutExitStatus after the timeout, 128 + signal number after a forwarded SIGINT/SIGTERM.
// Throws moefq::Error (bad input) for invalid options or a program that cannot be executed, after
// stopping the ranks already started.
int launch(const LaunchOptions& options);

}  // namespace moefq::dist
