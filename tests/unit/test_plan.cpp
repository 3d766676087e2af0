// SPDX-License-Identifier: Apache-2.0
// The layout plan (docs/DESIGN.md §2): exhaustive properties over small ranges of
// every input, and the two overflows that shipped as named regressions.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "base/status.h"
#include "moecap.h"
#include "plugin/plan.h"
#include "tests/support/tensors.h"

using moecap_test::small_config;

namespace {

moecap_rows rows_for(const moecap::Plan& plan, int32_t mode, int32_t rank, const std::vector<int64_t>& tokens,
                     int64_t padded) {
  moecap_batch b{sizeof(moecap_batch), mode, rank, static_cast<int32_t>(tokens.size()), 0, tokens.data(), padded};
  return moecap::locate_rows(plan, &b);
}

moecap_status status_of(const moecap_config& c) {
  moecap_plan_info info{};
  info.struct_size = sizeof info;
  return moecap_plan(&c, &info);
}

}  // namespace

TEST_CASE("rows_per_rank is the largest per-rank term and device_rows multiplies by dp_size") {
  for (int32_t dp = 1; dp <= 4; ++dp)
    for (int64_t running = 1; running <= 6; ++running)
      for (int64_t chunk = 0; chunk <= 9; chunk += 3)
        for (int64_t graph = 0; graph <= 6; graph += 2)
          for (int32_t verify = 1; verify <= 4; ++verify)
            for (int64_t extra_tokens = 0; extra_tokens <= 20; extra_tokens += 10) {
              moecap_config c = small_config();
              c.dp_size = dp;
              c.max_running_requests = running;
              c.chunked_prefill_size = chunk;
              c.max_graph_batch = graph;
              c.verify_tokens = verify;
              c.max_batch_tokens = extra_tokens;
              const moecap::Plan p = moecap::make_plan(&c);
              const int64_t expect = std::max({chunk, running * verify, graph * verify, extra_tokens});
              REQUIRE(p.rows_per_rank == expect);
              REQUIRE(p.device_rows == dp * expect);
            }
}

TEST_CASE("every batch the engine may legally form fits, on every rank, in both modes") {
  for (int32_t dp = 1; dp <= 3; ++dp)
    for (int64_t running = 1; running <= 4; ++running)
      for (int64_t chunk = 1; chunk <= 5; chunk += 2)
        for (int64_t graph = 1; graph <= 4; ++graph)
          for (int32_t verify = 1; verify <= 3; ++verify) {
            moecap_config c = small_config();
            c.dp_size = dp;
            c.max_running_requests = running;
            c.chunked_prefill_size = chunk;
            c.max_graph_batch = graph;
            c.verify_tokens = verify;
            c.max_batch_tokens = chunk + running;  // mixed prefill + decode
            const moecap::Plan p = moecap::make_plan(&c);
            // Per-rank token counts the scheduler can produce: a prefill chunk,
            // decode, verify, and mixed chunk+decode.
            const int64_t per_rank_max = std::max({chunk, running * verify, chunk + running});
            std::vector<int64_t> tokens(static_cast<size_t>(dp));
            // Every combination of per-rank counts in [0, per_rank_max] (odometer).
            for (;;) {
              std::vector<bool> covered(static_cast<size_t>(p.device_rows), false);
              for (int32_t r = 0; r < dp; ++r) {
                const moecap_rows rows = rows_for(p, MOECAP_BATCH_EAGER, r, tokens, 0);
                REQUIRE(rows.count == tokens[static_cast<size_t>(r)]);
                REQUIRE(rows.start + rows.count <= p.device_rows);
                REQUIRE(rows.total <= p.device_rows);
                for (int64_t i = rows.start; i < rows.start + rows.count; ++i) {
                  REQUIRE_FALSE(covered[static_cast<size_t>(i)]);  // ranks never overlap
                  covered[static_cast<size_t>(i)] = true;
                }
              }
              size_t i = 0;
              while (i < tokens.size() && ++tokens[i] > per_rank_max) tokens[i++] = 0;
              if (i == tokens.size()) break;
            }
            // Graph batches: every captured size (requests * verify tokens), every rank.
            for (int64_t g = 1; g <= graph; ++g) {
              const int64_t padded = g * verify;
              std::vector<int64_t> real(static_cast<size_t>(dp), padded);
              for (int32_t r = 0; r < dp; ++r) {
                real[static_cast<size_t>(r)] = padded - (r % 2);
                const moecap_rows rows = rows_for(p, MOECAP_BATCH_GRAPH, r, real, padded);
                REQUIRE(rows.start == r * padded);
                REQUIRE(rows.total == dp * padded);
                REQUIRE(rows.total <= p.device_rows);
              }
            }
          }
}

