/* SPDX-License-Identifier: Apache-2.0 */
// The CUDA Driver API, loaded at run time: dlopen("libcuda.so.1") and every
// entry point through cuGetProcAddress, so libmoecap.so has no link-time
// dependency on libcuda or cudart and loads on machines without a GPU. The
// few driver types are declared here (their ABI is fixed), so the library
// builds without the CUDA toolkit too.
#pragma once

#include <cstddef>
#include <cstdint>

#include "base/status.h"
#include "base/stream.h"

namespace moecap::cuda {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUgraph = struct CUgraph_st*;
using CUgraphExec = struct CUgraphExec_st*;
using CUgraphNode = struct CUgraphNode_st*;
using CUuserObject = struct CUuserObject_st*;

constexpr CUresult kSuccess = 0;
constexpr CUresult kErrorOutOfMemory = 2;
constexpr CUresult kErrorDeinitialized = 4;
constexpr CUresult kErrorStubLibrary = 34;
constexpr CUresult kErrorNoDevice = 100;
// cuModuleLoadData: no SASS for this GPU and no PTX it can JIT / PTX newer
// than the driver's JIT compiler.
constexpr CUresult kErrorInvalidPtx = 218;
constexpr CUresult kErrorNoBinaryForGpu = 209;
constexpr CUresult kErrorUnsupportedPtxVersion = 222;
constexpr CUresult kErrorNotFound = 500;
constexpr CUresult kErrorNotReady = 600;
// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED .. CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD:
// the call is not allowed while a graph is being captured.
constexpr CUresult kErrorCaptureFirst = 900;
constexpr CUresult kErrorCaptureLast = 908;

constexpr unsigned kStreamNonBlocking = 0x1;
// CU_STREAM_PER_THREAD: one handle that means each calling thread's own stream.
constexpr uintptr_t kStreamPerThreadHandle = 0x2;
constexpr unsigned kEventBlockingSync = 0x1;
constexpr unsigned kEventDisableTiming = 0x2;
constexpr unsigned kMemHostAllocPortable = 0x1;
constexpr unsigned kMemHostAllocDeviceMap = 0x2;
constexpr unsigned kEventRecordExternal = 0x1;
constexpr int kCaptureStatusNone = 0;
constexpr int kCaptureStatusActive = 1;
constexpr int kCaptureModeRelaxed = 2;
constexpr unsigned kUserObjectNoDestructorSync = 0x1;
constexpr unsigned kGraphUserObjectMove = 0x1;

// The first CUDA release with every entry point below: cuGetProcAddress
// finds an entry point only in the ABI of a release that has it.
constexpr int kEntryPointsVersion = 11040;
// The oldest driver moecap needs, and the ABI its entry points are resolved
// in: the one of the toolkit that built the kernels (SASS from CUDA N.x needs
// a driver for CUDA N.0; PTX JIT failures are reported at module load), but
// never older than kEntryPointsVersion (a CUDA 11.x build asking for 11.0's
// ABI would find no cuGraphInstantiateWithFlags).
#if defined(MOECAP_KERNELS_CUDA_VERSION)
constexpr int kMinDriverVersion = MOECAP_KERNELS_CUDA_VERSION / 1000 * 1000 > kEntryPointsVersion
                                      ? MOECAP_KERNELS_CUDA_VERSION / 1000 * 1000
                                      : kEntryPointsVersion;
#else
constexpr int kMinDriverVersion = kEntryPointsVersion;
#endif
// cuStreamGetCaptureInfo is resolved in CUDA 11.3's ABI (with the capture's
// graph, without 12.3's edge data), whatever the minimum above.
constexpr int kCaptureInfoVersion = 11030;

// Every entry point resolved through cuGetProcAddress, written once as
// X(name, parameter list): the Driver struct declares them and the loader
// (cuda_driver.cpp) resolves them from this one list.
#define MOECAP_CUDA_ENTRY_POINTS(X)                                                                           \
  X(cuGetErrorName, (CUresult, const char**))                                                                 \
  X(cuGetErrorString, (CUresult, const char**))                                                               \
  X(cuDeviceGetCount, (int*))                                                                                 \
  X(cuDeviceGet, (CUdevice*, int))                                                                            \
  X(cuDevicePrimaryCtxRetain, (CUcontext*, CUdevice))                                                         \
  X(cuDevicePrimaryCtxRelease, (CUdevice))                                                                    \
  X(cuCtxPushCurrent, (CUcontext))                                                                            \
  X(cuCtxPopCurrent, (CUcontext*))                                                                            \
  X(cuMemAlloc, (CUdeviceptr*, size_t))                                                                       \
  X(cuMemFree, (CUdeviceptr))                                                                                 \
  X(cuMemHostAlloc, (void**, size_t, unsigned))                                                               \
  X(cuMemFreeHost, (void*))                                                                                   \
  X(cuMemHostGetDevicePointer, (CUdeviceptr*, void*, unsigned))                                               \
  X(cuMemsetD8Async, (CUdeviceptr, unsigned char, size_t, CUstream))                                          \
  X(cuMemcpyHtoDAsync, (CUdeviceptr, const void*, size_t, CUstream))                                         \
  X(cuMemcpyDtoHAsync, (void*, CUdeviceptr, size_t, CUstream))                                               \
  X(cuModuleLoadData, (CUmodule*, const void*))                                                               \
  X(cuModuleUnload, (CUmodule))                                                                               \
  X(cuModuleGetFunction, (CUfunction*, CUmodule, const char*))                                                \
  X(cuLaunchKernel, (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, \
                     void**, void**))                                                                         \
  X(cuStreamCreate, (CUstream*, unsigned))                                                                    \
  X(cuStreamDestroy, (CUstream))                                                                              \
  X(cuStreamSynchronize, (CUstream))                                                                          \
  X(cuStreamWaitEvent, (CUstream, CUevent, unsigned))                                                         \
  X(cuStreamIsCapturing, (CUstream, int*))                                                                    \
  X(cuStreamBeginCapture, (CUstream, int))                                                                    \
  X(cuStreamEndCapture, (CUstream, CUgraph*))                                                                 \
  X(cuEventCreate, (CUevent*, unsigned))                                                                      \
  X(cuEventDestroy, (CUevent))                                                                                \
  X(cuEventRecord, (CUevent, CUstream))                                                                       \
  X(cuEventRecordWithFlags, (CUevent, CUstream, unsigned))                                                    \
  X(cuEventQuery, (CUevent))                                                                                  \
  X(cuEventSynchronize, (CUevent))                                                                            \
  X(cuGraphInstantiateWithFlags, (CUgraphExec*, CUgraph, unsigned long long))                                 \
  X(cuGraphLaunch, (CUgraphExec, CUstream))                                                                   \
  X(cuGraphExecDestroy, (CUgraphExec))                                                                        \
  X(cuGraphDestroy, (CUgraph))                                                                                \
  X(cuThreadExchangeStreamCaptureMode, (int*))                                                                \
  X(cuUserObjectCreate, (CUuserObject*, void*, void (*)(void*), unsigned, unsigned))                          \
  X(cuUserObjectRelease, (CUuserObject, unsigned))                                                            \
  X(cuGraphRetainUserObject, (CUgraph, CUuserObject, unsigned, unsigned))

struct Driver {
  // Found with dlsym before anything else: they decide whether the rest can be.
  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuDriverGetVersion)(int*) = nullptr;
#define MOECAP_CUDA_DECLARE_ENTRY_POINT(name, params) CUresult(*name) params = nullptr;
  MOECAP_CUDA_ENTRY_POINTS(MOECAP_CUDA_DECLARE_ENTRY_POINT)
#undef MOECAP_CUDA_DECLARE_ENTRY_POINT
  // In kCaptureInfoVersion's ABI: status, capture id, the graph being captured.
  CUresult (*cuStreamGetCaptureInfo)(CUstream, int*, uint64_t*, CUgraph*, const CUgraphNode**, size_t*) = nullptr;

