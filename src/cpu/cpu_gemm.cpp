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
constexpr int kLanes = 8;
typedef float Lane8 __attribute__((vector_size(kLanes * sizeof(float))));
static_assert(kColBlock % kLanes == 0, "a column block is a whole number of vectors");

// R rows x kColBlock columns of accumulators held in vector registers (written with explicit
// vectors: GCC keeps a plain 2-D array on the stack). Each lane is one output; the multiply and
// the add are separately rounded (no FMA: the clones below never enable it, and the library is
// built with -ffp-contract=off), so every ISA clone gives the same bits.
template <int R>
__attribute__((target_clones("avx2", "default"))) void micro_kernel(const float* __restrict h, int64_t dim,
                                                                    const float* __restrict panel, int col0,
                                                                    float* __restrict out, int64_t out_stride) {
  constexpr int kVecs = kColBlock / kLanes;
  Lane8 acc[R][kVecs] = {};
  for (int64_t k = 0; k < dim; ++k) {
    Lane8 w[kVecs];
    DETLOGP_UNROLL
    for (int v = 0; v < kVecs; ++v) __builtin_memcpy(&w[v], panel + k * kPanelCols + col0 + v * kLanes, sizeof(Lane8));
    DETLOGP_UNROLL
    for (int r = 0; r < R; ++r) {
      const float hk = h[r * dim + k];
      const Lane8 hv = {hk, hk, hk, hk, hk, hk, hk, hk};
      DETLOGP_UNROLL
      for (int v = 0; v < kVecs; ++v) acc[r][v] = acc[r][v] + hv * w[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) __builtin_memcpy(out + r * out_stride + v * kLanes, &acc[r][v], sizeof(Lane8));
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
