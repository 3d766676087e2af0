// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's host waits and teardown on the stand-in driver, where
// its hooks show them: host waits that never hold the capturer's lock,
// teardown during an engine's global capture on another thread, and graph
// commit events freed with their graphs.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "tests/cuda_standin/engine.h"

using namespace standin;
using namespace moecap_scenarios;

// MOECAP_LIBCUDA names the stand-in: set for the whole binary by test_scenarios.cpp.
namespace {

std::vector<int64_t> device_row(Tensor& out) {
  const moecap_config c = cuda_config();
  return std::vector<int64_t>(out.as<int64_t>(), out.as<int64_t>() + c.num_layers * c.top_k);
}

// One slot's row as a GPU tensor (int64 [1, layers, top_k]).
Tensor gpu_row() {
  const moecap_config c = cuda_config();
  return Tensor({1, c.num_layers, c.top_k}, moecap_test::i64(), kDLCUDA);
}

// Forward `token`'s routing committed to `slot` and landed, then a read of
// the slot into `out` (a GPU tensor) queued on `s`, not yet run.
void queue_gpu_read(moecap_capturer* h, Stream s, Tensor& ids, moecap_test::HostTensor& slot, int token,
                    Tensor& out) {
  forward(ids, token, 1);
  capture_layers(h, ids.get(), 1, s);
  commit(h, slot.get(), s);
  REQUIRE(moecap_synchronize(h) == MOECAP_OK);
  REQUIRE(moecap_read(h, slot.get(), out.get(), nullptr, 0, s) == MOECAP_OK);
}

// Waits until the capturer's memory (its device and pinned blocks, claims,
// snapshot ring: four allocations) is freed, by whichever thread releases it.
void wait_until_freed(int64_t held) {
  for (int i = 0; i < 200 && standin_live_allocations() > held - 4; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(standin_live_allocations() <= held - 4);
}

// After the capturer was released during the engine's global capture: its
// memory freed, the engine's capture not invalidated, no rule broken.
void check_freed_during_engine_capture(Stream engine, int64_t held, int64_t violations) {
  standin_drain_callbacks();
  wait_until_freed(held);
  Graph captured = nullptr;
  CHECK(driver().end_capture(engine, &captured) == 0);  // not invalidated
  if (captured != nullptr) driver().graph_destroy(captured);
  CHECK_MESSAGE(standin_violations() == violations, std::string(standin_first_violation()));
}

// A new capturer whose capture and commit the engine's global-mode capture on
// `s` records into *graph (the graph then holds the capturer).
moecap_capturer* record_into_engine_graph(Stream s, Tensor& ids, Tensor& slots, Graph* graph) {
  moecap_capturer* h = make_capturer();
  REQUIRE(driver().begin_capture(s, kModeGlobal) == 0);
  capture_layers(h, ids.get(), 1, s);
  commit(h, slots.get(), s);
  REQUIRE(driver().end_capture(s, graph) == 0);
  return h;
}

}  // namespace

TEST_CASE("get_errors waiting for commits does not hold the capturer's lock") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 43, 1);
  capture_layers(h, ids.get(), 1, s);
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  slot.set(0, 3);
  commit(h, slot.get(), s);  // get_errors waits for it
  CHECK(other_calls_proceed(h, ids, [&] {
    moecap_error_counts e{};
    e.struct_size = sizeof e;
    CHECK(moecap_get_errors(h, &e, MOECAP_ERRORS_CLEAR) == MOECAP_OK);
  }));
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("get_errors and a GPU read with no commit in flight copy from the GPU without the capturer's lock") {
  // Their only host waits are on moecap's own stream (the counters, and with
  // guards their bytes), which a busy GPU can hold up as long as a commit.
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  slot.set(0, 5);
  forward(ids, 45, 1);
  capture_layers(h, ids.get(), 1, s);
  commit(h, slot.get(), s);
  REQUIRE(moecap_synchronize(h) == MOECAP_OK);
  moecap_error_counts e{};
  e.struct_size = sizeof e;
  e.skipped_rows = 7;
  CHECK(other_calls_proceed(h, ids, [&] { CHECK(moecap_get_errors(h, &e, MOECAP_ERRORS_CLEAR) == MOECAP_OK); }));
  CHECK(e.skipped_rows == 0);
  CHECK(e.invalid_ids == 0);
  Tensor out = gpu_row();
  CHECK(other_calls_proceed(h, ids, [&] { CHECK(moecap_read(h, slot.get(), out.get(), nullptr, 0, s) == MOECAP_OK); }));
  standin_run_stream(s);
  CHECK(device_row(out) == expected_row(45, 0));
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("write waiting for a GPU read and for the engine's stream does not hold the capturer's lock") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  slot.set(0, 4);
  Tensor out = gpu_row();
  queue_gpu_read(h, s, ids, slot, 44, out);  // write waits for it
  const moecap_config c = cuda_config();
  moecap_test::HostTensor reuse({1, c.num_layers, c.top_k}, moecap_test::i32());
  for (int64_t i = 0; i < reuse.numel(); ++i) reuse.set(i, 1);
  CHECK(other_calls_proceed(h, ids, [&] {
    CHECK(moecap_write(h, slot.get(), reuse.get(), nullptr, nullptr) == MOECAP_OK);
  }));
  CHECK(device_row(out) == expected_row(44, 0));

  // Device inputs: write waits for the engine's stream before copying them.
  Tensor device_in({1, c.num_layers, c.top_k}, moecap_test::i32(), kDLCUDA);
  for (int64_t i = 0; i < c.num_layers * c.top_k; ++i) device_in.as<int32_t>()[i] = 2;
  capture_layers(h, ids.get(), 1, s);  // the engine's stream has work queued
  CHECK(other_calls_proceed(h, ids, [&] {
    CHECK(moecap_write(h, slot.get(), device_in.get(), nullptr, s) == MOECAP_OK);
  }));
  CHECK(read_rows(h, {4}) == std::vector<int64_t>(static_cast<size_t>(c.num_layers * c.top_k), 2));
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("a commit waiting for a snapshot-ring entry still in use does not hold the capturer's lock") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  // Eight eager commits with host slots fill the ring; none has run.
  for (int i = 0; i < 8; ++i) {
    slot.set(0, i);
    commit(h, slot.get(), s);
  }
  REQUIRE(standin_pending(s) > 0);
  slot.set(0, 8);
  CHECK(other_calls_proceed(h, ids, [&] { commit(h, slot.get(), s); }));  // waits for the first entry
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("moecap_destroy and moecap_graph_destroy on one thread during the engine's global capture on another") {
  const int64_t violations = standin_violations();
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Stream engine = new_stream();
  Tensor ids = routing_buffer();
  Tensor slots = index_tensor({5}, kDLCUDA);
  moecap_graph* g = record_commit_graph(h, ids.get(), 1, slots.get(), s);

  standin_drain_callbacks();
  const int64_t held = standin_live_allocations();
  REQUIRE(driver().begin_capture(engine, kModeGlobal) == 0);  // torch.cuda.graph's default mode
  moecap_status destroyed_graph = MOECAP_OK, destroyed = MOECAP_OK;
  std::thread([&] {
    destroyed = moecap_destroy(h);
    destroyed_graph = moecap_graph_destroy(g);  // the capturer goes with the graph's last hold
  }).join();
  CHECK(destroyed_graph == MOECAP_OK);
  CHECK(destroyed == MOECAP_OK);
  check_freed_during_engine_capture(engine, held, violations);
}

TEST_CASE("the thread releasing a graph's last hold on the capturer frees it during the engine's global capture") {
  const int64_t violations = standin_violations();
  Stream s = new_stream();
  Stream engine = new_stream();
  Tensor ids = routing_buffer();
  Tensor slots = index_tensor({6}, kDLCUDA);
  Graph graph = nullptr;
  moecap_capturer* h = record_into_engine_graph(s, ids, slots, &graph);
  Exec exec = nullptr;
  REQUIRE(driver().instantiate(&exec, graph, 0) == 0);
  REQUIRE(moecap_destroy(h) == MOECAP_OK);  // the graph and its exec hold the capturer now
  standin_drain_callbacks();
  const int64_t held = standin_live_allocations();

  REQUIRE(driver().begin_capture(engine, kModeGlobal) == 0);  // another engine thread captures
  std::thread([&] {
    driver().exec_destroy(exec);
    driver().graph_destroy(graph);
  }).join();
  check_freed_during_engine_capture(engine, held, violations);
}

TEST_CASE("the events of commits captured in graphs are freed with the graphs") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  Tensor slots = index_tensor({7}, kDLCUDA);
  REQUIRE(moecap_synchronize(h) == MOECAP_OK);
  const int64_t events = standin_live_events();
  constexpr int kRecaptures = 30;
  for (int i = 0; i < kRecaptures; ++i) {
    // moecap's own graphs and the engine's (cudagraph trees recapture often).
    moecap_graph* g = record_commit_graph(h, ids.get(), 1, slots.get(), s);
    forward(ids, 50 + i, 1);
    REQUIRE(moecap_graph_launch(g, s) == MOECAP_OK);
    CHECK(read_rows(h, {7}) == expected_row(50 + i, 0));
    REQUIRE(moecap_graph_destroy(g) == MOECAP_OK);

    REQUIRE(driver().begin_capture(s, kModeGlobal) == 0);
    capture_layers(h, ids.get(), 1, s);
    commit(h, slots.get(), s);
    Graph graph = nullptr;
    REQUIRE(driver().end_capture(s, &graph) == 0);
    Exec exec = nullptr;
    REQUIRE(driver().instantiate(&exec, graph, 0) == 0);
    REQUIRE(driver().launch(exec, s) == 0);
    REQUIRE(driver().stream_sync(s) == 0);
    driver().exec_destroy(exec);
    driver().graph_destroy(graph);
  }
  // A released graph's hold is deleted on a thread of moecap's (no CUDA call
  // may run on the driver's callback thread), so its events go a moment later.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  do {
    standin_drain_callbacks();
    REQUIRE(moecap_synchronize(h) == MOECAP_OK);
    if (standin_live_events() <= events + 2) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  } while (std::chrono::steady_clock::now() < deadline);
  CHECK(standin_live_events() <= events + 2);  // not one per captured commit

  // A graph still alive is still waited for.
  moecap_graph* g = record_commit_graph(h, ids.get(), 1, slots.get(), s);
  forward(ids, 90, 1);
  REQUIRE(moecap_graph_launch(g, s) == MOECAP_OK);
  standin_drain_callbacks();
  CHECK(read_rows(h, {7}) == expected_row(90, 0));
  REQUIRE(moecap_graph_destroy(g) == MOECAP_OK);
  CHECK(moecap_destroy(h) == MOECAP_OK);
}


