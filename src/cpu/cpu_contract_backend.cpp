// The contract on the host, in two backends that differ only in the K walk of §3.1:
// cpu-linear-logp-contract-v1 (the CPU's fp32 chain, arch cpu) and cpu-sm90-emulated-contract-v1
// (the SM90 wgmma model, docs/contract.md §3.1.1: the arch sm90a bits, computed on the host). Work
// is split into (vocab tile, row block) tasks; each task computes z for its block, the tile
// summaries (or a shard's edge lanes) and the owned y_t; a second pass runs the ascending chain per
// row.
#include <algorithm>
#include <memory>
#include <mutex>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cpu/cpu_gemm.hpp"
#include "cpu/cpu_parallel.hpp"
#include "cpu/cpu_sample.hpp"
#include "cpu/cpu_tile_summary.hpp"
#include "cpu/cpu_wgmma_gemm.hpp"
#include "detlogp/detlogp.hpp"

namespace detlogp::detail {
namespace {

constexpr int64_t kSummaryBudgetBytes = int64_t{64} << 20;  // bounded workspace: chunk rows
static_assert(cpu::kPanelCols == kVocabTile, "one GEMM panel is one vocab tile");

float row_inverse_temperature(const LogpProblem& p, int64_t row) {
  return inverse_temperature(p.temperature_rows ? p.temperature_rows[row] : p.temperature);
}

// The rows' top-k lists while the panels are walked: panels of one row run on several workers, so
// each row's list takes its lock (the lists' order is total, so which panel comes first does not
// change them).
struct TopkLists {
  int64_t k = 0;
  std::vector<TopkEntry> entries;  // [rows][k], sorted by topk_before
  std::vector<int> counts;
  std::vector<std::mutex> locks;
  TopkLists(int64_t rows, int64_t topk)
      : k(topk),
        entries(static_cast<size_t>(rows * topk)),
        counts(static_cast<size_t>(rows), 0),
        locks(static_cast<size_t>(rows)) {}
  void reset() { std::fill(counts.begin(), counts.end(), 0); }
  // The panel's real lanes y[0..real), ids first_id.. onwards, offered to row `at`'s list.
  void offer(int64_t at, const float* y, int real, int64_t first_id) {
    if (real <= 0) return;
    std::lock_guard<std::mutex> hold(locks[static_cast<size_t>(at)]);
    TopkEntry* list = entries.data() + at * k;
    int& count = counts[static_cast<size_t>(at)];
    topk_offer_lanes(list, static_cast<int>(k), count, y, real, first_id);
  }
};

// Where one row block's per-tile results go: summaries [rows][tiles], the entropy sums beside them
// when the entropy is asked for, a shard's edge lanes [rows][edge_lanes], the owned scaled target
// logit and its flag.
struct TileOutputs {
  int64_t tiles = 0;
  TileSummary* summaries = nullptr;
  float* usums = nullptr;
  int64_t edge_lanes = 0;
  float* edge_logits = nullptr;
  float* target_logit = nullptr;    // [rows][targets_per_row]
  uint8_t* target_owned = nullptr;  // [rows][targets_per_row]
  TopkLists* topk = nullptr;        // the rows' top-k lists, with the top-k output
};

// What one 64-column panel of z is: a whole global tile (its summary slot and real lanes), or the
// shard's lanes of a straddling tile (its first `edge_count` lanes are the edge lanes from `edge`).
struct PanelRole {
  int64_t slot = -1;
  int real_lanes = 0;
  int64_t edge = -1;
  int64_t edge_count = 0;
};

// Bias, logits, scaling, summary (and entropy sum) or edge lanes, and owned y_t of one row's z over
// one panel of `cols` columns from local column col0; `at` is the row's index in `out`.
template <class Gemm>
void panel_epilogue(const LogpProblem& p, int64_t row, int64_t col0, int cols, float* z, const TileOutputs& out,
                    int64_t at, const PanelRole& role) {
  if (p.bias) Gemm::add_bias(z, p.bias + col0, cols);
  if (p.logits) std::copy(z, z + cols, p.logits + row * p.vocab_local + col0);
  const float inv_t = row_inverse_temperature(p, row);
  float y[kVocabTile];
  for (int c = 0; c < cols; ++c) y[c] = scale_logit(z[c], inv_t);
  if (out.topk)
    out.topk->offer(at, y, role.slot >= 0 ? role.real_lanes : static_cast<int>(role.edge_count), p.vocab_start + col0);
  if (role.slot >= 0) {
    const int64_t slot = at * out.tiles + role.slot;
    if (out.usums) {
      const TileEntropySummary s = tile_entropy_summary(y, role.real_lanes);
      out.summaries[slot] = s.summary;
      out.usums[slot] = s.usum;
    } else {
      out.summaries[slot] = cpu::fast_tile_summary(y, role.real_lanes);
    }
  } else {
    std::copy(y, y + role.edge_count, out.edge_logits + at * out.edge_lanes + role.edge);
  }
  for (int64_t k = 0; k < p.targets_per_row; ++k) {
    const int64_t t = p.target(row, k);
    if (t == p.ignore_index) continue;
    const int64_t local = t - p.vocab_start - col0;
    if (local >= 0 && local < cols) {
      out.target_logit[at * p.targets_per_row + k] = y[local];
      out.target_owned[at * p.targets_per_row + k] = 1;
    }
  }
}

// Computes tile summaries (and logits, entropy sums, edge lanes, y_t) for rows [row0, row0 + rows)
// into row r - row0 of `out`. The panels (cpu::for_each_z_panel: one GEMM panel is 64 columns) fall
// on global tile boundaries: the columns before the shard's first whole tile are one panel of their
// own, then the whole tiles, then the tail's edge lanes. z does not depend on the panels (one
// K-ascending accumulator per output).
template <class Gemm>
void compute_tile_summaries(const LogpProblem& p, int64_t row0, int64_t rows, const TileOutputs& out) {
  const ShardGeometry g = p.geometry();
  const auto no_window = [](int64_t, int64_t) {};
  if (g.head_cols > 0)
    cpu::for_each_z_panel<Gemm>(p.hidden, p.hidden_stride, p.weight, p.weight_stride, p.dim, row0, rows, g.head_cols,
                                no_window, [&](int64_t row, int64_t, int cols, float* z) {
                                  panel_epilogue<Gemm>(p, row, 0, cols, z, out, row - row0, {-1, 0, 0, g.head_lanes});
                                });
  const int64_t rest = p.vocab_local - g.head_cols;
  if (rest == 0) return;
  cpu::for_each_z_panel<Gemm>(
      p.hidden, p.hidden_stride, p.weight + g.head_cols * p.weight_stride, p.weight_stride, p.dim, row0, rows, rest,
      no_window, [&](int64_t row, int64_t panel, int cols, float* z) {
        const PanelRole role = panel < g.tiles ? PanelRole{panel, g.real_lanes(panel, p.real_vocab), -1, 0}
                                               : PanelRole{-1, 0, g.head_lanes, g.tail_lanes};
        panel_epilogue<Gemm>(p, row, g.head_cols + panel * kVocabTile, cols, z, out, row - row0, role);
      });
}

template <class Gemm>
class CpuContractBackend final : public CpuBackend {
 public:
  CpuContractBackend(const char* id, const char* arch, int cc)
      : CpuBackend(contract_provenance(id, arch, cc, true, true)) {}
  bool contract_bearing() const override { return true; }
  SamplingReport run_sample(const SampleProblem& p) const override { return cpu_sample<Gemm>(p); }
  bool supports_multi_targets() const override { return true; }
  bool supports_topk() const override { return true; }

