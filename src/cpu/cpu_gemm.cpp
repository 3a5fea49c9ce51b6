#include "cpu/cpu_gemm.hpp"

#include "detlogp/fpops.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace detlogp::cpu {

namespace {

// The widening transpose for any panel: columns past `cols` are zero.
void load_weight_panel_scalar(const uint16_t* weight, int64_t weight_stride, int64_t first_row, int cols, int64_t dim,
                              int64_t k0, WeightPanel& panel) {
  for (int c = 0; c < kPanelCols; ++c) {
    const uint16_t* w = weight + (first_row + c) * weight_stride;
    for (int64_t k = k0; k < dim; ++k)
      panel.kmajor[static_cast<size_t>(k) * kPanelCols + c] = c < cols ? fp::bf16_to_float(w[k]) : 0.0f;
  }
}

#if defined(__x86_64__)
// Eight weight rows' bf16 at k0..k0+15 (src[i * stride], i < 8) transposed and widened into
// dst[k * kPanelCols + i] for k < 16: three levels of in-lane interleaves, the last of which
// interleaves with zero and so is the widening too (a bf16 is the upper half of its fp32). Pure
// data movement: the fp32 values are those of bf16_to_float.
__attribute__((target("avx2"), always_inline)) inline void transpose8x16(const uint16_t* src, int64_t stride,
                                                                         float* dst) {
  const __m256i zero = _mm256_setzero_si256();
  __m256i r[8], a[8], b[8];
  DETLOGP_UNROLL
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * stride));
  // a[2j] / a[2j+1]: rows 2j, 2j+1 interleaved, k 0-3 / 4-7 of each 128-bit lane.
  DETLOGP_UNROLL
  for (int j = 0; j < 4; ++j) {
    a[2 * j] = _mm256_unpacklo_epi16(r[2 * j], r[2 * j + 1]);
    a[2 * j + 1] = _mm256_unpackhi_epi16(r[2 * j], r[2 * j + 1]);
  }
  // b[q] (q < 4): rows 0-3 at k = 2q, 2q + 1; b[4 + q]: rows 4-7.
  DETLOGP_UNROLL
  for (int half = 0; half < 2; ++half) {
    const __m256i* s = a + 4 * half;
    b[4 * half + 0] = _mm256_unpacklo_epi32(s[0], s[2]);
    b[4 * half + 1] = _mm256_unpackhi_epi32(s[0], s[2]);
    b[4 * half + 2] = _mm256_unpacklo_epi32(s[1], s[3]);
    b[4 * half + 3] = _mm256_unpackhi_epi32(s[1], s[3]);
  }
  DETLOGP_UNROLL
  for (int q = 0; q < 4; ++q) {
    DETLOGP_UNROLL
    for (int odd = 0; odd < 2; ++odd) {
      const __m256i lo = odd ? _mm256_unpackhi_epi16(zero, b[q]) : _mm256_unpacklo_epi16(zero, b[q]);
      const __m256i hi = odd ? _mm256_unpackhi_epi16(zero, b[4 + q]) : _mm256_unpacklo_epi16(zero, b[4 + q]);
      const int k = 2 * q + odd;  // the lower lane holds k, the upper k + 8
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k * kPanelCols), _mm256_permute2x128_si256(lo, hi, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (k + 8) * kPanelCols),
                          _mm256_permute2x128_si256(lo, hi, 0x31));
    }
  }
}

// A full panel's k in blocks of 16, sixteen columns (one 64-byte line of a k row) at a time, so
// that each panel line is written whole, once, and the weight is read as sixteen sequential
// streams, each prefetched a few lines ahead. Returns the first k left to the scalar loop.
__attribute__((target("avx2"), always_inline)) inline int64_t pack_panel(const uint16_t* weight, int64_t weight_stride,
                                                                         int64_t first_row, int64_t dim,
                                                                         WeightPanel& panel) {
  const int64_t k_end = dim / 16 * 16;
  for (int c0 = 0; c0 < kPanelCols; c0 += 16) {
    const uint16_t* src = weight + (first_row + c0) * weight_stride;
    for (int64_t k0 = 0; k0 < k_end; k0 += 16) {
      if (k0 % 32 == 0) DETLOGP_UNROLL
      for (int i = 0; i < 16; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(src + i * weight_stride + k0 + 256), _MM_HINT_T0);
      float* dst = panel.kmajor.data() + k0 * kPanelCols + c0;
      transpose8x16(src + k0, weight_stride, dst);
      transpose8x16(src + 8 * weight_stride + k0, weight_stride, dst + 8);
    }
  }
  return k_end;
}