TEST_CASE("moecap_destroy lets a read into a GPU tensor still queued on the engine's stream finish first") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  slot.set(0, 5);
  Tensor out = gpu_row();
  const int64_t violations = standin_violations();
  queue_gpu_read(h, s, ids, slot, 45, out);
  REQUIRE(standin_pending(s) > 0);  // the gather has not run
  CHECK(moecap_destroy(h) == MOECAP_OK);  // frees the pinned cache the gather reads, and its module
  standin_run_stream(s);
  CHECK_MESSAGE(standin_violations() == violations, std::string(standin_first_violation()));
  CHECK(device_row(out) == expected_row(45, 0));
}

TEST_CASE("moecap_destroy lets captures and a histogram reset still queued on the engine's streams run first") {
  // A request dropped after its forward: captures with no commit behind
  // them, on two streams, then the capturer is destroyed. The kernels write
  // the device memory destroy frees.
  moecap_config c = cuda_config();
  c.flags |= MOECAP_FLAG_HISTOGRAM;
  moecap_capturer* h = nullptr;
  REQUIRE(moecap_create(&c, &h) == MOECAP_OK);
  Stream s = new_stream();
  Stream other = new_stream();
  Tensor ids = routing_buffer();
  const int64_t violations = standin_violations();
  forward(ids, 46, 1);
  capture_layers(h, ids.get(), 1, s);
  REQUIRE(moecap_histogram_reset(h, other) == MOECAP_OK);
  capture_layers(h, ids.get(), 1, other);
  REQUIRE(standin_pending(s) > 0);
  REQUIRE(standin_pending(other) > 0);
  CHECK(moecap_destroy(h) == MOECAP_OK);
  CHECK(standin_pending(s) == 0);
  CHECK(standin_pending(other) == 0);
  standin_run_stream(s);
  standin_run_stream(other);
  CHECK_MESSAGE(standin_violations() == violations, std::string(standin_first_violation()));
}