  int version = 0;  // cuDriverGetVersion
};

// The process's driver, loaded and initialized on first success. Throws
// moecap::Error: NO_DEVICE (no libcuda.so.1, or no GPU), STUB_DRIVER,
// DRIVER_TOO_OLD, DRIVER. A failure is not cached, so a later call retries.
// MOECAP_LIBCUDA, if set, names the library to load instead of libcuda.so.1.
const Driver& driver();

// Throws moecap::Error naming `what` unless r == 0: OUT_OF_MEMORY, CAPTURE_ILLEGAL
// for the stream-capture errors, DRIVER for the rest.
void check(const Driver& d, CUresult r, const char* what);

// The engine's stream as the driver takes it (NULL: the legacy default stream).
inline CUstream cu_stream(EngineStream s) { return static_cast<CUstream>(s.handle()); }

// check() for cuModuleLoadData of moecap's kernels: NO_DEVICE when nothing in
// the fatbin runs on this GPU, DRIVER_TOO_OLD when the driver cannot JIT its
// PTX, DRIVER otherwise.
void check_module_load(const Driver& d, CUresult r);

// Puts this thread in relaxed stream-capture mode for one host-side call
// (a wait, copy or allocation), restoring its mode after: in the default
// global mode such calls fail, and invalidate the capture, while any thread
// captures a graph (torch.cuda.graph on another thread, or this one).
// Never throws (frees use it too): if the exchange fails, the mode stays
// (also where a driver table lacks the entry point: tests' counting drivers).
class RelaxedCaptureScope {
 public:
  explicit RelaxedCaptureScope(const Driver& d) noexcept
      : d_(d),
        exchanged_(d_.cuThreadExchangeStreamCaptureMode != nullptr &&
                   d_.cuThreadExchangeStreamCaptureMode(&mode_) == kSuccess) {}
  ~RelaxedCaptureScope() {
    if (exchanged_) d_.cuThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCaptureScope(const RelaxedCaptureScope&) = delete;
  RelaxedCaptureScope& operator=(const RelaxedCaptureScope&) = delete;

 private:
  const Driver& d_;
  int mode_ = kCaptureModeRelaxed;
  bool exchanged_;
};

// Makes a context current for one call, restoring the caller's.
class ContextScope {
 public:
  ContextScope(const Driver& d, CUcontext ctx) : d_(d) { check(d_, d_.cuCtxPushCurrent(ctx), "cuCtxPushCurrent"); }
  ~ContextScope() {
    CUcontext popped = nullptr;
    d_.cuCtxPopCurrent(&popped);
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  const Driver& d_;
};

}  // namespace moecap::cuda
