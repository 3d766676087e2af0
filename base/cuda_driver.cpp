// SPDX-License-Identifier: Apache-2.0
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

  // `name` in the ABI of CUDA `version` (the minimum unless an entry point says otherwise).
  template <class Fn>
  void get(Fn*& out, const char* name, int version = kMinDriverVersion) {
    void* p = nullptr;
    CUresult r = v2_ ? v2_(name, &p, version, 0, nullptr) : v1_(name, &p, version, 0);
    if (r != kSuccess || p == nullptr) {
      fail(MOECAP_ERROR_DRIVER_TOO_OLD, "the CUDA driver has no ", name, " for CUDA ", version / 1000, ".",
           (version % 1000) / 10, " (cuGetProcAddress returned ", r, ")");
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
         (d.version % 1000) / 10, "; moecap needs ", kMinDriverVersion / 1000, ".", (kMinDriverVersion % 1000) / 10,
#if defined(MOECAP_KERNELS_CUDA_VERSION)
         " (its kernels were built with CUDA ", MOECAP_KERNELS_CUDA_VERSION / 1000, ".",
         (MOECAP_KERNELS_CUDA_VERSION % 1000) / 10, ")",
#endif
         "");
  }
  Resolver r(lib);
  if (!r.usable()) {
    fail(MOECAP_ERROR_DRIVER_TOO_OLD, path, " has no cuGetProcAddress (needs CUDA 11.3 or newer)");
  }
#define MOECAP_CUDA_RESOLVE_ENTRY_POINT(name, params) r.get(d.name, #name);
  MOECAP_CUDA_ENTRY_POINTS(MOECAP_CUDA_RESOLVE_ENTRY_POINT)
#undef MOECAP_CUDA_RESOLVE_ENTRY_POINT
  r.get(d.cuStreamGetCaptureInfo, "cuStreamGetCaptureInfo", kCaptureInfoVersion);
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

namespace {

[[noreturn]] void fail_with(const Driver& d, CUresult r, moecap_status code, const char* what, const char* hint) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (d.cuGetErrorName != nullptr) d.cuGetErrorName(r, &name);
  if (d.cuGetErrorString != nullptr) d.cuGetErrorString(r, &text);
  fail(code, what, " failed: ", name ? name : "CUresult", " (", r, ")", text ? ": " : "", text ? text : "", hint);
}

}  // namespace

void check(const Driver& d, CUresult r, const char* what) {
  if (r == kSuccess) return;
  const moecap_status code = r == kErrorOutOfMemory                                ? MOECAP_ERROR_OUT_OF_MEMORY
                             : (r >= kErrorCaptureFirst && r <= kErrorCaptureLast) ? MOECAP_ERROR_CAPTURE_ILLEGAL
                                                                                   : MOECAP_ERROR_DRIVER;
  fail_with(d, r, code, what, "");
}

void check_module_load(const Driver& d, CUresult r) {
  if (r == kSuccess) return;
  const char* what = "cuModuleLoadData (embedded kernels)";
  if (r == kErrorNoBinaryForGpu) {
    fail_with(d, r, MOECAP_ERROR_NO_DEVICE, what, "; moecap's kernels have no code for this GPU (built for "
#if defined(MOECAP_CUDA_ARCHS)
              MOECAP_CUDA_ARCHS
#else
              "other architectures"
#endif
              ")");
  }
  if (r == kErrorUnsupportedPtxVersion || r == kErrorInvalidPtx) {
    fail_with(d, r, MOECAP_ERROR_DRIVER_TOO_OLD, what, "; the driver cannot compile the kernels' PTX: it needs the driver "
              "of the CUDA toolkit that built libmoecap.so or newer");
  }
  check(d, r, what);
}

}  // namespace moecap::cuda
