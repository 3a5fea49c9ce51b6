#include "sm90/workspace.hpp"

#include <algorithm>

#include "core/env.hpp"

namespace detlogp::sm90 {
namespace {

constexpr size_t kStatusBytes = 256;  // keeps the arrays after it 256-byte aligned

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

int64_t workspace_mib() { return detail::env_integer(kWorkspaceEnv, kDefaultWorkspaceMiB); }

}  // namespace

WorkspaceLayout workspace_layout(const detail::LogpProblem& p) {
  WorkspaceLayout w;
  w.bytes = kStatusBytes;
  if (p.partial_mode()) return w;  // summaries and y_t go straight to the caller's buffers
  const bool entropy = p.entropy != nullptr;
  w.chunk = chunk_rows(p.rows, p.local_tiles(), entropy, p.targets_per_row);
  w.summaries_offset = w.bytes;
  w.bytes += round_up(static_cast<size_t>(w.chunk * p.local_tiles()) * sizeof(TileSummary), 256);
  w.target_offset = w.bytes;
  w.bytes += round_up(static_cast<size_t>(w.chunk * p.targets_per_row) * sizeof(float), 256);
  if (entropy) {
    w.usums_offset = w.bytes;
    w.bytes += round_up(static_cast<size_t>(w.chunk * p.local_tiles()) * sizeof(float), 256);
  }
  return w;
}

int64_t chunk_rows(int64_t rows, int64_t local_tiles, bool entropy, int64_t targets_per_row) {
  const int64_t per_tile = static_cast<int64_t>(sizeof(TileSummary)) + (entropy ? int64_t{sizeof(float)} : 0);
  const int64_t per_row = local_tiles * per_tile + targets_per_row * static_cast<int64_t>(sizeof(float));
  int64_t chunk = (workspace_mib() << 20) / per_row;
  chunk = std::max<int64_t>(128, chunk / 128 * 128);
  return std::min(chunk, rows);
}

int64_t workspace_bytes(const detail::LogpProblem& p) { return static_cast<int64_t>(workspace_layout(p).bytes); }

}  // namespace detlogp::sm90
