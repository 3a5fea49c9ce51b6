// reduce_logits: the contract reducer over fp32 logits given from anywhere. This is what lets
// another backend's serving logits be re-reduced and compared bit for bit.
#include <algorithm>

#include "core/validate.hpp"
#include "cpu/cpu_parallel.hpp"
#include "detlogp/detlogp.hpp"

namespace detlogp {

void reduce_logits(const ReduceLogitsInputs& in, const MutableTensorView& logp, const MutableTensorView& lse) {
  check_environment();
  const TensorView& z = in.logits;
  DETLOGP_CHECK(z.ndim == 2 && z.dtype == DType::f32,
                "logits must be a 2-D f32 tensor, got ndim=" << z.ndim << " dtype=" << dtype_name(z.dtype));
  DETLOGP_CHECK(z.memory == Memory::host, "reduce_logits runs on host memory; logits are in CUDA memory");
  DETLOGP_CHECK(z.cols > 0, "logits has V=0 columns");
  DETLOGP_CHECK(z.row_stride >= z.cols, "logits row_stride=" << z.row_stride << " < " << z.cols << " columns");
  const int64_t rows = z.rows, vocab = z.cols;
  const int64_t real_vocab = in.real_vocab < 0 ? vocab : in.real_vocab;
  DETLOGP_CHECK(real_vocab > 0 && real_vocab <= vocab,
                "real_vocab=" << in.real_vocab << " must be in [1, V=" << vocab << "] (or -1 for V)");
  for (const auto* t : {&in.targets, static_cast<const TensorView*>(&logp), static_cast<const TensorView*>(&lse)})
    DETLOGP_CHECK(t->memory == Memory::host, "reduce_logits needs host memory for targets/logp/lse");
  DETLOGP_CHECK(in.targets.ndim == 1 && (in.targets.dtype == DType::i32 || in.targets.dtype == DType::i64) &&
                    in.targets.rows == rows,
                "targets must be [N=" << rows << "] i32 or i64");
  DETLOGP_CHECK(logp.ndim == 1 && logp.dtype == DType::f32 && logp.rows == rows, "logp must be [N=" << rows << "] f32");
  DETLOGP_CHECK(lse.ndim == 1 && lse.dtype == DType::f32 && lse.rows == rows, "lse must be [N=" << rows << "] f32");
  detail::check_temperature_value(in.temperature, "temperature", -1);
  const float* temps = nullptr;
  if (in.temperature_rows.present()) {
    DETLOGP_CHECK(in.temperature_rows.ndim == 1 && in.temperature_rows.dtype == DType::f32 &&
                      in.temperature_rows.rows == rows && in.temperature_rows.memory == Memory::host,
                  "temperature_rows must be [N=" << rows << "] f32 in host memory");
    temps = static_cast<const float*>(in.temperature_rows.data);
    detail::check_temperatures_host(temps, rows);
  }
  const bool i64 = in.targets.dtype == DType::i64;
  if (rows == 0) return;
  detail::check_targets_host(in.targets.data, i64, rows, real_vocab, in.ignore_index);

  const int64_t tiles = shard_tiles(vocab);
  float* logp_out = static_cast<float*>(logp.mutable_data());
  float* lse_out = static_cast<float*>(lse.mutable_data());
  cpu::parallel_for(rows, cpu::cpu_threads(), [&](int64_t row, int) {
    const float* zr = static_cast<const float*>(z.data) + row * z.row_stride;
    const float inv_t = inverse_temperature(temps ? temps[row] : in.temperature);
    const int64_t target =
        i64 ? static_cast<const int64_t*>(in.targets.data)[row] : static_cast<const int32_t*>(in.targets.data)[row];
    const bool ignored = target == in.ignore_index;
    std::vector<TileSummary> summaries(static_cast<size_t>(tiles));
    float y[kVocabTile];
    for (int64_t g = 0; g < tiles; ++g) {
      const int64_t col0 = g * kVocabTile;
      const int cols = static_cast<int>(std::min<int64_t>(kVocabTile, vocab - col0));
      const int real = static_cast<int>(std::clamp<int64_t>(real_vocab - col0, 0, kVocabTile));
      for (int c = 0; c < cols; ++c) y[c] = scale_logit(zr[col0 + c], inv_t);
      summaries[static_cast<size_t>(g)] = tile_summary(y, std::min(real, cols));
    }
    const float y_t = ignored ? 0.0f : scale_logit(zr[target], inv_t);
    const RowResult r = reduce_row_summaries(summaries.data(), tiles, y_t, ignored);
    logp_out[row] = r.logp;
    lse_out[row] = r.lse;
  });
}

}  // namespace detlogp
