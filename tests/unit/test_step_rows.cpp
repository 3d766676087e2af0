// SPDX-License-Identifier: Apache-2.0
// Consumption that holds at dp >= 2 on the host backend (tests/support/step_rows.h),
// eagerly and with the side stream's deferred work.
#include <doctest/doctest.h>

#include <deque>
#include <memory>

#include "tests/support/capturer_handle.h"
#include "tests/support/step_rows.h"

namespace {

using Held = std::deque<std::unique_ptr<moecap_test::HostTensor>>;

// The scenario's ids as host tensors, kept in `held` as long as it lives
// (a recorded graph reads them at every replay).
moecap_step_rows::Memory host_memory(Held& held) {
  moecap_step_rows::Memory m;
  m.ids = [&held](const std::vector<int32_t>& v, int64_t n, int32_t top_k) {
    held.push_back(std::make_unique<moecap_test::HostTensor>(std::initializer_list<int64_t>{n, top_k}, moecap_test::i32()));
    for (size_t i = 0; i < v.size(); ++i) held.back()->set(static_cast<int64_t>(i), v[i]);
    return held.back()->get();
  };
  return m;
}

void run_on_host(int32_t dp, uint32_t flags) {
  moecap_config c = moecap_step_rows::config(dp, MOECAP_DEVICE_HOST);
  c.flags |= flags;
  moecap_test::Handle cap(c);
  Held held;
  moecap_step_rows::Memory m = host_memory(held);
  moecap_step_rows::run(cap.h, c, m);
}

}  // namespace

TEST_CASE("a step's rows are unusable after its commits at dp 2 and 4, skipped layers read -1 (host)") {
  for (int32_t dp : {2, 4}) {
    CAPTURE(dp);
    run_on_host(dp, 0);
    run_on_host(dp, MOECAP_FLAG_SIDE_STREAM);
  }
}

TEST_CASE("steps hold in recorded graphs: a replay that skips a layer reads -1 there, every replay (host, dp 2)") {
  namespace sr = moecap_step_rows;
  const moecap_config c = sr::config(2, MOECAP_DEVICE_HOST);
  moecap_test::Handle cap(c);
  Held held;
  sr::Memory m = host_memory(held);
  // The graph: rank 1's decode step, layer 1 skipped, its rows at 0-1.
  REQUIRE(moecap_graph_begin(cap.h, nullptr) == MOECAP_OK);
  sr::capture(cap.h, c, m, 0, 2, 2);
  sr::capture(cap.h, c, m, 2, 2, 2);
  moecap_test::HostTensor slots({2}, moecap_test::i64());  // read at every replay: lives as long as the graph
  slots.fill<int64_t>({2, 3});
  moecap_commit_args a{};
  a.struct_size = sizeof a;
  a.dst_slots = slots.get();
  REQUIRE(moecap_commit(cap.h, &a, nullptr) == MOECAP_OK);
  moecap_graph* g = nullptr;
  REQUIRE(moecap_graph_end(cap.h, &g) == MOECAP_OK);
  for (int replay = 0; replay < 2; ++replay) {
    CAPTURE(replay);
    // An eager step first: both ranks' rows, this rank (1) commits rows 2-3.
    for (int32_t l = 0; l < c.num_layers; ++l) sr::capture(cap.h, c, m, l, 1, 4);
    sr::commit(cap.h, m, 2, {0, 1});
    CHECK(sr::read(cap.h, c, 0, MOECAP_OK) == sr::row(c, 1, 2));
    REQUIRE(moecap_graph_launch(g, nullptr) == MOECAP_OK);
    CHECK(sr::read(cap.h, c, 2, MOECAP_ERROR_NO_ROUTING) == sr::row(c, 2, 0, {1}));
    CHECK(sr::read(cap.h, c, 3, MOECAP_ERROR_NO_ROUTING) == sr::row(c, 2, 1, {1}));
  }
  REQUIRE(moecap_graph_destroy(g) == MOECAP_OK);
}

// A rank with no rows in a step (DP attention: its MoE layers saw only other
// ranks' tokens) commits an empty list, which ends the step like any commit:
// the next step's captures start a new one, so a layer it skips reads -1
// there, never the other ranks' rows of the step before.
TEST_CASE("an empty commit ends the step: a layer the next step skips reads -1, not an earlier step's rows (host)") {
  namespace sr = moecap_step_rows;
  for (const uint32_t flags : {0u, static_cast<uint32_t>(MOECAP_FLAG_SIDE_STREAM)}) {
    CAPTURE(flags);
    moecap_config c = sr::config(2, MOECAP_DEVICE_HOST);
    c.flags |= flags;
    moecap_test::Handle cap(c);
    Held held;
    sr::Memory m = host_memory(held);
    // Step 1: the other rank's four tokens at rows 0-3; this rank has none.
    for (int32_t l = 0; l < c.num_layers; ++l) sr::capture(cap.h, c, m, l, 1, 4);
    sr::commit(cap.h, m, 0, {});
    // Step 2: this rank's two tokens at rows 0-1; layer 1 skipped.
    sr::capture(cap.h, c, m, 0, 2, 2);
    sr::capture(cap.h, c, m, 2, 2, 2);
    sr::commit(cap.h, m, 0, {0, 1});
    CHECK(sr::read(cap.h, c, 0, MOECAP_ERROR_NO_ROUTING) == sr::row(c, 2, 0, {1}));
    CHECK(sr::read(cap.h, c, 1, MOECAP_ERROR_NO_ROUTING) == sr::row(c, 2, 1, {1}));
  }
}
