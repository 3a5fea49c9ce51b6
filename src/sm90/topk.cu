// The top-k output on the GPU (docs/contract.md §12): one CTA per row over a chunk of the serving
// logits, the K first real ids of the row in the order of topk_before, through their integer keys
// (topk_key: key order is that order, and every key is distinct):
//   1. one pass over the row (coalesced float4 rounds, visit_row): each thread keeps its kListed
//      largest keys in registers; the lists are sorted together in shared memory. Their K-th key is
//      at most the row's K-th largest key (they are distinct lanes of the row), so every top-K lane
//      is at or above it;
//   2. if no thread's last listed key reaches that bound, no unlisted lane does, and the first K of
//      the sorted lists are the output (the common case: one pass). Otherwise a second pass gathers
//      the lanes at or above the bound (a count pass and an exact prefix sum give each thread its
//      slots: no atomics; at most kCandidates, past that the K-th key itself is found by radix
//      selection and only the K lanes at or above it are gathered) and sorts them. With
//      fewer than K real lanes (a tensor-parallel shard), all of them, then id -1;
//   3. each one's logp is target_logp with the row's lse (full mode), the single-target bits; a
//      shard's list keeps y for the merge.
// With few rows (topk_split) a row's lanes are split into slices, steps 1-2 run on each slice by its
// own CTA into a scratch list of its K largest keys, and a second kernel sorts a row's slice lists
// and does step 3: the row's top K are the top K of its slices' top K.
// The block only orders exact comparisons of distinct keys, so the ids do not depend on how lanes
// meet threads or slices.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "core/device_ops.hpp"
#include "cuda/check.hpp"
#include "cuda/device.hpp"
#include "detlogp/reduce.hpp"
#include "detlogp/topk.hpp"
#include "sm90/device/block_select.cuh"
#include "sm90/device/ptx.cuh"
#include "sm90/device/wgmma_lane.cuh"
#include "sm90/launch_dependent.cuh"
#include "sm90/params.hpp"
#include "sm90/topk.hpp"

