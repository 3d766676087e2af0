// The CUDA Driver API, loaded at run time: dlopen("libcuda.so.1") and every
// entry point through cuGetProcAddress, so libmoecap.so has no link-time
// dependency on libcuda or cudart and loads on machines without a GPU. The
// few driver types are declared here (their ABI is fixed), so the plugin
// builds without the CUDA toolkit too.
#pragma once

#include <cstddef>
#include <cstdint>

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

constexpr CUresult kSuccess = 0;
constexpr CUresult kErrorOutOfMemory = 2;
constexpr CUresult kErrorDeinitialized = 4;
constexpr CUresult kErrorStubLibrary = 34;
constexpr CUresult kErrorNoDevice = 100;
constexpr CUresult kErrorNotFound = 500;
constexpr CUresult kErrorNotReady = 600;
// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED .. CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD:
// the call is not allowed while a graph is being captured.
constexpr CUresult kErrorCaptureFirst = 900;
constexpr CUresult kErrorCaptureLast = 908;

constexpr unsigned kStreamNonBlocking = 0x1;
constexpr unsigned kEventDisableTiming = 0x2;
constexpr unsigned kMemHostAllocPortable = 0x1;
constexpr unsigned kMemHostAllocDeviceMap = 0x2;
constexpr unsigned kEventRecordExternal = 0x1;
constexpr int kCaptureStatusNone = 0;
constexpr int kCaptureModeThreadLocal = 1;

// The oldest driver moecap needs: 11.4, the first with every entry point below
// (cuGraphInstantiateWithFlags is the newest of them).
constexpr int kMinDriverVersion = 11040;

struct Driver {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDriverGetVersion)(int*);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
  CUresult (*cuCtxPushCurrent)(CUcontext);
  CUresult (*cuCtxPopCurrent)(CUcontext*);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned);
  CUresult (*cuMemFreeHost)(void*);
  CUresult (*cuMemHostGetDevicePointer)(CUdeviceptr*, void*, unsigned);
  CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleUnload)(CUmodule);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);
  CUresult (*cuStreamCreate)(CUstream*, unsigned);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned);
  CUresult (*cuStreamIsCapturing)(CUstream, int*);
  CUresult (*cuStreamBeginCapture)(CUstream, int);
  CUresult (*cuStreamEndCapture)(CUstream, CUgraph*);
  CUresult (*cuEventCreate)(CUevent*, unsigned);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventRecordWithFlags)(CUevent, CUstream, unsigned);
  CUresult (*cuEventQuery)(CUevent);
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuGraphInstantiateWithFlags)(CUgraphExec*, CUgraph, unsigned long long);
  CUresult (*cuGraphLaunch)(CUgraphExec, CUstream);
  CUresult (*cuGraphExecDestroy)(CUgraphExec);
  CUresult (*cuGraphDestroy)(CUgraph);

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
