// The contract on the host, in two backends that differ only in the K walk of §3.1:
// cpu-linear-logp-contract-v1 (the CPU's fp32 chain, arch cpu) and cpu-sm90-emulated-contract-v1
// (the SM90 wgmma model, docs/contract.md §3.1.1: the arch sm90a bits, computed on the host). Work
// is split into (vocab tile, row block) tasks; each task computes z for its block, the tile
// summaries and the owned y_t; a second pass runs the ascending chain per row.
#include <algorithm>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cpu/cpu_gemm.hpp"
#include "cpu/cpu_parallel.hpp"
#include "cpu/cpu_sample.hpp"
#include "cpu/cpu_wgmma_gemm.hpp"
#include "detlogp/detlogp.hpp"

namespace detlogp::detail {
namespace {

constexpr int64_t kSummaryBudgetBytes = int64_t{64} << 20;  // bounded workspace: chunk rows
static_assert(cpu::kPanelCols == kVocabTile, "one GEMM panel is one vocab tile");

float row_inverse_temperature(const LogpProblem& p, int64_t row) {
  return inverse_temperature(p.temperature_rows ? p.temperature_rows[row] : p.temperature);
}

// Where one row block's per-tile results go: summaries [rows][tiles], the entropy sums beside them
// when the entropy is asked for, the owned scaled target logit and its flag.
struct TileOutputs {
  TileSummary* summaries = nullptr;
  float* usums = nullptr;
  float* target_logit = nullptr;
  uint8_t* target_owned = nullptr;
};

// Bias, logits, scaling, summary (and entropy sum) and owned y_t of one row's z over one tile;
// `at` is the row's index in `out`.
template <class Gemm>
void tile_epilogue(const LogpProblem& p, int64_t row, int64_t tile, int cols, float* z, const TileOutputs& out,
                   int64_t at) {
  const int64_t col0 = tile * kVocabTile;
  if (p.bias) Gemm::add_bias(z, p.bias + col0, cols);
  if (p.logits) std::copy(z, z + cols, p.logits + row * p.vocab_local + col0);
  const float inv_t = row_inverse_temperature(p, row);
  float y[kVocabTile];
  for (int c = 0; c < cols; ++c) y[c] = scale_logit(z[c], inv_t);
  const int64_t slot = at * p.local_tiles() + tile;
  if (out.usums) {
    const TileEntropySummary s = tile_entropy_summary(y, p.real_lanes(tile));
    out.summaries[slot] = s.summary;
    out.usums[slot] = s.usum;
  } else {
    out.summaries[slot] = tile_summary(y, p.real_lanes(tile));
  }
  const int64_t t = p.target(row);
  if (t == p.ignore_index) return;
  const int64_t local = t - p.vocab_start - col0;
  if (local >= 0 && local < cols) {
    out.target_logit[at] = y[local];
    out.target_owned[at] = 1;
  }
}

// Computes tile summaries (and logits, entropy sums, y_t) for rows [row0, row0 + rows) into row
// r - row0 of `out` (cpu::for_each_z_panel: one GEMM panel is one vocab tile).
template <class Gemm>
void compute_tile_summaries(const LogpProblem& p, int64_t row0, int64_t rows, const TileOutputs& out) {
  cpu::for_each_z_panel<Gemm>(
      p.hidden, p.hidden_stride, p.weight, p.weight_stride, p.dim, row0, rows, p.vocab_local, [](int64_t, int64_t) {},
      [&](int64_t row, int64_t tile, int cols, float* z) {
        tile_epilogue<Gemm>(p, row, tile, cols, z, out, row - row0);
      });
}

template <class Gemm>
class CpuContractBackend final : public CpuBackend {
 public:
  CpuContractBackend(const char* id, const char* arch, int cc)
      : CpuBackend(contract_provenance(id, arch, cc, true, true)) {}
  bool contract_bearing() const override { return true; }
  SamplingReport run_sample(const SampleProblem& p) const override { return cpu_sample<Gemm>(p); }

  void run(const LogpProblem& p) const override {
    if (p.rows == 0) return;
    const int64_t tiles = p.local_tiles();
    if (p.partial_mode()) {
      std::fill(p.target_logit, p.target_logit + p.rows, 0.0f);
      std::fill(p.target_owned, p.target_owned + p.rows, uint8_t{0});
      compute_tile_summaries<Gemm>(p, 0, p.rows, {p.summaries, p.usums, p.target_logit, p.target_owned});
      return;
    }
    const int64_t tile_bytes = static_cast<int64_t>(sizeof(TileSummary) + (p.entropy ? sizeof(float) : 0));
    int64_t chunk = kSummaryBudgetBytes / (tiles * tile_bytes);
    chunk = std::max<int64_t>(cpu::kRowGroup, chunk / cpu::kRowGroup * cpu::kRowGroup);
    chunk = std::min(chunk, p.rows);
    std::vector<TileSummary> summaries(static_cast<size_t>(chunk * tiles));
    std::vector<float> target_logit(static_cast<size_t>(chunk));
    std::vector<uint8_t> owned(static_cast<size_t>(chunk));
    std::vector<float> usums(p.entropy ? static_cast<size_t>(chunk * tiles) : 0);
    const TileOutputs out{summaries.data(), p.entropy ? usums.data() : nullptr, target_logit.data(), owned.data()};
    for (int64_t row0 = 0; row0 < p.rows; row0 += chunk) {
      const int64_t rows = std::min(chunk, p.rows - row0);
      std::fill(owned.begin(), owned.end(), uint8_t{0});
      compute_tile_summaries<Gemm>(p, row0, rows, out);
      cpu::parallel_for(rows, cpu::cpu_threads(), [&](int64_t r, int) {
        const int64_t row = row0 + r;
        const bool ignored = p.target(row) == p.ignore_index;
        const RowResult res = reduce_row_summaries(summaries.data() + r * tiles, tiles, target_logit[r], ignored);
        p.logp[row] = res.logp;
        p.lse[row] = res.lse;
        if (p.entropy)
          p.entropy[row] = entropy_row_summaries(summaries.data() + r * tiles, usums.data() + r * tiles, tiles);
      });
    }
  }
};

}  // namespace

const Backend& cpu_contract_backend() {
  static const CpuContractBackend<cpu::Fp32ChainGemm> backend("cpu-linear-logp-contract-v1", "cpu", 0);
  return backend;
}

// The SM90 backend's bits (arch sm90a, cc 90: the key of its golden fingerprints), on the host.
const Backend& cpu_sm90_emulated_backend() {
  static const CpuContractBackend<cpu::WgmmaModelGemm> backend("cpu-sm90-emulated-contract-v1", "sm90a", 90);
  return backend;
}

}  // namespace detlogp::detail
