// SPDX-License-Identifier: Apache-2.0
// DetachedWork: the detached threads that free graph holds, which process exit drains.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "base/detached_work.h"

using namespace std::chrono_literals;

TEST_CASE("drain waits for work in flight, then refuses new work without running it" *
          doctest::test_suite("concurrency")) {
  static auto* work = new moecap::DetachedWork;  // as the process-wide one: never destroyed
  std::atomic<bool> go{false};
  std::atomic<int> done{0};
  REQUIRE(work->run([&] {
    while (!go.load()) std::this_thread::yield();
    std::this_thread::sleep_for(50ms);
    done = 1;
  }));
  std::thread opener([&] {
    std::this_thread::sleep_for(20ms);
    go = true;
  });
  CHECK(work->drain(5s));
  CHECK(done.load() == 1);  // drained only once it finished
  opener.join();
  std::atomic<bool> ran{false};
  CHECK_FALSE(work->run([&] { ran = true; }));
  std::this_thread::sleep_for(20ms);
  CHECK_FALSE(ran.load());
}

TEST_CASE("drain gives up after its limit when work does not finish" * doctest::test_suite("concurrency")) {
  // Reachable until the process ends (no leak report): the thread may still use them after the test.
  static auto* work = new moecap::DetachedWork;
  static auto* release = new std::atomic<bool>{false};
  REQUIRE(work->run([] {
    while (!release->load()) std::this_thread::sleep_for(1ms);
  }));
  const auto start = std::chrono::steady_clock::now();
  CHECK_FALSE(work->drain(30ms));
  CHECK(std::chrono::steady_clock::now() - start >= 30ms);
  release->store(true);  // the thread ends on its own
}
