/* SPDX-License-Identifier: Apache-2.0 */
// What the CUDA backend scenarios (scenarios.cpp) need of an engine, written
// once over either driver: the stand-in (engine_standin.cpp, label
// `standin`, every CI run) or the real one through cudart
// (tests/gpu/engine_cudart.cpp, label `gpu`). Streams, engine memory, a
// "long forward" that holds a stream, stream captures and graphs.
//
// The two drivers schedule differently and the scenarios are written for
// both: on the stand-in nothing runs on a stream until the host waits, so a
// hold changes nothing; on a GPU a held stream stalls until released, so a
// call that blocks on it runs with a release_after() thread.
#pragma once

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#include "moecap.h"
#include "tests/support/scenarios.h"
#include "tests/support/tensors.h"

// The driver's handle types, global as cuda.h and cudart declare them.
struct CUstream_st;
struct CUgraph_st;
struct CUgraphExec_st;

namespace engine {

using Stream = CUstream_st*;  // CUstream and cudaStream_t alike
using Graph = CUgraph_st*;
using Exec = CUgraphExec_st*;

enum CaptureMode { kGlobal = 0, kThreadLocal = 1, kRelaxed = 2 };

// Points moecap at the driver (the stand-in: MOECAP_LIBCUDA), before any capturer exists.
void setup();

Stream new_stream();
// Zeroed memory on the capturer's GPU (kDLCUDA) or pinned host memory
// (kDLCUDAHost, or kDLCPU as PyTorch's pin_memory reports it).
void* allocate(size_t bytes, DLDeviceType where);
void release(void* p, DLDeviceType where);
// Host <-> engine memory, synchronous.
void upload(void* dst, const void* src, size_t bytes);
void download(void* dst, const void* src, size_t bytes);
// The host waits until `s` ran everything enqueued on it.
void sync(Stream s);
// Whether `s` has work enqueued that has not run yet.
bool busy(Stream s);

// A long forward: work on `s` after this stalls until release() (on the stand-in: until a host wait).
struct HoldState;
HoldState* hold(Stream s);
void release(HoldState* h);

// The engine's own stream capture and graphs; 0 is success.
int begin_capture(Stream s, CaptureMode mode);
int end_capture(Stream s, Graph* out);
bool capturing(Stream s);
Exec instantiate(Graph g);
void launch(Exec e, Stream s);
void destroy(Exec e);
void destroy(Graph g);
Graph new_graph();
void add_child(Graph parent, Graph child);

// Violations the driver saw (kernels touching freed memory, driver calls from
// user-object destructors); the GPU relies on compute-sanitizer instead: 0.
int64_t violations();
const char* first_violation();
// Waits for user-object destructors the driver started (the GPU: a short sleep).
void drain_callbacks();

// A stream stalled until release(), or until release_after's thread opens it.
class Hold {
 public:
  explicit Hold(Stream s) : state_(hold(s)) {}
  ~Hold() { open(); }
  Hold(const Hold&) = delete;
  Hold& operator=(const Hold&) = delete;
  void open() {  // once, from whichever thread comes first: release() drops the caller's share of the state
    if (HoldState* s = state_.exchange(nullptr)) release(s);
  }
  // For a call that blocks until the stream moves: opens it from another thread.
  std::thread open_after(int ms) {
    return std::thread([this, ms] {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      open();
    });
  }

 private:
  std::atomic<HoldState*> state_;
};

// Engine memory as a tensor: device or pinned host.
class Tensor {
 public:
  Tensor(std::vector<int64_t> shape, DLDataType dtype, DLDeviceType where) : shape_(std::move(shape)), where_(where) {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    bytes_ = static_cast<size_t>(n) * (dtype.bits / 8);
    data_ = allocate(bytes_, where);
    t_.data = data_;
    t_.device = DLDevice{where, 0};
    t_.ndim = static_cast<int32_t>(shape_.size());
    t_.dtype = dtype;
    t_.shape = shape_.data();
  }
  Tensor(Tensor&& o) noexcept
      : shape_(std::move(o.shape_)), where_(o.where_), bytes_(o.bytes_), data_(std::exchange(o.data_, nullptr)),
        t_(o.t_) {
    t_.shape = shape_.data();
  }
  Tensor& operator=(Tensor&&) = delete;
  Tensor(const Tensor&) = delete;
  ~Tensor() {
    if (data_ != nullptr) release(data_, where_);
  }
  DLTensor* get() { return &t_; }
  template <class T>
  T* host() { return static_cast<T*>(data_); }  // pinned memory only
  template <class T>
  void upload(const std::vector<T>& v) { engine::upload(data_, v.data(), v.size() * sizeof(T)); }
  template <class T>
  std::vector<T> download() {
    std::vector<T> v(bytes_ / sizeof(T));
    engine::download(v.data(), data_, bytes_);
    return v;
  }

 private:
  std::vector<int64_t> shape_;
  DLDeviceType where_;
  size_t bytes_ = 0;
  void* data_ = nullptr;
  DLTensor t_{};
};

// The engine's routing buffer (moecap_scenarios::forward_values) on the device.
inline Tensor routing_buffer() {
  const moecap_config c = moecap_scenarios::cuda_config();
  return Tensor({c.num_layers, moecap_scenarios::kRows, c.top_k}, moecap_test::i32(), kDLCUDA);
}

// The forward of batch `batch` over n tokens writes the routing buffer (every id `value` instead, when given).
inline void forward(Tensor& ids, int64_t batch, int64_t n, int32_t value = -1) {
  ids.upload(moecap_scenarios::forward_values(batch, n, value));
}

// A 1-D int64 index tensor in engine memory.
inline Tensor index_tensor(const std::vector<int64_t>& values, DLDeviceType where) {
  Tensor t({static_cast<int64_t>(values.size())}, moecap_test::i64(), where);
  t.upload(values);
  return t;
}

}  // namespace engine
