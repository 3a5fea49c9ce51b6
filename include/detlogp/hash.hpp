// The project's one counter hash: SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom
// number generators", 2014). Integer operations only, so every platform, host or device, draws the
// same numbers: the golden input generator, the CLI's built-in problems, the tests and the
// benchmarks all build on these two pieces.
#pragma once

#include <cstdint>

#include "detlogp/config.hpp"

namespace detlogp {

// SplitMix64's increment (2^64 / golden ratio, odd).
inline constexpr uint64_t kSplitMixGamma = 0x9E3779B97F4A7C15ull;

// SplitMix64's output finalizer: a bijection of 64-bit words with full avalanche.
DETLOGP_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The sequential generator: the state advances by the gamma, each output is its mix.
class SplitMix64 {
 public:
  DETLOGP_HD explicit SplitMix64(uint64_t state) : state_(state) {}
  DETLOGP_HD uint64_t next() { return mix64(state_ += kSplitMixGamma); }
  // Uniform in [0, 1) with 53 random bits.
  DETLOGP_HD double uniform() { return static_cast<double>(next() >> 11) * 0x1p-53; }

 private:
  uint64_t state_;
};

}  // namespace detlogp
