// SPDX-License-Identifier: Apache-2.0
// Plugin-owned graphs on the host backend (docs/DESIGN.md §6): operations are
// recorded with every argument baked and replayed against what memory holds
// at replay time, which is exactly what a CUDA graph does.
#include <doctest/doctest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "moecap.h"
#include "tests/support/capturer_handle.h"
#include "tests/support/tensors.h"

using namespace moecap_test;

namespace {

struct Graph {
  ~Graph() { moecap_graph_destroy(g); }
  moecap_graph* g = nullptr;
};

// The engine's static graph inputs: gathered top-k ids per layer and this rank's slots.
struct GraphInputs {
  GraphInputs(const moecap_config& c, int64_t padded)
      : ids({c.dp_size * padded, c.top_k}, i32()), slots({padded}, i64()) {}
  HostTensor ids;
  HostTensor slots;
};

void fill_step(const moecap_config& c, GraphInputs& in, int32_t layer, int64_t step) {
  const int64_t rows = in.ids.dl().shape[0];
  for (int64_t r = 0; r < rows; ++r)
    for (int32_t k = 0; k < c.top_k; ++k) in.ids.set(r * c.top_k + k, route(step * 1000 + r, layer, k, c.num_experts));
}

// One forward: capture every layer (contents set per layer), then commit this rank's rows.
void run_forward(moecap_capturer* h, const moecap_config& c, GraphInputs& in, int64_t step, int64_t start,
                 moecap_graph* graph) {
  if (graph != nullptr) {
    // Under a graph the engine's layers rewrite the same input buffer; to model
    // per-layer data with one baked pointer we capture the same tensor per layer,
    // so all layers see the contents present at replay.
    fill_step(c, in, 0, step);
    REQUIRE(moecap_graph_launch(graph, nullptr) == MOECAP_OK);
    return;
  }
  fill_step(c, in, 0, step);
  for (int32_t l = 0; l < c.num_layers; ++l) REQUIRE(moecap_capture(h, l, in.ids.get(), nullptr, nullptr) == MOECAP_OK);
  moecap_commit_args a{sizeof a, start, nullptr, in.slots.get()};
  REQUIRE(moecap_commit(h, &a, nullptr) == MOECAP_OK);
}

std::vector<int64_t> read_all(moecap_capturer* h, const moecap_config& c) {
  HostTensor slots({c.host_slots}, i64());
  for (int64_t s = 0; s < c.host_slots; ++s) slots.set(s, s);
  HostTensor out({c.host_slots, c.num_layers, c.top_k}, i64());
  REQUIRE(moecap_read(h, slots.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
  return std::vector<int64_t>(out.as<int64_t>(), out.as<int64_t>() + out.numel());
}

}  // namespace

TEST_CASE("graphs per padded batch size, every DP rank, replayed with other batch sizes, match eager") {
  for (int32_t dp : {1, 2, 4, 8}) {
    for (int32_t rank = 0; rank < dp; ++rank) {
      CAPTURE(dp);
      CAPTURE(rank);
      moecap_config c = small_config();
      c.dp_size = dp;
      c.max_running_requests = 4;
      c.max_graph_batch = 4;
      c.chunked_prefill_size = 4;
      c.host_slots = 64;
      Handle graphed(c);
      Handle eager(c);
      std::mt19937 rng(static_cast<uint32_t>(dp * 100 + rank));
      for (int64_t padded : {1, 2, 4}) {
        GraphInputs gin(c, padded);
        GraphInputs ein(c, padded);
        moecap_batch batch{sizeof(moecap_batch), MOECAP_BATCH_GRAPH, rank, dp, 0, nullptr, padded};
        std::vector<int64_t> tokens(static_cast<size_t>(dp), padded);
        batch.tokens_per_rank = tokens.data();
        moecap_rows rows{};
        rows.struct_size = sizeof rows;
        REQUIRE(moecap_local_rows(graphed.h, &batch, &rows) == MOECAP_OK);
        REQUIRE(rows.total == dp * padded);

        Graph g;
        REQUIRE(moecap_graph_begin(graphed.h, nullptr) == MOECAP_OK);
        for (int32_t l = 0; l < c.num_layers; ++l)
          REQUIRE(moecap_capture(graphed.h, l, gin.ids.get(), nullptr, nullptr) == MOECAP_OK);
        moecap_commit_args a{sizeof a, rows.start, nullptr, gin.slots.get()};
        REQUIRE(moecap_commit(graphed.h, &a, nullptr) == MOECAP_OK);
        REQUIRE(moecap_graph_end(graphed.h, &g.g) == MOECAP_OK);

        for (int64_t step = 0; step < 4; ++step) {
          // A real batch of 1..padded requests; the rest of the graph is padding (slot -1).
          const int64_t real = 1 + static_cast<int64_t>(rng() % static_cast<uint32_t>(padded));
          for (int64_t i = 0; i < padded; ++i) {
            const int64_t slot = i < real ? static_cast<int64_t>(rng() % 63) : -1;
            gin.slots.set(i, slot);
            ein.slots.set(i, slot);
          }
          run_forward(graphed.h, c, gin, padded * 10 + step, rows.start, g.g);
          run_forward(eager.h, c, ein, padded * 10 + step, rows.start, nullptr);
        }
      }
      CHECK(read_all(graphed.h, c) == read_all(eager.h, c));
    }
  }
}

TEST_CASE("a replay reads the captured tensors' contents at replay time, not at record time") {
  moecap_config c = small_config();
  Handle cap(c);
  GraphInputs in(c, 2);
  in.slots.fill<int64_t>({3, 4});
  Graph g;
  REQUIRE(moecap_graph_begin(cap.h, nullptr) == MOECAP_OK);
  for (int32_t l = 0; l < c.num_layers; ++l) REQUIRE(moecap_capture(cap.h, l, in.ids.get(), nullptr, nullptr) == MOECAP_OK);
  moecap_commit_args a{sizeof a, 0, nullptr, in.slots.get()};
  REQUIRE(moecap_commit(cap.h, &a, nullptr) == MOECAP_OK);
  REQUIRE(moecap_graph_end(cap.h, &g.g) == MOECAP_OK);
  // Recording ran nothing.
  HostTensor q({1}, i32());
  q.fill<int32_t>({3});
  HostTensor out({1, c.num_layers, c.top_k}, i32());
  REQUIRE(moecap_read(cap.h, q.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
  CHECK(out.at(0) == -1);  // never committed
  in.ids.fill<int32_t>({5, 6, 7, 1});
  REQUIRE(moecap_graph_launch(g.g, nullptr) == MOECAP_OK);
  REQUIRE(moecap_read(cap.h, q.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
  CHECK(out.at(0) == 5);
  CHECK(out.at(1) == 6);
  in.ids.fill<int32_t>({2, 3, 4, 1});
  in.slots.fill<int64_t>({-1, 3});  // the slot moved: row 1 now goes to slot 3
  REQUIRE(moecap_graph_launch(g.g, nullptr) == MOECAP_OK);
  REQUIRE(moecap_read(cap.h, q.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
  CHECK(out.at(0) == 4);
  CHECK(out.at(1) == 1);
}

TEST_CASE("a speculative verify graph at the largest batch on the last rank fits") {
  moecap_config c = small_config();
  c.dp_size = 4;
  c.max_running_requests = 8;
  c.max_graph_batch = 8;
  c.verify_tokens = 4;
  c.chunked_prefill_size = 16;
  c.host_slots = 128;
  Handle cap(c);
  const int64_t padded = c.max_graph_batch * c.verify_tokens;
  std::vector<int64_t> tokens(4, padded);
  moecap_batch batch{sizeof(moecap_batch), MOECAP_BATCH_GRAPH, 3, 4, 0, tokens.data(), padded};
  moecap_rows rows{};
  rows.struct_size = sizeof rows;
  REQUIRE(moecap_local_rows(cap.h, &batch, &rows) == MOECAP_OK);
  GraphInputs in(c, padded);
  for (int64_t i = 0; i < padded; ++i) in.slots.set(i, i % 3 == 0 ? -1 : i);  // rejected drafts drop
  Graph g;
  REQUIRE(moecap_graph_begin(cap.h, nullptr) == MOECAP_OK);
  for (int32_t l = 0; l < c.num_layers; ++l) REQUIRE(moecap_capture(cap.h, l, in.ids.get(), nullptr, nullptr) == MOECAP_OK);
  moecap_commit_args a{sizeof a, rows.start, nullptr, in.slots.get()};
  REQUIRE(moecap_commit(cap.h, &a, nullptr) == MOECAP_OK);
  REQUIRE(moecap_graph_end(cap.h, &g.g) == MOECAP_OK);
  fill_step(c, in, 0, 7);
  REQUIRE(moecap_graph_launch(g.g, nullptr) == MOECAP_OK);
  HostTensor q({1}, i32());
  q.fill<int32_t>({5});
  HostTensor out({1, c.num_layers, c.top_k}, i32());
  REQUIRE(moecap_read(cap.h, q.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
  CHECK(out.at(0) == route(7 * 1000 + rows.start + 5, 0, 0, c.num_experts));
}

TEST_CASE("a call that exceeds capacity fails at record time, and the graph records nothing of it") {
  moecap_config c = small_config();  // device_rows 8
  Handle cap(c);
  HostTensor big({9, c.top_k}, i32());
  HostTensor ok({2, c.top_k}, i32());
  HostTensor slots({2}, i64());
  slots.fill<int64_t>({1, 2});
  Graph g;
  REQUIRE(moecap_graph_begin(cap.h, nullptr) == MOECAP_OK);
  CHECK(moecap_capture(cap.h, 0, big.get(), nullptr, nullptr) == MOECAP_ERROR_CAPACITY);
  moecap_commit_args past{sizeof past, 7, nullptr, slots.get()};
  CHECK(moecap_commit(cap.h, &past, nullptr) == MOECAP_ERROR_CAPACITY);
  ok.fill<int32_t>({3, 4, 5, 6});
  REQUIRE(moecap_capture(cap.h, 0, ok.get(), nullptr, nullptr) == MOECAP_OK);
  REQUIRE(moecap_graph_end(cap.h, &g.g) == MOECAP_OK);
  REQUIRE(moecap_graph_launch(g.g, nullptr) == MOECAP_OK);
  DLManagedTensorVersioned* v = nullptr;
  REQUIRE(moecap_export(cap.h, MOECAP_BUFFER_DEVICE_IDS, 0, &v) == MOECAP_OK);
  const int16_t* dev = static_cast<const int16_t*>(v->dl_tensor.data);  // layer 0's block first
  CHECK(dev[0] == 3);
  CHECK(dev[c.top_k + 1] == 6);  // row 1 of the small capture
  CHECK(dev[2 * c.top_k] == -1);  // the refused 9-row capture wrote nothing: still no routing
  v->deleter(v);
}

TEST_CASE("slots that go bad between replays are skipped, counted and reported by the next host call") {
  moecap_config c = small_config();
  Handle cap(c);
  GraphInputs in(c, 2);
  in.slots.fill<int64_t>({1, 2});
  Graph g;
  REQUIRE(moecap_graph_begin(cap.h, nullptr) == MOECAP_OK);
  moecap_commit_args a{sizeof a, 0, nullptr, in.slots.get()};
  REQUIRE(moecap_commit(cap.h, &a, nullptr) == MOECAP_OK);
  REQUIRE(moecap_graph_end(cap.h, &g.g) == MOECAP_OK);
  in.slots.fill<int64_t>({1, 999});
  REQUIRE(moecap_graph_launch(g.g, nullptr) == MOECAP_OK);
  HostTensor q({1}, i32());
  HostTensor out({1, c.num_layers, c.top_k}, i32());
  CHECK(moecap_read(cap.h, q.get(), out.get(), nullptr, 0, nullptr) == MOECAP_ERROR_ROWS_SKIPPED);
  CHECK(std::string(moecap_last_error()).find("1 rows of commits or invalidations were skipped") != std::string::npos);
  CHECK(moecap_synchronize(cap.h) == MOECAP_ERROR_ROWS_SKIPPED);
  moecap_error_counts e{};
  e.struct_size = sizeof e;
  REQUIRE(moecap_get_errors(cap.h, &e, MOECAP_ERRORS_CLEAR) == MOECAP_OK);
  CHECK(e.skipped_rows == 1);
  CHECK(moecap_read(cap.h, q.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
}

TEST_CASE("calls that are illegal in a graph return CAPTURE_ILLEGAL while recording") {
  moecap_config c = small_config();
  Handle cap(c);
  HostTensor slots({1}, i32());
  HostTensor out({1, c.num_layers, c.top_k}, i32());
  moecap_error_counts e{};
  e.struct_size = sizeof e;
  REQUIRE(moecap_graph_begin(cap.h, nullptr) == MOECAP_OK);
  CHECK(moecap_graph_begin(cap.h, nullptr) == MOECAP_ERROR_CAPTURE_ILLEGAL);
  CHECK(moecap_read(cap.h, slots.get(), out.get(), nullptr, 0, nullptr) == MOECAP_ERROR_CAPTURE_ILLEGAL);
  CHECK(moecap_write(cap.h, slots.get(), out.get(), nullptr, nullptr) == MOECAP_ERROR_CAPTURE_ILLEGAL);
  CHECK(moecap_synchronize(cap.h) == MOECAP_ERROR_CAPTURE_ILLEGAL);
  CHECK(moecap_get_errors(cap.h, &e, 0) == MOECAP_ERROR_CAPTURE_ILLEGAL);
  CHECK(moecap_destroy(cap.h) == MOECAP_ERROR_CAPTURE_ILLEGAL);
  // Exports and local_rows stay legal: they touch no device state.
  DLManagedTensorVersioned* v = nullptr;
  CHECK(moecap_export(cap.h, MOECAP_BUFFER_LAYER_IDS, 1, &v) == MOECAP_OK);
  v->deleter(v);
  Graph g;
  REQUIRE(moecap_graph_end(cap.h, &g.g) == MOECAP_OK);
  void* native = nullptr;
  CHECK(moecap_graph_native(g.g, &native) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(moecap_read(cap.h, slots.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
}

TEST_CASE("graphs keep the capturer alive after moecap_destroy") {
  moecap_config c = small_config();
  moecap_capturer* h = nullptr;
  REQUIRE(moecap_create(&c, &h) == MOECAP_OK);
  HostTensor ids({1, c.top_k}, i32());
  REQUIRE(moecap_graph_begin(h, nullptr) == MOECAP_OK);
  REQUIRE(moecap_capture(h, 0, ids.get(), nullptr, nullptr) == MOECAP_OK);
  moecap_graph* g = nullptr;
  REQUIRE(moecap_graph_end(h, &g) == MOECAP_OK);
  REQUIRE(moecap_destroy(h) == MOECAP_OK);
  CHECK(moecap_graph_launch(g, nullptr) == MOECAP_OK);  // memory still valid
  CHECK(moecap_graph_destroy(g) == MOECAP_OK);
}
