// SPDX-License-Identifier: Apache-2.0
// Slots fail closed: a slot without committed routing, or with ids that were
// out of range at capture, reads -1 (never an expert id); moecap_invalidate
// empties slots (also from a graph replay); MOECAP_READ_STRICT turns a slot
// without usable routing into an error. And the layer-major device buffer:
// a "kernel" writes ids straight into the exported layer views, no
// moecap_capture, and commit narrows them into the host cache.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "moecap.h"
#include "tests/support/capturer_handle.h"
#include "tests/support/tensors.h"

using namespace moecap_test;

namespace {

bool error_has(const char* needle) { return std::string(moecap_last_error()).find(needle) != std::string::npos; }

// Captures `n` rows of route(token0 + row, layer, k) in every layer and commits them to `slots`.
void capture_and_commit(moecap_capturer* h, const moecap_config& c, int64_t token0, std::initializer_list<int64_t> slots) {
  const int64_t n = static_cast<int64_t>(slots.size());
  HostTensor ids({n, c.top_k}, i64());
  HostTensor w({n, c.top_k}, f32());
  for (int32_t l = 0; l < c.num_layers; ++l) {
    for (int64_t i = 0; i < n * c.top_k; ++i) {
      ids.set(i, route(token0 + i / c.top_k, l, i % c.top_k, c.num_experts));
      w.as<float>()[i] = 0.5f;
    }
    REQUIRE(moecap_capture(h, l, ids.get(), c.weight_dtype != MOECAP_WEIGHTS_NONE ? w.get() : nullptr, nullptr) ==
            MOECAP_OK);
  }
  HostTensor s({n}, i64());
  int64_t i = 0;
  for (int64_t v : slots) s.set(i++, v);
  moecap_commit_args a{sizeof a, 0, nullptr, s.get()};
  REQUIRE(moecap_commit(h, &a, nullptr) == MOECAP_OK);
}

uint8_t state_of(moecap_capturer* h, int64_t slot) {
  DLManagedTensorVersioned* v = nullptr;
  REQUIRE(moecap_export(h, MOECAP_BUFFER_HOST_STATES, 0, &v) == MOECAP_OK);
  const uint8_t s = static_cast<const uint8_t*>(v->dl_tensor.data)[slot];
  v->deleter(v);
  return s;
}

}  // namespace

