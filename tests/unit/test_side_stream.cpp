// SPDX-License-Identifier: Apache-2.0
// MOECAP_FLAG_SIDE_STREAM on the host backend: forked work (capture, commit)
// runs at the join or at a host call, never at the call, as a side stream's
// work may run on a GPU. So the join contract is checkable on the CPU: an
// engine write to topk_ids (or to a layer view) before moecap_join changes
// what is committed; the same write after the join does not.
#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <vector>

#include "moecap.h"
#include "tests/support/capturer_handle.h"
#include "tests/support/tensors.h"

using namespace moecap_test;

namespace {

moecap_config side_config(bool side) {
  moecap_config c = small_config();
  if (side) c.flags |= MOECAP_FLAG_SIDE_STREAM;
  return c;
}

// The engine's per-layer routing output for batch `batch` (tokens 0..n-1).
void fill(HostTensor& ids, const moecap_config& c, int64_t batch, int32_t layer, int64_t n) {
  for (int64_t i = 0; i < n * c.top_k; ++i) ids.set(i, route(batch * 100 + i / c.top_k, layer, i % c.top_k, c.num_experts));
}

std::vector<int64_t> read_slots(moecap_capturer* h, const moecap_config& c, std::vector<int64_t> slots) {
  const auto n = static_cast<int64_t>(slots.size());
  HostTensor s({n}, i64());
  for (int64_t i = 0; i < n; ++i) s.set(i, slots[static_cast<size_t>(i)]);
  HostTensor out({n, c.num_layers, c.top_k}, i64());
  REQUIRE_MESSAGE(moecap_read(h, s.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK, std::string(moecap_last_error()));
  std::vector<int64_t> v(static_cast<size_t>(out.numel()));
  for (int64_t i = 0; i < out.numel(); ++i) v[static_cast<size_t>(i)] = out.at(i);
  return v;
}

std::vector<int64_t> expected(const moecap_config& c, int64_t batch, int64_t n) {
  std::vector<int64_t> v;
  for (int64_t t = 0; t < n; ++t)
    for (int32_t l = 0; l < c.num_layers; ++l)
      for (int32_t k = 0; k < c.top_k; ++k) v.push_back(route(batch * 100 + t, l, k, c.num_experts));
  return v;
}

enum class Join { BeforeWrite, AfterWrite };

// One forward of batch 1 over 2 tokens, committed to slots 3 and 4; the
// engine then writes batch 2's routing into the same topk_ids tensors, and
// joins before or after that write. Returns what slots 3 and 4 read.
std::vector<int64_t> step(bool side, Join join) {
  const moecap_config c = side_config(side);
  Handle h(c);
  const int64_t n = 2;
  // Each layer's output lives in its own tensor until the join (the contract):
  // a reused tensor would itself be "written before the join".
  std::vector<std::unique_ptr<HostTensor>> outs;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    outs.push_back(std::make_unique<HostTensor>(std::initializer_list<int64_t>{n, c.top_k}, i64()));
    fill(*outs.back(), c, 1, l, n);
    REQUIRE(moecap_capture(h.h, l, outs.back()->get(), nullptr, nullptr) == MOECAP_OK);
  }
  HostTensor slots({n}, i64());
  slots.fill<int64_t>({3, 4});
  moecap_commit_args a{sizeof a, 0, nullptr, slots.get()};
  REQUIRE(moecap_commit(h.h, &a, nullptr) == MOECAP_OK);
  slots.fill<int64_t>({5, 6});  // host slots are copied at the call, forked or not
  if (join == Join::BeforeWrite) REQUIRE(moecap_join(h.h, nullptr) == MOECAP_OK);
  for (int32_t l = 0; l < c.num_layers; ++l) fill(*outs[static_cast<size_t>(l)], c, 2, l, n);  // the next forward
  if (join == Join::AfterWrite) REQUIRE(moecap_join(h.h, nullptr) == MOECAP_OK);
  std::vector<int64_t> got = read_slots(h.h, c, {3, 4});
  const std::vector<int64_t> nothing = read_slots(h.h, c, {5, 6});
  CHECK(nothing == std::vector<int64_t>(nothing.size(), -1));
  return got;
}

}  // namespace

