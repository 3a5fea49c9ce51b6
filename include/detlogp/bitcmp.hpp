// Bit-pattern comparison of fp32 arrays. Two floats are equal here only when their uint32 bit
// patterns are equal: -0.0 and +0.0 differ, two NaNs with different payloads differ, and a NaN
// equals itself only when its bits do. Header-only and free of any test framework, so the CLI,
// the CPU tests and the GPU tests share it.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "detlogp/fpops.hpp"

namespace detlogp::bitcmp {

inline uint32_t float_bits(float x) { return fp::bits(x); }

inline float float_from_bits(uint32_t u) { return fp::from_bits(u); }

// "%a (0xXXXXXXXX)": the exact value in hex-float notation and its bit pattern.
inline std::string describe_float(float x) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%a (0x%08X)", static_cast<double>(x), static_cast<unsigned>(float_bits(x)));
  return buf;
}

struct Mismatch {
  int64_t index = -1;
  float expected = 0.0f;
  float actual = 0.0f;
  uint32_t expected_bits = 0;
  uint32_t actual_bits = 0;
};

struct Result {
  int64_t compared = 0;    // elements compared
  int64_t mismatches = 0;  // elements whose bit patterns differ
  std::optional<Mismatch> first;

  bool identical() const { return mismatches == 0; }
  explicit operator bool() const { return identical(); }

  // One line: "<what>: N elements bit-identical" or
  // "<what>: M of N elements differ; first at [i]: expected %a (0x...), actual %a (0x...)".
  std::string describe(const std::string& what = "arrays") const {
    std::string s = what + ": ";
    if (mismatches == 0) return s + std::to_string(compared) + " elements bit-identical";
    s += std::to_string(mismatches) + " of " + std::to_string(compared) + " elements differ";
    if (first) {
      s += "; first at [" + std::to_string(first->index) + "]: expected " + describe_float(first->expected) +
           ", actual " + describe_float(first->actual);
    }
    return s;
  }
};

// Compares expected[0..n) with actual[0..n) bit for bit.
inline Result compare(const float* expected, const float* actual, int64_t n) {
  Result r;
  r.compared = n;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = float_bits(expected[i]);
    const uint32_t b = float_bits(actual[i]);
    if (a == b) continue;
    if (!r.first) r.first = Mismatch{i, expected[i], actual[i], a, b};
    ++r.mismatches;
  }
  return r;
}

// Vectors of different lengths: the common prefix is compared and every element beyond it
// counts as a mismatch (the first such one is reported when the prefix matched, with the
// missing side shown as 0x00000000).
inline Result compare(const std::vector<float>& expected, const std::vector<float>& actual) {
  const int64_t common = static_cast<int64_t>(expected.size() < actual.size() ? expected.size() : actual.size());
  Result r = compare(expected.data(), actual.data(), common);
  const int64_t longer = static_cast<int64_t>(expected.size() > actual.size() ? expected.size() : actual.size());
  if (longer > common) {
    r.compared = longer;
    r.mismatches += longer - common;
    if (!r.first) {
      const float e = common < static_cast<int64_t>(expected.size()) ? expected[common] : 0.0f;
      const float a = common < static_cast<int64_t>(actual.size()) ? actual[common] : 0.0f;
      r.first = Mismatch{common, e, a, float_bits(e), float_bits(a)};
    }
  }
  return r;
}

// Strided rows: compares `rows` rows of `cols` elements, row r starting at base + r * stride.
// The reported index is the flat index r * cols + c.
inline Result compare_rows(const float* expected, int64_t expected_stride, const float* actual, int64_t actual_stride,
                           int64_t rows, int64_t cols) {
  Result r;
  r.compared = rows * cols;
  for (int64_t i = 0; i < rows; ++i) {
    const Result row = compare(expected + i * expected_stride, actual + i * actual_stride, cols);
    if (row.mismatches == 0) continue;
    if (!r.first) {
      r.first = row.first;
      r.first->index += i * cols;
    }
    r.mismatches += row.mismatches;
  }
  return r;
}

}  // namespace detlogp::bitcmp
