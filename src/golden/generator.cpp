#include "golden/generator.hpp"

#include <algorithm>
#include <cmath>
#include <thread>

#include "detlogp/error.hpp"
#include "detlogp/fpops.hpp"
#include "detlogp/hash.hpp"

namespace detlogp::golden {

uint64_t draw(uint64_t seed, uint64_t stream, uint64_t index) {
  const uint64_t key = mix64(seed * kSplitMixGamma + stream * 0xD1B54A32D192ED03ull + 0x632BE59BD9B4E019ull);
  return mix64(key ^ mix64(index * kSplitMixGamma + key));
}

float normal(uint64_t seed, uint64_t stream, uint64_t index) {
  const uint64_t a = draw(seed, stream, 2 * index), b = draw(seed, stream, 2 * index + 1);
  int64_t sum = 0;
  for (int s = 0; s < 64; s += 16)
    sum += static_cast<int64_t>((a >> s) & 0xFFFF) + static_cast<int64_t>((b >> s) & 0xFFFF);
  // Eight uniforms on {0..65535}: mean 8 * 32767.5 = 262140, sd sqrt(8 (65536^2 - 1) / 12) = 53510.85.
  // |sum - 262140| <= 262140 < 2^24: the int -> float conversion is exact; one rounding follows.
  return static_cast<float>(sum - 262140) * (1.0f / 53510.0f);
}

float uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return static_cast<float>(draw(seed, stream, index) >> 40) * 0x1p-24f;
}

std::vector<uint16_t> weight_rows(uint64_t seed, int64_t row_begin, int64_t rows, int64_t dim) {
  std::vector<uint16_t> w(static_cast<size_t>(rows * dim));
  // Counter-based, so the split across threads cannot change a bit.
  const int workers = static_cast<int>(std::max(1u, std::min(8u, std::thread::hardware_concurrency())));
  std::vector<std::thread> pool;
  for (int t = 0; t < workers; ++t) {
    pool.emplace_back([&, t] {
      for (int64_t r = t; r < rows; r += workers) {
        const uint64_t base = static_cast<uint64_t>((row_begin + r) * dim);
        uint16_t* out = w.data() + r * dim;
        for (int64_t k = 0; k < dim; ++k) out[k] = fp::bf16_round(kWeightStd * normal(seed, kStreamWeight, base + k));
      }
    });
  }
  for (auto& th : pool) th.join();
  return w;
}

void hidden_row(uint64_t seed, uint64_t key, int64_t dim, float gain, const uint16_t* dominant_row, uint16_t* out) {
  std::vector<float> x(static_cast<size_t>(dim));
  const float mix = dominant_mix(dim);
  for (int64_t k = 0; k < dim; ++k) {
    float v = normal(seed, kStreamHidden, key * static_cast<uint64_t>(dim) + static_cast<uint64_t>(k));
    if (dominant_row != nullptr) v = v + mix * (fp::bf16_to_float(dominant_row[k]) / kWeightStd);
    x[static_cast<size_t>(k)] = v;
  }
  float ss = 0.0f;
  for (float v : x) ss = ss + v * v;
  const float rms = std::sqrt(ss / static_cast<float>(dim));
  for (int64_t k = 0; k < dim; ++k) out[k] = fp::bf16_round(gain * (x[static_cast<size_t>(k)] / rms));
}

float dominant_logit(int64_t dim) { return dim >= 4096 ? 18.0f : 12.0f; }

float dominant_mix(int64_t dim) {
  const float scale = kWeightStd * static_cast<float>(dim), z = dominant_logit(dim);
  if (scale <= 1.25f * z) return 4.0f;
  return z / std::sqrt(scale * scale - z * z);
}

}  // namespace detlogp::golden
