// Backend selection: auto, by id, strict mode, fallback reporting.
#pragma once

#include <string>

#include "core/backend.hpp"
#include "detlogp/detlogp.hpp"

namespace detlogp::detail {

// Picks the backend for a call whose tensors live in `memory`; fills report (requested,
// strict, fallback). Throws with the backend ids named when it cannot serve.
const Backend& select_backend(const CallOptions& opt, Memory memory, bool partials, CallReport& report);

// Runs the problem on the backend, staging host tensors to a device backend when needed.
void dispatch(const Backend& backend, const LogpProblem& problem);

}  // namespace detlogp::detail
