// SPDX-License-Identifier: Apache-2.0
// The CUDA backend scenarios on a real GPU: tests/cuda_standin/scenarios.cpp
// (written once, over engine_api.h) runs here against cudart through
// engine_cudart.cpp, plus what only a GPU shows. Skips (exit 77) without a
// GPU; tests/gpu/device_check.sh runs it under compute-sanitizer memcheck.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <deque>
#include <string>
#include <thread>

#include "tests/cuda_standin/engine_api.h"
#include "tests/support/step_rows.h"

using namespace engine;
using namespace moecap_scenarios;

// The stand-in forces the interleaving with a hook at a host wait; here
// another thread replays for real while get_errors clears.
TEST_CASE("get_errors(CLEAR) while another thread replays: no count lost") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 0, kRows, 99);  // every id outside [0, num_experts)
  REQUIRE(begin_capture(s, kGlobal) == 0);
  capture_layers(h, ids.get(), 1, s);  // 6 invalid ids per replay
  Graph g = nullptr;
  REQUIRE(end_capture(s, &g) == 0);
  Exec exec = instantiate(g);
  constexpr int kReplays = 2000;
  std::thread replayer([&] {
    for (int i = 0; i < kReplays; ++i) cudaGraphLaunch(exec, s);
    cudaStreamSynchronize(s);
  });
  uint64_t seen = 0;
  for (int i = 0; i < 200; ++i) {
    moecap_error_counts e{};
    e.struct_size = sizeof e;
    REQUIRE(moecap_get_errors(h, &e, MOECAP_ERRORS_CLEAR) == MOECAP_OK);
    seen += e.invalid_ids;
  }
  replayer.join();
  moecap_error_counts e{};
  e.struct_size = sizeof e;
  REQUIRE(moecap_get_errors(h, &e, MOECAP_ERRORS_CLEAR) == MOECAP_OK);
  CHECK(seen + e.invalid_ids == 6u * kReplays);
  destroy(exec);
  destroy(g);
  moecap_destroy(h);
  cudaStreamDestroy(s);
}

// Consumption that holds at dp >= 2 (tests/support/step_rows.h), as the host
// backend and the stand-in run it, with the claim and release kernels on a GPU.
TEST_CASE("a step's rows are unusable after its commits at dp 2 and 4, skipped layers read -1 (GPU)") {
  for (int32_t dp : {2, 4}) {
    CAPTURE(dp);
    const moecap_config c = moecap_step_rows::config(dp, MOECAP_DEVICE_CUDA);
    moecap_capturer* h = nullptr;
    REQUIRE_MESSAGE(moecap_create(&c, &h) == MOECAP_OK, std::string(moecap_last_error()));
    std::deque<Tensor> held;  // every step's ids live until the test ends: no upload overwrites a queued capture's input
    moecap_step_rows::Memory m;
    Stream s = new_stream();
    m.stream = s;
    m.ids = [&held](const std::vector<int32_t>& v, int64_t n, int32_t top_k) {
      held.emplace_back(std::vector<int64_t>{n, top_k}, moecap_test::i32(), kDLCUDA);
      if (!v.empty()) held.back().upload(v);
      return held.back().get();
    };
    moecap_step_rows::run(h, c, m);
    CHECK(moecap_destroy(h) == MOECAP_OK);
    cudaStreamDestroy(s);
  }
}

#include "tests/gpu/gpu_main.h"
