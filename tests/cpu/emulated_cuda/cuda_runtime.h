// The few CUDA names that src/sm90/device/block_select.cuh's listing pass and
// src/sm90/device/grad_from_logits.cuh use, for running that device code on the host with one
// std::thread a CUDA thread (test_block_select_host.cpp, test_grad_from_logits_host.cpp): threadIdx
// is thread-local, the block barriers are a std::barrier over the block's threads, and
// __syncthreads_count is an exact count between two barriers. Shuffles and warp votes are not
// emulated (neither pass uses them; a header beside them may name them).
#pragma once

#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdlib>

#define __device__
#define __forceinline__ inline
#define __shared__ static

struct float4 {
  float x, y, z, w;
};
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct uint2 {
  uint32_t x, y;
};
using cudaStream_t = struct CUstream_st*;

struct EmulatedThreadIndex {
  unsigned x;
};
extern thread_local EmulatedThreadIndex threadIdx;

// The block the calling threads form: set before they start.
struct EmulatedBlock {
  std::barrier<>* barrier = nullptr;
  std::atomic<int> count{0};
};
extern EmulatedBlock emulated_block;

inline void __syncthreads() { emulated_block.barrier->arrive_and_wait(); }
inline int __syncthreads_count(int predicate) {
  emulated_block.barrier->arrive_and_wait();  // the last count is read by every thread
  if (threadIdx.x == 0) emulated_block.count.store(0);
  emulated_block.barrier->arrive_and_wait();
  if (predicate) emulated_block.count.fetch_add(1);
  emulated_block.barrier->arrive_and_wait();
  return emulated_block.count.load();
}
template <class T>
inline T __ldg(const T* p) {
  return *p;
}
template <class T>
inline T __ldcs(const T* p) {
  return *p;
}
inline bool __all_sync(unsigned, bool) { std::abort(); }
inline int __ffs(uint32_t x) { return __builtin_ffs(static_cast<int>(x)); }
template <class V>
inline V __shfl_xor_sync(unsigned, V, int) {
  std::abort();
}
template <class V>
inline V __shfl_up_sync(unsigned, V, int) {
  std::abort();
}
