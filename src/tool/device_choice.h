// The device a command-line run uses, shared by the moefq tool's commands (src/cli) and its
// benchmark programs (bench/), below both: the choice auto, cpu or cuda, and the name the reports
// and benchmark JSON give the CPU.
#pragma once

#include <string>

namespace moefq::tool {

// Device selection shared by commands: "auto" (cuda when a GPU is visible), "cpu" or "cuda".
// Returns true for cuda; throws a bad-input error for an unknown name or cuda without a GPU.
bool use_cuda(const std::string& device);
// "cpu (8 threads)": the CPU device as the reports and benchmark JSON name it; num_threads 0 means
// every hardware thread.
std::string cpu_device_name(int num_threads);

}  // namespace moefq::tool
