#include "cpu/cpu_tile_summary.hpp"

#include "cpu/cpu_gemm.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace detlogp::cpu {

namespace {

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics pass an undefined vector as the passthrough of their unmasked forms
// and then warn about it at every use (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// expc (transcendentals.hpp) on 16 lanes: the same fp32 operations (the hardware fma is the
// correctly rounded fma of fp::fma), each of the function's branches computed and selected by mask.
__attribute__((target("avx512f"))) __m512 expc16(__m512 x) {
  using namespace expc_constants;
  const __m512 shifted = _mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(kRoundMagic));
  const __m512 kf = _mm512_sub_ps(shifted, _mm512_set1_ps(kRoundMagic));
  const __m512i k = _mm512_cvttps_epi32(kf);
  __m512 r = _mm512_fmadd_ps(kf, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(kf, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kC6);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kC5));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kC4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kC3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kC2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512 normal =
      _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k, _mm512_set1_epi32(127)), 23)));
  const __m512 subnormal = _mm512_mul_ps(
      _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k, _mm512_set1_epi32(127 + 64)), 23))),
      _mm512_set1_ps(0x1p-64f));
  __m512 e = _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(k, _mm512_set1_epi32(-126)), subnormal, normal);
  e = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(kUnderflow), _CMP_GE_OQ), _mm512_setzero_ps(), e);
  e = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(kOverflow), _CMP_GT_OQ), e,
                           _mm512_set1_ps(fp::pos_inf()));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), e, x);  // NaN unchanged
}

// One level of the adjacent-pairwise tree: lanes 2i and 2i + 1 of the 32 lanes (a, b) added into
// lane i.
__attribute__((target("avx512f"))) __m512 pair_level(__m512 a, __m512 b) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}

__attribute__((target("avx512f"))) bool tile_summary_avx512(const float* y, TileSummary& out) {
  __m512 v[4];
  const __m512i exponent = _mm512_set1_epi32(0x7F800000);
  __mmask16 special = 0;
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm512_loadu_ps(y + 16 * i);
    special |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v[i]), exponent), exponent);
  }
  if (special) return false;
  // Finite lanes: the maximum is exact in any order, up to the sign of a zero maximum, which the
  // +0 normalizes as in the scalar definition.
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, _mm512_max_ps(_mm512_max_ps(v[0], v[1]), _mm512_max_ps(v[2], v[3])));
  float m = lanes[0];
  for (int i = 1; i < 16; ++i) m = lanes[i] > m ? lanes[i] : m;
  m = normalize_zero(m);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 e[4];
  for (int i = 0; i < 4; ++i) e[i] = expc16(_mm512_sub_ps(v[i], mv));
  __m512 s = pair_level(pair_level(e[0], e[1]), pair_level(e[2], e[3]));  // levels 1 and 2: 16 lanes
  for (int level = 3; level <= 6; ++level) s = pair_level(s, s);          // lanes 0.. hold the next level
  out = {m, _mm512_cvtss_f32(s)};
  return true;
}
__attribute__((target("avx512f"))) void expc_avx512(const float* x, float* e, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(e + i, expc16(_mm512_loadu_ps(x + i)));
}
#pragma GCC diagnostic pop
#endif

}  // namespace

bool vector_expc(const float* x, float* e, int64_t n) {
#if defined(__x86_64__)
  if (gemm_isa_supported(GemmIsa::kAvx512)) {
    expc_avx512(x, e, n);
    return true;
  }
#endif
  (void)x;
  (void)e;
  (void)n;
  return false;
}

bool vector_tile_summary(const float* y, TileSummary& out) {
#if defined(__x86_64__)
  if (gemm_isa_supported(GemmIsa::kAvx512)) return tile_summary_avx512(y, out);
#endif
  (void)y;
  (void)out;
  return false;
}

TileSummary fast_tile_summary(const float* y, int real_lanes) {
  TileSummary s;
  if (real_lanes == kVocabTile && vector_tile_summary(y, s)) return s;
  return tile_summary(y, real_lanes);
}

}  // namespace detlogp::cpu
