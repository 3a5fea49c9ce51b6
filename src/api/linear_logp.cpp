// linear_logp: validate, select a backend, dispatch, report (linear_logp_partials, which also
// records its layout, is with the other tensor-parallel entries in tensor_parallel.cpp).
#include "core/validate.hpp"
#include "detlogp/detlogp.hpp"
#include "registry/registry.hpp"

namespace detlogp {

CallReport linear_logp(const LinearLogpInputs& in, const LinearLogpOutputs& out, const CallOptions& opt) {
  CallReport report;
  const detail::Backend& backend = detail::select_backend(opt, in.hidden.memory, false, out.entropy.present(), report,
                                                          in.targets.ndim == 2 ? in.targets.cols : 1,
                                                          out.topk_ids.present() ? out.topk_ids.cols : 0);
  detail::LogpProblem problem = detail::make_problem(in, &out, nullptr);
  problem.stream = opt.cuda_stream;
  problem.defer_errors = opt.defer_errors;
  if (problem.rows > 0) detail::dispatch(backend, problem);
  return report;
}

}  // namespace detlogp
