// reduce_logits: validate, then the one implementation (host memory: the CPU reducer).
#include "core/env.hpp"
#include "core/reduce_logits.hpp"
#include "detlogp/detlogp.hpp"

namespace detlogp {

void reduce_logits(const ReduceLogitsInputs& in, const MutableTensorView& logp, const MutableTensorView& lse,
                   const MutableTensorView& entropy) {
  detail::check_environment();
  const detail::ReduceLogitsProblem p = detail::make_reduce_logits_problem(in, logp, lse, entropy);
  if (p.rows > 0) detail::cpu_reduce_logits(p);
}

}  // namespace detlogp
