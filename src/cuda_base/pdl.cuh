// Programmatic dependent launch (sm_90) for chains of kernels on one stream.
//
// A kernel launched with `pdl` may start while the stream's previous kernel still runs: its CTAs
// are scheduled once every CTA of that kernel has called pdl_enter() or exited, so its launch and
// its set-up (shared memory, barriers) overlap the previous kernel's last CTAs. pdl_enter() first
// waits until the previous kernel has completed and its writes are visible, and only then lets the
// next kernel start. Before pdl_enter() a kernel may therefore touch only its parameters and its
// shared memory. Every thread of a CTA calls it, at the same point.
//
// Every kernel launched with `pdl` must call pdl_enter() (nothing else makes it wait for the
// previous kernel), and the attribute is set only where the stream's previous operation is a
// kernel. The previous kernel need not call pdl_enter(): one that does not lets the next start
// when its last CTA exits. A kernel launched without `pdl` waits for the previous one to
// complete, as usual; calling pdl_enter() costs it nothing.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "cuda_base/cuda_check.h"

namespace moefq::cuda {

__device__ __forceinline__ void pdl_enter() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// On unless the environment sets MOEFQ_PDL=0 (every kernel then waits for the previous one);
// read at every launch, which costs far less than the launch.
inline bool pdl_enabled() {
  const char* v = std::getenv("MOEFQ_PDL");
  return !(v && std::strcmp(v, "0") == 0);
}

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent when pdl is true.
template <typename... Params, typename... Args>
void launch_chained(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                    Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = pdl ? 1 : 0;
  MOEFQ_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace moefq::cuda
