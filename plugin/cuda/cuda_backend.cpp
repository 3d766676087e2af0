// The CUDA backend: device buffers from cuMemAlloc, the host cache in
// portable, device-mapped pinned memory that the commit kernel writes
// directly, kernels from the embedded fatbin, all on the primary context of
// the configured device. Capture-path calls only launch on the given stream.
#include <algorithm>
#include <array>
#include <cstring>
#include <memory>

#include "base/cuda_driver.h"
#include "base/cuda_owners.h"
#include "base/status.h"
#include "base/stream.h"
#include "graphs/cuda_graph.h"
#include "graphs/element.h"
#include "plugin/backend.h"

#if defined(MOECAP_HAVE_KERNELS)
extern "C" const unsigned char moecap_kernels_fatbin[];
#endif

namespace moecap {
namespace {

using namespace cuda;

// A kernel of the embedded fatbin and how its grid is sized: one unit of work
// (an element, or a committed row for the commit kernel's warp per row) per
// `units_per_block`, 256 threads a block.
struct Kernel {
  const char* name;
  int64_t units_per_block;
  const char* launch_what;  // names the launch in errors
  CUfunction fn = nullptr;
};

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
    CUdevice device = 0;
    check(d_, d_.cuDeviceGet(&device, ordinal_), "cuDeviceGet");
    // Every owner below frees its object if a later step throws.
    ctx_ = PrimaryContext(d_, device);
    ContextScope scope(d_, ctx());
    CUmodule module = nullptr;
    check(d_, d_.cuModuleLoadData(&module, moecap_kernels_fatbin), "cuModuleLoadData (embedded kernels)");
    module_ = UniqueModule(d_, ctx(), module);
    for (Kernel* k : {&capture_, &commit_, &gather_}) {
      check(d_, d_.cuModuleGetFunction(&k->fn, module_.get(), k->name), "cuModuleGetFunction");
    }
    CUstream internal = nullptr;
    check(d_, d_.cuStreamCreate(&internal, kStreamNonBlocking), "cuStreamCreate");
    internal_ = UniqueStream(d_, ctx(), internal);
    for (UniqueEvent& e : events_) e = create_event();
    staging_free_ = create_event();
    staging_rows_ = plan.device_rows;
    const size_t staging = static_cast<size_t>(staging_rows_) * sizeof(int64_t);
    slot_staging_ = allocate_device(staging, "cuMemAlloc (slot staging)");
    row_staging_ = allocate_device(staging, "cuMemAlloc (row staging)");
#endif
  }

  DLDevice device() const override { return DLDevice{kDLCUDA, ordinal_}; }
  bool kernel_can_read(DLDevice d) const override {
    return ((d.device_type == kDLCUDA || d.device_type == kDLCUDAManaged) && d.device_id == ordinal_) ||
           d.device_type == kDLCUDAHost;
  }

  void* alloc_device(size_t bytes) override {
    ContextScope scope(d_, ctx());
    UniqueDeviceMemory p = allocate_device(bytes == 0 ? 1 : bytes, "cuMemAlloc");
    check(d_, d_.cuMemsetD8Async(p.get(), 0, bytes, internal_.get()), "cuMemsetD8Async");
    check(d_, d_.cuStreamSynchronize(internal_.get()), "cuStreamSynchronize");
    return reinterpret_cast<void*>(p.release());
  }
  // The owners free in the backend's context and never throw (see cuda_owners.h).
  void free_device(void* ptr) override { UniqueDeviceMemory(d_, ctx(), reinterpret_cast<CUdeviceptr>(ptr)).reset(); }
  void* alloc_host(size_t bytes) override {
    ContextScope scope(d_, ctx());
    void* p = nullptr;
    check(d_, d_.cuMemHostAlloc(&p, bytes == 0 ? 1 : bytes, kMemHostAllocPortable | kMemHostAllocDeviceMap),
          "cuMemHostAlloc");
    std::memset(p, 0, bytes);
    return p;
  }
  void free_host(void* ptr) override { UniquePinnedMemory(d_, ctx(), ptr).reset(); }
  void* device_address_of_host(void* host) override {
    ContextScope scope(d_, ctx());
    CUdeviceptr p = 0;
    check(d_, d_.cuMemHostGetDevicePointer(&p, host, 0), "cuMemHostGetDevicePointer");
    return reinterpret_cast<void*>(p);
  }

