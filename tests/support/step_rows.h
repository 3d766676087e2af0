/* SPDX-License-Identifier: Apache-2.0 */
// Consumption that holds at dp >= 2, as one scenario every backend runs: each
// rank's capturer sees the gathered batch but commits only its own rows, so
// other ranks' rows stay in its device buffer. A later step that places this
// rank's rows there and skips a layer (or captures fewer rows in one) must
// read -1 for what it did not write, never another request's routing; and
// several commits in one step (prefill part, decode part, accepted verify
// rows) must still commit what the step captured; a rank without tokens ends
// its step with an empty commit, and captures without rows start one.
#pragma once

#include <doctest/doctest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "moecap.h"
#include "tests/support/tensors.h"

namespace moecap_step_rows {

// The small test model at data-parallel size dp: device_rows = 8 * dp.
inline moecap_config config(int32_t dp, int32_t device_type) {
  moecap_config c = moecap_test::small_config();
  c.dp_size = dp;
  c.device_type = device_type;
  return c;
}

inline int64_t expert(const moecap_config& c, int64_t batch, int64_t token, int64_t layer, int64_t k) {
  return moecap_test::route(batch * 1000 + token, layer, k, c.num_experts);
}

// What a backend needs of its test: an int32 [n, top_k] tensor its kernels
// can read, holding `values` (the tensor lives until the test ends), and the
// stream moecap's calls go on.
struct Memory {
  std::function<DLTensor*(const std::vector<int32_t>& values, int64_t n, int32_t top_k)> ids;
  void* stream = nullptr;
};

// Layer `layer` of batch `batch`: rows [0, n).
inline void capture(moecap_capturer* h, const moecap_config& c, Memory& m, int32_t layer, int64_t batch, int64_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n * c.top_k));
  for (int64_t t = 0; t < n; ++t)
    for (int32_t k = 0; k < c.top_k; ++k) v[static_cast<size_t>(t * c.top_k + k)] = static_cast<int32_t>(expert(c, batch, t, layer, k));
  REQUIRE_MESSAGE(moecap_capture(h, layer, m.ids(v, n, c.top_k), nullptr, m.stream) == MOECAP_OK,
                  std::string(moecap_last_error()));
}

inline void commit(moecap_capturer* h, Memory& m, int64_t src_start, std::vector<int64_t> slots,
                   std::vector<int64_t> rows = {}) {
  moecap_test::HostTensor s({static_cast<int64_t>(slots.size())}, moecap_test::i64());
  for (size_t i = 0; i < slots.size(); ++i) s.set(static_cast<int64_t>(i), slots[i]);
  moecap_test::HostTensor r({static_cast<int64_t>(rows.size())}, moecap_test::i64());
  for (size_t i = 0; i < rows.size(); ++i) r.set(static_cast<int64_t>(i), rows[i]);
  moecap_commit_args a{};
  a.struct_size = sizeof a;
  a.src_start = rows.empty() ? src_start : 0;
  a.src_rows = rows.empty() ? nullptr : r.get();
  a.dst_slots = s.get();
  REQUIRE_MESSAGE(moecap_commit(h, &a, m.stream) == MOECAP_OK, std::string(moecap_last_error()));
}

// Slot `slot`'s ids, [num_layers * top_k]; `expect` is the status of a strict read of it.
inline std::vector<int64_t> read(moecap_capturer* h, const moecap_config& c, int64_t slot, moecap_status expect) {
  moecap_test::HostTensor s({1}, moecap_test::i64());
  s.set(0, slot);
  moecap_test::HostTensor out({1, c.num_layers, c.top_k}, moecap_test::i64());
  CHECK_MESSAGE(moecap_read(h, s.get(), out.get(), nullptr, MOECAP_READ_STRICT, nullptr) == expect,
                std::string(moecap_last_error()));
  REQUIRE_MESSAGE(moecap_read(h, s.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK, std::string(moecap_last_error()));
  std::vector<int64_t> v(static_cast<size_t>(out.numel()));
  for (int64_t i = 0; i < out.numel(); ++i) v[static_cast<size_t>(i)] = out.at(i);
  return v;
}

// Token `token` of batch `batch`, with -1 in the layers listed in `unwritten`.
inline std::vector<int64_t> row(const moecap_config& c, int64_t batch, int64_t token, std::vector<int32_t> unwritten = {}) {
  std::vector<int64_t> v;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    bool missing = false;
    for (int32_t u : unwritten) missing = missing || u == l;
    for (int32_t k = 0; k < c.top_k; ++k) v.push_back(missing ? -1 : expert(c, batch, token, l, k));
  }
  return v;
}

