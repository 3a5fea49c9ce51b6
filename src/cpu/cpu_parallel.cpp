#include "cpu/cpu_parallel.hpp"

#include <cstdlib>

#include "core/env.hpp"

namespace detlogp::cpu {

int cpu_threads() {
  if (auto v = detail::env_value("DETLOGP_CPU_THREADS")) return std::max(1, std::atoi(v->c_str()));
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace detlogp::cpu
