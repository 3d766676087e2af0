// SPDX-License-Identifier: Apache-2.0
// MOECAP_FLAG_SIDE_STREAM on the CUDA backend, run by the stand-in driver:
// capture and commit fork onto moecap's stream (eagerly, and as a branch of
// the engine's own graph capture) and join back at moecap_join. The stand-in
// runs the side stream (or the graph branch) only when a join or a host
// wait orders it, so a join the engine places after its next write to
// topk_ids commits that write's values: the test below shows that the
// contract (join before the write) is what keeps the rows right.
#include <doctest/doctest.h>

#include <cstring>
#include <string>

#include "tests/cuda_standin/engine.h"

using namespace standin;
using namespace moecap_scenarios;

// MOECAP_LIBCUDA names the stand-in: set for the whole binary by test_scenarios.cpp.
namespace {

constexpr CUresult kCaptureUnjoined = 904;

moecap_capturer* make_side_capturer(bool side) {
  moecap_config c = cuda_config();
  if (side) c.flags |= MOECAP_FLAG_SIDE_STREAM;
  moecap_capturer* h = nullptr;
  REQUIRE_MESSAGE(moecap_create(&c, &h) == MOECAP_OK, std::string(moecap_last_error()));
  return h;
}

// The engine writes `src` (pinned: read when the copy runs) over the routing
// buffer on `s`, as its next forward's top-k would.
void engine_write(Tensor& ids, Tensor& src, Stream s) {
  using Copy = CUresult (*)(unsigned long long, const void*, size_t, Stream);
  static const Copy copy = entry<Copy>("cuMemcpyHtoDAsync");
  const moecap_config c = cuda_config();
  const size_t bytes = static_cast<size_t>(c.num_layers * kRows * c.top_k) * sizeof(int32_t);
  REQUIRE(copy(reinterpret_cast<unsigned long long>(ids.as<void>()), src.as<void>(), bytes, s) == 0);
}

Tensor pinned_routing(int64_t batch, int64_t n) {
  const moecap_config c = cuda_config();
  Tensor t({c.num_layers, kRows, c.top_k}, moecap_test::i32(), kDLCUDAHost);
  const std::vector<int32_t> v = forward_values(batch, n);
  std::memcpy(t.as<int32_t>(), v.data(), v.size() * sizeof(int32_t));
  return t;
}

enum class Join { BeforeWrite, AfterWrite };

// Eager: capture batch 1, commit to slots 3 and 4, the engine's write of
// batch 2 and the join in the given order; the engine's stream runs first.
std::vector<int64_t> eager_step(bool side, Join join) {
  moecap_capturer* h = make_side_capturer(side);
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 1, 2);
  Tensor next = pinned_routing(2, 2);
  capture_layers(h, ids.get(), 2, s);
  Tensor slots = index_tensor({3, 4}, kDLCPU);
  commit(h, slots.get(), s);
  if (join == Join::BeforeWrite) REQUIRE(moecap_join(h, s) == MOECAP_OK);
  engine_write(ids, next, s);
  if (join == Join::AfterWrite) REQUIRE(moecap_join(h, s) == MOECAP_OK);
  REQUIRE(driver().stream_sync(s) == 0);  // the engine's stream gets ahead of the side stream
  std::vector<int64_t> got = read_rows(h, {3, 4});
  CHECK(moecap_destroy(h) == MOECAP_OK);
  return got;
}

std::vector<int64_t> rows_of_batch(int64_t batch) {
  std::vector<int64_t> v = expected_row(batch, 0);
  const std::vector<int64_t> second = expected_row(batch, 1);
  v.insert(v.end(), second.begin(), second.end());
  return v;
}

// The engine's graph: capture batch 1's rows, commit them to device slots,
// then write batch 2's routing, with the join before or after that write.
std::vector<int64_t> graph_step(Join join) {
  moecap_capturer* h = make_side_capturer(true);
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  Tensor next = pinned_routing(2, 2);
  Tensor slots = index_tensor({3, 4}, kDLCUDA);
  REQUIRE(driver().begin_capture(s, kModeGlobal) == 0);
  capture_layers(h, ids.get(), 2, s);
  commit(h, slots.get(), s);
  if (join == Join::BeforeWrite) REQUIRE(moecap_join(h, s) == MOECAP_OK);
  engine_write(ids, next, s);
  if (join == Join::AfterWrite) REQUIRE(moecap_join(h, s) == MOECAP_OK);
  Graph g = nullptr;
  REQUIRE(driver().end_capture(s, &g) == 0);
  Exec exec = nullptr;
  REQUIRE(driver().instantiate(&exec, g, 0) == 0);
  forward(ids, 1, 2);
  REQUIRE(driver().launch(exec, s) == 0);
  REQUIRE(driver().stream_sync(s) == 0);
  std::vector<int64_t> got = read_rows(h, {3, 4});
  CHECK(driver().exec_destroy(exec) == 0);
  CHECK(driver().graph_destroy(g) == 0);
  CHECK(moecap_destroy(h) == MOECAP_OK);
  return got;
}

}  // namespace

TEST_CASE("side stream, eager: the join before the engine's next write commits the forward's rows") {
  CHECK(eager_step(true, Join::BeforeWrite) == rows_of_batch(1));
  CHECK(eager_step(false, Join::AfterWrite) == rows_of_batch(1));  // no flag: nothing forked
}

