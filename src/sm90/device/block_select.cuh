// Block-wide selection over 64-bit rank keys (detlogp/rank.hpp, detlogp/topk.hpp) for the row
// kernels that read a row of serving logits with one CTA: the sampling program's cut and the top-k
// output. Every operation here is exact (integer sums, comparisons of distinct keys), so its result
// does not depend on the number of threads or on the order in which they visit the lanes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "detlogp/config.hpp"
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

// Calls lane(c, y) for each real lane c of tile g, y its scaled logit, without a lane array: a
// whole tile at a 16-byte aligned address issues its sixteen float4 loads first, so they are in
// flight together, then visits the lanes in order; otherwise lane by lane.
template <class Lane>
__device__ __forceinline__ void visit_tile(const float* z, int64_t g, int64_t lanes, float inv_t, const Lane& lane) {
  const int64_t first = g * kVocabTile;
  const int real = lanes - first < kVocabTile ? static_cast<int>(lanes - first) : kVocabTile;
  const float* src = z + first;
  if (real == kVocabTile && (reinterpret_cast<uintptr_t>(src) & 15u) == 0) {
    float4 q[kVocabTile / 4];
#pragma unroll
    for (int i = 0; i < kVocabTile / 4; ++i) q[i] = __ldg(reinterpret_cast<const float4*>(src) + i);
#pragma unroll
    for (int i = 0; i < kVocabTile / 4; ++i) {
      lane(4 * i, scale_logit(q[i].x, inv_t));
      lane(4 * i + 1, scale_logit(q[i].y, inv_t));
      lane(4 * i + 2, scale_logit(q[i].z, inv_t));
      lane(4 * i + 3, scale_logit(q[i].w, inv_t));
    }
    return;
  }
  for (int c = 0; c < real; ++c) lane(c, lane_y(z, first + c, inv_t));
}

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

// Each thread's first slot when thread t contributes count[t] entries in thread order: count[] in
// shared memory is replaced by the exclusive prefix sums (one thread, exact) and every thread
// returns the total. Called by every thread of the block with its own count.
template <int kThreads>
__device__ int block_offsets(int* count, int* total, int mine) {
  __syncthreads();
  count[threadIdx.x] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    int running = 0;
    for (int t = 0; t < kThreads; ++t) {
      const int c = count[t];
      count[t] = running;
      running += c;
    }
    *total = running;
  }
  __syncthreads();
  return *total;
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
