// Builds without a CUDA compiler: the SM90 backend exists and reports why it cannot run; its
// tensor-parallel merge and logit gradient say so too; its launch buckets' names are known.
#include "cuda/unavailable.hpp"

#include <iterator>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/device_ops.hpp"
#include "core/env.hpp"
#include "core/grad_logits.hpp"
#include "detlogp/error.hpp"
#include "sm90/backend.hpp"
#include "sm90/launch_buckets.hpp"

namespace detlogp::detail {
namespace {

class Sm90Unavailable final : public CudaLaneBackend {
 public:
  Sm90Unavailable() : CudaLaneBackend(contract_provenance(sm90::kBackendId, "sm90a", 0, false), true) {
    set_availability(false, kNoCudaReason);
  }
  // The same capability flag as the built backend: the id takes [N, K] targets wherever it runs.
  bool supports_multi_targets() const override { return true; }
  bool supports_topk() const override { return true; }
  void run(const LogpProblem&) const override { DETLOGP_FAIL("SM90 backend unavailable: " << kNoCudaReason); }
};

}  // namespace

void device_merge(const std::vector<DeviceMergeRank>&, int64_t, const void*, bool, int64_t, float*, float*, int, void*,
                  float*, const StraddlePlan*, int64_t) {
  DETLOGP_FAIL("CUDA-memory merge unavailable: " << kNoCudaReason);
}

void device_merge_topk(const std::vector<DeviceTopkList>&, int64_t, int64_t, const float*, int64_t*, float*, int,
                       void*) {
  DETLOGP_FAIL("CUDA-memory merge unavailable: " << kNoCudaReason);
}

void sm90_grad_logits(const GradLogitsProblem&) { DETLOGP_FAIL("SM90 logit gradient unavailable: " << kNoCudaReason); }
void sm90_grad_from_logits(const GradLogitsProblem&) {
  DETLOGP_FAIL("SM90 logit gradient unavailable: " << kNoCudaReason);
}

const Backend& sm90_contract_backend() {
  static const Sm90Unavailable backend;
  return backend;
}

// The bucket names come from the launch table here too, so DETLOGP_SM90_BUCKET is checked the same
// way without CUDA.
const std::vector<std::string>& sm90_bucket_names() {
  static const std::vector<std::string> names(std::begin(sm90::kBucketNames), std::end(sm90::kBucketNames));
  return names;
}

}  // namespace detlogp::detail
