// SPDX-License-Identifier: Apache-2.0
// ABI 1.x compatibility, as abi_structs.h implements it: any struct_size from
// the 1.0 size up; older structs take defaults, newer ones are accepted only
// with a zero tail; structs the library fills are written up to the
// caller's size and no further. Plus moecap_config_init and config->next.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "moecap.h"
#include "tests/support/tensors.h"

using namespace moecap_test;

namespace {

bool error_has(const char* needle) { return std::string(moecap_last_error()).find(needle) != std::string::npos; }

// A struct followed by bytes the library must never touch.
template <class T>
struct Fenced {
  T value;
  unsigned char fence[64];
  Fenced() { std::memset(this, 0x5a, sizeof *this); }
  bool fence_intact() const {
    for (unsigned char b : fence)
      if (b != 0x5a) return false;
    return true;
  }
};

// A caller whose header has one more (unknown) field after the current ones.
struct NewerConfig {
  moecap_config known;
  int64_t future_field;
};

}  // namespace

TEST_CASE("the named 1.0 sizes are the sizeof of the frozen 1.0 header's structs") {
  // sizeof in tests/abi/v1_0/moecap.h on LP64 (caller_1_0.c checks the same numbers there).
  CHECK(MOECAP_CONFIG_SIZE_1_0 == 96);
  CHECK(MOECAP_PLAN_INFO_SIZE_1_0 == 64);
  CHECK(MOECAP_BATCH_SIZE_1_0 == 40);
  CHECK(MOECAP_ROWS_SIZE_1_0 == 32);
  CHECK(MOECAP_COMMIT_ARGS_SIZE_1_0 == 32);
  CHECK(MOECAP_ERROR_COUNTS_SIZE_1_0 == 24);
  CHECK(MOECAP_API_SIZE_1_0 == 192);
  CHECK(sizeof(moecap_config) > MOECAP_CONFIG_SIZE_1_0);
  CHECK(MOECAP_ABI_VERSION == ((1u << 16) | 1u));
}

