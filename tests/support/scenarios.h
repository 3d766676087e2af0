/* SPDX-License-Identifier: Apache-2.0 */
// The CUDA backend scenarios (graphs, DP ranks, verify rows, fail-closed slots), shared by the stand-in driver's
// suite (tests/cuda_standin) and the GPU suite (tests/gpu): the capturer,
// the engine's routing buffer contents, and the moecap calls they make. Each
// suite brings its own memory and streams (the stand-in's or cudart's).
#pragma once

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "moecap.h"
#include "tests/support/tensors.h"

namespace moecap_scenarios {

constexpr int64_t kRows = 8;    // device rows the scenarios use (the small config has at least this many)
constexpr int64_t kNever = 31;  // a slot no scenario writes: what "nothing committed" reads as

inline moecap_config cuda_config() {
  moecap_config c = moecap_test::small_config();
  c.device_type = MOECAP_DEVICE_CUDA;
  return c;
}

inline moecap_capturer* make_capturer() {
  const moecap_config c = cuda_config();
  moecap_capturer* h = nullptr;
  const moecap_status s = moecap_create(&c, &h);
  REQUIRE_MESSAGE(s == MOECAP_OK, std::string(moecap_last_error()));
  return h;
}

// The expert of token `token` of batch `batch` at (layer, k).
inline int32_t expert(int64_t batch, int64_t token, int64_t layer, int64_t k) {
  return static_cast<int32_t>(moecap_test::route(batch * 1000 + token, layer, k, cuda_config().num_experts));
}

// The engine's routing buffer after the forward of batch `batch` over n
// tokens: [num_layers, kRows, top_k] int32, one block per layer (every id
// `value` instead, when given).
inline std::vector<int32_t> forward_values(int64_t batch, int64_t n, int32_t value = -1) {
  const moecap_config c = cuda_config();
  std::vector<int32_t> v(static_cast<size_t>(c.num_layers * kRows * c.top_k), 0);
  for (int32_t layer = 0; layer < c.num_layers; ++layer)
    for (int64_t t = 0; t < n; ++t)
      for (int32_t k = 0; k < c.top_k; ++k)
        v[static_cast<size_t>((layer * kRows + t) * c.top_k + k)] = value >= 0 ? value : expert(batch, t, layer, k);
  return v;
}

// What read returns for token `token` of batch `batch`: [num_layers, top_k].
inline std::vector<int64_t> expected_row(int64_t batch, int64_t token) {
  const moecap_config c = cuda_config();
  std::vector<int64_t> v;
  for (int32_t layer = 0; layer < c.num_layers; ++layer)
    for (int32_t k = 0; k < c.top_k; ++k) v.push_back(expert(batch, token, layer, k));
  return v;
}

// Row i of what read_rows returned.
inline std::vector<int64_t> row_of(const std::vector<int64_t>& rows, size_t i) {
  const moecap_config c = cuda_config();
  const auto w = static_cast<long>(c.num_layers * c.top_k);
  return std::vector<int64_t>(rows.begin() + static_cast<long>(i) * w, rows.begin() + static_cast<long>(i + 1) * w);
}

// moecap_capture of every layer's first n rows of the routing buffer `ids` on `stream`.
inline void capture_layers(moecap_capturer* h, const DLTensor* ids, int64_t n, void* stream) {
  const moecap_config c = cuda_config();
  for (int32_t layer = 0; layer < c.num_layers; ++layer) {
    int64_t shape[2] = {n, c.top_k};
    DLTensor view = *ids;
    view.ndim = 2;
    view.shape = shape;
    view.byte_offset = static_cast<uint64_t>(layer * kRows * c.top_k) * sizeof(int32_t);
    REQUIRE_MESSAGE(moecap_capture(h, layer, &view, nullptr, stream) == MOECAP_OK, std::string(moecap_last_error()));
  }
}

// Rows [src_start, src_start + count) to `slots` on `stream`.
inline void commit(moecap_capturer* h, const DLTensor* slots, void* stream, int64_t src_start = 0,
                   moecap_status expect = MOECAP_OK) {
  moecap_commit_args a{};
  a.struct_size = sizeof a;
  a.dst_slots = slots;
  a.src_start = src_start;
  REQUIRE_MESSAGE(moecap_commit(h, &a, stream) == expect, std::string(moecap_last_error()));
}

// A moecap graph recorded on `stream`: the capture of rows [0, n) of `ids`
// (routing_buffer's layout) and their commit to `slots`.
inline moecap_graph* record_commit_graph(moecap_capturer* h, const DLTensor* ids, int64_t n, const DLTensor* slots,
                                         void* stream) {
  REQUIRE(moecap_graph_begin(h, stream) == MOECAP_OK);
  capture_layers(h, ids, n, stream);
  commit(h, slots, stream);
  moecap_graph* g = nullptr;
  REQUIRE_MESSAGE(moecap_graph_end(h, &g) == MOECAP_OK, std::string(moecap_last_error()));
  return g;
}

// Reads `slots` into host memory; returns the ids, [slots, layers, top_k].
inline std::vector<int64_t> read_rows(moecap_capturer* h, const std::vector<int64_t>& slots,
                                      moecap_status expect = MOECAP_OK, uint32_t flags = 0) {
  const moecap_config c = cuda_config();
  const auto n = static_cast<int64_t>(slots.size());
  moecap_test::HostTensor s({n}, moecap_test::i64());
  for (int64_t i = 0; i < n; ++i) s.set(i, slots[static_cast<size_t>(i)]);
  moecap_test::HostTensor out({n, c.num_layers, c.top_k}, moecap_test::i64());
  CHECK_MESSAGE(moecap_read(h, s.get(), out.get(), nullptr, flags, nullptr) == expect, std::string(moecap_last_error()));
  std::vector<int64_t> v(static_cast<size_t>(out.numel()));
  for (int64_t i = 0; i < out.numel(); ++i) v[static_cast<size_t>(i)] = out.at(i);
  return v;
}

}  // namespace moecap_scenarios
