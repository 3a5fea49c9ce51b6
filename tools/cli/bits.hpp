// How the CLI prints and compares fp32 bit patterns. Comparisons are on the bits (bitcmp.hpp), so
// -0.0 vs +0.0 and NaN payloads count as different.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace detlogp::cli {

// "0x%08x": lower-case hex, as `detlogp info` prints the canonical NaN.
std::string hex32(uint32_t u);

// "0x%08x (value)", the value with 9 significant digits: enough to tell any two floats apart.
std::string describe_bits(float x);

// "" when the bits of `a` equal those of `reference`; otherwise the first mismatch, as
// "what[i] = <bits> but reference[j] = <bits>". `reference_index` maps a's index i to the
// reference's index j (the identity when empty, and then the sizes must agree).
std::string compare_bits(const std::string& what, const std::vector<float>& a, const std::vector<float>& reference,
                         const std::vector<int64_t>& reference_index = {});

}  // namespace detlogp::cli