// While moecap_synchronize waits (without the lock) on the first commit's
// event, another engine thread's commit takes that event, now completed,
// from the pool, and the driver refuses its launch.
struct RefusedCommitMeanwhile {
  moecap_capturer* h = nullptr;
  Stream stream = nullptr;
  Tensor* ids = nullptr;
  moecap_test::HostTensor* slot = nullptr;
  std::thread::id caller = std::this_thread::get_id();
  bool started = false;
  moecap_status status = MOECAP_OK;
};

void refuse_a_commit_while_waiting(void* arg) {
  auto* m = static_cast<RefusedCommitMeanwhile*>(arg);
  if (std::this_thread::get_id() != m->caller || m->started) return;
  m->started = true;
  std::thread([m] {
    standin_run_stream(m->stream);  // the first commit's event completes: the next commit retires it to the pool
    forward(*m->ids, 48, 1);
    capture_layers(m->h, m->ids->get(), 1, m->stream);
    standin_fail_next_launch("moecap_commit_kernel", 999);  // CUDA_ERROR_UNKNOWN
    moecap_commit_args a{};
    a.struct_size = sizeof a;
    a.dst_slots = m->slot->get();
    m->status = moecap_commit(m->h, &a, m->stream);
  }).join();
}

TEST_CASE("a commit the driver refuses keeps its pooled event, which another thread's host wait holds") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  slot.set(0, 4);
  forward(ids, 47, 1);
  capture_layers(h, ids.get(), 1, s);
  commit(h, slot.get(), s);
  const int64_t violations = standin_violations();
  RefusedCommitMeanwhile m;
  m.h = h;
  m.stream = s;
  m.ids = &ids;
  m.slot = &slot;
  standin_set_wait_hook(refuse_a_commit_while_waiting, &m);
  const moecap_status waited = moecap_synchronize(h);  // then waits on the event it copied before
  standin_set_wait_hook(nullptr, nullptr);
  REQUIRE(m.started);
  CHECK(m.status == MOECAP_ERROR_DRIVER);
  CHECK_MESSAGE(waited == MOECAP_OK, std::string(moecap_last_error()));
  CHECK_MESSAGE(standin_violations() == violations, std::string(standin_first_violation()));
  // The capturer goes on: the same rows commit.
  commit(h, slot.get(), s);
  REQUIRE(moecap_synchronize(h) == MOECAP_OK);
  CHECK(read_rows(h, {4}) == expected_row(48, 0));
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

