// The scenarios of tests/cuda_standin on a real GPU: the same engine
// behaviour, with a host-function "gate" standing in for a long forward (the
// stream stalls until the test opens it). Skips (exit 77) without a GPU;
// tests/gpu/device_check.sh runs it under compute-sanitizer memcheck.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "moecap.h"
#include "tests/support/scenarios.h"
#include "tests/support/tensors.h"

using namespace moecap_test;
using namespace moecap_scenarios;

namespace {

#define CUDA_OK(call) REQUIRE_MESSAGE((call) == cudaSuccess, #call)

cudaStream_t new_stream() {
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

// A long forward: the stream stalls in a host function until open().
class Gate {
 public:
  void close(cudaStream_t s) {
    open_ = false;
    CUDA_OK(cudaLaunchHostFunc(s, &Gate::wait, this));
  }
  void open() { open_ = true; }
  // Opens after `ms` from another thread (for calls that block until then).
  std::thread open_after(int ms) {
    return std::thread([this, ms] {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      open();
    });
  }

 private:
  static void wait(void* self) {
    while (!static_cast<Gate*>(self)->open_.load()) std::this_thread::yield();
  }
  std::atomic<bool> open_{true};
};

// Engine memory: device (kDLCUDA) or pinned host (kDLCPU as pin_memory reports it, or kDLCUDAHost).
class Tensor {
 public:
  Tensor(std::vector<int64_t> shape, DLDataType dtype, DLDeviceType where) : shape_(std::move(shape)), where_(where) {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    bytes_ = static_cast<size_t>(n) * (dtype.bits / 8);
    if (where == kDLCUDA) {
      CUDA_OK(cudaMalloc(&data_, bytes_));
      CUDA_OK(cudaMemset(data_, 0, bytes_));
    } else {
      CUDA_OK(cudaHostAlloc(&data_, bytes_, cudaHostAllocPortable | cudaHostAllocMapped));
      std::memset(data_, 0, bytes_);
    }
    t_.data = data_;
    t_.device = DLDevice{where, 0};
    t_.ndim = static_cast<int32_t>(shape_.size());
    t_.dtype = dtype;
    t_.shape = shape_.data();
  }
  ~Tensor() {
    if (where_ == kDLCUDA) {
      cudaFree(data_);
    } else {
      cudaFreeHost(data_);
    }
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  DLTensor* get() { return &t_; }
  template <class T>
  T* host() { return static_cast<T*>(data_); }  // pinned tensors only
  template <class T>
  std::vector<T> download() {
    std::vector<T> v(bytes_ / sizeof(T));
    CUDA_OK(cudaMemcpy(v.data(), data_, bytes_, cudaMemcpyDefault));
    return v;
  }
  template <class T>
  void upload(const std::vector<T>& v) { CUDA_OK(cudaMemcpy(data_, v.data(), v.size() * sizeof(T), cudaMemcpyDefault)); }

 private:
  std::vector<int64_t> shape_;
  DLDeviceType where_;
  size_t bytes_ = 0;
  void* data_ = nullptr;
  DLTensor t_{};
};

// The engine's routing buffer, filled by the "forward" of `batch` (every id `value` instead, when given).
void forward(Tensor& ids, int64_t batch, int64_t n, int32_t value = -1) { ids.upload(forward_values(batch, n, value)); }

Tensor routing_buffer() {
  const moecap_config c = cuda_config();
  return Tensor({c.num_layers, kRows, c.top_k}, i32(), kDLCUDA);
}



}  // namespace

TEST_CASE("pinned slot lists refilled while a commit waits behind a long forward") {
  moecap_capturer* h = make_capturer();
  cudaStream_t s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 1, 2);
  Gate gate;
  gate.close(s);
  for (DLDeviceType where : {kDLCPU, kDLCUDAHost}) {
    capture_layers(h, ids.get(), 2, s);  // each commit consumes the rows it reads
    const int64_t first = where == kDLCPU ? 3 : 5, refill = first + 4;
    Tensor slots({2}, i64(), where);
    slots.host<int64_t>()[0] = first;
    slots.host<int64_t>()[1] = first + 1;
    commit(h, slots.get(), s);
    slots.host<int64_t>()[0] = refill;
    slots.host<int64_t>()[1] = refill + 1;
  }
  gate.open();
  REQUIRE(moecap_synchronize(h) == MOECAP_OK);
  const auto got = read_rows(h, {3, 4, 5, 6, 7, 8, 9, 10, kNever});
  for (size_t i = 0; i < 4; ++i) CHECK(row_of(got, i) == expected_row(1, static_cast<int64_t>(i % 2)));
  for (size_t i = 4; i < 8; ++i) CHECK(row_of(got, i) == row_of(got, 8));
  moecap_destroy(h);
  cudaStreamDestroy(s);
}

TEST_CASE("read, synchronize and get_errors while the engine captures on another thread") {
  moecap_capturer* h = make_capturer();
  cudaStream_t s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 2, 1);
  capture_layers(h, ids.get(), 1, s);
  HostTensor slot({1}, i64());
  slot.set(0, 3);
  commit(h, slot.get(), s);
  cudaStream_t engine = new_stream();
  CUDA_OK(cudaStreamBeginCapture(engine, cudaStreamCaptureModeGlobal));
  std::thread([&] {
    CHECK(read_rows(h, {3}) == expected_row(2, 0));
    CHECK(moecap_synchronize(h) == MOECAP_OK);
    moecap_error_counts e{};
    e.struct_size = sizeof e;
    CHECK(moecap_get_errors(h, &e, 0) == MOECAP_OK);
  }).join();
  cudaGraph_t g = nullptr;
  CHECK(cudaStreamEndCapture(engine, &g) == cudaSuccess);
  if (g != nullptr) cudaGraphDestroy(g);
  moecap_destroy(h);
  cudaStreamDestroy(engine);
  cudaStreamDestroy(s);
}

