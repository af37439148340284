// moefq command-line entry: dispatches subcommands, maps errors to exit codes
// (0 success, 1 a failed check, 2 bad input).
#include <cstdio>
#include <exception>

#include "cli/commands.h"
#include "moefq/errors.h"

int main(int argc, char** argv) {
  try {
    return moefq::cli::run(argc, argv);
  } catch (const moefq::Error& e) {
    std::fprintf(stderr, "moefq: error: %s\n", e.what());
    return e.kind() == moefq::ErrorKind::kFailedCheck ? 1 : 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moefq: internal error: %s\n", e.what());
    return 3;
  }
}