__attribute__((target("avx2"))) int64_t load_weight_panel_avx2(const uint16_t* weight, int64_t weight_stride,
                                                               int64_t first_row, int64_t dim, WeightPanel& panel) {
  return pack_panel(weight, weight_stride, first_row, dim, panel);
}
// The same code with AVX-512's 32 vector registers (VL and BW: EVEX forms of the 16-bit
// interleaves), which hold the transpose with fewer spills.
__attribute__((target("avx2,avx512f,avx512vl,avx512bw"))) int64_t load_weight_panel_avx512(
    const uint16_t* weight, int64_t weight_stride, int64_t first_row, int64_t dim, WeightPanel& panel) {
  return pack_panel(weight, weight_stride, first_row, dim, panel);
}
#endif

constexpr int kLanes = 8;
typedef float Lane8 __attribute__((vector_size(kLanes * sizeof(float))));

// The portable kernel: R rows x 16 columns of accumulators in explicit vectors (GCC keeps a plain
// 2-D array on the stack), each lane one output.
template <int R>
void kernel_portable(const float* __restrict h, int64_t dim, const float* __restrict panel, int col0,
                     float* __restrict out, int64_t out_stride) {
  constexpr int kVecs = 2;
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

void gemm_portable(const float* h, int rows, int64_t dim, const WeightPanel& panel, float* out, int64_t out_stride) {
  for (int col0 = 0; col0 < panel.cols; col0 += 16) {
    int r = 0;
    for (; r + 4 <= rows; r += 4)
      kernel_portable<4>(h + r * dim, dim, panel.kmajor.data(), col0, out + r * out_stride + col0, out_stride);
    for (; r < rows; ++r)
      kernel_portable<1>(h + r * dim, dim, panel.kmajor.data(), col0, out + r * out_stride + col0, out_stride);
  }
}

#if defined(__x86_64__)
// The K step's multiply and add with their operands in a fixed order: h_k * w as src1 * src2 and
// acc + product as src1 + src2. Where both operands are NaN, x86 returns src1's payload, and the
// compiler may swap the operands of a commutative intrinsic; asm keeps the NaN bits of z those of
// the library's earlier kernel (GCC's AVX2 code for acc + h * w: the same order). The asm also
// rules out contraction into an FMA.
__attribute__((target("avx2"), always_inline)) inline __m256 mul_h_w(__m256 h, __m256 w) {
  __m256 r;
  asm("vmulps %2, %1, %0" : "=x"(r) : "x"(h), "x"(w));
  return r;
}
__attribute__((target("avx2"), always_inline)) inline __m256 add_acc(__m256 acc, __m256 product) {
  asm("vaddps %1, %0, %0" : "+x"(acc) : "x"(product));
  return acc;
}
__attribute__((target("avx512f"), always_inline)) inline __m512 mul_h_w(__m512 h, __m512 w) {
  __m512 r;
  asm("vmulps %2, %1, %0" : "=v"(r) : "v"(h), "v"(w));
  return r;
}
__attribute__((target("avx512f"), always_inline)) inline __m512 add_acc(__m512 acc, __m512 product) {
  asm("vaddps %1, %0, %0" : "+v"(acc) : "v"(product));
  return acc;
}

// AVX2: R rows x 16 columns (8 accumulators at R = 4, with the two weight vectors, the broadcast
// and the product: 12 of the 16 ymm registers).
template <int R>
__attribute__((target("avx2"))) void kernel_avx2(const float* __restrict h, int64_t dim, const float* __restrict panel,
                                                 int col0, float* __restrict out, int64_t out_stride) {
  __m256 acc[R][2];
  DETLOGP_UNROLL
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const float* p = panel + col0;
  for (int64_t k = 0; k < dim; ++k, p += kPanelCols) {
    const __m256 w0 = _mm256_loadu_ps(p), w1 = _mm256_loadu_ps(p + 8);
    DETLOGP_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 hv = _mm256_broadcast_ss(h + r * dim + k);
      acc[r][0] = add_acc(acc[r][0], mul_h_w(hv, w0));
      acc[r][1] = add_acc(acc[r][1], mul_h_w(hv, w1));
    }
  }
  DETLOGP_UNROLL
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * out_stride, acc[r][0]);
    _mm256_storeu_ps(out + r * out_stride + 8, acc[r][1]);
  }
}

