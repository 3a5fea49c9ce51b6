// linear_logp_grad_from_logits on the device: one CTA a row of given logits, the pinned logit
// gradient of detlogp/grad.hpp element by element (the functions the CPU implementation calls).
// The row's columns are taken in ascending segments of kFromLogitsThreads * kFromLogitsPerThread,
// every load of a segment before any store of it (a barrier), so the row's dz may overwrite its own
// logits in place: dz column c lands on logit c / 2, which this segment or an earlier one has read,
// while later segments read only logits past this one. Also run on the host through emulated CUDA
// names (tests/cpu/test_grad_from_logits_host.cpp).
#pragma once

#include <cstdint>

#include "detlogp/grad.hpp"
#include "sm90/device/epilogue_grad_logits.cuh"
#include "sm90/params.hpp"

namespace detlogp::sm90 {

constexpr int kFromLogitsThreads = 256;
constexpr int kFromLogitsPerThread = 16;
static_assert(kFromLogitsPerThread % 4 == 0, "whole float4 loads a thread");

// Row `row` of the problem by the calling CTA's kFromLogitsThreads threads. vec4: logits and dz
// rows start 16- and 8-byte aligned and their strides keep them so (checked on the host).
__device__ __forceinline__ void grad_from_logits_row(const GradLogitsParams& p, const float* logits,
                                                     int64_t logits_stride, bool vec4, int64_t row) {
  const float* zr = logits + row * logits_stride;
  uint16_t* out = p.dz + row * p.dz_stride;
  const int64_t tgt = load_target(p.targets, p.targets_i64, row);
  const bool ignored = tgt == p.ignore_index;
  const GradRow r = plain_grad_row(p, row, ignored);
  const int64_t rel = tgt - p.vocab_start;
  const int64_t target_col = (!ignored && rel >= 0 && rel < p.cols) ? rel : -1;
  constexpr int kQuads = kFromLogitsPerThread / 4;
  constexpr int64_t kSegment = int64_t{kFromLogitsThreads} * kFromLogitsPerThread;
  for (int64_t s0 = 0; s0 < p.cols; s0 += kSegment) {
    float z[kFromLogitsPerThread];
#pragma unroll
    for (int u = 0; u < kQuads; ++u) {
      const int64_t c = s0 + (int64_t{u} * kFromLogitsThreads + threadIdx.x) * 4;
      if (vec4 && c + 3 < p.cols) {
        const float4 q = __ldcs(reinterpret_cast<const float4*>(zr + c));
        z[4 * u] = q.x;
        z[4 * u + 1] = q.y;
        z[4 * u + 2] = q.z;
        z[4 * u + 3] = q.w;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) z[4 * u + e] = c + e < p.cols ? zr[c + e] : 0.0f;
      }
    }
    __syncthreads();  // in place: every logit of the segment read before any of its dz is written
#pragma unroll
    for (int u = 0; u < kQuads; ++u) {
      const int64_t c = s0 + (int64_t{u} * kFromLogitsThreads + threadIdx.x) * 4;
      uint16_t g[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) g[e] = grad_logit_bf16(z[4 * u + e], r, c + e < p.real_cols, c + e == target_col);
      if (vec4 && c + 3 < p.cols) {
        const uint2 w{g[0] | (uint32_t{g[1]} << 16), g[2] | (uint32_t{g[3]} << 16)};
        *reinterpret_cast<uint2*>(out + c) = w;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (c + e < p.cols) out[c + e] = g[e];
      }
    }
  }
}

}  // namespace detlogp::sm90