TEST_CASE("side stream, eager: a join after the engine's next write to topk_ids commits that write") {
  CHECK(eager_step(true, Join::AfterWrite) == rows_of_batch(2));
}

TEST_CASE("side stream, in the engine's capture: the branch joins where moecap_join is recorded") {
  CHECK(graph_step(Join::BeforeWrite) == rows_of_batch(1));
  CHECK(graph_step(Join::AfterWrite) == rows_of_batch(2));
}

TEST_CASE("side stream, in the engine's capture: a capture without moecap_join cannot end, and the next one can") {
  moecap_capturer* h = make_side_capturer(true);
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  Tensor slots = index_tensor({5}, kDLCUDA);
  for (const bool join : {false, true, true}) {
    CAPTURE(join);
    REQUIRE(driver().begin_capture(s, kModeRelaxed) == 0);
    capture_layers(h, ids.get(), 1, s);
    commit(h, slots.get(), s);
    if (join) REQUIRE(moecap_join(h, s) == MOECAP_OK);
    Graph g = nullptr;
    CHECK(driver().end_capture(s, &g) == (join ? 0 : kCaptureUnjoined));
    int status = -1;
    REQUIRE(driver().is_capturing(s, &status) == 0);
    CHECK(status == 0);
    if (g != nullptr) {
      Exec exec = nullptr;
      REQUIRE(driver().instantiate(&exec, g, 0) == 0);
      forward(ids, 7, 1);
      REQUIRE(driver().launch(exec, s) == 0);
      CHECK(read_rows(h, {5}) == expected_row(7, 0));  // read waits for the branch's commit
      CHECK(driver().exec_destroy(exec) == 0);
      CHECK(driver().graph_destroy(g) == 0);
    }
  }
  CHECK(moecap_destroy(h) == MOECAP_OK);
  CHECK(standin_violations() == 0);
}

TEST_CASE("side stream: a moecap graph joins at moecap_graph_end; replays and eager calls mix") {
  moecap_capturer* h = make_side_capturer(true);
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  Tensor slots = index_tensor({6}, kDLCUDA);
  moecap_graph* g = record_commit_graph(h, ids.get(), 1, slots.get(), s);
  for (int64_t batch : {3, 4}) {
    forward(ids, batch, 1);
    REQUIRE(moecap_graph_launch(g, s) == MOECAP_OK);
    REQUIRE(driver().stream_sync(s) == 0);
    CHECK(read_rows(h, {6}) == expected_row(batch, 0));
    // An eager step on the same stream between replays.
    forward(ids, batch + 10, 1);
    capture_layers(h, ids.get(), 1, s);
    Tensor eager_slot = index_tensor({8}, kDLCPU);
    commit(h, eager_slot.get(), s);
    REQUIRE(moecap_join(h, s) == MOECAP_OK);
    CHECK(read_rows(h, {8}) == expected_row(batch + 10, 0));
  }
  CHECK(moecap_graph_destroy(g) == MOECAP_OK);
  CHECK(moecap_destroy(h) == MOECAP_OK);
  standin_drain_callbacks();
  CHECK(standin_violations() == 0);
}

TEST_CASE("side stream: a forked invalidate is ordered after the forked commit, and read waits for both") {
  moecap_capturer* h = make_side_capturer(true);
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 5, 2);
  capture_layers(h, ids.get(), 2, s);
  Tensor slots = index_tensor({10, 11}, kDLCPU);
  commit(h, slots.get(), s);
  Tensor freed = index_tensor({11}, kDLCPU);
  REQUIRE(moecap_invalidate(h, freed.get(), s) == MOECAP_OK);
  REQUIRE(standin_pending(s) > 0);  // nothing ran: the host has not waited
  const std::vector<int64_t> got = read_rows(h, {10, 11});
  CHECK(row_of(got, 0) == expected_row(5, 0));
  CHECK(row_of(got, 1) == std::vector<int64_t>(row_of(got, 1).size(), -1));
  REQUIRE(moecap_join(h, s) == MOECAP_OK);
  CHECK(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("side stream: an eager invalidate, then a replay committing the same slot: the replay's commit lands last") {
  // Eager forks and a graph's branch are different streams: moecap_graph_launch
  // joins the eager side stream first, so the branch forks after the invalidate.
  moecap_capturer* h = make_side_capturer(true);
  Stream s = new_stream();
  Tensor ids = routing_buffer();
  Tensor slots = index_tensor({12}, kDLCUDA);
  moecap_graph* g = record_commit_graph(h, ids.get(), 1, slots.get(), s);
  Tensor freed = index_tensor({12}, kDLCPU);
  for (int64_t batch : {1, 2}) {
    forward(ids, batch, 1);
    REQUIRE(moecap_invalidate(h, freed.get(), s) == MOECAP_OK);  // the slot's previous request finished
    REQUIRE(moecap_graph_launch(g, s) == MOECAP_OK);              // a new request's token lands there
    REQUIRE(driver().stream_sync(s) == 0);
    CHECK(read_rows(h, {12}, MOECAP_OK, MOECAP_READ_STRICT) == expected_row(batch, 0));
  }
  CHECK(moecap_graph_destroy(g) == MOECAP_OK);
  CHECK(moecap_destroy(h) == MOECAP_OK);
}
