// Subcommands of the moefq tool. Each registers itself on the CLI11 app and runs when chosen;
// errors are thrown as moefq::Error and mapped to exit codes by main().
#pragma once

#include <chrono>
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

// " (12.3 s, eta 40 s)": the seconds since `start` and an estimate of what is left at the rate so
// far, with `done` of `total` units of work done; "" before any work is done.
std::string elapsed_and_eta(std::chrono::steady_clock::time_point start, double done, double total);

// The one parser of numbers on the command line. An integer: decimal digits with an optional
// leading '-', in the int64 range. A decimal number: an optional '-', digits with an optional
// '.', an optional exponent (e or E, an optional sign, digits), finite. Nothing else: no spaces,
// '+', hexadecimal ("0x40", "0x1p-3"), inf or nan. Each returns "" or what is wrong with `text`.
std::string integer_error(const std::string& text);
std::string decimal_error(const std::string& text);
// The value of a text decimal_error accepts.
double decimal_value(const std::string& text);

// --seed's check: a decimal integer in [0, 2^63 - 1] (no sign, exponent or spaces), with that range
// in the message.
const CLI::Validator& seed_range();
// A finite decimal number > 0 (e.g. --max-rel-l2), "must be a finite number > 0, got '...'".
const CLI::Validator& positive_number();

// Makes every numeric option of `app` and its subcommands take only what integer_error or
// decimal_error accept ("expected an integer, got '12abc'") before its own range check; options
// with a check of their own (seed_range, positive_number) keep theirs.
void strict_numbers(CLI::App& app);

// The subcommand argv names, which must be one of `app`'s: "unknown command 'evl'" with the list
// (and the command meant, when only the case differs) instead of CLI11's "A subcommand is required".
void check_command_name(const CLI::App& app, int argc, char** argv);

}  // namespace moefq::cli
