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

// z on the CPU contract GEMM for every (row, panel); row_of(n, &aux) gives a row's operands once
// per widening window (aux: its target column, or its target entries), panel_out(z, row, aux,
// col0, cols, out) one panel's dz values.
template <class Row, class Aux, class RowOf, class PanelOut>
void grad_over_panels(const GradLogitsProblem& p, RowOf&& row_of, PanelOut&& panel_out) {
  std::vector<Row> rows;  // per row of the current widening window
  std::vector<Aux> aux;
  int64_t window0 = 0;
  cpu::for_each_z_panel<cpu::Fp32ChainGemm>(
      p.hidden, p.hidden_stride, p.weight, p.weight_stride, p.dim, 0, p.rows, p.cols,
      [&](int64_t w0, int64_t w_rows) {
        window0 = w0;
        rows.resize(static_cast<size_t>(w_rows));
        aux.resize(static_cast<size_t>(w_rows));
        cpu::parallel_for(w_rows, cpu::cpu_threads(), [&](int64_t r, int) {
          rows[static_cast<size_t>(r)] = row_of(w0 + r, &aux[static_cast<size_t>(r)]);
        });
      },
      [&](int64_t row, int64_t panel, int cols, const float* z) {
        const size_t local = static_cast<size_t>(row - window0);
        const int64_t col0 = panel * cpu::kPanelCols;
        float zb[cpu::kPanelCols];
        for (int c = 0; c < cols; ++c) zb[c] = p.bias ? add_bias(z[c], p.bias[col0 + c]) : z[c];
        panel_out(zb, rows[local], aux[local], col0, cols, p.dz + row * p.dz_stride + col0);
      });
}

}  // namespace

void cpu_grad_logits(const GradLogitsProblem& p) {
  if (p.rows == 0) return;
  const int64_t real = p.real_cols();
  if (p.sampled) {
    grad_over_panels<SampledGradRow, int64_t>(
        p, [&](int64_t n, int64_t* t_col) { return p.sampled_grad_row(n, t_col); },
        [&](const float* z, const SampledGradRow& g, int64_t t_col, int64_t col0, int cols, uint16_t* out) {
          for (int c = 0; c < cols; ++c) {
            const int64_t v = col0 + c;
            out[c] = bf16_round(sampled_grad_logit(z[c], p.vocab_start + v, g, v < real, v == t_col));
          }
        });
    return;
  }
  // Every column without its target terms, then the few columns the row's entries name.
  grad_over_panels<GradRow, GradEntries>(
      p, [&](int64_t n, GradEntries* e) { return p.grad_row(n, e); },
      [&](const float* z, const GradRow& g, const GradEntries& e, int64_t col0, int cols, uint16_t* out) {
        for (int c = 0; c < cols; ++c) out[c] = grad_logit_bf16(z[c], g, col0 + c < real, false);
        write_target_columns(
            e, g, real, col0, cols, [&](int i) { return z[e.col[i] - col0]; }, out);
      });
}

void cpu_grad_from_logits(const GradLogitsProblem& p) {
  cpu::parallel_for(p.rows, cpu::cpu_threads(),
                    [&](int64_t n, int) { grad_row_from_logits(p, p.logits, p.logits_stride, n); });
}

}  // namespace detlogp::detail