TEST_CASE("event ring: 20 graphs behind a long forward on one stream, 16 eager commits on another") {
  moecap_capturer* h = make_capturer();
  cudaStream_t a = new_stream(), b = new_stream();
  Tensor ids = routing_buffer();
  std::vector<std::unique_ptr<Tensor>> slots;
  std::vector<moecap_graph*> graphs;
  for (int i = 0; i < 20; ++i) {
    slots.push_back(std::make_unique<Tensor>(std::vector<int64_t>{1}, i64(), kDLCUDA));
    slots.back()->upload(std::vector<int64_t>{i});
    REQUIRE(moecap_graph_begin(h, a) == MOECAP_OK);
    capture_layers(h, ids.get(), 1, a);
    commit(h, slots.back()->get(), a);
    moecap_graph* g = nullptr;
    REQUIRE(moecap_graph_end(h, &g) == MOECAP_OK);
    graphs.push_back(g);
  }
  forward(ids, 3, 1);
  Gate gate;
  gate.close(a);
  for (moecap_graph* g : graphs) REQUIRE(moecap_graph_launch(g, a) == MOECAP_OK);
  HostTensor eager({1}, i64());
  eager.set(0, 25);
  for (int i = 0; i < 16; ++i) commit(h, eager.get(), b);
  std::thread opener = gate.open_after(200);
  std::vector<int64_t> which;
  for (int64_t i = 0; i < 20; ++i) which.push_back(i);
  const auto got = read_rows(h, which);
  opener.join();
  for (size_t i = 0; i < 20; ++i) CHECK(row_of(got, i) == expected_row(3, 0));
  for (moecap_graph* g : graphs) moecap_graph_destroy(g);
  moecap_destroy(h);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
}

