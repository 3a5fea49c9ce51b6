// CPU fp32 GEMM for the contract: z[r][c] = sum_k h[r][k] * w[c][k], K ascending, one separately
// rounded multiply and add per step (products of bf16 are exact in fp32 in the normal range, so
// only the accumulation order matters; docs/contract.md §3.1). Vectorized across output columns.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/cpu_parallel.hpp"
#include "detlogp/fpops.hpp"

namespace detlogp::cpu {

// One vocab tile's weights widened to fp32 and transposed to [D][cols] so a K step touches
// consecutive columns.
struct WeightPanel {
  int cols = 0;
  std::vector<float> kmajor;  // [dim][kPanelCols]
};
inline constexpr int kPanelCols = 64;

void load_weight_panel(const uint16_t* weight, int64_t weight_stride, int64_t first_row, int cols, int64_t dim,
                       WeightPanel& panel);

// z for `rows` hidden rows (already widened to fp32, [rows][dim]) against one panel;
// out[r * out_stride + c] for c < panel.cols.
void gemm_rows_panel(const float* hidden_f32, int rows, int64_t dim, const WeightPanel& panel, float* out,
                     int64_t out_stride);

// The contract GEMM over hidden rows [row0, row0 + rows) and weight rows [0, cols), driven as both
// CPU entry points need it: hidden rows widened to fp32 kWidenRows at a time; per window,
// on_window(w0, w_rows) runs first (serially), then tasks of (64-column panel, up to kRowsPerTask
// rows) share one widened weight panel across cpu_threads() workers, z computed kRowGroup rows at a
// time. on_z(row, panel, panel_cols, z) is called exactly once per (row, panel) with the row's z
// (panel_cols values, writable scratch). Each task touches distinct (row, panel) pairs, so the
// thread count is a free axis.
inline constexpr int kRowGroup = 32;
inline constexpr int kRowsPerTask = 256;
inline constexpr int64_t kWidenRows = 4096;

template <class OnWindow, class OnZ>
void for_each_z_panel(const uint16_t* hidden, int64_t hidden_stride, const uint16_t* weight, int64_t weight_stride,
                      int64_t dim, int64_t row0, int64_t rows, int64_t cols, OnWindow&& on_window, OnZ&& on_z) {
  struct Scratch {
    std::vector<float> z;  // [kRowGroup][kPanelCols]
    WeightPanel panel;
  };
  const int64_t panels = (cols + kPanelCols - 1) / kPanelCols;
  const int workers = cpu_threads();
  std::vector<Scratch> scratch(static_cast<size_t>(std::max(1, workers)));
  std::vector<float> hidden_f32;
  for (int64_t w0 = row0; w0 < row0 + rows; w0 += kWidenRows) {
    const int64_t w_rows = std::min(kWidenRows, row0 + rows - w0);
    hidden_f32.resize(static_cast<size_t>(w_rows * dim));
    parallel_for(w_rows, workers, [&](int64_t r, int) {
      const uint16_t* h = hidden + (w0 + r) * hidden_stride;
      float* dst = hidden_f32.data() + r * dim;
      for (int64_t k = 0; k < dim; ++k) dst[k] = fp::bf16_to_float(h[k]);
    });
    on_window(w0, w_rows);
    const int64_t blocks = (w_rows + kRowsPerTask - 1) / kRowsPerTask;
    parallel_for(blocks * panels, workers, [&](int64_t task, int worker) {
      const int64_t panel = task % panels;
      const int64_t b_row0 = (task / panels) * kRowsPerTask;  // relative to w0
      const int64_t b_rows = std::min<int64_t>(kRowsPerTask, w_rows - b_row0);
      const int64_t col0 = panel * kPanelCols;
      const int panel_cols = static_cast<int>(std::min<int64_t>(kPanelCols, cols - col0));
      Scratch& s = scratch[static_cast<size_t>(worker)];
      load_weight_panel(weight, weight_stride, col0, panel_cols, dim, s.panel);
      s.z.resize(static_cast<size_t>(kRowGroup) * kPanelCols);
      for (int64_t g0 = b_row0; g0 < b_row0 + b_rows; g0 += kRowGroup) {
        const int g_rows = static_cast<int>(std::min<int64_t>(kRowGroup, b_row0 + b_rows - g0));
        gemm_rows_panel(hidden_f32.data() + g0 * dim, g_rows, dim, s.panel, s.z.data(), kPanelCols);
        for (int r = 0; r < g_rows; ++r)
          on_z(w0 + g0 + r, panel, panel_cols, s.z.data() + static_cast<int64_t>(r) * kPanelCols);
      }
    });
  }
}

}  // namespace detlogp::cpu
