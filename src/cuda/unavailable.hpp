// What a build without CUDA (or without cuBLAS) links instead of the CUDA lanes: the backends exist
// in the registry and say why they cannot run.
#pragma once

#include <string>
#include <utility>

#include "core/backend.hpp"
#include "detlogp/error.hpp"

namespace detlogp::detail {

inline constexpr const char* kNoCudaReason =
    "this build of detlogp has no CUDA support (no CUDA compiler was found at configure time, or "
    "DETLOGP_ENABLE_CUDA=OFF); rebuild with nvcc >= 12.3 available to get the SM90 backend";

// The cuda-cublas-materialized lane where it is not built.

class CublasUnavailable final : public Backend {
 public:
  explicit CublasUnavailable(std::string reason) : reason_(std::move(reason)) {
    prov_ = {"none",      0,      "cuda-cublas-materialized", "cuda", 0, 0, 0, "cublas-gemm-fp32-out", "block-parallel",
             "expf/logf", "y=z/T"};
  }
  const Provenance& provenance() const override { return prov_; }
  bool contract_bearing() const override { return false; }
  Memory memory() const override { return Memory::cuda; }
  bool supports_partials() const override { return false; }
  bool available(std::string* why) const override {
    if (why != nullptr) *why = reason_;
    return false;
  }
  void run(const LogpProblem&) const override { DETLOGP_FAIL("cuda-cublas-materialized unavailable: " << reason_); }
  void run_from_host(const LogpProblem&) const override {
    DETLOGP_FAIL("cuda-cublas-materialized unavailable: " << reason_);
  }

 private:
  Provenance prov_;
  std::string reason_;
};

}  // namespace detlogp::detail