namespace detlogp::sm90 {
namespace {

constexpr int kThreads = 256;
constexpr int kListed = 8;  // keys each thread keeps in its first pass
constexpr int kCandidates = kThreads * kListed;
static_assert(kMaxTopk <= kCandidates, "the bound is the K-th of the listed keys: K <= kCandidates");
static_assert((kCandidates & (kCandidates - 1)) == 0, "a power-of-two sort size");
static_assert(kMaxSliceKeys <= kCandidates, "a row's slice lists fit the staging array");

struct TopkShared {
  union {
    RadixScratch<kThreads> radix;  // a row with more than kCandidates lanes above the bound
    uint64_t key[kCandidates];     // the gathered keys, then sorted descending; or the staged slice lists
  };
  uint64_t merged[kMaxTopk];  // a row's K largest keys from its slice lists
  int offset[kThreads];       // each thread's first slot among the gathered lanes
  int total;                  // lanes gathered
  int uncertain;              // some thread may hold more lanes at or above the bound than it listed
};

// The lanes a CTA selects from: a whole row of the chunk's logits or one slice of it.
struct RowSlice {
  const float* z;    // the slice's first lane
  int64_t lanes;     // its real lanes
  int64_t first_id;  // the global id of its first lane
};

// The key of each lane of a slice of serving logits: its y and its global id.
struct LaneKeys {
  int64_t first_id;
  __device__ __forceinline__ uint64_t operator()(float y, int64_t v) const { return topk_key(y, first_id + v); }
};

// The lanes at or above `floor`: with `out` null, this thread's count of them; otherwise they are
// stored from out[0] on (the slots the count gave, in the thread's visiting order). A lane whose y
// is below the floor's logit has a key below the floor (key_of keeps topk_key's order of y), so the
// float test comes first (a NaN y, or a NaN floor logit, fails it and takes the key test).
template <class KeyOf>
__device__ __forceinline__ int lanes_at_or_above(const RowSlice& r, float inv_t, uint64_t floor, uint64_t* out,
                                                 const KeyOf& key_of) {
  const float floor_y = rank_key_logit(floor);
  int n = 0;
  visit_row<kThreads>(r.z, r.lanes, inv_t, [&](int64_t v, float y) {
    if (y < floor_y) return;
    const uint64_t key = key_of(y, v);
    if (key < floor) return;
    if (out) out[n] = key;
    ++n;
  });
  return n;
}

// Gathers every lane at or above `floor` into sh.key when they are at most kCandidates (a count
// pass, each thread's first slot by an exact prefix sum, then the stores: no atomics); returns how
// many there are (more than kCandidates: nothing stored).
template <class KeyOf>
__device__ int gather_at_or_above(TopkShared& sh, const RowSlice& r, float inv_t, uint64_t floor, const KeyOf& key_of) {
  const int mine = lanes_at_or_above(r, inv_t, floor, nullptr, key_of);
  const int count = block_offsets<kThreads>(sh.offset, &sh.total, mine);
  if (count <= kCandidates) lanes_at_or_above(r, inv_t, floor, sh.key + sh.offset[threadIdx.x], key_of);
  __syncthreads();
  return count;
}

// The k largest keys of the slice's lanes into sh.key[0, k), descending, key 0 past its real lanes
// (steps 1 and 2 of the head comment). key_of(y, v): lane v's key (LaneKeys for serving logits; any
// map that orders keys by y first, with key 0 for a lane that is none). Called by every thread.
template <class KeyOf>
__device__ void top_keys(TopkShared& sh, const RowSlice& r, float inv_t, int k, const KeyOf& key_of) {
  // 1. Each thread's kListed largest keys over its lanes, in registers.
  ListedKeys<kListed> listed;
  list_largest<kThreads>(listed, sh.key, r.z, r.lanes, inv_t, k, key_of, [](int64_t, float) {});
  if (threadIdx.x == 0) sh.uncertain = 0;
  int count = sort_listed<kThreads>(sh.key, sh.offset, &sh.total, listed, k);

  // 2. The bound: the K-th largest listed key is at most the slice's K-th largest key (the lists
  //    are distinct lanes). A thread whose last listed key is below it has no other lane at or
  //    above it; if every thread is so, the listed keys hold every lane at or above the bound, so
  //    the first K of the sorted ones are the top K (key 0 past the real lanes). Otherwise the
  //    lanes at or above the bound are gathered in a second pass; past kCandidates of them, the
  //    K-th key itself by radix selection, then exactly the K lanes at or above it.
  uint64_t floor = sh.key[k - 1];
  if (listed.last() != 0 && listed.last() >= floor) sh.uncertain = 1;
  __syncthreads();
  if (sh.uncertain) {
    count = gather_at_or_above(sh, r, inv_t, floor, key_of);
    if (count > kCandidates) {
      const auto lane = [&](int64_t c) { return KeyWeight{key_of(lane_y(r.z, c, inv_t), c), 1u}; };
      floor = radix_select<kThreads>(sh.radix, r.lanes, lane, floor, static_cast<unsigned long long>(k));
      count = gather_at_or_above(sh, r, inv_t, floor, key_of);  // exactly K: the keys are distinct
    }
    sort_padded_descending<kThreads>(sh.key, count, pow2_at_least(count > k ? count : k));
  }
}

// 3. The outputs of call row `row` from its k largest keys (key 0: fewer real lanes than K, as in a
//    tensor-parallel shard). `z`: the row's logits, column c global id vocab_start + c.
__device__ void write_outputs(const TopkRowsParams& p, int64_t row, const float* z, float inv_t, const uint64_t* key) {
  for (int j = threadIdx.x; j < p.k; j += kThreads) {
    const int64_t out = row * p.k + j;
    if (key[j] == 0) {
      p.ids[out] = -1;
      if (p.logit) p.logit[out] = fp::neg_inf();
      continue;
    }
    const int64_t id = rank_key_id(key[j]);
    const float yj = lane_y(z, id - p.vocab_start, inv_t);
    p.ids[out] = id;
    if (p.lse)
      p.logp[out] = target_logp(yj, p.lse[row]);
    else
      p.logit[out] = yj;
  }
}

__device__ __forceinline__ float row_inverse_temperature(const TopkRowsParams& p, int64_t row) {
  return p.temperature_rows ? inverse_temperature(p.temperature_rows[row]) : p.inv_temperature;
}

// One CTA a row (slices == 1), or one a slice of a row, whose k largest keys go to slice_keys.
__global__ void __launch_bounds__(kThreads) topk_rows_kernel(const TopkRowsParams p) {
  __shared__ TopkShared sh;
  ptx::grid_dependency_wait();  // the logits (and lse) of the kernels before
  ptx::launch_dependents();
  const int64_t local = p.slices == 1 ? int64_t{blockIdx.x} : int64_t{blockIdx.x} / p.slices;
  const int64_t row = p.row_begin + local;
  const float* z = p.logits + local * p.logits_stride;
  const float inv_t = row_inverse_temperature(p, row);
  if (p.slices == 1) {
    top_keys(sh, RowSlice{z, p.lanes, p.vocab_start}, inv_t, p.k, LaneKeys{p.vocab_start});
    write_outputs(p, row, z, inv_t, sh.key);
    return;
  }
  const int64_t s = int64_t{blockIdx.x} % p.slices;
  const int64_t first = s * p.slice_lanes;
  const int64_t lanes = p.lanes - first < p.slice_lanes ? p.lanes - first : p.slice_lanes;
  top_keys(sh, RowSlice{z + first, lanes > 0 ? lanes : 0, p.vocab_start + first}, inv_t, p.k,
           LaneKeys{p.vocab_start + first});
  uint64_t* list = p.slice_keys + (local * p.slices + s) * p.k;
  for (int j = threadIdx.x; j < p.k; j += kThreads) list[j] = sh.key[j];
}

// A row's slice lists merged: the k largest of their slices * k keys (distinct, or 0), the outputs.
__global__ void __launch_bounds__(kThreads) topk_merge_slices_kernel(const TopkRowsParams p) {
  __shared__ TopkShared sh;
  ptx::grid_dependency_wait();  // the slice lists
  ptx::launch_dependents();
  const int64_t local = blockIdx.x;
  const int64_t row = p.row_begin + local;
  merge_sorted_lists<kThreads>(sh.merged, sh.key, p.slice_keys + local * p.slices * p.k, p.slices, p.k);
  write_outputs(p, row, p.logits + local * p.logits_stride, row_inverse_temperature(p, row), sh.merged);
}

// The candidate path (topk.hpp, TopkCandidatesParams). Group g of a row holds the lanes
// 8 j + 2 q + e of local tile g / kGroupsPerTile (q = g % kGroupsPerTile): global ids from
// group_first_id(g) to group_last_id(g), its max lane's id from the column the epilogue kept.
__device__ __forceinline__ int64_t group_tile_id(int64_t g) { return g / kGroupsPerTile * kVocabTile; }
__device__ __forceinline__ int64_t group_first_id(int64_t g) { return group_tile_id(g) + 2 * (g % kGroupsPerTile); }
__device__ __forceinline__ int64_t group_last_id(int64_t g) { return group_first_id(g) + 8 * 7 + 1; }
__device__ __forceinline__ int64_t group_of_id(int64_t id) {
  return id / kVocabTile * kGroupsPerTile + (id % kVocabTile % 8) / 2;
}

// A group's max as top_keys sees it: the key of its max lane; for a NaN max (the lane unknown) the
// smallest key a NaN lane of the group can have, a lower bound; key 0 for a group without real lanes.
struct GroupMaxKeys {
  const uint8_t* lane;  // the row's cand_lane
  __device__ __forceinline__ uint64_t operator()(float y, int64_t g) const {
    const uint8_t c = lane[g];
    if (c == kNoCandidateLane) return 0;
    return topk_key(y, fp::is_nan(y) ? group_last_id(g) : group_tile_id(g) + c);
  }
};

constexpr int kRecomputeGroupLanes = 16;  // a group's lanes, one half warp each
static_assert(kThreads == 16 * kRecomputeGroupLanes, "one group's lanes recomputed by the whole block");
constexpr int kFlaggedWindow = 512;  // flagged groups listed per scan of the row

struct CandidateShared {
  TopkShared top;
  uint64_t best[kMaxTopk];  // the row's K largest keys so far, descending (0: none)
  float best_y[kMaxTopk];   // their y
  uint64_t lane_key[kRecomputeGroupLanes];
  float lane_y[kRecomputeGroupLanes];
  int flagged[kFlaggedWindow];
  int total;
};

// Whether group g's maxima list can miss one of the row's K largest keys (floor: the K-th largest
// group key, floor_y its logit): its second largest lane could reach the floor (the second's key is
// at most that of its y at the group's first id); its max is NaN (its lanes unknown); or its max is
// a zero at or above the floor (the sign of that lane's y, which its logp keeps, is not stored).
__device__ __forceinline__ bool group_flagged(const TopkCandidatesParams& p, const float* max_row,
                                              const float* second_row, const uint8_t* lane_row, int64_t g,
                                              uint64_t floor, float floor_y) {
  const float y1 = max_row[g];
  if (y1 < floor_y) return false;  // its second is no larger (a NaN floor_y: floor 0, every group is tested)
  const uint8_t c = lane_row[g];
  if (c == kNoCandidateLane) return false;
  if (fp::is_nan(y1)) return topk_key(y1, group_first_id(g)) >= floor;
  if (y1 == 0.0f && topk_key(y1, group_tile_id(g) + c) >= floor) return true;
  return topk_key(second_row[g], group_first_id(g)) >= floor;
}

// A row's group maxima and lane bytes are read as vectors of kGroupVector groups (a row holds
// kGroupsPerTile groups a tile, so whole vectors; its arrays start 16-byte aligned), kGroupBatch
// vectors a thread in flight: the passes over a row are a few rounds of loads, not one load's
// latency a group.
constexpr int kGroupVector = 4;
constexpr int kGroupBatch = 8;
static_assert(kGroupsPerTile % kGroupVector == 0, "a row's groups are whole vectors");

struct GroupVectors {
  float4 max[kGroupBatch];
  uint32_t lane[kGroupBatch];  // the vector's kGroupVector lane bytes, group e in byte e
};

__device__ __forceinline__ float group_vector_max(const float4& v, int e) {
  return e == 0 ? v.x : (e == 1 ? v.y : (e == 2 ? v.z : v.w));
}

// The vectors of round g0 of thread `thread` among `threads`: vector b holds the groups from
// g0 + kGroupVector * (threads * b + thread). Past the row: -inf maxima and no lanes.
template <bool kLanes>
__device__ __forceinline__ void load_group_vectors(GroupVectors& v, const float* max_row, const uint8_t* lane_row,
                                                   int64_t groups, int64_t g0, int thread, int threads) {
#pragma unroll
  for (int b = 0; b < kGroupBatch; ++b) {
    const int64_t g = g0 + int64_t{kGroupVector} * (int64_t{threads} * b + thread);
    const bool in = g < groups;
    v.max[b] = in ? *reinterpret_cast<const float4*>(max_row + g)
                  : make_float4(fp::neg_inf(), fp::neg_inf(), fp::neg_inf(), fp::neg_inf());
    if constexpr (kLanes) v.lane[b] = in ? *reinterpret_cast<const uint32_t*>(lane_row + g) : 0xFFFFFFFFu;
  }
}

// fn(g) for the groups of thread `thread` among `threads` (each thread's in ascending g) whose max
// is not below floor_y (a NaN max or floor included: the groups group_flagged may flag).
template <class Fn>
__device__ __forceinline__ void visit_groups_reaching(const float* max_row, int64_t groups, int thread, int threads,
                                                      float floor_y, const Fn& fn) {
  const int64_t round = int64_t{kGroupVector} * kGroupBatch * threads;
  for (int64_t g0 = 0; g0 < groups; g0 += round) {
    GroupVectors v;
    load_group_vectors<false>(v, max_row, nullptr, groups, g0, thread, threads);
#pragma unroll
    for (int b = 0; b < kGroupBatch; ++b)
#pragma unroll
      for (int e = 0; e < kGroupVector; ++e) {
        const int64_t g = g0 + int64_t{kGroupVector} * (int64_t{threads} * b + thread) + e;
        if (g < groups && !(group_vector_max(v.max[b], e) < floor_y)) fn(g);
      }
  }
}

__device__ __forceinline__ uint64_t shfl_xor_u64(uint64_t v, int m) {
  const uint32_t lo = __shfl_xor_sync(0xFFFFFFFFu, static_cast<uint32_t>(v), m);
  const uint32_t hi = __shfl_xor_sync(0xFFFFFFFFu, static_cast<uint32_t>(v >> 32), m);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

__device__ __forceinline__ uint64_t shfl_u64(uint64_t v, int from) {
  const uint32_t lo = __shfl_sync(0xFFFFFFFFu, static_cast<uint32_t>(v), from);
  const uint32_t hi = __shfl_sync(0xFFFFFFFFu, static_cast<uint32_t>(v >> 32), from);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// Sorts the warp's 32 * R keys descending, element lane * R + r in v[r] of each lane: the bitonic
// network of sort_descending (the same compare-exchanges), its distances below R inside a lane's
// registers and the others between lanes by shuffles. Called by the whole warp.
template <int R>
__device__ __forceinline__ void warp_sort_descending(uint64_t (&v)[R]) {
  static_assert((R & (R - 1)) == 0 && R <= 32, "a power of two of keys a lane");
  const int lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll
  for (int k = 2; k <= 32 * R; k <<= 1)
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) {
      if (j < R) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if ((r & j) != 0) continue;  // the pair's lower element takes the exchange
          const bool descending = ((lane * R + r) & k) == 0;
          const uint64_t a = v[r], b = v[r ^ j];
          const bool swap = descending ? a < b : a > b;
          v[r] = swap ? b : a;
          v[r ^ j] = swap ? a : b;
        }
      } else {
        const int m = j / R;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint64_t other = shfl_xor_u64(v[r], m);
          const bool lower = (lane & m) == 0;
          const bool descending = ((lane * R + r) & k) == 0;
          const bool keep_larger = lower == descending;
          v[r] = keep_larger ? (v[r] > other ? v[r] : other) : (v[r] < other ? v[r] : other);
        }
      }
    }
}

