// The sampling program on the GPU (docs/contract.md §11): one CTA per row over a chunk of the
// serving logits (fp32 z in device memory, from the fused kernel), the same definitions as the CPU
// row program (detlogp/sample.hpp, detlogp/reduce.hpp, SampleProblem::write_row):
//   1. one pass over the row (coalesced, visit_row): M by an exact max over the lanes, and each
//      thread's kListed largest rank keys in registers; lse from the fused kernel, which ran at the
//      row's temperature (the chain's bits over these logits, §5-§6). With few rows and a top-k cut
//      of k' <= kMaxTopk, the top-k output's split runs first instead (each slice of the row lists
//      its k largest keys in its own CTA): the merged lists give M and the row's top k' directly;
//      the cut and support below read only those and the support's tiles;
//   2. the cut (§11.4-§11.5). The candidate path: with top-k, the k'-th largest listed key is at
//      most the row's k'-th (the listed keys are distinct lanes), so every lane of rank < k' is at
//      or above it; when no thread's last listed key reaches it the first k' listed keys are the
//      top k' (no second pass), otherwise the lanes at or above it are gathered (at most
//      kCandidates) and sorted by rank key. Without top-k, the bound is the k'-th largest of the
//      threads' maxima and the lanes at or above it are gathered the same way. The cut is read off
//      the sorted list: top-k by position, top-p by the exact integer prefix masses. Without top-k,
//      top-p takes this path when the gathered prefix already holds the threshold mass. Otherwise (a
//      large k', a flat row) the radix selection over rank_key, 16 passes of 4-bit digits: top-k
//      with digit histograms of counts, top-p with digit histograms of the integer mass q after the
//      exact sum Q over the top-k lanes. Each thread fills its own row of the histograms, which a
//      tree of integer adds then sums: exact in any order, and no atomics (the contract kernels have
//      none). Both find the same lane: the cut is a selection by a total order;
//   3. the support: with a cut every support lane is among the sorted candidates, so the support's
//      lanes are sorted by id, each tile that holds some gets its masked summary, and the chain runs
//      over those tiles in ascending order (a tile without support lanes has s_g = 0, a step that
//      changes nothing); the Gumbel scores of the support lanes and a block argmax under
//      score_precedes (a total order, so the reduction order does not matter). Without a cut, one pass
//      over every lane: with min-p off the support is every lane and lse_Sigma is lse (only the
//      scores); with min-p on, membership, masked summaries, scores, the support size by the same
//      integer tree, the chain by one warp;
//   4. write_row by one thread.
// Every rounding is the contract's; the block only chooses the order of exact operations.
#include <cuda_runtime.h>

#include "cuda/check.hpp"
#include "detlogp/sample.hpp"
#include "sm90/device/block_select.cuh"
#include "sm90/device/ptx.cuh"
#include "sm90/launch_dependent.cuh"
#include "sm90/sample.hpp"
#include "sm90/topk.hpp"

namespace detlogp::sm90 {
namespace {

constexpr int kThreads = 256;
// The candidate path's capacity: rank-ordered lanes gathered in shared memory.
constexpr int kCandidates = 2048;
// Keys each thread lists in its first pass: the listed keys fill the candidates' array.
constexpr int kListed = kCandidates / kThreads;
static_assert(kListed * kThreads == kCandidates, "every thread lists the same number of keys");
static_assert((kCandidates & (kCandidates - 1)) == 0 && kCandidates >= kThreads, "a power-of-two sort size");
static_assert(kThreads % 32 == 0 && (kThreads & (kThreads - 1)) == 0, "whole warps, a power-of-two sort");
static_assert(kMaxSliceKeys <= kCandidates, "a row's slice lists fit the staging array");

struct Shared {
  union {
    RadixScratch<kThreads> radix;  // the radix path
    struct {
      uint64_t key[kCandidates];  // the candidates' rank keys; then the support's lanes by id
      union {
        uint64_t mass[kCandidates];  // the candidates' top-p masses, in rank order
        struct {
          float sum[kCandidates];     // s_g of the support tile starting at this entry (0 elsewhere)
          float factor[kCandidates];  // its chain factor (0 elsewhere)
        } run;
      };
    } cand;
  };
  float max;
  float sum;
  float best_score[kThreads];
  int64_t best_id[kThreads];
  float best_y[kThreads];
  uint64_t thread_max[kThreads];  // rank keys of the threads' maxima, sorted descending
  unsigned long long warp_total[kThreads / 32];
  int offset[kThreads];  // each thread's first slot among the gathered candidates
  int gathered;
  int cut_index;
  int uncertain;  // some thread may hold more lanes at or above the listed bound than it listed
};

// The chain S over n (s_g, factor_g) in ascending g by one warp: 32 tiles per coalesced load, then
// every lane runs the same serial fma chain over them (so every lane returns the same S). Past n the
// step is fma(0, 0, S) == S.
__device__ float warp_chain(const TileSummary* tiles, const float* factors, int64_t n) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  float s = 0.0f;
  for (int64_t g0 = 0; g0 < n; g0 += 32) {
    const int64_t g = g0 + lane;
    const float ts = g < n ? tiles[g].sum : 0.0f;
    const float f = g < n ? factors[g] : 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) s = chain_fma(s, __shfl_sync(0xFFFFFFFFu, ts, i), __shfl_sync(0xFFFFFFFFu, f, i));
  }
  return s;
}

