// The logit gradient of linear_logp_grad_logits (docs/contract.md, appendix A): from a logit z
// (the full K walk plus bias, the same z as the serving entry's logits) and a row's forward lse
// to the bf16 gradient dL/dz. One definition, compiled for host and device alike, so the CPU
// implementation and the SM90 epilogue give the same bits for the same z. Gradients are not part
// of contract v1's frozen outputs (logp/lse), but this op's fp32 order is pinned here all the same.
#pragma once

#include <cstdint>

#include "detlogp/config.hpp"
#include "detlogp/fpops.hpp"
#include "detlogp/reduce.hpp"
#include "detlogp/sample.hpp"
#include "detlogp/transcendentals.hpp"

namespace detlogp {

using fp::bf16_round;  // a NaN gradient is stored as the canonical kCanonicalNanBf16

// Per-row operands of the logit gradient: gl = dL/dlogp (+0 for an ignored row, or when absent;
// with K targets a row the sum of the entries' dL/dlogp, entry_gradient_sum),
// gs = dL/dlse (+0 when absent), inv_t = inverse_temperature(T_row), lse the forward's lse. With an
// entropy term (a dL/dH input given): gh = dL/dH and h the forward's entropy H of the row.
struct GradRow {
  float inv_t;
  float lse;
  float gl;
  float gs;
  bool entropy_term = false;
  float gh = 0.0f;
  float h = 0.0f;
};

// dL/dz of one logit in fp32, in this exact order:
//   padding (global id >= real_vocab): +0 exactly, no arithmetic (a target is never padding)
//   y = fl(z * inv_t)                                (scale_logit)
//   x = fl(y - lse);  p = expc(x)
//   c = fl(gs - gl)
//   entropy term only, and only where p != 0:  c = fma(-gh, fl(x + h), c)
//   d = fl(c * p);  d = fl(d + gl) at the target column only
//   g = fl(d * inv_t)
// dH/dy_v = -p_v (log p_v + H) with log p_v = x, so the entropy term is one fma on the factor of p.
// Where p == 0 it is skipped (x may be -inf there, and the term would be 0 * inf). Without the
// entropy term the bits are those of the logp/lse-only gradient.
// The two halves of grad_logit around its exponential, for a backend that evaluates many
// exponentials at once (the SM90 epilogue: expc_normal where the argument allows, same bits).
//
// With K targets a row ([N, K], docs/contract.md appendix A): gl is the sum of the non-ignored
// entries' g_k (entry_gradient_sum) and the target step is d = fl(d + g_k) once per non-ignored
// entry k whose id is this column, in ascending k (grad_from_p_entries; a repeated id adds each
// of its entries). K = 1 is the single-target order above, bit for bit.
DETLOGP_HD float grad_exp_arg(float z, const GradRow& r) { return fp::sub(scale_logit(z, r.inv_t), r.lse); }
DETLOGP_HD float grad_p_term(float p, float x, const GradRow& r) {
  float c = fp::sub(r.gs, r.gl);
  if (r.entropy_term && p != 0.0f) c = fp::fma(fp::neg(r.gh), fp::add(x, r.h), c);
  return fp::mul(c, p);
}
DETLOGP_HD float grad_from_p(float p, float x, const GradRow& r, bool is_target) {
  float d = grad_p_term(p, x, r);
  if (is_target) d = fp::add(d, r.gl);
  return fp::mul(d, r.inv_t);
}
DETLOGP_HD float grad_from_p_entries(float p, float x, const GradRow& r, const float* adds, int n_adds) {
  float d = grad_p_term(p, x, r);
  for (int i = 0; i < n_adds; ++i) d = fp::add(d, adds[i]);
  return fp::mul(d, r.inv_t);
}

// gl of a row of K entries: the first non-ignored g_k, then fl(gl + g_k) for each later one in
// ascending k; +0 when every entry is ignored (K = 1: g, or +0 for an ignored row).
DETLOGP_HD float entry_gradient_sum(const float* g, const bool* ignored, int k) {
  float sum = 0.0f;
  bool first = true;
  for (int i = 0; i < k; ++i) {
    if (ignored[i]) continue;
    sum = first ? g[i] : fp::add(sum, g[i]);
    first = false;
  }
  return sum;
}

DETLOGP_HD float grad_logit(float z, const GradRow& r, bool real, bool is_target) {
  if (!real) return 0.0f;
  const float x = grad_exp_arg(z, r);
  return grad_from_p(expc(x), x, r, is_target);
}

// The stored gradient: bf16_round(grad_logit(...)).
DETLOGP_HD uint16_t grad_logit_bf16(float z, const GradRow& r, bool real, bool is_target) {
  return bf16_round(grad_logit(z, r, real, is_target));
}

// The stored gradient of a column that n_adds entries of the row name (adds: their g_k in entry
// order; n_adds = 0 for any other column). A target is never padding.
DETLOGP_HD uint16_t grad_logit_entries_bf16(float z, const GradRow& r, bool real, const float* adds, int n_adds) {
  if (!real) return 0;
  const float x = grad_exp_arg(z, r);
  return bf16_round(grad_from_p_entries(expc(x), x, r, adds, n_adds));
}

// The logit gradient of the sampling program's replay (docs/contract.md §11.10), the support Sigma
// fixed: logp = y_t - lse_Sigma over Sigma, logp_raw = y_t - lse and lse over every real lane. Per
// row: gl = dL/dlogp (+0 for an ignored row and for a target outside Sigma, whose logp is the
// constant -inf), gs = dL/dlse, glr = dL/dlogp_raw (+0 for an ignored row), inv_t the program's
// (1 for T = 0), the forward's lse and lse_Sigma, and the row's support (M, cut, min_p).
struct SampledGradRow {
  float inv_t;
  float lse;
  float lse_support;
  SupportRow support;
  float gl;
  float gs;
  float glr;
};

// dL/dz of one logit with global id `id`, in this exact order:
//   padding: +0 exactly
//   y = fl(z * inv_t);  p = expc(fl(y - lse));  d = fl(fl(gs - glr) * p)
//   y in Sigma (in_support):  d = fma(-gl, expc(fl(y - lse_Sigma)), d)
//   target column:  d = fl(d + fl(gl + glr))
//   g = fl(d * inv_t)
// that is dL/dy = onehot(t) (gl + glr) - gl [y in Sigma] p_Sigma + (gs - glr) p.
// Its second half, after the two exponentials (for a backend that evaluates many at once: the SM90
// epilogue, expc_normal where the arguments allow, same bits): p = expc(fl(y - lse)), p_support =
// expc(fl(y - lse_Sigma)) (read only for a lane in Sigma), in_sigma = in_support(y, id, r.support).
DETLOGP_HD float sampled_grad_from_p(float p, float p_support, bool in_sigma, const SampledGradRow& r, bool is_target) {
  float d = fp::mul(fp::sub(r.gs, r.glr), p);
  if (in_sigma) d = fp::fma(fp::neg(r.gl), p_support, d);
  if (is_target) d = fp::add(d, fp::add(r.gl, r.glr));
  return fp::mul(d, r.inv_t);
}

DETLOGP_HD float sampled_grad_logit(float z, int64_t id, const SampledGradRow& r, bool real, bool is_target) {
  if (!real) return 0.0f;
  const float y = scale_logit(z, r.inv_t);
  const bool in_sigma = in_support(y, id, r.support);
  const float p_support = in_sigma ? expc(fp::sub(y, r.lse_support)) : 0.0f;
  return sampled_grad_from_p(expc(fp::sub(y, r.lse)), p_support, in_sigma, r, is_target);
}

}  // namespace detlogp
