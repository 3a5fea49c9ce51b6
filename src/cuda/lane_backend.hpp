// What every backend of the CUDA lanes shares, built or not: tensors in CUDA memory, its provenance,
// and whether it can run here (with the reason it cannot, or the device it would use). Plain C++:
// the builds without CUDA list these backends as unavailable through it too.
#pragma once

#include <string>
#include <utility>

#include "core/backend.hpp"

namespace detlogp::detail {

class CudaLaneBackend : public Backend {
 public:
  CudaLaneBackend(Provenance provenance, bool contract_bearing)
      : prov_(std::move(provenance)), contract_bearing_(contract_bearing) {}
  const Provenance& provenance() const final { return prov_; }
  bool contract_bearing() const final { return contract_bearing_; }
  Memory memory() const final { return Memory::cuda; }
  // why: the reason it cannot run, or the device it would use.
  bool available(std::string* why) const final {
    if (why != nullptr) *why = reason_;
    return available_;
  }

 protected:
  void set_availability(bool available, std::string reason) {
    available_ = available;
    reason_ = std::move(reason);
  }
  Provenance& mutable_provenance() { return prov_; }
  const std::string& reason() const { return reason_; }

 private:
  Provenance prov_;
  bool contract_bearing_;
  bool available_ = false;
  std::string reason_;
};

// The non-contract cuBLAS lane's provenance: no contract, its own GEMM and reduction.
inline constexpr const char* kCublasLaneId = "cuda-cublas-materialized";
inline Provenance cublas_lane_provenance() {
  return {"none", 0, kCublasLaneId, "cuda", 0, 0, 0, "cublas-gemm-fp32-out", "block-parallel", "expf/logf", "y=z/T"};
}

}  // namespace detlogp::detail
