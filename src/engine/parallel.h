// parallel_for over [0, n) with a fixed number of std::threads. Work is split into contiguous
// chunks; callers make each index's result independent of which thread runs it.
#pragma once

#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace moefq {

template <typename F>
void parallel_for(int64_t n, int num_threads, F&& fn) {
  const int64_t workers = std::min<int64_t>(num_threads, n);
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::exception_ptr error;
  std::mutex mu;
  std::vector<std::thread> threads;
  for (int64_t w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      try {
        for (int64_t i = n * w / workers; i < n * (w + 1) / workers; ++i) fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace moefq
