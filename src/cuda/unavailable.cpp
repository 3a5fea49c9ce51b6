// Builds without a CUDA compiler: the cuBLAS lane is listed as unavailable, and the device
// operations of the tensor-parallel layer say why they cannot run.
#include "cuda/unavailable.hpp"

#include <utility>

#include "core/device_ops.hpp"

namespace detlogp::detail {

const Backend& cublas_materialized_backend() {
  static const CublasUnavailable backend(kNoCudaReason);
  return backend;
}

DeviceAllocation::DeviceAllocation(size_t, int, const char* what) {
  DETLOGP_FAIL("cannot allocate device memory for " << what << ": " << kNoCudaReason);
}
DeviceAllocation::~DeviceAllocation() = default;
DeviceAllocation& DeviceAllocation::operator=(DeviceAllocation&& o) noexcept {
  std::swap(ptr_, o.ptr_);
  std::swap(device_, o.device_);
  return *this;
}
void device_copy_async(void*, const void*, size_t, int, void*) {
  DETLOGP_FAIL("CUDA copy unavailable: " << kNoCudaReason);
}
void device_stream_sync(int, void*) { DETLOGP_FAIL("CUDA stream unavailable: " << kNoCudaReason); }
void drain_deferred_device_errors() {}  // no CUDA call was made, so none is outstanding

}  // namespace detlogp::detail
