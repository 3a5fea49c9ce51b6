// The sampling program on the host. Per row chunk, the contract GEMM (cpu::for_each_z_panel, the
// driver and K walk of the CPU backend's logits) writes z [rows, V_local]; then every row runs the
// program of docs/contract.md §11 on its own: the raw tile summaries and chain (§5-§6, the bits of
// linear_logp), with the top-k output its K largest y (§12), the cut by a sort of the candidates'
// rank keys, one support pass (masked summaries, chain, Gumbel-max), the finalize. A row's bits
// depend on its z and parameters alone, so the chunk size and the thread count are free.
#include "cpu/cpu_sample.hpp"

#include <algorithm>
#include <functional>
#include <vector>

#include "cpu/cpu_gemm.hpp"
#include "cpu/cpu_parallel.hpp"
#include "cpu/cpu_tile_summary.hpp"
#include "cpu/cpu_wgmma_gemm.hpp"
#include "detlogp/sample.hpp"
#include "detlogp/topk.hpp"

namespace detlogp::detail {
namespace {

constexpr int64_t kLogitsBudgetBytes = int64_t{64} << 20;  // the z chunk when logits are not asked for

// One worker's buffers, reused across its rows.
struct RowScratch {
  std::vector<float> y;
  std::vector<TileSummary> tiles;
  std::vector<uint64_t> keys;
  std::vector<std::pair<uint64_t, uint64_t>> weighted;  // (rank key, top-p mass) of the top-p candidates
  std::vector<TopkEntry> topk;                          // the top-k output's list
};

// The row's top-k output (§12): its K largest y in topk_before order, each with its raw logp, the
// bits linear_logp's top-k output gives for the same y and lse (K <= real_vocab: the list is full).
void write_topk(const SampleProblem& p, int64_t n, const float* y, int64_t lanes, float lse, RowScratch& s) {
  const int k = static_cast<int>(p.topk);
  s.topk.resize(static_cast<size_t>(k));
  int count = 0;
  topk_offer_lanes(s.topk.data(), k, count, y, lanes, 0);
  for (int j = 0; j < k; ++j) {
    p.topk_ids[n * k + j] = s.topk[static_cast<size_t>(j)].id;
    p.topk_logp[n * k + j] = target_logp(s.topk[static_cast<size_t>(j)].y, lse);
  }
}

// The cut of §11.4-§11.5 over a row's y[0, lanes) (global ids = lane indices), by sorting rank keys:
// top-k selects the keep largest keys, top-p sorts the ones among them with a positive mass (only
// those can end the prefix, §11.5) and walks their exact prefix sums.
SupportCut find_cut(const float* y, int64_t lanes, float row_max, const SampleRowParams& r, RowScratch& s) {
  s.keys.resize(static_cast<size_t>(lanes));
  for (int64_t v = 0; v < lanes; ++v) s.keys[static_cast<size_t>(v)] = rank_key(y[v], v);
  auto first = s.keys.begin();
  auto kept = s.keys.end();
  if (r.keep < lanes) {
    kept = first + r.keep;
    std::nth_element(first, kept - 1, s.keys.end(), std::greater<uint64_t>());
  }
  if (r.top_p == 1.0f) {
    const int64_t id = rank_key_id(*(kept - 1));
    return {y[id], id};
  }
  s.weighted.clear();
  uint64_t total = 0;
  for (auto it = first; it != kept; ++it) {
    const uint64_t q = top_p_mass(relative_weight(y[rank_key_id(*it)], row_max));
    total += q;
    if (q > 0) s.weighted.emplace_back(*it, q);
  }
  const uint64_t tau = top_p_threshold(total, r.top_p);
  std::sort(s.weighted.begin(), s.weighted.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  uint64_t prefix = 0;
  for (const auto& [key, q] : s.weighted) {
    prefix += q;
    if (prefix >= tau) {
      const int64_t id = rank_key_id(key);
      return {y[id], id};
    }
  }
  DETLOGP_FAIL("internal: the top-p prefix never reached its threshold (docs/contract.md 11.5)");
}

// The program of one row over its unscaled logits z[0, V_local). Returns whether a replayed target
// lies outside the support.
bool run_row(const SampleProblem& p, int64_t n, const float* z, RowScratch& s) {
  const SampleRowParams r = p.program.row(n, p.real_vocab);
  const int64_t lanes = p.real_vocab;  // the whole vocabulary from id 0 (checked)
  s.y.resize(static_cast<size_t>(lanes));
  float* y = s.y.data();
  for (int64_t v = 0; v < lanes; ++v) y[v] = scale_logit(z[v], r.inv_temperature);
  const int64_t n_tiles = (lanes + kVocabTile - 1) / kVocabTile;
  s.tiles.resize(static_cast<size_t>(n_tiles));
  for (int64_t g = 0; g < n_tiles; ++g) {
    const int64_t real = std::min<int64_t>(kVocabTile, lanes - g * kVocabTile);
    s.tiles[static_cast<size_t>(g)] = cpu::fast_tile_summary(y + g * kVocabTile, static_cast<int>(real));
  }
  const RowStats st = row_stats(s.tiles.data(), n_tiles);
  if (p.topk > 0) write_topk(p, n, y, lanes, st.lse, s);
  const bool samplable = row_samplable(st);
  SupportRow support{st.max, no_cut(), r.min_p};
  if (samplable && has_cut(r, lanes)) support.cut = find_cut(y, lanes, st.max, r, s);
  SupportPass pass{0.0f, 0, kNoToken, 0.0f};
  if (samplable) pass = support_pass(y, lanes, 0, support, !p.replay, p.replay ? 0 : p.row_stream(n));
  const bool target_read = p.replay && p.target(n) != p.ignore_index;
  return p.write_row(n, st, support, pass, target_read ? y[p.target(n)] : 0.0f);
}

}  // namespace

namespace {

// Rows [row0, row0 + rows) of the program over their logits z ([rows][vocab_local]), on the pool.
void run_rows(const SampleProblem& p, int64_t row0, int64_t rows, const float* z, std::vector<RowScratch>& scratch,
              std::vector<uint8_t>& outside) {
  cpu::parallel_for(rows, static_cast<int>(scratch.size()), [&](int64_t r, int w) {
    outside[static_cast<size_t>(row0 + r)] =
        run_row(p, row0 + r, z + r * p.vocab_local, scratch[static_cast<size_t>(w)]);
  });
}

SamplingReport count_outside(const std::vector<uint8_t>& outside) {
  SamplingReport report;
  for (size_t n = 0; n < outside.size(); ++n) {
    if (!outside[n]) continue;
    if (report.outside_support == 0) report.first_outside_support = static_cast<int64_t>(n);
    ++report.outside_support;
  }
  return report;
}

}  // namespace

template <class Gemm>
SamplingReport cpu_sample(const SampleProblem& p, int64_t chunk_rows) {
  if (p.rows == 0) return {};
  const int64_t v = p.vocab_local;
  int64_t chunk = p.logits ? p.rows : std::clamp<int64_t>(kLogitsBudgetBytes / (v * 4), 1, p.rows);
  if (chunk_rows > 0) chunk = std::min(chunk_rows, p.rows);
  std::vector<float> buffer(p.logits ? 0 : static_cast<size_t>(chunk * v));
  std::vector<RowScratch> scratch(static_cast<size_t>(std::max(1, cpu::cpu_threads())));
  std::vector<uint8_t> outside(static_cast<size_t>(p.rows), 0);
  for (int64_t row0 = 0; row0 < p.rows; row0 += chunk) {
    const int64_t rows = std::min(chunk, p.rows - row0);
    float* z = p.logits ? p.logits + row0 * v : buffer.data();
    cpu::for_each_z_panel<Gemm>(
        p.hidden, p.hidden_stride, p.weight, p.weight_stride, p.dim, row0, rows, v, [](int64_t, int64_t) {},
        [&](int64_t row, int64_t panel, int cols, float* acc) {
          const int64_t col0 = panel * cpu::kPanelCols;
          if (p.bias) Gemm::add_bias(acc, p.bias + col0, cols);
          std::copy(acc, acc + cols, z + (row - row0) * v + col0);
        });
    run_rows(p, row0, rows, z, scratch, outside);
  }
  return count_outside(outside);
}

template SamplingReport cpu_sample<cpu::Fp32ChainGemm>(const SampleProblem&, int64_t);
template SamplingReport cpu_sample<cpu::WgmmaModelGemm>(const SampleProblem&, int64_t);

SamplingReport cpu_sample_from_logits(const SampleProblem& p, const float* logits) {
  if (p.rows == 0) return {};
  std::vector<RowScratch> scratch(static_cast<size_t>(std::max(1, cpu::cpu_threads())));
  std::vector<uint8_t> outside(static_cast<size_t>(p.rows), 0);
  run_rows(p, 0, p.rows, logits, scratch, outside);
  return count_outside(outside);
}

}  // namespace detlogp::detail
