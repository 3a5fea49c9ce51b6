// The tensor-parallel protocol behind linear_logp_tensor_parallel (include/detlogp/dist.hpp
// describes the steps). The protocol does not choose backends: the entry point supplies the one
// that serves this rank's partials.
#pragma once

#include "core/problem.hpp"
#include "detlogp/dist.hpp"

namespace detlogp::tp {

class PartialsBackend {
 public:
  virtual ~PartialsBackend() = default;
  // Picks the backend for this rank's partials in `memory` (with the tiles' entropy sums when
  // `entropy`, taking targets_per_row targets a row, with top-k lists of `topk` when > 0) and fills `report` (its
  // provenance names the backend: every rank must be served by the same one under the same contract); throws when none
  // can serve (the protocol turns that into the same error on every rank).
  virtual void select(Memory memory, bool entropy, int64_t targets_per_row, int64_t topk, CallReport& report) = 0;
  // Computes the partials of one validated row chunk on the selected backend.
  virtual void run(const detail::LogpProblem& problem) const = 0;
};

// One tensor-parallel call of this rank: tensors where comm.memory() says, work on `stream`.
CallReport run_tensor_parallel(const LinearLogpInputs& in, const LinearLogpOutputs& out, Communicator& comm,
                               void* stream, PartialsBackend& backend);

}  // namespace detlogp::tp
