// linear_logp_grad_logits on the host: z on the CPU contract GEMM (cpu_gemm.hpp, the same K walk
// as the CPU backend's logits), then the pinned logit gradient (detlogp/grad.hpp) per element.
// Tasks are (64-column panel, row block); each writes disjoint dz elements, so the thread count is
// a free axis.
#include <algorithm>
#include <vector>

#include "core/grad_logits.hpp"
#include "cpu/cpu_gemm.hpp"
#include "cpu/cpu_parallel.hpp"

namespace detlogp::detail {
namespace {

constexpr int kRowGroup = 32;         // rows per GEMM call (z scratch of kRowGroup x 64)
constexpr int kRowsPerTask = 256;     // rows that share one widened weight panel
constexpr int64_t kWidenRows = 4096;  // rows of hidden widened to fp32 at a time
constexpr int kPanel = cpu::kPanelCols;

struct Scratch {
  std::vector<float> z;  // [kRowGroup][kPanel]
  cpu::WeightPanel panel;
};

}  // namespace

void cpu_grad_logits(const GradLogitsProblem& p) {
  if (p.rows == 0) return;
  const int64_t panels = (p.cols + kPanel - 1) / kPanel;
  const int64_t real = p.real_cols();
  const int workers = cpu::cpu_threads();
  std::vector<Scratch> scratch(static_cast<size_t>(std::max(1, workers)));
  std::vector<float> hidden_f32;
  std::vector<GradRow> rows;
  std::vector<int64_t> target_col;
  for (int64_t w0 = 0; w0 < p.rows; w0 += kWidenRows) {
    const int64_t w_rows = std::min(kWidenRows, p.rows - w0);
    hidden_f32.resize(static_cast<size_t>(w_rows * p.dim));
    rows.resize(static_cast<size_t>(w_rows));
    target_col.resize(static_cast<size_t>(w_rows));
    cpu::parallel_for(w_rows, workers, [&](int64_t r, int) {
      const uint16_t* h = p.hidden + (w0 + r) * p.hidden_stride;
      float* dst = hidden_f32.data() + r * p.dim;
      for (int64_t k = 0; k < p.dim; ++k) dst[k] = fp::bf16_to_float(h[k]);
      rows[static_cast<size_t>(r)] = p.grad_row(w0 + r, &target_col[static_cast<size_t>(r)]);
    });
    const int64_t blocks = (w_rows + kRowsPerTask - 1) / kRowsPerTask;
    cpu::parallel_for(blocks * panels, workers, [&](int64_t task, int worker) {
      const int64_t panel = task % panels;
      const int64_t b_row0 = (task / panels) * kRowsPerTask;  // relative to w0
      const int64_t b_rows = std::min<int64_t>(kRowsPerTask, w_rows - b_row0);
      const int64_t col0 = panel * kPanel;
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, p.cols - col0));
      Scratch& s = scratch[static_cast<size_t>(worker)];
      cpu::load_weight_panel(p.weight, p.weight_stride, col0, cols, p.dim, s.panel);
      s.z.resize(static_cast<size_t>(kRowGroup) * kPanel);
      for (int64_t g0 = b_row0; g0 < b_row0 + b_rows; g0 += kRowGroup) {
        const int g_rows = static_cast<int>(std::min<int64_t>(kRowGroup, b_row0 + b_rows - g0));
        cpu::gemm_rows_panel(hidden_f32.data() + g0 * p.dim, g_rows, p.dim, s.panel, s.z.data(), kPanel);
        for (int r = 0; r < g_rows; ++r) {
          const int64_t local = g0 + r;  // relative to w0
          const GradRow& row = rows[static_cast<size_t>(local)];
          const int64_t t_col = target_col[static_cast<size_t>(local)];
          const float* z = s.z.data() + static_cast<int64_t>(r) * kPanel;
          uint16_t* out = p.dz + (w0 + local) * p.dz_stride + col0;
          for (int c = 0; c < cols; ++c) {
            const int64_t v = col0 + c;
            const float zv = p.bias ? add_bias(z[c], p.bias[v]) : z[c];
            out[c] = grad_logit_bf16(zv, row, v < real, v == t_col);
          }
        }
      }
    });
  }
}

}  // namespace detlogp::detail
