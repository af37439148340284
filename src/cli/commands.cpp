#include "cli/commands.h"

#include <CLI/CLI.hpp>

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <vector>

#include "moefq/errors.h"
#ifdef MOEFQ_HAS_CUDA
#include "cuda/host_api.h"
#endif

namespace moefq::cli {

bool use_cuda(const std::string& device) {
  MOEFQ_CHECK(device == "auto" || device == "cpu" || device == "cuda", "--device: unknown device '",
              device, "' (expected auto, cpu or cuda)");
  if (device == "cpu") return false;
#ifdef MOEFQ_HAS_CUDA
  const bool gpu = cuda::device_count() > 0;
#else
  const bool gpu = false;
#endif
  MOEFQ_CHECK(gpu || device == "auto", "--device cuda: no CUDA device is visible",
#ifdef MOEFQ_HAS_CUDA
              ""
#else
              " (this moefq was built without CUDA)"
#endif
  );
  return gpu;
}

const CLI::Validator& seed_range() {
  static const CLI::Validator v(
      [](const std::string& text) -> std::string {
        uint64_t value = 0;
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
        const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
        if (digits && ec == std::errc() && end == text.data() + text.size() &&
            value <= uint64_t(std::numeric_limits<int64_t>::max()))
          return {};
        return "expected a whole number from 0 to " + std::to_string(std::numeric_limits<int64_t>::max()) +
               ", got '" + text + "'";
      },
      "INT in [0, 2^63-1]");
  return v;
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
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "moefq: error: %s\n", e.what());
    std::fprintf(stderr, "Run 'moefq --help' or 'moefq COMMAND --help' for usage.\n");
    return 2;
  }
  for (size_t i = 0; i < app.get_subcommands({}).size(); ++i)
    if (app.get_subcommands({})[i]->parsed()) return actions[i]();
  return 2;
}

}  // namespace moefq::cli