// Arms a refusal of the next gather launch at the first host wait with work
// queued on `stream`: a read's piece waiting for a snapshot entry in use.
struct RefuseAtRingWait {
  Stream stream = nullptr;
  bool armed = false;
};

void refuse_next_gather(void* arg) {
  auto* r = static_cast<RefuseAtRingWait*>(arg);
  if (r->armed || standin_pending(r->stream) == 0) return;
  r->armed = true;
  standin_fail_next_launch("moecap_gather_kernel", 999);  // CUDA_ERROR_UNKNOWN
}

TEST_CASE("a GPU read refused partway is tracked: destroy waits for the pieces it queued") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  moecap_plan_info info{};
  info.struct_size = sizeof info;
  REQUIRE(moecap_get_plan(h, &info) == MOECAP_OK);
  const moecap_config c = cuda_config();
  // A snapshot entry holds 2 * device_rows slots, the ring 8 entries: the ninth piece waits for the first.
  const int64_t n = 8 * 2 * info.device_rows + 1;
  moecap_test::HostTensor slots({n}, moecap_test::i64());
  for (int64_t i = 0; i < n; ++i) slots.set(i, i % c.host_slots);
  Tensor out({n, c.num_layers, c.top_k}, moecap_test::i32(), kDLCUDA);
  const int64_t violations = standin_violations();
  RefuseAtRingWait r;
  r.stream = s;
  standin_set_wait_hook(refuse_next_gather, &r);
  const moecap_status status = moecap_read(h, slots.get(), out.get(), nullptr, 0, s);
  standin_set_wait_hook(nullptr, nullptr);
  REQUIRE(r.armed);
  CHECK(status == MOECAP_ERROR_DRIVER);
  REQUIRE(standin_pending(s) > 0);  // the pieces before the refused one, not yet run
  CHECK(moecap_destroy(h) == MOECAP_OK);  // frees the pinned cache they gather from, after them
  standin_run_stream(s);
  CHECK_MESSAGE(standin_violations() == violations, std::string(standin_first_violation()));
}

// At the first host wait on the test's thread with work queued on `stream`
// (any when null), another thread runs `call`: it may take the capturer's
// lock only where the waiting call let go of it, so it is not joined here.
struct CallAtWait {
  std::function<void()> call;
  Stream stream = nullptr;
  int skip = 0;  // qualifying waits to let pass first
  std::thread::id caller = std::this_thread::get_id();
  bool started = false;
  std::atomic<bool> done{false};
  std::thread other;
};

