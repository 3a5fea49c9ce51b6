// The sampling program (docs/contract.md §11): temperature, top-k, top-p, min-p over one row's
// contract logits, Gumbel-max noise from a counter hash of (seed, key, global id), and the processed
// log-probability over the support. One definition of each piece, compiled for host and device
// alike: the per-lane tests and the noise, the exact integer top-p threshold, and the serial
// reference of the per-row passes (support sum, token) that a GPU block runs in parallel with the
// same tree and chain. Finding the cut (the rank selection of §11.4-§11.5) is left to the backend
// (a sort on the CPU, a radix selection over rank_key on a GPU): every way gives the same lane.
#pragma once

#include <cstdint>

#include "detlogp/config.hpp"
#include "detlogp/fpops.hpp"
#include "detlogp/hash.hpp"
#include "detlogp/rank.hpp"
#include "detlogp/reduce.hpp"
#include "detlogp/transcendentals.hpp"

namespace detlogp {

// The largest real vocabulary the program takes: every top-p mass sum then fits in 64 bits (§11.3).
inline constexpr int64_t kSampleMaxVocab = int64_t{1} << 24;
// The top-p mass of a lane is floor(e * 2^kTopPMassBits).
inline constexpr int kTopPMassBits = 40;
// The token of a row without a processed distribution (its lse is NaN or -inf; §11.1).
inline constexpr int64_t kNoToken = -1;
// The cut of a row without top-k or top-p: every lane passes before_cut.
inline constexpr int64_t kNoCutId = INT64_MAX;

// ---------------------------------------------------------------- parameters (§11.1)

// T = 0 (greedy, either sign of zero) or a temperature of §3.3. False for NaN, +-inf, negatives.
DETLOGP_HD bool sampling_temperature_in_range(float t) { return t == 0.0f || temperature_in_range(t); }
DETLOGP_HD bool top_p_in_range(float p) { return p > 0.0f && p <= 1.0f; }  // NaN fails
DETLOGP_HD bool min_p_in_range(float p) { return p >= 0.0f && p < 1.0f; }  // NaN fails

// One row's program after its parameters were checked.
struct SampleRowParams {
  float inv_temperature;  // fl(1 / T); 1 for T = 0
  int64_t keep;           // k' of §11.4: lanes kept by top-k (real_vocab when off; 1 for T = 0)
  float top_p;            // 1: off
  float min_p;            // 0: off
};

DETLOGP_HD SampleRowParams sample_row_params(float temperature, int64_t top_k, float top_p, float min_p,
                                             int64_t real_vocab) {
  const bool greedy = temperature == 0.0f;
  SampleRowParams r;
  r.inv_temperature = greedy ? 1.0f : inverse_temperature(temperature);
  r.keep = greedy ? 1 : (top_k >= 1 && top_k < real_vocab ? top_k : real_vocab);
  r.top_p = top_p;
  r.min_p = min_p;
  return r;
}

// Whether the row runs the rank cut of §11.4-§11.5 (otherwise every lane passes it).
DETLOGP_HD bool has_cut(const SampleRowParams& r, int64_t real_vocab) { return r.keep < real_vocab || r.top_p < 1.0f; }

// ---------------------------------------------------------------- weights and top-p (§11.3, §11.5)

// e_v = expc(fl(y_v - M)): in [0, 1], exactly 1 where y_v == M.
DETLOGP_HD float relative_weight(float y, float row_max) { return expc(fp::sub(y, row_max)); }

// q_v = floor(e_v * 2^40): the scaling is exact (e <= 1), the conversion truncates.
DETLOGP_HD uint64_t top_p_mass(float e) { return static_cast<uint64_t>(fp::mul(e, 0x1p+40f)); }

// tau = ceil(total * top_p) exactly, for top_p in (0, 1] and total < 2^64: top_p = m * 2^-s with m its
// integer significand (< 2^24) and s >= 23, total * m as a 128-bit product, shifted right by s
// rounding up. 1 <= tau <= total for total >= 1.
DETLOGP_HD uint64_t top_p_threshold(uint64_t total, float top_p) {
  const uint32_t b = fp::bits(top_p);
  const uint32_t biased = b >> 23;  // top_p > 0: the sign bit is clear
  const uint64_t m = biased == 0 ? (b & 0x7FFFFFu) : ((b & 0x7FFFFFu) | 0x800000u);
  const int s = biased == 0 ? 149 : 150 - static_cast<int>(biased);
  // total * m = hi * 2^64 + lo, from two 32 x 24-bit partial products (each < 2^56).
  const uint64_t low_part = (total & 0xFFFFFFFFull) * m;
  const uint64_t high_part = (total >> 32) * m;
  const uint64_t lo = low_part + (high_part << 32);
  const uint64_t hi = (high_part >> 32) + (lo < low_part ? 1u : 0u);
  if (s >= 128) return (hi | lo) != 0 ? 1u : 0u;
  uint64_t q;
  bool remainder;
  if (s >= 64) {
    const int r = s - 64;
    q = hi >> r;
    remainder = lo != 0 || (hi & ((uint64_t{1} << r) - 1u)) != 0;
  } else {  // 23 <= s < 64; the quotient is <= total, so it fits in 64 bits
    q = (lo >> s) | (hi << (64 - s));
    remainder = (lo & ((uint64_t{1} << s) - 1u)) != 0;
  }
  return q + (remainder ? 1u : 0u);
}

// ---------------------------------------------------------------- the support (§11.5-§11.7)

// The last lane kept by top-k and top-p, in rank order; {-inf, kNoCutId} keeps every lane.
struct SupportCut {
  float logit;
  int64_t id;
};
DETLOGP_HD SupportCut no_cut() { return {fp::neg_inf(), kNoCutId}; }

// rank(lane) <= rank(cut), from the lane's own (y, id).
DETLOGP_HD bool before_cut(float y, int64_t id, SupportCut cut) {
  return y > cut.logit || (y == cut.logit && id <= cut.id);
}

// p_v >= min_p * p_max with the common 1/S cancelled: e_v >= min_p (min_p = 0 keeps every lane).
DETLOGP_HD bool min_p_keeps(float e, float min_p) { return e >= min_p; }

// Everything a lane needs to decide its membership alone: the row's max M, its cut and min_p.
struct SupportRow {
  float max;
  SupportCut cut;
  float min_p;
};

DETLOGP_HD bool in_support(float y, int64_t id, const SupportRow& s) {
  if (!before_cut(y, id, s.cut)) return false;
  return s.min_p == 0.0f || min_p_keeps(relative_weight(y, s.max), s.min_p);
}

// ---------------------------------------------------------------- noise and token (§11.8)

// The row's stream, once per row: a = mix64(seed + gamma), s = mix64(a ^ key).
DETLOGP_HD uint64_t sample_stream(uint64_t seed, int64_t key) {
  return mix64(mix64(seed + kSplitMixGamma) ^ static_cast<uint64_t>(key));
}
// A lane's 64 bits: mix64(s ^ (id * gamma)), a bijection of the id for one row.
DETLOGP_HD uint64_t sample_lane_bits(uint64_t stream, int64_t id) {
  return mix64(stream ^ (static_cast<uint64_t>(id) * kSplitMixGamma));
}
// u = (2r + 1) * 2^-24 with r the top 23 bits: exact, in [2^-24, 1 - 2^-24], never 0 or 1.
DETLOGP_HD float sample_uniform(uint64_t bits) {
  const uint32_t r = static_cast<uint32_t>(bits >> 41);
  return fp::mul(static_cast<float>(2u * r + 1u), 0x1p-24f);
}
// g = -logc(-logc(u)), both negations exact.
DETLOGP_HD float sample_gumbel(float u) { return fp::neg(logc(fp::neg(logc(u)))); }

// score_v = fl(y_v + g_v).
DETLOGP_HD float gumbel_score(float y, uint64_t stream, int64_t id) {
  return fp::add(y, sample_gumbel(sample_uniform(sample_lane_bits(stream, id))));
}

// The token precedence: the larger score, then the lower global id.
DETLOGP_HD bool score_precedes(float score_a, int64_t id_a, float score_b, int64_t id_b) {
  return score_a > score_b || (score_a == score_b && id_a < id_b);
}

// ---------------------------------------------------------------- the per-row passes

// One pass over a row's scaled logits y[0, lanes) with global ids first_id + v (first_id a multiple
// of 64, so local tiles are global tiles): the support's chain sum S_Sigma (the masked tile summaries
// of §11.7 chained in ascending tiles with the row's M), its size, and with `draw` the Gumbel-max
// token over it. Serial reference; a GPU block runs the tiles in parallel and the chain in order.
struct SupportPass {
  float sum;          // S_Sigma
  int64_t size;       // |Sigma|
  int64_t token;      // the draw's winner (kNoToken without a draw)
  float token_logit;  // y at the token
};

// The lanes y[0, real) (real <= 64) of one tile, or of a shard's edge lanes in a tile, with global
// ids first_id + v: the support lanes counted into `pass` and, with `draw`, their Gumbel scores
// offered to its token (`best`: the token's score). Returns the mask of the support lanes.
DETLOGP_HD uint64_t support_lanes(const float* y, int real, int64_t first_id, const SupportRow& s, bool draw,
                                  uint64_t stream, SupportPass& pass, float& best) {
  uint64_t mask = 0;
  for (int v = 0; v < real; ++v) {
    const float yv = y[v];
    const int64_t id = first_id + v;
    if (!in_support(yv, id, s)) continue;
    mask |= uint64_t{1} << v;
    ++pass.size;
    if (!draw) continue;
    const float score = gumbel_score(yv, stream, id);
    if (pass.token == kNoToken || score_precedes(score, id, best, pass.token)) {
      best = score;
      pass.token = id;
      pass.token_logit = yv;
    }
  }
  return mask;
}

DETLOGP_HD SupportPass support_pass(const float* y, int64_t lanes, int64_t first_id, const SupportRow& s, bool draw,
                                    uint64_t stream) {
  SupportPass out{0.0f, 0, kNoToken, 0.0f};
  float best = fp::neg_inf();
  for (int64_t t0 = 0; t0 < lanes; t0 += kVocabTile) {
    const int real = lanes - t0 < kVocabTile ? static_cast<int>(lanes - t0) : kVocabTile;
    const uint64_t mask = support_lanes(y + t0, real, first_id + t0, s, draw, stream, out, best);
    out.sum = chain_step(out.sum, tile_summary_masked(y + t0, mask), s.max);
  }
  return out;
}

// The raw statistics of a row from its tile summaries (any producer), ascending: M, S, lse (§6).
// A row's raw statistics: M and lse (§5-§6), all the program reads of them.
struct RowStats {
  float max;
  float lse;
};
DETLOGP_HD RowStats row_stats(const TileSummary* tiles, int64_t n_tiles) {
  const RowChain chain = chain_row_summaries(tiles, n_tiles);
  return {chain.global_max, row_lse(chain.global_max, chain.sum)};
}

// Whether the support is every real lane (no cut, min-p off): then the masked tiles are the tiles
// of §5, S_Sigma is S and lse_Sigma is lse bit for bit (§11.7), so a backend may take lse for it.
DETLOGP_HD bool whole_support(const SupportRow& s) { return s.cut.id == kNoCutId && s.min_p == 0.0f; }

// A row with a processed distribution: its lse is finite (§11.1).
DETLOGP_HD bool row_samplable(const RowStats& r) { return !fp::is_nan(r.lse) && r.lse != fp::neg_inf(); }

// lse_Sigma of §11.7: fl(M + logc(S_Sigma)); for the whole support it is lse (whole_support), so
// a backend that did not form the masked chain passes any support_sum there. The processed logp
// of a support lane is then target_logp(y_t, lse_Sigma).
DETLOGP_HD float support_lse(const RowStats& st, const SupportRow& s, float support_sum) {
  return whole_support(s) ? st.lse : row_lse(st.max, support_sum);
}

}  // namespace detlogp
