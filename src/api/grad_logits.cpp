// linear_logp_grad_logits: validate, run where the tensors live (src/registry), report.
#include "core/grad_logits.hpp"

#include "core/env.hpp"
#include "detlogp/detlogp.hpp"
#include "registry/registry.hpp"

namespace detlogp {
namespace {

// Validates with make_problem, then runs the problem where its tensors live with dispatch.
template <class MakeProblem, class Dispatch>
CallReport run_grad(const CallOptions& opt, MakeProblem&& make_problem, Dispatch&& dispatch) {
  detail::check_environment();
  CallReport report;
  report.requested_backend = "auto";
  report.strict = opt.strict || detail::env_strict();
  detail::GradLogitsProblem p = make_problem();
  p.stream = opt.cuda_stream;
  p.defer_errors = opt.defer_errors;
  dispatch(p, report);
  return report;
}

}  // namespace

CallReport linear_logp_grad_logits(const LinearLogpInputs& in, const GradLogitsArgs& args, const MutableTensorView& dz,
                                   const CallOptions& opt) {
  return run_grad(
      opt, [&] { return detail::make_grad_logits_problem(in, args, dz); }, detail::dispatch_grad_logits);
}

CallReport linear_logp_grad_logits(const LinearLogpInputs& in, const SamplingProgram& program,
                                   const SampledGradArgs& args, const MutableTensorView& dz, const CallOptions& opt) {
  return run_grad(
      opt, [&] { return detail::make_sampled_grad_logits_problem(in, program, args, dz); },
      detail::dispatch_grad_logits);
}

CallReport linear_logp_grad_from_logits(const GradFromLogitsInputs& in, const GradLogitsArgs& args,
                                        const MutableTensorView& dz, const CallOptions& opt) {
  return run_grad(
      opt, [&] { return detail::make_grad_from_logits_problem(in, args, dz); }, detail::dispatch_grad_from_logits);
}

}  // namespace detlogp
