// The tests' random numbers, all drawn from the project's one counter hash (detlogp/hash.hpp): a
// sequential generator for host code (Rng) and a counter-based draw (unit_float_at) that host and
// device code index by element. Integer operations up to the final conversion, so a test's data
// is the same on every machine.
#pragma once

#include <cmath>
#include <cstdint>

#include "detlogp/config.hpp"
#include "detlogp/hash.hpp"

namespace detlogp_test {

// The top 24 bits of a 64-bit draw as a float in [0, 1) (exact: a multiple of 2^-24).
DETLOGP_HD float unit_float(uint64_t draw) { return static_cast<float>(draw >> 40) * 0x1p-24f; }

// Element i of the counter-based stream `seed`: the first output of a SplitMix64 started at
// seed * 0x100000001B3 + i, so every thread draws its own elements in any order.
DETLOGP_HD float unit_float_at(uint64_t seed, int64_t i) {
  return unit_float(detlogp::SplitMix64(seed * 0x100000001B3ull + static_cast<uint64_t>(i)).next());
}

// The host tests' sequential generator: detlogp::SplitMix64 and the draws the tests build from it.
class Rng : public detlogp::SplitMix64 {
 public:
  using SplitMix64::SplitMix64;
  // Uniform integer in [0, n).
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
  // Uniform float in [0, 1) with 24 random bits.
  float next_unit_float() { return unit_float(next()); }
  // Standard normal by Box-Muller (one value per call; deterministic on a given libm).
  double normal() {
    double u1 = uniform();
    if (u1 < 0x1p-60) u1 = 0x1p-60;
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

}  // namespace detlogp_test