void call_at_wait(void* arg) {
  auto* m = static_cast<CallAtWait*>(arg);
  if (std::this_thread::get_id() != m->caller || m->started) return;
  if (m->stream != nullptr && standin_pending(m->stream) == 0) return;
  if (m->skip > 0) {
    --m->skip;
    return;
  }
  m->started = true;
  m->other = std::thread([m] {
    m->call();
    m->done = true;
  });
  for (int i = 0; i < 200 && !m->done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

TEST_CASE("a commit made while a long GPU read waits for the snapshot ring lands between its pieces") {
  // A read of 8 * 2 * device_rows + 1 slots goes in nine pieces, the ninth
  // waiting for the first's snapshot entry. Slot 2 is gathered by the second
  // piece, queued before the commit; slot 3 by the ninth, queued after it.
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Stream other = new_stream();
  moecap_plan_info info{};
  info.struct_size = sizeof info;
  REQUIRE(moecap_get_plan(h, &info) == MOECAP_OK);
  const moecap_config c = cuda_config();
  Tensor ids = routing_buffer();
  moecap_test::HostTensor old_slots({4}, moecap_test::i64());
  for (int64_t i = 0; i < 4; ++i) old_slots.set(i, i);
  forward(ids, 80, 4);
  capture_layers(h, ids.get(), 4, other);
  commit(h, old_slots.get(), other);
  REQUIRE(moecap_synchronize(h) == MOECAP_OK);
  forward(ids, 81, 4);
  capture_layers(h, ids.get(), 4, other);  // queued, not run: the commit below takes these rows
  Tensor new_slots = index_tensor({0, 1, 2, 3}, kDLCUDA);
  const int64_t per_piece = 2 * info.device_rows;
  const int64_t n = 8 * per_piece + 1;
  moecap_test::HostTensor slots({n}, moecap_test::i64());
  for (int64_t i = 0; i < n; ++i) slots.set(i, 4 + i % (c.host_slots - 4));
  slots.set(per_piece, 2);
  slots.set(n - 1, 3);
  Tensor out({n, c.num_layers, c.top_k}, moecap_test::i64(), kDLCUDA);
  CallAtWait m;  // at the ninth piece's wait for a snapshot entry, the first with work queued on s
  moecap_status committed = MOECAP_ERROR_INTERNAL;
  m.call = [&] {
    moecap_commit_args a{};
    a.struct_size = sizeof a;
    a.dst_slots = new_slots.get();
    committed = moecap_commit(h, &a, other);  // device slots: the commit itself does not wait on the host
  };
  m.stream = s;
  standin_set_wait_hook(call_at_wait, &m);
  const moecap_status read = moecap_read(h, slots.get(), out.get(), nullptr, 0, s);
  standin_set_wait_hook(nullptr, nullptr);
  REQUIRE(m.started);
  m.other.join();
  REQUIRE(committed == MOECAP_OK);
  REQUIRE_MESSAGE(read == MOECAP_OK, std::string(moecap_last_error()));
  const auto row = [&](int64_t i) {
    const int64_t w = c.num_layers * c.top_k;
    return std::vector<int64_t>(out.as<int64_t>() + i * w, out.as<int64_t>() + (i + 1) * w);
  };
  SUBCASE("the commit's stream runs first: it waits for the pieces queued before it") {
    standin_run_stream(other);
    standin_run_stream(s);
    CHECK(row(per_piece) == expected_row(80, 2));
    CHECK(row(n - 1) == expected_row(81, 3));
  }
  SUBCASE("the read's stream runs first: the piece queued after the commit waits for it") {
    standin_run_stream(s);
    standin_run_stream(other);
    CHECK(row(per_piece) == expected_row(80, 2));
    CHECK(row(n - 1) == expected_row(81, 3));
  }
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("a graph recording begun on a GPU read's stream while the read waits refuses the rest of the read") {
  // Both of a GPU read's host waits let go of the capturer's lock: the copy of
  // the error counters, and a snapshot entry in use. A gather queued after
  // another thread began recording on the stream would be a node of its graph.
  moecap_capturer* h = make_capturer();
  moecap_plan_info info{};
  info.struct_size = sizeof info;
  REQUIRE(moecap_get_plan(h, &info) == MOECAP_OK);
  const moecap_config c = cuda_config();
  Tensor ids = routing_buffer();
  moecap_test::HostTensor one({1}, moecap_test::i64());
  one.set(0, 5);
  forward(ids, 45, 1);
  capture_layers(h, ids.get(), 1, new_stream());
  commit(h, one.get(), nullptr);
  REQUIRE(moecap_synchronize(h) == MOECAP_OK);
  const int64_t long_read = 8 * 2 * info.device_rows + 1;  // its ninth piece waits for the ring
  for (const int64_t n : {int64_t{1}, long_read}) {
    CAPTURE(n);
    Stream s = new_stream();
    moecap_test::HostTensor slots({n}, moecap_test::i64());
    for (int64_t i = 0; i < n; ++i) slots.set(i, 5);
    Tensor out({n, c.num_layers, c.top_k}, moecap_test::i64(), kDLCUDA);
    CallAtWait m;
    moecap_status begun = MOECAP_ERROR_INTERNAL;
    m.call = [&] { begun = moecap_graph_begin(h, s); };
    m.stream = n == 1 ? nullptr : s;
    standin_set_wait_hook(call_at_wait, &m);
    const moecap_status read = moecap_read(h, slots.get(), out.get(), nullptr, 0, s);
    standin_set_wait_hook(nullptr, nullptr);
    REQUIRE(m.started);
    m.other.join();
    REQUIRE(begun == MOECAP_OK);
    CHECK(read == MOECAP_ERROR_CAPTURE_ILLEGAL);
    moecap_graph* g = nullptr;
    REQUIRE_MESSAGE(moecap_graph_end(h, &g) == MOECAP_OK, std::string(moecap_last_error()));
    moecap_graph_destroy(g);
    // The capturer goes on: the pieces queued before the recording are tracked, nothing of the read was recorded.
    standin_run_stream(s);
    forward(ids, 46, 1);
    capture_layers(h, ids.get(), 1, s);
    commit(h, one.get(), s);
    REQUIRE(moecap_synchronize(h) == MOECAP_OK);
    CHECK(read_rows(h, {5}) == expected_row(46, 0));
    forward(ids, 45, 1);
    capture_layers(h, ids.get(), 1, s);
    commit(h, one.get(), s);
    REQUIRE(moecap_synchronize(h) == MOECAP_OK);
  }
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

// Eight eager commits with host slots queued on `q` and not run: every
// snapshot entry is in use, and the next call that needs one waits for q.
void fill_the_snapshot_ring(moecap_capturer* h, Stream q) {
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  for (int i = 0; i < 8; ++i) {
    slot.set(0, 20 + i);
    commit(h, slot.get(), q);
  }
  REQUIRE(standin_pending(q) > 0);
}

TEST_CASE("a graph recording begun on a commit's stream while it waits for the snapshot ring refuses the commit") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Stream q = new_stream();
  Tensor ids = routing_buffer();
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  slot.set(0, 6);
  fill_the_snapshot_ring(h, q);
  for (const bool invalidate : {false, true}) {
    CAPTURE(invalidate);
    if (invalidate) fill_the_snapshot_ring(h, q);
    CallAtWait m;
    moecap_status begun = MOECAP_ERROR_INTERNAL;
    m.call = [&] { begun = moecap_graph_begin(h, s); };
    m.stream = q;
    standin_set_wait_hook(call_at_wait, &m);
    moecap_commit_args a{};
    a.struct_size = sizeof a;
    a.dst_slots = slot.get();
    const moecap_status called = invalidate ? moecap_invalidate(h, slot.get(), s) : moecap_commit(h, &a, s);
    standin_set_wait_hook(nullptr, nullptr);
    REQUIRE(m.started);
    m.other.join();
    REQUIRE(begun == MOECAP_OK);
    CHECK(called == MOECAP_ERROR_CAPTURE_ILLEGAL);
    moecap_graph* g = nullptr;
    REQUIRE_MESSAGE(moecap_graph_end(h, &g) == MOECAP_OK, std::string(moecap_last_error()));
    moecap_graph_destroy(g);
    standin_run_all();
    // The capturer goes on: nothing of the refused call was queued or recorded.
    forward(ids, 48, 1);
    capture_layers(h, ids.get(), 1, s);
    commit(h, slot.get(), s);
    REQUIRE_MESSAGE(moecap_synchronize(h) == MOECAP_OK, std::string(moecap_last_error()));
    CHECK(read_rows(h, {6}) == expected_row(48, 0));
  }
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("a GPU read waiting for the snapshot ring before its first piece stays listed while others retire") {
  // Its event is not yet recorded, so it reads as finished: a commit from
  // another thread meanwhile retires the finished reads, and must leave this
  // one, which the read goes on using (a use after free under ASan).
  const int64_t violations = standin_violations();
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Stream q = new_stream();
  Stream other = new_stream();
  Tensor ids = routing_buffer();
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  slot.set(0, 7);
  forward(ids, 49, 1);
  capture_layers(h, ids.get(), 1, s);
  commit(h, slot.get(), s);
  REQUIRE(moecap_synchronize(h) == MOECAP_OK);
  fill_the_snapshot_ring(h, q);
  Tensor device_slot = index_tensor({9}, kDLCUDA);
  CallAtWait m;
  moecap_status committed = MOECAP_ERROR_INTERNAL;
  m.call = [&] {
    moecap_commit_args a{};
    a.struct_size = sizeof a;
    a.dst_slots = device_slot.get();
    committed = moecap_commit(h, &a, other);  // device slots: no snapshot entry, no wait
  };
  m.stream = q;
  m.skip = 2;  // the read's copy of the error counters (the copy, then its stream); then its wait for a snapshot entry
  Tensor out = gpu_row();
  standin_set_wait_hook(call_at_wait, &m);
  const moecap_status read = moecap_read(h, slot.get(), out.get(), nullptr, 0, s);
  standin_set_wait_hook(nullptr, nullptr);
  REQUIRE(m.started);
  m.other.join();
  CHECK(committed == MOECAP_OK);
  CHECK(read == MOECAP_OK);
  standin_run_all();
  CHECK(device_row(out) == expected_row(49, 0));
  CHECK(moecap_destroy(h) == MOECAP_OK);
  CHECK_MESSAGE(standin_violations() == violations, std::string(standin_first_violation()));
}

TEST_CASE("moecap_destroy whose wait for reads fails still waits for the captures queued before it frees") {
  const int64_t violations = standin_violations();
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Stream engine = new_stream();
  Tensor ids = routing_buffer();
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  slot.set(0, 5);
  Tensor out = gpu_row();
  REQUIRE(moecap_read(h, slot.get(), out.get(), nullptr, 0, s) == MOECAP_OK);
  standin_run_stream(s);  // the read ran; destroy still waits for its event, listed until the next retire
  forward(ids, 47, 1);
  capture_layers(h, ids.get(), 1, engine);
  REQUIRE(standin_pending(engine) > 0);
  standin_fail_next_event_sync(999);  // CUDA_ERROR_UNKNOWN, at the wait for the read
  CHECK(moecap_destroy(h) == MOECAP_OK);
  CHECK(standin_pending(engine) == 0);  // it waited for the captures that write its device memory
  standin_run_stream(engine);
  CHECK_MESSAGE(standin_violations() == violations, std::string(standin_first_violation()));
}

TEST_CASE("moecap_synchronize waits for captures queued on the engine's stream; get_errors only for commits") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 49, 1);
  capture_layers(h, ids.get(), 1, s);
  REQUIRE(standin_pending(s) > 0);
  moecap_error_counts e{};
  e.struct_size = sizeof e;
  REQUIRE(moecap_get_errors(h, &e, 0) == MOECAP_OK);  // a monitor does not wait out the forward
  CHECK(standin_pending(s) > 0);
  REQUIRE(moecap_synchronize(h) == MOECAP_OK);
  CHECK(standin_pending(s) == 0);
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("a commit with device slots refused after its claim pass withdraws the claims: later commits land") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  Tensor two_slots = index_tensor({5, 4}, kDLCUDA);
  forward(ids, 60, 2);
  capture_layers(h, ids.get(), 2, s);
  standin_fail_next_launch("moecap_commit_kernel", 999);  // CUDA_ERROR_UNKNOWN, after the claim pass
  commit(h, two_slots.get(), s, 0, MOECAP_ERROR_DRIVER);
  REQUIRE(moecap_synchronize(h) == MOECAP_OK);  // the claim pass queued is waited for, as a commit
  // Slot 4 was claimed by entry 1; the next commit's entry 0 takes it.
  Tensor one_slot = index_tensor({4}, kDLCUDA);
  forward(ids, 61, 1);
  capture_layers(h, ids.get(), 1, s);
  commit(h, one_slot.get(), s);
  REQUIRE(moecap_synchronize(h) == MOECAP_OK);
  CHECK(read_rows(h, {4}) == expected_row(61, 0));
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("moecap_destroy waits for captures queued on each thread's own CU_STREAM_PER_THREAD") {
  // One handle, a different stream on each thread: the captures one thread
  // queued are not covered by a fence another thread's stream recorded.
  moecap_capturer* h = make_capturer();
  Tensor ids = routing_buffer();
  forward(ids, 62, 1);
  void* const per_thread = reinterpret_cast<void*>(uintptr_t{2});
  const int64_t violations = standin_violations();
  std::promise<void> destroyed;
  const std::shared_future<void> after_destroy = destroyed.get_future().share();
  std::atomic<int> queued{0};
  std::array<moecap_status, 2> captured{};
  std::array<int64_t, 2> pending_before{}, pending_after{};
  std::vector<std::thread> threads;
  for (size_t t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {  // no doctest assertion off the test's thread
      int64_t shape[2] = {1, cuda_config().top_k};
      DLTensor view = *ids.get();
      view.ndim = 2;
      view.shape = shape;
      captured[t] = moecap_capture(h, 0, &view, nullptr, per_thread);
      pending_before[t] = standin_pending(static_cast<StandinStream>(per_thread));
      ++queued;
      after_destroy.wait();
      pending_after[t] = standin_pending(static_cast<StandinStream>(per_thread));
    });
    while (queued.load() < static_cast<int>(t) + 1) std::this_thread::yield();  // one after the other
  }
  CHECK(moecap_destroy(h) == MOECAP_OK);
  destroyed.set_value();
  for (std::thread& t : threads) t.join();
  for (size_t t = 0; t < 2; ++t) {
    CAPTURE(t);
    CHECK(captured[t] == MOECAP_OK);
    CHECK(pending_before[t] > 0);
    CHECK(pending_after[t] == 0);
  }
  CHECK_MESSAGE(standin_violations() == violations, std::string(standin_first_violation()));
}

// Run alone by ctest with STANDIN_EXIT_CHECK (the stand-in's exit handler
// then ends the process with 70 at any later driver call), the last graph
// holding a capturer destroyed as the process ends: no driver call may come
// after the driver's exit handler. Run in the whole suite, they only check
// that the graph's hold is released.
namespace {

void destroy_last_graph_holding_a_capturer() {
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  Tensor slots = index_tensor({6}, kDLCUDA);
  Graph graph = nullptr;
  REQUIRE(moecap_destroy(record_into_engine_graph(s, ids, slots, &graph)) == MOECAP_OK);  // the graph holds it now
  const int64_t live = standin_live_user_objects();
  driver().graph_destroy(graph);  // its release starts on other threads
  CHECK(standin_live_user_objects() == live - 1);
}

}  // namespace

// With STANDIN_SLOW_FREE_MS: the driver's destructor callback has handed the
// capturer to moecap's thread, which is still freeing it when main returns:
// exit waits for it.
TEST_CASE("exit waits for a capturer still being freed after its last graph was destroyed") {
  destroy_last_graph_holding_a_capturer();
  standin_drain_callbacks();  // the release is on moecap's thread now
}

// With STANDIN_SLOW_USER_OBJECT_MS: the driver's destructor callback comes
// after exit began: moecap keeps the capturer rather than free it then.
TEST_CASE("a capturer whose last graph's release comes during exit is kept, not freed under the driver") {
  destroy_last_graph_holding_a_capturer();
}

// The child of a fork() taken while moecap's thread frees a capturer has no
// such thread: its exit must not wait for it (the drain's limit is 5 s). Not
// under ASan or TSan, whose runtimes do their own exit work in a forked child
// of a threaded process (a LeakSanitizer check hung there in CI).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
TEST_CASE("a child forked while a capturer is being freed exits at once" * doctest::skip(kSanitized)) {
  standin_set_slow_free_ms(400);
  destroy_last_graph_holding_a_capturer();
  standin_drain_callbacks();  // the release is on moecap's thread, in its frees
  std::fflush(nullptr);  // the child's exit flushes only what is its own
  const auto start = std::chrono::steady_clock::now();
  const pid_t child = fork();
  if (child == 0) std::exit(0);  // the exit handlers run in the child
  // Polled, never a blocking wait: a child stuck in its exit is killed and fails the test, not the run.
  int status = 0;
  pid_t waited = 0;
  const auto give_up = start + std::chrono::seconds(20);
  while ((waited = waitpid(child, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const auto took = std::chrono::steady_clock::now() - start;
  if (waited == 0) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
  }
  standin_set_slow_free_ms(-1);
  REQUIRE(waited == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(took < std::chrono::seconds(3));
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // the parent's release ends its last slow free
}
