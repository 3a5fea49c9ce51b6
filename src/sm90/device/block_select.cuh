// Block-wide selection over 64-bit rank keys (detlogp/rank.hpp, detlogp/topk.hpp) for the row
// kernels that read a row of serving logits with one CTA: the sampling program's cut and the top-k
// output. Every operation here is exact (integer sums, comparisons of distinct keys), so its result
// does not depend on the number of threads or on the order in which they visit the lanes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "detlogp/config.hpp"
#include "detlogp/rank.hpp"
#include "detlogp/reduce.hpp"

namespace detlogp::sm90 {

// The y of lane v of a row of serving logits (the same fl(z * inv_t) every pass).
__device__ __forceinline__ float lane_y(const float* z, int64_t v, float inv_t) { return scale_logit(z[v], inv_t); }

// Tile g's scaled logits into y[0, real) (real lanes of the tile), returns real. A whole tile at a
// 16-byte aligned address is read as float4s.
__device__ __forceinline__ int load_tile(const float* z, int64_t g, int64_t lanes, float inv_t, float* y) {
  const int64_t first = g * kVocabTile;
  const int real = lanes - first < kVocabTile ? static_cast<int>(lanes - first) : kVocabTile;
  const float* src = z + first;
  if (real == kVocabTile && (reinterpret_cast<uintptr_t>(src) & 15u) == 0) {
#pragma unroll
    for (int c = 0; c < kVocabTile; c += 4) {
      const float4 q = __ldg(reinterpret_cast<const float4*>(src + c));
      y[c] = scale_logit(q.x, inv_t);
      y[c + 1] = scale_logit(q.y, inv_t);
      y[c + 2] = scale_logit(q.z, inv_t);
      y[c + 3] = scale_logit(q.w, inv_t);
    }
    return real;
  }
  for (int c = 0; c < real; ++c) y[c] = lane_y(z, first + c, inv_t);
  return real;
}

inline constexpr int kRadixDigitBits = 4;
inline constexpr int kRadixDigits = 1 << kRadixDigitBits;

// The float4 loads a thread has in flight in one round of visit_row.
inline constexpr int kRowVectors = 8;

// One round of visit_row's float4 loads at lane v0 of a 16-byte aligned row (v0 a multiple of 4,
// v0 + 4 * kRowVectors * kThreads <= lanes): thread t reads the float4 at 4t of each kThreads x
// 4-lane block, so a warp's load is one coalesced 512-byte run; lane(b, v, y) for each of its lanes,
// b = 4i + c its place among the thread's lanes of the round (block i, component c).
template <int kThreads, class Lane>
__device__ __forceinline__ void visit_vector_round_places(const float* z, int64_t v0, float inv_t, const Lane& lane) {
  const float4* src = reinterpret_cast<const float4*>(z + v0) + threadIdx.x;
  float4 q[kRowVectors];
#pragma unroll
  for (int i = 0; i < kRowVectors; ++i) q[i] = __ldg(src + i * kThreads);
#pragma unroll
  for (int i = 0; i < kRowVectors; ++i) {
    const int64_t v = v0 + 4 * (int64_t{i} * kThreads + threadIdx.x);
    lane(4 * i, v, scale_logit(q[i].x, inv_t));
    lane(4 * i + 1, v + 1, scale_logit(q[i].y, inv_t));
    lane(4 * i + 2, v + 2, scale_logit(q[i].z, inv_t));
    lane(4 * i + 3, v + 3, scale_logit(q[i].w, inv_t));
  }
}

// The same round, lane(v, y) for each lane.
template <int kThreads, class Lane>
__device__ __forceinline__ void visit_vector_round(const float* z, int64_t v0, float inv_t, const Lane& lane) {
  visit_vector_round_places<kThreads>(z, v0, inv_t, [&](int, int64_t v, float y) { lane(v, y); });
}

// Calls lane(v, y) for every lane v of a row of serving logits, y its scaled logit, each lane once,
// in an order that suits the loads: rounds of visit_vector_round (a thread has kRowVectors loads in
// flight: a row read by one CTA is bound by the loads in flight, not by the bytes). The lanes past
// the last whole round, and every lane of a row not 16-byte aligned, go lane by lane with the same
// coalescing. Callers only make exact decisions per lane, so the visiting order does not change
// their result.
template <int kThreads, class Lane>
__device__ __forceinline__ void visit_row(const float* z, int64_t lanes, float inv_t, const Lane& lane) {
  constexpr int64_t kVectorRound = int64_t{4} * kRowVectors * kThreads;
  constexpr int kScalars = 16;
  constexpr int64_t kScalarRound = int64_t{kScalars} * kThreads;
  int64_t v0 = 0;
  if ((reinterpret_cast<uintptr_t>(z) & 15u) == 0)
    for (; v0 + kVectorRound <= lanes; v0 += kVectorRound) visit_vector_round<kThreads>(z, v0, inv_t, lane);
  for (; v0 + kScalarRound <= lanes; v0 += kScalarRound) {
    float q[kScalars];
#pragma unroll
    for (int i = 0; i < kScalars; ++i) q[i] = __ldg(z + v0 + i * kThreads + threadIdx.x);
#pragma unroll
    for (int i = 0; i < kScalars; ++i) lane(v0 + i * kThreads + threadIdx.x, scale_logit(q[i], inv_t));
  }
  for (int64_t v = v0 + threadIdx.x; v < lanes; v += kThreads) lane(v, lane_y(z, v, inv_t));
}

// A thread's kListed largest keys seen so far (descending; key 0, below every lane's key since no y
// maps to ordinal 0, where it has seen fewer lanes), kept in registers while it visits its lanes.
// `last_y`, the logit of the last listed key, lets most lanes leave on one float compare: a y below
// it has a smaller key whatever its id (the keys order y first). Key 0 and a NaN key give a NaN
// last_y, which no lane is below, so such lanes always take the key test. A floor (raise_floor, a
// logit no listed lane needs to reach; NaN: none) joins that compare: `bar` is the larger of the
// two (fmaxf leaves the other where one is NaN), and y < bar exactly when y is below either.
template <int kListed>
struct ListedKeys {
  static_assert(kListed >= 1 && kListed <= 16, "a short list kept in registers");
  uint64_t key[kListed];
  float last_y;
  float floor_y;
  float bar;

