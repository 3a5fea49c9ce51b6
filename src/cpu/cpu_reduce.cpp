// The contract reducer over fp32 logits given from anywhere, on the host. This is what lets
// another backend's serving logits be re-reduced and compared bit for bit.
#include <algorithm>
#include <vector>

#include "core/reduce_logits.hpp"
#include "cpu/cpu_parallel.hpp"
#include "cpu/cpu_tile_summary.hpp"

namespace detlogp::detail {

void cpu_reduce_logits(const ReduceLogitsProblem& p) {
  const int64_t tiles = shard_tiles(p.vocab);
  cpu::parallel_for(p.rows, cpu::cpu_threads(), [&](int64_t row, int) {
    const float* zr = p.logits + row * p.logits_stride;
    const float inv_t = inverse_temperature(p.temperature_rows ? p.temperature_rows[row] : p.temperature);
    std::vector<TileSummary> summaries(static_cast<size_t>(tiles));
    std::vector<float> usums(p.entropy ? static_cast<size_t>(tiles) : 0);
    float y[kVocabTile];
    for (int64_t g = 0; g < tiles; ++g) {
      const int64_t col0 = g * kVocabTile;
      const int cols = static_cast<int>(std::min<int64_t>(kVocabTile, p.vocab - col0));
      const int real = static_cast<int>(std::clamp<int64_t>(p.real_vocab - col0, 0, kVocabTile));
      for (int c = 0; c < cols; ++c) y[c] = scale_logit(zr[col0 + c], inv_t);
      if (p.entropy) {
        const TileEntropySummary s = tile_entropy_summary(y, std::min(real, cols));
        summaries[static_cast<size_t>(g)] = s.summary;
        usums[static_cast<size_t>(g)] = s.usum;
      } else {
        summaries[static_cast<size_t>(g)] = cpu::fast_tile_summary(y, std::min(real, cols));
      }
    }
    const RowChain chain = chain_row_summaries(summaries.data(), tiles);
    for (int64_t k = 0; k < p.targets_per_row; ++k) {  // each target's finalize: its single-target bits
      const int64_t i = row * p.targets_per_row + k;
      const int64_t target =
          p.targets_i64 ? static_cast<const int64_t*>(p.targets)[i] : static_cast<const int32_t*>(p.targets)[i];
      const bool ignored = target == p.ignore_index;
      const float y_t = ignored ? 0.0f : scale_logit(zr[target], inv_t);
      const RowResult r = finalize_row(chain.global_max, chain.sum, y_t, ignored);
      p.logp[i] = r.logp;
      p.lse[row] = r.lse;
    }
    if (p.entropy) p.entropy[row] = entropy_row_summaries(summaries.data(), usums.data(), tiles);
  });
}

}  // namespace detlogp::detail