// Element i of the warp's sorted keys (every lane returns it).
template <int R>
__device__ __forceinline__ uint64_t warp_sorted_at(const uint64_t (&v)[R], int i) {
  uint64_t mine = v[0];
#pragma unroll
  for (int r = 1; r < R; ++r) mine = i % R == r ? v[r] : mine;
  return shfl_u64(mine, i / R);
}

constexpr int kWarpRowsPerBlock = 4;

// The candidate path's common case, one warp a row: each lane lists its kListed largest group-max
// keys (GroupMaxKeys' keys, the maxima and bytes loaded as vectors), after the first round of every
// lane not offering a group below the K-th largest listed key (distinct groups: at most the row's
// K-th key, so the certainty test keeps its proof, as in list_largest); the warp's 32 * kListed
// listed keys sorted in registers give the K largest when no lane's last listed key reaches the K-th
// of them and no group is flagged (group_flagged). Then the outputs are written; otherwise the row
// is marked undecided and topk_candidates_kernel (a CTA a row, with the recomputation) does it.
__global__ void __launch_bounds__(32 * kWarpRowsPerBlock) topk_candidates_warp_kernel(const TopkCandidatesParams p) {
  const int64_t local = int64_t{blockIdx.x} * kWarpRowsPerBlock + threadIdx.x / 32;
  if (local >= p.rows) return;  // warp-uniform
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t row = p.row_begin + local;
  const float* max_row = p.cand_max + local * p.groups;
  const float* second_row = p.cand_second + local * p.groups;
  const uint8_t* lane_row = p.cand_lane + local * p.groups;
  const int k = p.k;
  ListedKeys<kListed> listed;
  float floor_y = rank_key_logit(0);  // none yet: NaN, which no y is below
  const int64_t round = int64_t{kGroupVector} * kGroupBatch * 32;
  for (int64_t g0 = 0; g0 < p.groups; g0 += round) {
    GroupVectors gv;
    load_group_vectors<true>(gv, max_row, lane_row, p.groups, g0, lane, 32);
#pragma unroll
    for (int b = 0; b < kGroupBatch; ++b)
#pragma unroll
      for (int e = 0; e < kGroupVector; ++e) {
        const float y = group_vector_max(gv.max[b], e);
        const auto c = static_cast<uint8_t>(gv.lane[b] >> (8 * e));
        if (c == kNoCandidateLane || y < floor_y) continue;
        const int64_t g = g0 + int64_t{kGroupVector} * (32 * b + lane) + e;
        listed.offer(y, [&] { return topk_key(y, fp::is_nan(y) ? group_last_id(g) : group_tile_id(g) + c); });
      }
    if (g0 == 0) {  // the floor after the first round
      uint64_t v[kListed];
#pragma unroll
      for (int r = 0; r < kListed; ++r) v[r] = listed.key[r];
      warp_sort_descending(v);
      floor_y = rank_key_logit(warp_sorted_at(v, k - 1));
    }
  }
  uint64_t v[kListed];
#pragma unroll
  for (int r = 0; r < kListed; ++r) v[r] = listed.key[r];
  warp_sort_descending(v);
  const uint64_t floor = warp_sorted_at(v, k - 1);
  const float floor_final_y = rank_key_logit(floor);
  bool undecided = listed.last() != 0 && listed.last() >= floor;
  visit_groups_reaching(max_row, p.groups, lane, 32, floor_final_y, [&](int64_t g) {
    undecided = undecided || group_flagged(p, max_row, second_row, lane_row, g, floor, floor_final_y);
  });
  undecided = __any_sync(0xFFFFFFFFu, undecided);
  if (lane == 0) p.undecided[local] = undecided ? 1 : 0;
  if (undecided) return;
#pragma unroll
  for (int r = 0; r < kListed; ++r) {
    const int j = lane * kListed + r;
    if (j >= k) break;
    const int64_t out = row * k + j;
    const uint64_t key = v[r];
    const int64_t id = key == 0 ? -1 : rank_key_id(key);
    p.ids[out] = id;
    p.logp[out] = key == 0 ? fp::neg_inf() : target_logp(max_row[group_of_id(id)], p.lse[row]);
  }
}

