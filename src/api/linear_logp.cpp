// linear_logp and linear_logp_partials: validate, select a backend, dispatch, report.
#include "core/validate.hpp"
#include "detlogp/detlogp.hpp"
#include "registry/registry.hpp"

namespace detlogp {
namespace {

// One of the two entries: full outputs (`out`) or a shard's partials (`partials`).
CallReport run_entry(const LinearLogpInputs& in, const LinearLogpOutputs* out, const ShardPartials* partials,
                     const CallOptions& opt) {
  CallReport report;
  const detail::Backend& backend = detail::select_backend(opt, in.hidden.memory, partials != nullptr, report);
  detail::LogpProblem problem = detail::make_problem(in, out, partials);
  problem.stream = opt.cuda_stream;
  if (problem.rows > 0) detail::dispatch(backend, problem);
  return report;
}

}  // namespace

CallReport linear_logp(const LinearLogpInputs& in, const LinearLogpOutputs& out, const CallOptions& opt) {
  return run_entry(in, &out, nullptr, opt);
}

CallReport linear_logp_partials(const LinearLogpInputs& in, const ShardPartials& out, const CallOptions& opt) {
  return run_entry(in, nullptr, &out, opt);
}

}  // namespace detlogp
