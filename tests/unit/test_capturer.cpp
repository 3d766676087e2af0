// SPDX-License-Identifier: Apache-2.0
// capture -> commit -> read through the C ABI on the host backend: round
// trips for every dtype, and every entry point's bad input refused with the
// right status, a message naming the argument, and no buffer changed.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "moecap.h"
#include "tests/support/tensors.h"

using namespace moecap_test;

namespace {

struct Capturer {
  explicit Capturer(const moecap_config& c) { REQUIRE(moecap_create(&c, &h) == MOECAP_OK); }
  ~Capturer() { moecap_destroy(h); }
  moecap_capturer* h = nullptr;
};

// Fills ids [n, cols] with route(token0 + row, layer, k); extra columns get fused-expert ids.
void fill_ids(HostTensor& ids, int64_t token0, int32_t layer, int32_t top_k, int32_t experts) {
  const int64_t n = ids.dl().shape[0], cols = ids.dl().shape[1];
  for (int64_t r = 0; r < n; ++r)
    for (int64_t k = 0; k < cols; ++k)
      ids.set(r * cols + k, k < top_k ? route(token0 + r, layer, k, experts) : experts + (k - top_k));
}

moecap_commit_args range_commit(DLTensor* slots, int64_t start) {
  return moecap_commit_args{sizeof(moecap_commit_args), start, nullptr, slots};
}

}  // namespace

TEST_CASE("round trip capture -> commit -> read for every stored and output id dtype") {
  for (int32_t stored : {MOECAP_IDS_U8, MOECAP_IDS_U16, MOECAP_IDS_I32}) {
    for (DLDataType in : {i32(), i64()}) {
      for (DLDataType out : {u8(), u16(), i32(), i64(), DLDataType{kDLInt, 8, 1}, DLDataType{kDLInt, 16, 1}}) {
        CAPTURE(stored);
        CAPTURE(int(in.bits));
        CAPTURE(int(out.bits));
        moecap_config c = small_config();
        c.id_dtype = stored;
        c.extra_columns = 1;
        Capturer cap(c);
        const int64_t n = 5;
        HostTensor ids({n, c.top_k + c.extra_columns}, in);
        for (int32_t l = 0; l < c.num_layers; ++l) {
          fill_ids(ids, 100, l, c.top_k, c.num_experts);
          REQUIRE(moecap_capture(cap.h, l, ids.get(), nullptr, nullptr) == MOECAP_OK);
        }
        HostTensor slots({n}, i64());
        slots.fill<int64_t>({7, -1, 3, 30, 12});
        moecap_commit_args a = range_commit(slots.get(), 0);
        REQUIRE(moecap_commit(cap.h, &a, nullptr) == MOECAP_OK);
        HostTensor want({4}, i32());
        want.fill<int32_t>({3, 7, 12, 30});
        HostTensor got({4, c.num_layers, c.top_k}, out);
        REQUIRE(moecap_read(cap.h, want.get(), got.get(), nullptr, 0, nullptr) == MOECAP_OK);
        const int64_t row_of_slot[] = {2, 0, 4, 3};  // rows that went to slots 3, 7, 12, 30
        for (int64_t t = 0; t < 4; ++t)
          for (int32_t l = 0; l < c.num_layers; ++l)
            for (int32_t k = 0; k < c.top_k; ++k)
              REQUIRE(got.at((t * c.num_layers + l) * c.top_k + k) == route(100 + row_of_slot[t], l, k, c.num_experts));
      }
    }
  }
}