// One CTA a row of the chunk: the K largest group-max keys (top_keys over the groups), then every
// flagged group in turn replaced by its recomputed lanes (its entries leave the list, its real
// lanes are offered: the list stays the K largest of what it has seen), then the outputs. Exact:
// every lane not seen is below the floor, and the list holds K keys at or above it.
__global__ void __launch_bounds__(kThreads) topk_candidates_kernel(const TopkCandidatesParams p) {
  __shared__ CandidateShared sh;
  const int64_t local = blockIdx.x;
  if (!p.undecided[local]) return;  // the warp kernel wrote this row
  const int64_t row = p.row_begin + local;
  const float* max_row = p.cand_max + local * p.groups;
  const float* second_row = p.cand_second + local * p.groups;
  const uint8_t* lane_row = p.cand_lane + local * p.groups;
  const int k = p.k;
  top_keys(sh.top, RowSlice{max_row, p.groups, 0}, 1.0f, k, GroupMaxKeys{lane_row});
  const uint64_t floor = sh.top.key[k - 1];
  const float floor_y = rank_key_logit(floor);
  for (int j = threadIdx.x; j < k; j += kThreads) {
    const uint64_t key = sh.top.key[j];
    sh.best[j] = key;
    sh.best_y[j] = key == 0 ? 0.0f : max_row[group_of_id(rank_key_id(key))];  // flagged groups' entries leave below
  }

  int mine = 0;
  visit_groups_reaching(max_row, p.groups, threadIdx.x, kThreads, floor_y, [&](int64_t g) {
    mine += group_flagged(p, max_row, second_row, lane_row, g, floor, floor_y) ? 1 : 0;
  });
  const int flagged = block_offsets<kThreads>(sh.top.offset, &sh.total, mine);
  const float inv_t = p.temperature_rows ? inverse_temperature(p.temperature_rows[row]) : p.inv_temperature;
  const uint16_t* hidden_row = p.hidden + row * p.hidden_stride;
  for (int window = 0; window < flagged; window += kFlaggedWindow) {
    // The flagged groups with slots [window, window + kFlaggedWindow), in the threads' group order.
    int slot = sh.top.offset[threadIdx.x];
    visit_groups_reaching(max_row, p.groups, threadIdx.x, kThreads, floor_y, [&](int64_t g) {
      if (!group_flagged(p, max_row, second_row, lane_row, g, floor, floor_y)) return;
      if (slot >= window && slot < window + kFlaggedWindow) sh.flagged[slot - window] = static_cast<int>(g);
      ++slot;
    });
    __syncthreads();
    const int here = flagged - window < kFlaggedWindow ? flagged - window : kFlaggedWindow;
    for (int f = 0; f < here; ++f) {
      const int64_t g = sh.flagged[f];
      // The group's lanes, one half warp each: z by the wgmma model, then the epilogue's bias and scale.
      const int lane = static_cast<int>(threadIdx.x / 16);
      const int64_t id = group_first_id(g) + 8 * (lane / 2) + lane % 2;
      // Every thread runs the dot (the warp together); a half warp past the lanes runs lane 0's and drops it.
      const bool real = id < p.lanes;
      float z = wgmma_model_dot_half_warp(hidden_row, p.weight + (real ? id : 0) * p.weight_stride, p.dim);
      float y = 0.0f;
      uint64_t key = 0;
      if (real) {
        if (p.bias) z = add_bias(z, p.bias[id]);
        y = scale_logit(z, inv_t);
        key = topk_key(y, id);
      }
      if (threadIdx.x % 16 == 0) {
        sh.lane_key[lane] = key;
        sh.lane_y[lane] = y;
      }
      // The group's entries leave the list (its max, or a NaN max's lower bound).
      for (int j = threadIdx.x; j < k; j += kThreads)
        if (sh.best[j] != 0 && group_of_id(rank_key_id(sh.best[j])) == g) sh.best[j] = 0;
      __syncthreads();
      // The K largest of the list and the group's lanes, each with its y.
      constexpr int kMerge = 256;  // a power of two above the list and one group's lanes
      static_assert(kMerge >= kMaxTopk + kRecomputeGroupLanes && kMerge <= kCandidates);
      for (int i = threadIdx.x; i < kMerge; i += kThreads)
        sh.top.key[i] = i < k ? sh.best[i] : (i < k + kRecomputeGroupLanes ? sh.lane_key[i - k] : 0);
      __syncthreads();
      sort_descending<kThreads>(sh.top.key, pow2_at_least(k + kRecomputeGroupLanes));
      uint64_t kept = 0;
      float kept_y = 0.0f;
      if (threadIdx.x < k) {
        kept = sh.top.key[threadIdx.x];
        if (kept != 0) {
          for (int i = 0; i < kRecomputeGroupLanes; ++i)
            if (sh.lane_key[i] == kept) kept_y = sh.lane_y[i];
          for (int i = 0; i < k; ++i)
            if (sh.best[i] == kept) kept_y = sh.best_y[i];
        }
      }
      __syncthreads();
      if (threadIdx.x < k) {
        sh.best[threadIdx.x] = kept;
        sh.best_y[threadIdx.x] = kept_y;
      }
      __syncthreads();
    }
  }
  for (int j = threadIdx.x; j < k; j += kThreads) {
    const int64_t out = row * k + j;
    const uint64_t key = sh.best[j];
    p.ids[out] = key == 0 ? -1 : rank_key_id(key);
    p.logp[out] = key == 0 ? fp::neg_inf() : target_logp(sh.best_y[j], p.lse[row]);
  }
}

