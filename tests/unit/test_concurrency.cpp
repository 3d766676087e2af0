// SPDX-License-Identifier: Apache-2.0
// Thread safety as the header documents it: one thread reads finished
// requests while another captures and commits new ones on the same capturer.
// Run under TSan by .ci/run; here it checks that no row is lost or torn.
#include <doctest/doctest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "moecap.h"
#include "tests/support/tensors.h"

using namespace moecap_test;

TEST_CASE("reads on one thread, captures and commits on another: no race, no row lost" *
          doctest::test_suite("concurrency")) {
  moecap_config c = small_config();
  c.num_layers = 4;
  c.top_k = 4;
  c.num_experts = 64;
  c.chunked_prefill_size = 16;
  c.host_slots = 4096;
  moecap_capturer* h = nullptr;
  REQUIRE(moecap_create(&c, &h) == MOECAP_OK);
  constexpr int64_t kSteps = 200;
  constexpr int64_t kRows = 16;
  std::atomic<int64_t> committed{0};  // steps whose rows are in the cache
  std::atomic<bool> writer_ok{true};

  std::thread writer([&] {
    HostTensor ids({kRows, c.top_k}, i32());
    HostTensor slots({kRows}, i64());
    for (int64_t step = 0; step < kSteps; ++step) {
      for (int32_t l = 0; l < c.num_layers; ++l) {
        for (int64_t i = 0; i < ids.numel(); ++i) ids.set(i, route(step * kRows + i / c.top_k, l, i % c.top_k, 64));
        writer_ok = writer_ok && moecap_capture(h, l, ids.get(), nullptr, nullptr) == MOECAP_OK;
      }
      for (int64_t i = 0; i < kRows; ++i) slots.set(i, step * kRows + i);
      moecap_commit_args a{sizeof a, 0, nullptr, slots.get()};
      writer_ok = writer_ok && moecap_commit(h, &a, nullptr) == MOECAP_OK;
      committed.store(step + 1, std::memory_order_release);
    }
  });

  int64_t checked = 0;
  int64_t bad = 0;
  HostTensor q({kRows}, i64());
  HostTensor out({kRows, c.num_layers, c.top_k}, i32());
  for (int64_t step = 0; step < kSteps; ++step) {
    while (committed.load(std::memory_order_acquire) <= step) std::this_thread::yield();
    for (int64_t i = 0; i < kRows; ++i) q.set(i, step * kRows + i);
    REQUIRE(moecap_read(h, q.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
    for (int64_t i = 0; i < kRows; ++i)
      for (int32_t l = 0; l < c.num_layers; ++l)
        for (int32_t k = 0; k < c.top_k; ++k)
          bad += out.at((i * c.num_layers + l) * c.top_k + k) != route(step * kRows + i, l, k, 64);
    checked += kRows;
  }
  writer.join();
  CHECK(writer_ok);
  CHECK(bad == 0);
  CHECK(checked == kSteps * kRows);
  moecap_destroy(h);
}

#ifndef NDEBUG
TEST_CASE("debug builds detect use after destroy") {
  moecap_config c = small_config();
  moecap_capturer* h = nullptr;
  REQUIRE(moecap_create(&c, &h) == MOECAP_OK);
  REQUIRE(moecap_destroy(h) == MOECAP_OK);
  HostTensor ids({1, c.top_k}, i32());
  CHECK(moecap_capture(h, 0, ids.get(), nullptr, nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(moecap_last_error()).find("after moecap_destroy") != std::string::npos);
  CHECK(moecap_destroy(h) == MOECAP_ERROR_INVALID_ARGUMENT);
}
#endif
