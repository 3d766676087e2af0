#include "base/cuda_driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "base/status.h"

namespace moecap::cuda {
namespace {

using GetProcV1 = CUresult (*)(const char*, void**, int, uint64_t);
using GetProcV2 = CUresult (*)(const char*, void**, int, uint64_t, int*);

class Resolver {
 public:
  explicit Resolver(void* lib) {
    v2_ = reinterpret_cast<GetProcV2>(dlsym(lib, "cuGetProcAddress_v2"));
    v1_ = reinterpret_cast<GetProcV1>(dlsym(lib, "cuGetProcAddress"));
  }
  bool usable() const { return v1_ != nullptr || v2_ != nullptr; }

  template <class Fn>
  void get(Fn*& out, const char* name) {
    void* p = nullptr;
    CUresult r = v2_ ? v2_(name, &p, kMinDriverVersion, 0, nullptr) : v1_(name, &p, kMinDriverVersion, 0);
    if (r != kSuccess || p == nullptr) {
      fail(MOECAP_ERROR_DRIVER_TOO_OLD, "the CUDA driver has no ", name, " for CUDA ", kMinDriverVersion / 1000, ".",
           (kMinDriverVersion % 1000) / 10, " (cuGetProcAddress returned ", r, ")");
    }
    out = reinterpret_cast<Fn*>(p);
  }

 private:
  GetProcV1 v1_ = nullptr;
  GetProcV2 v2_ = nullptr;
};

Driver load() {
  const char* override_path = std::getenv("MOECAP_LIBCUDA");
  const char* path = override_path != nullptr && *override_path != '\0' ? override_path : "libcuda.so.1";
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    fail(MOECAP_ERROR_NO_DEVICE, "no CUDA driver: cannot load ", path, " (", why ? why : "unknown", ")");
  }
  // From here on the library stays loaded: unloading a driver is never safe.
  Driver d{};
  d.cuInit = reinterpret_cast<CUresult (*)(unsigned)>(dlsym(lib, "cuInit"));
  d.cuDriverGetVersion = reinterpret_cast<CUresult (*)(int*)>(dlsym(lib, "cuDriverGetVersion"));
  if (d.cuInit == nullptr || d.cuDriverGetVersion == nullptr) {
    fail(MOECAP_ERROR_DRIVER_TOO_OLD, path, " lacks cuInit or cuDriverGetVersion: not a usable CUDA driver");
  }
  const CUresult init = d.cuInit(0);
  if (init == kErrorStubLibrary) {
    fail(MOECAP_ERROR_STUB_DRIVER, path, " is the CUDA toolkit's stub library, not a driver ",
         "(CUDA_ERROR_STUB_LIBRARY): the stubs folder is on the library path of a machine without a GPU driver");
  }
  if (init == kErrorNoDevice) fail(MOECAP_ERROR_NO_DEVICE, "the CUDA driver found no GPU (CUDA_ERROR_NO_DEVICE)");
  if (init != kSuccess) fail(MOECAP_ERROR_DRIVER, "cuInit failed with CUresult ", init);
  if (d.cuDriverGetVersion(&d.version) != kSuccess || d.version < kMinDriverVersion) {
    fail(MOECAP_ERROR_DRIVER_TOO_OLD, "the CUDA driver supports CUDA ", d.version / 1000, ".",
         (d.version % 1000) / 10, "; moecap needs ", kMinDriverVersion / 1000, ".", (kMinDriverVersion % 1000) / 10);
  }
  Resolver r(lib);
  if (!r.usable()) {
    fail(MOECAP_ERROR_DRIVER_TOO_OLD, path, " has no cuGetProcAddress (needs CUDA 11.3 or newer)");
  }
  r.get(d.cuGetErrorName, "cuGetErrorName");
  r.get(d.cuGetErrorString, "cuGetErrorString");
  r.get(d.cuDeviceGetCount, "cuDeviceGetCount");
  r.get(d.cuDeviceGet, "cuDeviceGet");
  r.get(d.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  r.get(d.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease");
  r.get(d.cuCtxPushCurrent, "cuCtxPushCurrent");
  r.get(d.cuCtxPopCurrent, "cuCtxPopCurrent");
  r.get(d.cuMemAlloc, "cuMemAlloc");
  r.get(d.cuMemFree, "cuMemFree");
  r.get(d.cuMemHostAlloc, "cuMemHostAlloc");
  r.get(d.cuMemFreeHost, "cuMemFreeHost");
  r.get(d.cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer");
  r.get(d.cuMemsetD8Async, "cuMemsetD8Async");
  r.get(d.cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync");
  r.get(d.cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync");
  r.get(d.cuModuleLoadData, "cuModuleLoadData");
  r.get(d.cuModuleUnload, "cuModuleUnload");
  r.get(d.cuModuleGetFunction, "cuModuleGetFunction");
  r.get(d.cuLaunchKernel, "cuLaunchKernel");
  r.get(d.cuStreamCreate, "cuStreamCreate");
  r.get(d.cuStreamDestroy, "cuStreamDestroy");
  r.get(d.cuStreamSynchronize, "cuStreamSynchronize");
  r.get(d.cuStreamWaitEvent, "cuStreamWaitEvent");
  r.get(d.cuStreamIsCapturing, "cuStreamIsCapturing");
  r.get(d.cuStreamBeginCapture, "cuStreamBeginCapture");
  r.get(d.cuStreamEndCapture, "cuStreamEndCapture");
  r.get(d.cuEventCreate, "cuEventCreate");
  r.get(d.cuEventDestroy, "cuEventDestroy");
  r.get(d.cuEventRecord, "cuEventRecord");
  r.get(d.cuEventRecordWithFlags, "cuEventRecordWithFlags");
  r.get(d.cuEventQuery, "cuEventQuery");
  r.get(d.cuEventSynchronize, "cuEventSynchronize");
  r.get(d.cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags");
  r.get(d.cuGraphLaunch, "cuGraphLaunch");
  r.get(d.cuGraphExecDestroy, "cuGraphExecDestroy");
  r.get(d.cuGraphDestroy, "cuGraphDestroy");
  return d;
}

}  // namespace

const Driver& driver() {
  static std::mutex mu;
  static Driver loaded{};
  static bool ready = false;
  std::lock_guard<std::mutex> lock(mu);
  if (!ready) {
    loaded = load();
    ready = true;
  }
  return loaded;
}

void check(const Driver& d, CUresult r, const char* what) {
  if (r == kSuccess) return;
  const char* name = nullptr;
  const char* text = nullptr;
  if (d.cuGetErrorName != nullptr) d.cuGetErrorName(r, &name);
  if (d.cuGetErrorString != nullptr) d.cuGetErrorString(r, &text);
  const moecap_status code = r == kErrorOutOfMemory                                ? MOECAP_ERROR_OUT_OF_MEMORY
                             : (r >= kErrorCaptureFirst && r <= kErrorCaptureLast) ? MOECAP_ERROR_CAPTURE_ILLEGAL
                                                                                   : MOECAP_ERROR_DRIVER;
  fail(code, what, " failed: ",
       name ? name : "CUresult", " (", r, ")", text ? ": " : "", text ? text : "");
}

}  // namespace moecap::cuda
