// SPDX-License-Identifier: Apache-2.0
// The core test matrix on the CUDA backend, checked row by row against the
// host backend doing the same steps. Skips (exit 77) without a GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdio>
#include <string>
#include <vector>

#include "moecap.h"
#include "tests/support/tensors.h"

using namespace moecap_test;

namespace {

#define CUDA_OK(call) REQUIRE_MESSAGE((call) == cudaSuccess, #call)

// A device copy of a host tensor, with its own DLTensor on kDLCUDA.
class DeviceTensor {
 public:
  explicit DeviceTensor(HostTensor& host) : host_(host) {
    bytes_ = host.bytes().size();
    CUDA_OK(cudaMalloc(&ptr_, bytes_ == 0 ? 1 : bytes_));
    t_ = host.dl();
    t_.data = ptr_;
    t_.device = DLDevice{kDLCUDA, 0};
    upload();
  }
  ~DeviceTensor() { cudaFree(ptr_); }
  void upload() { CUDA_OK(cudaMemcpy(ptr_, host_.bytes().data(), bytes_, cudaMemcpyHostToDevice)); }
  DLTensor* get() { return &t_; }

 private:
  HostTensor& host_;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  DLTensor t_{};
};

struct Pair {
  explicit Pair(moecap_config c) : config(c) {
    c.device_type = MOECAP_DEVICE_HOST;
    REQUIRE(moecap_create(&c, &host) == MOECAP_OK);
    c.device_type = MOECAP_DEVICE_CUDA;
    const moecap_status s = moecap_create(&c, &cuda);
    REQUIRE_MESSAGE(s == MOECAP_OK, std::string(moecap_last_error()));
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  ~Pair() {
    moecap_destroy(host);
    moecap_destroy(cuda);
    cudaStreamDestroy(stream);
  }
  moecap_config config;
  moecap_capturer* host = nullptr;
  moecap_capturer* cuda = nullptr;
  cudaStream_t stream = nullptr;
};

std::vector<int64_t> read_slots(moecap_capturer* h, const moecap_config& c, int64_t slots_count, bool weights,
                                std::vector<float>* wout) {
  HostTensor slots({slots_count}, i64());
  for (int64_t s = 0; s < slots_count; ++s) slots.set(s, s);
  HostTensor out({slots_count, c.num_layers, c.top_k}, i64());
  HostTensor w({slots_count, c.num_layers, c.top_k}, f32());
  const moecap_status s = moecap_read(h, slots.get(), out.get(), weights ? w.get() : nullptr, 0, nullptr);
  REQUIRE_MESSAGE(s == MOECAP_OK, std::string(moecap_last_error()));
  if (wout != nullptr) wout->assign(w.as<float>(), w.as<float>() + w.numel());
  return std::vector<int64_t>(out.as<int64_t>(), out.as<int64_t>() + out.numel());
}

}  // namespace

TEST_CASE("capture, commit (range, row list, host and device slots) and read match the host backend") {
  for (int32_t stored : {MOECAP_IDS_U8, MOECAP_IDS_U16, MOECAP_IDS_I32}) {
    for (int32_t wdt : {MOECAP_WEIGHTS_NONE, MOECAP_WEIGHTS_F32, MOECAP_WEIGHTS_BF16, MOECAP_WEIGHTS_F16}) {
      for (DLDataType in : {i32(), i64()}) {
        CAPTURE(stored);
        CAPTURE(wdt);
        CAPTURE(int(in.bits));
        moecap_config c = small_config();
        c.num_layers = 5;
        c.top_k = 6;
        c.extra_columns = 1;
        c.num_experts = 200;
        c.dp_size = 2;
        c.max_running_requests = 64;
        c.chunked_prefill_size = 128;
        c.host_slots = 512;
        c.id_dtype = stored;
        c.weight_dtype = wdt;
        c.flags = MOECAP_FLAG_HISTOGRAM;
        Pair p(c);
        const int64_t n = 200;
        HostTensor ids({n, c.top_k + c.extra_columns}, in);
        HostTensor w({n, c.top_k + c.extra_columns}, f32());
        DeviceTensor dids(ids);
        DeviceTensor dw(w);
        for (int32_t l = 0; l < c.num_layers; ++l) {
          for (int64_t i = 0; i < ids.numel(); ++i) {
            ids.set(i, (i % 97 == 0) ? -1 : route(i / 7, l, i % 7, c.num_experts));
            w.as<float>()[i] = static_cast<float>(i % 13) / 13.0f;
          }
          dids.upload();
          dw.upload();
          const DLTensor* hw = wdt == MOECAP_WEIGHTS_NONE ? nullptr : w.get();
          const DLTensor* dwp = wdt == MOECAP_WEIGHTS_NONE ? nullptr : dw.get();
          REQUIRE(moecap_capture(p.host, l, ids.get(), hw, nullptr) == MOECAP_OK);
          REQUIRE_MESSAGE(moecap_capture(p.cuda, l, dids.get(), dwp, p.stream) == MOECAP_OK, std::string(moecap_last_error()));
          CUDA_OK(cudaStreamSynchronize(p.stream));  // the next layer's upload reuses the buffer
        }
        // Range commit with device slots, including drops.
        HostTensor slots({n}, i64());
        for (int64_t i = 0; i < n; ++i) slots.set(i, i % 5 == 0 ? -1 : (i * 7) % 300);
        DeviceTensor dslots(slots);
        moecap_commit_args a{sizeof a, 0, nullptr, slots.get()};
        moecap_commit_args da{sizeof da, 0, nullptr, dslots.get()};
        REQUIRE(moecap_commit(p.host, &a, nullptr) == MOECAP_OK);
        REQUIRE_MESSAGE(moecap_commit(p.cuda, &da, p.stream) == MOECAP_OK, std::string(moecap_last_error()));
        // Row-list commit with host (pageable) slots and rows: the staging path.
        HostTensor rows({50}, i32());
        HostTensor slots2({50}, i32());
        for (int64_t i = 0; i < 50; ++i) {
          rows.set(i, (i * 37) % n);  // rows that were captured
          slots2.set(i, 300 + i);
        }
        moecap_commit_args b{sizeof b, 0, rows.get(), slots2.get()};
        REQUIRE(moecap_commit(p.host, &b, nullptr) == MOECAP_OK);
        REQUIRE_MESSAGE(moecap_commit(p.cuda, &b, p.stream) == MOECAP_OK, std::string(moecap_last_error()));

        const bool weights = wdt != MOECAP_WEIGHTS_NONE;
        std::vector<float> hw, cw;
        CHECK(read_slots(p.host, c, c.host_slots, weights, &hw) == read_slots(p.cuda, c, c.host_slots, weights, &cw));
        CHECK(hw == cw);

        moecap_error_counts he{}, ce{};
        he.struct_size = ce.struct_size = sizeof he;
        REQUIRE(moecap_get_errors(p.host, &he, 0) == MOECAP_OK);
        REQUIRE(moecap_get_errors(p.cuda, &ce, 0) == MOECAP_OK);
        CHECK(he.invalid_ids == ce.invalid_ids);
        CHECK(ce.skipped_rows == 0);

        DLManagedTensorVersioned* hv = nullptr;
        DLManagedTensorVersioned* cv = nullptr;
        REQUIRE(moecap_export(p.host, MOECAP_BUFFER_HISTOGRAM, 0, &hv) == MOECAP_OK);
        REQUIRE(moecap_export(p.cuda, MOECAP_BUFFER_HISTOGRAM, 0, &cv) == MOECAP_OK);
        CHECK(cv->dl_tensor.device.device_type == kDLCUDA);
        std::vector<int64_t> chist(static_cast<size_t>(c.num_layers * c.num_experts));
        CUDA_OK(cudaMemcpy(chist.data(), cv->dl_tensor.data, chist.size() * 8, cudaMemcpyDeviceToHost));
        CHECK(std::vector<int64_t>(static_cast<int64_t*>(hv->dl_tensor.data),
                                   static_cast<int64_t*>(hv->dl_tensor.data) + chist.size()) == chist);
        hv->deleter(hv);
        cv->deleter(cv);
      }
    }
  }
}

TEST_CASE("moecap-owned CUDA graph: replays see new data, padding drops, native graph embeds") {
  moecap_config c = small_config();
  c.dp_size = 4;
  c.max_running_requests = 16;
  c.max_graph_batch = 16;
  c.verify_tokens = 2;
  c.host_slots = 256;
  Pair p(c);
  const int64_t padded = 32;  // 16 requests * 2 verify tokens
  const int32_t rank = 3;
  HostTensor ids({c.dp_size * padded, c.top_k}, i32());
  HostTensor slots({padded}, i64());
  DeviceTensor dids(ids);
  DeviceTensor dslots(slots);
  moecap_graph* hg = nullptr;
  moecap_graph* cg = nullptr;
  for (moecap_capturer* h : {p.host, p.cuda}) {
    const bool cuda = h == p.cuda;
    void* s = cuda ? static_cast<void*>(p.stream) : nullptr;
    REQUIRE_MESSAGE(moecap_graph_begin(h, s) == MOECAP_OK, std::string(moecap_last_error()));
    for (int32_t l = 0; l < c.num_layers; ++l)
      REQUIRE_MESSAGE(moecap_capture(h, l, cuda ? dids.get() : ids.get(), nullptr, s) == MOECAP_OK,
                      std::string(moecap_last_error()));
    moecap_commit_args a{sizeof a, rank * padded, nullptr, cuda ? dslots.get() : slots.get()};
    REQUIRE_MESSAGE(moecap_commit(h, &a, s) == MOECAP_OK, std::string(moecap_last_error()));
    REQUIRE_MESSAGE(moecap_graph_end(h, cuda ? &cg : &hg) == MOECAP_OK, std::string(moecap_last_error()));
  }
  void* native = nullptr;
  REQUIRE(moecap_graph_native(cg, &native) == MOECAP_OK);
  CHECK(native != nullptr);
  for (int64_t step = 0; step < 5; ++step) {
    const int64_t real = 5 + step * 6;
    for (int64_t i = 0; i < ids.numel(); ++i) ids.set(i, route(step * 977 + i / c.top_k, 0, i % c.top_k, c.num_experts));
    for (int64_t i = 0; i < padded; ++i) slots.set(i, i < real ? (step * 41 + i) % c.host_slots : -1);
    dids.upload();
    dslots.upload();
    REQUIRE(moecap_graph_launch(hg, nullptr) == MOECAP_OK);
    REQUIRE_MESSAGE(moecap_graph_launch(cg, p.stream) == MOECAP_OK, std::string(moecap_last_error()));
    CUDA_OK(cudaStreamSynchronize(p.stream));
  }
  CHECK(read_slots(p.host, c, c.host_slots, false, nullptr) == read_slots(p.cuda, c, c.host_slots, false, nullptr));
  moecap_graph_destroy(hg);
  moecap_graph_destroy(cg);
}

TEST_CASE("inside the engine's own stream capture: legal calls record, illegal ones refuse without breaking it") {
  moecap_config c = small_config();
  Pair p(c);
  HostTensor ids({4, c.top_k}, i32());
  HostTensor slots({4}, i64());
  slots.fill<int64_t>({1, 2, 3, -1});
  ids.fill<int32_t>({1, 2, 3, 4, 5, 6, 7, 0});
  DeviceTensor dids(ids);
  DeviceTensor dslots(slots);
  CUDA_OK(cudaStreamBeginCapture(p.stream, cudaStreamCaptureModeGlobal));
  for (int32_t l = 0; l < c.num_layers; ++l)
    CHECK_MESSAGE(moecap_capture(p.cuda, l, dids.get(), nullptr, p.stream) == MOECAP_OK, std::string(moecap_last_error()));
  moecap_commit_args a{sizeof a, 0, nullptr, dslots.get()};
  CHECK_MESSAGE(moecap_commit(p.cuda, &a, p.stream) == MOECAP_OK, std::string(moecap_last_error()));
  moecap_commit_args host_slots{sizeof a, 0, nullptr, slots.get()};
  CHECK(moecap_commit(p.cuda, &host_slots, p.stream) == MOECAP_ERROR_CAPTURE_ILLEGAL);
  HostTensor q({1}, i32());
  HostTensor out({1, c.num_layers, c.top_k}, i32());
  CHECK(moecap_read(p.cuda, q.get(), out.get(), nullptr, 0, p.stream) == MOECAP_ERROR_CAPTURE_ILLEGAL);
  CHECK(moecap_graph_begin(p.cuda, p.stream) == MOECAP_ERROR_CAPTURE_ILLEGAL);
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(p.stream, &graph));  // the engine's capture survived
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphLaunch(exec, p.stream));
  CUDA_OK(cudaStreamSynchronize(p.stream));
  q.fill<int32_t>({3});
  REQUIRE_MESSAGE(moecap_read(p.cuda, q.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK, std::string(moecap_last_error()));
  CHECK(out.at(0) == 5);
  CHECK(out.at(1) == 6);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_CASE("device slots out of range are skipped, counted, and reported by the next read") {
  moecap_config c = small_config();
  Pair p(c);
  HostTensor slots({2}, i64());
  slots.fill<int64_t>({4, 9999});
  DeviceTensor dslots(slots);
  moecap_commit_args a{sizeof a, 0, nullptr, dslots.get()};
  REQUIRE(moecap_commit(p.cuda, &a, p.stream) == MOECAP_OK);
  HostTensor q({1}, i32());
  HostTensor out({1, c.num_layers, c.top_k}, i32());
  CHECK(moecap_read(p.cuda, q.get(), out.get(), nullptr, 0, nullptr) == MOECAP_ERROR_ROWS_SKIPPED);
  moecap_error_counts e{};
  e.struct_size = sizeof e;
  REQUIRE(moecap_get_errors(p.cuda, &e, MOECAP_ERRORS_CLEAR) == MOECAP_OK);
  CHECK(e.skipped_rows == 1);
  CHECK(moecap_read(p.cuda, q.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
  HostTensor host_ids({1, c.top_k}, i32());
  CHECK(moecap_capture(p.cuda, 0, host_ids.get(), nullptr, p.stream) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(moecap_last_error()).find("topk_ids is on cpu") != std::string::npos);
  CHECK(moecap_graph_begin(p.cuda, nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);  // legacy stream: not capturable
}

TEST_CASE("read into device tensors and write from device tensors match the host paths") {
  moecap_config c = small_config();
  c.num_layers = 4;
  c.top_k = 8;
  c.num_experts = 256;  // u8 ids, every value a valid id
  c.weight_dtype = MOECAP_WEIGHTS_BF16;
  c.max_running_requests = 16;
  c.chunked_prefill_size = 16;  // device_rows 16: a 40-slot read goes in pieces
  c.host_slots = 64;
  Pair p(c);
  const int64_t row = c.num_layers * c.top_k;
  HostTensor slots({40}, i64());
  HostTensor ids({40, c.num_layers, c.top_k}, i32());
  HostTensor w({40, c.num_layers, c.top_k}, f32());
  for (int64_t i = 0; i < 40; ++i) slots.set(i, 63 - i);
  for (int64_t i = 0; i < 40 * row; ++i) {
    ids.set(i, i % 97 == 0 ? -1 : route(i, 1, 2, c.num_experts));
    w.as<float>()[i] = static_cast<float>(i % 17) / 16.0f;
  }
  DeviceTensor dids(ids);
  DeviceTensor dw(w);
  REQUIRE(moecap_write(p.host, slots.get(), ids.get(), w.get(), nullptr) == MOECAP_OK);
  REQUIRE_MESSAGE(moecap_write(p.cuda, slots.get(), dids.get(), dw.get(), p.stream) == MOECAP_OK,
                  std::string(moecap_last_error()));
  // u8 would hold -1 as 255, a real id with 256 experts: refused without MOECAP_READ_STRICT.
  for (DLDataType out_type : {i32(), i64(), i16()}) {
    CAPTURE(int(out_type.bits));
    HostTensor want({40, c.num_layers, c.top_k}, out_type);
    HostTensor want_w({40, c.num_layers, c.top_k}, f32());
    REQUIRE(moecap_read(p.host, slots.get(), want.get(), want_w.get(), 0, nullptr) == MOECAP_OK);
    HostTensor got({40, c.num_layers, c.top_k}, out_type);
    HostTensor got_w({40, c.num_layers, c.top_k}, f32());
    DeviceTensor dgot(got);
    DeviceTensor dgot_w(got_w);
    REQUIRE_MESSAGE(moecap_read(p.cuda, slots.get(), dgot.get(), dgot_w.get(), 0, p.stream) == MOECAP_OK,
                    std::string(moecap_last_error()));
    CUDA_OK(cudaStreamSynchronize(p.stream));
    CUDA_OK(cudaMemcpy(got.as<uint8_t>(), dgot.get()->data, got.bytes().size(), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(got_w.as<uint8_t>(), dgot_w.get()->data, got_w.bytes().size(), cudaMemcpyDeviceToHost));
    CHECK(got.bytes() == want.bytes());
    CHECK(got_w.bytes() == want_w.bytes());
  }
}

TEST_CASE("a moecap graph embedded as a child node of the engine's graph") {
  moecap_config c = small_config();
  Pair p(c);
  HostTensor ids({2, c.top_k}, i32());
  HostTensor slots({2}, i64());
  DeviceTensor dids(ids);
  DeviceTensor dslots(slots);
  REQUIRE(moecap_graph_begin(p.cuda, p.stream) == MOECAP_OK);
  for (int32_t l = 0; l < c.num_layers; ++l) REQUIRE(moecap_capture(p.cuda, l, dids.get(), nullptr, p.stream) == MOECAP_OK);
  moecap_commit_args a{sizeof a, 0, nullptr, dslots.get()};
  REQUIRE(moecap_commit(p.cuda, &a, p.stream) == MOECAP_OK);
  moecap_graph* g = nullptr;
  REQUIRE(moecap_graph_end(p.cuda, &g) == MOECAP_OK);
  void* child = nullptr;
  REQUIRE(moecap_graph_native(g, &child) == MOECAP_OK);
  cudaGraph_t engine = nullptr;
  CUDA_OK(cudaGraphCreate(&engine, 0));
  cudaGraphNode_t node = nullptr;
  CUDA_OK(cudaGraphAddChildGraphNode(&node, engine, nullptr, 0, static_cast<cudaGraph_t>(child)));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, engine, 0));
  ids.fill<int32_t>({3, 1, 6, 2});
  slots.fill<int64_t>({9, 12});
  dids.upload();
  dslots.upload();
  CUDA_OK(cudaGraphLaunch(exec, p.stream));
  CUDA_OK(cudaStreamSynchronize(p.stream));
  HostTensor q({2}, i64());
  q.fill<int64_t>({12, 9});
  HostTensor out({2, c.num_layers, c.top_k}, i32());
  REQUIRE(moecap_read(p.cuda, q.get(), out.get(), nullptr, 0, nullptr) == MOECAP_OK);
  CHECK(out.at(0) == 6);
  CHECK(out.at(1) == 2);
  CHECK(out.at(c.num_layers * c.top_k) == 3);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(engine);
  moecap_graph_destroy(g);
}

TEST_CASE("slots fail closed on CUDA: never committed, invalidated (also by a graph replay) read -1, as on the host") {
  moecap_config c = small_config();
  c.weight_dtype = MOECAP_WEIGHTS_F32;
  c.host_slots = 64;
  Pair p(c);
  HostTensor ids({4, c.top_k}, i32());
  HostTensor w({4, c.top_k}, f32());
  ids.fill<int32_t>({1, 2, 3, 4, 5, 6, 7, -1});  // token 3 has an id out of range
  w.fill<float>({0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f});
  DeviceTensor dids(ids);
  DeviceTensor dw(w);
  for (int32_t l = 0; l < c.num_layers; ++l) {
    REQUIRE(moecap_capture(p.host, l, ids.get(), w.get(), nullptr) == MOECAP_OK);
    REQUIRE(moecap_capture(p.cuda, l, dids.get(), dw.get(), p.stream) == MOECAP_OK);
  }
  HostTensor slots({4}, i64());
  slots.fill<int64_t>({10, 11, 12, 13});
  moecap_commit_args a{sizeof a, 0, nullptr, slots.get()};
  REQUIRE(moecap_commit(p.host, &a, nullptr) == MOECAP_OK);
  REQUIRE(moecap_commit(p.cuda, &a, p.stream) == MOECAP_OK);
  // Invalidate slot 11 from host memory (staged), slot 12 from device memory.
  HostTensor freed_host({1}, i64());
  freed_host.fill<int64_t>({11});
  HostTensor freed_dev({2}, i64());
  freed_dev.fill<int64_t>({12, -1});
  DeviceTensor dfreed(freed_dev);
  REQUIRE(moecap_invalidate(p.host, freed_host.get(), nullptr) == MOECAP_OK);
  REQUIRE(moecap_invalidate(p.host, freed_dev.get(), nullptr) == MOECAP_OK);
  REQUIRE_MESSAGE(moecap_invalidate(p.cuda, freed_host.get(), p.stream) == MOECAP_OK, std::string(moecap_last_error()));
  REQUIRE_MESSAGE(moecap_invalidate(p.cuda, dfreed.get(), p.stream) == MOECAP_OK, std::string(moecap_last_error()));
  std::vector<float> hw, cw;
  const std::vector<int64_t> host = read_slots(p.host, c, c.host_slots, true, &hw);
  CHECK(read_slots(p.cuda, c, c.host_slots, true, &cw) == host);
  CHECK(cw == hw);
  const int64_t row = c.num_layers * c.top_k;
  CHECK(host[static_cast<size_t>(10 * row)] == 1);
  CHECK(host[static_cast<size_t>(11 * row)] == -1);       // invalidated through staging
  CHECK(host[static_cast<size_t>(12 * row)] == -1);       // invalidated from device memory
  CHECK(host[static_cast<size_t>(13 * row + 1)] == -1);   // out of range at capture
  CHECK(host[static_cast<size_t>(13 * row)] == 7);
  CHECK(host[static_cast<size_t>(0)] == -1);              // never committed
  CHECK(hw[static_cast<size_t>(11 * row)] == 0.0f);

  // A graph that captures, commits and invalidates, replayed with new slot
  // contents (each replay captures again: a commit consumes the rows it reads).
  HostTensor gslots({4}, i64());
  HostTensor gfreed({1}, i64());
  DeviceTensor dgslots(gslots);
  DeviceTensor dgfreed(gfreed);
  moecap_graph* hg = nullptr;
  moecap_graph* cg = nullptr;
  for (moecap_capturer* h : {p.host, p.cuda}) {
    const bool cuda = h == p.cuda;
    void* s = cuda ? static_cast<void*>(p.stream) : nullptr;
    REQUIRE(moecap_graph_begin(h, s) == MOECAP_OK);
    for (int32_t l = 0; l < c.num_layers; ++l) {
      REQUIRE_MESSAGE(moecap_capture(h, l, cuda ? dids.get() : ids.get(), cuda ? dw.get() : w.get(), s) == MOECAP_OK,
                      std::string(moecap_last_error()));
    }
    moecap_commit_args ga{sizeof ga, 0, nullptr, cuda ? dgslots.get() : gslots.get()};
    REQUIRE_MESSAGE(moecap_commit(h, &ga, s) == MOECAP_OK, std::string(moecap_last_error()));
    REQUIRE_MESSAGE(moecap_invalidate(h, cuda ? dgfreed.get() : gfreed.get(), s) == MOECAP_OK,
                    std::string(moecap_last_error()));
    REQUIRE(moecap_graph_end(h, cuda ? &cg : &hg) == MOECAP_OK);
  }
  for (int64_t step = 0; step < 3; ++step) {
    gslots.fill<int64_t>({20 + step, 30 + step, -1, 40 + step});
    gfreed.fill<int64_t>({step == 0 ? -1 : 29 + step});  // frees the previous replay's second slot
    dgslots.upload();
    dgfreed.upload();
    REQUIRE(moecap_graph_launch(hg, nullptr) == MOECAP_OK);
    REQUIRE(moecap_graph_launch(cg, p.stream) == MOECAP_OK);
    CUDA_OK(cudaStreamSynchronize(p.stream));
  }
  const std::vector<int64_t> after = read_slots(p.host, c, c.host_slots, false, nullptr);
  CHECK(read_slots(p.cuda, c, c.host_slots, false, nullptr) == after);
  CHECK(after[static_cast<size_t>(30 * row)] == -1);  // invalidated by the second replay
  CHECK(after[static_cast<size_t>(31 * row)] == -1);  // by the third
  CHECK(after[static_cast<size_t>(32 * row)] == 3);   // committed by the third (row 1)
  CHECK(after[static_cast<size_t>(22 * row)] == 1);
  CHECK(after[static_cast<size_t>(20 * row)] == 1);   // every replay's rows, not only the first's
  CHECK(after[static_cast<size_t>(42 * row)] == 7);   // row 3, its id in range
  moecap_graph_destroy(hg);
  moecap_graph_destroy(cg);

  HostTensor q({2}, i64());
  q.fill<int64_t>({10, 11});
  HostTensor out({2, c.num_layers, c.top_k}, i32());
  CHECK(moecap_read(p.cuda, q.get(), out.get(), nullptr, MOECAP_READ_STRICT, nullptr) == MOECAP_ERROR_NO_ROUTING);
}

TEST_CASE("a kernel writing the exported CUDA layer views: commit narrows on the GPU as on the host") {
  moecap_config c = small_config();
  c.num_experts = 256;
  c.host_slots = 64;
  Pair p(c);
  moecap_plan_info info{};
  info.struct_size = sizeof info;
  REQUIRE(moecap_get_plan(p.cuda, &info) == MOECAP_OK);
  REQUIRE(info.device_id_dtype == MOECAP_IDS_I16);
  const int64_t n = 6;
  std::vector<int16_t> layer(static_cast<size_t>(n * c.top_k));
  for (int32_t l = 0; l < c.num_layers; ++l) {
    for (int64_t i = 0; i < n * c.top_k; ++i) {
      layer[static_cast<size_t>(i)] = static_cast<int16_t>(i == 5 && l == 1 ? 999 : route(i / c.top_k, l, i % c.top_k, 256));
    }
    for (moecap_capturer* h : {p.host, p.cuda}) {
      DLManagedTensorVersioned* v = nullptr;
      REQUIRE(moecap_export(h, MOECAP_BUFFER_LAYER_IDS, l, &v) == MOECAP_OK);
      REQUIRE(v->dl_tensor.strides[0] == c.top_k);
      CUDA_OK(cudaMemcpy(v->dl_tensor.data, layer.data(), layer.size() * 2,
                         h == p.cuda ? cudaMemcpyHostToDevice : cudaMemcpyHostToHost));
      v->deleter(v);
    }
  }
  HostTensor rows({n}, i64());
  rows.fill<int64_t>({5, 0, 4, 1, 3, 2});
  HostTensor slots({n}, i64());
  slots.fill<int64_t>({7, 8, 9, 10, 11, 7});  // slot 7 twice: the last row wins (host twin; see the kernel)
  DeviceTensor drows(rows);
  DeviceTensor dslots(slots);
  moecap_commit_args a{sizeof a, 0, rows.get(), slots.get()};
  moecap_commit_args da{sizeof da, 0, drows.get(), dslots.get()};
  REQUIRE(moecap_commit(p.host, &a, nullptr) == MOECAP_OK);
  REQUIRE_MESSAGE(moecap_commit(p.cuda, &da, p.stream) == MOECAP_OK, std::string(moecap_last_error()));
  HostTensor q({4}, i64());
  q.fill<int64_t>({8, 9, 10, 11});  // the slots listed once
  HostTensor want({4, c.num_layers, c.top_k}, i32());
  HostTensor got({4, c.num_layers, c.top_k}, i32());
  REQUIRE(moecap_read(p.host, q.get(), want.get(), nullptr, 0, nullptr) == MOECAP_OK);
  REQUIRE(moecap_read(p.cuda, q.get(), got.get(), nullptr, 0, nullptr) == MOECAP_OK);
  CHECK(got.bytes() == want.bytes());
  // The 999 sits in row 2 of layer 1 (element 5, top_k 2): slot 7's last entry, on the host twin.
  DLManagedTensorVersioned* hs = nullptr;
  DLManagedTensorVersioned* cs = nullptr;
  REQUIRE(moecap_export(p.host, MOECAP_BUFFER_HOST_STATES, 0, &hs) == MOECAP_OK);
  REQUIRE(moecap_export(p.cuda, MOECAP_BUFFER_HOST_STATES, 0, &cs) == MOECAP_OK);
  REQUIRE(moecap_synchronize(p.cuda) == MOECAP_OK);
  for (int64_t s = 8; s <= 11; ++s) {
    CHECK(static_cast<uint8_t*>(cs->dl_tensor.data)[s] == static_cast<uint8_t*>(hs->dl_tensor.data)[s]);
  }
  CHECK(static_cast<uint8_t*>(hs->dl_tensor.data)[7] == (MOECAP_SLOT_VALID | MOECAP_SLOT_INVALID_IDS));
  hs->deleter(hs);
  cs->deleter(cs);
}

#include "tests/gpu/gpu_main.h"
