// A minimal fork-join loop over independent tasks. Task results never depend on which thread
// ran them, so the thread count is a free axis (DETLOGP_CPU_THREADS).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace detlogp::cpu {

int cpu_threads();  // DETLOGP_CPU_THREADS (checked by check_environment), else hardware concurrency

// Runs body(task, worker) for task in [0, n_tasks); worker in [0, workers) indexes per-thread
// scratch. Rethrows the first exception.
template <class Body>
void parallel_for(int64_t n_tasks, int workers, Body&& body) {
  workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(workers, n_tasks)));
  if (workers == 1) {
    for (int64_t t = 0; t < n_tasks; ++t) body(t, 0);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker_loop = [&](int w) {
    try {
      for (int64_t t = next++; t < n_tasks; t = next++) body(t, w);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      next = n_tasks;
    }
  };
  std::vector<std::thread> pool;
  for (int w = 1; w < workers; ++w) pool.emplace_back(worker_loop, w);
  worker_loop(0);
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace detlogp::cpu
