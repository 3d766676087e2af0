// The CUDA backend's orchestration on the stand-in driver: one scenario per
// defect of issue 14, each the way an engine really produces it. Nothing
// runs on a stream until the host waits (or the test runs it), so ordering,
// lifetime and capture-mode mistakes show as wrong rows, errors or
// violations the stand-in records.
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

TEST_CASE("defect 1: a pinned slot list the engine refills after the call still commits to the call's slots") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 1, 2);
  capture_layers(h, ids.get(), 2, s);
  struct Case {
    DLDeviceType where;
    int64_t first, refill;
  };
  for (Case k : {Case{kDLCPU, 3, 7}, Case{kDLCUDAHost, 5, 9}}) {
    CAPTURE(k.where);
    Tensor slots = index_tensor({k.first, k.first + 1}, k.where);  // pinned (cudaHostAlloc / pin_memory)
    commit(h, slots.get(), s);
    slots.as<int64_t>()[0] = k.refill;  // the engine prepares the next step while this one runs
    slots.as<int64_t>()[1] = k.refill + 1;
    REQUIRE(moecap_synchronize(h) == MOECAP_OK);
    const auto got = read_rows(h, {k.first, k.first + 1, k.refill, k.refill + 1, kNever});
    CHECK(row_of(got, 0) == expected_row(1, 0));
    CHECK(row_of(got, 1) == expected_row(1, 1));
    CHECK(row_of(got, 2) == row_of(got, 4));  // the refilled slots got nothing
    CHECK(row_of(got, 3) == row_of(got, 4));
  }
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("defect 2: read, synchronize and get_errors while the engine captures, on another thread or this one") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 2, 1);
  capture_layers(h, ids.get(), 1, s);
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  slot.set(0, 3);
  commit(h, slot.get(), s);  // a commit in flight: read must wait for it

  Stream engine = new_stream();
  auto host_calls = [&] {
    CHECK(read_rows(h, {3}) == expected_row(2, 0));
    CHECK_MESSAGE(moecap_synchronize(h) == MOECAP_OK, std::string(moecap_last_error()));
    moecap_error_counts e{};
    e.struct_size = sizeof e;
    CHECK_MESSAGE(moecap_get_errors(h, &e, 0) == MOECAP_OK, std::string(moecap_last_error()));
  };
  for (const bool other_thread : {true, false}) {
    CAPTURE(other_thread);
    REQUIRE(driver().begin_capture(engine, kModeGlobal) == 0);  // torch.cuda.graph's default mode
    if (other_thread) {
      std::thread(host_calls).join();
    } else {
      host_calls();
    }
    Graph g = nullptr;
    CHECK(driver().end_capture(engine, &g) == 0);  // not invalidated
    if (g != nullptr) driver().graph_destroy(g);
  }
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("defect 3: a read waits for graph replays on one stream after many eager commits on another") {
  moecap_capturer* h = make_capturer();
  Stream a = new_stream();
  Stream b = new_stream();
  Tensor ids = routing_buffer();
  constexpr int kGraphs = 20;
  std::vector<moecap_graph*> graphs;
  std::vector<Tensor> slots;
  slots.reserve(kGraphs);
  for (int i = 0; i < kGraphs; ++i) {
    slots.push_back(index_tensor({i}, kDLCUDA));
    REQUIRE(moecap_graph_begin(h, a) == MOECAP_OK);
    capture_layers(h, ids.get(), 1, a);
    commit(h, slots.back().get(), a);
    moecap_graph* g = nullptr;
    REQUIRE(moecap_graph_end(h, &g) == MOECAP_OK);
    graphs.push_back(g);
  }
  forward(ids, 3, 1);
  for (moecap_graph* g : graphs) REQUIRE(moecap_graph_launch(g, a) == MOECAP_OK);  // behind a long forward on a
  moecap_test::HostTensor eager_slot({1}, moecap_test::i64());
  eager_slot.set(0, 25);
  for (int i = 0; i < 16; ++i) commit(h, eager_slot.get(), b);
  std::vector<int64_t> which;
  for (int i = 0; i < kGraphs; ++i) which.push_back(i);
  const auto got = read_rows(h, which);
  for (size_t i = 0; i < kGraphs; ++i) CHECK(row_of(got, i) == expected_row(3, 0));
  for (moecap_graph* g : graphs) moecap_graph_destroy(g);
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("defect 4: a read into GPU tensors is ordered before a later moecap_write to the same slots") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 4, 1);
  capture_layers(h, ids.get(), 1, s);
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  slot.set(0, 2);
  commit(h, slot.get(), s);
  REQUIRE(moecap_synchronize(h) == MOECAP_OK);

  const moecap_config c = cuda_config();
  Tensor out({1, c.num_layers, c.top_k}, moecap_test::i64(), kDLCUDA);
  REQUIRE_MESSAGE(moecap_read(h, slot.get(), out.get(), nullptr, 0, s) == MOECAP_OK, std::string(moecap_last_error()));
  moecap_test::HostTensor reuse({1, c.num_layers, c.top_k}, moecap_test::i32());
  for (int64_t i = 0; i < reuse.numel(); ++i) reuse.set(i, 1);  // the slot is freed and reused
  REQUIRE_MESSAGE(moecap_write(h, slot.get(), reuse.get(), nullptr, nullptr) == MOECAP_OK, std::string(moecap_last_error()));
  standin_run_stream(s);
  CHECK(std::vector<int64_t>(out.as<int64_t>(), out.as<int64_t>() + c.num_layers * c.top_k) == expected_row(4, 0));
  CHECK(read_rows(h, {2}) == std::vector<int64_t>(static_cast<size_t>(c.num_layers * c.top_k), 1));
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("defect 5: moecap_graph_end on another thread than moecap_graph_begin") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  Tensor slots = index_tensor({4}, kDLCUDA);
  std::thread([&] {
    REQUIRE(moecap_graph_begin(h, s) == MOECAP_OK);
    capture_layers(h, ids.get(), 1, s);
    commit(h, slots.get(), s);
  }).join();
  moecap_graph* g = nullptr;
  CHECK_MESSAGE(moecap_graph_end(h, &g) == MOECAP_OK, std::string(moecap_last_error()));
  int status = -1;
  REQUIRE(driver().is_capturing(s, &status) == 0);
  CHECK(status == 0);  // the engine's stream is not left capturing
  if (g != nullptr) {
    forward(ids, 5, 1);
    REQUIRE(moecap_graph_launch(g, s) == MOECAP_OK);
    CHECK(read_rows(h, {4}) == expected_row(5, 0));
    moecap_graph_destroy(g);
  }
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("defect 6: a module the driver cannot load reports NO_DEVICE or DRIVER_TOO_OLD") {
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
TEST_CASE("defect 6: a driver older than the toolkit that built the kernels: DRIVER_TOO_OLD") {
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

TEST_CASE("defect 7: engine graphs holding moecap's nodes keep the capturer alive after moecap_destroy") {
  const int64_t violations = standin_violations();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  Tensor slots = index_tensor({6}, kDLCUDA);

  // The engine's own capture (torch.cuda.graph) with moecap's calls inside.
  moecap_capturer* h = make_capturer();
  REQUIRE(driver().begin_capture(s, kModeGlobal) == 0);
  capture_layers(h, ids.get(), 1, s);
  commit(h, slots.get(), s);
  Graph engine_graph = nullptr;
  REQUIRE(driver().end_capture(s, &engine_graph) == 0);
  Exec engine_exec = nullptr;
  REQUIRE(driver().instantiate(&engine_exec, engine_graph, 0) == 0);

  // moecap's own graph, embedded as a child node of an engine graph.
  REQUIRE(moecap_graph_begin(h, s) == MOECAP_OK);
  capture_layers(h, ids.get(), 1, s);
  commit(h, slots.get(), s);
  moecap_graph* own = nullptr;
  REQUIRE(moecap_graph_end(h, &own) == MOECAP_OK);
  void* native = nullptr;
  REQUIRE(moecap_graph_native(own, &native) == MOECAP_OK);
  Graph parent = nullptr;
  REQUIRE(driver().graph_create(&parent, 0) == 0);
  void* node = nullptr;
  REQUIRE(driver().add_child(&node, parent, nullptr, 0, static_cast<Graph>(native)) == 0);
  Exec parent_exec = nullptr;
  REQUIRE(driver().instantiate(&parent_exec, parent, 0) == 0);

  REQUIRE(moecap_graph_destroy(own) == MOECAP_OK);
  REQUIRE(moecap_destroy(h) == MOECAP_OK);
  forward(ids, 7, 1);
  REQUIRE(driver().launch(engine_exec, s) == 0);
  REQUIRE(driver().launch(parent_exec, s) == 0);
  REQUIRE(driver().stream_sync(s) == 0);
  CHECK_MESSAGE(standin_violations() == violations, std::string(standin_first_violation()));

  // The last graph gone, the capturer goes too, and not from the driver's callback thread.
  driver().exec_destroy(engine_exec);
  driver().graph_destroy(engine_graph);
  driver().exec_destroy(parent_exec);
  driver().graph_destroy(parent);
  standin_drain_callbacks();
  CHECK(standin_live_user_objects() == 0);
  CHECK_MESSAGE(standin_violations() == violations, std::string(standin_first_violation()));
}

namespace {

struct Replays {
  Exec exec;
  Stream stream;
  int launched = 0;
};

void replay_at_every_wait(void* arg) {
  auto* r = static_cast<Replays*>(arg);
  ++r->launched;
  driver().launch(r->exec, r->stream);
  standin_run_stream(r->stream);
}

}  // namespace

TEST_CASE("defect 8: get_errors(CLEAR) loses no count to replays in between") {
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

TEST_CASE("defect 9: duplicate slots in one commit: the last entry wins, in any kernel schedule") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 9, 3);
  capture_layers(h, ids.get(), 3, s);
  moecap_test::HostTensor host_slots({3}, moecap_test::i64());
  host_slots.fill<int64_t>({5, 6, 5});
  commit(h, host_slots.get(), s);
  Tensor device_slots = index_tensor({6, 7, 7}, kDLCUDA);
  commit(h, device_slots.get(), s);
  const auto got = read_rows(h, {5, 6, 7});
  CHECK(row_of(got, 0) == expected_row(9, 2));
  CHECK(row_of(got, 1) == expected_row(9, 0));
  CHECK(row_of(got, 2) == expected_row(9, 2));
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("defect 10: host waits block instead of spinning") {
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

TEST_CASE("defect 10: a non-blocking read waits only for the commits that wrote its slots") {
  moecap_capturer* h = make_capturer();
  Stream a = new_stream();
  Stream b = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 10, 1);
  capture_layers(h, ids.get(), 1, a);
  moecap_test::HostTensor done_slot({1}, moecap_test::i64());
  done_slot.set(0, 1);
  commit(h, done_slot.get(), a);
  standin_run_stream(a);
  moecap_test::HostTensor busy_slot({1}, moecap_test::i64());
  busy_slot.set(0, 2);
  commit(h, busy_slot.get(), b);  // another request's commit, still in flight
  CHECK(read_rows(h, {1}, MOECAP_OK, MOECAP_READ_NONBLOCKING) == expected_row(10, 0));
  read_rows(h, {2}, MOECAP_ERROR_NOT_READY, MOECAP_READ_NONBLOCKING);
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("defect 10: a read into GPU tensors orders on the stream instead of blocking the host") {
  moecap_capturer* h = make_capturer();
  Stream a = new_stream();
  Stream reader = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 11, 1);
  capture_layers(h, ids.get(), 1, a);
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  slot.set(0, 3);
  commit(h, slot.get(), a);
  const moecap_config c = cuda_config();
  Tensor out({1, c.num_layers, c.top_k}, moecap_test::i64(), kDLCUDA);
  REQUIRE_MESSAGE(moecap_read(h, slot.get(), out.get(), nullptr, 0, reader) == MOECAP_OK, std::string(moecap_last_error()));
  CHECK(standin_pending(a) > 0);  // the host did not wait for the commit
  standin_run_stream(reader);
  CHECK(std::vector<int64_t>(out.as<int64_t>(), out.as<int64_t>() + c.num_layers * c.top_k) == expected_row(11, 0));
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

namespace {

// While a read waits, another engine thread captures a layer: it must not
// wait for the read.
struct EagerCallMeanwhile {
  moecap_capturer* h;
  DLTensor* ids;
  Stream stream;
  std::thread other;
  std::atomic<bool> done{false};
  bool in_time = false;
  bool started = false;
};

void capture_meanwhile(void* arg) {
  auto* m = static_cast<EagerCallMeanwhile*>(arg);
  if (m->started) return;
  m->started = true;
  m->other = std::thread([m] {
    int64_t shape[2] = {1, cuda_config().top_k};
    DLTensor view = *m->ids;
    view.ndim = 2;
    view.shape = shape;
    moecap_capture(m->h, 0, &view, nullptr, m->stream);  // no doctest assertion off the test's thread
    m->done = true;
  });
  for (int i = 0; i < 200 && !m->done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  m->in_time = m->done;
}

}  // namespace

TEST_CASE("defect 10: a blocking read does not hold the capturer's lock while it waits") {
  moecap_capturer* h = make_capturer();
  Stream a = new_stream();
  Stream other = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 12, 1);
  capture_layers(h, ids.get(), 1, a);
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  slot.set(0, 4);
  commit(h, slot.get(), a);  // read waits for it
  EagerCallMeanwhile m{h, ids.get(), other};
  standin_set_wait_hook(capture_meanwhile, &m);
  CHECK(read_rows(h, {4}) == expected_row(12, 0));
  standin_set_wait_hook(nullptr, nullptr);
  if (m.other.joinable()) m.other.join();
  CHECK(m.started);
  CHECK(m.in_time);
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

// Issue 11 on the CUDA backend: slots fail closed. Nothing runs until a host
// wait, so a read that did not wait for an invalidation would see the rows.
TEST_CASE("slots fail closed on the CUDA backend: never committed, invalidated (eagerly and by replays) read -1") {
  const int64_t violations = standin_violations();
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 11, 4);
  capture_layers(h, ids.get(), 4, s);
  moecap_test::HostTensor slots({4}, moecap_test::i64());
  slots.fill<int64_t>({1, 2, 3, 4});
  commit(h, slots.get(), s);
  const std::vector<int64_t> none(expected_row(11, 0).size(), -1);
  auto rows = read_rows(h, {1, kNever});
  CHECK(row_of(rows, 0) == expected_row(11, 0));
  CHECK(row_of(rows, 1) == none);  // never committed

  // Freed KV: slot 1 from pageable host memory (staged), slot 2 from device memory.
  moecap_test::HostTensor freed_host({1}, moecap_test::i64());
  freed_host.fill<int64_t>({1});
  Tensor freed_dev = index_tensor({2, -1}, kDLCUDA);
  REQUIRE(moecap_invalidate(h, freed_host.get(), s) == MOECAP_OK);
  REQUIRE(moecap_invalidate(h, freed_dev.get(), s) == MOECAP_OK);
  rows = read_rows(h, {1, 2, 3});
  CHECK(row_of(rows, 0) == none);
  CHECK(row_of(rows, 1) == none);
  CHECK(row_of(rows, 2) == expected_row(11, 2));
  read_rows(h, {1}, MOECAP_ERROR_NO_ROUTING, MOECAP_READ_STRICT);

  // A moecap graph that commits and then invalidates, replayed with new slots.
  Tensor gslots = index_tensor({0, 0}, kDLCUDA);
  Tensor gfreed = index_tensor({0}, kDLCUDA);
  REQUIRE(moecap_graph_begin(h, s) == MOECAP_OK);
  capture_layers(h, ids.get(), 2, s);
  commit(h, gslots.get(), s);
  REQUIRE(moecap_invalidate(h, gfreed.get(), s) == MOECAP_OK);
  moecap_graph* g = nullptr;
  REQUIRE(moecap_graph_end(h, &g) == MOECAP_OK);
  for (int64_t step = 0; step < 3; ++step) {
    forward(ids, 20 + step, 2);
    gslots.as<int64_t>()[0] = 10 + step;
    gslots.as<int64_t>()[1] = 20 + step;
    gfreed.as<int64_t>()[0] = step == 0 ? 3 : 19 + step;  // the previous replay's second slot
    REQUIRE(moecap_graph_launch(g, s) == MOECAP_OK);
    REQUIRE(driver().stream_sync(s) == 0);  // the engine reuses its buffers after the step
  }
  rows = read_rows(h, {3, 20, 21, 22, 12});
  CHECK(row_of(rows, 0) == none);  // invalidated by the first replay
  CHECK(row_of(rows, 1) == none);  // by the second
  CHECK(row_of(rows, 2) == none);  // by the third
  CHECK(row_of(rows, 3) == expected_row(22, 1));
  CHECK(row_of(rows, 4) == expected_row(22, 0));
  REQUIRE(moecap_graph_destroy(g) == MOECAP_OK);
  CHECK(moecap_destroy(h) == MOECAP_OK);
  CHECK_MESSAGE(standin_violations() == violations, std::string(standin_first_violation()));
}

TEST_CASE("a top-k kernel writing the CUDA backend's int16 layer views: commit narrows and checks them") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  const moecap_config c = cuda_config();
  for (int32_t layer = 0; layer < c.num_layers; ++layer) {
    DLManagedTensorVersioned* v = nullptr;
    REQUIRE(moecap_export(h, MOECAP_BUFFER_LAYER_IDS, layer, &v) == MOECAP_OK);
    REQUIRE(v->dl_tensor.device.device_type == kDLCUDA);
    REQUIRE(v->dl_tensor.dtype.bits == 16);
    REQUIRE(v->dl_tensor.strides[0] == c.top_k);
    auto* out = static_cast<int16_t*>(v->dl_tensor.data);  // the stand-in's device memory is host memory
    for (int64_t t = 0; t < 3; ++t)
      for (int32_t k = 0; k < c.top_k; ++k) out[t * c.top_k + k] = static_cast<int16_t>(expert(30, t, layer, k));
    if (layer == 1) out[2 * c.top_k] = 999;  // token 2: a bad id from the kernel
    v->deleter(v);
  }
  moecap_test::HostTensor slots({3}, moecap_test::i64());
  slots.fill<int64_t>({5, 6, 7});
  commit(h, slots.get(), s);
  const auto rows = read_rows(h, {5, 6, 7});
  CHECK(row_of(rows, 0) == expected_row(30, 0));
  CHECK(row_of(rows, 1) == expected_row(30, 1));
  std::vector<int64_t> bad = expected_row(30, 2);
  bad[static_cast<size_t>(c.top_k)] = -1;  // exactly the bad id (u8 has a spare value with 8 experts)
  CHECK(row_of(rows, 2) == bad);
  read_rows(h, {7}, MOECAP_ERROR_NO_ROUTING, MOECAP_READ_STRICT);
  CHECK(moecap_destroy(h) == MOECAP_OK);
}
