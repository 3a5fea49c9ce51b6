// Backend selection: auto, by id, strict mode, fallback reporting; where the logit gradient runs.
#pragma once

#include "core/backend.hpp"
#include "detlogp/detlogp.hpp"

namespace detlogp::detail {

struct GradLogitsProblem;

// Picks the backend for a call whose tensors live in `memory`; fills report (requested,
// strict, fallback). Throws with the backend ids named when it cannot serve: partials, the entropy
// output, [N, K] targets, the top-k output or the sampling program asked of a backend that has none.
// targets_per_row: K of [N, K] targets (K > 1 needs a backend that takes several targets a row).
// topk: K of the top-k output (0: none).
const Backend& select_backend(const CallOptions& opt, Memory memory, bool partials, bool entropy, CallReport& report,
                              int64_t targets_per_row = 1, int64_t topk = 0, bool sampling = false);

// Runs the problem on the backend, staging host tensors to a device backend when needed.
void dispatch(const Backend& backend, const LogpProblem& problem);

// Runs the logit gradient where its tensors live (host: the CPU, CUDA memory: the SM90 kernel,
// which must be available) and names the implementation in report.provenance.
void dispatch_grad_logits(const GradLogitsProblem& p, CallReport& report);
// The same for the gradient from given logits (p.logits set): the CPU, or the SM90 backend's kernel.
void dispatch_grad_from_logits(const GradLogitsProblem& p, CallReport& report);

}  // namespace detlogp::detail
