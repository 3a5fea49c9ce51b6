// Platform-independent input generator for goldens and the validation harness (docs/validation.md).
//
// Every value is a pure function of (seed, stream, index): a counter-based hash built from 64-bit
// integer operations only, turned into fp32 with integer sums, int->float conversions that are
// exact, and IEEE basic operations (+ - * / sqrt, correctly rounded everywhere). No libm
// transcendental and no std::*_distribution is used, so every platform and compiler gives the
// same bits (the library's -ffp-contract=off keeps multiply-adds separately rounded).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "detlogp/tensor.hpp"
#include "io/weight_fingerprint.hpp"

namespace detlogp::golden {

// Stream tags: each tensor draws from its own stream, so a tensor's values never depend on the
// shape of another one.
enum Stream : uint64_t {
  kStreamHidden = 101,
  kStreamWeight = 102,
  kStreamBias = 103,
  kStreamTargets = 104,
  kStreamTemperature = 105,
  kStreamSampler = 106,
  kStreamSchedule = 107,
};

// The counter-based hash: SplitMix64 finalizer rounds (detlogp::mix64) over (seed, stream) and
// the index.
uint64_t draw(uint64_t seed, uint64_t stream, uint64_t index);

// Standard-normal approximation: Irwin-Hall sum of the eight 16-bit fields of two draws
// (indices 2i and 2i+1), centred, times fl(1/53510) (sd 1 within 2e-5; tails cut at 4.9 sd).
float normal(uint64_t seed, uint64_t stream, uint64_t index);

// Uniform in [0, 1): the top 24 bits of one draw, times 2^-24 (exact).
float uniform(uint64_t seed, uint64_t stream, uint64_t index);

constexpr float kWeightStd = 0.02f;

// lm_head rows [row_begin, row_begin + rows) of a [*, dim] weight, each element
// bf16(0.02 * normal(seed, weight, global_row * dim + k)): a shard is a slice of the full head.
std::vector<uint16_t> weight_rows(uint64_t seed, int64_t row_begin, int64_t rows, int64_t dim);

// One RMS-normalized hidden row: x_k = normal(seed, hidden, key * dim + k), plus, when
// `dominant_row` is given (a bf16 weight row), c * W_k / 0.02 with c = dominant_mix(dim) so that
// row's logit is about dominant_logit(dim) * gain; then h_k = bf16(gain * x_k / rms),
// rms = sqrt(fl(sum_k x_k^2 in ascending k) / dim).
void hidden_row(uint64_t seed, uint64_t key, int64_t dim, float gain, const uint16_t* dominant_row, uint16_t* out);

// z_t ~ 0.02 c D / sqrt(1 + c^2) for h = (n + c u) / rms, so c = Z / sqrt((0.02 D)^2 - Z^2);
// where 0.02 D is too small for Z (tiny D), c = 4. Z = 12 below D = 4096 and 18 from there (the
// other logits spread as 0.02 sqrt(D)): logp near 0 but not exactly 0 at T = 1 (measured in
// tests/golden: about -1e-2 at D = 1024, V = 2053).
float dominant_logit(int64_t dim);
float dominant_mix(int64_t dim);

// The weight-version fingerprint (docs/validation.md), defined beside the hashing in io/.
using io::weight_fingerprint;

}  // namespace detlogp::golden
