// Builds without a CUDA compiler: the SM90 logit gradient says why it cannot run.
#include "core/grad_logits.hpp"
#include "detlogp/error.hpp"

namespace detlogp::detail {

void sm90_grad_logits(const GradLogitsProblem&) {
  DETLOGP_FAIL(
      "SM90 logit gradient unavailable: this build of detlogp has no CUDA support (no CUDA compiler was found at "
      "configure time, or DETLOGP_ENABLE_CUDA=OFF)");
}

}  // namespace detlogp::detail