  void run(const LogpProblem& p) const override {
    if (p.rows == 0) return;
    const int64_t tiles = p.local_tiles();
    const int64_t per_row = p.targets_per_row;
    if (p.partial_mode()) {
      std::fill(p.target_logit, p.target_logit + p.rows * per_row, 0.0f);
      std::fill(p.target_owned, p.target_owned + p.rows * per_row, uint8_t{0});
      const ShardGeometry g = p.geometry();
      std::unique_ptr<TopkLists> topk = p.topk > 0 ? std::make_unique<TopkLists>(p.rows, p.topk) : nullptr;
      compute_tile_summaries<Gemm>(
          p, 0, p.rows,
          {g.tiles, p.summaries, p.usums, g.edge_lanes(), p.edge_logits, p.target_logit, p.target_owned, topk.get()});
      // The shard's lists; past its real ids (a shard of fewer than K) id -1 and y -inf.
      for (int64_t r = 0; topk && r < p.rows; ++r)
        topk_store_list(topk->entries.data() + r * p.topk, static_cast<int>(p.topk),
                        topk->counts[static_cast<size_t>(r)], p.topk_logit + r * p.topk, p.topk_ids + r * p.topk);
      return;
    }
    const int64_t tile_bytes = static_cast<int64_t>(sizeof(TileSummary) + (p.entropy ? sizeof(float) : 0));
    int64_t chunk = kSummaryBudgetBytes / (tiles * tile_bytes);
    chunk = std::max<int64_t>(cpu::kRowGroup, chunk / cpu::kRowGroup * cpu::kRowGroup);
    chunk = std::min(chunk, p.rows);
    std::vector<TileSummary> summaries(static_cast<size_t>(chunk * tiles));
    std::vector<float> target_logit(static_cast<size_t>(chunk * per_row));
    std::vector<uint8_t> owned(static_cast<size_t>(chunk * per_row));
    std::vector<float> usums(p.entropy ? static_cast<size_t>(chunk * tiles) : 0);
    std::unique_ptr<TopkLists> topk = p.topk > 0 ? std::make_unique<TopkLists>(chunk, p.topk) : nullptr;
    const TileOutputs out{
        tiles,        summaries.data(), p.entropy ? usums.data() : nullptr, 0, nullptr, target_logit.data(),
        owned.data(), topk.get()};
    for (int64_t row0 = 0; row0 < p.rows; row0 += chunk) {
      const int64_t rows = std::min(chunk, p.rows - row0);
      std::fill(owned.begin(), owned.end(), uint8_t{0});
      if (topk) topk->reset();
      compute_tile_summaries<Gemm>(p, row0, rows, out);
      cpu::parallel_for(rows, cpu::cpu_threads(), [&](int64_t r, int) {
        const int64_t row = row0 + r;
        const RowChain chain = chain_row_summaries(summaries.data() + r * tiles, tiles);
        for (int64_t k = 0; k < per_row; ++k) {  // each target's finalize: its single-target bits
          const bool ignored = p.target(row, k) == p.ignore_index;
          const RowResult res = finalize_row(chain.global_max, chain.sum, target_logit[r * per_row + k], ignored);
          p.logp[row * per_row + k] = res.logp;
          p.lse[row] = res.lse;
        }
        if (p.entropy)
          p.entropy[row] = entropy_row_summaries(summaries.data() + r * tiles, usums.data() + r * tiles, tiles);
        // The K first ids and their logp: finalize_row of each one's y, its single-target bits. The
        // shard holds the whole vocabulary, so every list is full (K <= real_vocab).
        for (int64_t j = 0; topk && j < p.topk; ++j) {
          const TopkEntry e = topk->entries[static_cast<size_t>(r * p.topk + j)];
          p.topk_ids[row * p.topk + j] = e.id;
          p.topk_logp[row * p.topk + j] = finalize_row(chain.global_max, chain.sum, e.y, false).logp;
        }
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
