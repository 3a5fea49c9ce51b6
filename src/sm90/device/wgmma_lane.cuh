// One lane of the SM90 logits recomputed on the CUDA cores with the wgmma model's bits
// (detlogp/wgmma_model.hpp, docs/contract.md §3.1.1): z = the model's dot of a hidden row and a
// weight row, ascending blocks of 16 products on one accumulator from +0, which is what the fused
// kernel's wgmma computes. The top-k output's candidate path uses it for the few lane groups whose
// lanes it did not keep. A block's 16 products are spread over 16 consecutive threads (a half
// warp): each notes its product's specials and parts; the block exponent is their integer max and
// the aligned sum their exact integer sum (both order-free), so every thread of the half warp
// finishes the block with the model's own finish_block and holds the same accumulator.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "detlogp/wgmma_model.hpp"

namespace detlogp::sm90 {

// The model's fp32 z of hidden row `a` and weight row `b` (bf16 bits, `dim` each), by the 16 threads
// of a half warp (threadIdx.x / 16 the same); the two half warps of a warp may run different lanes,
// but all 32 threads call it together with the same `dim`. Every one of the 16 returns its half's z.
// The warp never diverges inside: full-warp votes and shuffles (offsets below 16 stay in the half
// warp), and a block with specials still runs the integer sum, whose result it discards. A vote or
// shuffle under a per-half mask would make the compiler gather the warp's masks with a REDUX.
__device__ __forceinline__ float wgmma_model_dot_half_warp(const uint16_t* a, const uint16_t* b, int64_t dim) {
  constexpr unsigned kWarp = 0xFFFFFFFFu;
  const int j = static_cast<int>(threadIdx.x % 16);
  const unsigned half = 0xFFFFu << (threadIdx.x % 32 & 16u);
  uint32_t c = 0;
  for (int64_t k0 = 0; k0 < dim; k0 += wgmma::kBlockK) {
    const bool in = k0 + j < dim;  // past D: a zero product, which takes no part (a shorter block)
    const uint16_t x = in ? a[k0 + j] : uint16_t{0}, y = in ? b[k0 + j] : uint16_t{0};
    wgmma::BlockSpecials mine;
    wgmma::note_product_specials(x, y, mine);
    const unsigned nan = __ballot_sync(kWarp, mine.nan) & half, pos = __ballot_sync(kWarp, mine.pos_inf) & half,
                   neg = __ballot_sync(kWarp, mine.neg_inf) & half;
    wgmma::BlockSpecials block = wgmma::accumulator_specials(c);
    block.nan = block.nan || nan != 0;
    block.pos_inf = block.pos_inf || pos != 0;
    block.neg_inf = block.neg_inf || neg != 0;
    const wgmma::ProductParts pp = wgmma::product_parts(x, y);
    int32_t product_max = pp.nonzero ? pp.exp : wgmma::kZeroExp;
#pragma unroll
    for (int o = 8; o >= 1; o /= 2) {
      const int32_t other = __shfl_xor_sync(kWarp, product_max, o);
      product_max = other > product_max ? other : product_max;
    }
    const int32_t e = wgmma::block_exponent(product_max, static_cast<int32_t>(c));
    int32_t sum = pp.nonzero ? wgmma::align_product<int32_t>(pp.sig, e - pp.exp) : 0;
#pragma unroll
    for (int o = 8; o >= 1; o /= 2) sum += __shfl_xor_sync(kWarp, sum, o);
    // A block with a special (uniform over the half warp) makes the accumulator that special.
    c = block.any() ? block.bits() : wgmma::finish_block(sum, e, c);
  }
  return fp::from_bits(c);
}

}  // namespace detlogp::sm90
