// The sampling program on the host (docs/contract.md §11): the CPU contract backend's rollout and
// replay, over the contract GEMM's logits in bounded row chunks.
#pragma once

#include "core/sample.hpp"

namespace detlogp::detail {

// Runs a validated sampling problem (host memory): logits [chunk, V_local] at a time (the serving
// logits when asked for, else a bounded buffer of about 64 MiB, or chunk_rows rows when > 0), each
// row's program on the pool's threads. The chunk is a free axis: no bit depends on it.
// Gemm: the backend's K walk (cpu::Fp32ChainGemm, or cpu::WgmmaModelGemm for the SM90 bits).
template <class Gemm>
SamplingReport cpu_sample(const SampleProblem& p, int64_t chunk_rows = 0);

// The same program over given logits z [p.rows][p.vocab_local] f32 (host memory, bias included: the
// serving logits of any backend); p's hidden, weight and bias are not read. Applied to an arch's own
// serving logits it gives the bits that arch's sampling entry must give.
SamplingReport cpu_sample_from_logits(const SampleProblem& p, const float* logits);

}  // namespace detlogp::detail
