// CUDA builds without cuBLAS: the non-contract cuBLAS lane is listed as unavailable.
#include "cuda/unavailable.hpp"

namespace detlogp::detail {

const Backend& cublas_materialized_backend() {
  static const CublasUnavailable backend("this build found no cuBLAS (CUDA::cublas) at configure time");
  return backend;
}

}  // namespace detlogp::detail