TEST_CASE("a read into GPU tensors, then moecap_write to the same slots") {
  moecap_capturer* h = make_capturer();
  cudaStream_t s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 4, 1);
  capture_layers(h, ids.get(), 1, s);
  HostTensor slot({1}, i64());
  slot.set(0, 2);
  commit(h, slot.get(), s);
  REQUIRE(moecap_synchronize(h) == MOECAP_OK);
  const moecap_config c = cuda_config();
  Tensor out({1, c.num_layers, c.top_k}, i64(), kDLCUDA);
  Gate gate;
  gate.close(s);
  REQUIRE(moecap_read(h, slot.get(), out.get(), nullptr, 0, s) == MOECAP_OK);
  HostTensor reuse({1, c.num_layers, c.top_k}, i32());
  for (int64_t i = 0; i < reuse.numel(); ++i) reuse.set(i, 1);
  std::thread opener = gate.open_after(100);  // write may wait for the read
  REQUIRE(moecap_write(h, slot.get(), reuse.get(), nullptr, nullptr) == MOECAP_OK);
  opener.join();
  CUDA_OK(cudaStreamSynchronize(s));
  CHECK(out.download<int64_t>() == expected_row(4, 0));
  moecap_destroy(h);
  cudaStreamDestroy(s);
}

TEST_CASE("moecap_graph_begin on one thread, moecap_graph_end on another") {
  moecap_capturer* h = make_capturer();
  cudaStream_t s = new_stream();
  Tensor ids = routing_buffer();
  Tensor slots({1}, i64(), kDLCUDA);
  slots.upload(std::vector<int64_t>{4});
  std::thread([&] {
    REQUIRE(moecap_graph_begin(h, s) == MOECAP_OK);
    capture_layers(h, ids.get(), 1, s);
    commit(h, slots.get(), s);
  }).join();
  moecap_graph* g = nullptr;
  REQUIRE_MESSAGE(moecap_graph_end(h, &g) == MOECAP_OK, std::string(moecap_last_error()));
  cudaStreamCaptureStatus status{};
  CUDA_OK(cudaStreamIsCapturing(s, &status));
  CHECK(status == cudaStreamCaptureStatusNone);
  forward(ids, 5, 1);
  REQUIRE(moecap_graph_launch(g, s) == MOECAP_OK);
  CHECK(read_rows(h, {4}) == expected_row(5, 0));
  moecap_graph_destroy(g);
  moecap_destroy(h);
  cudaStreamDestroy(s);
}

TEST_CASE("an engine graph and a child-graph clone replay after moecap_destroy") {
  cudaStream_t s = new_stream();
  Tensor ids = routing_buffer();
  Tensor slots({1}, i64(), kDLCUDA);
  slots.upload(std::vector<int64_t>{6});
  moecap_capturer* h = make_capturer();
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  capture_layers(h, ids.get(), 1, s);
  commit(h, slots.get(), s);
  cudaGraph_t engine = nullptr;
  CUDA_OK(cudaStreamEndCapture(s, &engine));
  cudaGraphExec_t engine_exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&engine_exec, engine, 0));
  REQUIRE(moecap_graph_begin(h, s) == MOECAP_OK);
  capture_layers(h, ids.get(), 1, s);
  commit(h, slots.get(), s);
  moecap_graph* own = nullptr;
  REQUIRE(moecap_graph_end(h, &own) == MOECAP_OK);
  void* native = nullptr;
  REQUIRE(moecap_graph_native(own, &native) == MOECAP_OK);
  cudaGraph_t parent = nullptr;
  CUDA_OK(cudaGraphCreate(&parent, 0));
  cudaGraphNode_t node = nullptr;
  CUDA_OK(cudaGraphAddChildGraphNode(&node, parent, nullptr, 0, static_cast<cudaGraph_t>(native)));
  cudaGraphExec_t parent_exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&parent_exec, parent, 0));
  moecap_graph_destroy(own);
  REQUIRE(moecap_destroy(h) == MOECAP_OK);
  forward(ids, 7, 1);
  CUDA_OK(cudaGraphLaunch(engine_exec, s));
  CUDA_OK(cudaGraphLaunch(parent_exec, s));
  CUDA_OK(cudaStreamSynchronize(s));  // memcheck reports any access to freed memory
  cudaGraphExecDestroy(engine_exec);
  cudaGraphDestroy(engine);
  cudaGraphExecDestroy(parent_exec);
  cudaGraphDestroy(parent);
  CUDA_OK(cudaDeviceSynchronize());
  cudaStreamDestroy(s);
}

