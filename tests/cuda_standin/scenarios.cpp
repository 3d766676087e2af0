// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's scenarios, written once and run against either driver
// (engine_api.h): the stand-in in every CI run (moecap_standin_tests), the
// real one on a GPU (moecap_gpu_scenarios, also under compute-sanitizer).
// Each is the way an engine really produces the situation; on the stand-in
// nothing runs on a stream until the host waits, on a GPU a held stream is
// the long forward.
#include <doctest/doctest.h>

#include <string>
#include <thread>

#include "tests/cuda_standin/engine_api.h"

using namespace engine;
using namespace moecap_scenarios;

namespace {

struct Setup {
  Setup() { engine::setup(); }
};
const Setup setup_driver;

std::vector<int64_t> no_routing() {
  const moecap_config c = cuda_config();
  return std::vector<int64_t>(static_cast<size_t>(c.num_layers * c.top_k), -1);
}

Tensor request_rows(int64_t n, DLDeviceType where) {
  const moecap_config c = cuda_config();
  return Tensor({n, c.num_layers, c.top_k}, moecap_test::i64(), where);
}

void clear_errors(moecap_capturer* h, uint64_t expect_skipped) {
  moecap_error_counts e{};
  e.struct_size = sizeof e;
  REQUIRE(moecap_get_errors(h, &e, MOECAP_ERRORS_CLEAR) == MOECAP_OK);
  CHECK(e.skipped_rows == expect_skipped);
}

void end_and_drop(Stream s, int expect = 0) {
  Graph g = nullptr;
  CHECK(end_capture(s, &g) == expect);
  if (g != nullptr) destroy(g);
}

}  // namespace

