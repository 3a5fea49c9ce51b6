// cpu-linear-logp-contract-v1: the whole contract on the host. Work is split into (vocab tile,
// row block) tasks; each task computes z for its block, the tile summaries and the owned y_t;
// a second pass runs the ascending chain per row.
#include <algorithm>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cpu/cpu_gemm.hpp"
#include "cpu/cpu_parallel.hpp"
#include "detlogp/detlogp.hpp"

namespace detlogp::detail {
namespace {

constexpr int64_t kSummaryBudgetBytes = int64_t{64} << 20;  // bounded workspace: chunk rows
static_assert(cpu::kPanelCols == kVocabTile, "one GEMM panel is one vocab tile");

float row_inverse_temperature(const LogpProblem& p, int64_t row) {
  return inverse_temperature(p.temperature_rows ? p.temperature_rows[row] : p.temperature);
}

// Bias, logits, scaling, summary and owned y_t of one row's z over one tile.
void tile_epilogue(const LogpProblem& p, int64_t row, int64_t tile, int cols, float* z, TileSummary& summary,
                   float& target_logit, uint8_t& target_owned) {
  const int64_t col0 = tile * kVocabTile;
  if (p.bias)
    for (int c = 0; c < cols; ++c) z[c] = add_bias(z[c], p.bias[col0 + c]);
  if (p.logits) std::copy(z, z + cols, p.logits + row * p.vocab_local + col0);
  const float inv_t = row_inverse_temperature(p, row);
  float y[kVocabTile];
  for (int c = 0; c < cols; ++c) y[c] = scale_logit(z[c], inv_t);
  summary = tile_summary(y, p.real_lanes(tile));
  const int64_t t = p.target(row);
  if (t == p.ignore_index) return;
  const int64_t local = t - p.vocab_start - col0;
  if (local >= 0 && local < cols) {
    target_logit = y[local];
    target_owned = 1;
  }
}

// Computes tile summaries (and logits, y_t) for rows [row0, row0 + rows), writing summaries to
// summaries[(r - row0) * tiles + j] and the owned scaled target logit to target_logit[r - row0]
// (cpu::for_each_z_panel: one GEMM panel is one vocab tile).
void compute_tile_summaries(const LogpProblem& p, int64_t row0, int64_t rows, TileSummary* summaries,
                            float* target_logit, uint8_t* target_owned) {
  const int64_t tiles = p.local_tiles();
  cpu::for_each_z_panel(
      p.hidden, p.hidden_stride, p.weight, p.weight_stride, p.dim, row0, rows, p.vocab_local, [](int64_t, int64_t) {},
      [&](int64_t row, int64_t tile, int cols, float* z) {
        const int64_t out = row - row0;
        tile_epilogue(p, row, tile, cols, z, summaries[out * tiles + tile], target_logit[out], target_owned[out]);
      });
}

class CpuContractBackend final : public CpuBackend {
 public:
  CpuContractBackend() : CpuBackend(contract_provenance("cpu-linear-logp-contract-v1", "cpu", 0)) {}
  bool contract_bearing() const override { return true; }

  void run(const LogpProblem& p) const override {
    if (p.rows == 0) return;
    const int64_t tiles = p.local_tiles();
    if (p.partial_mode()) {
      std::fill(p.target_logit, p.target_logit + p.rows, 0.0f);
      std::fill(p.target_owned, p.target_owned + p.rows, uint8_t{0});
      compute_tile_summaries(p, 0, p.rows, p.summaries, p.target_logit, p.target_owned);
      return;
    }
    int64_t chunk = kSummaryBudgetBytes / (tiles * static_cast<int64_t>(sizeof(TileSummary)));
    chunk = std::max<int64_t>(cpu::kRowGroup, chunk / cpu::kRowGroup * cpu::kRowGroup);
    chunk = std::min(chunk, p.rows);
    std::vector<TileSummary> summaries(static_cast<size_t>(chunk * tiles));
    std::vector<float> target_logit(static_cast<size_t>(chunk));
    std::vector<uint8_t> owned(static_cast<size_t>(chunk));
    for (int64_t row0 = 0; row0 < p.rows; row0 += chunk) {
      const int64_t rows = std::min(chunk, p.rows - row0);
      std::fill(owned.begin(), owned.end(), uint8_t{0});
      compute_tile_summaries(p, row0, rows, summaries.data(), target_logit.data(), owned.data());
      cpu::parallel_for(rows, cpu::cpu_threads(), [&](int64_t r, int) {
        const int64_t row = row0 + r;
        const bool ignored = p.target(row) == p.ignore_index;
        const RowResult res = reduce_row_summaries(summaries.data() + r * tiles, tiles, target_logit[r], ignored);
        p.logp[row] = res.logp;
        p.lse[row] = res.lse;
      });
    }
  }
};

}  // namespace

const Backend& cpu_contract_backend() {
  static const CpuContractBackend backend;
  return backend;
}

}  // namespace detlogp::detail
