// SPDX-License-Identifier: Apache-2.0
// Every entry point's bad input: the right status, a message that names the
// argument and the limit, and nothing changed (docs/DESIGN.md §4).
#include <doctest/doctest.h>

#include <climits>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "moecap.h"
#include "tests/support/tensors.h"

using namespace moecap_test;

namespace {

struct Fixture {
  Fixture() {
    moecap_config c = small_config();
    c.weight_dtype = MOECAP_WEIGHTS_F32;
    c.flags = MOECAP_FLAG_HISTOGRAM;
    cfg = c;
    REQUIRE(moecap_create(&c, &h) == MOECAP_OK);
    // Some content, so "nothing changed" is a real comparison.
    HostTensor ids({4, c.top_k}, i32());
    HostTensor w({4, c.top_k}, f32());
    for (int64_t i = 0; i < 8; ++i) {
      ids.set(i, i % c.num_experts);
      w.as<float>()[i] = 0.25f;
    }
    for (int32_t l = 0; l < c.num_layers; ++l) REQUIRE(moecap_capture(h, l, ids.get(), w.get(), nullptr) == MOECAP_OK);
    HostTensor slots({4}, i32());
    slots.fill<int32_t>({1, 2, 3, 4});
    moecap_commit_args a{sizeof a, 0, nullptr, slots.get()};
    REQUIRE(moecap_commit(h, &a, nullptr) == MOECAP_OK);
  }
  ~Fixture() { moecap_destroy(h); }

  void refused(moecap_status code, const char* needle, const std::function<moecap_status()>& call) {
    CAPTURE(needle);
    const std::vector<uint8_t> before = snapshot(h);
    CHECK(call() == code);
    CHECK_MESSAGE(std::string(moecap_last_error()).find(needle) != std::string::npos, moecap_last_error());
    CHECK(snapshot(h) == before);
  }

  moecap_config cfg{};
  moecap_capturer* h = nullptr;
};

}  // namespace

TEST_CASE("capture refuses bad input") {
  Fixture f;
  const int32_t k = f.cfg.top_k;
  HostTensor ids({2, k}, i32());
  HostTensor w({2, k}, f32());
  ids.fill<int32_t>({5, 6, 7, 1});
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "capturer is NULL", [&] { return moecap_capture(nullptr, 0, ids.get(), w.get(), nullptr); });
  f.refused(MOECAP_ERROR_OUT_OF_RANGE, "num_layers = 3", [&] { return moecap_capture(f.h, 3, ids.get(), w.get(), nullptr); });
  f.refused(MOECAP_ERROR_OUT_OF_RANGE, "layer is -1", [&] { return moecap_capture(f.h, -1, ids.get(), w.get(), nullptr); });
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "topk_ids is NULL", [&] { return moecap_capture(f.h, 0, nullptr, w.get(), nullptr); });
  HostTensor fl({2, k}, f32());
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "topk_ids has dtype float32", [&] { return moecap_capture(f.h, 0, fl.get(), w.get(), nullptr); });
  HostTensor one({4}, i32());
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "topk_ids has ndim 1", [&] { return moecap_capture(f.h, 0, one.get(), w.get(), nullptr); });
  HostTensor wide({2, k + 3}, i32());
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "topk_ids->shape[1] is 5", [&] { return moecap_capture(f.h, 0, wide.get(), w.get(), nullptr); });
  HostTensor big({9, k}, i32());
  HostTensor bigw({9, k}, f32());
  f.refused(MOECAP_ERROR_CAPACITY, "device_rows is 8", [&] { return moecap_capture(f.h, 0, big.get(), bigw.get(), nullptr); });
  DLTensor on_gpu = ids.dl();
  on_gpu.device = DLDevice{kDLCUDA, 0};
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "topk_ids is on cuda:0", [&] { return moecap_capture(f.h, 0, &on_gpu, w.get(), nullptr); });
  int64_t strides[2] = {1, 2};  // column-major: a transposed view
  DLTensor strided = ids.dl();
  strided.strides = strides;
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "not compact", [&] { return moecap_capture(f.h, 0, &strided, w.get(), nullptr); });
  DLTensor null_data = ids.dl();
  null_data.data = nullptr;
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "topk_ids->data is NULL", [&] { return moecap_capture(f.h, 0, &null_data, w.get(), nullptr); });
  DLTensor misaligned = ids.dl();
  misaligned.byte_offset = 2;
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "not aligned", [&] { return moecap_capture(f.h, 0, &misaligned, w.get(), nullptr); });
  DLTensor wrapping = ids.dl();  // an aligned offset that points below data, modulo 2^64
  wrapping.byte_offset = ~uint64_t{0} - 7;
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "wraps around the address space",
            [&] { return moecap_capture(f.h, 0, &wrapping, w.get(), nullptr); });
  int64_t negative_shape[2] = {-2, k};
  DLTensor negative = ids.dl();
  negative.shape = negative_shape;
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "topk_ids->shape[0] is -2; must be >= 0",
            [&] { return moecap_capture(f.h, 0, &negative, w.get(), nullptr); });
  int64_t huge_shape[2] = {int64_t{1} << 62, k};
  DLTensor huge = ids.dl();
  huge.shape = huge_shape;
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "byte size overflows", [&] { return moecap_capture(f.h, 0, &huge, w.get(), nullptr); });
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "topk_weights is NULL; the capturer keeps weights (config->weight_dtype is float32)", [&] { return moecap_capture(f.h, 0, ids.get(), nullptr, nullptr); });
  HostTensor w3({3, k}, f32());
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "topk_weights->shape[0] is 3", [&] { return moecap_capture(f.h, 0, ids.get(), w3.get(), nullptr); });
  HostTensor wint({2, k}, i32());
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "topk_weights has dtype int32", [&] { return moecap_capture(f.h, 0, ids.get(), wint.get(), nullptr); });
}