  void capture(const CaptureParams& p, EngineStream stream) override {
    ContextScope scope(d_, ctx());
    launch(capture_, p, p.n * p.top_k, cu_stream(stream));
  }

  void commit(const CommitParams& p, CommitPlacement where, EngineStream stream) override {
    ContextScope scope(d_, ctx());
    const CUstream s = cu_stream(stream);
    CommitParams params = p;
    const bool staged = where.slots_on_host || where.rows_on_host;
    if (staged) {
      // One staging area per capturer: the previous user must be done with it.
      check(d_, d_.cuStreamWaitEvent(s, staging_free_.get(), 0), "cuStreamWaitEvent");
      if (where.slots_on_host) params.dst_slots = stage(slot_staging_, p.dst_slots, p.count, p.dst_slots_elem, s);
      if (where.rows_on_host) params.src_rows = stage(row_staging_, p.src_rows, p.count, p.src_rows_elem, s);
    }
    launch(commit_, params, p.count, s);
    if (staged) check(d_, d_.cuEventRecord(staging_free_.get(), s), "cuEventRecord");
    // Inside a capture a plain record only expresses a dependency inside the
    // graph, and the host may not wait on it; an external record becomes an
    // event-record node that every replay performs, so read can wait for it.
    const CUevent e = events_[next_event_].get();
    if (where.in_graph) {
      check(d_, d_.cuEventRecordWithFlags(e, s, kEventRecordExternal), "cuEventRecordWithFlags (commit)");
    } else {
      check(d_, d_.cuEventRecord(e, s), "cuEventRecord (commit)");
    }
    next_event_ = (next_event_ + 1) % events_.size();
    if (recorded_ < events_.size()) ++recorded_;
  }

