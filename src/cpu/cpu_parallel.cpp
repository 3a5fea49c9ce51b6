#include "cpu/cpu_parallel.hpp"

#include <algorithm>
#include <thread>

#include "core/env.hpp"

namespace detlogp::cpu {

int cpu_threads() {
  const int hardware = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return static_cast<int>(detail::env_integer("DETLOGP_CPU_THREADS", hardware));
}

}  // namespace detlogp::cpu
