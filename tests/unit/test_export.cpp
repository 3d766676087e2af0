// SPDX-License-Identifier: Apache-2.0
// DLPack export consumed through the header only: shapes, strides, dtype,
// device, byte_offset 0, a deleter that keeps the memory alive, and writes
// through a view seen by moecap (zero copy).
#include <doctest/doctest.h>

#include <cstdint>

#include "moecap.h"
#include "tests/support/tensors.h"

using namespace moecap_test;

TEST_CASE("versioned and legacy views describe the buffers exactly") {
  moecap_config c = small_config();
  c.weight_dtype = MOECAP_WEIGHTS_BF16;
  c.dp_size = 2;
  moecap_capturer* h = nullptr;
  REQUIRE(moecap_create(&c, &h) == MOECAP_OK);
  moecap_plan_info info{};
  info.struct_size = sizeof info;
  REQUIRE(moecap_get_plan(h, &info) == MOECAP_OK);

  DLManagedTensorVersioned* dev = nullptr;
  REQUIRE(moecap_export(h, MOECAP_BUFFER_DEVICE_IDS, 0, &dev) == MOECAP_OK);
  CHECK(dev->version.major == 1);
  CHECK(dev->flags == 0);
  CHECK(dev->dl_tensor.byte_offset == 0);
  CHECK(dev->dl_tensor.device.device_type == kDLCPU);
  // Layer-major, in the device id dtype (AUTO: int16), beside a u8 host cache.
  CHECK(info.device_id_dtype == MOECAP_IDS_I16);
  CHECK(info.id_dtype == MOECAP_IDS_U8);
  CHECK(dev->dl_tensor.dtype.code == kDLInt);
  CHECK(dev->dl_tensor.dtype.bits == 16);
  REQUIRE(dev->dl_tensor.ndim == 3);
  CHECK(dev->dl_tensor.shape[0] == c.num_layers);
  CHECK(dev->dl_tensor.shape[1] == info.device_rows);
  CHECK(dev->dl_tensor.shape[2] == c.top_k);
  REQUIRE(dev->dl_tensor.strides != nullptr);
  CHECK(dev->dl_tensor.strides[0] == info.device_rows * c.top_k);
  CHECK(dev->dl_tensor.strides[1] == c.top_k);

  DLManagedTensor* layer = nullptr;
  REQUIRE(moecap_export_legacy(h, MOECAP_BUFFER_LAYER_IDS, 2, &layer) == MOECAP_OK);
  CHECK(layer->dl_tensor.ndim == 2);
  CHECK(layer->dl_tensor.shape[0] == info.device_rows);
  CHECK(layer->dl_tensor.shape[1] == c.top_k);
  CHECK(layer->dl_tensor.strides[0] == c.top_k);  // compact: a kernel's out= tensor
  CHECK(layer->dl_tensor.strides[1] == 1);
  CHECK(static_cast<int16_t*>(layer->dl_tensor.data) ==
        static_cast<int16_t*>(dev->dl_tensor.data) + 2 * info.device_rows * c.top_k);

  DLManagedTensorVersioned* w = nullptr;
  REQUIRE(moecap_export(h, MOECAP_BUFFER_HOST_WEIGHTS, 0, &w) == MOECAP_OK);
  CHECK(w->dl_tensor.dtype.code == kDLBfloat);
  CHECK(w->dl_tensor.shape[0] == c.host_slots);

  // A top-k kernel writing straight into the layer view (out=): capture is free.
  int16_t* l2 = static_cast<int16_t*>(layer->dl_tensor.data);
  l2[0] = 5;
  l2[1] = 6;
  HostTensor slots({1}, i32());
  slots.fill<int32_t>({9});
  moecap_commit_args a{sizeof a, 0, nullptr, slots.get()};
  REQUIRE(moecap_commit(h, &a, nullptr) == MOECAP_OK);
  HostTensor out({1, c.num_layers, c.top_k}, i32());
  REQUIRE(moecap_read(h, slots.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
  CHECK(out.at(2 * c.top_k) == 5);
  CHECK(out.at(2 * c.top_k + 1) == 6);
  CHECK(out.at(0) == -1);  // layers nobody wrote hold no routing: never read as expert 0
  CHECK(moecap_read(h, slots.get(), out.get(), nullptr, MOECAP_READ_STRICT, nullptr) == MOECAP_ERROR_NO_ROUTING);
  CHECK(l2[0] == -1);  // commit consumed the row

  // The views outlive the handle; their deleters free the memory.
  REQUIRE(moecap_destroy(h) == MOECAP_OK);
  l2[0] = 7;
  CHECK(static_cast<int16_t*>(dev->dl_tensor.data)[2 * info.device_rows * c.top_k] == 7);
  dev->deleter(dev);
  layer->deleter(layer);
  w->deleter(w);
}

// Commits and reads touch host rows at random all over the cache: a cache of
// a huge page or more starts on one, so Linux can back it with huge
// pages and a random row is not a TLB miss.
TEST_CASE("the host backend starts a cache of 2 MB or more on a huge page, a small one on a cache line") {
  for (const int64_t slots : {int64_t{32}, int64_t{1} << 20}) {
    CAPTURE(slots);
    moecap_config c = small_config();
    c.host_slots = slots;
    moecap_capturer* h = nullptr;
    REQUIRE(moecap_create(&c, &h) == MOECAP_OK);
    DLManagedTensorVersioned* host = nullptr;
    REQUIRE(moecap_export(h, MOECAP_BUFFER_HOST_IDS, 0, &host) == MOECAP_OK);
    const auto at = reinterpret_cast<uintptr_t>(host->dl_tensor.data);
    const uintptr_t bytes = static_cast<uintptr_t>(slots * c.num_layers * c.top_k);  // u8 ids
    CHECK(at % 64 == 0);
    if (bytes >= (uintptr_t{2} << 20)) CHECK(at % (uintptr_t{2} << 20) == 0);
    host->deleter(host);
    REQUIRE(moecap_destroy(h) == MOECAP_OK);
  }
}

TEST_CASE("moecap_get_api fills a table of the same functions") {
  moecap_api api{};
  api.struct_size = sizeof api;
  REQUIRE(moecap_get_api(&api) == MOECAP_OK);
  CHECK(api.abi_version == MOECAP_ABI_VERSION);
  CHECK((api.capture == &moecap_capture));
  CHECK((api.graph_destroy == &moecap_graph_destroy));
  CHECK((api.abi_version_fn == &moecap_abi_version));
  moecap_api small{};
  small.struct_size = 8;
  CHECK(moecap_get_api(&small) == MOECAP_ERROR_ABI_MISMATCH);
  CHECK(moecap_get_api(nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
}
