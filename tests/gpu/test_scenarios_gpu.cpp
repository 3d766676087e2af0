// SPDX-License-Identifier: Apache-2.0
// The CUDA backend scenarios on a real GPU: tests/cuda_standin/scenarios.cpp
// (written once, over engine_api.h) runs here against cudart through
// engine_cudart.cpp, plus what only a GPU shows. Skips (exit 77) without a
// GPU; tests/gpu/device_check.sh runs it under compute-sanitizer memcheck.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <thread>

#include "tests/cuda_standin/engine_api.h"

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

#include "tests/gpu/gpu_main.h"
