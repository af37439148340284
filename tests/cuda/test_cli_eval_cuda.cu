// The moefq binary on a machine with a GPU: `eval --device cpu` that the host cannot hold is
// refused with the advice to use --device cuda exactly where the GPU would hold the run (the CLI
// registers the GPU memory query for CPU runs too, and asks it only for a refused run).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cli/moefq_binary.h"
#include "eval/layer_runner.h"
#include "gpu_test.h"
#include "moefq/host_memory.h"
#include "moefq/moe_config.h"

namespace moefq {
namespace {

using test::describe, test::RunResult;

class CliEvalCuda : public test::WorkDirTest {
 protected:
  CliEvalCuda() : WorkDirTest("moefq_cli_eval_cuda_") {}
  // `timeout` bounds a run that the plan did not refuse after all (it would run a huge layer).
  RunResult eval_cpu(int64_t tokens) const {
    return run_in_work("timeout 300 " + test::moefq_command("eval --device cpu --preset deepseek-v3 --ranks 8 --tokens " +
                                                            std::to_string(tokens)));
  }
};

TEST_F(CliEvalCuda, RefusedCpuRunAdvisesTheGpuWhereItFits) {
  SKIP_WITHOUT_GPU();
  register_cuda_layer_runner();  // the real GPU memory query, as the binary registers it
  // The eval's run of deepseek-v3 on 8 ranks with the default 2 + 2 batches: the fewest tokens (in
  // steps of 256) whose CPU plan this host refuses with a 5% margin (host memory freed meanwhile
  // must not let the binary start the run).
  RunnerSetup s;
  s.config = preset("deepseek-v3");
  s.ranks = 8;
  s.calib_batches = s.eval_batches = 2;
  int64_t tokens = 0;
  for (int64_t t = 256; t <= (int64_t(1) << 20) && tokens == 0; t += 256) {
    s.tokens = t;
    const MemoryPlan cpu = plan_run_memory(s, EvalDevice::kCpu);
    if (cpu.host_available > 0 && cpu.host_bytes > 1.05 * kUsableFraction * cpu.host_available) tokens = t;
  }
  ASSERT_GT(tokens, 0) << "no size the host refuses";
  s.tokens = tokens;
  const MemoryPlan gpu = plan_run_memory(s, EvalDevice::kCuda);
  const double host = double(available_host_memory().value_or(0));
  if (!(gpu.device_bytes <= kUsableFraction * gpu.device_available && gpu.host_bytes <= kUsableFraction * host))
    GTEST_SKIP() << "--tokens " << tokens << " needs " << gpu.device_bytes << " bytes of GPU memory, "
                 << gpu.device_available << " free: no size that only the GPU holds on this machine";
  RunResult r = eval_cpu(tokens);
  EXPECT_EQ(r.status, 2) << describe(r);
  EXPECT_NE(r.err.find("moefq eval: needs "), std::string::npos) << describe(r);
  EXPECT_NE(r.err.find("use --device cuda"), std::string::npos) << "--tokens " << tokens << "\n" << describe(r);
  // One the GPU cannot hold either: the plain advice.
  r = eval_cpu(int64_t(1) << 20);
  EXPECT_EQ(r.status, 2) << describe(r);
  EXPECT_NE(r.err.find("use fewer --ranks"), std::string::npos) << describe(r);
  EXPECT_EQ(r.err.find("--device cuda"), std::string::npos) << describe(r);
}

}  // namespace
}  // namespace moefq
