// SM90 epilogue of linear_logp_grad_logits: from the wgmma accumulators of a recomputed logit
// tile to the bf16 logit gradient dz, element by element with the pinned formula of
// detlogp/grad.hpp (the same functions the CPU implementation calls): the plain gradient, or with
// kSampled the sampling replay's (sampled_grad_logit: two exponentials and the support test).
//
// Accumulator fragment of wgmma m64nNk16 (f32), thread t of the warpgroup, warp w = t / 32,
// lane l, q = l % 4: acc[4j + 2h + e] holds row 16w + l/4 + 8h, column 8j + 2q + e
// (epilogue_tile_summary.cuh). Each thread therefore owns column pairs (8j + 2q, 8j + 2q + 1)
// of two rows and stores each pair as one 4-byte bf16x2 word; no shuffles, no shared memory.
#pragma once

#include <cstdint>
#include <type_traits>

#include "detlogp/grad.hpp"
#include "sm90/params.hpp"

namespace detlogp::sm90 {

// Row `row`'s operands of the plain gradient (detlogp/grad.hpp GradRow): ignored rows take no
// dL/dlogp term.
__device__ __forceinline__ GradRow plain_grad_row(const GradLogitsParams& p, int64_t row, bool ignored) {
  GradRow r;
  r.inv_t = inverse_temperature(p.temperature_rows ? p.temperature_rows[row] : p.temperature);
  r.lse = p.lse[row];
  r.gl = (ignored || p.g_logp == nullptr) ? 0.0f : p.g_logp[row];
  r.gs = p.g_lse == nullptr ? 0.0f : p.g_lse[row];
  if (p.g_entropy != nullptr) {
    r.entropy_term = true;
    r.gh = p.g_entropy[row];
    r.h = p.entropy[row];
  }
  return r;
}

// Epilogue of one m64 accumulator fragment: its 64 rows start at `row_tile0`, its BlockN columns
// at chunk column `col0`. vec2: dz base 4-byte aligned and row stride even (checked on the host).
template <int BlockN, bool kSampled>
__device__ __forceinline__ void epilogue_grad_logits(const float (&acc)[BlockN / 2], const GradLogitsParams& p,
                                                     int64_t row_tile0, int64_t col0, bool vec2) {
  using Row = std::conditional_t<kSampled, SampledGradRow, GradRow>;
  const int t = threadIdx.x % 128;
  const int warp = t / 32;
  const int lane = t % 32;
  const int q = lane % 4;
  if (row_tile0 + 16 * warp >= p.rows) return;  // warp-uniform: all 16 rows past N

  // Columns of this tile inside the chunk and inside the real vocabulary (32-bit from here on).
  const int64_t left = p.cols - col0;
  const int cols = left >= BlockN ? BlockN : static_cast<int>(left);
  const int64_t real_left = p.real_cols - col0;
  const int real = real_left <= 0 ? 0 : (real_left >= BlockN ? BlockN : static_cast<int>(real_left));

  bool row_ok[2];
  Row r[2];
  int target[2];     // tile column of the row's target, -1 when not in this tile (or ignored)
  uint16_t* out[2];  // dz row at col0
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = row_tile0 + 16 * warp + lane / 4 + 8 * h;
    row_ok[h] = row < p.rows;
    r[h] = Row{};
    r[h].inv_t = 1.0f;
    target[h] = -1;
    out[h] = nullptr;
    if (row_ok[h]) {
      const int64_t tgt = load_target(p.targets, p.targets_i64, row);
      const bool ignored = tgt == p.ignore_index;
      if constexpr (kSampled) {
        r[h] = p.replay.row(row, p.real_vocab, ignored, p.lse, p.g_logp, p.g_lse);
      } else {
        r[h] = plain_grad_row(p, row, ignored);
      }
      const int64_t rel = tgt - p.vocab_start - col0;
      if (!ignored && rel >= 0 && rel < cols) target[h] = static_cast<int>(rel);
      out[h] = p.dz + row * p.dz_stride + col0;
    }
  }