// The scenario, as rank dp - 1 of dp ranks with two tokens each.
inline void run(moecap_capturer* h, const moecap_config& c, Memory& m) {
  const int32_t dp = c.dp_size;
  const int64_t total = 2 * dp;
  const int64_t mine = 2 * (dp - 1);
  REQUIRE(c.num_layers == 3);

  // Step 1: every rank has two tokens; this rank commits its own two.
  for (int32_t l = 0; l < c.num_layers; ++l) capture(h, c, m, l, 1, total);
  commit(h, m, mine, {0, 1});
  CHECK(read(h, c, 0, MOECAP_OK) == row(c, 1, mine));
  CHECK(read(h, c, 1, MOECAP_OK) == row(c, 1, mine + 1));

  // Step 2: only this rank has tokens, now at rows 0-1 (another rank's rows
  // in step 1, never committed here); layer 1 is skipped and layer 2
  // captures one row only.
  capture(h, c, m, 0, 2, 2);
  capture(h, c, m, 2, 2, 1);
  commit(h, m, 0, {2, 3});
  CHECK(read(h, c, 2, MOECAP_ERROR_NO_ROUTING) == row(c, 2, 0, {1}));
  CHECK(read(h, c, 3, MOECAP_ERROR_NO_ROUTING) == row(c, 2, 1, {1, 2}));

  // Step 3: the first layer is the skipped one; another rank's row of step 1
  // sits under this rank's token in layer 0.
  capture(h, c, m, 1, 3, total);
  capture(h, c, m, 2, 3, total);
  commit(h, m, 2, {4});
  CHECK(read(h, c, 4, MOECAP_ERROR_NO_ROUTING) == row(c, 3, 2, {0}));

  // Step 4: several commits in one step (a prefill part, a decode part, the
  // accepted verify rows as a list in any order) all commit this step's rows.
  for (int32_t l = 0; l < c.num_layers; ++l) capture(h, c, m, l, 4, total);
  commit(h, m, 0, {5});
  commit(h, m, 1, {6});
  commit(h, m, 0, {7, 8}, {total - 1, 2});
  CHECK(read(h, c, 5, MOECAP_OK) == row(c, 4, 0));
  CHECK(read(h, c, 6, MOECAP_OK) == row(c, 4, 1));
  CHECK(read(h, c, 7, MOECAP_OK) == row(c, 4, total - 1));
  CHECK(read(h, c, 8, MOECAP_OK) == row(c, 4, 2));

  // Step 5: a step after those commits, every layer skipped but the last:
  // nothing of step 4 is committed again, whichever commit took it.
  capture(h, c, m, 2, 5, 1);
  commit(h, m, 1, {9});
  CHECK(read(h, c, 9, MOECAP_ERROR_NO_ROUTING) == row(c, 5, 1, {0, 1, 2}));

  // Step 6: this rank has no tokens (the other ranks' fill every row of
  // every layer) and commits an empty list, which still ends the step.
  // Step 7: this rank's two tokens at rows 0-1, layer 1 skipped: it reads -1
  // there, not the other ranks' rows of step 6.
  for (int32_t l = 0; l < c.num_layers; ++l) capture(h, c, m, l, 6, total);
  commit(h, m, 0, {});
  capture(h, c, m, 0, 7, 2);
  capture(h, c, m, 2, 7, 2);
  commit(h, m, 0, {10, 11});
  CHECK(read(h, c, 10, MOECAP_ERROR_NO_ROUTING) == row(c, 7, 0, {1}));
  CHECK(read(h, c, 11, MOECAP_ERROR_NO_ROUTING) == row(c, 7, 1, {1}));

  // Step 8: every rank fills every row of every layer; this rank has no
  // tokens and commits an empty list. Step 9: every capture has no rows (an
  // empty gathered batch); they still start a step, so rows 2-3, another
  // rank's rows of step 8 that no commit took, read -1 in every layer (were
  // step 9 no step, its commit would be step 8's second and take them).
  for (int32_t l = 0; l < c.num_layers; ++l) capture(h, c, m, l, 8, total);
  commit(h, m, 0, {});
  for (int32_t l = 0; l < c.num_layers; ++l) capture(h, c, m, l, 9, 0);
  commit(h, m, 2, {12, 13});
  CHECK(read(h, c, 12, MOECAP_ERROR_NO_ROUTING) == row(c, 9, 2, {0, 1, 2}));
  CHECK(read(h, c, 13, MOECAP_ERROR_NO_ROUTING) == row(c, 9, 3, {0, 1, 2}));

  moecap_error_counts e{};
  e.struct_size = sizeof e;
  REQUIRE(moecap_get_errors(h, &e, 0) == MOECAP_OK);
  CHECK(e.invalid_ids == 0);  // rows not written are no routing, not bad ids
  CHECK(e.skipped_rows == 0);
}

}  // namespace moecap_step_rows