  __device__ __forceinline__ ListedKeys() : last_y(rank_key_logit(0)), floor_y(rank_key_logit(0)), bar(last_y) {
#pragma unroll
    for (int i = 0; i < kListed; ++i) key[i] = 0;
  }
  // Lanes below `floor` are offered no more (a NaN floor: every lane is).
  __device__ __forceinline__ void raise_floor(float floor) {
    floor_y = floor;
    bar = fmaxf(floor_y, last_y);
  }
  // Lists the lane whose logit is y, its key from key_of() (computed only past the float test).
  template <class KeyOf>
  __device__ __forceinline__ void offer(float y, const KeyOf& key_of) {
    if (y < bar) return;
    const uint64_t k = key_of();
    if (k <= key[kListed - 1]) return;
    key[kListed - 1] = k;
#pragma unroll
    for (int i = kListed - 1; i > 0; --i)
      if (key[i] > key[i - 1]) {
        const uint64_t t = key[i];
        key[i] = key[i - 1];
        key[i - 1] = t;
      }
    last_y = rank_key_logit(key[kListed - 1]);
    bar = fmaxf(floor_y, last_y);
  }
  __device__ __forceinline__ uint64_t last() const { return key[kListed - 1]; }
};

// Sorts key[0, n) descending (n a power of two, n >= 2) by a bitonic network: keys are distinct
// or, where equal, interchangeable, so the result is one array whatever the network.
template <int kThreads>
__device__ void sort_descending(uint64_t* key, int n) {
  for (int k = 2; k <= n; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n; i += kThreads) {
        const int l = i ^ j;
        if (l <= i) continue;
        const uint64_t a = key[i], b = key[l];
        if ((i & k) == 0 ? a < b : a > b) {
          key[i] = b;
          key[l] = a;
        }
      }
      __syncthreads();
    }
}