TEST_CASE("a pinned slot list the engine refills after the call still commits to the call's slots") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 1, 2);
  std::vector<Tensor> lists;
  {
    Hold forward_running(s);  // the commits wait behind a long forward
    for (DLDeviceType where : {kDLCPU, kDLCUDAHost}) {  // pin_memory's kDLCPU and cudaHostAlloc's kDLCUDAHost
      CAPTURE(where);
      capture_layers(h, ids.get(), 2, s);  // each commit consumes the rows it reads
      const int64_t first = where == kDLCPU ? 3 : 5;
      lists.push_back(index_tensor({first, first + 1}, where));
      commit(h, lists.back().get(), s);
      lists.back().host<int64_t>()[0] = first + 4;  // the engine prepares the next step while this one runs
      lists.back().host<int64_t>()[1] = first + 5;
    }
  }
  REQUIRE(moecap_synchronize(h) == MOECAP_OK);
  const auto got = read_rows(h, {3, 4, 5, 6, 7, 8, 9, 10, kNever});
  for (size_t i = 0; i < 4; ++i) CHECK(row_of(got, i) == expected_row(1, static_cast<int64_t>(i % 2)));
  for (size_t i = 4; i < 8; ++i) CHECK(row_of(got, i) == row_of(got, 8));  // the refilled slots got nothing
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("read, synchronize and get_errors while the engine captures in global mode, on another thread or this one") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 2, 1);
  capture_layers(h, ids.get(), 1, s);
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  slot.set(0, 3);
  commit(h, slot.get(), s);  // a commit in flight: read must wait for it

  Stream captured = new_stream();
  auto host_calls = [&] {
    CHECK(read_rows(h, {3}) == expected_row(2, 0));
    CHECK_MESSAGE(moecap_synchronize(h) == MOECAP_OK, std::string(moecap_last_error()));
    moecap_error_counts e{};
    e.struct_size = sizeof e;
    CHECK_MESSAGE(moecap_get_errors(h, &e, 0) == MOECAP_OK, std::string(moecap_last_error()));
  };
  for (const bool other_thread : {true, false}) {
    CAPTURE(other_thread);
    REQUIRE(begin_capture(captured, kGlobal) == 0);  // torch.cuda.graph's default mode
    if (other_thread) {
      std::thread(host_calls).join();
    } else {
      host_calls();
    }
    end_and_drop(captured);  // not invalidated
  }
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("a read waits for graph replays behind a long forward on one stream after many eager commits on another") {
  moecap_capturer* h = make_capturer();
  Stream a = new_stream();
  Stream b = new_stream();
  Tensor ids = routing_buffer();
  constexpr int kGraphs = 20;
  std::vector<moecap_graph*> graphs;
  std::vector<Tensor> slots;
  for (int i = 0; i < kGraphs; ++i) {
    slots.push_back(index_tensor({i}, kDLCUDA));
    moecap_graph* g = record_commit_graph(h, ids.get(), 1, slots.back().get(), a);
    graphs.push_back(g);
  }
  forward(ids, 3, 1);
  Hold forward_running(a);
  for (moecap_graph* g : graphs) REQUIRE(moecap_graph_launch(g, a) == MOECAP_OK);
  moecap_test::HostTensor eager_slot({1}, moecap_test::i64());
  eager_slot.set(0, 25);
  for (int i = 0; i < 16; ++i) commit(h, eager_slot.get(), b);
  std::vector<int64_t> which;
  for (int i = 0; i < kGraphs; ++i) which.push_back(i);
  std::thread opener = forward_running.open_after(200);
  const auto got = read_rows(h, which);
  opener.join();
  for (size_t i = 0; i < kGraphs; ++i) CHECK(row_of(got, i) == expected_row(3, 0));
  for (moecap_graph* g : graphs) moecap_graph_destroy(g);
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("a read into GPU tensors is ordered before a later moecap_write to the same slots") {
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
  Tensor out = request_rows(1, kDLCUDA);
  Hold forward_running(s);
  REQUIRE_MESSAGE(moecap_read(h, slot.get(), out.get(), nullptr, 0, s) == MOECAP_OK, std::string(moecap_last_error()));
  moecap_test::HostTensor reuse({1, c.num_layers, c.top_k}, moecap_test::i32());
  for (int64_t i = 0; i < reuse.numel(); ++i) reuse.set(i, 1);  // the slot is freed and reused
  std::thread opener = forward_running.open_after(100);  // write waits for the read
  REQUIRE_MESSAGE(moecap_write(h, slot.get(), reuse.get(), nullptr, nullptr) == MOECAP_OK,
                  std::string(moecap_last_error()));
  opener.join();
  sync(s);
  CHECK(out.download<int64_t>() == expected_row(4, 0));
  CHECK(read_rows(h, {2}) == std::vector<int64_t>(static_cast<size_t>(c.num_layers * c.top_k), 1));
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("a read into GPU tensors is ordered before a later invalidate, commit or graph replay of its slots") {
  moecap_capturer* h = make_capturer();
  Stream engine_stream = new_stream();
  Stream reader = new_stream();
  Stream other = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 40, 1);
  capture_layers(h, ids.get(), 1, engine_stream);
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  slot.set(0, 2);
  commit(h, slot.get(), engine_stream);
  REQUIRE(moecap_synchronize(h) == MOECAP_OK);

  Tensor out = request_rows(1, kDLCUDA);
  {
    Hold reader_busy(reader);  // the gather has not run when the slot is reused
    REQUIRE_MESSAGE(moecap_read(h, slot.get(), out.get(), nullptr, 0, reader) == MOECAP_OK,
                    std::string(moecap_last_error()));
    // The next request gets the slot, on another stream: invalidate (host
    // slots), then a commit with device slots.
    REQUIRE(moecap_invalidate(h, slot.get(), other) == MOECAP_OK);
    std::thread opener = reader_busy.open_after(100);  // the invalidate waits for the gather
    sync(other);
    opener.join();
  }
  sync(reader);
  CHECK(out.download<int64_t>() == expected_row(40, 0));

  Tensor device_slot = index_tensor({2}, kDLCUDA);
  {
    Hold reader_busy(reader);
    REQUIRE(moecap_read(h, slot.get(), out.get(), nullptr, 0, reader) == MOECAP_OK);
    forward(ids, 41, 1);
    capture_layers(h, ids.get(), 1, other);
    commit(h, device_slot.get(), other);
    std::thread opener = reader_busy.open_after(100);  // the commit waits for the gather
    sync(other);
    opener.join();
  }
  sync(reader);
  CHECK(out.download<int64_t>() == no_routing());  // what the invalidated slot held at the read
  CHECK(read_rows(h, {2}) == expected_row(41, 0));

  // A moecap graph replay that commits to the slot follows the read too.
  moecap_graph* g = record_commit_graph(h, ids.get(), 1, device_slot.get(), other);
  {
    Hold reader_busy(reader);
    REQUIRE(moecap_read(h, slot.get(), out.get(), nullptr, 0, reader) == MOECAP_OK);
    forward(ids, 42, 1);
    REQUIRE(moecap_graph_launch(g, other) == MOECAP_OK);
    std::thread opener = reader_busy.open_after(100);
    sync(other);
    opener.join();
  }
  sync(reader);
  CHECK(out.download<int64_t>() == expected_row(41, 0));
  CHECK(read_rows(h, {2}) == expected_row(42, 0));
  REQUIRE(moecap_graph_destroy(g) == MOECAP_OK);
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("a moecap graph replays on the legacy default stream, after a read of its slots into a GPU tensor") {
  // torch's default stream is CUDA's legacy one: Graph.launch() passes it.
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Stream reader = new_stream();
  Tensor ids = routing_buffer();
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  slot.set(0, 3);
  Tensor device_slot = index_tensor({3}, kDLCUDA);
  moecap_graph* g = record_commit_graph(h, ids.get(), 1, device_slot.get(), s);
  forward(ids, 50, 1);
  REQUIRE_MESSAGE(moecap_graph_launch(g, nullptr) == MOECAP_OK, std::string(moecap_last_error()));
  REQUIRE(moecap_synchronize(h) == MOECAP_OK);
  CHECK(read_rows(h, {3}) == expected_row(50, 0));

  Tensor out = request_rows(1, kDLCUDA);
  {
    Hold reader_busy(reader);  // the gather has not run when the replay is launched
    REQUIRE(moecap_read(h, slot.get(), out.get(), nullptr, 0, reader) == MOECAP_OK);
    forward(ids, 51, 1);
    REQUIRE(moecap_graph_launch(g, nullptr) == MOECAP_OK);
    std::thread opener = reader_busy.open_after(100);  // the replay waits for the gather
    sync(nullptr);
    opener.join();
  }
  sync(reader);
  CHECK(out.download<int64_t>() == expected_row(50, 0));
  CHECK(read_rows(h, {3}) == expected_row(51, 0));
  REQUIRE(moecap_graph_destroy(g) == MOECAP_OK);
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("moecap_graph_end on another thread than moecap_graph_begin") {
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
  CHECK_FALSE(capturing(s));  // the engine's stream is not left capturing
  if (g != nullptr) {
    forward(ids, 5, 1);
    REQUIRE(moecap_graph_launch(g, s) == MOECAP_OK);
    CHECK(read_rows(h, {4}) == expected_row(5, 0));
    moecap_graph_destroy(g);
  }
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("engine graphs and child-graph clones holding moecap's nodes replay after moecap_destroy") {
  const int64_t seen = violations();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  Tensor slots = index_tensor({6}, kDLCUDA);

  // The engine's own capture (torch.cuda.graph) with moecap's calls inside.
  moecap_capturer* h = make_capturer();
  REQUIRE(begin_capture(s, kGlobal) == 0);
  capture_layers(h, ids.get(), 1, s);
  commit(h, slots.get(), s);
  Graph engine_graph = nullptr;
  REQUIRE(end_capture(s, &engine_graph) == 0);
  Exec engine_exec = instantiate(engine_graph);

  // moecap's own graph, embedded as a child node of an engine graph.
  moecap_graph* own = record_commit_graph(h, ids.get(), 1, slots.get(), s);
  void* native = nullptr;
  REQUIRE(moecap_graph_native(own, &native) == MOECAP_OK);
  Graph parent = new_graph();
  add_child(parent, static_cast<Graph>(native));
  Exec parent_exec = instantiate(parent);

  REQUIRE(moecap_graph_destroy(own) == MOECAP_OK);
  REQUIRE(moecap_destroy(h) == MOECAP_OK);
  forward(ids, 7, 1);
  launch(engine_exec, s);
  launch(parent_exec, s);
  sync(s);  // memcheck on a GPU, the stand-in's freed-memory check here
  CHECK_MESSAGE(violations() == seen, std::string(first_violation()));

  // The last graph gone, the capturer goes too, and not from the driver's callback thread.
  destroy(engine_exec);
  destroy(engine_graph);
  destroy(parent_exec);
  destroy(parent);
  drain_callbacks();
  CHECK_MESSAGE(violations() == seen, std::string(first_violation()));
}

TEST_CASE("duplicate slots in one commit: the last entry wins, in any kernel schedule") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 9, 3);
  capture_layers(h, ids.get(), 3, s);
  moecap_test::HostTensor host_slots({3}, moecap_test::i64());
  host_slots.fill<int64_t>({5, 6, 5});
  commit(h, host_slots.get(), s);
  capture_layers(h, ids.get(), 3, s);  // commit consumed the rows
  Tensor device_slots = index_tensor({6, 7, 7}, kDLCUDA);
  commit(h, device_slots.get(), s);
  const auto got = read_rows(h, {5, 6, 7});
  CHECK(row_of(got, 0) == expected_row(9, 2));
  CHECK(row_of(got, 1) == expected_row(9, 0));
  CHECK(row_of(got, 2) == expected_row(9, 2));
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("a slot listed twice keeps the last entry whose row is in range, with host slots and device rows too") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 60, 2);
  capture_layers(h, ids.get(), 2, s);
  moecap_test::HostTensor host_slots({3}, moecap_test::i64());
  host_slots.fill<int64_t>({5, 6, 5});
  // The last entry for slot 5 names a row outside device_rows: only the device sees it.
  Tensor device_rows = index_tensor({0, 1, 1000}, kDLCUDA);
  moecap_commit_args a{};
  a.struct_size = sizeof a;
  a.dst_slots = host_slots.get();
  a.src_rows = device_rows.get();
  REQUIRE_MESSAGE(moecap_commit(h, &a, s) == MOECAP_OK, std::string(moecap_last_error()));
  REQUIRE(moecap_synchronize(h) == MOECAP_ERROR_ROWS_SKIPPED);
  clear_errors(h, 1);
  const auto got = read_rows(h, {5, 6});
  CHECK(row_of(got, 0) == expected_row(60, 0));  // as the host backend keeps it
  CHECK(row_of(got, 1) == expected_row(60, 1));

  // The same on the host backend, the reference (host rows are range-checked
  // at the call outside graphs: a host graph reads them at replay).
  moecap_config hc = cuda_config();
  hc.device_type = MOECAP_DEVICE_HOST;
  moecap_capturer* host = nullptr;
  REQUIRE(moecap_create(&hc, &host) == MOECAP_OK);
  moecap_test::HostTensor hids({hc.num_layers, kRows, hc.top_k}, moecap_test::i32());
  const std::vector<int32_t> v = forward_values(60, 2);
  for (size_t i = 0; i < v.size(); ++i) hids.set(static_cast<int64_t>(i), v[i]);
  REQUIRE(moecap_graph_begin(host, nullptr) == MOECAP_OK);
  capture_layers(host, hids.get(), 2, nullptr);
  moecap_test::HostTensor hrows({3}, moecap_test::i64());
  hrows.fill<int64_t>({0, 1, 1000});
  moecap_commit_args ha = a;
  ha.src_rows = hrows.get();
  REQUIRE_MESSAGE(moecap_commit(host, &ha, nullptr) == MOECAP_OK, std::string(moecap_last_error()));
  moecap_graph* g = nullptr;
  REQUIRE(moecap_graph_end(host, &g) == MOECAP_OK);
  REQUIRE(moecap_graph_launch(g, nullptr) == MOECAP_OK);
  clear_errors(host, 1);
  CHECK(read_rows(host, {5, 6}) == got);
  REQUIRE(moecap_graph_destroy(g) == MOECAP_OK);
  CHECK(moecap_destroy(host) == MOECAP_OK);
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("pinned index lists are refused in graphs on CUDA: a replay would read what the engine refilled") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  Tensor device_slots = index_tensor({3}, kDLCUDA);
  for (DLDeviceType where : {kDLCUDAHost, kDLCPU}) {
    CAPTURE(where);
    Tensor pinned = index_tensor({3}, where);
    // moecap's own graph and the engine's capture alike.
    REQUIRE(moecap_graph_begin(h, s) == MOECAP_OK);
    capture_layers(h, ids.get(), 1, s);
    commit(h, pinned.get(), s, 0, MOECAP_ERROR_CAPTURE_ILLEGAL);
    CHECK(std::string(moecap_last_error()).find("args->dst_slots is in host memory") != std::string::npos);
    moecap_commit_args a{};
    a.struct_size = sizeof a;
    a.dst_slots = device_slots.get();
    a.src_rows = pinned.get();
    CHECK(moecap_commit(h, &a, s) == MOECAP_ERROR_CAPTURE_ILLEGAL);
    CHECK(std::string(moecap_last_error()).find("args->src_rows is in host memory") != std::string::npos);
    CHECK(moecap_invalidate(h, pinned.get(), s) == MOECAP_ERROR_CAPTURE_ILLEGAL);
    commit(h, device_slots.get(), s);  // the capture goes on
    moecap_graph* g = nullptr;
    REQUIRE(moecap_graph_end(h, &g) == MOECAP_OK);
    REQUIRE(moecap_graph_destroy(g) == MOECAP_OK);

    REQUIRE(begin_capture(s, kGlobal) == 0);
    commit(h, pinned.get(), s, 0, MOECAP_ERROR_CAPTURE_ILLEGAL);
    end_and_drop(s);  // the refusal left the engine's capture intact
  }
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("a non-blocking read waits only for the commits that wrote its slots") {
  moecap_capturer* h = make_capturer();
  Stream a = new_stream();
  Stream b = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 10, 1);
  capture_layers(h, ids.get(), 1, a);
  moecap_test::HostTensor done_slot({1}, moecap_test::i64());
  done_slot.set(0, 1);
  commit(h, done_slot.get(), a);
  sync(a);
  Hold forward_running(b);
  moecap_test::HostTensor busy_slot({1}, moecap_test::i64());
  busy_slot.set(0, 2);
  commit(h, busy_slot.get(), b);  // another request's commit, still in flight
  CHECK(read_rows(h, {1}, MOECAP_OK, MOECAP_READ_NONBLOCKING) == expected_row(10, 0));
  read_rows(h, {2}, MOECAP_ERROR_NOT_READY, MOECAP_READ_NONBLOCKING);
  forward_running.open();
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("a read into GPU tensors orders on the stream instead of blocking the host") {
  moecap_capturer* h = make_capturer();
  Stream a = new_stream();
  Stream reader = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 11, 1);
  capture_layers(h, ids.get(), 1, a);
  moecap_test::HostTensor slot({1}, moecap_test::i64());
  slot.set(0, 3);
  Tensor out = request_rows(1, kDLCUDA);
  {
    Hold forward_running(a);
    commit(h, slot.get(), a);
    REQUIRE_MESSAGE(moecap_read(h, slot.get(), out.get(), nullptr, 0, reader) == MOECAP_OK,
                    std::string(moecap_last_error()));
    CHECK(busy(a));  // the host did not wait for the commit
  }
  sync(reader);
  CHECK(out.download<int64_t>() == expected_row(11, 0));
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("slots fail closed on CUDA: never committed, invalidated (eagerly and by replays) read -1") {
  const int64_t seen = violations();
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 11, 4);
  capture_layers(h, ids.get(), 4, s);
  moecap_test::HostTensor slots({4}, moecap_test::i64());
  slots.fill<int64_t>({1, 2, 3, 4});
  commit(h, slots.get(), s);
  const std::vector<int64_t> none = no_routing();
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
    gslots.upload(std::vector<int64_t>{10 + step, 20 + step});
    gfreed.upload(std::vector<int64_t>{step == 0 ? 3 : 19 + step});  // the previous replay's second slot
    REQUIRE(moecap_graph_launch(g, s) == MOECAP_OK);
    sync(s);  // the engine reuses its buffers after the step
  }
  rows = read_rows(h, {3, 20, 21, 22, 12});
  CHECK(row_of(rows, 0) == none);  // invalidated by the first replay
  CHECK(row_of(rows, 1) == none);  // by the second
  CHECK(row_of(rows, 2) == none);  // by the third
  CHECK(row_of(rows, 3) == expected_row(22, 1));
  CHECK(row_of(rows, 4) == expected_row(22, 0));
  REQUIRE(moecap_graph_destroy(g) == MOECAP_OK);
  CHECK(moecap_destroy(h) == MOECAP_OK);
  CHECK_MESSAGE(violations() == seen, std::string(first_violation()));
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
    std::vector<int16_t> out(static_cast<size_t>(3 * c.top_k));
    for (int64_t t = 0; t < 3; ++t)
      for (int32_t k = 0; k < c.top_k; ++k) out[static_cast<size_t>(t * c.top_k + k)] = static_cast<int16_t>(expert(30, t, layer, k));
    if (layer == 1) out[static_cast<size_t>(2 * c.top_k)] = 999;  // token 2: a bad id from the kernel
    upload(v->dl_tensor.data, out.data(), out.size() * sizeof(int16_t));
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
  moecap_error_counts e{};
  e.struct_size = sizeof e;
  REQUIRE(moecap_get_errors(h, &e, 0) == MOECAP_OK);
  CHECK(e.invalid_ids == 1);  // the kernel's 999, counted at commit
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("commit consumes its rows on the CUDA backend, on the claim path too; no routing is never VALID") {
  moecap_capturer* h = make_capturer();
  Stream s = new_stream();
  const moecap_config c = cuda_config();
  // Never captured: every layer is no routing from create.
  moecap_test::HostTensor fresh({2}, moecap_test::i64());
  fresh.fill<int64_t>({10, 11});
  commit(h, fresh.get(), s);
  read_rows(h, {10, 11}, MOECAP_ERROR_NO_ROUTING, MOECAP_READ_STRICT);
  CHECK(row_of(read_rows(h, {10}), 0) == no_routing());

  Tensor ids = routing_buffer();
  forward(ids, 12, 3);
  capture_layers(h, ids.get(), 3, s);
  Tensor device_slots = index_tensor({5, 6, 5}, kDLCUDA);  // slots the host cannot see: claims
  commit(h, device_slots.get(), s);
  const auto got = read_rows(h, {5, 6}, MOECAP_OK, MOECAP_READ_STRICT);
  CHECK(row_of(got, 0) == expected_row(12, 2));
  CHECK(row_of(got, 1) == expected_row(12, 1));
  // Every row the commit named is consumed, the losing duplicate's too.
  for (int32_t layer = 0; layer < c.num_layers; ++layer) {
    DLManagedTensorVersioned* v = nullptr;
    REQUIRE(moecap_export(h, MOECAP_BUFFER_LAYER_IDS, layer, &v) == MOECAP_OK);
    std::vector<int16_t> rows(static_cast<size_t>(3 * c.top_k));
    download(rows.data(), v->dl_tensor.data, rows.size() * sizeof(int16_t));
    for (int16_t id : rows) CHECK(id == -1);
    v->deleter(v);
  }
  // A later step that captures one row but commits three: rows 1-2 are not the previous request's.
  forward(ids, 13, 1);
  capture_layers(h, ids.get(), 1, s);
  moecap_test::HostTensor again({3}, moecap_test::i64());
  again.fill<int64_t>({5, 6, 7});
  commit(h, again.get(), s);
  read_rows(h, {5, 6, 7}, MOECAP_ERROR_NO_ROUTING, MOECAP_READ_STRICT);
  const auto after = read_rows(h, {5, 6, 7});
  CHECK(row_of(after, 0) == expected_row(13, 0));
  CHECK(row_of(after, 1) == no_routing());
  CHECK(row_of(after, 2) == no_routing());
  moecap_error_counts e{};
  e.struct_size = sizeof e;
  REQUIRE(moecap_get_errors(h, &e, 0) == MOECAP_OK);
  CHECK(e.invalid_ids == 0);  // no routing is not a bad id
  CHECK(moecap_destroy(h) == MOECAP_OK);
}
