// The validated problem of linear_logp_grad_logits and the implementations that take it: the CPU
// one (src/cpu/cpu_grad_logits.cpp), the SM90 one (src/sm90/sm90_grad_logits.cu, or a stub that
// throws in builds without CUDA), and the host epilogue over given logits that tests use as the
// bitwise reference of either.
#pragma once

#include <cstdint>

#include "detlogp/detlogp.hpp"
#include "detlogp/grad.hpp"

namespace detlogp::detail {

struct GradLogitsProblem {
  int64_t rows = 0;         // N
  int64_t dim = 0;          // D
  int64_t cols = 0;         // C: columns of the chunk
  int64_t vocab_start = 0;  // global id of chunk column 0
  int64_t real_vocab = 0;   // global ids >= real_vocab are padding (p = 0)
  int64_t ignore_index = kDefaultIgnoreIndex;

  const uint16_t* hidden = nullptr;  // bf16 bits [rows][hidden_stride]
  int64_t hidden_stride = 0;
  const uint16_t* weight = nullptr;  // bf16 bits [cols][weight_stride]
  int64_t weight_stride = 0;
  const float* bias = nullptr;  // [cols] or null
  const void* targets = nullptr;
  bool targets_i64 = false;
  float temperature = 1.0f;
  const float* temperature_rows = nullptr;  // [rows] or null
  const float* lse = nullptr;               // [rows]
  const float* g_logp = nullptr;            // [rows] or null (zeros)
  const float* g_lse = nullptr;             // [rows] or null (zeros)

  uint16_t* dz = nullptr;  // bf16 bits [rows][dz_stride]
  int64_t dz_stride = 0;

  Memory memory = Memory::host;
  int device = 0;
  void* stream = nullptr;

  int64_t target(int64_t row) const {
    return targets_i64 ? static_cast<const int64_t*>(targets)[row] : static_cast<const int32_t*>(targets)[row];
  }
  // Chunk columns [0, real_cols()) have global ids < real_vocab.
  int64_t real_cols() const {
    const int64_t n = real_vocab - vocab_start;
    return n <= 0 ? 0 : (n >= cols ? cols : n);
  }
  // Host memory only: the row's operands and its target column in the chunk (-1: none here).
  GradRow grad_row(int64_t row, int64_t* target_col) const {
    const int64_t t = target(row);
    const bool ignored = t == ignore_index;
    GradRow r;
    r.inv_t = inverse_temperature(temperature_rows ? temperature_rows[row] : temperature);
    r.lse = lse[row];
    r.gl = (ignored || g_logp == nullptr) ? 0.0f : g_logp[row];
    r.gs = g_lse == nullptr ? 0.0f : g_lse[row];
    const int64_t local = t - vocab_start;
    *target_col = (!ignored && local >= 0 && local < cols) ? local : -1;
    return r;
  }
};

// Shapes, dtypes, memory, strides and (host memory) target and temperature values.
GradLogitsProblem make_grad_logits_problem(const LinearLogpInputs& in, const GradLogitsArgs& args,
                                           const MutableTensorView& dz);

// Host: recomputes z on the CPU contract GEMM and writes dz.
void cpu_grad_logits(const GradLogitsProblem& p);
// CUDA memory: the SM90 kernel on p.stream (throws where CUDA or an SM90 device is missing).
void sm90_grad_logits(const GradLogitsProblem& p);

// Host: dz from given logits z [rows][z_stride] f32 that already include the bias (the serving
// entry's logits of the chunk's columns); p.bias, p.hidden and p.weight are not read. Applying it
// to an arch's own serving logits gives that arch's linear_logp_grad_logits bits.
void grad_logits_from_logits(const GradLogitsProblem& p, const float* z, int64_t z_stride);

}  // namespace detlogp::detail