// The key of the lane that ends the prefix (radix_select): among the lanes with key >= floor, the
// one where the running count (or, with by_mass, top-p mass) from the largest key first reaches need.
__device__ uint64_t radix_select_lanes(Shared& sh, const float* z, int64_t lanes, float inv_t, float row_max,
                                       uint64_t floor, bool by_mass, unsigned long long need) {
  const auto lane = [&](int64_t v) {
    const float y = lane_y(z, v, inv_t);
    return KeyWeight{rank_key(y, v), by_mass ? top_p_mass(relative_weight(y, row_max)) : 1u};
  };
  return radix_select<kThreads>(sh.radix, lanes, lane, floor, need);
}

// The radix path's cut key (§11.4-§11.5).
__device__ uint64_t radix_cut(Shared& sh, const float* z, int64_t lanes, float inv_t, float row_max,
                              const SampleRowParams& r) {
  uint64_t kth = 0;  // every key passes
  if (r.keep < lanes) kth = radix_select_lanes(sh, z, lanes, inv_t, row_max, 0, false, static_cast<uint64_t>(r.keep));
  if (r.top_p == 1.0f) return kth;
  unsigned long long mine = 0;
  visit_row<kThreads>(z, lanes, inv_t, [&](int64_t v, float yv) {
    if (rank_key(yv, v) >= kth) mine += top_p_mass(relative_weight(yv, row_max));
  });
  const unsigned long long total = block_sum<kThreads>(sh.warp_total, mine);
  return radix_select_lanes(sh, z, lanes, inv_t, row_max, kth, true, top_p_threshold(total, r.top_p));
}

// Gathers the lanes with y >= bound into sh.cand.key, sorted descending (rank order), padded with 0
// to a power of two; returns how many, or -1 (nothing gathered) when more than kCandidates. `mass`:
// every thread also returns the gathered lanes' exact top-p mass.
__device__ int gather_candidates(Shared& sh, const float* z, int64_t lanes, float inv_t, float row_max, float bound,
                                 unsigned long long* mass) {
  int mine = 0;
  unsigned long long q = 0;
  visit_row<kThreads>(z, lanes, inv_t, [&](int64_t, float y) {
    if (y >= bound) {
      ++mine;
      if (mass) q += top_p_mass(relative_weight(y, row_max));
    }
  });
  const int count = block_offsets<kThreads>(sh.offset, &sh.gathered, mine);
  if (mass) *mass = block_sum<kThreads>(sh.warp_total, q);
  if (count > kCandidates) return -1;
  int slot = sh.offset[threadIdx.x];  // the same visiting order as the count above
  visit_row<kThreads>(z, lanes, inv_t, [&](int64_t v, float y) {
    if (y >= bound) sh.cand.key[slot++] = rank_key(y, v);
  });
  sort_padded_descending<kThreads>(sh.cand.key, count, pow2_at_least(count));
  return count;
}

