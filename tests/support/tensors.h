/* SPDX-License-Identifier: Apache-2.0 */
// Test helpers: owning host tensors that lend a DLTensor, and a config
// with sane defaults. Shared by the unit, ABI and GPU suites.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "moecap.h"

namespace moecap_test {

inline DLDataType i32() { return DLDataType{kDLInt, 32, 1}; }
inline DLDataType i64() { return DLDataType{kDLInt, 64, 1}; }
inline DLDataType u8() { return DLDataType{kDLUInt, 8, 1}; }
inline DLDataType u16() { return DLDataType{kDLUInt, 16, 1}; }
inline DLDataType i16() { return DLDataType{kDLInt, 16, 1}; }
inline DLDataType f32() { return DLDataType{kDLFloat, 32, 1}; }
inline DLDataType bf16() { return DLDataType{kDLBfloat, 16, 1}; }
inline DLDataType f16() { return DLDataType{kDLFloat, 16, 1}; }

// A compact host tensor that owns its bytes.
class HostTensor {
 public:
  HostTensor(std::initializer_list<int64_t> shape, DLDataType dtype) : shape_(shape) {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    bytes_.assign(static_cast<size_t>(n) * (dtype.bits / 8), 0);
    t_.data = bytes_.empty() ? nullptr : bytes_.data();
    t_.device = DLDevice{kDLCPU, 0};
    t_.ndim = static_cast<int>(shape_.size());
    t_.dtype = dtype;
    t_.shape = shape_.data();
    t_.strides = nullptr;
    t_.byte_offset = 0;
  }
  HostTensor(const HostTensor&) = delete;
  HostTensor& operator=(const HostTensor&) = delete;

  DLTensor* get() { return &t_; }
  DLTensor& dl() { return t_; }
  int64_t numel() const { return static_cast<int64_t>(bytes_.size()) / (t_.dtype.bits / 8); }
  template <class T>
  T* as() { return reinterpret_cast<T*>(bytes_.data()); }
  template <class T>
  void fill(std::initializer_list<T> values) {
    size_t i = 0;
    for (T v : values) as<T>()[i++] = v;
  }
  // Integer element i, whatever the dtype.
  int64_t at(int64_t i) const {
    const uint8_t* p = bytes_.data();
    switch (t_.dtype.bits) {
      case 8: return t_.dtype.code == kDLUInt ? int64_t{p[i]} : int64_t{reinterpret_cast<const int8_t*>(p)[i]};
      case 16:
        return t_.dtype.code == kDLUInt ? int64_t{reinterpret_cast<const uint16_t*>(p)[i]}
                                        : int64_t{reinterpret_cast<const int16_t*>(p)[i]};
      case 32: return reinterpret_cast<const int32_t*>(p)[i];
      default: return reinterpret_cast<const int64_t*>(p)[i];
    }
  }
  void set(int64_t i, int64_t v) {
    uint8_t* p = bytes_.data();
    switch (t_.dtype.bits) {
      case 8: p[i] = static_cast<uint8_t>(v); break;
      case 16: reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(v); break;
      case 32: reinterpret_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
      default: reinterpret_cast<int64_t*>(p)[i] = v; break;
    }
  }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  std::vector<int64_t> shape_;
  std::vector<uint8_t> bytes_;
  DLTensor t_{};
};

// Every byte a capturer owns, read through its own DLPack views, plus its
// error counters: equal before and after a call means the call changed nothing.
inline std::vector<uint8_t> snapshot(moecap_capturer* h) {
  std::vector<uint8_t> all;
  for (int32_t which : {MOECAP_BUFFER_DEVICE_IDS, MOECAP_BUFFER_DEVICE_WEIGHTS, MOECAP_BUFFER_HOST_IDS,
                        MOECAP_BUFFER_HOST_WEIGHTS, MOECAP_BUFFER_HISTOGRAM, MOECAP_BUFFER_HOST_STATES}) {
    DLManagedTensorVersioned* v = nullptr;
    if (moecap_export(h, which, 0, &v) != MOECAP_OK) continue;
    int64_t n = v->dl_tensor.dtype.bits / 8;
    for (int i = 0; i < v->dl_tensor.ndim; ++i) n *= v->dl_tensor.shape[i];
    const uint8_t* p = static_cast<const uint8_t*>(v->dl_tensor.data);
    all.insert(all.end(), p, p + n);
    v->deleter(v);
  }
  moecap_error_counts e{};
  e.struct_size = sizeof e;
  if (moecap_get_errors(h, &e, 0) == MOECAP_OK) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(&e);
    all.insert(all.end(), p, p + sizeof e);
  }
  return all;
}

// `init` is moecap_config_init, or the same function from a dlopen'ed library.
inline moecap_config small_config(moecap_status (*init)(moecap_config*) = moecap_config_init) {
  moecap_config c{};
  c.struct_size = sizeof c;
  if (init(&c) != MOECAP_OK) std::abort();
  c.num_layers = 3;
  c.top_k = 2;
  c.num_experts = 8;
  c.max_running_requests = 4;
  c.chunked_prefill_size = 8;
  c.max_graph_batch = 4;
  c.host_slots = 32;
  return c;
}

// Deterministic routing: expert of (token, layer, k), distinct across k.
inline int64_t route(int64_t token, int64_t layer, int64_t k, int64_t experts) {
  uint64_t x = static_cast<uint64_t>(token) * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(layer) * 0xC2B2AE3D27D4EB4Full;
  x ^= x >> 29;
  return static_cast<int64_t>((x + static_cast<uint64_t>(k) * 7919u) % static_cast<uint64_t>(experts));
}

}  // namespace moecap_test
