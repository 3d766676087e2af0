// The CUDA backend: device buffers from cuMemAlloc, the host cache in
// portable, device-mapped pinned memory that the commit kernel writes
// directly, kernels from the embedded fatbin, all on the primary context of
// the configured device. Capture-path calls only launch on the given stream.
#include <algorithm>
#include <array>
#include <cstring>
#include <memory>

#include "base/cuda_driver.h"
#include "base/status.h"
#include "graphs/cuda_graph.h"
#include "graphs/element.h"
#include "plugin/backend.h"

#if defined(MOECAP_HAVE_KERNELS)
extern "C" const unsigned char moecap_kernels_fatbin[];
#endif

namespace moecap {
namespace {

using namespace cuda;

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const Plan& plan) : d_(driver()), ordinal_(plan.config.device_id) {
#if !defined(MOECAP_HAVE_KERNELS)
    fail(MOECAP_ERROR_NO_DEVICE, "this libmoecap.so was built without CUDA kernels (no nvcc at build time); ",
         "only MOECAP_DEVICE_HOST is available");
#else
    int count = 0;
    check(d_, d_.cuDeviceGetCount(&count), "cuDeviceGetCount");
    if (count == 0) fail(MOECAP_ERROR_NO_DEVICE, "the CUDA driver reports no GPU");
    if (ordinal_ >= count) {
      fail(MOECAP_ERROR_NO_DEVICE, "config->device_id is ", ordinal_, "; the driver reports ", count, " GPU(s)");
    }
    check(d_, d_.cuDeviceGet(&device_, ordinal_), "cuDeviceGet");
    check(d_, d_.cuDevicePrimaryCtxRetain(&ctx_, device_), "cuDevicePrimaryCtxRetain");
    try {
      ContextScope scope(d_, ctx_);
      check(d_, d_.cuModuleLoadData(&module_, moecap_kernels_fatbin), "cuModuleLoadData (embedded kernels)");
      check(d_, d_.cuModuleGetFunction(&capture_fn_, module_, "moecap_capture_kernel"), "cuModuleGetFunction");
      check(d_, d_.cuModuleGetFunction(&commit_fn_, module_, "moecap_commit_kernel"), "cuModuleGetFunction");
      check(d_, d_.cuModuleGetFunction(&gather_fn_, module_, "moecap_gather_kernel"), "cuModuleGetFunction");
      check(d_, d_.cuStreamCreate(&internal_, kStreamNonBlocking), "cuStreamCreate");
      for (CUevent& e : events_) check(d_, d_.cuEventCreate(&e, kEventDisableTiming), "cuEventCreate");
      check(d_, d_.cuEventCreate(&staging_free_, kEventDisableTiming), "cuEventCreate");
      staging_rows_ = plan.device_rows;
      const size_t staging = static_cast<size_t>(staging_rows_) * sizeof(int64_t);
      check(d_, d_.cuMemAlloc(&slot_staging_, staging), "cuMemAlloc (slot staging)");
      check(d_, d_.cuMemAlloc(&row_staging_, staging), "cuMemAlloc (row staging)");
    } catch (...) {
      release();
      throw;
    }
#endif
  }

  ~CudaBackend() override { release(); }

  DLDevice device() const override { return DLDevice{kDLCUDA, ordinal_}; }
  bool kernel_can_read(DLDevice d) const override {
    return ((d.device_type == kDLCUDA || d.device_type == kDLCUDAManaged) && d.device_id == ordinal_) ||
           d.device_type == kDLCUDAHost;
  }

  void* alloc_device(size_t bytes) override {
    ContextScope scope(d_, ctx_);
    CUdeviceptr p = 0;
    check(d_, d_.cuMemAlloc(&p, bytes == 0 ? 1 : bytes), "cuMemAlloc");
    CUresult r = d_.cuMemsetD8Async(p, 0, bytes, internal_);
    if (r == kSuccess) r = d_.cuStreamSynchronize(internal_);
    if (r != kSuccess) {
      d_.cuMemFree(p);
      check(d_, r, "cuMemsetD8Async");
    }
    return reinterpret_cast<void*>(p);
  }
  // Frees run from destructors, also at process exit when the driver may be
  // gone: they never throw, and a driver that cannot free anymore keeps it.
  void free_device(void* ptr) override {
    if (d_.cuCtxPushCurrent(ctx_) != kSuccess) return;
    d_.cuMemFree(reinterpret_cast<CUdeviceptr>(ptr));
    CUcontext popped = nullptr;
    d_.cuCtxPopCurrent(&popped);
  }
  void* alloc_host(size_t bytes) override {
    ContextScope scope(d_, ctx_);
    void* p = nullptr;
    check(d_, d_.cuMemHostAlloc(&p, bytes == 0 ? 1 : bytes, kMemHostAllocPortable | kMemHostAllocDeviceMap),
          "cuMemHostAlloc");
    std::memset(p, 0, bytes);
    return p;
  }
  void free_host(void* ptr) override {
    if (d_.cuCtxPushCurrent(ctx_) != kSuccess) return;
    d_.cuMemFreeHost(ptr);
    CUcontext popped = nullptr;
    d_.cuCtxPopCurrent(&popped);
  }
  void* device_address_of_host(void* host) override {
    ContextScope scope(d_, ctx_);
    CUdeviceptr p = 0;
    check(d_, d_.cuMemHostGetDevicePointer(&p, host, 0), "cuMemHostGetDevicePointer");
    return reinterpret_cast<void*>(p);
  }

