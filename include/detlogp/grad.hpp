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
#include "detlogp/transcendentals.hpp"

namespace detlogp {

using fp::bf16_round;  // a NaN gradient is stored as the canonical kCanonicalNanBf16

// Per-row operands of the logit gradient: gl = dL/dlogp (+0 for an ignored row, or when absent),
// gs = dL/dlse (+0 when absent), inv_t = inverse_temperature(T_row), lse the forward's lse.
struct GradRow {
  float inv_t;
  float lse;
  float gl;
  float gs;
};

// dL/dz of one logit in fp32, in this exact order:
//   padding (global id >= real_vocab): +0 exactly, no arithmetic (a target is never padding)
//   y = fl(z * inv_t)                                (scale_logit)
//   p = expc(fl(y - lse))
//   d = fl(fl(gs - gl) * p);  d = fl(d + gl) at the target column only
//   g = fl(d * inv_t)
// The two halves of grad_logit around its exponential, for a backend that evaluates many
// exponentials at once (the SM90 epilogue: expc_normal where the argument allows, same bits).
DETLOGP_HD float grad_exp_arg(float z, const GradRow& r) { return fp::sub(scale_logit(z, r.inv_t), r.lse); }
DETLOGP_HD float grad_from_p(float p, const GradRow& r, bool is_target) {
  float d = fp::mul(fp::sub(r.gs, r.gl), p);
  if (is_target) d = fp::add(d, r.gl);
  return fp::mul(d, r.inv_t);
}

DETLOGP_HD float grad_logit(float z, const GradRow& r, bool real, bool is_target) {
  if (!real) return 0.0f;
  return grad_from_p(expc(grad_exp_arg(z, r)), r, is_target);
}

// The stored gradient: bf16_round(grad_logit(...)).
DETLOGP_HD uint16_t grad_logit_bf16(float z, const GradRow& r, bool real, bool is_target) {
  return bf16_round(grad_logit(z, r, real, is_target));
}

}  // namespace detlogp