TEST_CASE("capture refuses weights on a capturer without them") {
  moecap_config c = small_config();
  moecap_capturer* h = nullptr;
  REQUIRE(moecap_create(&c, &h) == MOECAP_OK);
  HostTensor ids({1, c.top_k}, i32());
  HostTensor w({1, c.top_k}, f32());
  CHECK(moecap_capture(h, 0, ids.get(), w.get(), nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(moecap_last_error()).find("MOECAP_WEIGHTS_NONE") != std::string::npos);
  moecap_destroy(h);
}

TEST_CASE("commit refuses bad input") {
  Fixture f;
  HostTensor slots({2}, i64());
  slots.fill<int64_t>({10, 11});
  moecap_commit_args good{sizeof good, 0, nullptr, slots.get()};
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "capturer is NULL", [&] { return moecap_commit(nullptr, &good, nullptr); });
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "args is NULL", [&] { return moecap_commit(f.h, nullptr, nullptr); });
  moecap_commit_args a = good;
  a.struct_size = 16;
  f.refused(MOECAP_ERROR_ABI_MISMATCH, "args->struct_size is 16", [&] { return moecap_commit(f.h, &a, nullptr); });
  a = good;
  a.dst_slots = nullptr;
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "args->dst_slots is NULL", [&] { return moecap_commit(f.h, &a, nullptr); });
  HostTensor fslots({2}, f32());
  a.dst_slots = fslots.get();
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "args->dst_slots has dtype float32", [&] { return moecap_commit(f.h, &a, nullptr); });
  HostTensor past({3}, i64());
  past.fill<int64_t>({1, 32, 2});  // host_slots is 32: the middle one is past the cache
  a.dst_slots = past.get();
  f.refused(MOECAP_ERROR_OUT_OF_RANGE, "args->dst_slots[1] is 32; it must be in [-1, 32)", [&] { return moecap_commit(f.h, &a, nullptr); });
  past.fill<int64_t>({1, -2, 2});
  f.refused(MOECAP_ERROR_OUT_OF_RANGE, "args->dst_slots[1] is -2", [&] { return moecap_commit(f.h, &a, nullptr); });
  a = good;
  a.src_start = 7;  // rows 7 and 8 of 8
  f.refused(MOECAP_ERROR_CAPACITY, "device_rows = 8", [&] { return moecap_commit(f.h, &a, nullptr); });
  a.src_start = -1;
  f.refused(MOECAP_ERROR_OUT_OF_RANGE, "args->src_start is -1; it must be >= 0",
            [&] { return moecap_commit(f.h, &a, nullptr); });
  HostTensor many({9}, i64());
  a = good;
  a.dst_slots = many.get();
  f.refused(MOECAP_ERROR_CAPACITY, "args->dst_slots has 9 entries", [&] { return moecap_commit(f.h, &a, nullptr); });
  HostTensor rows({3}, i32());
  a = good;
  a.src_rows = rows.get();
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "args->src_rows->shape[0] is 3", [&] { return moecap_commit(f.h, &a, nullptr); });
  HostTensor rows2({2}, i32());
  rows2.fill<int32_t>({0, 8});
  a.src_rows = rows2.get();
  f.refused(MOECAP_ERROR_OUT_OF_RANGE, "args->src_rows[1] is 8", [&] { return moecap_commit(f.h, &a, nullptr); });
  DLTensor gpu_slots = slots.dl();
  gpu_slots.device = DLDevice{kDLCUDA, 0};
  a = good;
  a.dst_slots = &gpu_slots;
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "args->dst_slots is on cuda:0", [&] { return moecap_commit(f.h, &a, nullptr); });
}

