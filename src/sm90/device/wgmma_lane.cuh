// One lane of the SM90 logits recomputed on the CUDA cores with the wgmma model's bits
// (detlogp/wgmma_model.hpp, docs/contract.md §3.1.1): z = the model's dot of a hidden row and a
// weight row, ascending blocks of 16 products on one accumulator from +0, which is what the fused
// kernel's wgmma computes. The top-k output's candidate path uses it for the few lane groups whose
// lanes it did not keep. One thread a lane runs the model's own block FMA (wgmma::block_fma_bits):
// a block's 16 products are independent work for one thread, while only the accumulator's rounding
// is a chain from block to block, so spreading a block over threads would put their shuffles on
// that chain.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "detlogp/wgmma_model.hpp"

namespace detlogp::sm90 {

// The model's scalar dot, out of line: inlined beside the vector path below, its blocks of a
// runtime length would move that path's per-block arrays to local memory too.
__device__ __noinline__ float wgmma_model_dot_scalar(const uint16_t* a, const uint16_t* b, int64_t dim) {
  return wgmma::dot(a, b, dim);
}

// The model's fp32 z of hidden row `a` and weight row `b` (bf16 bits, `dim` each), by one thread.
// With 16-byte aligned rows and whole blocks the operands come as 16-byte vectors, kAhead blocks
// loaded before the block being summed (the chain would otherwise wait a memory latency a block);
// otherwise the model's scalar dot.
__device__ __forceinline__ float wgmma_model_dot(const uint16_t* a, const uint16_t* b, int64_t dim) {
  constexpr int kBlock = wgmma::kBlockK;
  static_assert(kBlock == 16, "a block is two 16-byte vectors of bf16");
  if (dim % kBlock != 0 || ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) & 15u) != 0)
    return wgmma_model_dot_scalar(a, b, dim);
  constexpr int kAhead = 2;
  uint4 va[kAhead][2], vb[kAhead][2];
  const auto load = [&](int slot, int64_t k0) {
    const uint4* pa = reinterpret_cast<const uint4*>(a + k0);
    const uint4* pb = reinterpret_cast<const uint4*>(b + k0);
    va[slot][0] = pa[0];
    va[slot][1] = pa[1];
    vb[slot][0] = pb[0];
    vb[slot][1] = pb[1];
  };
#pragma unroll
  for (int i = 0; i < kAhead; ++i)
    if (int64_t{kBlock} * i < dim) load(i, int64_t{kBlock} * i);
  uint32_t c = 0;
  for (int64_t k0 = 0; k0 < dim; k0 += int64_t{kBlock} * kAhead) {
#pragma unroll
    for (int i = 0; i < kAhead; ++i) {
      const int64_t kb = k0 + int64_t{kBlock} * i;
      if (kb >= dim) break;
      uint16_t x[kBlock], y[kBlock];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t wa[4] = {va[i][h].x, va[i][h].y, va[i][h].z, va[i][h].w};
        const uint32_t wb[4] = {vb[i][h].x, vb[i][h].y, vb[i][h].z, vb[i][h].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          x[8 * h + 2 * q] = static_cast<uint16_t>(wa[q]);
          x[8 * h + 2 * q + 1] = static_cast<uint16_t>(wa[q] >> 16);
          y[8 * h + 2 * q] = static_cast<uint16_t>(wb[q]);
          y[8 * h + 2 * q + 1] = static_cast<uint16_t>(wb[q] >> 16);
        }
      }
      const int64_t next = kb + int64_t{kBlock} * kAhead;
      if (next < dim) load(i, next);
      c = wgmma::block_fma_bits(x, y, kBlock, c);
    }
  }
  return fp::from_bits(c);
}

}  // namespace detlogp::sm90
