// The SM90 logits on the CPU: the wgmma model (detlogp/wgmma_model.hpp, docs/contract.md §3.1.1)
// as a GEMM policy of for_each_z_panel. Operands are decoded once into integer significands and
// exponents; the block FMAs run on 8 int32 lanes (one output column each), and any (row, column)
// whose operands hold an infinity or a NaN is computed by the model's scalar dot instead.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/cpu_gemm.hpp"
#include "detlogp/wgmma_model.hpp"

namespace detlogp::cpu {

struct WgmmaModelGemm {
  // Hidden rows decoded: [rows][kpad] with kpad = dim rounded up to a whole k-block, the tail a
  // zero (which takes no part in a block); whether each row is all finite; the raw rows.
  struct Rows {
    int64_t dim = 0, kpad = 0;
    std::vector<int32_t> sig, exp;
    std::vector<uint8_t> finite;
    const uint16_t* raw = nullptr;
    int64_t raw_stride = 0;
  };
  // One panel's weight rows decoded k-major: [kpad][kPanelCols], columns past `cols` zero.
  struct Panel {
    int cols = 0;
    int64_t kpad = 0;
    std::vector<int32_t> sig, exp;
    uint8_t finite[kPanelCols] = {};
    const uint16_t* raw = nullptr;  // the panel's first weight row
    int64_t raw_stride = 0;
  };
  static void prepare_rows(const uint16_t* hidden, int64_t hidden_stride, int64_t dim, int64_t rows, int workers,
                           Rows& out);
  static void load_panel(const uint16_t* weight, int64_t weight_stride, int64_t first_row, int cols, int64_t dim,
                         Panel& panel);
  // z (fp32) of rows [row0, row0 + count) of `rows` against the panel: out[r * out_stride + c].
  static void compute(const Rows& rows, int64_t row0, int count, const Panel& panel, float* out, int64_t out_stride);
  // The bias on z as the SM90 epilogue's fp32 add gives it: the host's add, except that a NaN is
  // written as the SM90 writes it (kWgmmaNanBits; x86 keeps an operand's payload).
  static void add_bias(float* z, const float* bias, int cols) {
    for (int c = 0; c < cols; ++c) {
      z[c] = detlogp::add_bias(z[c], bias[c]);
      if (fp::is_nan(z[c])) z[c] = fp::from_bits(wgmma::kWgmmaNanBits);
    }
  }
};

}  // namespace detlogp::cpu