TEST_CASE("moecap_config_init fills every default and writes only struct_size bytes") {
  moecap_config c{};
  c.struct_size = sizeof c;
  std::memset(reinterpret_cast<char*>(&c) + sizeof c.struct_size, 0x77, sizeof c - sizeof c.struct_size);
  REQUIRE(moecap_config_init(&c) == MOECAP_OK);
  CHECK(c.struct_size == sizeof c);
  CHECK(c.abi_version == MOECAP_ABI_VERSION);
  CHECK(c.flags == 0);
  CHECK(c.num_layers == 0);
  CHECK(c.extra_columns == 0);
  CHECK(c.dp_size == 1);
  CHECK(c.verify_tokens == 1);
  CHECK(c.max_batch_tokens == 0);
  CHECK(c.id_dtype == MOECAP_IDS_AUTO);
  CHECK(c.device_id_dtype == MOECAP_IDS_AUTO);
  CHECK(c.weight_dtype == MOECAP_WEIGHTS_NONE);
  CHECK(c.device_type == MOECAP_DEVICE_HOST);
  CHECK(c.device_id == 0);
  CHECK(c.next == nullptr);
  CHECK(c.reserved == 0);

  // An older caller's struct (the 1.0 size): nothing past it is written.
  Fenced<moecap_config> old;
  old.value.struct_size = MOECAP_CONFIG_SIZE_1_0;
  REQUIRE(moecap_config_init(&old.value) == MOECAP_OK);
  CHECK(old.value.struct_size == MOECAP_CONFIG_SIZE_1_0);
  CHECK(old.value.dp_size == 1);
  const auto* tail = reinterpret_cast<const unsigned char*>(&old.value) + MOECAP_CONFIG_SIZE_1_0;
  for (size_t i = 0; i < sizeof(moecap_config) - MOECAP_CONFIG_SIZE_1_0; ++i) REQUIRE(tail[i] == 0x5a);
  CHECK(old.fence_intact());

  // A newer caller's bigger struct: the known part is filled and struct_size
  // kept, so a newer field set after init is refused, not silently dropped.
  NewerConfig newer{};
  newer.known.struct_size = sizeof newer;
  REQUIRE(moecap_config_init(&newer.known) == MOECAP_OK);
  CHECK(newer.known.struct_size == sizeof newer);
  CHECK(newer.known.dp_size == 1);
  CHECK(newer.future_field == 0);
  newer.known.num_layers = 2;
  newer.known.top_k = 2;
  newer.known.num_experts = 8;
  newer.known.max_running_requests = 4;
  newer.known.host_slots = 16;
  moecap_plan_info info{};
  info.struct_size = sizeof info;
  CHECK(moecap_plan(&newer.known, &info) == MOECAP_OK);  // its newer field left 0: the default
  newer.future_field = 42;
  CHECK(moecap_plan(&newer.known, &info) == MOECAP_ERROR_ABI_MISMATCH);
  CHECK(error_has("a field this library"));

  moecap_config unset{};
  CHECK(moecap_config_init(&unset) == MOECAP_ERROR_ABI_MISMATCH);
  CHECK(error_has("config->struct_size is 0; the smallest this library"));
  CHECK(moecap_config_init(nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
}

TEST_CASE("a config one field shorter than current (an older caller) works with defaults") {
  moecap_config c = small_config();
  c.device_id_dtype = MOECAP_IDS_I32;  // beyond the caller's struct_size: must not be seen
  c.struct_size = offsetof(moecap_config, device_id_dtype);
  moecap_plan_info info{};
  info.struct_size = sizeof info;
  REQUIRE(moecap_plan(&c, &info) == MOECAP_OK);
  CHECK(info.device_id_dtype == MOECAP_IDS_I16);  // the default, not the I32 past the end

  c = small_config();
  c.struct_size = MOECAP_CONFIG_SIZE_1_0;
  c.next = &c;  // past a 1.0 caller's struct: garbage to this library, never read
  moecap_capturer* h = nullptr;
  REQUIRE(moecap_create(&c, &h) == MOECAP_OK);
  REQUIRE(moecap_destroy(h) == MOECAP_OK);
  h = nullptr;

  c.struct_size = MOECAP_CONFIG_SIZE_1_0 - 4;
  CHECK(moecap_create(&c, &h) == MOECAP_ERROR_ABI_MISMATCH);
  CHECK(error_has("config->struct_size is 92; the smallest this library (ABI 1.1) accepts is 96"));
  CHECK(h == nullptr);
}

TEST_CASE("a longer config is accepted with a zero tail and refused with a non-zero one") {
  NewerConfig newer{};
  newer.known = small_config();
  newer.known.struct_size = sizeof newer;
  moecap_capturer* h = nullptr;
  REQUIRE(moecap_create(&newer.known, &h) == MOECAP_OK);
  REQUIRE(moecap_destroy(h) == MOECAP_OK);
  h = nullptr;
  newer.future_field = 1;
  CHECK(moecap_create(&newer.known, &h) == MOECAP_ERROR_ABI_MISMATCH);
  CHECK(error_has("config->struct_size is 120 and byte 112 is set, a field this library"));
  CHECK(h == nullptr);
  moecap_plan_info info{};
  info.struct_size = sizeof info;
  CHECK(moecap_plan(&newer.known, &info) == MOECAP_ERROR_ABI_MISMATCH);
}

TEST_CASE("a struct_size past any newer header is refused before a byte past the struct is read") {
  // Only the struct itself is readable: reading the claimed size would run off it.
  moecap_config c = small_config();
  moecap_capturer* h = nullptr;
  for (size_t size : {SIZE_MAX, sizeof c + 4097}) {
    CAPTURE(size);
    c.struct_size = size;
    CHECK(moecap_create(&c, &h) == MOECAP_ERROR_ABI_MISMATCH);
    CHECK(error_has("config->struct_size is "));
    CHECK(error_has(("the largest this library (ABI 1.1) reads is " + std::to_string(sizeof c + 4096)).c_str()));
    CHECK(h == nullptr);
  }
}

TEST_CASE("config->next must be NULL, config->reserved 0") {
  moecap_config c = small_config();
  const int extension = 0;
  c.next = &extension;
  moecap_plan_info info{};
  info.struct_size = sizeof info;
  CHECK(moecap_plan(&c, &info) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(error_has("config->next is not NULL; ABI 1.1 defines no extension"));
  c.next = nullptr;
  c.reserved = 3;
  CHECK(moecap_plan(&c, &info) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(error_has("config->reserved is 3; it must be 0"));
}

TEST_CASE("structs the library fills are written up to the caller's size, never past it") {
  moecap_config c = small_config();
  moecap_capturer* h = nullptr;
  REQUIRE(moecap_create(&c, &h) == MOECAP_OK);

  Fenced<moecap_plan_info> plan;
  plan.value.struct_size = MOECAP_PLAN_INFO_SIZE_1_0;
  REQUIRE(moecap_get_plan(h, &plan.value) == MOECAP_OK);
  CHECK(plan.value.struct_size == MOECAP_PLAN_INFO_SIZE_1_0);
  CHECK(plan.value.device_rows == 8);
  unsigned char past[sizeof(moecap_plan_info) - MOECAP_PLAN_INFO_SIZE_1_0];
  std::memcpy(past, reinterpret_cast<const unsigned char*>(&plan.value) + MOECAP_PLAN_INFO_SIZE_1_0, sizeof past);
  for (unsigned char b : past) CHECK(b == 0x5a);
  CHECK(plan.fence_intact());

  // A newer caller's bigger output struct: filled up to what the library knows.
  struct {
    moecap_plan_info known;
    int64_t future_field;
  } newer{};
  newer.known.struct_size = sizeof newer;
  newer.future_field = 7;
  REQUIRE(moecap_get_plan(h, &newer.known) == MOECAP_OK);
  CHECK(newer.known.struct_size == sizeof(moecap_plan_info));
  CHECK(newer.known.device_id_dtype == MOECAP_IDS_I16);
  CHECK(newer.future_field == 7);

  plan.value.struct_size = MOECAP_PLAN_INFO_SIZE_1_0 - 8;
  CHECK(moecap_get_plan(h, &plan.value) == MOECAP_ERROR_ABI_MISMATCH);

  Fenced<moecap_error_counts> counts;
  counts.value.struct_size = MOECAP_ERROR_COUNTS_SIZE_1_0;
  REQUIRE(moecap_get_errors(h, &counts.value, 0) == MOECAP_OK);
  CHECK(counts.value.skipped_rows == 0);
  CHECK(counts.fence_intact());

  const int64_t tokens[1] = {3};
  moecap_batch b{sizeof b, MOECAP_BATCH_EAGER, 0, 1, 0, tokens, 0};
  Fenced<moecap_rows> rows;
  rows.value.struct_size = MOECAP_ROWS_SIZE_1_0;
  REQUIRE(moecap_local_rows(h, &b, &rows.value) == MOECAP_OK);
  CHECK(rows.value.count == 3);
  CHECK(rows.fence_intact());
  REQUIRE(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("input structs of a newer caller: batch and commit args with a non-zero tail change nothing") {
  moecap_config c = small_config();
  moecap_capturer* h = nullptr;
  REQUIRE(moecap_create(&c, &h) == MOECAP_OK);
  const int64_t tokens[1] = {2};
  struct {
    moecap_batch known;
    int64_t future_field;
  } batch{};
  batch.known = moecap_batch{sizeof batch, MOECAP_BATCH_EAGER, 0, 1, 0, tokens, 0};
  moecap_rows rows{};
  rows.struct_size = sizeof rows;
  REQUIRE(moecap_local_rows(h, &batch.known, &rows) == MOECAP_OK);
  batch.future_field = -1;
  CHECK(moecap_local_rows(h, &batch.known, &rows) == MOECAP_ERROR_ABI_MISMATCH);
  CHECK(error_has("batch->struct_size is 48 and byte 40 is set"));

  HostTensor ids({2, c.top_k}, i32());
  ids.fill<int32_t>({1, 2, 3, 4});
  for (int32_t l = 0; l < c.num_layers; ++l) REQUIRE(moecap_capture(h, l, ids.get(), nullptr, nullptr) == MOECAP_OK);
  HostTensor slots({2}, i32());
  slots.fill<int32_t>({4, 5});
  struct {
    moecap_commit_args known;
    uint64_t future_field;
  } args{};
  args.known = moecap_commit_args{sizeof args, 0, nullptr, slots.get()};
  args.future_field = 1;
  const std::vector<uint8_t> before = snapshot(h);
  CHECK(moecap_commit(h, &args.known, nullptr) == MOECAP_ERROR_ABI_MISMATCH);
  CHECK(error_has("args->struct_size is 40 and byte 32 is set"));
  CHECK(snapshot(h) == before);
  args.future_field = 0;
  CHECK(moecap_commit(h, &args.known, nullptr) == MOECAP_OK);
  REQUIRE(moecap_destroy(h) == MOECAP_OK);
}

TEST_CASE("moecap_get_api fills a 1.0 table without the 1.1 entries, a 1.1 table with them") {
  Fenced<moecap_api> old;
  old.value.struct_size = MOECAP_API_SIZE_1_0;
  REQUIRE(moecap_get_api(&old.value) == MOECAP_OK);
  CHECK(old.value.struct_size == MOECAP_API_SIZE_1_0);
  CHECK((old.value.graph_destroy == &moecap_graph_destroy));
  const auto* past = reinterpret_cast<const unsigned char*>(&old.value) + MOECAP_API_SIZE_1_0;
  for (size_t i = 0; i < sizeof(moecap_api) - MOECAP_API_SIZE_1_0; ++i) REQUIRE(past[i] == 0x5a);
  CHECK(old.fence_intact());
  moecap_api api{};
  api.struct_size = sizeof api;
  REQUIRE(moecap_get_api(&api) == MOECAP_OK);
  CHECK((api.config_init == &moecap_config_init));
  CHECK((api.invalidate == &moecap_invalidate));
}
