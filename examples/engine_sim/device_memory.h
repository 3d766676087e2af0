/* SPDX-License-Identifier: Apache-2.0 */
// Where the simulated engine keeps its own tensors (the router's top-k
// output, slot and row lists): plain host memory for the host backend, or
// device memory through the CUDA driver (loaded at run time, like moecap)
// when the capturer runs on a GPU.
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecap.h"

namespace sim {

class DeviceMemory {
 public:
  explicit DeviceMemory(bool cuda) : cuda_(cuda) {
    if (!cuda_) return;
    // The driver moecap uses: MOECAP_LIBCUDA when set (the tests' stand-in driver).
    const char* path = std::getenv("MOECAP_LIBCUDA");
    void* lib = dlopen(path != nullptr && *path != '\0' ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) throw std::runtime_error("engine_sim: --backend cuda needs libcuda.so.1");
    load(lib, init_, "cuInit");
    load(lib, device_get_, "cuDeviceGet");
    load(lib, retain_, "cuDevicePrimaryCtxRetain");
    load(lib, set_current_, "cuCtxSetCurrent");
    load(lib, alloc_, "cuMemAlloc_v2");
    load(lib, free_, "cuMemFree_v2");
    load(lib, htod_, "cuMemcpyHtoDAsync_v2");
    load(lib, stream_create_, "cuStreamCreate");
    load(lib, stream_sync_, "cuStreamSynchronize");
    int dev = 0;
    void* ctx = nullptr;
    check(init_(0), "cuInit");
    check(device_get_(&dev, 0), "cuDeviceGet");
    check(retain_(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(set_current_(ctx), "cuCtxSetCurrent");
    check(stream_create_(&stream_, 1), "cuStreamCreate");
  }
  ~DeviceMemory() {
    for (void* p : owned_) cuda_ ? static_cast<void>(free_(reinterpret_cast<uintptr_t>(p))) : std::free(p);
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  bool cuda() const { return cuda_; }
  void* stream() const { return stream_; }
  DLDevice device() const { return cuda_ ? DLDevice{kDLCUDA, 0} : DLDevice{kDLCPU, 0}; }

  void* allocate(size_t bytes) {
    void* p = nullptr;
    if (cuda_) {
      uintptr_t d = 0;
      check(alloc_(&d, bytes == 0 ? 1 : bytes), "cuMemAlloc");
      p = reinterpret_cast<void*>(d);
    } else {
      p = std::calloc(1, bytes == 0 ? 1 : bytes);
    }
    owned_.push_back(p);
    return p;
  }

  // Copies host bytes into memory from allocate(), ordered on stream().
  void upload(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return;
    if (cuda_) {
      check(htod_(reinterpret_cast<uintptr_t>(dst), src, bytes, stream_), "cuMemcpyHtoDAsync");
    } else {
      std::memcpy(dst, src, bytes);
    }
  }

  void synchronize() {
    if (cuda_) check(stream_sync_(stream_), "cuStreamSynchronize");
  }

 private:
  template <class Fn>
  static void load(void* lib, Fn*& fn, const char* name) {
    fn = reinterpret_cast<Fn*>(dlsym(lib, name));
    if (fn == nullptr) throw std::runtime_error(std::string("engine_sim: libcuda lacks ") + name);
  }
  static void check(int r, const char* what) {
    if (r != 0) throw std::runtime_error(std::string("engine_sim: ") + what + " failed with CUresult " + std::to_string(r));
  }

  bool cuda_;
  void* stream_ = nullptr;
  std::vector<void*> owned_;
  int (*init_)(unsigned) = nullptr;
  int (*device_get_)(int*, int) = nullptr;
  int (*retain_)(void**, int) = nullptr;
  int (*set_current_)(void*) = nullptr;
  int (*alloc_)(uintptr_t*, size_t) = nullptr;
  int (*free_)(uintptr_t) = nullptr;
  int (*htod_)(uintptr_t, const void*, size_t, void*) = nullptr;
  int (*stream_create_)(void**, unsigned) = nullptr;
  int (*stream_sync_)(void*) = nullptr;
};

}  // namespace sim