TEST_CASE("read refuses bad input") {
  Fixture f;
  const moecap_config& c = f.cfg;
  HostTensor slots({2}, i32());
  slots.fill<int32_t>({1, 2});
  HostTensor out({2, c.num_layers, c.top_k}, i32());
  HostTensor wout({2, c.num_layers, c.top_k}, f32());
  const std::vector<uint8_t> out_before = out.bytes();
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "capturer is NULL", [&] { return moecap_read(nullptr, slots.get(), out.get(), nullptr, 0, nullptr); });
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "slots is NULL", [&] { return moecap_read(f.h, nullptr, out.get(), nullptr, 0, nullptr); });
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "ids_out is NULL", [&] { return moecap_read(f.h, slots.get(), nullptr, nullptr, 0, nullptr); });
  HostTensor wrong({2, c.num_layers + 1, c.top_k}, i32());
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "ids_out->shape[1] is 4; expected 3 (num_layers)", [&] { return moecap_read(f.h, slots.get(), wrong.get(), nullptr, 0, nullptr); });
  HostTensor fout({2, c.num_layers, c.top_k}, f32());
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "ids_out has dtype float32", [&] { return moecap_read(f.h, slots.get(), fout.get(), nullptr, 0, nullptr); });
  HostTensor past({2}, i64());
  past.fill<int64_t>({1, 40});
  f.refused(MOECAP_ERROR_OUT_OF_RANGE, "slots[1] is 40; it must be in [0, 32)", [&] { return moecap_read(f.h, past.get(), out.get(), nullptr, 0, nullptr); });
  past.fill<int64_t>({-1, 1});
  f.refused(MOECAP_ERROR_OUT_OF_RANGE, "slots[0] is -1", [&] { return moecap_read(f.h, past.get(), out.get(), nullptr, 0, nullptr); });
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "flags has unknown bits", [&] { return moecap_read(f.h, slots.get(), out.get(), nullptr, 0x10, nullptr); });
  DLTensor gpu_out = out.dl();
  gpu_out.device = DLDevice{kDLCUDA, 0};
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "ids_out is on cuda:0", [&] { return moecap_read(f.h, slots.get(), &gpu_out, nullptr, 0, nullptr); });
  HostTensor wbad({2, c.num_layers, c.top_k + 1}, f32());
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "weights_out->shape[2]", [&] { return moecap_read(f.h, slots.get(), out.get(), wbad.get(), 0, nullptr); });
  DLTensor gpu_w = wout.dl();
  gpu_w.device = DLDevice{kDLCUDA, 0};
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "both must be host memory or both device memory", [&] { return moecap_read(f.h, slots.get(), out.get(), &gpu_w, 0, nullptr); });
  CHECK(out.bytes() == out_before);  // no partial write into the caller's tensor either
}

TEST_CASE("read into a dtype too narrow for the experts is refused") {
  moecap_config c = small_config();
  c.num_experts = 300;
  moecap_capturer* h = nullptr;
  REQUIRE(moecap_create(&c, &h) == MOECAP_OK);
  HostTensor slots({1}, i32());
  HostTensor out({1, c.num_layers, c.top_k}, u8());
  CHECK(moecap_read(h, slots.get(), out.get(), nullptr, 0, nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(moecap_last_error()).find("num_experts is 300") != std::string::npos);
  HostTensor wout({1, c.num_layers, c.top_k}, f32());
  HostTensor out16({1, c.num_layers, c.top_k}, u16());
  CHECK(moecap_read(h, slots.get(), out16.get(), wout.get(), 0, nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(moecap_last_error()).find("weights_out is given") != std::string::npos);
  moecap_destroy(h);
}

TEST_CASE("write refuses bad input") {
  Fixture f;
  const moecap_config& c = f.cfg;
  HostTensor slots({1}, i32());
  slots.fill<int32_t>({5});
  HostTensor ids({1, c.num_layers, c.top_k}, i32());
  HostTensor w({1, c.num_layers, c.top_k}, f32());
  ids.set(4, 8);  // num_experts is 8
  f.refused(MOECAP_ERROR_OUT_OF_RANGE, "ids[0][2][0] is 8", [&] { return moecap_write(f.h, slots.get(), ids.get(), w.get(), nullptr); });
  ids.set(4, -3);
  f.refused(MOECAP_ERROR_OUT_OF_RANGE, "is -3", [&] { return moecap_write(f.h, slots.get(), ids.get(), w.get(), nullptr); });
  ids.set(4, 1);
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "weights is NULL; the capturer keeps weights", [&] { return moecap_write(f.h, slots.get(), ids.get(), nullptr, nullptr); });
  HostTensor past({1}, i32());
  past.fill<int32_t>({32});
  f.refused(MOECAP_ERROR_OUT_OF_RANGE, "slots[0] is 32", [&] { return moecap_write(f.h, past.get(), ids.get(), w.get(), nullptr); });
  DLTensor gpu_ids = ids.dl();
  gpu_ids.device = DLDevice{kDLCUDA, 0};
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "ids is on cuda:0; expected host memory or the capturer's device (cpu)", [&] { return moecap_write(f.h, slots.get(), &gpu_ids, w.get(), nullptr); });
  HostTensor ids2({2, c.num_layers, c.top_k}, i32());
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "ids->shape[0] is 2", [&] { return moecap_write(f.h, slots.get(), ids2.get(), w.get(), nullptr); });
}