// key[0, count) sorted descending over key[0, size) (size a power of two >= count), the entries past
// count padded with key 0 (below every lane's key), as the listing's candidates are read.
template <int kThreads>
__device__ void sort_padded_descending(uint64_t* key, int count, int size) {
  for (int i = count + static_cast<int>(threadIdx.x); i < size; i += kThreads) key[i] = 0;
  __syncthreads();
  sort_descending<kThreads>(key, size);
}

// The k-th largest (1 <= k <= kThreads) of the threads' keys, one a thread (distinct, or 0 and
// interchangeable), staged in scratch[kThreads] of shared memory; every thread returns it. By
// counting: a nonzero key's place in the descending order is the count of larger keys, so the key at
// place k - 1 is the k-th, and none there (fewer than k nonzero keys) leaves 0, as a sort would.
// Every thread reads every staged key (one broadcast read each), with no network of barriers.
template <int kThreads>
__device__ uint64_t kth_largest_of_threads(uint64_t* scratch, uint64_t mine, int k) {
  __shared__ uint64_t kth;
  if (threadIdx.x == 0) kth = 0;
  scratch[threadIdx.x] = mine;
  __syncthreads();
  if (mine != 0) {
    int place = 0;
#pragma unroll 8
    for (int t = 0; t < kThreads; ++t) place += scratch[t] > mine ? 1 : 0;
    if (place == k - 1) kth = mine;
  }
  __syncthreads();
  const uint64_t out = kth;
  __syncthreads();  // every thread has read it before scratch or kth is reused
  return out;
}

// The k-th largest (1 <= k <= kThreads) of one 32-bit value a thread; every thread returns it. A
// bisection over the bits from the top: each step counts the threads at or above a candidate with
// one counting barrier (an exact integer count), so no shared memory and few instructions a thread
// (32 barriers of latency).
template <int kThreads>
__device__ uint32_t kth_largest_u32_of_threads(uint32_t mine, int k) {
  uint32_t x = 0;
#pragma unroll 1
  for (int bit = 31; bit >= 0; --bit) {
    const uint32_t c = x | (1u << bit);
    if (__syncthreads_count(mine >= c ? 1 : 0) >= k) x = c;
  }
  return x;
}

// The place of bit b (b = 4i + c) of a thread's round mask in a float4 round at lane v0: thread t
// holds lanes 4t + c of each kThreads x 4-lane block i (visit_vector_round's order).
template <int kThreads>
__device__ __forceinline__ int64_t round_lane(int64_t v0, int b) {
  return v0 + int64_t{4} * (int64_t{b / 4} * kThreads + threadIdx.x) + b % 4;
}

// Offers the lanes of a round whose bit is set in `passing` (those at or above the list's bar when
// the round was read), in ascending bit order, each lane's y read again (the same fl(z * inv_t); the
// line was just loaded): one copy of the insertion code for the round instead of one a lane, and a
// warp runs it as often as its busiest thread has lanes to offer, not once a lane place where any
// thread has one. The bar only rises while a round is offered, so a lane below it when the round
// was read would not be listed anyway, and offer() tests the rest against the bar of its turn, as
// the lane-by-lane order would.
template <int kThreads, int kListed, class KeyOf>
__device__ __forceinline__ void offer_passing(ListedKeys<kListed>& listed, const float* z, int64_t v0, float inv_t,
                                              uint32_t passing, const KeyOf& key_of) {
#pragma unroll 1
  while (passing != 0) {
    const int b = __ffs(passing) - 1;
    passing &= passing - 1;
    const int64_t v = round_lane<kThreads>(v0, b);
    const float y = lane_y(z, v, inv_t);
    listed.offer(y, [&] { return key_of(y, v); });
  }
}