  void capture(const CaptureParams& p, void* stream) override {
    ContextScope scope(d_, ctx_);
    const int64_t elements = p.n * p.top_k;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((elements + 255) / 256, 4096));
    CaptureParams params = p;
    void* args[] = {&params};
    check(d_, d_.cuLaunchKernel(capture_fn_, blocks, 1, 1, 256, 1, 1, 0, static_cast<CUstream>(stream), args, nullptr),
          "cuLaunchKernel (capture)");
  }

  void commit(const CommitParams& p, CommitPlacement where, void* stream) override {
    ContextScope scope(d_, ctx_);
    CUstream s = static_cast<CUstream>(stream);
    CommitParams params = p;
    const bool staged = where.slots_on_host || where.rows_on_host;
    if (staged) {
      // One staging area per capturer: the previous user must be done with it.
      check(d_, d_.cuStreamWaitEvent(s, staging_free_, 0), "cuStreamWaitEvent");
      if (where.slots_on_host) params.dst_slots = stage(slot_staging_, p.dst_slots, p.count, p.dst_slots_elem, s);
      if (where.rows_on_host) params.src_rows = stage(row_staging_, p.src_rows, p.count, p.src_rows_elem, s);
    }
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((p.count + 7) / 8, 4096));
    void* args[] = {&params};
    check(d_, d_.cuLaunchKernel(commit_fn_, blocks, 1, 1, 256, 1, 1, 0, s, args, nullptr), "cuLaunchKernel (commit)");
    if (staged) check(d_, d_.cuEventRecord(staging_free_, s), "cuEventRecord");
    // Inside a capture a plain record only expresses a dependency inside the
    // graph, and the host may not wait on it; an external record becomes an
    // event-record node that every replay performs, so read can wait for it.
    CUevent e = events_[next_event_];
    if (where.in_graph) {
      check(d_, d_.cuEventRecordWithFlags(e, s, kEventRecordExternal), "cuEventRecordWithFlags (commit)");
    } else {
      check(d_, d_.cuEventRecord(e, s), "cuEventRecord (commit)");
    }
    next_event_ = (next_event_ + 1) % events_.size();
    if (recorded_ < events_.size()) ++recorded_;
  }

  void gather(const GatherParams& p, void* stream) override {
    ContextScope scope(d_, ctx_);
    CUstream s = static_cast<CUstream>(stream);
    check(d_, d_.cuStreamWaitEvent(s, staging_free_, 0), "cuStreamWaitEvent");
    // The staging area holds device_rows slots; longer requests go in pieces,
    // each ordered on `s` after the previous piece's kernel read the staging.
    const int64_t slot_bytes = elem_bytes(p.slots_elem);
    const int64_t id_row = p.row_elements * elem_bytes(p.dst_id_elem);
    const int64_t w_row = p.dst_weights ? p.row_elements * elem_bytes(p.dst_weight_elem) : 0;
    for (int64_t first = 0; first < p.count; first += staging_rows_) {
      GatherParams piece = p;
      piece.count = std::min(staging_rows_, p.count - first);
      piece.slots = stage(slot_staging_, static_cast<const uint8_t*>(p.slots) + first * slot_bytes, piece.count,
                          p.slots_elem, s);
      piece.dst_ids = static_cast<uint8_t*>(p.dst_ids) + first * id_row;
      if (p.dst_weights) piece.dst_weights = static_cast<uint8_t*>(p.dst_weights) + first * w_row;
      const int64_t elements = piece.count * p.row_elements;
      const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((elements + 255) / 256, 4096));
      void* args[] = {&piece};
      check(d_, d_.cuLaunchKernel(gather_fn_, blocks, 1, 1, 256, 1, 1, 0, s, args, nullptr), "cuLaunchKernel (gather)");
    }
    check(d_, d_.cuEventRecord(staging_free_, s), "cuEventRecord");
  }

  void zero_device(void* ptr, size_t bytes, void* stream) override {
    ContextScope scope(d_, ctx_);
    check(d_, d_.cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(ptr), 0, bytes, static_cast<CUstream>(stream)),
          "cuMemsetD8Async");
  }

  bool commits_done(bool block) override {
    ContextScope scope(d_, ctx_);
    for (size_t i = 0; i < recorded_; ++i) {
      if (block) {
        check(d_, d_.cuEventSynchronize(events_[i]), "cuEventSynchronize");
      } else {
        const CUresult r = d_.cuEventQuery(events_[i]);
        if (r == kErrorNotReady) return false;
        check(d_, r, "cuEventQuery");
      }
    }
    return true;
  }

  void copy_device_to_host(void* dst, const void* src, size_t bytes) override {
    ContextScope scope(d_, ctx_);
    check(d_, d_.cuMemcpyDtoHAsync(dst, reinterpret_cast<CUdeviceptr>(src), bytes, internal_), "cuMemcpyDtoHAsync");
    check(d_, d_.cuStreamSynchronize(internal_), "cuStreamSynchronize");
  }
  void copy_host_to_device(void* dst, const void* src, size_t bytes) override {
    ContextScope scope(d_, ctx_);
    check(d_, d_.cuMemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(dst), src, bytes, internal_), "cuMemcpyHtoDAsync");
    check(d_, d_.cuStreamSynchronize(internal_), "cuStreamSynchronize");
  }

  void wait_stream(void* stream) override {
    ContextScope scope(d_, ctx_);
    check(d_, d_.cuStreamSynchronize(static_cast<CUstream>(stream)), "cuStreamSynchronize");
  }

  bool stream_capturing(void* stream) override {
    ContextScope scope(d_, ctx_);
    int status = kCaptureStatusNone;
    check(d_, d_.cuStreamIsCapturing(static_cast<CUstream>(stream), &status), "cuStreamIsCapturing");
    return status != kCaptureStatusNone;
  }

  void begin_graph(void* stream) override {
    ContextScope scope(d_, ctx_);
    cuda::begin_graph(d_, static_cast<CUstream>(stream));
    recording_ = static_cast<CUstream>(stream);
  }

  std::unique_ptr<BackendGraph> end_graph() override {
    ContextScope scope(d_, ctx_);
    CUstream s = recording_;
    recording_ = nullptr;
    return cuda::end_graph(d_, ctx_, s);
  }

 private:
  // Copies `count` host indices into a staging buffer on `s`; returns it.
  const void* stage(CUdeviceptr staging, const void* host, int64_t count, int32_t elem, CUstream s) {
    check(d_, d_.cuMemcpyHtoDAsync(staging, host, static_cast<size_t>(count * elem_bytes(elem)), s),
          "cuMemcpyHtoDAsync (staging)");
    return reinterpret_cast<const void*>(staging);
  }

  // Frees what the constructor made; errors are ignored because this also
  // runs at process exit, when the driver may already be shutting down.
  void release() {
    if (ctx_ == nullptr) return;
    if (d_.cuCtxPushCurrent(ctx_) == kSuccess) {
      if (slot_staging_) d_.cuMemFree(slot_staging_);
      if (row_staging_) d_.cuMemFree(row_staging_);
      for (CUevent e : events_)
        if (e) d_.cuEventDestroy(e);
      if (staging_free_) d_.cuEventDestroy(staging_free_);
      if (internal_) d_.cuStreamDestroy(internal_);
      if (module_) d_.cuModuleUnload(module_);
      CUcontext popped = nullptr;
      d_.cuCtxPopCurrent(&popped);
    }
    d_.cuDevicePrimaryCtxRelease(device_);
    ctx_ = nullptr;
  }

  const Driver& d_;
  int ordinal_;
  CUdevice device_ = 0;
  CUcontext ctx_ = nullptr;
  CUmodule module_ = nullptr;
  CUfunction capture_fn_ = nullptr;
  CUfunction commit_fn_ = nullptr;
  CUfunction gather_fn_ = nullptr;
  CUstream internal_ = nullptr;
  std::array<CUevent, 16> events_{};
  size_t next_event_ = 0;
  size_t recorded_ = 0;
  CUevent staging_free_ = nullptr;
  CUdeviceptr slot_staging_ = 0;
  int64_t staging_rows_ = 0;
  CUdeviceptr row_staging_ = 0;
  CUstream recording_ = nullptr;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const Plan& plan) { return std::make_unique<CudaBackend>(plan); }

}  // namespace moecap
