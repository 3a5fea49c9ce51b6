// linear_logp_grad_logits on the host: z on the CPU contract GEMM (cpu::for_each_z_panel, the
// same driver and K walk as the CPU backend's logits), then the pinned logit gradient
// (detlogp/grad.hpp: the plain one, or the sampling replay's) per element; each (row, panel) writes
// disjoint dz elements.
#include <algorithm>
#include <vector>

#include "core/grad_logits.hpp"
#include "cpu/cpu_gemm.hpp"
#include "cpu/cpu_parallel.hpp"

namespace detlogp::detail {

namespace {

// z on the CPU contract GEMM for every (row, panel); row_of(n, &target_col) gives a row's operands
// once per widening window, grad(z, row, column, real, is_target) one dz value.
template <class Row, class RowOf, class Grad>
void grad_over_panels(const GradLogitsProblem& p, RowOf&& row_of, Grad&& grad) {
  const int64_t real = p.real_cols();
  std::vector<Row> rows;  // per row of the current widening window
  std::vector<int64_t> target_col;
  int64_t window0 = 0;
  cpu::for_each_z_panel<cpu::Fp32ChainGemm>(
      p.hidden, p.hidden_stride, p.weight, p.weight_stride, p.dim, 0, p.rows, p.cols,
      [&](int64_t w0, int64_t w_rows) {
        window0 = w0;
        rows.resize(static_cast<size_t>(w_rows));
        target_col.resize(static_cast<size_t>(w_rows));
        cpu::parallel_for(w_rows, cpu::cpu_threads(), [&](int64_t r, int) {
          rows[static_cast<size_t>(r)] = row_of(w0 + r, &target_col[static_cast<size_t>(r)]);
        });
      },
      [&](int64_t row, int64_t panel, int cols, const float* z) {
        const size_t local = static_cast<size_t>(row - window0);
        const Row& g = rows[local];
        const int64_t t_col = target_col[local];
        const int64_t col0 = panel * cpu::kPanelCols;
        uint16_t* out = p.dz + row * p.dz_stride + col0;
        for (int c = 0; c < cols; ++c) {
          const int64_t v = col0 + c;
          const float zv = p.bias ? add_bias(z[c], p.bias[v]) : z[c];
          out[c] = grad(zv, g, v, v < real, v == t_col);
        }
      });
}

}  // namespace

void cpu_grad_logits(const GradLogitsProblem& p) {
  if (p.rows == 0) return;
  if (p.sampled) {
    grad_over_panels<SampledGradRow>(
        p, [&](int64_t n, int64_t* t_col) { return p.sampled_grad_row(n, t_col); },
        [&](float z, const SampledGradRow& g, int64_t v, bool real, bool is_target) {
          return bf16_round(sampled_grad_logit(z, p.vocab_start + v, g, real, is_target));
        });
    return;
  }
  grad_over_panels<GradRow>(
      p, [&](int64_t n, int64_t* t_col) { return p.grad_row(n, t_col); },
      [](float z, const GradRow& g, int64_t, bool real, bool is_target) {
        return grad_logit_bf16(z, g, real, is_target);
      });
}

}  // namespace detlogp::detail
