// What a build without CUDA (or without cuBLAS) links instead of the CUDA lanes: the backends exist
// in the registry and say why they cannot run.
#pragma once

#include <string>
#include <utility>

#include "cuda/lane_backend.hpp"
#include "detlogp/error.hpp"

namespace detlogp::detail {

inline constexpr const char* kNoCudaReason =
    "this build of detlogp has no CUDA support (no CUDA compiler was found at configure time, or "
    "DETLOGP_ENABLE_CUDA=OFF); rebuild with nvcc >= 12.3 available to get the SM90 backend";

// The cuda-cublas-materialized lane where it is not built.
class CublasUnavailable final : public CudaLaneBackend {
 public:
  explicit CublasUnavailable(std::string reason) : CudaLaneBackend(cublas_lane_provenance(), false) {
    set_availability(false, std::move(reason));
  }
  bool supports_partials() const override { return false; }
  void run(const LogpProblem&) const override { DETLOGP_FAIL(kCublasLaneId << " unavailable: " << reason()); }
};

}  // namespace detlogp::detail