TEST_CASE("regression: DP attention rank > 0 under graph padding overflowed the old sizing") {
  // SGLang's shape of the bug: 4 DP ranks, small prefill chunk, graphs of 64.
  moecap_config c = small_config();
  c.dp_size = 4;
  c.chunked_prefill_size = 16;
  c.max_running_requests = 64;
  c.max_graph_batch = 64;
  const moecap::Plan p = moecap::make_plan(&c);
  const std::vector<int64_t> tokens(4, 64);
  const moecap_rows last = rows_for(p, MOECAP_BATCH_GRAPH, 3, tokens, 64);
  // The old buffer held max(16 * 4, 64) = 64 rows: rank 3 starts at 192.
  CHECK(moecap::legacy_device_rows(c) == 64);
  CHECK(last.start == 192);
  CHECK(last.start + last.count > moecap::legacy_device_rows(c));
  CHECK(last.start + last.count <= p.device_rows);
  CHECK(p.device_rows == 256);
}

TEST_CASE("regression: speculative verify rows were never reserved") {
  moecap_config c = small_config();
  c.dp_size = 2;
  c.chunked_prefill_size = 32;
  c.max_running_requests = 48;
  c.max_graph_batch = 48;
  c.verify_tokens = 4;  // EAGLE verify: 4 tokens per request
  const moecap::Plan p = moecap::make_plan(&c);
  const std::vector<int64_t> tokens(2, 48 * 4);
  const moecap_rows last = rows_for(p, MOECAP_BATCH_GRAPH, 1, tokens, 48 * 4);
  CHECK(moecap::legacy_device_rows(c) == 64);
  CHECK(last.start + last.count > moecap::legacy_device_rows(c));
  CHECK(last.start + last.count <= p.device_rows);
  CHECK(last.total == p.device_rows);
}

TEST_CASE("a batch beyond the plan is a CAPACITY error, never a slice past the end") {
  moecap_config c = small_config();
  c.dp_size = 2;
  const moecap::Plan p = moecap::make_plan(&c);  // rows_per_rank 8
  std::vector<int64_t> tokens{8, 9};
  try {
    rows_for(p, MOECAP_BATCH_EAGER, 1, tokens, 0);
    FAIL("expected CAPACITY");
  } catch (const moecap::Error& e) {
    CHECK(e.code() == MOECAP_ERROR_CAPACITY);
    CHECK(std::string(e.what()).find("device_rows is 16") != std::string::npos);
  }
  tokens = {4, 4};
  try {
    rows_for(p, MOECAP_BATCH_GRAPH, 0, tokens, 9);  // a graph padded past rows_per_rank
    FAIL("expected CAPACITY");
  } catch (const moecap::Error& e) {
    CHECK(e.code() == MOECAP_ERROR_CAPACITY);
    CHECK(std::string(e.what()).find("padded_tokens_per_rank") != std::string::npos);
  }
}

