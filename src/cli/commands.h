// Subcommands of the moefq tool.
#pragma once

namespace moefq::cli {
// Parses argv and runs the chosen subcommand; returns the exit status.
int run(int argc, char** argv);
}  // namespace moefq::cli
