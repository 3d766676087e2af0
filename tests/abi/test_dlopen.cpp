// SPDX-License-Identifier: Apache-2.0
// ABI conformance: loads the built libmoecap.so with RTLD_NOW | RTLD_LOCAL
// and drives it only through abi/moecap.h, as an engine does.
#include <doctest/doctest.h>

#include <dlfcn.h>

#include <string>

#include "moecap.h"
#include "tests/support/tensors.h"

using namespace moecap_test;

namespace {

const moecap_api& api() {
  static moecap_api table = [] {
    void* lib = dlopen(MOECAP_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    REQUIRE_MESSAGE(lib != nullptr, dlerror());
    using GetApi = moecap_status (*)(moecap_api*);
    auto get = reinterpret_cast<GetApi>(dlsym(lib, "moecap_get_api"));
    REQUIRE(reinterpret_cast<void*>(get) != nullptr);
    moecap_api t{};
    t.struct_size = sizeof t;
    REQUIRE(get(&t) == MOECAP_OK);
    return t;
  }();
  return table;
}

}  // namespace

TEST_CASE("every header function resolves by name") {
  void* lib = dlopen(MOECAP_LIBRARY, RTLD_NOW | RTLD_LOCAL);
  REQUIRE(lib != nullptr);
  for (const char* name :
       {"moecap_abi_version", "moecap_last_error", "moecap_status_name", "moecap_plan", "moecap_create",
        "moecap_destroy", "moecap_get_plan", "moecap_capture", "moecap_local_rows", "moecap_commit", "moecap_read",
        "moecap_write", "moecap_synchronize", "moecap_get_errors", "moecap_histogram_reset", "moecap_export",
        "moecap_export_legacy", "moecap_graph_begin", "moecap_graph_end", "moecap_graph_launch",
        "moecap_graph_native", "moecap_graph_destroy", "moecap_get_api", "moecap_config_init",
        "moecap_invalidate", "moecap_join"}) {
    CAPTURE(name);
    CHECK(dlsym(lib, name) != nullptr);
  }
  // Internals stay inside.
  CHECK(dlsym(lib, "moecap_kernels_fatbin") == nullptr);
  using Version = uint32_t (*)();
  CHECK(reinterpret_cast<Version>(dlsym(lib, "moecap_abi_version"))() == MOECAP_ABI_VERSION);
}

TEST_CASE("a full step through the loaded library: create, capture, local_rows, commit, read, export") {
  const moecap_api& m = api();
  moecap_config c = small_config(m.config_init);
  c.dp_size = 2;
  c.weight_dtype = MOECAP_WEIGHTS_F16;
  moecap_capturer* h = nullptr;
  REQUIRE(m.create(&c, &h) == MOECAP_OK);

  const int64_t tokens[2] = {3, 2};
  moecap_batch batch{sizeof(moecap_batch), MOECAP_BATCH_EAGER, 1, 2, 0, tokens, 0};
  moecap_rows rows{};
  rows.struct_size = sizeof rows;
  REQUIRE(m.local_rows(h, &batch, &rows) == MOECAP_OK);
  REQUIRE(rows.start == 3);

  HostTensor ids({rows.total, c.top_k}, i64());
  HostTensor w({rows.total, c.top_k}, f32());
  for (int32_t l = 0; l < c.num_layers; ++l) {
    for (int64_t i = 0; i < ids.numel(); ++i) {
      ids.set(i, route(i / c.top_k, l, i % c.top_k, c.num_experts));
      w.as<float>()[i] = 0.5f;
    }
    REQUIRE(m.capture(h, l, ids.get(), w.get(), nullptr) == MOECAP_OK);
  }
  HostTensor slots({rows.count}, i32());
  slots.fill<int32_t>({17, 4});
  moecap_commit_args a{sizeof a, rows.start, nullptr, slots.get()};
  REQUIRE(m.commit(h, &a, nullptr) == MOECAP_OK);
  HostTensor out({2, c.num_layers, c.top_k}, i32());
  HostTensor wout({2, c.num_layers, c.top_k}, f32());
  REQUIRE(m.read(h, slots.get(), out.get(), wout.get(), 0, nullptr) == MOECAP_OK);
  for (int32_t l = 0; l < c.num_layers; ++l) {
    CHECK(out.at(l * c.top_k) == route(3, l, 0, c.num_experts));
    CHECK(out.at((c.num_layers + l) * c.top_k + 1) == route(4, l, 1, c.num_experts));
  }
  CHECK(wout.as<float>()[0] == 0.5f);

  DLManagedTensorVersioned* v = nullptr;
  REQUIRE(m.export_versioned(h, MOECAP_BUFFER_HOST_IDS, 0, &v) == MOECAP_OK);
  CHECK(static_cast<const uint8_t*>(v->dl_tensor.data)[17 * c.num_layers * c.top_k] == route(3, 0, 0, c.num_experts));
  REQUIRE(m.destroy(h) == MOECAP_OK);
  v->deleter(v);
}

TEST_CASE("errors cross the boundary as status and thread-local text") {
  const moecap_api& m = api();
  moecap_config c = small_config(m.config_init);
  c.top_k = 0;
  moecap_capturer* h = nullptr;
  CHECK(m.create(&c, &h) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(m.last_error()).find("config->top_k is 0") != std::string::npos);
  CHECK(std::string(m.status_name(MOECAP_ERROR_INVALID_ARGUMENT)) == "MOECAP_ERROR_INVALID_ARGUMENT");
  // A newer header's bigger struct whose unknown tail is set.
  struct {
    moecap_config known;
    int64_t future_field;
  } newer{small_config(m.config_init), 1};
  newer.known.struct_size = sizeof newer;
  CHECK(m.create(&newer.known, &h) == MOECAP_ERROR_ABI_MISMATCH);
  CHECK(std::string(m.last_error()).find("config->struct_size is 120 and byte 112 is set") != std::string::npos);
  CHECK(h == nullptr);
}
