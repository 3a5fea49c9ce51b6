// A row kernel launched as a programmatic dependent of the kernel before it in the stream: its CTAs
// may be scheduled while that kernel finishes, so the launch's latency overlaps it. The kernel calls
// ptx::grid_dependency_wait() before its first read of what the kernels before it wrote (for a plain
// launch that wait returns at once).
#pragma once

#include <cuda_runtime.h>

#include "cuda/check.hpp"

namespace detlogp::sm90 {

// The launch attribute that makes a kernel a programmatic dependent of the one before it.
inline cudaLaunchAttribute programmatic_dependent_attribute() {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return attr;
}

template <class Params>
void launch_dependent(void (*kernel)(Params), int64_t grid, int threads, cudaStream_t stream, const Params& p) {
  DETLOGP_CHECK(grid > 0 && grid < (int64_t{1} << 31), "row kernel grid of " << grid << " CTAs out of range");
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.stream = stream;
  cudaLaunchAttribute attr = programmatic_dependent_attribute();
  config.attrs = &attr;
  config.numAttrs = 1;
  DETLOGP_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
}

}  // namespace detlogp::sm90