struct DeviceTopkListView {
  const float* logit;
  const int64_t* ids;
};

struct TopkMergeParams {
  DeviceTopkListView lists[kMaxMergeSegments];
  int32_t ranks = 0;
  int32_t k = 0;
  int64_t rows = 0;
  const float* lse = nullptr;
  int64_t* ids = nullptr;
  float* logp = nullptr;
};

// One thread a row: the ranks' lists offered in rank order, as the host merge does.
__global__ void topk_merge_kernel(const TopkMergeParams p) {
  const int64_t n = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (n >= p.rows) return;
  TopkEntry list[kMaxTopk];
  int count = 0;
  for (int r = 0; r < p.ranks; ++r)
    topk_offer_list(list, p.k, count, p.lists[r].logit + n * p.k, p.lists[r].ids + n * p.k);
  const float lse = p.lse[n];
  for (int j = 0; j < p.k; ++j) {
    p.ids[n * p.k + j] = j < count ? list[j].id : -1;
    p.logp[n * p.k + j] = j < count ? target_logp(list[j].y, lse) : fp::neg_inf();
  }
}

}  // namespace

TopkSplit topk_split(int64_t rows, int64_t lanes, int sms, int64_t k) {
  constexpr int64_t kRound = int64_t{32} * kThreads;  // visit_row's float4 round, list_largest's first
  const int64_t most = kMaxSliceKeys / std::max<int64_t>(k, 1);
  const int64_t want = rows > 0 ? std::min<int64_t>(most, 2 * int64_t{sms} / rows) : 1;
  if (want < 2 || lanes < 2 * kRound) return {1, lanes};
  const int64_t slice = ((lanes + want - 1) / want + kRound - 1) / kRound * kRound;
  const auto slices = static_cast<int32_t>((lanes + slice - 1) / slice);
  if (slices < 2) return {1, lanes};
  return {slices, slice};
}