TEST_CASE("never-committed and invalidated slots read -1 ids and 0 weights") {
  moecap_config c = small_config();
  c.weight_dtype = MOECAP_WEIGHTS_F32;
  Handle cap(c);
  const int64_t row = c.num_layers * c.top_k;
  capture_and_commit(cap.h, c, 0, {3, 4});
  CHECK(state_of(cap.h, 3) == MOECAP_SLOT_VALID);
  CHECK(state_of(cap.h, 5) == MOECAP_SLOT_EMPTY);

  HostTensor q({3}, i32());
  q.fill<int32_t>({3, 5, 4});  // slot 5: never committed
  HostTensor out({3, c.num_layers, c.top_k}, i16());
  HostTensor w({3, c.num_layers, c.top_k}, f32());
  std::memset(w.as<float>(), 0x7f, static_cast<size_t>(3 * row * 4));
  REQUIRE(moecap_read(cap.h, q.get(), out.get(), w.get(), 0, nullptr) == MOECAP_OK);
  for (int64_t e = 0; e < row; ++e) {
    CHECK(out.at(e) == route(0, e / c.top_k, e % c.top_k, c.num_experts));
    CHECK(out.at(row + e) == -1);
    CHECK(w.as<float>()[row + e] == 0.0f);
    CHECK(out.at(2 * row + e) == route(1, e / c.top_k, e % c.top_k, c.num_experts));
  }

  // The engine frees slot 3's KV (slot -1 entries are ignored).
  HostTensor freed({2}, i64());
  freed.fill<int64_t>({3, -1});
  REQUIRE(moecap_invalidate(cap.h, freed.get(), nullptr) == MOECAP_OK);
  CHECK(state_of(cap.h, 3) == MOECAP_SLOT_EMPTY);
  REQUIRE(moecap_read(cap.h, q.get(), out.get(), w.get(), 0, nullptr) == MOECAP_OK);
  for (int64_t e = 0; e < row; ++e) {
    CHECK(out.at(e) == -1);
    CHECK(w.as<float>()[e] == 0.0f);
    CHECK(out.at(2 * row + e) == route(1, e / c.top_k, e % c.top_k, c.num_experts));
  }
  // A new request's commit makes it valid again.
  capture_and_commit(cap.h, c, 50, {3});
  REQUIRE(moecap_read(cap.h, q.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
  CHECK(out.at(0) == route(50, 0, 0, c.num_experts));
}

TEST_CASE("MOECAP_READ_STRICT: a slot without usable routing is an error, and nothing is written") {
  moecap_config c = small_config();
  Handle cap(c);
  capture_and_commit(cap.h, c, 0, {1, 2});
  HostTensor q({3}, i64());
  q.fill<int64_t>({1, 9, 2});
  HostTensor out({3, c.num_layers, c.top_k}, i32());
  std::memset(out.as<int32_t>(), 0x33, out.bytes().size());
  const std::vector<uint8_t> untouched = out.bytes();
  CHECK(moecap_read(cap.h, q.get(), out.get(), nullptr, MOECAP_READ_STRICT, nullptr) == MOECAP_ERROR_NO_ROUTING);
  CHECK(error_has("slots[1] = 9 holds no committed routing (never committed, or invalidated); 1 of 3 slots"));
  CHECK(out.bytes() == untouched);
  CHECK(std::string(moecap_status_name(MOECAP_ERROR_NO_ROUTING)) == "MOECAP_ERROR_NO_ROUTING");
  q.fill<int64_t>({1, 2, 2});
  CHECK(moecap_read(cap.h, q.get(), out.get(), nullptr, MOECAP_READ_STRICT, nullptr) == MOECAP_OK);
  CHECK(out.at(0) == route(0, 0, 0, c.num_experts));
  CHECK(moecap_read(cap.h, q.get(), out.get(), nullptr, 0x8, nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
}

TEST_CASE("an id out of range at capture reads -1, distinguishable from every real id") {
  for (int32_t experts : {200, 256}) {
    CAPTURE(experts);
    moecap_config c = small_config();
    c.num_experts = experts;
    c.id_dtype = MOECAP_IDS_U8;
    Handle cap(c);
    HostTensor ids({2, c.top_k}, i32());
    ids.fill<int32_t>({255 % experts, -1, 7, 255 % experts});  // token 0 has a bad id in layer 1
    HostTensor good({2, c.top_k}, i32());
    good.fill<int32_t>({255 % experts, 4, 7, 255 % experts});
    for (int32_t l = 0; l < c.num_layers; ++l) {
      REQUIRE(moecap_capture(cap.h, l, l == 1 ? ids.get() : good.get(), nullptr, nullptr) == MOECAP_OK);
    }
    HostTensor slots({2}, i32());
    slots.fill<int32_t>({10, 11});
    moecap_commit_args a{sizeof a, 0, nullptr, slots.get()};
    REQUIRE(moecap_commit(cap.h, &a, nullptr) == MOECAP_OK);
    CHECK(state_of(cap.h, 10) == (MOECAP_SLOT_VALID | MOECAP_SLOT_INVALID_IDS));
    CHECK(state_of(cap.h, 11) == MOECAP_SLOT_VALID);
    HostTensor out({2, c.num_layers, c.top_k}, i32());
    REQUIRE(moecap_read(cap.h, slots.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
    const int64_t row = c.num_layers * c.top_k;
    if (experts == 200) {
      // u8 has a spare value: exactly the bad id reads -1, the rest is real routing.
      CHECK(out.at(0) == 255 % experts);
      CHECK(out.at(c.top_k + 1) == -1);
      CHECK(out.at(c.top_k) == 255 % experts);
    } else {
      // 256 experts fill u8: which id was bad is not stored, so the token has no usable routing.
      for (int64_t e = 0; e < row; ++e) CHECK(out.at(e) == -1);
    }
    for (int64_t e = 0; e < row; ++e) CHECK(out.at(row + e) != -1);  // token 1 is untouched
    CHECK(out.at(row + 1) == 255 % experts);  // with 256 experts, 255 is a real id and reads as one
    CHECK(moecap_read(cap.h, slots.get(), out.get(), nullptr, MOECAP_READ_STRICT, nullptr) == MOECAP_ERROR_NO_ROUTING);
    if (experts == 200) {
      CHECK(error_has("slots[0] = 10 holds ids that were out of range in layer 1 (at capture"));
    } else {
      CHECK(error_has("slots[0] = 10 holds ids that are no real expert"));
      CHECK(error_has("the two cannot be told apart"));
    }
    CHECK_FALSE(error_has("not captured again in that layer before"));
  }
}

TEST_CASE("a row committed again without a new capture fails a strict read naming that cause, not bad ids") {
  moecap_config c = small_config();
  Handle cap(c);
  capture_and_commit(cap.h, c, 0, {3});
  // Layer 0 only is captured again; layer 1's row was consumed by the first commit.
  HostTensor ids({1, c.top_k}, i64());
  for (int64_t k = 0; k < c.top_k; ++k) ids.set(k, route(5, 0, k, c.num_experts));
  REQUIRE(moecap_capture(cap.h, 0, ids.get(), nullptr, nullptr) == MOECAP_OK);
  HostTensor slot({1}, i64());
  slot.set(0, 4);
  moecap_commit_args a{sizeof a, 0, nullptr, slot.get()};
  REQUIRE(moecap_commit(cap.h, &a, nullptr) == MOECAP_OK);
  CHECK(state_of(cap.h, 4) == (MOECAP_SLOT_VALID | MOECAP_SLOT_INVALID_IDS));
  HostTensor out({1, c.num_layers, c.top_k}, i32());
  CHECK(moecap_read(cap.h, slot.get(), out.get(), nullptr, MOECAP_READ_STRICT, nullptr) == MOECAP_ERROR_NO_ROUTING);
  CHECK(error_has("slots[0] = 4 has no routing in layer 1: its row was not captured again in that layer"));
  CHECK_FALSE(error_has("out of range in layer"));
  CHECK_FALSE(error_has("out of range at capture"));
  // An empty slot has its own message.
  slot.set(0, 6);
  CHECK(moecap_read(cap.h, slot.get(), out.get(), nullptr, MOECAP_READ_STRICT, nullptr) == MOECAP_ERROR_NO_ROUTING);
  CHECK(error_has("slots[0] = 6 holds no committed routing (never committed, or invalidated)"));
}

TEST_CASE("an unsigned output where -1 would be a real id is refused unless MOECAP_READ_STRICT") {
  moecap_config c = small_config();
  c.num_experts = 256;
  Handle cap(c);
  capture_and_commit(cap.h, c, 0, {1});
  HostTensor q({1}, i32());
  q.fill<int32_t>({1});
  HostTensor out({1, c.num_layers, c.top_k}, u8());
  CHECK(moecap_read(cap.h, q.get(), out.get(), nullptr, 0, nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(error_has("ids_out has dtype uint8, where -1 (no routing) reads as 255, a real expert id with num_experts 256"));
  REQUIRE(moecap_read(cap.h, q.get(), out.get(), nullptr, MOECAP_READ_STRICT, nullptr) == MOECAP_OK);
  CHECK(out.at(0) == route(0, 0, 0, 256));
  // With 255 experts, u8's 255 is no expert: fine without the flag.
  moecap_config c255 = small_config();
  c255.num_experts = 255;
  Handle cap255(c255);
  REQUIRE(moecap_read(cap255.h, q.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
  CHECK(out.at(0) == 255);  // never committed: -1 as u8
}

TEST_CASE("a slot listed twice in one commit or write keeps its last row") {
  moecap_config c = small_config();
  c.weight_dtype = MOECAP_WEIGHTS_F32;
  Handle cap(c);
  HostTensor ids({3, c.top_k}, i32());
  HostTensor w({3, c.top_k}, f32());
  ids.fill<int32_t>({1, 2, 3, 4, 5, 6});
  w.fill<float>({0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f});
  for (int32_t l = 0; l < c.num_layers; ++l) REQUIRE(moecap_capture(cap.h, l, ids.get(), w.get(), nullptr) == MOECAP_OK);
  HostTensor slots({3}, i32());
  slots.fill<int32_t>({7, 8, 7});
  moecap_commit_args a{sizeof a, 0, nullptr, slots.get()};
  REQUIRE(moecap_commit(cap.h, &a, nullptr) == MOECAP_OK);
  HostTensor q({1}, i32());
  q.fill<int32_t>({7});
  HostTensor out({1, c.num_layers, c.top_k}, i32());
  HostTensor wout({1, c.num_layers, c.top_k}, f32());
  REQUIRE(moecap_read(cap.h, q.get(), out.get(), wout.get(), 0, nullptr) == MOECAP_OK);
  CHECK(out.at(0) == 5);
  CHECK(out.at(1) == 6);
  CHECK(wout.as<float>()[1] == 0.6f);

  HostTensor wslots({2}, i32());
  wslots.fill<int32_t>({9, 9});
  HostTensor rows({2, c.num_layers, c.top_k}, i32());
  HostTensor rw({2, c.num_layers, c.top_k}, f32());
  for (int64_t i = 0; i < rows.numel(); ++i) rows.set(i, i < rows.numel() / 2 ? 1 : 2);
  REQUIRE(moecap_write(cap.h, wslots.get(), rows.get(), rw.get(), nullptr) == MOECAP_OK);
  q.fill<int32_t>({9});
  REQUIRE(moecap_read(cap.h, q.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
  CHECK(out.at(0) == 2);
}

TEST_CASE("write marks its slots: real rows valid, all -1 rows empty, some -1 rows invalid ids") {
  moecap_config c = small_config();
  Handle cap(c);
  const int64_t row = c.num_layers * c.top_k;
  HostTensor slots({3}, i64());
  slots.fill<int64_t>({20, 21, 22});
  HostTensor ids({3, c.num_layers, c.top_k}, i16());
  for (int64_t e = 0; e < row; ++e) {
    ids.set(e, 3);
    ids.set(row + e, -1);
    ids.set(2 * row + e, e == 0 ? -1 : 2);
  }
  REQUIRE(moecap_write(cap.h, slots.get(), ids.get(), nullptr, nullptr) == MOECAP_OK);
  CHECK(state_of(cap.h, 20) == MOECAP_SLOT_VALID);
  CHECK(state_of(cap.h, 21) == MOECAP_SLOT_EMPTY);
  CHECK(state_of(cap.h, 22) == (MOECAP_SLOT_VALID | MOECAP_SLOT_INVALID_IDS));
  HostTensor out({3, c.num_layers, c.top_k}, i64());
  REQUIRE(moecap_read(cap.h, slots.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
  CHECK(out.at(0) == 3);
  CHECK(out.at(row) == -1);
  CHECK(out.at(2 * row) == -1);
  CHECK(out.at(2 * row + 1) == 2);
}

TEST_CASE("write takes back what a read into uint8 or uint16 gave: all ones is -1 where it is no expert id") {
  for (DLDataType dtype : {u8(), u16()}) {
    CAPTURE(static_cast<int>(dtype.bits));
    moecap_config c = small_config();
    Handle cap(c);
    const int64_t row = c.num_layers * c.top_k;
    capture_and_commit(cap.h, c, 0, {1});
    HostTensor slots({2}, i64());
    slots.fill<int64_t>({1, 5});  // committed; never committed
    HostTensor out({2, c.num_layers, c.top_k}, dtype);
    REQUIRE(moecap_read(cap.h, slots.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
    CHECK(out.at(row) == (dtype.bits == 8 ? 0xFF : 0xFFFF));
    HostTensor to({2}, i64());
    to.fill<int64_t>({10, 11});
    REQUIRE_MESSAGE(moecap_write(cap.h, to.get(), out.get(), nullptr, nullptr) == MOECAP_OK,
                    std::string(moecap_last_error()));
    CHECK(state_of(cap.h, 10) == MOECAP_SLOT_VALID);
    CHECK(state_of(cap.h, 11) == MOECAP_SLOT_EMPTY);
    HostTensor back({2, c.num_layers, c.top_k}, i64());
    REQUIRE(moecap_read(cap.h, to.get(), back.get(), nullptr, 0, nullptr) == MOECAP_OK);
    for (int64_t e = 0; e < row; ++e) {
      CHECK(back.at(e) == route(0, e / c.top_k, e % c.top_k, c.num_experts));
      CHECK(back.at(row + e) == -1);
    }
  }
  // With 256 experts a uint8 255 is expert 255. With 255 it is -1 in uint8,
  // and out of range in uint16, whose all ones is 65535.
  moecap_config c = small_config();
  c.num_experts = 256;
  Handle cap(c);
  HostTensor to({1}, i64());
  to.fill<int64_t>({3});
  HostTensor ids({1, c.num_layers, c.top_k}, u8());
  for (int64_t e = 0; e < ids.numel(); ++e) ids.set(e, 255);
  REQUIRE(moecap_write(cap.h, to.get(), ids.get(), nullptr, nullptr) == MOECAP_OK);
  CHECK(state_of(cap.h, 3) == MOECAP_SLOT_VALID);
  HostTensor back({1, c.num_layers, c.top_k}, i64());
  REQUIRE(moecap_read(cap.h, to.get(), back.get(), nullptr, 0, nullptr) == MOECAP_OK);
  CHECK(back.at(0) == 255);
  moecap_config small = small_config();
  small.num_experts = 255;
  Handle cap255(small);
  ids.set(0, 254);
  REQUIRE(moecap_write(cap255.h, to.get(), ids.get(), nullptr, nullptr) == MOECAP_OK);
  CHECK(state_of(cap255.h, 3) == (MOECAP_SLOT_VALID | MOECAP_SLOT_INVALID_IDS));
  HostTensor u16ids({1, c.num_layers, c.top_k}, u16());
  for (int64_t e = 0; e < u16ids.numel(); ++e) u16ids.set(e, 255);
  CHECK(moecap_write(cap255.h, to.get(), u16ids.get(), nullptr, nullptr) == MOECAP_ERROR_OUT_OF_RANGE);
  CHECK(error_has("moecap_write: ids[0][0][0] is 255; ids must be in [0, num_experts = 255) or -1"));
}

TEST_CASE("invalidate refuses bad input and changes nothing") {
  moecap_config c = small_config();
  Handle cap(c);
  capture_and_commit(cap.h, c, 0, {1, 2});
  const std::vector<uint8_t> before = snapshot(cap.h);
  HostTensor bad({2}, i32());
  bad.fill<int32_t>({1, 32});
  CHECK(moecap_invalidate(cap.h, bad.get(), nullptr) == MOECAP_ERROR_OUT_OF_RANGE);
  CHECK(error_has("moecap_invalidate: slots[1] is 32; it must be in [-1, 32)"));
  HostTensor floats({2}, f32());
  CHECK(moecap_invalidate(cap.h, floats.get(), nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(moecap_invalidate(cap.h, nullptr, nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(moecap_invalidate(nullptr, bad.get(), nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(snapshot(cap.h) == before);
  HostTensor none({0}, i64());
  CHECK(moecap_invalidate(cap.h, none.get(), nullptr) == MOECAP_OK);
  CHECK(snapshot(cap.h) == before);
}

TEST_CASE("a graph that invalidates: slots are read at replay time") {
  moecap_config c = small_config();
  Handle cap(c);
  capture_and_commit(cap.h, c, 0, {1, 2, 3});
  HostTensor freed({2}, i64());
  freed.fill<int64_t>({1, -1});
  moecap_graph* g = nullptr;
  REQUIRE(moecap_graph_begin(cap.h, nullptr) == MOECAP_OK);
  REQUIRE(moecap_invalidate(cap.h, freed.get(), nullptr) == MOECAP_OK);
  REQUIRE(moecap_graph_end(cap.h, &g) == MOECAP_OK);
  CHECK(state_of(cap.h, 1) == MOECAP_SLOT_VALID);  // recording ran nothing
  freed.fill<int64_t>({2, 3});
  REQUIRE(moecap_graph_launch(g, nullptr) == MOECAP_OK);
  CHECK(state_of(cap.h, 1) == MOECAP_SLOT_VALID);
  CHECK(state_of(cap.h, 2) == MOECAP_SLOT_EMPTY);
  CHECK(state_of(cap.h, 3) == MOECAP_SLOT_EMPTY);
  // A slot out of range at replay is skipped and counted, as in a commit.
  freed.fill<int64_t>({1, 99});
  REQUIRE(moecap_graph_launch(g, nullptr) == MOECAP_OK);
  CHECK(state_of(cap.h, 1) == MOECAP_SLOT_EMPTY);
  moecap_error_counts e{};
  e.struct_size = sizeof e;
  REQUIRE(moecap_get_errors(cap.h, &e, MOECAP_ERRORS_CLEAR) == MOECAP_OK);
  CHECK(e.skipped_rows == 1);
  HostTensor q({1}, i32());
  q.fill<int32_t>({2});
  HostTensor out({1, c.num_layers, c.top_k}, i32());
  REQUIRE(moecap_read(cap.h, q.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
  CHECK(out.at(0) == -1);
  REQUIRE(moecap_graph_destroy(g) == MOECAP_OK);
}

TEST_CASE("layer-major export end to end: a kernel writes each layer's view, commit narrows, read matches") {
  for (int32_t device_dtype : {MOECAP_IDS_I16, MOECAP_IDS_I32}) {
    CAPTURE(device_dtype);
    moecap_config c = small_config();
    c.num_experts = 256;
    c.weight_dtype = MOECAP_WEIGHTS_BF16;
    c.device_id_dtype = device_dtype;
    Handle cap(c);
    moecap_plan_info info{};
    info.struct_size = sizeof info;
    REQUIRE(moecap_get_plan(cap.h, &info) == MOECAP_OK);
    CHECK(info.id_dtype == MOECAP_IDS_U8);  // compact host cache, wider device buffer
    CHECK(info.device_id_bytes == (device_dtype == MOECAP_IDS_I16 ? 2 : 4));
    const int64_t n = 5;
    for (int32_t l = 0; l < c.num_layers; ++l) {
      DLManagedTensorVersioned* ids = nullptr;
      DLManagedTensorVersioned* w = nullptr;
      REQUIRE(moecap_export(cap.h, MOECAP_BUFFER_LAYER_IDS, l, &ids) == MOECAP_OK);
      REQUIRE(moecap_export(cap.h, MOECAP_BUFFER_LAYER_WEIGHTS, l, &w) == MOECAP_OK);
      // What a top-k kernel's out= needs: a compact [rows, top_k] tensor.
      const DLTensor& t = ids->dl_tensor;
      REQUIRE(t.ndim == 2);
      CHECK(t.shape[0] == info.device_rows);
      CHECK(t.shape[1] == c.top_k);
      CHECK(t.strides[0] == c.top_k);
      CHECK(t.strides[1] == 1);
      CHECK(t.dtype.code == kDLInt);
      // The "kernel": rows [0, n) of this layer, ids and bf16 weights.
      for (int64_t r = 0; r < n; ++r)
        for (int32_t k = 0; k < c.top_k; ++k) {
          const int64_t id = route(r, l, k, c.num_experts);
          if (t.dtype.bits == 16) {
            static_cast<int16_t*>(t.data)[r * c.top_k + k] = static_cast<int16_t>(id);
          } else {
            static_cast<int32_t*>(t.data)[r * c.top_k + k] = static_cast<int32_t>(id);
          }
          static_cast<uint16_t*>(w->dl_tensor.data)[r * c.top_k + k] = 0x3f00;  // bf16 0.5
        }
      ids->deleter(ids);
      w->deleter(w);
    }
    HostTensor rows({n}, i32());
    rows.fill<int32_t>({4, 0, 2, 1, 3});
    HostTensor slots({n}, i64());
    slots.fill<int64_t>({30, 10, 12, 11, 31});
    moecap_commit_args a{sizeof a, 0, rows.get(), slots.get()};
    REQUIRE(moecap_commit(cap.h, &a, nullptr) == MOECAP_OK);
    HostTensor out({n, c.num_layers, c.top_k}, i32());
    HostTensor wout({n, c.num_layers, c.top_k}, f32());
    REQUIRE(moecap_read(cap.h, slots.get(), out.get(), wout.get(), MOECAP_READ_STRICT, nullptr) == MOECAP_OK);
    for (int64_t t = 0; t < n; ++t)
      for (int32_t l = 0; l < c.num_layers; ++l)
        for (int32_t k = 0; k < c.top_k; ++k) {
          const int64_t at = (t * c.num_layers + l) * c.top_k + k;
          REQUIRE(out.at(at) == route(rows.at(t), l, k, c.num_experts));
          REQUIRE(wout.as<float>()[at] == 0.5f);
        }
    moecap_error_counts e{};
    e.struct_size = sizeof e;
    REQUIRE(moecap_get_errors(cap.h, &e, 0) == MOECAP_OK);
    CHECK(e.invalid_ids == 0);
  }
}

// Writes route(row, layer, k) into rows [0, n) of every layer's view (weights 0.5), as a top-k kernel would.
static void kernel_writes(moecap_capturer* h, const moecap_config& c, int64_t n, int32_t only_layer = -1) {
  for (int32_t l = 0; l < c.num_layers; ++l) {
    if (only_layer >= 0 && l != only_layer) continue;
    DLManagedTensorVersioned* v = nullptr;
    REQUIRE(moecap_export(h, MOECAP_BUFFER_LAYER_IDS, l, &v) == MOECAP_OK);
    for (int64_t i = 0; i < n * c.top_k; ++i)
      static_cast<int16_t*>(v->dl_tensor.data)[i] = static_cast<int16_t>(route(i / c.top_k, l, i % c.top_k, c.num_experts));
    v->deleter(v);
    if (c.weight_dtype == MOECAP_WEIGHTS_NONE) continue;
    REQUIRE(moecap_export(h, MOECAP_BUFFER_LAYER_WEIGHTS, l, &v) == MOECAP_OK);
    for (int64_t i = 0; i < n * c.top_k; ++i) static_cast<float*>(v->dl_tensor.data)[i] = 0.5f;
    v->deleter(v);
  }
}

static void commit_range(moecap_capturer* h, std::initializer_list<int64_t> slot_list) {
  HostTensor slots({static_cast<int64_t>(slot_list.size())}, i64());
  int64_t i = 0;
  for (int64_t v : slot_list) slots.set(i++, v);
  moecap_commit_args a{sizeof a, 0, nullptr, slots.get()};
  REQUIRE(moecap_commit(h, &a, nullptr) == MOECAP_OK);
}

static unsigned long long invalid_ids_of(moecap_capturer* h) {
  moecap_error_counts e{};
  e.struct_size = sizeof e;
  REQUIRE(moecap_get_errors(h, &e, MOECAP_ERRORS_CLEAR) == MOECAP_OK);
  return e.invalid_ids;
}

TEST_CASE("a bad id a kernel wrote into a layer view is caught at commit, counted, and carries no weight") {
  moecap_config c = small_config();
  c.weight_dtype = MOECAP_WEIGHTS_F32;
  Handle cap(c);
  kernel_writes(cap.h, c, 2);
  DLManagedTensorVersioned* v = nullptr;
  REQUIRE(moecap_export(cap.h, MOECAP_BUFFER_LAYER_IDS, 1, &v) == MOECAP_OK);
  static_cast<int16_t*>(v->dl_tensor.data)[1] = -7;  // row 0, column 1: no such expert
  static_cast<int16_t*>(v->dl_tensor.data)[2] = static_cast<int16_t>(c.num_experts + 4);  // row 1, column 0
  v->deleter(v);
  commit_range(cap.h, {3, 4});
  CHECK(invalid_ids_of(cap.h) == 2);
  CHECK(state_of(cap.h, 3) == (MOECAP_SLOT_VALID | MOECAP_SLOT_INVALID_IDS));
  CHECK(state_of(cap.h, 4) == (MOECAP_SLOT_VALID | MOECAP_SLOT_INVALID_IDS));
  HostTensor slots({2}, i32());
  slots.fill<int32_t>({3, 4});
  HostTensor out({2, c.num_layers, c.top_k}, i32());
  HostTensor w({2, c.num_layers, c.top_k}, f32());
  REQUIRE(moecap_read(cap.h, slots.get(), out.get(), w.get(), 0, nullptr) == MOECAP_OK);
  const int64_t row = c.num_layers * c.top_k;
  for (int64_t e = 0; e < 2 * row; ++e) {
    const bool bad = e == c.top_k + 1 || e == row + c.top_k;
    CHECK(out.at(e) == (bad ? -1 : route(e / row, (e % row) / c.top_k, e % c.top_k, c.num_experts)));
    CHECK(w.as<float>()[e] == (bad ? 0.0f : 0.5f));  // -1 never carries a weight
  }
  CHECK(moecap_read(cap.h, slots.get(), out.get(), w.get(), MOECAP_READ_STRICT, nullptr) == MOECAP_ERROR_NO_ROUTING);
}

TEST_CASE("rows are consumed by commit: rows never written since the last commit are no routing") {
  moecap_config c = small_config();
  c.weight_dtype = MOECAP_WEIGHTS_F32;
  Handle cap(c);
  HostTensor q({3}, i64());
  q.fill<int64_t>({0, 1, 2});
  HostTensor out({3, c.num_layers, c.top_k}, i32());
  HostTensor w({3, c.num_layers, c.top_k}, f32());
  const int64_t row = c.num_layers * c.top_k;

  SUBCASE("rows never captured") {
    commit_range(cap.h, {0, 1, 2});
    CHECK(state_of(cap.h, 0) == (MOECAP_SLOT_VALID | MOECAP_SLOT_INVALID_IDS));
    CHECK(moecap_read(cap.h, q.get(), out.get(), w.get(), MOECAP_READ_STRICT, nullptr) == MOECAP_ERROR_NO_ROUTING);
    REQUIRE(moecap_read(cap.h, q.get(), out.get(), w.get(), 0, nullptr) == MOECAP_OK);
    for (int64_t e = 0; e < 3 * row; ++e) {
      CHECK(out.at(e) == -1);
      CHECK(w.as<float>()[e] == 0.0f);
    }
    CHECK(invalid_ids_of(cap.h) == 0);  // no routing is not a bad id
  }
  SUBCASE("only layer 0 written") {
    kernel_writes(cap.h, c, 3, 0);
    commit_range(cap.h, {0, 1, 2});
    CHECK(state_of(cap.h, 1) == (MOECAP_SLOT_VALID | MOECAP_SLOT_INVALID_IDS));
    CHECK(moecap_read(cap.h, q.get(), out.get(), w.get(), MOECAP_READ_STRICT, nullptr) == MOECAP_ERROR_NO_ROUTING);
    REQUIRE(moecap_read(cap.h, q.get(), out.get(), w.get(), 0, nullptr) == MOECAP_OK);
    for (int64_t e = 0; e < 3 * row; ++e) {
      const bool layer0 = (e % row) < c.top_k;
      CHECK(out.at(e) == (layer0 ? route(e / row, 0, e % c.top_k, c.num_experts) : -1));
    }
  }
  SUBCASE("a second request never reads the first one's rows") {
    capture_and_commit(cap.h, c, 0, {0, 1, 2});
    REQUIRE(moecap_read(cap.h, q.get(), out.get(), w.get(), MOECAP_READ_STRICT, nullptr) == MOECAP_OK);
    REQUIRE(moecap_invalidate(cap.h, q.get(), nullptr) == MOECAP_OK);
    // Step 2 captures one row and commits three to the same slots.
    HostTensor ids({1, c.top_k}, i64());
    HostTensor ws({1, c.top_k}, f32());
    for (int32_t l = 0; l < c.num_layers; ++l) {
      for (int32_t k = 0; k < c.top_k; ++k) ids.set(k, route(100, l, k, c.num_experts));
      REQUIRE(moecap_capture(cap.h, l, ids.get(), ws.get(), nullptr) == MOECAP_OK);
    }
    commit_range(cap.h, {0, 1, 2});
    CHECK(state_of(cap.h, 0) == MOECAP_SLOT_VALID);
    CHECK(state_of(cap.h, 1) == (MOECAP_SLOT_VALID | MOECAP_SLOT_INVALID_IDS));
    CHECK(state_of(cap.h, 2) == (MOECAP_SLOT_VALID | MOECAP_SLOT_INVALID_IDS));
    CHECK(moecap_read(cap.h, q.get(), out.get(), w.get(), MOECAP_READ_STRICT, nullptr) == MOECAP_ERROR_NO_ROUTING);
    REQUIRE(moecap_read(cap.h, q.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
    for (int64_t e = row; e < 3 * row; ++e) CHECK(out.at(e) == -1);
  }
  SUBCASE("the device views show no routing after commit") {
    kernel_writes(cap.h, c, 3);
    commit_range(cap.h, {0, 1, 2});
    for (int32_t l = 0; l < c.num_layers; ++l) {
      DLManagedTensorVersioned* v = nullptr;
      REQUIRE(moecap_export(cap.h, MOECAP_BUFFER_LAYER_IDS, l, &v) == MOECAP_OK);
      for (int64_t i = 0; i < 3 * c.top_k; ++i) CHECK(static_cast<int16_t*>(v->dl_tensor.data)[i] == -1);
      v->deleter(v);
      REQUIRE(moecap_export(cap.h, MOECAP_BUFFER_LAYER_WEIGHTS, l, &v) == MOECAP_OK);
      for (int64_t i = 0; i < 3 * c.top_k; ++i) CHECK(static_cast<float*>(v->dl_tensor.data)[i] == 0.0f);
      v->deleter(v);
    }
    REQUIRE(moecap_read(cap.h, q.get(), out.get(), w.get(), MOECAP_READ_STRICT, nullptr) == MOECAP_OK);
  }
}

TEST_CASE("a row listed twice in one commit is read twice before it is consumed") {
  moecap_config c = small_config();
  Handle cap(c);
  kernel_writes(cap.h, c, 2);
  HostTensor rows({3}, i64());
  rows.fill<int64_t>({1, 1, 0});
  HostTensor slots({3}, i64());
  slots.fill<int64_t>({5, 6, 7});
  moecap_commit_args a{sizeof a, 0, rows.get(), slots.get()};
  REQUIRE(moecap_commit(cap.h, &a, nullptr) == MOECAP_OK);
  HostTensor out({3, c.num_layers, c.top_k}, i32());
  REQUIRE(moecap_read(cap.h, slots.get(), out.get(), nullptr, MOECAP_READ_STRICT, nullptr) == MOECAP_OK);
  const int64_t row = c.num_layers * c.top_k;
  for (int64_t e = 0; e < row; ++e) {
    CHECK(out.at(e) == route(1, e / c.top_k, e % c.top_k, c.num_experts));
    CHECK(out.at(row + e) == route(1, e / c.top_k, e % c.top_k, c.num_experts));
  }
}

TEST_CASE("device_id_dtype: AUTO is signed; an explicit one needs a value beyond the ids") {
  moecap_config c = small_config();
  moecap_plan_info info{};
  info.struct_size = sizeof info;
  c.num_experts = 40000;
  c.top_k = 2;
  REQUIRE(moecap_plan(&c, &info) == MOECAP_OK);
  CHECK(info.device_id_dtype == MOECAP_IDS_I32);
  CHECK(info.id_dtype == MOECAP_IDS_U16);
  c.num_experts = 256;
  c.device_id_dtype = MOECAP_IDS_U8;
  CHECK(moecap_plan(&c, &info) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(error_has("config->device_id_dtype holds 255 expert ids besides its \"no expert\" value; num_experts is 256"));
  c.num_experts = 255;
  REQUIRE(moecap_plan(&c, &info) == MOECAP_OK);
  CHECK(info.device_id_bytes == 1);
  c.device_id_dtype = 9;
  CHECK(moecap_plan(&c, &info) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(error_has("config->device_id_dtype is 9"));
  c.device_id_dtype = MOECAP_IDS_I16;
  c.num_experts = 32769;
  CHECK(moecap_plan(&c, &info) == MOECAP_ERROR_INVALID_ARGUMENT);
}