__attribute__((target("avx2"))) void gemm_avx2(const float* h, int rows, int64_t dim, const WeightPanel& panel,
                                               float* out, int64_t out_stride) {
  for (int col0 = 0; col0 < panel.cols; col0 += 16) {
    int r = 0;
    for (; r + 4 <= rows; r += 4)
      kernel_avx2<4>(h + r * dim, dim, panel.kmajor.data(), col0, out + r * out_stride + col0, out_stride);
    for (; r < rows; ++r)
      kernel_avx2<1>(h + r * dim, dim, panel.kmajor.data(), col0, out + r * out_stride + col0, out_stride);
  }
}

// AVX-512: R rows x the whole 64-column panel (4 zmm a row); at R = 6, 24 accumulators, the four
// weight vectors, the broadcast and the product fill 30 of the 32 registers, and each k step reads
// 256 bytes of the panel per 24 multiplies and 24 adds. While it runs, the kernel prefetches one
// line a k step of the weight rows the worker is likely to pack next (PanelPrefetch), so that the
// next panel's DRAM reads overlap this panel's arithmetic.
constexpr int kRows512 = 6;
template <int R>
__attribute__((target("avx512f"))) void kernel_avx512(const float* __restrict h, int64_t dim,
                                                      const float* __restrict panel, float* __restrict out,
                                                      int64_t out_stride, PanelPrefetch& prefetch) {
  __m512 acc[R][4];
  DETLOGP_UNROLL
  for (int r = 0; r < R; ++r) DETLOGP_UNROLL
  for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  PanelPrefetch pf = prefetch;
  const float* p = panel;
  for (int64_t k = 0; k < dim; ++k, p += kPanelCols) {
    if (pf.rows_left > 0) {
      _mm_prefetch(pf.row + pf.offset, _MM_HINT_T1);
      pf.offset += 64;
      if (pf.offset >= pf.row_bytes) {
        pf.offset = 0;
        pf.row += pf.stride_bytes;
        --pf.rows_left;
      }
    }
    __m512 w[4];
    DETLOGP_UNROLL
    for (int v = 0; v < 4; ++v) w[v] = _mm512_loadu_ps(p + 16 * v);
    DETLOGP_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512 hv = _mm512_set1_ps(h[r * dim + k]);
      DETLOGP_UNROLL
      for (int v = 0; v < 4; ++v) acc[r][v] = add_acc(acc[r][v], mul_h_w(hv, w[v]));
    }
  }
  prefetch = pf;
  DETLOGP_UNROLL
  for (int r = 0; r < R; ++r) DETLOGP_UNROLL
  for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + r * out_stride + 16 * v, acc[r][v]);
}