TEST_CASE("read and write refuse tensors sharing memory with each other or with the host cache") {
  // The gather and the row stores load slots and ids as they go: a tensor
  // they write into would change values already checked.
  Fixture f;
  const moecap_config& c = f.cfg;
  HostTensor out({2, c.num_layers, c.top_k}, i32());
  HostTensor wout({2, c.num_layers, c.top_k}, f32());
  const std::vector<uint8_t> out_before = out.bytes();
  DLTensor slots_in_out = out.dl();  // slots 1 and 2 in out's first elements
  int64_t two[1] = {2};
  slots_in_out.ndim = 1;
  slots_in_out.shape = two;
  slots_in_out.strides = nullptr;
  out.set(0, 1);
  out.set(1, 2);
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "ids_out shares memory with slots", [&] { return moecap_read(f.h, &slots_in_out, out.get(), nullptr, 0, nullptr); });
  DLTensor slots_in_w = slots_in_out;
  slots_in_w.data = wout.get()->data;
  slots_in_w.byte_offset = 4 * static_cast<uint64_t>(c.top_k);  // past the first row's first layer
  std::memcpy(static_cast<uint8_t*>(slots_in_w.data) + slots_in_w.byte_offset, out.get()->data, 8);
  HostTensor slots({2}, i32());
  slots.fill<int32_t>({1, 2});
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "weights_out shares memory with slots", [&] { return moecap_read(f.h, &slots_in_w, out.get(), wout.get(), 0, nullptr); });
  DLTensor w_over_ids = out.dl();
  w_over_ids.dtype = DLDataType{kDLFloat, 32, 1};
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "weights_out shares memory with ids_out", [&] { return moecap_read(f.h, slots.get(), out.get(), &w_over_ids, 0, nullptr); });

  DLManagedTensorVersioned* cache = nullptr;
  REQUIRE(moecap_export(f.h, MOECAP_BUFFER_HOST_IDS, 0, &cache) == MOECAP_OK);
  DLTensor out_in_cache = out.dl();
  out_in_cache.data = cache->dl_tensor.data;
  out_in_cache.byte_offset = cache->dl_tensor.byte_offset;
  out_in_cache.dtype = DLDataType{kDLUInt, 8, 1};  // the cache's own u8 ids
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "ids_out lies in the capturer's host cache", [&] { return moecap_read(f.h, slots.get(), &out_in_cache, nullptr, 0, nullptr); });
  DLTensor slots_in_cache = slots.dl();
  slots_in_cache.data = cache->dl_tensor.data;
  slots_in_cache.byte_offset = cache->dl_tensor.byte_offset;
  slots_in_cache.dtype = DLDataType{kDLInt, 32, 1};
  HostTensor ids({2, c.num_layers, c.top_k}, i32());
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "slots lies in the capturer's host cache", [&] { return moecap_write(f.h, &slots_in_cache, ids.get(), wout.get(), nullptr); });
  DLTensor ids_in_cache = ids.dl();
  ids_in_cache.data = cache->dl_tensor.data;
  ids_in_cache.byte_offset = cache->dl_tensor.byte_offset;
  ids_in_cache.dtype = DLDataType{kDLUInt, 8, 1};
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "ids lies in the capturer's host cache", [&] { return moecap_write(f.h, slots.get(), &ids_in_cache, wout.get(), nullptr); });
  cache->deleter(cache);
  CHECK(out.bytes() != out_before);  // only the two slot values planted above
  out.set(0, 0);
  out.set(1, 0);
  CHECK(out.bytes() == out_before);
  // Separate tensors side by side still read.
  CHECK(moecap_read(f.h, slots.get(), out.get(), wout.get(), 0, nullptr) == MOECAP_OK);
}

TEST_CASE("capture and commit refuse tensors in the device buffer, but for a layer's own rows") {
  moecap_config c = small_config();
  c.device_id_dtype = MOECAP_IDS_I32;  // int32 views (the next case takes the default int16, and u8)
  c.weight_dtype = MOECAP_WEIGHTS_F32;
  moecap_capturer* h = nullptr;
  REQUIRE(moecap_create(&c, &h) == MOECAP_OK);
  DLManagedTensorVersioned* layer0 = nullptr;
  DLManagedTensorVersioned* weights0 = nullptr;
  REQUIRE(moecap_export(h, MOECAP_BUFFER_LAYER_IDS, 0, &layer0) == MOECAP_OK);
  REQUIRE(moecap_export(h, MOECAP_BUFFER_LAYER_WEIGHTS, 0, &weights0) == MOECAP_OK);
  auto* view = static_cast<int32_t*>(layer0->dl_tensor.data);
  for (int i = 0; i < 4 * c.top_k; ++i) {  // a top-k kernel wrote rows 0-3 of layer 0
    view[i] = 6 + i % 2;
    static_cast<float*>(weights0->dl_tensor.data)[i] = 0.5f;
  }
  int64_t shape[2] = {4, c.top_k};
  DLTensor own = layer0->dl_tensor;
  own.shape = shape;
  own.strides = nullptr;
  DLTensor own_w = weights0->dl_tensor;
  own_w.shape = shape;
  own_w.strides = nullptr;
  HostTensor w({4, c.top_k}, f32());
  auto refused = [&](const char* needle, const std::function<moecap_status()>& call) {
    CAPTURE(needle);
    const std::vector<uint8_t> before = snapshot(h);
    CHECK(call() == MOECAP_ERROR_INVALID_ARGUMENT);
    CHECK_MESSAGE(std::string(moecap_last_error()).find(needle) != std::string::npos, moecap_last_error());
    CHECK(snapshot(h) == before);
  };
  // Shifted by a row, the copy would read rows it has just written.
  DLTensor shifted = own;
  shifted.byte_offset = 4 * static_cast<uint64_t>(c.top_k);
  refused("histogram view) other than exactly the layer's own rows", [&] { return moecap_capture(h, 0, &shifted, w.get(), nullptr); });
  refused("topk_ids lies in the capturer's device buffer", [&] { return moecap_capture(h, 1, &own, w.get(), nullptr); });
  DLTensor shifted_w = own_w;
  shifted_w.byte_offset = 4 * static_cast<uint64_t>(c.top_k);
  refused("topk_weights lies in the capturer's device buffer", [&] { return moecap_capture(h, 0, &own, &shifted_w, nullptr); });
  DLTensor slots = own;  // slot (or row) numbers planted in the device rows the commit consumes
  slots.ndim = 1;
  refused("args->dst_slots lies in the capturer's device buffer", [&] {
    moecap_commit_args a{sizeof a, 0, nullptr, &slots};
    return moecap_commit(h, &a, nullptr);
  });
  HostTensor four({4}, i32());
  four.fill<int32_t>({10, 11, 12, 13});
  refused("args->src_rows lies in the capturer's device buffer", [&] {
    moecap_commit_args a{sizeof a, 0, &slots, four.get()};
    return moecap_commit(h, &a, nullptr);
  });
  CHECK(std::string(moecap_last_error()).find("own rows") == std::string::npos);  // no exemption for a commit
  // The layer's own rows, as they are stored, are copied onto themselves.
  REQUIRE(moecap_capture(h, 0, &own, &own_w, nullptr) == MOECAP_OK);
  HostTensor ids({4, c.top_k}, i32());
  ids.fill<int32_t>({1, 2, 3, 4, 5, 6, 7, 0});
  for (int32_t l = 1; l < c.num_layers; ++l) REQUIRE(moecap_capture(h, l, ids.get(), w.get(), nullptr) == MOECAP_OK);
  HostTensor to({4}, i32());
  to.fill<int32_t>({10, 11, 12, 13});
  moecap_commit_args a{sizeof a, 0, nullptr, to.get()};
  REQUIRE(moecap_commit(h, &a, nullptr) == MOECAP_OK);
  HostTensor out({4, c.num_layers, c.top_k}, i32());
  REQUIRE(moecap_read(h, to.get(), out.get(), nullptr, MOECAP_READ_STRICT, nullptr) == MOECAP_OK);
  for (int64_t r = 0; r < 4; ++r) {
    CHECK(out.as<int32_t>()[r * c.num_layers * c.top_k] == 6);
    CHECK(out.as<int32_t>()[r * c.num_layers * c.top_k + 1] == 7);
  }
  layer0->deleter(layer0);
  weights0->deleter(weights0);
  moecap_destroy(h);
}

