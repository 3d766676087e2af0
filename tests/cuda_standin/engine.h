/* SPDX-License-Identifier: Apache-2.0 */
// What the scenario tests need of an engine on the stand-in driver: its own
// streams, device and pinned buffers, stream captures and graphs, reached
// through the driver as an engine reaches cudart.
#pragma once

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "moecap.h"
#include "tests/cuda_standin/standin.h"
#include "tests/support/scenarios.h"
#include "tests/support/tensors.h"

struct CUgraph_st;
struct CUgraphExec_st;

namespace standin {

using CUresult = int;
using Stream = StandinStream;
using Graph = ::CUgraph_st*;
using Exec = ::CUgraphExec_st*;

constexpr int kModeGlobal = 0, kModeThreadLocal = 1, kModeRelaxed = 2;

template <class Fn>
Fn entry(const char* name) {
  void* f = standin_entry(name);
  REQUIRE_MESSAGE(f != nullptr, name);
  return reinterpret_cast<Fn>(f);
}

// The engine's side of the driver.
struct Driver {
  CUresult (*stream_create)(Stream*, unsigned) = entry<decltype(stream_create)>("cuStreamCreate");
  CUresult (*stream_sync)(Stream) = entry<decltype(stream_sync)>("cuStreamSynchronize");
  CUresult (*begin_capture)(Stream, int) = entry<decltype(begin_capture)>("cuStreamBeginCapture");
  CUresult (*end_capture)(Stream, Graph*) = entry<decltype(end_capture)>("cuStreamEndCapture");
  CUresult (*is_capturing)(Stream, int*) = entry<decltype(is_capturing)>("cuStreamIsCapturing");
  CUresult (*instantiate)(Exec*, Graph, unsigned long long) =
      entry<decltype(instantiate)>("cuGraphInstantiateWithFlags");
  CUresult (*launch)(Exec, Stream) = entry<decltype(launch)>("cuGraphLaunch");
  CUresult (*exec_destroy)(Exec) = entry<decltype(exec_destroy)>("cuGraphExecDestroy");
  CUresult (*graph_create)(Graph*, unsigned) = entry<decltype(graph_create)>("cuGraphCreate");
  CUresult (*graph_destroy)(Graph) = entry<decltype(graph_destroy)>("cuGraphDestroy");
  CUresult (*add_child)(void**, Graph, const void* const*, size_t, Graph) =
      entry<decltype(add_child)>("cuGraphAddChildGraphNode");
  CUresult (*mem_alloc)(unsigned long long*, size_t) = entry<decltype(mem_alloc)>("cuMemAlloc");
  CUresult (*host_alloc)(void**, size_t, unsigned) = entry<decltype(host_alloc)>("cuMemHostAlloc");
};

inline const Driver& driver() {
  static const Driver d;
  return d;
}

inline Stream new_stream() {
  Stream s = nullptr;
  REQUIRE(driver().stream_create(&s, 1) == 0);
  return s;
}

// A tensor in engine memory the driver gave out: device (kDLCUDA) or pinned
// host memory, which engines pass as kDLCPU (PyTorch's pin_memory) or
// kDLCUDAHost.
class Tensor {
 public:
  Tensor(std::vector<int64_t> shape, DLDataType dtype, DLDeviceType where) : shape_(std::move(shape)) {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    const size_t bytes = static_cast<size_t>(n) * (dtype.bits / 8);
    if (where == kDLCUDA) {
      unsigned long long p = 0;
      REQUIRE(driver().mem_alloc(&p, bytes) == 0);
      data_ = reinterpret_cast<void*>(p);
    } else {
      REQUIRE(driver().host_alloc(&data_, bytes, 0x3) == 0);
    }
    std::memset(data_, 0, bytes);
    t_.data = data_;
    t_.device = DLDevice{where, 0};
    t_.ndim = static_cast<int32_t>(shape_.size());
    t_.dtype = dtype;
    t_.shape = shape_.data();
  }
  DLTensor* get() { return &t_; }
  // The stand-in's device memory is host memory: tests look directly.
  template <class T>
  T* as() { return static_cast<T*>(data_); }

 private:
  std::vector<int64_t> shape_;
  void* data_ = nullptr;
  DLTensor t_{};
};

// The engine's routing buffer (moecap_scenarios::forward_values) on the device.
inline Tensor routing_buffer() {
  const moecap_config c = moecap_scenarios::cuda_config();
  return Tensor({c.num_layers, moecap_scenarios::kRows, c.top_k}, moecap_test::i32(), kDLCUDA);
}

// The forward of batch `batch` over n tokens writes the routing buffer.
inline void forward(Tensor& ids, int64_t batch, int64_t n) {
  const std::vector<int32_t> v = moecap_scenarios::forward_values(batch, n);
  std::memcpy(ids.as<int32_t>(), v.data(), v.size() * sizeof(int32_t));
}

// A 1-D int64 index tensor in engine memory.
inline Tensor index_tensor(std::vector<int64_t> values, DLDeviceType where) {
  Tensor t({static_cast<int64_t>(values.size())}, moecap_test::i64(), where);
  for (size_t i = 0; i < values.size(); ++i) t.as<int64_t>()[i] = values[i];
  return t;
}

// While a host call blocks in the driver, another engine thread makes a
// capture call on the same capturer: it must finish while the call waits.
struct CallMeanwhile {
  moecap_capturer* h = nullptr;
  DLTensor* ids = nullptr;
  Stream stream = nullptr;
  std::thread other;
  std::atomic<bool> done{false};
  bool started = false;
  bool in_time = false;
  // The hook is global: a host wait on another thread (an earlier test's
  // capturer released late by moecap's thread) is not the call under test.
  std::thread::id caller = std::this_thread::get_id();
};

inline void capture_while_waiting(void* arg) {
  auto* m = static_cast<CallMeanwhile*>(arg);
  if (std::this_thread::get_id() != m->caller || m->started) return;
  m->started = true;
  m->other = std::thread([m] {
    int64_t shape[2] = {1, moecap_scenarios::cuda_config().top_k};
    DLTensor view = *m->ids;
    view.ndim = 2;
    view.shape = shape;
    moecap_capture(m->h, 0, &view, nullptr, m->stream);  // no doctest assertion off the test's thread
    m->done = true;
  });
  for (int i = 0; i < 200 && !m->done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  m->in_time = m->done;
}

// Runs `blocking` (a call that waits on the host at its first driver wait)
// with another thread's capture call started at that wait; true when the
// other call did not wait for it.
inline bool other_calls_proceed(moecap_capturer* h, Tensor& ids, const std::function<void()>& blocking) {
  CallMeanwhile m;
  m.h = h;
  m.ids = ids.get();
  m.stream = new_stream();
  standin_set_wait_hook(capture_while_waiting, &m);
  blocking();
  standin_set_wait_hook(nullptr, nullptr);
  if (m.other.joinable()) m.other.join();
  CHECK(m.started);  // the call did wait
  return m.in_time;
}

}  // namespace standin
