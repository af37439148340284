#include "cli/commands.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

#include "moefq/errors.h"
#include "moefq/fileio.h"

namespace moefq::cli {

std::string elapsed_and_eta(std::chrono::steady_clock::time_point start, double done, double total) {
  if (!(done > 0)) return "";
  const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  char buf[64];
  std::snprintf(buf, sizeof buf, " (%.1f s, eta %.0f s)", el, el / done * std::max(0.0, total - done));
  return buf;
}

namespace {

// The name CLI validators with their own form check carry: strict_numbers leaves them alone.
constexpr const char* kStrict = "strict";

size_t digits_at(const std::string& t, size_t& i) {
  const size_t from = i;
  while (i < t.size() && t[i] >= '0' && t[i] <= '9') ++i;
  return i - from;
}

}  // namespace

std::string integer_error(const std::string& text) {
  size_t i = text.empty() || text[0] != '-' ? 0 : 1;
  if (digits_at(text, i) == 0 || i != text.size()) return "expected an integer, got '" + text + "'";
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size())
    return "'" + text + "' is out of the integer range [-2^63, 2^63 - 1]";
  return {};
}

std::string decimal_error(const std::string& text) {
  size_t i = text.empty() || text[0] != '-' ? 0 : 1;
  size_t digits = digits_at(text, i);
  if (i < text.size() && text[i] == '.') {
    ++i;
    digits += digits_at(text, i);
  }
  bool ok = digits > 0;
  if (ok && i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    ++i;
    if (i < text.size() && (text[i] == '+' || text[i] == '-')) ++i;
    ok = digits_at(text, i) > 0;
  }
  if (!ok || i != text.size()) return "expected a decimal number (such as 0.05 or 5e-2), got '" + text + "'";
  if (!std::isfinite(decimal_value(text))) return "'" + text + "' is beyond the range of a double";
  return {};
}

double decimal_value(const std::string& text) { return std::strtod(text.c_str(), nullptr); }

const CLI::Validator& seed_range() {
  static const CLI::Validator v(
      [](const std::string& text) -> std::string {
        const bool ok = integer_error(text).empty() && text[0] != '-';
        if (ok) return {};
        return "expected a whole number from 0 to " + std::to_string(std::numeric_limits<int64_t>::max()) +
               ", got '" + text + "'";
      },
      "INT in [0, 2^63-1]", kStrict);
  return v;
}

const CLI::Validator& positive_number() {
  static const CLI::Validator v(
      [](const std::string& text) -> std::string {
        if (decimal_error(text).empty() && decimal_value(text) > 0) return {};
        return "must be a finite number > 0, got '" + text + "'";
      },
      "NUMBER > 0", kStrict);
  return v;
}

void strict_numbers(CLI::App& app) {
  for (CLI::Option* opt : app.get_options()) {
    if (opt->get_type_size() == 0) continue;  // a flag
    try {
      (void)opt->get_validator(kStrict);
      continue;  // its own check covers the form
    } catch (const CLI::OptionNotFound&) {
    }
    const std::string full = opt->get_type_name(), type = full.substr(0, full.find(':'));
    if (type == "INT" || type == "UINT")
      opt->transform(CLI::Validator([](std::string& text) { return integer_error(text); }, ""));
    else if (type == "FLOAT")
      opt->transform(CLI::Validator([](std::string& text) { return decimal_error(text); }, ""));
  }
  for (CLI::App* sub : app.get_subcommands({})) strict_numbers(*sub);
}

void check_command_name(const CLI::App& app, int argc, char** argv) {
  // The top level takes flags only (--help, --version), so the first word that is not one names
  // the command.
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    if (!word.empty() && word[0] == '-') continue;
    std::string names, meant;
    for (const CLI::App* sub : app.get_subcommands({})) {
      const std::string& name = sub->get_name();
      if (name == word) return;
      names += (names.empty() ? "" : ", ") + name;
      bool same = name.size() == word.size();
      for (size_t k = 0; same && k < name.size(); ++k)
        same = std::tolower(static_cast<unsigned char>(word[k])) == name[k];
      if (same) meant = name;
    }
    MOEFQ_FAIL(ErrorKind::kBadInput, "unknown command '", word, "'", meant.empty() ? "" : " (did you mean '" + meant + "'?)",
               "; the commands are ", names, " (moefq --help)");
  }
}

int run(int argc, char** argv) {
  CLI::App app{"moefq: simulate quantized expert-parallel MoE communication (dispatch/combine "
               "fake quantization) and measure its accuracy cost."};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("moefq ") + MOEFQ_VERSION);
  app.footer("Run 'moefq COMMAND --help' for a command's options and an example.");
  // The main job first: `moefq --help` lists the subcommands in this order.
  std::vector<std::function<int()>> actions = {add_eval_command(app), add_calibrate_command(app), add_qdq_command(app),
                                               add_bench_command(app), add_launch_command(app)};
  strict_numbers(app);
  check_command_name(app, argc, argv);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "moefq: error: %s\n", terminal_safe(e.what(), true).c_str());
    std::fprintf(stderr, "Run 'moefq --help' or 'moefq COMMAND --help' for usage.\n");
    return 2;
  }
  for (size_t i = 0; i < app.get_subcommands({}).size(); ++i)
    if (app.get_subcommands({})[i]->parsed()) return actions[i]();
  return 2;
}

}  // namespace moefq::cli