// Each thread's kListed largest keys (key_of(y, v)) over a row of serving logits, into `listed`,
// for a selection of the k largest; also(v, y) sees every lane. Offering a lane costs a warp the
// 64-bit insertion whenever one of its threads lists, and few lanes a thread reach its own last
// key while its list fills, so no lane is offered below a floor: the k-th largest of one key a
// thread (distinct lanes: at most the row's k-th largest key, and k lanes reach it), when
// k <= kThreads. A lane below it is no top-k lane, and a lane that was not offered is below every
// listed bound that matters: each of the k threads whose key reaches the floor keeps a listed key
// at or above it, so the listed keys' k-th is at or above the floor and at most the row's k-th, and
// the certainty test (no thread's last listed key at or above that bound) keeps its proof.
// On a row of more than kThreads lanes (16-byte aligned if it has more than one round): the first
// round's loads (its lanes, if the row is shorter) stay in registers while the floor is taken from
// each thread's largest key of them, then the round is offered above it;
// the floor is raised after rounds 2, 4, 8, ... from each thread's largest listed key (the same as
// its largest lane whenever that lane reaches the floor, so the k-th of them is the k-th of the
// threads' maxima so far), which keeps the lanes offered to ~k per doubling of the lanes seen. The
// floor is compared as a logit (the keys order y first): the k-th of the keys' upper 32 bits
// (rank_ord(y), key 0 below every lane). Otherwise (an unaligned longer row, k > kThreads) the
// floor comes from the lists after a first round offered whole. `scratch`: kThreads keys of shared memory (that path).
// Called by every thread of the block.
template <int kThreads, int kListed, class KeyOf, class Also>
__device__ void list_largest(ListedKeys<kListed>& listed, uint64_t* scratch, const float* z, int64_t lanes, float inv_t,
                             int k, const KeyOf& key_of, const Also& also) {
  constexpr int64_t kRound = int64_t{4} * kRowVectors * kThreads;  // one round of visit_row's loads
  const bool has_floor = k >= 1 && k <= kThreads;
  const bool aligned = (reinterpret_cast<uintptr_t>(z) & 15u) == 0;
  if (has_floor && lanes > kThreads && (aligned || lanes <= kRound)) {
    // The floor's logit from one key a thread (a key 0 or a NaN key there gives a NaN floor: every
    // lane is offered).
    const auto floor_of = [&](uint64_t mine) {
      return rank_key_logit(uint64_t{kth_largest_u32_of_threads<kThreads>(static_cast<uint32_t>(mine >> 32), k)} << 32);
    };
    // The first round: float4 loads when whole and aligned, else the same lanes one by one (those
    // past the row are none).
    const bool whole = lanes >= kRound && aligned;
    const auto lane_of = [](int i, int c) { return round_lane<kThreads>(0, 4 * i + c); };
    const auto part = [](const float4& v, int c) { return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w; };
    const auto real = [&](int i, int c) { return whole || lane_of(i, c) < lanes; };
    float4 q[kRowVectors];
    if (whole) {
      const float4* src = reinterpret_cast<const float4*>(z) + threadIdx.x;
#pragma unroll
      for (int i = 0; i < kRowVectors; ++i) q[i] = __ldg(src + i * kThreads);
    } else {
#pragma unroll
      for (int i = 0; i < kRowVectors; ++i) {
        float f[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) f[c] = real(i, c) ? __ldg(z + lane_of(i, c)) : 0.0f;
        q[i] = make_float4(f[0], f[1], f[2], f[3]);
      }
    }
    // The thread's largest lane by y (the first of equal ones; -1: the thread has none); any lane
    // of the thread would do (a NaN first lane stays the choice), and a lane whose key is 0 counts
    // as none.
    float best_y = 0.0f;
    int best = -1;
#pragma unroll
    for (int i = 0; i < kRowVectors; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (!real(i, c)) continue;
        const float y = scale_logit(part(q[i], c), inv_t);
        also(lane_of(i, c), y);
        const bool larger = best < 0 || y > best_y;
        best = larger ? 4 * i + c : best;
        best_y = larger ? y : best_y;
      }
    listed.raise_floor(floor_of(best < 0 ? 0 : key_of(best_y, lane_of(best / 4, best % 4))));
    static_assert(4 * kRowVectors <= 32, "a round's lanes a thread fit a 32-bit mask");
    uint32_t passing = 0;
#pragma unroll
    for (int i = 0; i < kRowVectors; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (real(i, c) && !(scale_logit(part(q[i], c), inv_t) < listed.bar)) passing |= 1u << (4 * i + c);
    offer_passing<kThreads>(listed, z, 0, inv_t, passing, key_of);
    if (lanes <= kRound) return;
    const int64_t rounds = lanes / kRound;
#pragma unroll 1
    for (int64_t r = 1; r < rounds; ++r) {
      if (r >= 2 && (r & (r - 1)) == 0) listed.raise_floor(floor_of(listed.key[0]));
      const int64_t v0 = r * kRound;
      const float bar = listed.bar;
      uint32_t round_passing = 0;
      visit_vector_round_places<kThreads>(z, v0, inv_t, [&](int b, int64_t v, float y) {
        also(v, y);
        if (!(y < bar)) round_passing |= 1u << b;
      });
      offer_passing<kThreads>(listed, z, v0, inv_t, round_passing, key_of);
    }
    const auto lane = [&](int64_t v, float y) {
      also(v, y);
      listed.offer(y, [&] { return key_of(y, v); });
    };
    const int64_t done = rounds * kRound;
    visit_row<kThreads>(z + done, lanes - done, inv_t, [&](int64_t u, float y) { lane(done + u, y); });
    return;
  }
  const int64_t head = lanes < kRound ? lanes : kRound;  // (an unaligned row, or no floor)
  visit_row<kThreads>(z, head, inv_t, [&](int64_t v, float y) {
    also(v, y);
    listed.offer(y, [&] { return key_of(y, v); });
  });
  if (head == lanes) return;
  if (has_floor) listed.raise_floor(rank_key_logit(kth_largest_of_threads<kThreads>(scratch, listed.key[0], k)));
  visit_row<kThreads>(z + head, lanes - head, inv_t, [&](int64_t u, float y) {
    also(head + u, y);
    listed.offer(y, [&] { return key_of(y, head + u); });
  });
}

__device__ __forceinline__ int pow2_at_least(int n) {
  int p = 2;
  while (p < n) p <<= 1;
  return p;
}

// A warp's sum of one integer per lane (exact in any order); every lane returns it.
__device__ __forceinline__ unsigned long long warp_sum(unsigned long long v) {
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// Each thread's first slot when thread t contributes `mine` entries in thread order: count[t] in
// shared memory gets the exclusive prefix sum of thread t (warp scans by shuffles, then the warps'
// totals; exact integer sums) and every thread returns the total. Called by every thread of the
// block with its own count.
template <int kThreads>
__device__ int block_offsets(int* count, int* total, int mine) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps");
  __shared__ int warp_total[kThreads / 32];
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x / 32);
  int inclusive = mine;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int below = __shfl_up_sync(0xFFFFFFFFu, inclusive, o);
    if (lane >= o) inclusive += below;
  }
  __syncthreads();  // earlier readers of count[], warp_total and *total are done
  if (lane == 31) warp_total[warp] = inclusive;
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < kThreads / 32; ++w) {
    const int t = warp_total[w];
    if (w < warp) before += t;
    all += t;
  }
  count[threadIdx.x] = before + inclusive - mine;
  if (threadIdx.x == 0) *total = all;
  __syncthreads();
  return all;
}

