// moefq launch: start N processes of a program, one per rank, and supervise them
// (src/dist/launcher.h does the work).
#include <CLI/CLI.hpp>

#include <memory>

#include "cli/commands.h"
#include "dist/launcher.h"

namespace moefq::cli {

std::function<int()> add_launch_command(CLI::App& app) {
  auto opts = std::make_shared<dist::LaunchOptions>();
  auto timeout_s = std::make_shared<double>(0);
  CLI::App* sub = app.add_subcommand(
      "launch", "Start N processes of a program on this host, one per rank (GPU), with the torchrun environment "
                "(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) and a private rendezvous directory "
                "(MOEFQ_RENDEZVOUS); forward their output line by line with a [rank r] prefix; stop them all when "
                "one fails.");
  sub->add_option("-n,--num-ranks", opts->num_ranks, "processes to start, 1 to 1024")->required();
  CLI::Option* timeout = sub->add_option("--timeout", *timeout_s, "stop the whole job after this many seconds "
                                                                  "(default: no limit); exit status 124");
  sub->add_option("--grace", opts->grace_s, "seconds from SIGTERM to SIGKILL when the job is stopped (default 5)");
  sub->add_option("command", opts->command, "PROGRAM ARGS..., after --; PROGRAM is looked up in PATH");
  sub->footer(
      "Examples:\n"
      "  moefq launch -n 4 -- sh -c 'echo rank $RANK of $WORLD_SIZE'\n"
      "  moefq launch -n 8 --timeout 600 -- ./my_rank_program --layers 3\n"
      "When a rank exits non-zero or is killed, the others get SIGTERM, then SIGKILL after --grace seconds.\n"
      "SIGINT and SIGTERM to the launcher are forwarded to the ranks. See docs/launch.md.\n"
      "Exit status: 0 when every rank exits 0; else the first failing rank's exit code (128 + signal number "
      "when a signal killed it); 124 after --timeout; 128 + signal number when interrupted; 2 bad input.");
  return [sub, opts, timeout, timeout_s] {
    if (!sub->parsed()) return 0;
    if (timeout->count() > 0) opts->timeout_s = *timeout_s;
    return dist::launch(*opts);
  };
}

}  // namespace moefq::cli
