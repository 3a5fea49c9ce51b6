// CPU fp32 GEMM for the contract: z[r][c] = sum_k h[r][k] * w[c][k], K ascending, one separately
// rounded multiply and add per step, from an accumulator of +0 (products of bf16 are exact in fp32
// in the normal range, so only the accumulation order matters; docs/contract.md §3.1). Vectorized
// across output columns: a lane is one output, so every instruction set gives the same bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/cpu_parallel.hpp"
#include "detlogp/fpops.hpp"
#include "detlogp/reduce.hpp"

namespace detlogp::cpu {

// One vocab tile's weights widened to fp32 and transposed to [D][cols] so a K step touches
// consecutive columns.
// Weight rows the kernels prefetch, one cache line a k step, while they compute a panel: the rows
// of the panel the worker will likely pack next. Only a hint: any value gives the same bits.
struct PanelPrefetch {
  const char* row = nullptr;
  int64_t stride_bytes = 0;
  int64_t row_bytes = 0;
  int64_t offset = 0;
  int rows_left = 0;
};

struct WeightPanel {
  int cols = 0;
  std::vector<float> kmajor;  // [dim][kPanelCols]
  mutable PanelPrefetch prefetch;
};
inline constexpr int kPanelCols = 64;

// The kernels, by instruction set; the library runs the best one the CPU supports (gemm_isa()).
// All of them compute the same per-lane chain, so the choice is a free axis; the tests run each
// supported one against a scalar loop.
enum class GemmIsa { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };
GemmIsa gemm_isa();
bool gemm_isa_supported(GemmIsa isa);
const char* gemm_isa_name(GemmIsa isa);

void load_weight_panel(const uint16_t* weight, int64_t weight_stride, int64_t first_row, int cols, int64_t dim,
                       WeightPanel& panel);
void load_weight_panel(GemmIsa isa, const uint16_t* weight, int64_t weight_stride, int64_t first_row, int cols,
                       int64_t dim, WeightPanel& panel);

// z for `rows` hidden rows (already widened to fp32, [rows][dim]) against one panel:
// out[r * out_stride + c] for c < panel.cols. out_stride >= kPanelCols: the kernels may also write
// the zero columns past panel.cols (callers never consume them).
void gemm_rows_panel(const float* hidden_f32, int rows, int64_t dim, const WeightPanel& panel, float* out,
                     int64_t out_stride);
void gemm_rows_panel(GemmIsa isa, const float* hidden_f32, int rows, int64_t dim, const WeightPanel& panel, float* out,
                     int64_t out_stride);

// The fp32-chain GEMM as a policy of for_each_z_panel: hidden rows widened to fp32, weight panels
// of widened weights, gemm_rows_panel.
struct Fp32ChainGemm {
  struct Rows {
    int64_t dim = 0;
    std::vector<float> f32;  // [rows][dim]
  };
  using Panel = WeightPanel;
  static void prepare_rows(const uint16_t* hidden, int64_t hidden_stride, int64_t dim, int64_t rows, int workers,
                           Rows& out) {
    out.dim = dim;
    out.f32.resize(static_cast<size_t>(rows * dim));
    parallel_for(rows, workers, [&](int64_t r, int) {
      const uint16_t* h = hidden + r * hidden_stride;
      float* dst = out.f32.data() + r * dim;
      for (int64_t k = 0; k < dim; ++k) dst[k] = fp::bf16_to_float(h[k]);
    });
  }
  static void load_panel(const uint16_t* weight, int64_t weight_stride, int64_t first_row, int cols, int64_t dim,
                         Panel& panel) {
    load_weight_panel(weight, weight_stride, first_row, cols, dim, panel);
  }
  static void compute(const Rows& rows, int64_t row0, int count, const Panel& panel, float* out, int64_t out_stride) {
    gemm_rows_panel(rows.f32.data() + row0 * rows.dim, count, rows.dim, panel, out, out_stride);
  }
  // The bias on z (the serving logits' z + b): the host's fp32 add.
  static void add_bias(float* z, const float* bias, int cols) {
    for (int c = 0; c < cols; ++c) z[c] = detlogp::add_bias(z[c], bias[c]);
  }
};

// A GEMM over hidden rows [row0, row0 + rows) and weight rows [0, cols), driven as the CPU entry
// points need it: hidden rows prepared (Gemm::prepare_rows) kWidenRows at a time; per window,
// on_window(w0, w_rows) runs first (serially), then tasks of (64-column panel, up to kRowsPerTask
// rows) share one weight panel (Gemm::load_panel) across cpu_threads() workers, z computed
// kRowGroup rows at a time (Gemm::compute). on_z(row, panel, panel_cols, z) is called exactly once
// per (row, panel) with the row's z (panel_cols values, writable scratch). Each task touches
// distinct (row, panel) pairs, so the thread count is a free axis. Gemm is Fp32ChainGemm (the CPU
// contract's K walk) or WgmmaModelGemm (cpu_wgmma_gemm.hpp, the SM90 bits).
inline constexpr int kRowGroup = 32;
inline constexpr int kRowsPerTask = 256;
inline constexpr int64_t kWidenRows = 4096;

template <class Gemm, class OnWindow, class OnZ>
void for_each_z_panel(const uint16_t* hidden, int64_t hidden_stride, const uint16_t* weight, int64_t weight_stride,
                      int64_t dim, int64_t row0, int64_t rows, int64_t cols, OnWindow&& on_window, OnZ&& on_z) {
  struct Scratch {
    std::vector<float> z;  // [kRowGroup][kPanelCols]
    typename Gemm::Panel panel;
  };
  const int64_t panels = (cols + kPanelCols - 1) / kPanelCols;
  const int workers = cpu_threads();
  std::vector<Scratch> scratch(static_cast<size_t>(std::max(1, workers)));
  typename Gemm::Rows prepared;
  for (int64_t w0 = row0; w0 < row0 + rows; w0 += kWidenRows) {
    const int64_t w_rows = std::min(kWidenRows, row0 + rows - w0);
    Gemm::prepare_rows(hidden + w0 * hidden_stride, hidden_stride, dim, w_rows, workers, prepared);
    on_window(w0, w_rows);
    const int64_t blocks = (w_rows + kRowsPerTask - 1) / kRowsPerTask;
    parallel_for(blocks * panels, workers, [&](int64_t task, int worker) {
      const int64_t panel = task % panels;
      const int64_t b_row0 = (task / panels) * kRowsPerTask;  // relative to w0
      const int64_t b_rows = std::min<int64_t>(kRowsPerTask, w_rows - b_row0);
      const int64_t col0 = panel * kPanelCols;
      const int panel_cols = static_cast<int>(std::min<int64_t>(kPanelCols, cols - col0));
      Scratch& s = scratch[static_cast<size_t>(worker)];
      Gemm::load_panel(weight, weight_stride, col0, panel_cols, dim, s.panel);
      if constexpr (requires { s.panel.prefetch; }) {
        // Tasks are taken in order by the workers in turn, so this worker's next one is likely
        // `workers` further on.
        const int64_t next = task + workers;
        s.panel.prefetch = {};
        if (next < blocks * panels) {
          const int64_t next_col0 = (next % panels) * kPanelCols;
          s.panel.prefetch = {reinterpret_cast<const char*>(weight + next_col0 * weight_stride),
                              weight_stride * static_cast<int64_t>(sizeof(uint16_t)),
                              dim * static_cast<int64_t>(sizeof(uint16_t)), 0,
                              static_cast<int>(std::min<int64_t>(kPanelCols, cols - next_col0))};
        }
      }
      s.z.resize(static_cast<size_t>(kRowGroup) * kPanelCols);
      for (int64_t g0 = b_row0; g0 < b_row0 + b_rows; g0 += kRowGroup) {
        const int g_rows = static_cast<int>(std::min<int64_t>(kRowGroup, b_row0 + b_rows - g0));
        Gemm::compute(prepared, g0, g_rows, s.panel, s.z.data(), kPanelCols);
        for (int r = 0; r < g_rows; ++r)
          on_z(w0 + g0 + r, panel, panel_cols, s.z.data() + static_cast<int64_t>(r) * kPanelCols);
      }
    });
  }
}

}  // namespace detlogp::cpu
