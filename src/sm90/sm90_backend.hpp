// Host-side helpers of the SM90 backend that tests and the benchmark also use.
#pragma once

#include <cstdint>

#include "core/problem.hpp"

namespace detlogp::sm90 {

inline constexpr const char* kBackendId = "cuda-fused-linear-logp-sm90-contract-v1";
inline constexpr const char* kWorkspaceEnv = "DETLOGP_SM90_WORKSPACE_MB";  // free axis: N chunking
inline constexpr int64_t kDefaultWorkspaceMiB = 256;

struct DeviceStatus;
// Throws the error the validation kernel's status word describes (code != kStatusOk).
[[noreturn]] void throw_status(const DeviceStatus& s, const detail::LogpProblem& p);

// Rows per launch chunk of the full mode (bit-neutral: rows are independent).
int64_t chunk_rows(int64_t rows, int64_t local_tiles);
// Device bytes a call allocates besides its outputs (status word, summaries, target logits).
int64_t workspace_bytes(const detail::LogpProblem& p);

}  // namespace detlogp::sm90
