#include "io/weight_fingerprint.hpp"

#include <cstdint>

#include "detlogp/error.hpp"
#include "io/sha256.hpp"

namespace detlogp::io {

std::string weight_fingerprint(const std::vector<TensorView>& shards) {
  DETLOGP_CHECK(!shards.empty(), "weight_fingerprint needs at least one shard");
  int64_t rows = 0;
  const int64_t cols = shards.front().cols;
  for (size_t r = 0; r < shards.size(); ++r) {
    const TensorView& s = shards[r];
    DETLOGP_CHECK(s.memory == Memory::host, "weight_fingerprint: shard " << r << " is not in host memory");
    DETLOGP_CHECK(s.dtype == DType::bf16 && s.ndim == 2, "weight_fingerprint: shard " << r << " is not a bf16 matrix");
    DETLOGP_CHECK(s.cols == cols,
                  "weight_fingerprint: shard " << r << " has " << s.cols << " columns, shard 0 " << cols);
    rows += s.rows;
  }
  Sha256 h;
  const std::string header =
      "detlogp-weight-v1 bf16 rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) + "\n";
  h.update(header.data(), header.size());
  for (const TensorView& s : shards)
    for (int64_t r = 0; r < s.rows; ++r)
      h.update(static_cast<const uint16_t*>(s.data) + r * s.row_stride, static_cast<size_t>(cols) * 2);
  return Sha256::hex(h.finish());
}

}  // namespace detlogp::io