// The nonzero keys of staged[0, count) (count <= kThreads; the nonzero ones distinct) in descending
// order into out[0, nonzero count): a key's place is the count of larger keys, so the array is the one
// a sort gives, with no network of barriers. out may be staged itself; out's other entries are left
// as they are. Called by every thread of the block; out is ready for every thread after its own
// __syncthreads().
template <int kThreads>
__device__ void order_by_place(uint64_t* out, const uint64_t* staged, int count) {
  __syncthreads();  // staged is written
  const int t = static_cast<int>(threadIdx.x);
  const uint64_t v = t < count ? staged[t] : 0;
  int place = 0;
  if (v != 0)
    for (int i = 0; i < count; ++i) place += staged[i] > v ? 1 : 0;
  __syncthreads();  // every read of staged is done (out may be it)
  if (v != 0) out[place] = v;
}

// Sorts into key[] (descending, 0-padded to a power of two >= k) the threads' listed keys that can
// be among the k largest of the row, and returns how many there are (every thread the same): with
// k <= kThreads only those at or above the k-th largest of the threads' maxima (distinct lanes, so
// a bound at most the row's k-th key, and k listed keys reach it: the listed k-th is among them),
// else every listed key. Compacting first keeps the sort to ~k keys instead of kThreads * kListed
// (a single row's CTA waits on each of the network's stages). key[] holds kThreads * kListed
// entries, offset[] kThreads ints; called by every thread of the block.
template <int kThreads, int kListed>
__device__ int sort_listed(uint64_t* key, int* offset, int* total, const ListedKeys<kListed>& listed, int k) {
  uint64_t bound = k <= kThreads ? kth_largest_of_threads<kThreads>(key, listed.key[0], k) : 0;
  if (bound == 0) bound = 1;  // every listed lane (key 0 marks an empty slot)
  int mine = 0;
#pragma unroll
  for (int i = 0; i < kListed; ++i) mine += listed.key[i] >= bound ? 1 : 0;
  const int count = block_offsets<kThreads>(offset, total, mine);
  int slot = offset[threadIdx.x];
#pragma unroll
  for (int i = 0; i < kListed; ++i)
    if (listed.key[i] >= bound) key[slot++] = listed.key[i];
  const int size = pow2_at_least(count > k ? count : k);
  if (count <= kThreads) {  // the compacted keys are distinct and none is 0
    order_by_place<kThreads>(key, key, count);
    for (int i = count + static_cast<int>(threadIdx.x); i < size; i += kThreads) key[i] = 0;
    __syncthreads();
    return count;
  }
  sort_padded_descending<kThreads>(key, count, size);
  return count;
}

