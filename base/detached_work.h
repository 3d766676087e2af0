/* SPDX-License-Identifier: Apache-2.0 */
// Work on detached threads that process exit waits for. A detached thread
// still freeing driver memory while exit() tears the driver (or a tool such
// as compute-sanitizer) down crashes the process after main returned; the
// owner registers drain() with atexit after the driver is initialized, so it
// runs before the driver's own exit handlers. Work that would start after
// drain() began is refused: the caller leaks what it would have freed, which
// the ending process gives back anyway.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>

namespace moecap {

class DetachedWork {
 public:
  // Runs `work` on a new detached thread; false (and `work` not run) once
  // drain() began, or when no thread can be started. Never throws.
  template <class F>
  bool run(F work) noexcept {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (draining_) return false;
      ++running_;
    }
    try {
      std::thread([this, work = std::move(work)]() mutable {
        work();
        finished();
      }).detach();
      return true;
    } catch (...) {
      finished();
      return false;
    }
  }

  // Refuses new work and waits up to `limit` for what runs; true when none is left.
  bool drain(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(mu_);
    draining_ = true;
    return done_.wait_for(lock, limit, [this] { return running_ == 0; });
  }

 private:
  void finished() noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    --running_;
    done_.notify_all();  // under the lock: a drained owner may be destroyed as soon as it sees zero
  }

  std::mutex mu_;
  std::condition_variable done_;
  int running_ = 0;
  bool draining_ = false;
};

}  // namespace moecap
