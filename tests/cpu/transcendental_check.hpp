// Exhaustive checking of the contract transcendentals against a double-precision reference:
// error measured in ulps of the fp32 ulp of the reference value (subnormal ulp = 2^-149),
// split over std::thread::hardware_concurrency() threads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

#include "detlogp/fpops.hpp"

namespace detlogp_test {

// ulp of the fp32 binade holding |r|; 2^-149 for the subnormal range (and below).
inline double fp32_ulp_of(double r) {
  r = std::fabs(r);
  if (r < 0x1p-126) return 0x1p-149;
  int e = 0;
  std::frexp(r, &e);  // r = m 2^e, m in [0.5, 1)
  return std::ldexp(1.0, e - 24);
}

struct UlpScan {
  double max_ulp = 0;
  uint32_t worst_bits = 0;  // argument with the largest error
  float worst_value = 0;    // what the function returned there
  double worst_reference = 0;
  uint64_t checked = 0;
  uint64_t non_finite_mismatches = 0;  // reference finite but result not, or the reverse
  uint32_t first_non_finite_bits = 0;
};

// Scans every fp32 bit pattern in [first_bits, last_bits] (inclusive) through f and ref.
template <class F, class Ref>
UlpScan scan_ulp(uint32_t first_bits, uint32_t last_bits, F f, Ref ref) {
  unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  const uint64_t total = static_cast<uint64_t>(last_bits) - first_bits + 1;
  if (total < threads * 4096ull) threads = 1;
  std::vector<UlpScan> partial(threads);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const uint64_t begin = first_bits + total * t / threads;
      const uint64_t end = first_bits + total * (t + 1) / threads;
      UlpScan s;
      for (uint64_t b = begin; b < end; ++b) {
        const float x = detlogp::fp::from_bits(static_cast<uint32_t>(b));
        const float y = f(x);
        const double r = ref(static_cast<double>(x));
        ++s.checked;
        if (!std::isfinite(r) || !std::isfinite(y)) {
          if (!(std::isfinite(r) == std::isfinite(y) && static_cast<double>(y) == r)) {
            if (s.non_finite_mismatches++ == 0) s.first_non_finite_bits = static_cast<uint32_t>(b);
          }
          continue;
        }
        const double err = std::fabs(static_cast<double>(y) - r) / fp32_ulp_of(r);
        if (err > s.max_ulp) {
          s.max_ulp = err;
          s.worst_bits = static_cast<uint32_t>(b);
          s.worst_value = y;
          s.worst_reference = r;
        }
      }
      partial[t] = s;
    });
  }
  for (auto& th : pool) th.join();
  UlpScan all;
  for (const auto& s : partial) {
    all.checked += s.checked;
    if (s.non_finite_mismatches && !all.non_finite_mismatches) all.first_non_finite_bits = s.first_non_finite_bits;
    all.non_finite_mismatches += s.non_finite_mismatches;
    if (s.max_ulp > all.max_ulp) {
      all.max_ulp = s.max_ulp;
      all.worst_bits = s.worst_bits;
      all.worst_value = s.worst_value;
      all.worst_reference = s.worst_reference;
    }
  }
  return all;
}

}  // namespace detlogp_test

namespace detlogp_test {

// Counts the fp32 bit patterns in [first_bits, last_bits] for which bad(x) holds, in parallel;
// also returns the first such pattern found by the lowest thread.
template <class Pred>
std::pair<uint64_t, uint32_t> count_bits_where(uint32_t first_bits, uint32_t last_bits, Pred bad) {
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  const uint64_t total = static_cast<uint64_t>(last_bits) - first_bits + 1;
  std::vector<uint64_t> counts(threads, 0);
  std::vector<uint32_t> firsts(threads, 0);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const uint64_t begin = first_bits + total * t / threads;
      const uint64_t end = first_bits + total * (t + 1) / threads;
      for (uint64_t b = begin; b < end; ++b) {
        if (bad(detlogp::fp::from_bits(static_cast<uint32_t>(b)))) {
          if (counts[t]++ == 0) firsts[t] = static_cast<uint32_t>(b);
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  uint64_t n = 0;
  uint32_t first = 0;
  for (unsigned t = 0; t < threads; ++t) {
    if (counts[t] && !n) first = firsts[t];
    n += counts[t];
  }
  return {n, first};
}

}  // namespace detlogp_test