void launch_topk_rows(const TopkRowsParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  DETLOGP_CHECK(p.slices == 1 || (int64_t{p.slices} * p.k <= kMaxSliceKeys && p.slice_keys != nullptr),
                "internal error: a split top-k launch without its scratch lists");
  launch_dependent(topk_rows_kernel, p.rows * p.slices, kThreads, stream, p);
  if (p.slices == 1) return;
  launch_dependent(topk_merge_slices_kernel, p.rows, kThreads, stream, p);
}

void launch_topk_slice_lists(const TopkRowsParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  DETLOGP_CHECK(p.slices > 1 && p.k >= 1 && p.k <= kMaxTopk && int64_t{p.slices} * p.k <= kMaxSliceKeys &&
                    p.slice_keys != nullptr,
                "internal error: slice lists without a split, its scratch or a valid k");
  launch_dependent(topk_rows_kernel, p.rows * p.slices, kThreads, stream, p);
}

void launch_topk_candidates(const TopkCandidatesParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  DETLOGP_CHECK(p.k >= 1 && p.k <= kMaxTopk, "internal error: top-k candidates with k=" << p.k);
  DETLOGP_CHECK(p.undecided != nullptr, "internal error: top-k candidates without the undecided flags");
  topk_candidates_warp_kernel<<<static_cast<unsigned>((p.rows + kWarpRowsPerBlock - 1) / kWarpRowsPerBlock),
                                32 * kWarpRowsPerBlock, 0, stream>>>(p);
  DETLOGP_CUDA_CHECK_LAUNCH();
  topk_candidates_kernel<<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
  DETLOGP_CUDA_CHECK_LAUNCH();
}

}  // namespace detlogp::sm90

