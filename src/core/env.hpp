// Environment knobs. Only free axes may be set from the environment; any DETLOGP_* variable
// that names a frozen constant, or that detlogp does not know, is rejected with a clear error, and
// so is a bad value of a known one, in every build (with CUDA or without, with a GPU or without).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace detlogp::detail {

// The check behind detlogp::check_environment, which every entry point runs first: names, then
// the value of every knob that is set.
void check_environment();

std::optional<std::string> env_value(const char* name);

// The value of the free knob `name` (one of check_environment's table), checked with the message
// check_environment gives; nullopt when unset. An empty value is a bad value, not "unset".
std::optional<std::string> env_checked(const char* name);
// An integer knob's checked value, or `fallback` when unset.
int64_t env_integer(const char* name, int64_t fallback);

bool env_strict();               // DETLOGP_STRICT=1
std::string env_backend();       // DETLOGP_BACKEND, "" when unset
int64_t env_tp_workspace_mib();  // DETLOGP_TP_WORKSPACE_MB, 256 when unset

// The SM90 launch buckets' names in launch-table order (DETLOGP_SM90_BUCKET takes these or auto).
// Defined by the SM90 layer from its launch table in every build, with CUDA or without. (C++17:
// the CUDA sources include this header.)
const std::vector<std::string>& sm90_bucket_names();

}  // namespace detlogp::detail
