// The device workspace of a full-mode call: the status word, then the tile summaries and target
// logits (and with entropy the tiles' entropy sums) of one row chunk. N is walked in chunks so the workspace stays
// bounded (a free axis).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/problem.hpp"

namespace detlogp::sm90 {

inline constexpr const char* kWorkspaceEnv = "DETLOGP_SM90_WORKSPACE_MB";  // free axis: N chunking
inline constexpr int64_t kDefaultWorkspaceMiB = 256;
// The fewest rows a chunk of serving logits takes in the row-kernel entries (top-k, sampling) when
// the budget is not set: each chunk streams the whole weight again, so below this the weight's
// re-reads, not the logits, bound the call.
inline constexpr int64_t kRowKernelChunkRows = 1024;

struct WorkspaceLayout {
  int64_t chunk = 0;  // rows per launch chunk (0 in partial mode: no chunking)
  size_t summaries_offset = 0;
  size_t target_offset = 0;
  size_t usums_offset = 0;  // the chunk's entropy sums, when the call writes entropy
  size_t bytes = 0;
};
WorkspaceLayout workspace_layout(const detail::LogpProblem& p);

// Rows per launch chunk of the full mode (bit-neutral: rows are independent); entropy: the chunk
// also holds each row's entropy sums; targets_per_row: each row's K target logits.
int64_t chunk_rows(int64_t rows, int64_t local_tiles, bool entropy = false, int64_t targets_per_row = 1);
// Device bytes a call allocates besides its outputs (status word, summaries, target logits).
int64_t workspace_bytes(const detail::LogpProblem& p);

}  // namespace detlogp::sm90