TEST_CASE("side stream: a join before the engine's next write commits the forward's routing") {
  const moecap_config c = side_config(true);
  CHECK(step(true, Join::BeforeWrite) == expected(c, 1, 2));
  CHECK(step(false, Join::BeforeWrite) == expected(c, 1, 2));
  // Without the flag nothing forks: the late join is harmless (a no-op).
  CHECK(step(false, Join::AfterWrite) == expected(c, 1, 2));
}

TEST_CASE("side stream: the CPU model catches a join placed after the engine's next write to topk_ids") {
  const moecap_config c = side_config(true);
  // The forked captures ran at the late join and read the next forward's ids.
  CHECK(step(true, Join::AfterWrite) == expected(c, 2, 2));
  CHECK(step(true, Join::AfterWrite) != expected(c, 1, 2));
}

TEST_CASE("side stream: forked work runs at the join or at a host call, not at the call") {
  const moecap_config c = side_config(true);
  Handle h(c);
  HostTensor ids({1, c.top_k}, i64());
  fill(ids, c, 1, 0, 1);
  DLManagedTensorVersioned* dev = nullptr;
  REQUIRE(moecap_export(h.h, MOECAP_BUFFER_DEVICE_IDS, 0, &dev) == MOECAP_OK);
  const auto* stored = static_cast<const int16_t*>(dev->dl_tensor.data);  // AUTO device dtype: I16
  REQUIRE(moecap_capture(h.h, 0, ids.get(), nullptr, nullptr) == MOECAP_OK);
  CHECK(stored[0] == -1);  // not yet: the side stream has not run (rows start as no routing)
  REQUIRE(moecap_join(h.h, nullptr) == MOECAP_OK);
  CHECK(stored[0] == route(100, 0, 0, c.num_experts));
  REQUIRE(moecap_join(h.h, nullptr) == MOECAP_OK);  // nothing forked since: a no-op

  // A host call waits for forked work as it waits for commits.
  fill(ids, c, 3, 0, 1);
  REQUIRE(moecap_capture(h.h, 0, ids.get(), nullptr, nullptr) == MOECAP_OK);
  CHECK(stored[0] == route(100, 0, 0, c.num_experts));
  REQUIRE(moecap_synchronize(h.h) == MOECAP_OK);
  CHECK(stored[0] == route(300, 0, 0, c.num_experts));
  dev->deleter(dev);
}

TEST_CASE("side stream: destroy runs the forked work even while a view keeps the memory") {
  // The engine frees its tensors after destroy returns; a view that outlives
  // the handle must not let the forked capture read them later.
  const moecap_config c = side_config(true);
  moecap_capturer* h = nullptr;
  REQUIRE(moecap_create(&c, &h) == MOECAP_OK);
  DLManagedTensorVersioned* dev = nullptr;
  REQUIRE(moecap_export(h, MOECAP_BUFFER_DEVICE_IDS, 0, &dev) == MOECAP_OK);
  const auto* stored = static_cast<const int16_t*>(dev->dl_tensor.data);  // AUTO device dtype: I16
  {
    HostTensor ids({1, c.top_k}, i64());
    fill(ids, c, 5, 0, 1);
    REQUIRE(moecap_capture(h, 0, ids.get(), nullptr, nullptr) == MOECAP_OK);
    CHECK(stored[0] == -1);  // forked, not run
    REQUIRE(moecap_destroy(h) == MOECAP_OK);
    CHECK(stored[0] == route(500, 0, 0, c.num_experts));  // ran before destroy returned
    fill(ids, c, 7, 0, 1);  // the engine reuses (or frees) its tensor now
  }
  CHECK(stored[0] == route(500, 0, 0, c.num_experts));
  dev->deleter(dev);  // the memory goes here; nothing is left to run
}

