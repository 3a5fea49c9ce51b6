// The sampling program over vocabulary shards (docs/contract.md §11.9): the protocol behind
// sample_tensor_parallel and the replay's linear_logp_tensor_parallel (include/detlogp/dist.hpp).
#pragma once

#include "core/problem.hpp"
#include "detlogp/dist.hpp"

namespace detlogp::tp {

// The backend of this rank's partials and logits, supplied by the entry point (the protocol does
// not choose backends).
class SamplingBackend {
 public:
  virtual ~SamplingBackend() = default;
  // Picks a host backend that runs the sampling program (its provenance names the sample_id) and
  // serves partials, and fills `report`; throws when none can (every rank then refuses alike).
  virtual void select(CallReport& report) = 0;
  // Computes the partials and serving logits of one validated row chunk.
  virtual void run(const detail::LogpProblem& problem) const = 0;
};

CallReport run_sample_tensor_parallel(const SampleInputs& in, const SampleOutputs& out, Communicator& comm,
                                      SamplingBackend& backend);
CallReport run_replay_tensor_parallel(const LinearLogpInputs& in, const SamplingProgram& program,
                                      const SampledLogpOutputs& out, Communicator& comm, SamplingBackend& backend);

}  // namespace detlogp::tp
