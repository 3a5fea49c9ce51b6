// Host side of what every SM90 entry point needs of its operands: TMA tensor maps and the checks
// that make them legal (alignment, strides, extents), and the compute-capability check.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>

namespace detlogp::sm90 {

// Row-major bf16 matrix [rows][cols] with a row stride in elements, tiled into boxes of
// 64 columns (one 128-byte swizzle row) x box_rows rows. Out-of-range elements read as zero.
// promotion: L2 promotion of the loads, 0, 128 or 256 bytes.
CUtensorMap encode_bf16_map(const uint16_t* base, int64_t rows, int64_t cols, int64_t stride, int box_rows,
                            const char* name, int promotion = 256);
// What TMA needs of a bf16 operand: 16-byte aligned base, row stride a multiple of 16 bytes.
void check_tma_operand(const void* ptr, int64_t stride_elems, const char* name);
void check_alignment(const void* ptr, size_t align, const char* name);
// What every SM90 entry needs of the head beyond the API's checks: TMA-ready hidden and weight,
// extents below 2^31 (`vocab_name` names the weight's rows), aligned targets, bias, temperatures.
void check_head_operands(const uint16_t* hidden, int64_t hidden_stride, const uint16_t* weight, int64_t weight_stride,
                         int64_t rows, int64_t vocab, const char* vocab_name, int64_t dim, const void* targets,
                         bool targets_i64, const float* bias, const float* temperature_rows);
// Throws unless `device` has compute capability 9.0.
void check_sm90_device(int device);

}  // namespace detlogp::sm90
