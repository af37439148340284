// moefq command-line entry: dispatches subcommands, maps errors to exit codes
// (0 success, 1 a failed check, 2 bad input, 3 a bug) and removes temporary files on the
// terminating signals; SIGPIPE and SIGXFSZ end nothing (docs/cli.md).
#include <cstdio>
#include <exception>
#include <filesystem>
#include <new>
#include <string>

#include "cli/commands.h"
#include "moefq/errors.h"
#include "moefq/fileio.h"

namespace {

// The subcommand named on the command line, for messages ("moefq" when there is none).
std::string command_of(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (argv[i][0] != '-') return std::string("moefq ") + argv[i];
  return "moefq";
}

}  // namespace

int main(int argc, char** argv) {
  moefq::install_cleanup_signal_handlers();
  try {
    return moefq::cli::run(argc, argv);
  } catch (const moefq::Error& e) {
    if (e.kind() == moefq::ErrorKind::kInternal) {
      std::fprintf(stderr, "moefq: internal error: %s\n", moefq::terminal_safe(e.what(), true).c_str());
      return 3;
    }
    // Messages quote names from files and arguments: printed, they must not drive the terminal.
    std::fprintf(stderr, "moefq: error: %s\n", moefq::terminal_safe(e.what(), true).c_str());
    return e.kind() == moefq::ErrorKind::kFailedCheck ? 1 : 2;
  } catch (const std::filesystem::filesystem_error& e) {
    // A path the user gave that the system refuses (a symbolic link loop, a name too long, no
    // permission): bad input naming the path, not a bug.
    std::fprintf(stderr, "moefq: error: %s\n",
                 moefq::terminal_safe(moefq::filesystem_error_message(e)).c_str());
    return 2;
  } catch (const std::bad_alloc&) {
    // A size the command accepted but this machine cannot hold: bad input for this machine, not a bug.
    std::fprintf(stderr,
                 "moefq: error: %s ran out of memory (an allocation failed); nothing was written. Try smaller "
                 "sizes (fewer --tokens, --ranks, layers or tensors, a smaller model) or a machine with more "
                 "memory.\n",
                 command_of(argc, argv).c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moefq: internal error: %s\n", moefq::terminal_safe(e.what(), true).c_str());
    return 3;
  }
}
