// CPU fp32 GEMM for the contract: z[r][c] = sum_k h[r][k] * w[c][k], K ascending, one separately
// rounded multiply and add per step (products of bf16 are exact in fp32 in the normal range, so
// only the accumulation order matters; docs/contract.md §3.1). Vectorized across output columns.
#pragma once

#include <cstdint>
#include <vector>

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

}  // namespace detlogp::cpu
