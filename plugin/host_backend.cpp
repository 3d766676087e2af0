// The host backend: plain memory, operations run at once (or are recorded
// into a HostGraph between begin_graph and end_graph). The reference that
// every test runs against, and the real backend of CPU inference engines.
#include <cstdlib>
#include <cstring>
#include <new>

#include "base/status.h"
#include "graphs/host_graph.h"
#include "plugin/backend.h"

namespace moecap {
namespace {

class HostBackend final : public Backend {
 public:
  DLDevice device() const override { return DLDevice{kDLCPU, 0}; }
  bool kernel_can_read(DLDevice d) const override { return host_can_read(d); }

  void* alloc_device(size_t bytes) override { return allocate(bytes); }
  void free_device(void* ptr) override { std::free(ptr); }
  void* alloc_host(size_t bytes) override { return allocate(bytes); }
  void free_host(void* ptr) override { std::free(ptr); }
  void* device_address_of_host(void* host) override { return host; }

  void capture(const CaptureParams& p, EngineStream) override {
    graphs_.run([p] { capture_on_host(p); });
  }
  void commit(const CommitParams& p, CommitPlacement, EngineStream) override {
    graphs_.run([p] { commit_on_host(p); });
  }
  void gather(const GatherParams& p, EngineStream) override { gather_on_host(p); }
  void zero_device(void* ptr, size_t bytes, EngineStream) override {
    graphs_.run([ptr, bytes] { std::memset(ptr, 0, bytes); });
  }

  bool commits_done(bool, const SlotList*, std::unique_lock<std::mutex>*) override { return true; }
  void reads_done(const SlotList&) override {}
  ErrorWord take_errors(ErrorWord* counters, bool clear) override {
    if (!clear) return *counters;
    ErrorWord out{};
    take_errors_on_host(TakeErrorsParams{counters, &out});
    return out;
  }
  void copy_device_to_host(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_host_to_device(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }

  void wait_stream(EngineStream) override {}
  bool stream_capturing(EngineStream) override { return false; }

  void begin_graph(EngineStream) override { graphs_.begin(); }
  std::unique_ptr<BackendGraph> end_graph() override { return graphs_.end(); }

 private:
  // 64-byte aligned (a cache line; what JAX and XLA need to take a DLPack view
  // without copying it), zeroed.
  static void* allocate(size_t bytes) {
    constexpr size_t kAlign = 64;
    const size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
    void* p = rounded < bytes ? nullptr : std::aligned_alloc(kAlign, rounded == 0 ? kAlign : rounded);
    if (p == nullptr) fail(MOECAP_ERROR_OUT_OF_MEMORY, "host backend: cannot allocate ", bytes, " bytes");
    std::memset(p, 0, rounded == 0 ? kAlign : rounded);
    return p;
  }

  HostGraphRecorder graphs_;
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(const Plan&) { return std::make_unique<HostBackend>(); }

}  // namespace moecap