// The top-k lanes from the threads' listed keys, sorted into sh.cand.key: their k'-th key is at
// most the row's k'-th (they are distinct lanes), so every top-k lane is at or above it; when no
// thread's last listed key reaches it, no unlisted lane does, and the first k' listed keys are the
// top k' (one pass over the row). Otherwise the lanes at or above it are gathered (a second pass).
// Returns how many rank-ordered candidates sh.cand.key holds, or -1 (none: the radix path).
__device__ int listed_top_k(Shared& sh, const float* z, int64_t lanes, float inv_t, float row_max,
                            const ListedKeys<kListed>& listed, int64_t keep) {
  if (threadIdx.x == 0) sh.uncertain = 0;
  sort_listed<kThreads>(sh.cand.key, sh.offset, &sh.gathered, listed, static_cast<int>(keep));
  const uint64_t floor = sh.cand.key[keep - 1];
  if (floor == 0) return -1;  // fewer listed lanes than k' (not for k' < the row's lanes; kept safe)
  if (listed.last() != 0 && listed.last() >= floor) sh.uncertain = 1;
  __syncthreads();
  if (!sh.uncertain) return static_cast<int>(keep);
  return gather_candidates(sh, z, lanes, inv_t, row_max, rank_key_logit(floor), nullptr);
}

// The cut read off `count` rank-ordered candidates in sh.cand.key (with top-k, the row's top k' lanes
// first): sh.gathered and sh.cut_index. `total`: Q of §11.5 without top-k (with it, the candidates'
// own mass is Q).
__device__ void cut_among_candidates(Shared& sh, int count, bool top_k, uint64_t total, float row_max,
                                     const SampleRowParams& r) {
  if (threadIdx.x == 0) sh.gathered = count;
  const int keep = top_k ? static_cast<int>(r.keep) : count;  // the top-k lanes among the candidates
  if (r.top_p == 1.0f) {
    if (threadIdx.x == 0) sh.cut_index = keep - 1;
    __syncthreads();
    return;
  }
  for (int j = threadIdx.x; j < keep; j += kThreads)
    sh.cand.mass[j] = top_p_mass(relative_weight(rank_key_logit(sh.cand.key[j]), row_max));
  __syncthreads();
  if (top_k) {
    unsigned long long mine = 0;
    for (int j = threadIdx.x; j < keep; j += kThreads) mine += sh.cand.mass[j];
    total = block_sum<kThreads>(sh.warp_total, mine);
  }
  if (threadIdx.x == 0) {
    const uint64_t tau = top_p_threshold(total, r.top_p);
    uint64_t running = 0;
    int j = 0;
    for (; j < keep - 1; ++j) {
      running += sh.cand.mass[j];
      if (running >= tau) break;
    }
    sh.cut_index = j;
  }
  __syncthreads();
}

// The block's token among the threads' draws in sh.best_*: the first under score_precedes, a total
// order over the drawn lanes (distinct ids), so the reduction's order does not matter. Warp shuffles,
// then thread 0 over the warps' winners. Called by every thread; thread 0 gets the token in `pass`.
__device__ void block_token(Shared& sh, SupportPass& pass) {
  const int t = static_cast<int>(threadIdx.x);
  float score = sh.best_score[t], y = sh.best_y[t];
  int64_t id = sh.best_id[t];
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) {
    const float other_score = __shfl_xor_sync(0xFFFFFFFFu, score, o);
    const float other_y = __shfl_xor_sync(0xFFFFFFFFu, y, o);
    const auto other_id = static_cast<int64_t>(__shfl_xor_sync(0xFFFFFFFFu, static_cast<long long>(id), o));
    const bool take = other_id != kNoToken && (id == kNoToken || score_precedes(other_score, other_id, score, id));
    score = take ? other_score : score;
    y = take ? other_y : y;
    id = take ? other_id : id;
  }
  __syncthreads();
  if (t % 32 == 0) {
    sh.best_score[t / 32] = score;
    sh.best_y[t / 32] = y;
    sh.best_id[t / 32] = id;
  }
  __syncthreads();
  if (t != 0) return;
  float best = fp::neg_inf();
  for (int w = 0; w < kThreads / 32; ++w) {
    if (sh.best_id[w] == kNoToken) continue;
    if (pass.token == kNoToken || score_precedes(sh.best_score[w], sh.best_id[w], best, pass.token)) {
      best = sh.best_score[w];
      pass.token = sh.best_id[w];
      pass.token_logit = sh.best_y[w];
    }
  }
}

