// reference-materialized: NOT contract-bearing. Materializes the logits, then a plain
// log-softmax (division by T, running max, sequential sum of std::exp, std::log), the way a
// framework would. Kept as a comparison lane; strict mode refuses it.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cpu/cpu_gemm.hpp"
#include "cpu/cpu_parallel.hpp"
#include "detlogp/detlogp.hpp"

namespace detlogp::detail {
namespace {

class ReferenceMaterializedBackend final : public CpuBackend {
 public:
  ReferenceMaterializedBackend()
      : CpuBackend({"none", 0, "reference-materialized", "cpu", 0, 0, 0, "n/a", "sequential-std", "std::exp/std::log",
                    "y=z/T"}) {}
  bool contract_bearing() const override { return false; }
  bool supports_partials() const override { return false; }

  void run(const LogpProblem& p) const override {
    if (p.rows == 0) return;
    const int64_t tiles = p.local_tiles();
    std::vector<float> logits_buffer;
    float* logits = p.logits;
    if (!logits) {
      logits_buffer.resize(static_cast<size_t>(p.rows * p.vocab_local));
      logits = logits_buffer.data();
    }
    const int workers = cpu::cpu_threads();
    std::vector<cpu::WeightPanel> panels(static_cast<size_t>(workers));
    std::vector<std::vector<float>> hidden(static_cast<size_t>(workers)), z(static_cast<size_t>(workers));
    cpu::parallel_for(p.rows * tiles, workers, [&](int64_t task, int w) {
      const int64_t row = task / tiles, col0 = (task % tiles) * kVocabTile;
      const int cols = static_cast<int>(std::min<int64_t>(kVocabTile, p.vocab_local - col0));
      auto& h = hidden[static_cast<size_t>(w)];
      h.resize(static_cast<size_t>(p.dim));
      for (int64_t k = 0; k < p.dim; ++k)
        h[static_cast<size_t>(k)] = fp::bf16_to_float(p.hidden[row * p.hidden_stride + k]);
      cpu::load_weight_panel(p.weight, p.weight_stride, col0, cols, p.dim, panels[static_cast<size_t>(w)]);
      auto& zz = z[static_cast<size_t>(w)];
      zz.assign(kVocabTile, 0.0f);
      cpu::gemm_rows_panel(h.data(), 1, p.dim, panels[static_cast<size_t>(w)], zz.data(), kVocabTile);
      for (int c = 0; c < cols; ++c)
        logits[row * p.vocab_local + col0 + c] = zz[c] + (p.bias ? p.bias[col0 + c] : 0.0f);
    });
    const int64_t real = std::min(p.vocab_local, p.real_vocab - p.vocab_start);
    cpu::parallel_for(p.rows, workers, [&](int64_t row, int) {
      const float t = p.temperature_rows ? p.temperature_rows[row] : p.temperature;
      const float* z = logits + row * p.vocab_local;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t v = 0; v < real; ++v) m = std::max(m, z[v] / t);
      float sum = 0.0f;
      for (int64_t v = 0; v < real; ++v) sum += std::exp(z[v] / t - m);
      const float lse = m + std::log(sum);
      p.lse[row] = lse;
      const int64_t target = p.target(row);
      p.logp[row] = target == p.ignore_index ? 0.0f : z[target] / t - lse;
    });
  }
};

}  // namespace

const Backend& reference_materialized_backend() {
  static const ReferenceMaterializedBackend backend;
  return backend;
}

}  // namespace detlogp::detail