// The rows in blocks of at most six, as even as possible (32 rows: 6 6 5 5 5 5), so that no block
// is left with one or two rows, whose kernel would read the panel more often per multiply.
__attribute__((target("avx512f"))) void gemm_avx512(const float* h, int rows, int64_t dim, const WeightPanel& panel,
                                                    float* out, int64_t out_stride) {
  const int blocks = (rows + kRows512 - 1) / kRows512;
  int r = 0;
  for (int b = 0; b < blocks; ++b) {
    const int count = rows / blocks + (b < rows % blocks ? 1 : 0);
    const float* hb = h + r * dim;
    float* ob = out + r * out_stride;
    const float* pk = panel.kmajor.data();
    switch (count) {
      case 6:
        kernel_avx512<6>(hb, dim, pk, ob, out_stride, panel.prefetch);
        break;
      case 5:
        kernel_avx512<5>(hb, dim, pk, ob, out_stride, panel.prefetch);
        break;
      case 4:
        kernel_avx512<4>(hb, dim, pk, ob, out_stride, panel.prefetch);
        break;
      case 3:
        kernel_avx512<3>(hb, dim, pk, ob, out_stride, panel.prefetch);
        break;
      case 2:
        kernel_avx512<2>(hb, dim, pk, ob, out_stride, panel.prefetch);
        break;
      default:
        kernel_avx512<1>(hb, dim, pk, ob, out_stride, panel.prefetch);
        break;
    }
    r += count;
  }
}
#endif

GemmIsa detect_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return GemmIsa::kAvx512;
  if (__builtin_cpu_supports("avx2")) return GemmIsa::kAvx2;
#endif
  return GemmIsa::kPortable;
}

}  // namespace

GemmIsa gemm_isa() {
  static const GemmIsa isa = detect_isa();
  return isa;
}

bool gemm_isa_supported(GemmIsa isa) { return static_cast<int>(isa) <= static_cast<int>(gemm_isa()); }

const char* gemm_isa_name(GemmIsa isa) {
  switch (isa) {
    case GemmIsa::kAvx512:
      return "avx512";
    case GemmIsa::kAvx2:
      return "avx2";
    case GemmIsa::kPortable:
      break;
  }
  return "portable";
}

void load_weight_panel(GemmIsa isa, const uint16_t* weight, int64_t weight_stride, int64_t first_row, int cols,
                       int64_t dim, WeightPanel& panel) {
  panel.cols = cols;
  panel.kmajor.resize(static_cast<size_t>(dim) * kPanelCols);
  int64_t k0 = 0;
#if defined(__x86_64__)
  if (cols == kPanelCols && isa == GemmIsa::kAvx512)
    k0 = load_weight_panel_avx512(weight, weight_stride, first_row, dim, panel);
  else if (cols == kPanelCols && isa == GemmIsa::kAvx2)
    k0 = load_weight_panel_avx2(weight, weight_stride, first_row, dim, panel);
#endif
  load_weight_panel_scalar(weight, weight_stride, first_row, cols, dim, k0, panel);
}

void load_weight_panel(const uint16_t* weight, int64_t weight_stride, int64_t first_row, int cols, int64_t dim,
                       WeightPanel& panel) {
  load_weight_panel(gemm_isa(), weight, weight_stride, first_row, cols, dim, panel);
}

void gemm_rows_panel(GemmIsa isa, const float* hidden_f32, int rows, int64_t dim, const WeightPanel& panel, float* out,
                     int64_t out_stride) {
  static_assert(kPanelCols % 16 == 0, "a panel is a whole number of 16-column blocks");
  // Columns past panel.cols read the zero-filled panel and may be written to scratch the caller
  // sized for a full tile; callers only consume c < panel.cols.
  switch (isa) {
#if defined(__x86_64__)
    case GemmIsa::kAvx512:
      return gemm_avx512(hidden_f32, rows, dim, panel, out, out_stride);
    case GemmIsa::kAvx2:
      return gemm_avx2(hidden_f32, rows, dim, panel, out, out_stride);
#endif
    default:
      return gemm_portable(hidden_f32, rows, dim, panel, out, out_stride);
  }
}

void gemm_rows_panel(const float* hidden_f32, int rows, int64_t dim, const WeightPanel& panel, float* out,
                     int64_t out_stride) {
  gemm_rows_panel(gemm_isa(), hidden_f32, rows, dim, panel, out, out_stride);
}

}  // namespace detlogp::cpu