TEST_CASE("side stream: kernel-written layer views must not be rewritten before the join") {
  const moecap_config c = side_config(true);
  for (const bool late : {false, true}) {
    CAPTURE(late);
    Handle h(c);
    std::vector<DLManagedTensorVersioned*> views(static_cast<size_t>(c.num_layers));
    auto write_views = [&](int64_t batch) {
      for (int32_t l = 0; l < c.num_layers; ++l) {
        auto* v = static_cast<int16_t*>(views[static_cast<size_t>(l)]->dl_tensor.data);
        for (int32_t k = 0; k < c.top_k; ++k) v[k] = static_cast<int16_t>(route(batch * 100, l, k, c.num_experts));
      }
    };
    for (int32_t l = 0; l < c.num_layers; ++l)
      REQUIRE(moecap_export(h.h, MOECAP_BUFFER_LAYER_IDS, l, &views[static_cast<size_t>(l)]) == MOECAP_OK);
    write_views(1);  // the fused top-k kernel of each layer, no moecap_capture
    HostTensor slots({1}, i64());
    slots.fill<int64_t>({7});
    moecap_commit_args a{sizeof a, 0, nullptr, slots.get()};
    REQUIRE(moecap_commit(h.h, &a, nullptr) == MOECAP_OK);
    if (!late) REQUIRE(moecap_join(h.h, nullptr) == MOECAP_OK);
    write_views(2);  // the next forward's kernels
    if (late) REQUIRE(moecap_join(h.h, nullptr) == MOECAP_OK);
    CHECK((read_slots(h.h, c, {7}) == expected(c, 1, 1)) == !late);
    for (DLManagedTensorVersioned* v : views) v->deleter(v);
  }
}

TEST_CASE("side stream: a moecap graph joins at its end, so each replay is whole") {
  const moecap_config c = side_config(true);
  Handle h(c);
  HostTensor ids({1, c.top_k}, i64());
  HostTensor slots({1}, i64());
  slots.fill<int64_t>({9});
  REQUIRE(moecap_graph_begin(h.h, nullptr) == MOECAP_OK);
  for (int32_t l = 0; l < c.num_layers; ++l) REQUIRE(moecap_capture(h.h, l, ids.get(), nullptr, nullptr) == MOECAP_OK);
  moecap_commit_args a{sizeof a, 0, nullptr, slots.get()};
  REQUIRE(moecap_commit(h.h, &a, nullptr) == MOECAP_OK);
  moecap_graph* g = nullptr;
  REQUIRE(moecap_graph_end(h.h, &g) == MOECAP_OK);
  for (int64_t batch : {4, 5}) {
    fill(ids, c, batch, 0, 1);  // one tensor for every layer: the replay must read it before the next fill
    REQUIRE(moecap_graph_launch(g, nullptr) == MOECAP_OK);
    std::vector<int64_t> want;
    for (int32_t l = 0; l < c.num_layers; ++l)
      for (int32_t k = 0; k < c.top_k; ++k) want.push_back(route(batch * 100, 0, k, c.num_experts));
    CHECK(read_slots(h.h, c, {9}) == want);
  }
  CHECK(moecap_graph_destroy(g) == MOECAP_OK);
}

TEST_CASE("side stream: the flag is known, and moecap_join is in the API table") {
  moecap_config c = small_config();
  c.flags = MOECAP_FLAG_SIDE_STREAM | MOECAP_FLAG_HISTOGRAM;
  moecap_plan_info p{};
  p.struct_size = sizeof p;
  CHECK(moecap_plan(&c, &p) == MOECAP_OK);
  moecap_api api{};
  api.struct_size = sizeof api;
  REQUIRE(moecap_get_api(&api) == MOECAP_OK);
  CHECK((api.join == &moecap_join));
  CHECK(moecap_join(nullptr, nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
}
