// The launches of the per-row kernels around the fused kernel (combine.cu).
#pragma once

#include <cuda_runtime.h>

#include "sm90/params.hpp"

namespace detlogp::sm90 {

// The full-mode combine over one row chunk's summaries. programmatic: a programmatic dependent
// launch (its CTAs may start during the fused kernel's tail and wait for its grid).
void launch_combine(const CombineParams& p, cudaStream_t stream, bool programmatic = false);
// Partial mode: target ownership flags and +0 target logits for the rows this shard does not own.
void launch_partial_owner(const PartialOwnerParams& p, cudaStream_t stream);
// The tensor-parallel merge over rank-ordered segments (with their head tiles, where set).
void launch_merge(const MergeParams& p, cudaStream_t stream);
// The straddling tiles' summaries of a merge (before launch_merge reads them as segment heads).
void launch_straddle_summaries(const StraddleParams& p, cudaStream_t stream);
// Partial mode off the tile grid: the edge columns' logits, edge lanes and y_t (EdgeLanesParams).
void launch_edge_lanes(const EdgeLanesParams& p, cudaStream_t stream);

}  // namespace detlogp::sm90