// The candidate path's cut (see the top of the file): true with the rank-ordered candidates in
// sh.cand.key[0, gathered) and the cut at sh.cut_index, or false (nothing decided) where the path
// does not apply. `my_max`: this thread's maximum over its lanes, `listed` its largest keys (step 1).
__device__ bool candidate_cut(Shared& sh, const float* z, int64_t lanes, float inv_t, float row_max, float my_max,
                              const ListedKeys<kListed>& listed, const SampleRowParams& r) {
  const bool top_k = r.keep < lanes;
  if (top_k && r.keep > kCandidates) return false;
  int count = -1;
  uint64_t total = 0;  // Q of §11.5 without top-k: the mass of every lane
  if (top_k) {
    count = listed_top_k(sh, z, lanes, inv_t, row_max, listed, r.keep);
  } else {
    sh.thread_max[threadIdx.x] = rank_key(my_max, threadIdx.x);
    __syncthreads();
    sort_descending<kThreads>(sh.thread_max, kThreads);
    unsigned long long mine = 0;
    visit_row<kThreads>(z, lanes, inv_t, [&](int64_t, float y) { mine += top_p_mass(relative_weight(y, row_max)); });
    total = block_sum<kThreads>(sh.warp_total, mine);
    const uint64_t tau = top_p_threshold(total, r.top_p);
    const int ranks[2] = {kThreads / 4, kThreads};  // a tighter bound first
    for (int rank : ranks) {
      const float bound = rank_key_logit(sh.thread_max[rank - 1]);
      unsigned long long held = 0;
      count = gather_candidates(sh, z, lanes, inv_t, row_max, bound, &held);
      if (count >= 0 && held >= tau) break;
      count = -1;
    }
  }
  if (count < 0) return false;
  cut_among_candidates(sh, count, top_k, total, row_max, r);
  return true;
}

// The support's keys (kept[]: each thread's, slots j = threadIdx.x + kThreads * slot of the first c
// candidates; key 0 for a lane outside the support), whose order is ascending id, into
// sh.cand.key[0, support size) in that order (what lies after it is not read). Distinct keys: with
// c <= kThreads by place (order_by_place), more candidates take the sort.
__device__ void order_support_by_id(Shared& sh, const uint64_t (&kept)[kCandidates / kThreads], int c) {
  if (c <= kThreads) {
    const int j = static_cast<int>(threadIdx.x);
    if (j < c) sh.cand.mass[j] = kept[0];  // staged (the masses are not needed past the cut)
    order_by_place<kThreads>(sh.cand.key, sh.cand.mass, c);
    __syncthreads();
    return;
  }
  int slot = 0;
  for (int j = threadIdx.x; j < c; j += kThreads, ++slot) sh.cand.key[j] = kept[slot];
  sort_padded_descending<kThreads>(sh.cand.key, c, pow2_at_least(c));
}

// The support pass over the candidates (a cut exists and candidate_cut decided it): the support's
// lanes by ascending id, their tiles' masked summaries, the chain over those tiles, the draw.
__device__ SupportPass candidate_support(Shared& sh, const float* z, float inv_t, const SupportRow& support, bool draw,
                                         uint64_t stream) {
  const int c = sh.cut_index + 1;
  float best = fp::neg_inf();
  int64_t best_id = kNoToken;
  float best_y = 0.0f;
  int count = 0;
  uint64_t kept[kCandidates / kThreads];
  int slots = 0;
  for (int j = threadIdx.x; j < c; j += kThreads, ++slots) {
    const int64_t id = rank_key_id(sh.cand.key[j]);
    const float yv = lane_y(z, id, inv_t);
    kept[slots] = 0;
    if (!in_support(yv, id, support)) continue;
    kept[slots] = (uint64_t{1} << 32) | (0xFFFFFFFFull - static_cast<uint64_t>(id));  // descending = ascending id
    ++count;
    if (!draw) continue;
    const float score = gumbel_score(yv, stream, id);
    if (best_id == kNoToken || score_precedes(score, id, best, best_id)) {
      best = score;
      best_id = id;
      best_y = yv;
    }
  }
  __syncthreads();
  sh.best_score[threadIdx.x] = best;
  sh.best_id[threadIdx.x] = best_id;
  sh.best_y[threadIdx.x] = best_y;
  const int support_size = static_cast<int>(block_sum<kThreads>(sh.warp_total, static_cast<unsigned long long>(count)));
  order_support_by_id(sh, kept, c);
  // Each run of support lanes in one tile: its first entry forms the tile's masked summary, from
  // registers (only the tile's support lanes are read); a tile with one support lane, the common
  // case, by the one-lane summary (one expc, not the 64-lane tree).
  for (int j = threadIdx.x; j < support_size; j += kThreads) {
    const int64_t id = rank_key_id(sh.cand.key[j]);
    const int64_t g = id / kVocabTile;
    sh.cand.run.sum[j] = 0.0f;
    sh.cand.run.factor[j] = 0.0f;
    if (j > 0 && rank_key_id(sh.cand.key[j - 1]) / kVocabTile == g) continue;
    uint64_t mask = 0;
    for (int i = j; i < support_size; ++i) {
      const int64_t lane = rank_key_id(sh.cand.key[i]);
      if (lane / kVocabTile != g) break;
      mask |= uint64_t{1} << (lane - g * kVocabTile);
    }
    TileSummary t;
    if ((mask & (mask - 1)) == 0) {
      t = tile_summary_one_lane(lane_y(z, id, inv_t));
    } else {
      float tile[kVocabTile];
#pragma unroll
      for (int v = 0; v < kVocabTile; ++v)
        tile[v] = ((mask >> v) & 1u) != 0 ? lane_y(z, g * kVocabTile + v, inv_t) : 0.0f;
      t = tile_summary_masked(tile, mask);
    }
    sh.cand.run.sum[j] = t.sum;
    sh.cand.run.factor[j] = chain_factor_or_skip(t, support.max);
  }
  __syncthreads();
  SupportPass pass{0.0f, support_size, kNoToken, 0.0f};
  if (threadIdx.x == 0)
    for (int j = 0; j < support_size; ++j) pass.sum = chain_fma(pass.sum, sh.cand.run.sum[j], sh.cand.run.factor[j]);
  return pass;
}