  // Blocks of kJB column groups (4 kJB values a thread): the exponent arguments first, then one
  // warp vote: if every real element's argument lies in expc_normal's domain (NaN fails), all
  // exponentials of the block are straight-line code (same bits as expc there), else expc.
  // kSampled: two arguments per element, x = fl(y - lse) and xs = fl(y - lse_Sigma), the second
  // needed only at a lane of the support (elsewhere its exponential is not read).
  constexpr int kJB = 4;
  static_assert((BlockN / 8) % kJB == 0, "whole blocks of column groups");
#pragma unroll
  for (int j0 = 0; j0 < BlockN / 8; j0 += kJB) {
    float x[kJB][2][2];
    float xs[kJB][2][2];    // kSampled only
    uint32_t in_sigma = 0;  // kSampled only: bit (4 jj + 2 h + e) for a lane of the support
    bool normal = true;
#pragma unroll
    for (int jj = 0; jj < kJB; ++jj) {
      const int c = 8 * (j0 + jj) + 2 * q;  // tile column of e = 0
      float b[2] = {0.0f, 0.0f};
      if (p.bias != nullptr) {
        if (c < cols) b[0] = p.bias[col0 + c];
        if (c + 1 < cols) b[1] = p.bias[col0 + c + 1];
      }
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float z = acc[4 * (j0 + jj) + 2 * h + e];
          if (p.bias != nullptr) z = add_bias(z, b[e]);
          const bool needed = row_ok[h] && c + e < real;
          auto in_domain = [](float a) { return a >= kExpcNormalMin && a <= kExpcNormalMax; };
          if constexpr (kSampled) {
            const float y = scale_logit(z, r[h].inv_t);
            x[jj][h][e] = fp::sub(y, r[h].lse);
            xs[jj][h][e] = fp::sub(y, r[h].lse_support);
            const bool in = needed && in_support(y, p.vocab_start + col0 + c + e, r[h].support);
            if (in) in_sigma |= 1u << (4 * jj + 2 * h + e);
            normal = normal && (!needed || in_domain(x[jj][h][e])) && (!in || in_domain(xs[jj][h][e]));
          } else {
            x[jj][h][e] = grad_exp_arg(z, r[h]);
            normal = normal && (!needed || in_domain(x[jj][h][e]));
          }
        }
    }
    float pe[kJB][2][2];
    float ps[kJB][2][2];  // kSampled only: expc(xs)
    // The exponentials as straight-line code: expc_normal where the vote allows, else expc.
    auto exponentials = [&](auto fast_path) {
      auto ex = [](float a) { return decltype(fast_path)::value ? expc_normal(a) : expc(a); };
#pragma unroll
      for (int jj = 0; jj < kJB; ++jj)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            pe[jj][h][e] = ex(x[jj][h][e]);
            if constexpr (kSampled) ps[jj][h][e] = ex(xs[jj][h][e]);
          }
    };
    if (__all_sync(0xFFFFFFFFu, normal))
      exponentials(std::true_type{});
    else
      exponentials(std::false_type{});
#pragma unroll
    for (int jj = 0; jj < kJB; ++jj) {
      const int c = 8 * (j0 + jj) + 2 * q;
      if (c >= cols) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (!row_ok[h]) continue;
        // grad_logit (sampled_grad_logit): +0 exactly for padding (no arithmetic), else the pinned formula.
        auto grad = [&](int e) {
          if (c + e >= real) return 0.0f;
          if constexpr (kSampled) {
            const bool in = (in_sigma >> (4 * jj + 2 * h + e)) & 1u;
            return sampled_grad_from_p(pe[jj][h][e], ps[jj][h][e], in, r[h], c + e == target[h]);
          } else {
            return grad_from_p(pe[jj][h][e], x[jj][h][e], r[h], c + e == target[h]);
          }
        };
        const float g0f = grad(0);
        const float g1f = grad(1);
        const uint16_t g0 = bf16_round(g0f);
        const uint16_t g1 = bf16_round(g1f);
        if (vec2 && c + 1 < cols) {
          *reinterpret_cast<uint32_t*>(out[h] + c) = static_cast<uint32_t>(g0) | (static_cast<uint32_t>(g1) << 16);
        } else {
          out[h][c] = g0;
          if (c + 1 < cols) out[h][c + 1] = g1;
        }
      }
    }
  }
}

}  // namespace detlogp::sm90
