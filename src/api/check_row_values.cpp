// check_row_values: the entries' row-value checks without a computation, in their order.
#include "core/env.hpp"
#include "core/validate.hpp"
#include "detlogp/detlogp.hpp"

namespace detlogp {

void check_row_values(const TensorView& targets, int64_t real_vocab, int64_t ignore_index, float temperature,
                      const TensorView& temperature_rows) {
  detail::check_environment();
  const int64_t rows = targets.rows;
  const int64_t per_row = detail::check_targets_tensor(targets, rows);
  DETLOGP_CHECK(targets.memory == Memory::host, "check_row_values reads host memory; targets are in CUDA memory");
  DETLOGP_CHECK(real_vocab > 0, "real_vocab=" << real_vocab << " must be > 0");
  detail::check_temperature_value(temperature, "temperature", -1);
  if (temperature_rows.present()) {
    detail::check_vector(temperature_rows, "temperature_rows", rows, {DType::f32});
    DETLOGP_CHECK(temperature_rows.memory == Memory::host,
                  "check_row_values reads host memory; temperature_rows are in CUDA memory");
  }
  if (rows == 0) return;
  detail::check_targets_host(targets.data, targets.dtype == DType::i64, rows, real_vocab, ignore_index, per_row,
                             targets.ndim == 2);
  if (temperature_rows.present())
    detail::check_temperatures_host(static_cast<const float*>(temperature_rows.data), rows);
}

}  // namespace detlogp
