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
  // Picks a backend for tensors in `memory` that runs the sampling program (its provenance names
  // the sample_id) and serves partials, and fills `report`; throws when none can (every rank then
  // refuses alike).
  virtual void select(Memory memory, CallReport& report) = 0;
  // Computes the partials and serving logits of one validated row chunk, in the chunk's memory
  // (enqueued on problem.stream for CUDA memory).
  virtual void run(const detail::LogpProblem& problem) const = 0;
};

// Tensors live where comm.memory() says; for CUDA memory the work and the gathers are ordered on
// `stream` (a cudaStream_t) and the call has completed on return.
CallReport run_sample_tensor_parallel(const SampleInputs& in, const SampleOutputs& out, Communicator& comm,
                                      void* stream, SamplingBackend& backend);
CallReport run_replay_tensor_parallel(const LinearLogpInputs& in, const SamplingProgram& program,
                                      const SampledLogpOutputs& out, Communicator& comm, void* stream,
                                      SamplingBackend& backend);

}  // namespace detlogp::tp