// The first k keys of `slices` lists merged, into out[0, k) descending (key 0 where there are fewer):
// list s is lists[s * k, s * k + k), descending, key 0 past its real keys, and the real keys of all
// lists are distinct (lanes). A key's place in the merged order is its index in its own list plus, in
// each other list, the count of larger keys (a binary search), so the result is a sort's. Only keys
// at or above the largest of the lists' k-th keys are placed: that list alone holds k keys at or
// above it, so a smaller key's place is k or more. `staged`: slices * k keys of shared memory (the
// lists are read from there). Called by every thread of the block.
template <int kThreads>
__device__ void merge_sorted_lists(uint64_t* out, uint64_t* staged, const uint64_t* lists, int slices, int k) {
  const int n = slices * k;
  for (int i = threadIdx.x; i < n; i += kThreads) staged[i] = lists[i];
  for (int i = threadIdx.x; i < k; i += kThreads) out[i] = 0;
  __syncthreads();
  uint64_t floor = 0;
  for (int s = 0; s < slices; ++s) floor = staged[s * k + k - 1] > floor ? staged[s * k + k - 1] : floor;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const uint64_t key = staged[i];
    if (key == 0 || key < floor) continue;
    const int own = i / k;
    int place = i - own * k;
    for (int t = 0; t < slices && place < k; ++t) {
      if (t == own) continue;
      const uint64_t* list = staged + t * k;
      int lo = 0, hi = k;  // the first entry below key: the count of larger ones
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (list[mid] > key)
          lo = mid + 1;
        else
          hi = mid;
      }
      place += lo;
    }
    if (place < k) out[place] = key;
  }
  __syncthreads();
}

