// linear_logp_grad_logits: validate, run where the tensors live (src/registry), report.
#include "core/grad_logits.hpp"

#include "core/env.hpp"
#include "detlogp/detlogp.hpp"
#include "registry/registry.hpp"

namespace detlogp {

CallReport linear_logp_grad_logits(const LinearLogpInputs& in, const GradLogitsArgs& args, const MutableTensorView& dz,
                                   const CallOptions& opt) {
  detail::check_environment();
  CallReport report;
  report.requested_backend = "auto";
  report.strict = opt.strict || detail::env_strict();
  detail::GradLogitsProblem p = detail::make_grad_logits_problem(in, args, dz);
  p.stream = opt.cuda_stream;
  p.defer_errors = opt.defer_errors;
  detail::dispatch_grad_logits(p, report);
  return report;
}

CallReport linear_logp_grad_logits(const LinearLogpInputs& in, const SamplingProgram& program,
                                   const SampledGradArgs& args, const MutableTensorView& dz, const CallOptions& opt) {
  detail::check_environment();
  CallReport report;
  report.requested_backend = "auto";
  report.strict = opt.strict || detail::env_strict();
  detail::GradLogitsProblem p = detail::make_sampled_grad_logits_problem(in, program, args, dz);
  p.stream = opt.cuda_stream;
  p.defer_errors = opt.defer_errors;
  detail::dispatch_grad_logits(p, report);
  return report;
}

}  // namespace detlogp
