// What the scenario tests need of an engine on the stand-in driver: its own
// streams, device and pinned buffers, stream captures and graphs, reached
// through the driver as an engine reaches cudart; and a capturer on the CUDA
// backend with tensors on the "device".
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "moecap.h"
#include "tests/cuda_standin/standin.h"
#include "tests/support/tensors.h"

namespace standin {

using CUresult = int;
using Stream = StandinStream;
using Graph = struct CUgraph_st*;
using Exec = struct CUgraphExec_st*;

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

inline moecap_config cuda_config() {
  moecap_config c = moecap_test::small_config();
  c.device_type = MOECAP_DEVICE_CUDA;
  return c;
}

inline moecap_capturer* make_capturer(const moecap_config& c = cuda_config()) {
  moecap_capturer* h = nullptr;
  const moecap_status s = moecap_create(&c, &h);
  REQUIRE_MESSAGE(s == MOECAP_OK, std::string(moecap_last_error()));
  return h;
}

// The row of expert ids (every layer) that token `token` of batch `batch` routes to.
inline int32_t expert(int64_t batch, int64_t token, int64_t layer, int64_t k, int32_t experts) {
  return static_cast<int32_t>(moecap_test::route(batch * 1000 + token, layer, k, experts));
}

// The engine's routing buffer: [num_layers, rows, top_k] int32 on the device,
// one [rows, top_k] block per layer, as a forward leaves them.
inline Tensor routing_buffer(int64_t rows) {
  const moecap_config c = cuda_config();
  return Tensor({c.num_layers, rows, c.top_k}, moecap_test::i32(), kDLCUDA);
}

// The forward of batch `batch`: fills the first n rows of every layer.
inline void forward(Tensor& ids, int64_t rows, int64_t batch, int64_t n) {
  const moecap_config c = cuda_config();
  for (int32_t layer = 0; layer < c.num_layers; ++layer)
    for (int64_t t = 0; t < n; ++t)
      for (int32_t k = 0; k < c.top_k; ++k)
        ids.as<int32_t>()[(layer * rows + t) * c.top_k + k] = expert(batch, t, layer, k, c.num_experts);
}

// moecap_capture of every layer's first n rows on `stream`.
inline void capture_layers(moecap_capturer* h, Tensor& ids, int64_t rows, int64_t n, Stream stream) {
  const moecap_config c = cuda_config();
  for (int32_t layer = 0; layer < c.num_layers; ++layer) {
    int64_t shape[2] = {n, c.top_k};
    DLTensor view = *ids.get();
    view.ndim = 2;
    view.shape = shape;
    view.byte_offset = static_cast<uint64_t>(layer * rows * c.top_k) * sizeof(int32_t);
    REQUIRE_MESSAGE(moecap_capture(h, layer, &view, nullptr, stream) == MOECAP_OK, std::string(moecap_last_error()));
  }
}

// A 1-D int64 index tensor in engine memory.
inline Tensor index_tensor(std::vector<int64_t> values, DLDeviceType where) {
  Tensor t({static_cast<int64_t>(values.size())}, moecap_test::i64(), where);
  for (size_t i = 0; i < values.size(); ++i) t.as<int64_t>()[i] = values[i];
  return t;
}

inline void commit(moecap_capturer* h, DLTensor* slots, int64_t src_start, Stream stream,
                   moecap_status expect = MOECAP_OK) {
  moecap_commit_args a{};
  a.struct_size = sizeof a;
  a.dst_slots = slots;
  a.src_rows = nullptr;
  a.src_start = src_start;
  const moecap_status r = moecap_commit(h, &a, stream);
  REQUIRE_MESSAGE(r == expect, std::string(moecap_last_error()));
}

// Reads `slots` into host memory; returns the ids, [slots, layers, top_k].
inline std::vector<int64_t> read_rows(moecap_capturer* h, std::vector<int64_t> slots, moecap_status expect = MOECAP_OK,
                                      uint32_t flags = 0) {
  const moecap_config c = cuda_config();
  const int64_t n = static_cast<int64_t>(slots.size());
  moecap_test::HostTensor s({n}, moecap_test::i64());
  for (int64_t i = 0; i < n; ++i) s.set(i, slots[static_cast<size_t>(i)]);
  moecap_test::HostTensor out({n, c.num_layers, c.top_k}, moecap_test::i64());
  const moecap_status r = moecap_read(h, s.get(), out.get(), nullptr, flags, nullptr);
  CHECK_MESSAGE(r == expect, std::string(moecap_last_error()));
  std::vector<int64_t> v(static_cast<size_t>(out.numel()));
  for (int64_t i = 0; i < out.numel(); ++i) v[static_cast<size_t>(i)] = out.at(i);
  return v;
}

// What read returns for token `token` of batch `batch`.
inline std::vector<int64_t> expected_row(int64_t batch, int64_t token) {
  const moecap_config c = cuda_config();
  std::vector<int64_t> v;
  for (int32_t layer = 0; layer < c.num_layers; ++layer)
    for (int32_t k = 0; k < c.top_k; ++k) v.push_back(expert(batch, token, layer, k, c.num_experts));
  return v;
}

inline std::vector<int64_t> concat(std::initializer_list<std::vector<int64_t>> rows) {
  std::vector<int64_t> v;
  for (const auto& r : rows) v.insert(v.end(), r.begin(), r.end());
  return v;
}

}  // namespace standin