TEST_CASE("get_errors(CLEAR) while another thread replays: no count lost") {
  moecap_capturer* h = make_capturer();
  cudaStream_t s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 0, kRows, 99);  // every id outside [0, num_experts)
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  capture_layers(h, ids.get(), 1, s);  // 6 invalid ids per replay
  cudaGraph_t g = nullptr;
  CUDA_OK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
  constexpr int kReplays = 2000;
  std::thread replayer([&] {
    for (int i = 0; i < kReplays; ++i) cudaGraphLaunch(exec, s);
    cudaStreamSynchronize(s);
  });
  uint64_t seen = 0;
  for (int i = 0; i < 200; ++i) {
    moecap_error_counts e{};
    e.struct_size = sizeof e;
    REQUIRE(moecap_get_errors(h, &e, MOECAP_ERRORS_CLEAR) == MOECAP_OK);
    seen += e.invalid_ids;
  }
  replayer.join();
  moecap_error_counts e{};
  e.struct_size = sizeof e;
  REQUIRE(moecap_get_errors(h, &e, MOECAP_ERRORS_CLEAR) == MOECAP_OK);
  CHECK(seen + e.invalid_ids == 6u * kReplays);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(g);
  moecap_destroy(h);
  cudaStreamDestroy(s);
}

TEST_CASE("duplicate slots in one commit: the last entry wins") {
  moecap_capturer* h = make_capturer();
  cudaStream_t s = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 9, 3);
  capture_layers(h, ids.get(), 3, s);
  HostTensor host_slots({3}, i64());
  host_slots.fill<int64_t>({5, 6, 5});
  commit(h, host_slots.get(), s);
  capture_layers(h, ids.get(), 3, s);  // commit consumed the rows
  Tensor device_slots({3}, i64(), kDLCUDA);
  device_slots.upload(std::vector<int64_t>{6, 7, 7});
  commit(h, device_slots.get(), s);
  const auto got = read_rows(h, {5, 6, 7});
  CHECK(row_of(got, 0) == expected_row(9, 2));
  CHECK(row_of(got, 1) == expected_row(9, 0));
  CHECK(row_of(got, 2) == expected_row(9, 2));
  moecap_destroy(h);
  cudaStreamDestroy(s);
}

TEST_CASE("a non-blocking read waits only for the commits that wrote its slots") {
  moecap_capturer* h = make_capturer();
  cudaStream_t a = new_stream(), b = new_stream();
  Tensor ids = routing_buffer();
  forward(ids, 10, 1);
  capture_layers(h, ids.get(), 1, a);
  HostTensor done_slot({1}, i64());
  done_slot.set(0, 1);
  commit(h, done_slot.get(), a);
  CUDA_OK(cudaStreamSynchronize(a));
  Gate gate;
  gate.close(b);
  HostTensor busy_slot({1}, i64());
  busy_slot.set(0, 2);
  commit(h, busy_slot.get(), b);
  CHECK(read_rows(h, {1}, MOECAP_OK, MOECAP_READ_NONBLOCKING) == expected_row(10, 0));
  read_rows(h, {2}, MOECAP_ERROR_NOT_READY, MOECAP_READ_NONBLOCKING);
  gate.open();
  moecap_destroy(h);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
}

#include "tests/gpu/gpu_main.h"