TEST_CASE("read refuses outputs in the device buffer: they would commit later as another token's routing") {
  Fixture f;
  const moecap_config& c = f.cfg;
  HostTensor slots({1}, i32());
  slots.fill<int32_t>({1});
  for (int32_t which : {MOECAP_BUFFER_DEVICE_IDS, MOECAP_BUFFER_DEVICE_WEIGHTS, MOECAP_BUFFER_HISTOGRAM}) {
    CAPTURE(which);
    DLManagedTensorVersioned* v = nullptr;
    REQUIRE(moecap_export(f.h, which, 0, &v) == MOECAP_OK);
    int64_t shape[3] = {1, c.num_layers, c.top_k};
    HostTensor ids({1, c.num_layers, c.top_k}, i32());
    // The view's own memory, shaped as the output (each view holds at least one row's bytes).
    DLTensor in_buffer{v->dl_tensor.data, v->dl_tensor.device, 3, v->dl_tensor.dtype, shape, nullptr, 0};
    if (which == MOECAP_BUFFER_DEVICE_WEIGHTS) {
      f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "weights_out lies in the capturer's device buffer",
                [&] { return moecap_read(f.h, slots.get(), ids.get(), &in_buffer, 0, nullptr); });
    } else {
      f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "ids_out lies in the capturer's device buffer",
                [&] { return moecap_read(f.h, slots.get(), &in_buffer, nullptr, 0, nullptr); });
    }
    v->deleter(v);
  }
}

