/* SPDX-License-Identifier: Apache-2.0 */
// Move-only owners of driver objects (RMM-style): each frees its object once,
// in the context it was made in, from its destructor. Frees never throw: they
// run from destructors, also at process exit after the driver began
// unloading; a driver that cannot make the context current anymore keeps the
// object (the process is ending and it goes with it). Every free runs in
// relaxed stream-capture mode: frees and module unloads are unsafe calls, and
// in the thread's default global mode one made while any thread captures a
// graph in global mode (torch.cuda.graph) fails and invalidates that capture.
// That covers destructors run at moecap_destroy, by the thread releasing a
// graph's last hold on the capturer, and moecap_graph_destroy.
#pragma once

#include <utility>

#include "base/cuda_driver.h"

namespace moecap::cuda {

template <class Handle, CUresult (*Driver::*Destroy)(Handle)>
class Unique {
 public:
  Unique() = default;
  // Takes `handle`, an object of the context `ctx`.
  Unique(const Driver& d, CUcontext ctx, Handle handle) noexcept : d_(&d), ctx_(ctx), handle_(handle) {}
  Unique(Unique&& other) noexcept
      : d_(other.d_), ctx_(other.ctx_), handle_(std::exchange(other.handle_, Handle{})) {}
  Unique& operator=(Unique&& other) noexcept {
    if (this != &other) {
      reset();
      d_ = other.d_;
      ctx_ = other.ctx_;
      handle_ = std::exchange(other.handle_, Handle{});
    }
    return *this;
  }
  Unique(const Unique&) = delete;
  Unique& operator=(const Unique&) = delete;
  ~Unique() { reset(); }

  Handle get() const noexcept { return handle_; }
  explicit operator bool() const noexcept { return handle_ != Handle{}; }
  // Gives the object up without freeing it.
  Handle release() noexcept { return std::exchange(handle_, Handle{}); }

  void reset() noexcept {
    if (handle_ == Handle{}) return;
    const RelaxedCaptureScope relaxed(*d_);
    if (d_->cuCtxPushCurrent(ctx_) == kSuccess) {
      (d_->*Destroy)(handle_);
      CUcontext popped = nullptr;
      d_->cuCtxPopCurrent(&popped);
    }
    handle_ = Handle{};
  }

 private:
  const Driver* d_ = nullptr;
  CUcontext ctx_ = nullptr;
  Handle handle_{};
};

using UniqueModule = Unique<CUmodule, &Driver::cuModuleUnload>;
using UniqueStream = Unique<CUstream, &Driver::cuStreamDestroy>;
using UniqueEvent = Unique<CUevent, &Driver::cuEventDestroy>;
using UniqueDeviceMemory = Unique<CUdeviceptr, &Driver::cuMemFree>;
using UniquePinnedMemory = Unique<void*, &Driver::cuMemFreeHost>;
using UniqueGraph = Unique<CUgraph, &Driver::cuGraphDestroy>;
using UniqueGraphExec = Unique<CUgraphExec, &Driver::cuGraphExecDestroy>;

// The device's primary context, retained for the owner's lifetime: declared
// before the objects made in it, so that it is released after them.
class PrimaryContext {
 public:
  PrimaryContext() = default;
  // Throws moecap::Error when the driver refuses.
  PrimaryContext(const Driver& d, CUdevice device) : d_(&d), device_(device) {
    check(d, d.cuDevicePrimaryCtxRetain(&ctx_, device), "cuDevicePrimaryCtxRetain");
  }
  PrimaryContext(PrimaryContext&& other) noexcept
      : d_(other.d_), device_(other.device_), ctx_(std::exchange(other.ctx_, nullptr)) {}
  PrimaryContext& operator=(PrimaryContext&& other) noexcept {
    if (this != &other) {
      reset();
      d_ = other.d_;
      device_ = other.device_;
      ctx_ = std::exchange(other.ctx_, nullptr);
    }
    return *this;
  }
  PrimaryContext(const PrimaryContext&) = delete;
  PrimaryContext& operator=(const PrimaryContext&) = delete;
  ~PrimaryContext() { reset(); }

  CUcontext get() const noexcept { return ctx_; }

 private:
  void reset() noexcept {
    if (ctx_ == nullptr) return;
    const RelaxedCaptureScope relaxed(*d_);
    d_->cuDevicePrimaryCtxRelease(device_);
    ctx_ = nullptr;
  }

  const Driver* d_ = nullptr;
  CUdevice device_ = 0;
  CUcontext ctx_ = nullptr;
};

}  // namespace moecap::cuda
