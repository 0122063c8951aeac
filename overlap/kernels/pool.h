// The kernels' own worker threads, instead of OpenMP.
//
// Why: the engine runs the model on a stream's worker thread (overlap/device.py), not on the
// main thread. libgomp gives each thread that opens a parallel region its own team; with the
// main thread's team and the worker's team alive, it counts more OpenMP threads than cores
// and "throttles" them: a team thread sleeps on a futex after ~1000 spins, so every parallel
// region pays a wake-up (measured: a 200k-element add 15 us on the main thread, 92 us on a
// worker; a whole decode step 17 ms vs 25 ms). This pool's helpers spin for a while after
// each job (a forward issues a kernel every few tens of microseconds; loop() says how long),
// then sleep, so a step pays no wake-ups and an idle engine burns no CPU.
//
// Work is split into contiguous chunks of task indices, one per thread; the split never
// changes what a task computes, so kernels stay batch-invariant whatever the thread count.
// The caller and the awake helpers claim chunks (an atomic counter) rather than each owning
// one: with 2 cores the engine's other thread (the scheduler's Python beside the stream's
// worker) often holds the helper's core, and a caller that waited for the helper's chunk
// waited out the OS's time slice; claiming, it runs that chunk itself. Paired in one engine
// (runs/prof/pool_ab8.py, AMD EPYC Zen 5): concurrency 8 plain decoding +11.8%, EAGLE +10.2%;
// batch 1 +4.2% both (docs/fast_steps.md, "Session 33").
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sched.h>
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
    for (int i = 1; i < threads; ++i) helpers_.emplace_back([this] { loop(); });
  }
  // Helpers are detached on exit: the process is ending, and joining could hang on a
  // helper asleep in a condition wait.
  ~Pool() { for (auto& t : helpers_) t.detach(); }

  int threads() const { return int(helpers_.size()) + 1; }
  pid_t pid() const { return pid_; }

  // fn(begin, end) over [0, n), split into threads() contiguous chunks. The caller and any
  // helper that is awake claim chunks until none is left, so the caller waits only for a
  // chunk a helper is running, never for a helper the OS has not scheduled (on 2 cores the
  // engine's other thread often holds the second core). Concurrent callers (another thread
  // already inside) run their work inline.
  void run(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || n < 2 || helpers_.empty()) {
      fn(0, n);
      return;
    }
    job_ = &fn;
    n_ = n;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (claims_.load(std::memory_order_relaxed) >> kChunkBits) + 1;
    {
      std::lock_guard<std::mutex> lk(sleep_);
      claims_.store(gen << kChunkBits, std::memory_order_release);  // a new job, no chunk claimed
    }
    wake_.notify_all();
    work(gen);
    while (done_.load(std::memory_order_acquire) != threads()) _mm_pause();
  }

 private:
  // claims_: the job's generation above kChunkBits, the next unclaimed chunk below.
  static constexpr int kChunkBits = 16;
  static constexpr uint64_t kChunkMask = (uint64_t(1) << kChunkBits) - 1;

  // Claim and run chunks of job `gen` until none is left (or a newer job replaced it).
  void work(uint64_t gen) {
    const int t = threads();
    uint64_t c = claims_.load(std::memory_order_acquire);
    while ((c >> kChunkBits) == gen && int(c & kChunkMask) < t) {
      if (!claims_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
      const int64_t i = int64_t(c & kChunkMask), begin = n_ * i / t, end = n_ * (i + 1) / t;
      if (begin < end) (*job_)(begin, end);
      done_.fetch_add(1, std::memory_order_release);
      c = claims_.load(std::memory_order_acquire);
    }
  }

  bool has_chunks(uint64_t c) const { return int(c & kChunkMask) < threads(); }

  void loop() {
    while (true) {
      // Wait for the next job: spin 200 us, then spin yielding the core to any other thread
      // that wants it until 5 ms, then sleep until a job comes. A batch-1 EAGLE step leaves
      // the pool idle for 1-2 ms at a time (the host's planning, the drafter's glue), and a
      // helper asleep by then sat out the next jobs or cost them a wake-up; yielding keeps
      // the longer wait from taking a core from the host's Python. Against sleeping after
      // 200 us, paired in one engine (AMD EPYC Zen 5): batch 1 EAGLE +3.8%, plain +3.7%;
      // c=8 EAGLE +2.7% (docs/fast_steps.md, "Session 33").
      const auto start = std::chrono::steady_clock::now();
      const auto hot = start + std::chrono::microseconds(200), until = start + std::chrono::milliseconds(5);
      int spins = 0;
      uint64_t c;
      while (!has_chunks(c = claims_.load(std::memory_order_acquire))) {
        _mm_pause();
        if (++spins % 256 == 0) {
          const auto now = std::chrono::steady_clock::now();
          if (now > until) {
            std::unique_lock<std::mutex> lk(sleep_);
            wake_.wait(lk, [&] { return has_chunks(claims_.load(std::memory_order_acquire)); });
          } else if (now > hot) {
            sched_yield();
          }
        }
      }
      work(c >> kChunkBits);
    }
  }

  const pid_t pid_;
  std::vector<std::thread> helpers_;
  std::mutex busy_, sleep_;
  std::condition_variable wake_;
  std::atomic<uint64_t> claims_{kChunkMask};  // generation 0: no job, no chunk to claim
  std::atomic<int> done_{0};
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