TEST_CASE("a layer's own rows in the default int16 and in u8 are captured in place, bad ids counted once") {
  // Without a histogram the host capture has typed fast paths: own rows must not take them.
  for (const bool histogram : {true, false})
  for (const moecap_id_dtype dtype : {MOECAP_IDS_AUTO, MOECAP_IDS_U8, MOECAP_IDS_I32}) {
    CAPTURE(dtype);
    CAPTURE(histogram);
    moecap_config c = small_config();
    c.device_id_dtype = dtype;
    c.flags = histogram ? MOECAP_FLAG_HISTOGRAM : 0u;
    moecap_capturer* h = nullptr;
    REQUIRE(moecap_create(&c, &h) == MOECAP_OK);
    DLManagedTensorVersioned* layer0 = nullptr;
    REQUIRE(moecap_export(h, MOECAP_BUFFER_LAYER_IDS, 0, &layer0) == MOECAP_OK);
    const int32_t bits = layer0->dl_tensor.dtype.bits;
    CHECK(bits == (dtype == MOECAP_IDS_AUTO ? 16 : dtype == MOECAP_IDS_U8 ? 8 : 32));
    // A top-k kernel wrote rows 0-2 of layer 0: row 1 holds an id past the
    // experts (counted), row 2 the dtype's own "no expert" (all ones: not counted).
    const int64_t written[6] = {6, 7, c.num_experts + 3, 1, -1, -1};
    for (int i = 0; i < 6; ++i) {
      void* d = layer0->dl_tensor.data;
      if (bits == 8) static_cast<uint8_t*>(d)[i] = static_cast<uint8_t>(written[i]);
      if (bits == 16) static_cast<int16_t*>(d)[i] = static_cast<int16_t>(written[i]);
      if (bits == 32) static_cast<int32_t*>(d)[i] = static_cast<int32_t>(written[i]);
    }
    int64_t shape[2] = {3, c.top_k};
    DLTensor own = layer0->dl_tensor;
    own.shape = shape;
    own.strides = nullptr;
    REQUIRE_MESSAGE(moecap_capture(h, 0, &own, nullptr, nullptr) == MOECAP_OK, moecap_last_error());
    HostTensor copy({3, c.top_k}, layer0->dl_tensor.dtype);
    DLTensor other = own;  // the same dtype anywhere else is not the layer's own rows
    other.data = copy.get()->data;
    if (bits != 32) {
      CHECK(moecap_capture(h, 1, &other, nullptr, nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
      CHECK(std::string(moecap_last_error()).find("the device dtype, which capture takes only as exactly the layer's "
                                                  "own rows") != std::string::npos);
    }
    HostTensor ids({3, c.top_k}, i32());
    ids.fill<int32_t>({1, 2, 3, 4, 5, 0});
    for (int32_t l = 1; l < c.num_layers; ++l) REQUIRE(moecap_capture(h, l, ids.get(), nullptr, nullptr) == MOECAP_OK);
    HostTensor to({3}, i32());
    to.fill<int32_t>({10, 11, 12});
    moecap_commit_args a{sizeof a, 0, nullptr, to.get()};
    REQUIRE(moecap_commit(h, &a, nullptr) == MOECAP_OK);
    moecap_error_counts e{};
    e.struct_size = sizeof e;
    REQUIRE(moecap_get_errors(h, &e, 0) == MOECAP_OK);
    CHECK(e.invalid_ids == 1);  // at capture; commit sees the "no expert" it became
    HostTensor out({3, c.num_layers, c.top_k}, i32());
    REQUIRE(moecap_read(h, to.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
    const int32_t* o = out.as<int32_t>();
    const int64_t row = int64_t{c.num_layers} * c.top_k;
    CHECK(o[0] == 6);
    CHECK(o[1] == 7);
    CHECK(o[row] == -1);  // the id past the experts
    CHECK(o[row + 1] == 1);
    CHECK(o[2 * row] == -1);
    CHECK(o[2 * row + 1] == -1);
    CHECK(o[2 * row + c.top_k] == 5);  // layer 1 as captured
    if (histogram) {
      DLManagedTensorVersioned* hist = nullptr;
      REQUIRE(moecap_export(h, MOECAP_BUFFER_HISTOGRAM, 0, &hist) == MOECAP_OK);
      const auto* counts = static_cast<const int64_t*>(hist->dl_tensor.data);
      CHECK(counts[6] == 1);
      CHECK(counts[7] == 1);
      CHECK(counts[1] == 1);
      int64_t layer0_total = 0;
      for (int32_t x = 0; x < c.num_experts; ++x) layer0_total += counts[x];
      CHECK(layer0_total == 3);
      hist->deleter(hist);
    }
    layer0->deleter(layer0);
    moecap_destroy(h);
  }
}

TEST_CASE("export, histogram_reset, get_errors, get_plan and graphs refuse bad input") {
  Fixture f;
  DLManagedTensorVersioned* v = nullptr;
  DLManagedTensor* legacy = nullptr;
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "which is 0", [&] { return moecap_export(f.h, 0, 0, &v); });
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "which is 99", [&] { return moecap_export_legacy(f.h, 99, 0, &legacy); });
  f.refused(MOECAP_ERROR_OUT_OF_RANGE, "layer is 3", [&] { return moecap_export(f.h, MOECAP_BUFFER_LAYER_IDS, 3, &v); });
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "out is NULL", [&] { return moecap_export(f.h, MOECAP_BUFFER_HOST_IDS, 0, nullptr); });
  CHECK(v == nullptr);
  CHECK(legacy == nullptr);
  moecap_error_counts e{};
  e.struct_size = 4;
  f.refused(MOECAP_ERROR_ABI_MISMATCH, "out->struct_size is 4", [&] { return moecap_get_errors(f.h, &e, 0); });
  e.struct_size = sizeof e;
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "flags has unknown bits", [&] { return moecap_get_errors(f.h, &e, 8); });
  moecap_plan_info info{};
  f.refused(MOECAP_ERROR_ABI_MISMATCH, "out->struct_size is 0", [&] { return moecap_get_plan(f.h, &info); });
  moecap_graph* g = nullptr;
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "no moecap_graph_begin", [&] { return moecap_graph_end(f.h, &g); });
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "graph is NULL", [&] { return moecap_graph_launch(nullptr, nullptr); });
  CHECK(moecap_graph_destroy(nullptr) == MOECAP_OK);

  moecap_config plain = small_config();
  moecap_capturer* h = nullptr;
  REQUIRE(moecap_create(&plain, &h) == MOECAP_OK);
  CHECK(moecap_histogram_reset(h, nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(moecap_last_error()).find("MOECAP_FLAG_HISTOGRAM") != std::string::npos);
  CHECK(moecap_export(h, MOECAP_BUFFER_HISTOGRAM, 0, &v) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(moecap_export(h, MOECAP_BUFFER_HOST_WEIGHTS, 0, &v) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(moecap_last_error()).find("MOECAP_WEIGHTS_NONE") != std::string::npos);
  moecap_destroy(h);
}

TEST_CASE("create and destroy edge cases") {
  moecap_config c = small_config();
  CHECK(moecap_create(&c, nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
  moecap_capturer* h = nullptr;
  c.num_layers = 0;
  CHECK(moecap_create(&c, &h) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(h == nullptr);
  CHECK(moecap_destroy(nullptr) == MOECAP_OK);
  // A plan far larger than memory: OUT_OF_MEMORY, nothing handed out.
  c = small_config();
  c.host_slots = int64_t{1} << 40;
  c.num_layers = 64;
  c.top_k = 8;
  c.num_experts = 256;
  CHECK(moecap_create(&c, &h) == MOECAP_ERROR_OUT_OF_MEMORY);
  CHECK(h == nullptr);
  CHECK(std::string(moecap_last_error()).find("cannot allocate") != std::string::npos);
}

TEST_CASE("status names and ABI version") {
  CHECK(std::string(moecap_status_name(MOECAP_ERROR_CAPACITY)) == "MOECAP_ERROR_CAPACITY");
  CHECK(std::string(moecap_status_name(static_cast<moecap_status>(77))) == "MOECAP_STATUS_UNKNOWN");
  CHECK(moecap_abi_version() == MOECAP_ABI_VERSION);
}

TEST_CASE("guard canaries report the region something wrote past") {
  moecap_config c = small_config();
  c.flags = MOECAP_FLAG_GUARDS;
  moecap_capturer* h = nullptr;
  REQUIRE(moecap_create(&c, &h) == MOECAP_OK);
  DLManagedTensorVersioned* v = nullptr;
  REQUIRE(moecap_export(h, MOECAP_BUFFER_HOST_IDS, 0, &v) == MOECAP_OK);
  HostTensor slots({1}, i32());
  HostTensor out({1, c.num_layers, c.top_k}, i32());
  HostTensor outside({1, c.top_k}, i32());
  outside.fill<int32_t>({99, 1});  // counted in invalid_ids
  REQUIRE(moecap_capture(h, 0, outside.get(), nullptr, nullptr) == MOECAP_OK);
  REQUIRE(moecap_read(h, slots.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
  // An engine bug writing one byte past the host cache through the exported view.
  uint8_t* end = static_cast<uint8_t*>(v->dl_tensor.data) + c.host_slots * c.num_layers * c.top_k;
  end[3] ^= 0xff;
  CHECK(moecap_read(h, slots.get(), out.get(), nullptr, 0, nullptr) == MOECAP_ERROR_CORRUPTION);
  CHECK(std::string(moecap_last_error()).find("host ids") != std::string::npos);
  // The error counts are no way around it: get_errors reports it too, and clears nothing.
  moecap_error_counts e{};
  e.struct_size = sizeof e;
  CHECK(moecap_get_errors(h, &e, MOECAP_ERRORS_CLEAR) == MOECAP_ERROR_CORRUPTION);
  CHECK(std::string(moecap_last_error()).find("host ids") != std::string::npos);
  CHECK(moecap_synchronize(h) == MOECAP_ERROR_CORRUPTION);
  end[3] ^= 0xff;
  CHECK(moecap_read(h, slots.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
  CHECK(moecap_get_errors(h, &e, 0) == MOECAP_OK);
  CHECK(e.invalid_ids == 1);  // the id counted before the damage, not cleared by the refused call
  v->deleter(v);
  moecap_destroy(h);
}

// Inputs at the edges of int32 and of DLPack that once reached undefined
// behaviour (or a false refusal): each is refused cleanly, or accepted.
TEST_CASE("extra_columns near INT32_MAX is refused at create, not overflowed at capture") {
  moecap_config c = small_config();
  c.extra_columns = INT32_MAX - 1;
  moecap_capturer* h = nullptr;
  CHECK(moecap_create(&c, &h) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(moecap_last_error()).find("config->extra_columns is 2147483646; it must be <= 65536") !=
        std::string::npos);
  CHECK(h == nullptr);
  c.extra_columns = 65536;
  REQUIRE(moecap_create(&c, &h) == MOECAP_OK);
  HostTensor ids({1, c.top_k + 65536}, i32());
  CHECK(moecap_capture(h, 0, ids.get(), nullptr, nullptr) == MOECAP_OK);
  moecap_destroy(h);
}

TEST_CASE("a DLTensor device_type outside DLDeviceType is refused without loading it as the enum") {
  Fixture f;
  HostTensor ids({2, f.cfg.top_k}, i32());
  HostTensor w({2, f.cfg.top_k}, f32());
  DLTensor odd = ids.dl();
  const int32_t raw = -5;
  std::memcpy(&odd.device.device_type, &raw, sizeof raw);
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "topk_ids->device.device_type is -5; not a DLPack device type",
            [&] { return moecap_capture(f.h, 0, &odd, w.get(), nullptr); });
  HostTensor slots({1}, i32());
  DLTensor odd_slots = slots.dl();
  std::memcpy(&odd_slots.device.device_type, &raw, sizeof raw);
  f.refused(MOECAP_ERROR_INVALID_ARGUMENT, "slots->device.device_type is -5",
            [&] { return moecap_invalidate(f.h, &odd_slots, nullptr); });
}

// DLPack 1.0 device types past the end of the enum this build's dlpack.h may
// declare (Debian's 0.6 ends at 13, so 16 and 17 lie outside its range): every
// entry point compares them as integers. Loading one as DLDeviceType was
// undefined behaviour that UBSan (the ASan+UBSan build) aborts on; here they
// must come back as "on the wrong device", naming the raw number (DLPack only
// adds types: kDLTrn is 18 since 1.2), and values below 1 as "not a DLPack
// device type".
TEST_CASE("device types past the header's DLDeviceType are compared as integers by every entry point") {
  Fixture f;
  const int32_t k = f.cfg.top_k;
  HostTensor ids({2, k}, i32());
  HostTensor w({2, k}, f32());
  HostTensor slots({2}, i32());
  slots.fill<int32_t>({1, 2});
  HostTensor rows({2}, i32());
  rows.fill<int32_t>({0, 1});
  HostTensor out({2, f.cfg.num_layers, k}, i32());
  HostTensor out_w({2, f.cfg.num_layers, k}, f32());
  auto with_type = [](DLTensor t, int32_t raw) {
    std::memcpy(&t.device.device_type, &raw, sizeof raw);
    return t;
  };
  for (int32_t raw : {14, 15, 16, 17, 18, 0, -1, 1 << 30}) {
    CAPTURE(raw);
    const bool dlpack_type = raw >= 1;
    const std::string needle = dlpack_type ? "is on device_type " + std::to_string(raw)
                                           : "device.device_type is " + std::to_string(raw) + "; not a DLPack device type";
    DLTensor bad_ids = with_type(ids.dl(), raw);
    DLTensor bad_w = with_type(w.dl(), raw);
    DLTensor bad_slots = with_type(slots.dl(), raw);
    DLTensor bad_rows = with_type(rows.dl(), raw);
    DLTensor bad_out = with_type(out.dl(), raw);
    DLTensor bad_out_w = with_type(out_w.dl(), raw);
    DLTensor bad_src = with_type(out.dl(), raw);
    const char* n = needle.c_str();
    f.refused(MOECAP_ERROR_INVALID_ARGUMENT, n, [&] { return moecap_capture(f.h, 0, &bad_ids, w.get(), nullptr); });
    f.refused(MOECAP_ERROR_INVALID_ARGUMENT, n, [&] { return moecap_capture(f.h, 0, ids.get(), &bad_w, nullptr); });
    moecap_commit_args a{sizeof a, 0, nullptr, &bad_slots};
    f.refused(MOECAP_ERROR_INVALID_ARGUMENT, n, [&] { return moecap_commit(f.h, &a, nullptr); });
    moecap_commit_args by_rows{sizeof by_rows, 0, &bad_rows, slots.get()};
    f.refused(MOECAP_ERROR_INVALID_ARGUMENT, n, [&] { return moecap_commit(f.h, &by_rows, nullptr); });
    f.refused(MOECAP_ERROR_INVALID_ARGUMENT, n, [&] { return moecap_invalidate(f.h, &bad_slots, nullptr); });
    f.refused(MOECAP_ERROR_INVALID_ARGUMENT, n,
              [&] { return moecap_read(f.h, &bad_slots, out.get(), out_w.get(), 0, nullptr); });
    f.refused(MOECAP_ERROR_INVALID_ARGUMENT, n,
              [&] { return moecap_read(f.h, slots.get(), &bad_out, out_w.get(), 0, nullptr); });
    f.refused(MOECAP_ERROR_INVALID_ARGUMENT, dlpack_type ? "weights_out is on device_type" : n,
              [&] { return moecap_read(f.h, slots.get(), out.get(), &bad_out_w, 0, nullptr); });
    f.refused(MOECAP_ERROR_INVALID_ARGUMENT, n,
              [&] { return moecap_write(f.h, &bad_slots, out.get(), out_w.get(), nullptr); });
    f.refused(MOECAP_ERROR_INVALID_ARGUMENT, n,
              [&] { return moecap_write(f.h, slots.get(), &bad_src, out_w.get(), nullptr); });
  }
}

TEST_CASE("a tensor with zero elements is compact whatever its strides, and huge strides overflow nothing") {
  Fixture f;
  const int32_t k = f.cfg.top_k;
  // NumPy's empty array: shape (0,), strides (0,). An idle DP rank commits zero tokens.
  int64_t zero_shape[1] = {0};
  int64_t zero_strides[1] = {0};
  DLTensor empty{nullptr, {kDLCPU, 0}, 1, i64(), zero_shape, zero_strides, 0};
  moecap_commit_args a{sizeof a, 0, nullptr, &empty};
  const std::vector<uint8_t> before = snapshot(f.h);
  CHECK(moecap_commit(f.h, &a, nullptr) == MOECAP_OK);
  CHECK(moecap_invalidate(f.h, &empty, nullptr) == MOECAP_OK);
  // Zero rows with strides whose product would overflow int64.
  int64_t shape[2] = {0, k};
  int64_t strides[2] = {INT64_MAX, INT64_MAX};
  DLTensor ids{nullptr, {kDLCPU, 0}, 2, i32(), shape, strides, 0};
  DLTensor w{nullptr, {kDLCPU, 0}, 2, f32(), shape, strides, 0};
  CHECK(moecap_capture(f.h, 0, &ids, &w, nullptr) == MOECAP_OK);
  int64_t out_shape[3] = {0, INT64_MAX / 2, INT64_MAX / 2};
  int64_t out_strides[3] = {INT64_MAX, INT64_MAX, INT64_MAX};
  DLTensor out{nullptr, {kDLCPU, 0}, 3, i32(), out_shape, out_strides, 0};
  CHECK(moecap_read(f.h, &empty, &out, nullptr, 0, nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);  // shape[1] wrong
  CHECK(std::string(moecap_last_error()).find("ids_out->shape[1]") != std::string::npos);
  CHECK(snapshot(f.h) == before);
}
