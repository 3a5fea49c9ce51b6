#include "cpu/cpu_gemm.hpp"

#include "detlogp/fpops.hpp"

namespace detlogp::cpu {

void load_weight_panel(const uint16_t* weight, int64_t weight_stride, int64_t first_row, int cols, int64_t dim,
                       WeightPanel& panel) {
  panel.cols = cols;
  panel.kmajor.assign(static_cast<size_t>(dim) * kPanelCols, 0.0f);
  for (int c = 0; c < cols; ++c) {
    const uint16_t* w = weight + (first_row + c) * weight_stride;
    for (int64_t k = 0; k < dim; ++k) panel.kmajor[static_cast<size_t>(k) * kPanelCols + c] = fp::bf16_to_float(w[k]);
  }
}

namespace {

constexpr int kRowBlock = 4;
constexpr int kColBlock = 16;

// The accumulation step is written as a separate multiply and add on purpose: -ffp-contract=off
// keeps them apart, so every ISA clone below gives the same bits.
template <int R>
__attribute__((target_clones("avx2", "default"))) void micro_kernel(const float* __restrict h, int64_t dim,
                                                                    const float* __restrict panel, int col0,
                                                                    float* __restrict out, int64_t out_stride) {
  float acc[R][kColBlock] = {};
  for (int64_t k = 0; k < dim; ++k) {
    const float* w = panel + k * kPanelCols + col0;
    for (int r = 0; r < R; ++r) {
      const float hk = h[r * dim + k];
      for (int c = 0; c < kColBlock; ++c) acc[r][c] = acc[r][c] + hk * w[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kColBlock; ++c) out[r * out_stride + c] = acc[r][c];
}

}  // namespace

void gemm_rows_panel(const float* hidden_f32, int rows, int64_t dim, const WeightPanel& panel, float* out,
                     int64_t out_stride) {
  static_assert(kPanelCols % kColBlock == 0, "a panel is a whole number of column blocks");
  // Columns past panel.cols read the zero-filled panel and are written to scratch the caller
  // sized for a full tile; callers only consume c < panel.cols.
  for (int col0 = 0; col0 < panel.cols; col0 += kColBlock) {
    int r = 0;
    for (; r + kRowBlock <= rows; r += kRowBlock)
      micro_kernel<kRowBlock>(hidden_f32 + r * dim, dim, panel.kmajor.data(), col0, out + r * out_stride + col0,
                              out_stride);
    for (; r < rows; ++r)
      micro_kernel<1>(hidden_f32 + r * dim, dim, panel.kmajor.data(), col0, out + r * out_stride + col0, out_stride);
  }
}

}  // namespace detlogp::cpu