TEST_CASE("AUTO picks the narrowest id dtype that holds num_experts + extra_columns ids") {
  moecap_config c = small_config();
  struct Case { int32_t experts, extra, id_dtype, bytes; };
  for (const Case& k : {Case{8, 0, MOECAP_IDS_U8, 1}, Case{256, 0, MOECAP_IDS_U8, 1}, Case{256, 1, MOECAP_IDS_U16, 2},
                        Case{255, 1, MOECAP_IDS_U8, 1}, Case{65536, 0, MOECAP_IDS_U16, 2},
                        Case{65536, 1, MOECAP_IDS_I32, 4}}) {
    c.num_experts = k.experts;
    c.extra_columns = k.extra;
    moecap_plan_info info{};
    info.struct_size = sizeof info;
    REQUIRE(moecap_plan(&c, &info) == MOECAP_OK);
    CHECK(info.id_dtype == k.id_dtype);
    CHECK(info.id_bytes == k.bytes);
  }
}

TEST_CASE("an explicit U8 holds 256 routed experts with a fused shared expert; 257 routed do not fit") {
  moecap_config c = small_config();
  c.num_experts = 256;
  c.extra_columns = 1;
  c.id_dtype = MOECAP_IDS_U8;
  moecap_plan_info info{};
  info.struct_size = sizeof info;
  CHECK(moecap_plan(&c, &info) == MOECAP_OK);
  CHECK(info.id_bytes == 1);
  c.num_experts = 257;
  c.extra_columns = 0;
  CHECK(moecap_plan(&c, &info) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(moecap_last_error()).find("holds 256 expert ids; num_experts is 257") != std::string::npos);
}

TEST_CASE("plan bytes: a 61-layer top-8 model at int32 versus moecap's u8") {
  moecap_config c = small_config();
  c.num_layers = 61;
  c.top_k = 8;
  c.num_experts = 256;
  c.host_slots = 1000000;
  moecap_plan_info info{};
  info.struct_size = sizeof info;
  REQUIRE(moecap_plan(&c, &info) == MOECAP_OK);
  // 488 MB of ids plus 1 MB of slot states, against 1.95 GB as int32
  CHECK(info.host_bytes == 1000000ull * 61 * 8 + 1000000ull);
  c.id_dtype = MOECAP_IDS_I32;
  REQUIRE(moecap_plan(&c, &info) == MOECAP_OK);
  CHECK(info.host_bytes == 4ull * 1000000 * 61 * 8 + 1000000ull);
}

