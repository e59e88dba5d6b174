// kvrelay._ucx: a thread kept to drive batches (a striped pull's far half).
#pragma once

#include <pthread.h>
#include <sched.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "ucx_objects.h"

namespace kvrelay::ucx {
namespace {

// A thread kept to drive batches handed to it one after another (a striped
// pull's far half). Waking it is a futex wake; a new std::thread per batch
// cost about 100 us on a 2-core VM, a twentieth of a 16 MiB pull.
class Driver {
 public:
  Driver() : thread_([this] { run(); }) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0)
      for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
        if (CPU_ISSET(cpu, &set)) allowed_.push_back(cpu);
  }
  ~Driver() { stop(); }
  // Runs `job` on the kept thread, on a CPU other than the caller's: woken
  // from the caller, the thread stayed on the caller's CPU (the scheduler
  // favours the waker's cache), so a 16 MiB pull's two halves ran one after
  // the other there while the other core idled.
  void submit(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // Before the affinity call: a stopped driver's thread is joined, and
      // its handle names no thread any more.
      if (stopping_) throw UcxError("the driver is stopped");
      keep_off(sched_getcpu());
      jobs_.push_back(std::move(job));
    }
    ready_.notify_one();
  }
  // Runs what was submitted, then ends the thread.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }
  // Allows the kept thread every CPU of the process but `cpu` (a syscall
  // only when the caller has moved); nothing where one CPU is allowed.
  void keep_off(int cpu) {
    if (cpu < 0 || cpu == kept_off_ || allowed_.size() < 2) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int other : allowed_)
      if (other != cpu) CPU_SET(other, &set);
    if (pthread_setaffinity_np(thread_.native_handle(), sizeof(set), &set) == 0) kept_off_ = cpu;
  }

  std::vector<int> allowed_;  // the process's CPUs when the driver was made
  int kept_off_ = -1;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::thread thread_;  // last: it starts with the members above ready
};

}  // namespace
}  // namespace kvrelay::ucx
