#include "cpu/cpu_wgmma_gemm.hpp"

#include <algorithm>

namespace detlogp::cpu {

namespace {

using wgmma::kBlockK;

int64_t padded_dim(int64_t dim) { return (dim + kBlockK - 1) / kBlockK * kBlockK; }

bool all_finite(const uint16_t* x, int64_t n) {
  for (int64_t k = 0; k < n; ++k)
    if (!wgmma::bf16_finite(x[k])) return false;
  return true;
}

constexpr int kLanes = 8;
constexpr int kColBlock = 16;
constexpr int kVecs = kColBlock / kLanes;
constexpr int kRowBlock = 2;
typedef int32_t Lane8 __attribute__((vector_size(kLanes * sizeof(int32_t))));
static_assert(kPanelCols % kColBlock == 0, "a panel is a whole number of column blocks");

// R rows x kColBlock columns of the model's K walk: per k-block, the largest exponent sum of each
// output (pass 1), the block exponent with the accumulator, the aligned products summed in int32
// (pass 2), then each lane's accumulator term and rounding (wgmma::finish_block). Every lane step
// is one of wgmma_model.hpp's lane functions, so each ISA clone gives the model's bits.
template <int R>
__attribute__((target_clones("avx2", "default"))) void micro_kernel(const int32_t* __restrict hsig,
                                                                    const int32_t* __restrict hexp, int64_t kpad,
                                                                    const int32_t* __restrict psig,
                                                                    const int32_t* __restrict pexp, int col0,
                                                                    float* __restrict out, int64_t out_stride) {
  Lane8 acc[R][kVecs] = {};  // fp32 bits, +0 at the start
  for (int64_t k0 = 0; k0 < kpad; k0 += kBlockK) {
    Lane8 e[R][kVecs];
    DETLOGP_UNROLL
    for (int r = 0; r < R; ++r) DETLOGP_UNROLL
    for (int v = 0; v < kVecs; ++v) e[r][v] = wgmma::splat<Lane8>(wgmma::kZeroExp);
    for (int k = 0; k < kBlockK; ++k) {
      Lane8 we[kVecs];
      DETLOGP_UNROLL
      for (int v = 0; v < kVecs; ++v)
        __builtin_memcpy(&we[v], pexp + (k0 + k) * kPanelCols + col0 + v * kLanes, sizeof(Lane8));
      DETLOGP_UNROLL
      for (int r = 0; r < R; ++r) {
        const int32_t ea = hexp[r * kpad + k0 + k];
        DETLOGP_UNROLL
        for (int v = 0; v < kVecs; ++v) e[r][v] = wgmma::max_lanes(e[r][v], we[v] + ea);
      }
    }
    Lane8 sum[R][kVecs];
    DETLOGP_UNROLL
    for (int r = 0; r < R; ++r) DETLOGP_UNROLL
    for (int v = 0; v < kVecs; ++v) {
      e[r][v] = wgmma::block_exponent(e[r][v], acc[r][v]);
      sum[r][v] = Lane8{};
    }
    for (int k = 0; k < kBlockK; ++k) {
      Lane8 ws[kVecs], we[kVecs];
      DETLOGP_UNROLL
      for (int v = 0; v < kVecs; ++v) {
        __builtin_memcpy(&ws[v], psig + (k0 + k) * kPanelCols + col0 + v * kLanes, sizeof(Lane8));
        __builtin_memcpy(&we[v], pexp + (k0 + k) * kPanelCols + col0 + v * kLanes, sizeof(Lane8));
      }
      DETLOGP_UNROLL
      for (int r = 0; r < R; ++r) {
        const int32_t sa = hsig[r * kpad + k0 + k], ea = hexp[r * kpad + k0 + k];
        DETLOGP_UNROLL
        for (int v = 0; v < kVecs; ++v) sum[r][v] += wgmma::align_product(ws[v] * sa, e[r][v] - (we[v] + ea));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVecs; ++v)
        for (int l = 0; l < kLanes; ++l)
          acc[r][v][l] =
              static_cast<int32_t>(wgmma::finish_block(sum[r][v][l], e[r][v][l], static_cast<uint32_t>(acc[r][v][l])));
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) __builtin_memcpy(out + r * out_stride + v * kLanes, &acc[r][v], sizeof(Lane8));
}

}  // namespace

void WgmmaModelGemm::prepare_rows(const uint16_t* hidden, int64_t hidden_stride, int64_t dim, int64_t rows, int workers,
                                  Rows& out) {
  out.dim = dim;
  out.kpad = padded_dim(dim);
  out.raw = hidden;
  out.raw_stride = hidden_stride;
  out.sig.assign(static_cast<size_t>(rows * out.kpad), 0);
  out.exp.assign(static_cast<size_t>(rows * out.kpad), wgmma::kZeroExp);
  out.finite.assign(static_cast<size_t>(rows), 1);
  parallel_for(rows, workers, [&](int64_t r, int) {
    const uint16_t* h = hidden + r * hidden_stride;
    for (int64_t k = 0; k < dim; ++k) {
      const wgmma::Bf16Parts p = wgmma::bf16_parts(h[k]);
      out.sig[static_cast<size_t>(r * out.kpad + k)] = p.sig;
      out.exp[static_cast<size_t>(r * out.kpad + k)] = p.exp;
    }
    out.finite[static_cast<size_t>(r)] = all_finite(h, dim);
  });
}

void WgmmaModelGemm::load_panel(const uint16_t* weight, int64_t weight_stride, int64_t first_row, int cols, int64_t dim,
                                Panel& panel) {
  panel.cols = cols;
  panel.kpad = padded_dim(dim);
  panel.raw = weight + first_row * weight_stride;
  panel.raw_stride = weight_stride;
  panel.sig.resize(static_cast<size_t>(panel.kpad * kPanelCols));
  panel.exp.resize(static_cast<size_t>(panel.kpad * kPanelCols));
  // Decoded a k-block at a time across the columns (the k-major stores stay in cache); columns
  // past `cols` and the k tail are zeros.
  uint8_t nonfinite[kPanelCols] = {};
  for (int64_t k0 = 0; k0 < panel.kpad; k0 += kBlockK) {
    const int64_t kn = std::min<int64_t>(kBlockK, dim - k0);
    for (int c = 0; c < kPanelCols; ++c) {
      const uint16_t* w = panel.raw + c * weight_stride + k0;
      for (int64_t kk = 0; kk < kBlockK; ++kk) {
        const bool real = c < cols && kk < kn;
        const wgmma::Bf16Parts p = real ? wgmma::bf16_parts(w[kk]) : wgmma::Bf16Parts{};
        if (real) nonfinite[c] |= !wgmma::bf16_finite(w[kk]);
        panel.sig[static_cast<size_t>((k0 + kk) * kPanelCols + c)] = p.sig;
        panel.exp[static_cast<size_t>((k0 + kk) * kPanelCols + c)] = p.exp;
      }
    }
  }
  for (int c = 0; c < kPanelCols; ++c) panel.finite[c] = !nonfinite[c];
}

void WgmmaModelGemm::compute(const Rows& rows, int64_t row0, int count, const Panel& panel, float* out,
                             int64_t out_stride) {
  // Columns past panel.cols are zero (+0 results) in scratch the caller sized for a full tile.
  const int32_t* hsig = rows.sig.data() + row0 * rows.kpad;
  const int32_t* hexp = rows.exp.data() + row0 * rows.kpad;
  for (int col0 = 0; col0 < panel.cols; col0 += kColBlock) {
    int r = 0;
    for (; r + kRowBlock <= count; r += kRowBlock)
      micro_kernel<kRowBlock>(hsig + r * rows.kpad, hexp + r * rows.kpad, rows.kpad, panel.sig.data(), panel.exp.data(),
                              col0, out + r * out_stride + col0, out_stride);
    for (; r < count; ++r)
      micro_kernel<1>(hsig + r * rows.kpad, hexp + r * rows.kpad, rows.kpad, panel.sig.data(), panel.exp.data(), col0,
                      out + r * out_stride + col0, out_stride);
  }
  // Infinities and NaNs: the model's scalar dot, which carries its special-value rules.
  for (int r = 0; r < count; ++r) {
    const bool row_finite = rows.finite[static_cast<size_t>(row0 + r)] != 0;
    for (int c = 0; c < panel.cols; ++c) {
      if (row_finite && panel.finite[c]) continue;
      out[r * out_stride + c] =
          wgmma::dot(rows.raw + (row0 + r) * rows.raw_stride, panel.raw + c * panel.raw_stride, rows.dim);
    }
  }
}

}  // namespace detlogp::cpu
