// SPDX-License-Identifier: Apache-2.0
// The CUDA backend on the stand-in driver only: what needs the stand-in's
// hooks (a callback at every host wait, spin-wait counts, module-load errors,
// driver versions). The scenarios both drivers run are in scenarios.cpp.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "tests/cuda_standin/engine.h"

using namespace standin;
using namespace moecap_scenarios;

namespace {

struct Setup {
  Setup() { setenv("MOECAP_LIBCUDA", MOECAP_STANDIN_DRIVER, 1); }
};
const Setup setup;

}  // namespace

TEST_CASE("a module the driver cannot load reports NO_DEVICE or DRIVER_TOO_OLD") {
  struct Case {
    const char* error;
    moecap_status expect;
    const char* says;
  };
  // CUDA_ERROR_NO_BINARY_FOR_GPU: no SASS or PTX for this GPU; CUDA_ERROR_UNSUPPORTED_PTX_VERSION
  // and CUDA_ERROR_INVALID_PTX: PTX newer than the driver's JIT.
  for (Case k : {Case{"209", MOECAP_ERROR_NO_DEVICE, "no code for this GPU (built for sm_"},
                 Case{"222", MOECAP_ERROR_DRIVER_TOO_OLD, "cannot compile the kernels' PTX"},
                 Case{"218", MOECAP_ERROR_DRIVER_TOO_OLD, "cannot compile the kernels' PTX"}}) {
    CAPTURE(k.error);
    setenv("STANDIN_MODULE_LOAD_ERROR", k.error, 1);
    moecap_config c = cuda_config();
    moecap_capturer* h = nullptr;
    CHECK_MESSAGE(moecap_create(&c, &h) == k.expect, std::string(moecap_last_error()));
    CHECK_MESSAGE(std::string(moecap_last_error()).find(k.says) != std::string::npos, std::string(moecap_last_error()));
    CHECK(h == nullptr);
    unsetenv("STANDIN_MODULE_LOAD_ERROR");
  }
}

// Its own process (see CMakeLists.txt): the driver version is read once.
TEST_CASE("a driver older than the toolkit that built the kernels: DRIVER_TOO_OLD") {
  const char* version = std::getenv("STANDIN_DRIVER_VERSION");
  if (version == nullptr) {
    MESSAGE("STANDIN_DRIVER_VERSION unset: run by the standin_old_driver test");
    return;
  }
  moecap_config c = cuda_config();
  moecap_capturer* h = nullptr;
  CHECK(moecap_create(&c, &h) == MOECAP_ERROR_DRIVER_TOO_OLD);
  CHECK(h == nullptr);
  CHECK(std::string(moecap_last_error()).find("built with CUDA") != std::string::npos);
}

namespace {

struct Replays {
  Exec exec;
  Stream stream;
  int launched = 0;
  std::thread::id caller = std::this_thread::get_id();  // the hook is global: other threads' waits are not this call's
};

void replay_at_every_wait(void* arg) {
  auto* r = static_cast<Replays*>(arg);
  if (std::this_thread::get_id() != r->caller) return;
  ++r->launched;
  driver().launch(r->exec, r->stream);
  standin_run_stream(r->stream);
}

}  // namespace

TEST_CASE("get_errors(CLEAR) loses no count to replays in between") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  for (int64_t i = 0; i < 3 * kRows * 2; ++i) ids.as<int32_t>()[i] = 99;  // outside [0, num_experts)
  REQUIRE(driver().begin_capture(s, kModeGlobal) == 0);
  capture_layers(h, ids.get(), 1, s);  // 3 layers * top_k 2 = 6 invalid ids per replay
  Graph g = nullptr;
  REQUIRE(driver().end_capture(s, &g) == 0);
  Replays r{nullptr, s};
  REQUIRE(driver().instantiate(&r.exec, g, 0) == 0);

  moecap_error_counts cleared{}, left{};
  cleared.struct_size = left.struct_size = sizeof cleared;
  standin_set_wait_hook(replay_at_every_wait, &r);
  CHECK_MESSAGE(moecap_get_errors(h, &cleared, MOECAP_ERRORS_CLEAR) == MOECAP_OK, std::string(moecap_last_error()));
  standin_set_wait_hook(nullptr, nullptr);
  CHECK(moecap_get_errors(h, &left, 0) == MOECAP_OK);
  REQUIRE(r.launched > 0);
  CHECK(cleared.invalid_ids + left.invalid_ids == 6u * static_cast<unsigned>(r.launched));
  driver().exec_destroy(r.exec);
  driver().graph_destroy(g);
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("host waits block instead of spinning") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  capture_layers(h, ids.get(), 1, s);
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  commit(h, slot.get(), s);
  const int64_t spins = standin_spin_waits();
  REQUIRE(moecap_synchronize(h) == MOECAP_OK);
  CHECK(standin_spin_waits() == spins);
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("a blocking read does not hold the capturer's lock while it waits") {
  moecap_capturer* h = make_capturer();
  Stream a = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 12, 1);
  capture_layers(h, ids.get(), 1, a);
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  slot.set(0, 4);
  commit(h, slot.get(), a);  // read waits for it
  CHECK(other_calls_proceed(h, ids, [&] { CHECK(read_rows(h, {4}) == expected_row(12, 0)); }));
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

// Slots fail closed on the CUDA backend. Nothing runs until a host
// wait, so a read that did not wait for an invalidation would see the rows.