// The decode and prefill commit (a row range, no weights) at top-8, 6, 4,
// 2 and 1 from int16 and u8 device ids into u8 host ids, and at top-8 from
// int16 into u16 ones (384 experts), with enough rows and layers
// for every part of its one-pass kernel (passes of layers and blocks of
// rows, the single layers and rows after them), a slot two rows go to, rows
// sent nowhere, and a row with an id outside at capture.
TEST_CASE("a top-8, 6, 4, 2 or 1 range commit from int16 or u8 device ids reads back what was captured") {
  struct Case {
    int32_t device_dtype, experts, top_k;
  };
  for (const Case cs : {Case{MOECAP_IDS_AUTO, 200, 8}, Case{MOECAP_IDS_AUTO, 256, 8}, Case{MOECAP_IDS_U8, 200, 8},
                        Case{MOECAP_IDS_U8, 255, 8}, Case{MOECAP_IDS_AUTO, 256, 4}, Case{MOECAP_IDS_U8, 200, 4},
                        Case{MOECAP_IDS_AUTO, 200, 2}, Case{MOECAP_IDS_U8, 255, 2}, Case{MOECAP_IDS_AUTO, 160, 6},
                        Case{MOECAP_IDS_U8, 64, 6}, Case{MOECAP_IDS_AUTO, 128, 1}, Case{MOECAP_IDS_U8, 16, 1},
                        Case{MOECAP_IDS_AUTO, 384, 8}}) {
    CAPTURE(cs.device_dtype);
    CAPTURE(cs.experts);
    CAPTURE(cs.top_k);
    moecap_config c = small_config();
    c.num_layers = 9;
    c.top_k = cs.top_k;
    c.num_experts = cs.experts;
    c.device_id_dtype = cs.device_dtype;
    c.chunked_prefill_size = 64;
    c.host_slots = 128;
    Capturer cap(c);
    const int64_t n = 39;
    HostTensor ids({n, c.top_k}, i32());
    for (int32_t l = 0; l < c.num_layers; ++l) {
      fill_ids(ids, 500, l, c.top_k, c.num_experts);
      if (l == 5) ids.set(21 * c.top_k + c.top_k - 1, c.num_experts);  // row 21, layer 5: outside, counted at capture
      REQUIRE(moecap_capture(cap.h, l, ids.get(), nullptr, nullptr) == MOECAP_OK);
    }
    // Rows 0..36 of the range starting at row 2: row j to slot 3 j + 1, but
    // rows 5 and 30 to no slot, and row 10 to row 9's slot (the later wins;
    // they are middle rows of a block at every top-k).
    const int64_t count = n - 2;
    HostTensor slots({count}, i64());
    for (int64_t j = 0; j < count; ++j) slots.set(j, j == 5 || j == 30 ? -1 : j == 10 ? 3 * 9 + 1 : 3 * j + 1);
    moecap_commit_args a = range_commit(slots.get(), 2);
    REQUIRE(moecap_commit(cap.h, &a, nullptr) == MOECAP_OK);
    for (int64_t j = 0; j < count; ++j) {
      if (j == 5 || j == 30 || j == 9) continue;
      CAPTURE(j);
      const int64_t slot = j == 10 ? 3 * 9 + 1 : 3 * j + 1;
      const int64_t token = 2 + j;
      HostTensor want({1}, i64());
      want.set(0, slot);
      HostTensor got({1, c.num_layers, c.top_k}, i32());
      const moecap_status strict = moecap_read(cap.h, want.get(), got.get(), nullptr, MOECAP_READ_STRICT, nullptr);
      CHECK(strict == (token == 21 ? MOECAP_ERROR_NO_ROUTING : MOECAP_OK));
      REQUIRE(moecap_read(cap.h, want.get(), got.get(), nullptr, 0, nullptr) == MOECAP_OK);
      for (int32_t l = 0; l < c.num_layers; ++l) {
        for (int32_t k = 0; k < c.top_k; ++k) {
          // With 256 experts a u8 cache has no spare value: the whole token reads -1.
          const bool bad = token == 21 && (cs.experts == 256 || (l == 5 && k == c.top_k - 1));
          const int64_t expected = bad ? -1 : route(500 + token, l, k, c.num_experts);
          CAPTURE(l);
          CAPTURE(k);
          REQUIRE(got.at(l * c.top_k + k) == expected);
        }
      }
    }
    // Every row the range named is consumed: the views show no routing.
    for (int32_t l = 0; l < c.num_layers; ++l) {
      DLManagedTensorVersioned* v = nullptr;
      REQUIRE(moecap_export(cap.h, MOECAP_BUFFER_LAYER_IDS, l, &v) == MOECAP_OK);
      const bool wide = v->dl_tensor.dtype.bits == 16;
      auto id_at = [&](int64_t e) -> int64_t {
        return wide ? static_cast<const int16_t*>(v->dl_tensor.data)[e] : static_cast<const uint8_t*>(v->dl_tensor.data)[e];
      };
      const int64_t none = wide ? -1 : 0xff;
      bool consumed = true, kept = true;
      for (int64_t e = 2 * c.top_k; e < n * c.top_k; ++e) consumed = consumed && id_at(e) == none;
      for (int64_t e = 0; e < 2 * c.top_k; ++e) kept = kept && id_at(e) != none;  // rows 0-1: not named
      CHECK(consumed);
      CHECK(kept);
      v->deleter(v);
    }
  }
}