  void gather(const GatherParams& p, EngineStream stream) override {
    ContextScope scope(d_, ctx());
    const CUstream s = cu_stream(stream);
    check(d_, d_.cuStreamWaitEvent(s, staging_free_.get(), 0), "cuStreamWaitEvent");
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
      launch(gather_, piece, piece.count * p.row_elements, s);
    }
    check(d_, d_.cuEventRecord(staging_free_.get(), s), "cuEventRecord");
  }

  void zero_device(void* ptr, size_t bytes, EngineStream stream) override {
    ContextScope scope(d_, ctx());
    check(d_, d_.cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(ptr), 0, bytes, cu_stream(stream)),
          "cuMemsetD8Async");
  }

  bool commits_done(bool block) override {
    ContextScope scope(d_, ctx());
    for (size_t i = 0; i < recorded_; ++i) {
      if (block) {
        check(d_, d_.cuEventSynchronize(events_[i].get()), "cuEventSynchronize");
      } else {
        const CUresult r = d_.cuEventQuery(events_[i].get());
        if (r == kErrorNotReady) return false;
        check(d_, r, "cuEventQuery");
      }
    }
    return true;
  }

  void copy_device_to_host(void* dst, const void* src, size_t bytes) override {
    ContextScope scope(d_, ctx());
    check(d_, d_.cuMemcpyDtoHAsync(dst, reinterpret_cast<CUdeviceptr>(src), bytes, internal_.get()),
          "cuMemcpyDtoHAsync");
    check(d_, d_.cuStreamSynchronize(internal_.get()), "cuStreamSynchronize");
  }
  void copy_host_to_device(void* dst, const void* src, size_t bytes) override {
    ContextScope scope(d_, ctx());
    check(d_, d_.cuMemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(dst), src, bytes, internal_.get()),
          "cuMemcpyHtoDAsync");
    check(d_, d_.cuStreamSynchronize(internal_.get()), "cuStreamSynchronize");
  }

  void wait_stream(EngineStream stream) override {
    ContextScope scope(d_, ctx());
    check(d_, d_.cuStreamSynchronize(cu_stream(stream)), "cuStreamSynchronize");
  }

  bool stream_capturing(EngineStream stream) override {
    ContextScope scope(d_, ctx());
    int status = kCaptureStatusNone;
    check(d_, d_.cuStreamIsCapturing(cu_stream(stream), &status), "cuStreamIsCapturing");
    return status != kCaptureStatusNone;
  }

  void begin_graph(EngineStream stream) override {
    ContextScope scope(d_, ctx());
    cuda::begin_graph(d_, cu_stream(stream));
    recording_ = cu_stream(stream);
  }

  std::unique_ptr<BackendGraph> end_graph() override {
    ContextScope scope(d_, ctx());
    const CUstream s = recording_;
    recording_ = nullptr;
    return cuda::end_graph(d_, ctx(), s);
  }

 private:
  CUcontext ctx() const { return ctx_.get(); }

  // Every kernel launch: the parameter struct is the kernel's one argument;
  // the grid is capped at 4096 blocks, the kernels loop over what it does not
  // cover. The grid is frozen in a graph, so it follows the call's sizes.
  template <class Params>
  void launch(const Kernel& k, Params params, int64_t units, CUstream s) {
    constexpr unsigned kThreads = 256;
    constexpr int64_t kMaxBlocks = 4096;
    const auto blocks = static_cast<unsigned>(std::min((units + k.units_per_block - 1) / k.units_per_block, kMaxBlocks));
    void* args[] = {&params};
    check(d_, d_.cuLaunchKernel(k.fn, blocks, 1, 1, kThreads, 1, 1, 0, s, args, nullptr), k.launch_what);
  }

  // Needs the context current.
  UniqueDeviceMemory allocate_device(size_t bytes, const char* what) {
    CUdeviceptr p = 0;
    check(d_, d_.cuMemAlloc(&p, bytes), what);
    return UniqueDeviceMemory(d_, ctx(), p);
  }
  UniqueEvent create_event() {
    CUevent e = nullptr;
    check(d_, d_.cuEventCreate(&e, kEventDisableTiming), "cuEventCreate");
    return UniqueEvent(d_, ctx(), e);
  }

  // Copies `count` host indices into a staging buffer on `s`; returns it.
  const void* stage(const UniqueDeviceMemory& staging, const void* host, int64_t count, int32_t elem, CUstream s) {
    check(d_, d_.cuMemcpyHtoDAsync(staging.get(), host, static_cast<size_t>(count * elem_bytes(elem)), s),
          "cuMemcpyHtoDAsync (staging)");
    return reinterpret_cast<const void*>(staging.get());
  }

  const Driver& d_;
  int ordinal_;
  // Owners are destroyed in reverse order: the primary context goes last.
  PrimaryContext ctx_;
  UniqueModule module_;
  Kernel capture_{"moecap_capture_kernel", 256, "cuLaunchKernel (capture)"};
  Kernel commit_{"moecap_commit_kernel", 8, "cuLaunchKernel (commit)"};  // a warp per row, 8 warps a block
  Kernel gather_{"moecap_gather_kernel", 256, "cuLaunchKernel (gather)"};
  UniqueStream internal_;
  std::array<UniqueEvent, 16> events_;
  size_t next_event_ = 0;
  size_t recorded_ = 0;
  UniqueEvent staging_free_;
  UniqueDeviceMemory slot_staging_;
  UniqueDeviceMemory row_staging_;
  int64_t staging_rows_ = 0;
  CUstream recording_ = nullptr;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const Plan& plan) { return std::make_unique<CudaBackend>(plan); }

}  // namespace moecap