namespace detlogp::detail {

void device_merge_topk(const std::vector<DeviceTopkList>& ranks, int64_t rows, int64_t k, const float* lse,
                       int64_t* ids, float* logp, int device, void* stream) {
  DETLOGP_CHECK(k >= 1 && k <= kMaxTopk, "the device top-k merge takes 1.." << kMaxTopk << " entries, got " << k);
  DETLOGP_CHECK(!ranks.empty() && ranks.size() <= static_cast<size_t>(sm90::kMaxMergeSegments),
                "the device top-k merge takes 1.." << sm90::kMaxMergeSegments << " ranks, got " << ranks.size());
  if (rows == 0) return;
  cuda::DeviceGuard guard(device);
  sm90::TopkMergeParams p{};
  for (size_t r = 0; r < ranks.size(); ++r) {
    DETLOGP_CHECK(ranks[r].logit && ranks[r].ids, "rank " << r << " carries no top-k list");
    p.lists[r] = {ranks[r].logit, ranks[r].ids};
  }
  p.ranks = static_cast<int32_t>(ranks.size());
  p.k = static_cast<int32_t>(k);
  p.rows = rows;
  p.lse = lse;
  p.ids = ids;
  p.logp = logp;
  sm90::topk_merge_kernel<<<static_cast<unsigned>((rows + 127) / 128), 128, 0, static_cast<cudaStream_t>(stream)>>>(p);
  DETLOGP_CUDA_CHECK_LAUNCH();
}

}  // namespace detlogp::detail
