// Environment knobs. Only free axes may be set from the environment; any DETLOGP_* variable
// that names a frozen constant, or that detlogp does not know, is rejected with a clear error.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace detlogp::detail {

// The check behind detlogp::check_environment, which every entry point runs first.
void check_environment();

std::optional<std::string> env_value(const char* name);
bool env_strict();               // DETLOGP_STRICT=1
std::string env_backend();       // DETLOGP_BACKEND, "" when unset
int64_t env_tp_workspace_mib();  // DETLOGP_TP_WORKSPACE_MB, 256 when unset

}  // namespace detlogp::detail