// Three CTAs a multiprocessor (80 registers): with many rows the kernel is a wave of rows' latencies,
// not a stream of their logits, so rows in flight are what it needs.
__global__ void __launch_bounds__(kThreads, 3) sample_rows_kernel(const SampleRowsParams p) {
  __shared__ Shared sh;
  ptx::grid_dependency_wait();  // the logits, lse and slice lists of the kernels before
  ptx::launch_dependents();
  const detail::SampleProblem& q = p.problem;
  const int64_t n = p.row_begin + blockIdx.x;
  const float* z = p.logits + int64_t{blockIdx.x} * q.vocab_local;
  TileSummary* tiles = p.tiles + int64_t{blockIdx.x} * p.tiles_per_row;
  float* factors = p.factors + int64_t{blockIdx.x} * p.tiles_per_row;
  const int64_t lanes = q.real_vocab;
  const SampleRowParams r = q.program.row(n, lanes);
  const float inv_t = r.inv_temperature;
  float y[kVocabTile];

  // 1. M and, for a top-k cut, the row's top k' lanes. With the slices' lists (few rows: each
  //    slice's k largest keys from its own CTA), M is the first of their merged keys, and the
  //    merged keys' first k' are the row's top k' (no pass over the row). Otherwise M by an exact
  //    max over the lanes (each thread's maximum is one of its lanes: the candidate bound below),
  //    with each thread's largest keys listed for the top-k cut. A NaN row takes the pass (its M
  //    is the max's NaN); lse from the fused kernel, which ran at the row's temperature (§5-§6:
  //    its bits are the chain's over these logits).
  bool merged = p.slice_keys != nullptr && r.keep < lanes && r.keep <= p.slice_k;
  if (merged) {
    // The lists staged in sh.cand.mass (free until the cut).
    merge_sorted_lists<kThreads>(sh.cand.key, sh.cand.mass, p.slice_keys + int64_t{blockIdx.x} * p.slices * p.slice_k,
                                 p.slices, p.slice_k);
    merged = !fp::is_nan(rank_key_logit(sh.cand.key[0]));
  }
  float m = fp::neg_inf();
  ListedKeys<kListed> listed;  // for the top-k cut (a NaN row lists meaningless keys, unused: no cut)
  if (merged)
    m = rank_key_logit(sh.cand.key[0]);
  else if (r.keep < lanes && r.keep <= kCandidates)
    list_largest<kThreads>(
        listed, sh.thread_max, z, lanes, inv_t, static_cast<int>(r.keep),
        [](float y, int64_t v) { return rank_key(y, v); }, [&](int64_t, float y) { m = chain_max(m, y); });
  else
    visit_row<kThreads>(z, lanes, inv_t, [&](int64_t, float y) { m = chain_max(m, y); });
  const float my_max = m;
  __syncthreads();
  sh.best_score[threadIdx.x] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    float all = fp::neg_inf();
    for (int t = 0; t < kThreads; ++t) all = chain_max(all, sh.best_score[t]);
    sh.max = normalize_zero(all);
  }
  __syncthreads();
  const float row_max = sh.max;
  const RowStats st{row_max, p.lse[blockIdx.x]};
  const bool samplable = row_samplable(st);

  // 2. The cut.
  SupportRow support{row_max, no_cut(), r.min_p};
  const bool cut = samplable && has_cut(r, lanes);
  bool candidates = false;
  if (cut) {
    if (merged) cut_among_candidates(sh, static_cast<int>(r.keep), true, 0, row_max, r);
    candidates = merged || (!p.radix_only && candidate_cut(sh, z, lanes, inv_t, row_max, my_max, listed, r));
    const uint64_t key = candidates ? sh.cand.key[sh.cut_index] : radix_cut(sh, z, lanes, inv_t, row_max, r);
    const int64_t id = rank_key_id(key);
    support.cut = {lane_y(z, id, inv_t), id};
  }

  // 3. The support.
  const bool draw = !q.replay;
  const uint64_t stream = draw && samplable ? q.row_stream(n) : 0;
  SupportPass pass{0.0f, 0, kNoToken, 0.0f};
  float best = fp::neg_inf();
  if (candidates) {
    pass = candidate_support(sh, z, inv_t, support, draw, stream);
  } else if (samplable && whole_support(support)) {  // every lane; lse_Sigma is lse
    int64_t best_id = kNoToken;
    float best_y = 0.0f;
    if (draw)
      visit_row<kThreads>(z, lanes, inv_t, [&](int64_t v, float yv) {
        const float score = gumbel_score(yv, stream, v);
        if (best_id == kNoToken || score_precedes(score, v, best, best_id)) {
          best = score;
          best_id = v;
          best_y = yv;
        }
      });
    pass.size = lanes;
    sh.best_score[threadIdx.x] = best;
    sh.best_id[threadIdx.x] = best_id;
    sh.best_y[threadIdx.x] = best_y;
  } else if (samplable) {
    int64_t best_id = kNoToken;
    float best_y = 0.0f;
    int count = 0;
    for (int64_t g = threadIdx.x; g < p.tiles_per_row; g += kThreads) {
      const int real = load_tile(z, g, lanes, inv_t, y);
      uint64_t mask = 0;
      for (int c = 0; c < real; ++c) {
        const int64_t id = g * kVocabTile + c;
        if (!in_support(y[c], id, support)) continue;
        mask |= uint64_t{1} << c;
        ++count;
        if (!draw) continue;
        const float score = gumbel_score(y[c], stream, id);
        if (best_id == kNoToken || score_precedes(score, id, best, best_id)) {
          best = score;
          best_id = id;
          best_y = y[c];
        }
      }
      tiles[g] = tile_summary_masked(y, mask);
      factors[g] = chain_factor_or_skip(tiles[g], row_max);
    }
    pass.size = static_cast<int64_t>(block_sum<kThreads>(sh.warp_total, static_cast<unsigned long long>(count)));
    sh.best_score[threadIdx.x] = best;
    sh.best_id[threadIdx.x] = best_id;
    sh.best_y[threadIdx.x] = best_y;
    __syncthreads();
    if (threadIdx.x < 32) {
      const float s = warp_chain(tiles, factors, p.tiles_per_row);
      if (threadIdx.x == 0) pass.sum = s;
    }
  }
  __syncthreads();

  // 4. The token, the outputs.
  if (samplable && draw) block_token(sh, pass);  // uniform over the block
  if (threadIdx.x != 0) return;
  float target_logit = 0.0f;
  if (q.replay) {
    const int64_t t = q.target(n);
    if (t != q.ignore_index) target_logit = lane_y(z, t, inv_t);
  }
  const bool outside = q.write_row(n, st, support, pass, target_logit);
  if (p.outside) p.outside[n] = outside ? 1 : 0;
}

// The fused kernel's temperatures for the program's rows: T, and 1 for a greedy row (T = 0).
__global__ void program_temperatures_kernel(const float* temperature, float* out, int64_t rows) {
  const int64_t n = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (n < rows) out[n] = temperature[n] == 0.0f ? 1.0f : temperature[n];
}

}  // namespace

void launch_program_temperatures(const float* temperature, float* out, int64_t rows, cudaStream_t stream) {
  if (rows == 0) return;
  program_temperatures_kernel<<<static_cast<unsigned>((rows + 255) / 256), 256, 0, stream>>>(temperature, out, rows);
  DETLOGP_CUDA_CHECK_LAUNCH();
}

void launch_sample_rows(const SampleRowsParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  launch_dependent(sample_rows_kernel, p.rows, kThreads, stream, p);
}

}  // namespace detlogp::sm90