TEST_CASE("weights are converted to the stored dtype and back") {
  for (int32_t stored : {MOECAP_WEIGHTS_F32, MOECAP_WEIGHTS_BF16, MOECAP_WEIGHTS_F16}) {
    CAPTURE(stored);
    moecap_config c = small_config();
    c.weight_dtype = stored;
    Capturer cap(c);
    HostTensor ids({2, c.top_k}, i32());
    HostTensor w({2, c.top_k}, f32());
    ids.fill<int32_t>({1, 2, 3, 4});
    w.fill<float>({0.5f, 0.25f, 0.7f, 0.3f});
    for (int32_t l = 0; l < c.num_layers; ++l) REQUIRE(moecap_capture(cap.h, l, ids.get(), w.get(), nullptr) == MOECAP_OK);
    HostTensor slots({2}, i32());
    slots.fill<int32_t>({4, 5});
    moecap_commit_args a = range_commit(slots.get(), 0);
    REQUIRE(moecap_commit(cap.h, &a, nullptr) == MOECAP_OK);
    HostTensor got({2, c.num_layers, c.top_k}, i32());
    HostTensor gw({2, c.num_layers, c.top_k}, f32());
    REQUIRE(moecap_read(cap.h, slots.get(), got.get(), gw.get(), 0, nullptr) == MOECAP_OK);
    const float tol = stored == MOECAP_WEIGHTS_F32 ? 0.0f : stored == MOECAP_WEIGHTS_BF16 ? 4e-3f : 5e-4f;
    CHECK(std::fabs(gw.as<float>()[0] - 0.5f) <= tol);
    CHECK(std::fabs(gw.as<float>()[c.num_layers * c.top_k + 1] - 0.3f) <= tol);
    CHECK(got.as<int32_t>()[c.num_layers * c.top_k + 1] == 4);
    // Reading without weights is fine; asking for weights of a capturer without them is not.
  }
}

TEST_CASE("row lists commit accepted speculative tokens in any order") {
  moecap_config c = small_config();
  c.verify_tokens = 4;
  Capturer cap(c);
  const int64_t n = 8;
  HostTensor ids({n, c.top_k}, i64());
  for (int32_t l = 0; l < c.num_layers; ++l) {
    fill_ids(ids, 0, l, c.top_k, c.num_experts);
    REQUIRE(moecap_capture(cap.h, l, ids.get(), nullptr, nullptr) == MOECAP_OK);
  }
  HostTensor rows({3}, i32());
  rows.fill<int32_t>({6, 1, 3});  // tree acceptance: not contiguous, not sorted
  HostTensor slots({3}, i64());
  slots.fill<int64_t>({20, 21, 22});
  moecap_commit_args a{sizeof a, 0, rows.get(), slots.get()};
  REQUIRE(moecap_commit(cap.h, &a, nullptr) == MOECAP_OK);
  HostTensor got({3, c.num_layers, c.top_k}, i32());
  REQUIRE(moecap_read(cap.h, slots.get(), got.get(), nullptr, 0, nullptr) == MOECAP_OK);
  for (int64_t t = 0; t < 3; ++t) CHECK(got.at(t * c.num_layers * c.top_k) == route(rows.at(t), 0, 0, c.num_experts));
}