// The radix selection's shared state: each thread's digit histogram row, the selected key's digits
// so far and what remains to select inside them.
template <int kThreads>
struct RadixScratch {
  unsigned long long hist[kRadixDigits][kThreads];
  unsigned long long prefix;
  unsigned long long need;
};

// Sums every thread's row of the histograms into row 0 (hist[d][0]) by a tree of integer adds.
template <int kThreads>
__device__ void sum_histograms(RadixScratch<kThreads>& sh) {
  for (int stride = kThreads / 2; stride >= 1; stride /= 2) {
    if (threadIdx.x < stride)
      for (int d = 0; d < kRadixDigits; ++d) sh.hist[d][threadIdx.x] += sh.hist[d][threadIdx.x + stride];
    __syncthreads();
  }
}

// The block's sum of one integer per thread (exact in any order): warp sums, then the warps' sums
// through `warp_total` (kThreads / 32 entries of shared memory); every thread returns it.
template <int kThreads>
__device__ unsigned long long block_sum(unsigned long long* warp_total, unsigned long long mine) {
  const unsigned long long w = warp_sum(mine);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) warp_total[threadIdx.x / 32] = w;
  __syncthreads();
  unsigned long long total = 0;
  for (int i = 0; i < kThreads / 32; ++i) total += warp_total[i];
  __syncthreads();
  return total;
}

// A lane as the selection sees it: its key and its weight (1 to count lanes, or a mass).
struct KeyWeight {
  uint64_t key;
  unsigned long long weight;
};

// The key of the lane that ends the prefix: among the lanes with key >= floor (and a positive
// weight), the one where the running weight from the largest key first reaches need. `lane(v)`
// gives lane v's KeyWeight. 16 passes of 4-bit digits, each a histogram per thread summed by an
// integer tree: exact, no atomics. Every thread returns the same key.
template <int kThreads, class Lane>
__device__ uint64_t radix_select(RadixScratch<kThreads>& sh, int64_t lanes, const Lane& lane, uint64_t floor,
                                 unsigned long long need) {
  if (threadIdx.x == 0) {
    sh.prefix = 0;
    sh.need = need;
  }
  uint64_t mask = 0;
  for (int shift = 64 - kRadixDigitBits; shift >= 0; shift -= kRadixDigitBits) {
    for (int d = 0; d < kRadixDigits; ++d) sh.hist[d][threadIdx.x] = 0;
    __syncthreads();
    const uint64_t prefix = sh.prefix;
    for (int64_t v = threadIdx.x; v < lanes; v += kThreads) {
      const KeyWeight kw = lane(v);
      if ((kw.key & mask) != prefix || kw.key < floor) continue;
      sh.hist[(kw.key >> shift) & (kRadixDigits - 1)][threadIdx.x] += kw.weight;
    }
    __syncthreads();
    sum_histograms(sh);
    if (threadIdx.x == 0) {
      unsigned long long above = 0;
      for (int d = kRadixDigits - 1; d >= 0; --d) {
        if (above + sh.hist[d][0] >= sh.need) {
          sh.prefix |= static_cast<uint64_t>(d) << shift;
          sh.need -= above;
          break;
        }
        above += sh.hist[d][0];
      }
    }
    mask |= uint64_t{kRadixDigits - 1} << shift;
    __syncthreads();
  }
  return sh.prefix;
}

}  // namespace detlogp::sm90
