// Builds without a CUDA compiler: the SM90 backend exists and reports why it cannot run.
#include <string>
#include <utility>
#include <vector>

#include "core/backend.hpp"
#include "core/device_ops.hpp"
#include "cuda/cublas_unavailable.hpp"
#include "detlogp/config.hpp"
#include "detlogp/error.hpp"

namespace detlogp::detail {
namespace {

constexpr const char* kReason =
    "this build of detlogp has no CUDA support (no CUDA compiler was found at configure time, or "
    "DETLOGP_ENABLE_CUDA=OFF); rebuild with nvcc >= 12.3 available to get the SM90 backend";

class Sm90Unavailable final : public Backend {
 public:
  Sm90Unavailable() { prov_ = contract_provenance("cuda-fused-linear-logp-sm90-contract-v1", "sm90a", 0); }
  const Provenance& provenance() const override { return prov_; }
  bool contract_bearing() const override { return true; }
  Memory memory() const override { return Memory::cuda; }
  bool available(std::string* why) const override {
    if (why != nullptr) *why = kReason;
    return false;
  }
  void run(const LogpProblem&) const override { DETLOGP_FAIL("SM90 backend unavailable: " << kReason); }
  void run_from_host(const LogpProblem&) const override { DETLOGP_FAIL("SM90 backend unavailable: " << kReason); }

 private:
  Provenance prov_;
};

}  // namespace

const Backend& cublas_materialized_backend() {
  static const CublasUnavailable backend(kReason);
  return backend;
}

void device_merge(const std::vector<DeviceMergeRank>&, int64_t, const void*, bool, int64_t, float*, float*, int,
                  void*) {
  DETLOGP_FAIL("CUDA-memory merge unavailable: " << kReason);
}
DeviceAllocation::DeviceAllocation(size_t, int, const char* what) {
  DETLOGP_FAIL("cannot allocate device memory for " << what << ": " << kReason);
}
DeviceAllocation::~DeviceAllocation() = default;
DeviceAllocation& DeviceAllocation::operator=(DeviceAllocation&& o) noexcept {
  std::swap(ptr_, o.ptr_);
  std::swap(device_, o.device_);
  return *this;
}
void device_copy_async(void*, const void*, size_t, int, void*) { DETLOGP_FAIL("CUDA copy unavailable: " << kReason); }
void device_stream_sync(int, void*) { DETLOGP_FAIL("CUDA stream unavailable: " << kReason); }

const Backend& sm90_contract_backend() {
  static const Sm90Unavailable backend;
  return backend;
}

}  // namespace detlogp::detail