TEST_CASE("ids outside [0, num_experts) are stored as 'no expert', read as -1 and counted, but for -1 itself") {
  for (int path = 0; path < 3; ++path) {  // int32, int64, and with weights: each narrows its own way
    CAPTURE(path);
    moecap_config c = small_config();
    if (path == 2) c.weight_dtype = MOECAP_WEIGHTS_F32;
    Capturer cap(c);
    HostTensor ids({1, c.top_k}, path == 1 ? i64() : i32());
    ids.set(0, -1);  // an engine's padded row: "no expert" already
    ids.set(1, 99);
    HostTensor w({1, c.top_k}, f32());
    DLTensor* weights = path == 2 ? w.get() : nullptr;
    for (int32_t l = 0; l < c.num_layers; ++l) REQUIRE(moecap_capture(cap.h, l, ids.get(), weights, nullptr) == MOECAP_OK);
    HostTensor slots({1}, i32());
    slots.fill<int32_t>({0});
    moecap_commit_args a = range_commit(slots.get(), 0);
    REQUIRE(moecap_commit(cap.h, &a, nullptr) == MOECAP_OK);
    HostTensor got({1, c.num_layers, c.top_k}, i32());
    REQUIRE(moecap_read(cap.h, slots.get(), got.get(), nullptr, 0, nullptr) == MOECAP_OK);
    CHECK(got.at(0) == -1);
    CHECK(got.at(1) == -1);
    moecap_error_counts e{};
    e.struct_size = sizeof e;
    REQUIRE(moecap_get_errors(cap.h, &e, MOECAP_ERRORS_CLEAR) == MOECAP_OK);
    CHECK(e.invalid_ids == static_cast<uint64_t>(c.num_layers));
    REQUIRE(moecap_get_errors(cap.h, &e, 0) == MOECAP_OK);
    CHECK(e.invalid_ids == 0);
  }
}

TEST_CASE("histogram counts kept ids per layer and resets") {
  moecap_config c = small_config();
  c.flags = MOECAP_FLAG_HISTOGRAM;
  c.extra_columns = 1;
  Capturer cap(c);
  HostTensor ids({2, 3}, i32());
  ids.fill<int32_t>({1, 2, 8, 1, 5, 8});  // column 2: the fused shared expert, dropped
  REQUIRE(moecap_capture(cap.h, 1, ids.get(), nullptr, nullptr) == MOECAP_OK);
  DLManagedTensorVersioned* v = nullptr;
  REQUIRE(moecap_export(cap.h, MOECAP_BUFFER_HISTOGRAM, 0, &v) == MOECAP_OK);
  const int64_t* hist = static_cast<const int64_t*>(v->dl_tensor.data);
  CHECK(v->dl_tensor.shape[0] == c.num_layers);
  CHECK(v->dl_tensor.shape[1] == c.num_experts);
  CHECK(hist[1 * 8 + 1] == 2);
  CHECK(hist[1 * 8 + 2] == 1);
  CHECK(hist[1 * 8 + 5] == 1);
  CHECK(hist[0 * 8 + 1] == 0);
  REQUIRE(moecap_histogram_reset(cap.h, nullptr) == MOECAP_OK);
  CHECK(hist[1 * 8 + 1] == 0);
  v->deleter(v);
}

TEST_CASE("write imports rows that read returns (prefill/decode disaggregation)") {
  moecap_config c = small_config();
  c.weight_dtype = MOECAP_WEIGHTS_BF16;
  Capturer cap(c);
  HostTensor slots({2}, i64());
  slots.fill<int64_t>({9, 2});
  HostTensor ids({2, c.num_layers, c.top_k}, i64());
  HostTensor w({2, c.num_layers, c.top_k}, f32());
  for (int64_t i = 0; i < ids.numel(); ++i) {
    ids.set(i, i % c.num_experts);
    w.as<float>()[i] = 0.125f * static_cast<float>(i % 5);
  }
  ids.set(3, -1);
  REQUIRE(moecap_write(cap.h, slots.get(), ids.get(), w.get(), nullptr) == MOECAP_OK);
  HostTensor got({2, c.num_layers, c.top_k}, DLDataType{kDLInt, 16, 1});
  HostTensor gw({2, c.num_layers, c.top_k}, f32());
  REQUIRE(moecap_read(cap.h, slots.get(), got.get(), gw.get(), 0, nullptr) == MOECAP_OK);
  for (int64_t i = 0; i < ids.numel(); ++i) {
    CHECK(got.at(i) == ids.at(i));
    // Multiples of 1/8 are exact in bf16; an id -1 carries no weight, whatever was written.
    CHECK(gw.as<float>()[i] == (ids.at(i) == -1 ? 0.0f : w.as<float>()[i]));
  }
}
