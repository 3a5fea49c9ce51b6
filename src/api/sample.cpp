// The sampling program's entries (docs/contract.md §11): select a backend that runs it, validate,
// run, report. `sample` draws; linear_logp with a SamplingProgram replays.
#include "core/sample.hpp"

#include <functional>

#include "detlogp/detlogp.hpp"
#include "registry/registry.hpp"

namespace detlogp {
namespace {

CallReport run_program(const TensorView& hidden, const CallOptions& opt,
                       const std::function<detail::SampleProblem()>& make) {
  CallReport report;
  const detail::Backend& backend = detail::select_backend(opt, hidden.memory, false, false, report, 1, 0, true);
  detail::SampleProblem problem = make();
  problem.stream = opt.cuda_stream;
  if (problem.rows > 0) report.sampling = backend.run_sample(problem);
  return report;
}

}  // namespace

CallReport sample(const SampleInputs& in, const SampleOutputs& out, const CallOptions& opt) {
  return run_program(in.hidden, opt, [&] { return detail::make_sample_problem(in, out); });
}

CallReport linear_logp(const LinearLogpInputs& in, const SamplingProgram& program, const SampledLogpOutputs& out,
                       const CallOptions& opt) {
  return run_program(in.hidden, opt, [&] { return detail::make_sampled_logp_problem(in, program, out); });
}

}  // namespace detlogp
