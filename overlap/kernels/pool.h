// The kernels' own worker threads, instead of OpenMP.
//
// Why: the engine runs the model on a stream's worker thread (overlap/device.py), not on the
// main thread. libgomp gives each thread that opens a parallel region its own team; with the
// main thread's team and the worker's team alive, it counts more OpenMP threads than cores
// and "throttles" them: a team thread sleeps on a futex after ~1000 spins, so every parallel
// region pays a wake-up (measured: a 200k-element add 15 us on the main thread, 92 us on a
// worker; a whole decode step 17 ms vs 25 ms). This pool's helpers spin for a while after
// each job (a forward issues a kernel every few tens of microseconds), then sleep, so a step
// pays no wake-ups and an idle engine burns no CPU.
//
// Work is split into contiguous chunks of task indices, one per thread; the split never
// changes what a task computes, so kernels stay batch-invariant whatever the thread count.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace overlap {

class Pool {
 public:
  explicit Pool(int threads) : pid_(getpid()) {
    for (int i = 1; i < threads; ++i) helpers_.emplace_back([this, i] { loop(i); });
  }
  // Helpers are detached on exit: the process is ending, and joining could hang on a
  // helper asleep in a condition wait.
  ~Pool() { for (auto& t : helpers_) t.detach(); }

  int threads() const { return int(helpers_.size()) + 1; }
  pid_t pid() const { return pid_; }

  // fn(begin, end) over [0, n), split into threads() contiguous chunks; the caller runs the
  // first. Concurrent callers (another thread already inside) run their work inline.
  void run(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || n < 2 || helpers_.empty()) {
      fn(0, n);
      return;
    }
    job_ = &fn;
    n_ = n;
    pending_.store(int(helpers_.size()), std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lk(sleep_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    chunk(0, fn);
    while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
  }

 private:
  void chunk(int i, const std::function<void(int64_t, int64_t)>& fn) {
    const int64_t t = threads(), begin = n_ * i / t, end = n_ * (i + 1) / t;
    if (begin < end) fn(begin, end);
  }

  void loop(int i) {
    uint64_t seen = 0;
    while (true) {
      // Spin ~200 us for the next job, then sleep until one comes.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
      int spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen) {
        _mm_pause();
        if (++spins % 256 == 0 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lk(sleep_);
          wake_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        }
      }
      seen = generation_.load(std::memory_order_acquire);
      chunk(i, *job_);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  const pid_t pid_;
  std::vector<std::thread> helpers_;
  std::mutex busy_, sleep_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t n_ = 0;
};

// The process's pool, sized by torch's intra-op thread count at first use. A forked child
// (the runtime's processes, TP ranks) has no helper threads: it builds a pool of its own.
inline Pool& pool() {
  static Pool* p = nullptr;
  static std::mutex make;
  std::lock_guard<std::mutex> lk(make);
  if (p == nullptr || p->pid() != getpid()) p = new Pool(std::max(1, at::get_num_threads()));
  return *p;
}

// parallel_for over [0, n) tasks; fewer than min_tasks run inline on the caller.
inline void parallel_for(int64_t n, int64_t min_tasks, const std::function<void(int64_t, int64_t)>& fn) {
  if (n < min_tasks) {
    fn(0, n);
    return;
  }
  pool().run(n, fn);
}

}  // namespace overlap
