// Builds without a CUDA compiler: the SM90 backend exists and reports why it cannot run; its
// tensor-parallel merge and logit gradient say so too.
#include "cuda/unavailable.hpp"

#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/device_ops.hpp"
#include "core/grad_logits.hpp"
#include "detlogp/error.hpp"
#include "sm90/backend.hpp"

namespace detlogp::detail {
namespace {

class Sm90Unavailable final : public Backend {
 public:
  Sm90Unavailable() { prov_ = contract_provenance(sm90::kBackendId, "sm90a", 0); }
  const Provenance& provenance() const override { return prov_; }
  bool contract_bearing() const override { return true; }
  Memory memory() const override { return Memory::cuda; }
  bool available(std::string* why) const override {
    if (why != nullptr) *why = kNoCudaReason;
    return false;
  }
  void run(const LogpProblem&) const override { DETLOGP_FAIL("SM90 backend unavailable: " << kNoCudaReason); }
  void run_from_host(const LogpProblem&) const override { DETLOGP_FAIL("SM90 backend unavailable: " << kNoCudaReason); }

 private:
  Provenance prov_;
};

}  // namespace

void device_merge(const std::vector<DeviceMergeRank>&, int64_t, const void*, bool, int64_t, float*, float*, int,
                  void*) {
  DETLOGP_FAIL("CUDA-memory merge unavailable: " << kNoCudaReason);
}

void sm90_grad_logits(const GradLogitsProblem&) { DETLOGP_FAIL("SM90 logit gradient unavailable: " << kNoCudaReason); }

const Backend& sm90_contract_backend() {
  static const Sm90Unavailable backend;
  return backend;
}

}  // namespace detlogp::detail
