// Subcommands of the moefq tool. Each registers itself on the CLI11 app and runs when chosen;
// errors are thrown as moefq::Error and mapped to exit codes by main().
#pragma once

#include <functional>
#include <string>

namespace CLI {
class App;
class Validator;
}

namespace moefq::cli {

// Parses argv and runs the chosen subcommand; returns the exit status.
int run(int argc, char** argv);

// Each returns the action to run when its subcommand was chosen.
std::function<int()> add_eval_command(CLI::App& app);
std::function<int()> add_calibrate_command(CLI::App& app);
std::function<int()> add_qdq_command(CLI::App& app);
std::function<int()> add_bench_command(CLI::App& app);
std::function<int()> add_launch_command(CLI::App& app);

// Device selection shared by commands: "auto" (cuda when a GPU is visible), "cpu" or "cuda".
// Returns true for cuda; throws a bad-input error for an unknown name or cuda without a GPU.
bool use_cuda(const std::string& device);

// --seed's check: a decimal integer in [0, 2^63 - 1] (no sign, exponent or spaces), with that range
// in the message.
const CLI::Validator& seed_range();

}  // namespace moefq::cli