TEST_CASE("nonsense configs are refused with the field's name") {
  struct Bad {
    const char* field;
    void (*apply)(moecap_config&);
    moecap_status code;
  };
  const Bad cases[] = {
      {"num_layers", [](moecap_config& c) { c.num_layers = 0; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"top_k", [](moecap_config& c) { c.top_k = -1; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"top_k", [](moecap_config& c) { c.top_k = 9; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"extra_columns", [](moecap_config& c) { c.extra_columns = -2; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"num_experts", [](moecap_config& c) { c.num_experts = 0; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"dp_size", [](moecap_config& c) { c.dp_size = 0; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"verify_tokens", [](moecap_config& c) { c.verify_tokens = 0; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"max_running_requests", [](moecap_config& c) { c.max_running_requests = 0; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"chunked_prefill_size", [](moecap_config& c) { c.chunked_prefill_size = -1; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"max_graph_batch", [](moecap_config& c) { c.max_graph_batch = -1; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"max_batch_tokens", [](moecap_config& c) { c.max_batch_tokens = -5; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"host_slots", [](moecap_config& c) { c.host_slots = 0; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"id_dtype", [](moecap_config& c) { c.id_dtype = 7; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"id_dtype", [](moecap_config& c) { c.id_dtype = MOECAP_IDS_U8; c.num_experts = 300; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"weight_dtype", [](moecap_config& c) { c.weight_dtype = 9; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"device_type", [](moecap_config& c) { c.device_type = 3; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"device_id", [](moecap_config& c) { c.device_id = -1; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"host backend is device 0", [](moecap_config& c) { c.device_id = 1; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"flags", [](moecap_config& c) { c.flags = 0x100; }, MOECAP_ERROR_INVALID_ARGUMENT},
      {"struct_size", [](moecap_config& c) { c.struct_size = 8; }, MOECAP_ERROR_ABI_MISMATCH},
      {"abi_version", [](moecap_config& c) { c.abi_version = 2u << 16; }, MOECAP_ERROR_ABI_MISMATCH},
      {"overflows int64", [](moecap_config& c) { c.max_running_requests = INT64_MAX / 2; c.verify_tokens = 4; },
       MOECAP_ERROR_INVALID_ARGUMENT},
      {"overflows int64", [](moecap_config& c) { c.host_slots = INT64_MAX / 4; }, MOECAP_ERROR_INVALID_ARGUMENT},
  };
  for (const Bad& b : cases) {
    CAPTURE(b.field);
    moecap_config c = small_config();
    b.apply(c);
    CHECK(status_of(c) == b.code);
    CHECK(std::string(moecap_last_error()).find(b.field) != std::string::npos);
  }
  moecap_plan_info info{};
  info.struct_size = sizeof info;
  CHECK(moecap_plan(nullptr, &info) == MOECAP_ERROR_INVALID_ARGUMENT);
  const moecap_config ok = small_config();
  CHECK(moecap_plan(&ok, nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
  info.struct_size = 3;
  CHECK(moecap_plan(&ok, &info) == MOECAP_ERROR_ABI_MISMATCH);
}

TEST_CASE("local_rows rejects bad descriptors") {
  const moecap_config c = [] {
    moecap_config x = small_config();
    x.dp_size = 2;
    return x;
  }();
  moecap_capturer* h = nullptr;
  REQUIRE(moecap_create(&c, &h) == MOECAP_OK);
  const int64_t tokens[2] = {3, 2};
  moecap_rows out{};
  out.struct_size = sizeof out;
  moecap_batch b{sizeof(moecap_batch), MOECAP_BATCH_EAGER, 1, 2, 0, tokens, 0};
  REQUIRE(moecap_local_rows(h, &b, &out) == MOECAP_OK);
  CHECK(out.start == 3);
  CHECK(out.count == 2);
  CHECK(out.total == 5);
  moecap_batch bad = b;
  bad.dp_rank = 2;
  CHECK(moecap_local_rows(h, &bad, &out) == MOECAP_ERROR_OUT_OF_RANGE);
  CHECK(std::string(moecap_last_error()).find("dp_rank") != std::string::npos);
  bad = b;
  bad.num_ranks = 1;
  CHECK(moecap_local_rows(h, &bad, &out) == MOECAP_ERROR_INVALID_ARGUMENT);
  bad = b;
  bad.tokens_per_rank = nullptr;
  CHECK(moecap_local_rows(h, &bad, &out) == MOECAP_ERROR_INVALID_ARGUMENT);
  bad = b;
  bad.reserved = 1;  // kept 0, so that a later version may give it a meaning
  CHECK(moecap_local_rows(h, &bad, &out) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(moecap_last_error()).find("batch->reserved is 1; it must be 0") != std::string::npos);
  bad = b;
  bad.mode = 5;
  CHECK(moecap_local_rows(h, &bad, &out) == MOECAP_ERROR_INVALID_ARGUMENT);
  bad = b;
  bad.mode = MOECAP_BATCH_GRAPH;
  bad.padded_tokens_per_rank = 2;  // rank 0 has 3 real tokens
  CHECK(moecap_local_rows(h, &bad, &out) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(moecap_last_error()).find("tokens_per_rank[0]") != std::string::npos);
  bad = b;
  bad.struct_size = 1;
  CHECK(moecap_local_rows(h, &bad, &out) == MOECAP_ERROR_ABI_MISMATCH);
  CHECK(moecap_local_rows(nullptr, &b, &out) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(out.start == 3);  // failures left the output alone
  moecap_destroy(h);
}
