// The contract's reduction (docs/contract.md §3-§6): temperature scaling, the per-tile summary
// (m_g, s_g) with the adjacent-pairwise tree, the ascending chain over global tiles, and the
// finalize step. Host and device backends call these same definitions; the GPU epilogue maps
// the tree onto its accumulator layout and is proven equal by re-reducing its logits on the CPU.
#pragma once

#include <cstdint>

#include "detlogp/config.hpp"
#include "detlogp/fpops.hpp"
#include "detlogp/transcendentals.hpp"

namespace detlogp {

struct TileSummary {
  float max;  // m_g: NaN-propagating max over the tile's real lanes, -0 normalized; -inf if none
  float sum;  // s_g: tree sum of expc(y - m_g) over the 64 lanes, padding lanes exactly 0
};

// fl(1/T), computed once per row. temperature_in_range(T) holds (checked by the API), so the
// result is a finite normal number.
DETLOGP_HD float inverse_temperature(float temperature) { return fp::div(1.0f, temperature); }

// y = fl(z * fl(1/T)); y == z exactly when T == 1.
DETLOGP_HD float scale_logit(float z, float inv_temperature) { return fp::mul(z, inv_temperature); }

// z = fl(acc + b): the bias is added once, after the full K walk.
DETLOGP_HD float add_bias(float acc, float bias) { return fp::add(acc, bias); }

// One combining step of the tile tree and of the NaN max, named so every backend uses the same.
DETLOGP_HD float tree_add(float a, float b) { return fp::add(a, b); }

// -0 -> +0, everything else unchanged (NaN stays NaN).
DETLOGP_HD float normalize_zero(float m) { return fp::add(m, 0.0f); }

// Adjacent-pairwise tree over 64 values: level l adds elements 2i and 2i+1 of level l-1.
DETLOGP_HD float tile_tree_sum(const float* e) {
  float level[kVocabTile / 2];
  DETLOGP_UNROLL
  for (int i = 0; i < kVocabTile / 2; ++i) level[i] = tree_add(e[2 * i], e[2 * i + 1]);
  DETLOGP_UNROLL
  for (int width = kVocabTile / 4; width >= 1; width /= 2) {
    DETLOGP_UNROLL
    for (int i = 0; i < width; ++i) level[i] = tree_add(level[2 * i], level[2 * i + 1]);
  }
  return level[0];
}

// The entropy term of one lane (docs/contract.md §10): w = fl(e · x) with x = fl(y - m_g) and
// e = expc(x), and +0 where e is 0 (a padding lane, or x below expc's range or -inf), so that
// 0 · -inf never forms. w <= 0 wherever it is not NaN.
DETLOGP_HD float entropy_lane_term(float e, float x) { return e == 0.0f ? 0.0f : fp::mul(e, x); }

// A tile's summary plus its entropy sum u_g: the same adjacent-pairwise tree over the lane terms.
struct TileEntropySummary {
  TileSummary summary;
  float usum;  // u_g = tree sum of entropy_lane_term over the 64 lanes; +0 when m_g is -inf
};

namespace detail {
// tile_summary's one definition over the lanes v of the tile with real(v) true (the rest are padding);
// kEntropy also forms u_g from the same x and e. No lane outside real(v) is read.
template <bool kEntropy, class Real>
DETLOGP_HD TileEntropySummary tile_summary_impl(const float* y, Real real) {
  float m = fp::neg_inf();
  DETLOGP_UNROLL
  for (int v = 0; v < kVocabTile; ++v)
    if (real(v)) m = fp::max_nan(m, y[v]);
  m = normalize_zero(m);
  if (m == fp::neg_inf()) return {{m, 0.0f}, 0.0f};  // no real lane, or all real lanes -inf
  float e[kVocabTile];
  float w[kEntropy ? kVocabTile : 1];
  DETLOGP_UNROLL
  for (int v = 0; v < kVocabTile; ++v) {
    const bool in = real(v);
    const float x = in ? fp::sub(y[v], m) : fp::neg_inf();
    e[v] = in ? expc(x) : 0.0f;
    if constexpr (kEntropy) w[v] = entropy_lane_term(e[v], x);
  }
  if constexpr (kEntropy) return {{m, tile_tree_sum(e)}, tile_tree_sum(w)};
  return {{m, tile_tree_sum(e)}, 0.0f};
}

// The real lanes of a tile are a prefix 0..real_lanes-1 (docs/contract.md §3.4).
struct PrefixLanes {
  int real_lanes;
  DETLOGP_HD bool operator()(int v) const { return v < real_lanes; }
};
// The lanes whose bit is set in a 64-bit mask (bit v = lane v).
struct MaskedLanes {
  uint64_t mask;
  DETLOGP_HD bool operator()(int v) const { return ((mask >> v) & 1u) != 0; }
};
}  // namespace detail

// Summary of one tile from its scaled logits y[0..real_lanes); lanes real_lanes..63 are padding.
// real_lanes is 0..64 (real lanes are always a prefix of a tile: see docs/contract.md §3).
DETLOGP_HD TileSummary tile_summary(const float* y, int real_lanes) {
  return detail::tile_summary_impl<false>(y, detail::PrefixLanes{real_lanes}).summary;
}
// The same summary (identical bits) and the tile's entropy sum u_g.
DETLOGP_HD TileEntropySummary tile_entropy_summary(const float* y, int real_lanes) {
  return detail::tile_summary_impl<true>(y, detail::PrefixLanes{real_lanes});
}
// The summary of the lanes whose bit is set in `lanes`, every other lane a padding lane: the §5
// summary with a mask, which the sampling program forms over its support (docs/contract.md §11.7).
// With the mask of the first real_lanes lanes it is tile_summary bit for bit. Lanes outside the
// mask are not read.
DETLOGP_HD TileSummary tile_summary_masked(const float* y, uint64_t lanes) {
  return detail::tile_summary_impl<false>(y, detail::MaskedLanes{lanes}).summary;
}
// The summary of a tile with one real lane (scaled logit y), any one: tile_summary_masked with a
// one-bit mask, bit for bit. There the tree adds the lane's term only to +0s, which is exact (the
// term is >= +0 or NaN) except for a NaN's quieting, which one add does as well as six. For a row
// kernel whose support holds one lane of the tile: no lane array and one expc instead of 64.
DETLOGP_HD TileSummary tile_summary_one_lane(float y) {
  const float m = normalize_zero(fp::max_nan(fp::neg_inf(), y));
  if (m == fp::neg_inf()) return {m, 0.0f};
  return {m, tree_add(expc(fp::sub(y, m)), 0.0f)};
}

// Global max M over tile maxima: exact, so any order gives the same bits.
DETLOGP_HD float chain_max(float running, float tile_max) { return fp::max_nan(running, tile_max); }

// The rescale factor of tile g in the chain, expc(m_g - M). Independent across tiles, so a
// backend may compute the factors in parallel and keep only chain_accumulate on the serial path.
DETLOGP_HD float chain_factor(float tile_max, float global_max) { return expc(fp::sub(tile_max, global_max)); }

// The serial part of one chain step: S <- fl(s_g * factor + S). Tiles with s_g == 0 (padding
// only, or all lanes -inf) contribute exactly nothing.
DETLOGP_HD float chain_accumulate(float running_sum, float tile_sum, float factor) {
  if (tile_sum == 0.0f) return running_sum;
  return fp::fma(tile_sum, factor, running_sum);
}

// The skip of chain_accumulate folded into the factor, for a serial loop that is one fma per
// tile: a tile with s_g == 0 gets factor 0, and fma(0, 0, S) == S exactly for every value the
// chain holds (S is +0, positive, +inf or NaN; never -0). Same bits as chain_accumulate.
DETLOGP_HD float chain_factor_or_skip(TileSummary tile, float global_max) {
  return tile.sum == 0.0f ? 0.0f : chain_factor(tile.max, global_max);
}
DETLOGP_HD float chain_fma(float running_sum, float tile_sum, float factor_or_skip) {
  return fp::fma(tile_sum, factor_or_skip, running_sum);
}

// One step of the ascending chain: S <- fl(s_g * expc(m_g - M) + S).
DETLOGP_HD float chain_step(float running_sum, TileSummary tile, float global_max) {
  if (tile.sum == 0.0f) return running_sum;  // skip the factor too: it would be unused
  return chain_accumulate(running_sum, tile.sum, chain_factor(tile.max, global_max));
}

struct RowResult {
  float logp;
  float lse;
};

// lse = M + logc(S); logp = min(y_t - lse, 0), +0 for an ignored row. A NaN anywhere in the
// row's statistics gives the canonical NaN for both outputs.
// The two steps of finalize_row, for a caller that holds the row's lse already (the sampling
// program takes it from the fused kernel): lse = M + logc(S), canonical NaN where NaN; and the
// target's logp = min(y_t - lse, 0), canonical NaN where NaN.
DETLOGP_HD float row_lse(float global_max, float chain_sum) {
  const float lse = fp::add(global_max, logc(chain_sum));
  return fp::is_nan(lse) ? fp::canonical_nan() : lse;
}
DETLOGP_HD float target_logp(float target_logit, float lse) {
  const float d = fp::sub(target_logit, lse);
  if (fp::is_nan(d)) return fp::canonical_nan();
  return d > 0.0f ? 0.0f : d;
}
DETLOGP_HD RowResult finalize_row(float global_max, float chain_sum, float target_logit, bool ignored) {
  const float lse = row_lse(global_max, chain_sum);
  if (ignored) return {0.0f, lse};
  return {target_logp(target_logit, lse), lse};
}

// One step of the entropy chain, beside chain_step with the same d = fl(m_g - M) and factor
// f = expc(d): U <- fma(fma(s_g, d, u_g), f, U). Skipped (exactly nothing) where s_g == 0, as in
// chain_step, and where f == 0 (the tile is too far below M to count; s_g · d could then overflow).
// s_g > 0, d <= 0 and u_g <= 0, so neither fma cancels: every term added to U has U's sign.
DETLOGP_HD float entropy_chain_step(float running_usum, TileSummary tile, float tile_usum, float global_max) {
  if (tile.sum == 0.0f) return running_usum;
  const float d = fp::sub(tile.max, global_max);
  const float factor = expc(d);
  if (factor == 0.0f) return running_usum;
  return fp::fma(fp::fma(tile.sum, d, tile_usum), factor, running_usum);
}

// entropy_chain_step with its inner fma and its skip folded into the operands, for a serial loop of
// one fma per tile beside chain_fma (the factor is chain_factor_or_skip's, 0 for a skipped tile):
// a skipped tile (s_g == 0, or a factor of 0) gets the term -0, and fma(-0, 0, U) == U exactly for
// every U (-0 + U is U, for U = +0 and -0 too). Otherwise the term is fma(s_g, d, u_g). Same bits
// as entropy_chain_step.
DETLOGP_HD float entropy_chain_term_or_skip(TileSummary tile, float tile_usum, float global_max, float factor_or_skip) {
  if (factor_or_skip == 0.0f) return -0.0f;
  return fp::fma(tile.sum, fp::sub(tile.max, global_max), tile_usum);
}
DETLOGP_HD float entropy_chain_fma(float running_usum, float term_or_skip, float factor_or_skip) {
  return fp::fma(term_or_skip, factor_or_skip, running_usum);
}

// The rounding error of one S chain step, S_new = fl(s_g · f + S_old) (f = chain_factor_or_skip:
// chain_step and chain_fma give the same S_new), exact up to this function's last rounding: the
// product t = fl(s_g · f) and its error fma(s_g, f, -t), the 2Sum (sigma, tau) of S_old and t, and
// sigma - S_new (exact: both are roundings of nearly the same positive sum). +0 for a skipped tile.
// A row whose mass sits on a few lanes has S = 1 + eps with eps spread thinly over thousands of
// tiles, each step adding about one ulp of S: the steps' roundings then bias S by up to one ulp of
// 1 per tile, a large error relative to eps (and to H ~ eps log(1/eps)); their sum C restores it.
DETLOGP_HD float chain_step_error(float sum_before, float sum_after, float tile_sum, float factor_or_skip) {
  const float t = fp::mul(tile_sum, factor_or_skip);
  const float product_error = fp::fma(tile_sum, factor_or_skip, fp::neg(t));
  const float sigma = fp::add(sum_before, t);
  const float t_part = fp::sub(sigma, sum_before);
  const float tau = fp::add(fp::sub(sum_before, fp::sub(sigma, t_part)), fp::sub(t, t_part));
  const float error = fp::add(fp::add(fp::sub(sigma, sum_after), tau), product_error);
  // A select, not an early return: the device chains then interleave their steps (a branch per
  // step fences the scheduler). The skipped tile's operations have no effect on the result.
  return factor_or_skip == 0.0f ? 0.0f : error;
}
// One step of the compensation chain beside S: C <- fl(C + chain_step_error(...)), ascending tiles.
DETLOGP_HD float compensation_step(float running_comp, float sum_before, float sum_after, float tile_sum,
                                   float factor_or_skip) {
  return fp::add(running_comp, chain_step_error(sum_before, sum_after, tile_sum, factor_or_skip));
}

// H = fl(logc(S) - fl(fl(U - C) / S)), with S + C the chain's sum without its roundings:
// log(S + C) - U / (S + C) = logc(S) + C / S - U / S to first order in C / S. -U / S >= 0 and
// logc(S) + C / S ~ log(S + C) >= 0, so nothing cancels badly (a peaked row has both terms near 0,
// each accurate to about an ulp of itself); a result below +0 (rounding, H is >= 0) is +0.
// S == 0 (no real lane above -inf) and any NaN give the canonical NaN.
DETLOGP_HD float finalize_entropy(float chain_sum, float chain_usum, float chain_comp) {
  const float h = fp::sub(logc(chain_sum), fp::div(fp::sub(chain_usum, chain_comp), chain_sum));
  if (fp::is_nan(h)) return fp::canonical_nan();
  return h < 0.0f ? 0.0f : h;
}

// Reference helper: the entropy of a row from its n_tiles summaries and entropy sums, ascending.
DETLOGP_HD float entropy_row_summaries(const TileSummary* tiles, const float* usums, int64_t n_tiles) {
  float global_max = fp::neg_inf();
  for (int64_t g = 0; g < n_tiles; ++g) global_max = chain_max(global_max, tiles[g].max);
  float sum = 0.0f, usum = 0.0f, comp = 0.0f;
  for (int64_t g = 0; g < n_tiles; ++g) {
    const float before = sum;
    sum = chain_step(sum, tiles[g], global_max);
    comp = compensation_step(comp, before, sum, tiles[g].sum, chain_factor_or_skip(tiles[g], global_max));
    usum = entropy_chain_step(usum, tiles[g], usums[g], global_max);
  }
  return finalize_entropy(sum, usum, comp);
}

// A row's M and S: the chain's state before the finalize, the same for every target of the row
// (finalize_row of each target then gives that target's single-target bits).
struct RowChain {
  float global_max;
  float sum;
};

// Reference helper: M and the ascending chain S over a row's n_tiles summaries.
DETLOGP_HD RowChain chain_row_summaries(const TileSummary* tiles, int64_t n_tiles) {
  float global_max = fp::neg_inf();
  for (int64_t g = 0; g < n_tiles; ++g) global_max = chain_max(global_max, tiles[g].max);
  float sum = 0.0f;
  for (int64_t g = 0; g < n_tiles; ++g) sum = chain_step(sum, tiles[g], global_max);
  return {global_max, sum};
}

// Reference helper: the whole chain over a row's n_tiles summaries, ascending.
DETLOGP_HD RowResult reduce_row_summaries(const TileSummary* tiles, int64_t n_tiles, float target_logit, bool ignored) {
  const RowChain c = chain_row_summaries(tiles, n_tiles);
  return finalize_row(c.global_max, c.sum, target_logit, ignored);
}

}  // namespace detlogp
