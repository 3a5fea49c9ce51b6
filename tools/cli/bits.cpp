#include "cli/bits.hpp"

#include <cstdio>
#include <sstream>

#include "detlogp/bitcmp.hpp"

namespace detlogp::cli {

std::string hex32(uint32_t u) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", u);
  return buf;
}

std::string describe_bits(float x) {
  std::ostringstream os;
  os.precision(9);
  os << hex32(bitcmp::float_bits(x)) << " (" << x << ")";
  return os.str();
}

std::string compare_bits(const std::string& what, const std::vector<float>& a, const std::vector<float>& reference,
                         const std::vector<int64_t>& reference_index) {
  if (reference_index.empty() && a.size() != reference.size())
    return what + ": sizes differ (" + std::to_string(a.size()) + " vs " + std::to_string(reference.size()) + ")";
  std::vector<float> gathered;
  if (!reference_index.empty()) {
    gathered.reserve(a.size());
    for (size_t i = 0; i < a.size(); ++i) gathered.push_back(reference[static_cast<size_t>(reference_index[i])]);
  }
  const std::vector<float>& expected = reference_index.empty() ? reference : gathered;
  const bitcmp::Result r = bitcmp::compare(expected.data(), a.data(), static_cast<int64_t>(a.size()));
  if (r.identical()) return "";
  const int64_t i = r.first->index;
  const int64_t j = reference_index.empty() ? i : reference_index[static_cast<size_t>(i)];
  std::ostringstream os;
  os << what << "[" << i << "] = " << describe_bits(r.first->actual) << " but reference[" << j
     << "] = " << describe_bits(r.first->expected);
  return os.str();
}

}  // namespace detlogp::cli
