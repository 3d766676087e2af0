// SPDX-License-Identifier: Apache-2.0
// The host backend: plain memory, operations run at once (or are recorded
// into a HostGraph between begin_graph and end_graph). The reference that
// every test runs against, and the real backend of CPU inference engines.
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#include "base/status.h"
#include "graphs/element.h"
#include "graphs/host_graph.h"
#include "plugin/backend.h"

namespace moecap {
namespace {

// A host index list copied at the call: forked work runs after the caller
// may have refilled it.
std::shared_ptr<std::vector<uint8_t>> copy_indices(const void* data, int64_t count, int32_t elem) {
  const auto* p = static_cast<const uint8_t*>(data);
  return std::make_shared<std::vector<uint8_t>>(p, p + count * elem_bytes(elem));
}

class HostBackend final : public Backend {
 public:
  explicit HostBackend(bool side_stream) : side_stream_(side_stream) {}

  DLDevice device() const override { return DLDevice{kDLCPU, 0}; }
  bool kernel_can_read(DLDevice d) const override { return host_can_read(d); }

  void* alloc_device(size_t bytes) override { return allocate(bytes); }
  void free_device(void* ptr) override { std::free(ptr); }
  void* alloc_host(size_t bytes) override { return allocate(bytes); }
  void free_host(void* ptr) override { std::free(ptr); }
  void* device_address_of_host(void* host) override { return host; }

  void join(EngineStream) override {
    if (side_stream_) graphs_.run([this] { run_forked(); });
  }
  void capture(const CaptureParams& p, EngineStream) override {
    fork([p] { capture_on_host(p); });
  }
  void commit(const CommitParams& p, CommitPlacement where, EngineStream) override {
    if (!side_stream_ || !(where.slots_on_host || where.rows_on_host)) {
      fork([p] { commit_and_release_on_host(p); });  // the CUDA backend's commit and release kernels
      return;
    }
    std::shared_ptr<std::vector<uint8_t>> slots, rows;
    if (where.slots_on_host) slots = copy_indices(p.dst_slots, p.count, p.dst_slots_elem);
    if (where.rows_on_host) rows = copy_indices(p.src_rows, p.count, p.src_rows_elem);
    fork([p, slots, rows] {
      CommitParams q = p;
      if (slots) q.dst_slots = slots->data();
      if (rows) q.src_rows = rows->data();
      commit_and_release_on_host(q);
    });
  }
  void gather(const GatherParams& p, EngineStream) override { gather_on_host(p); }
  void zero_device(void* ptr, size_t bytes, EngineStream) override {
    fork([ptr, bytes] { std::memset(ptr, 0, bytes); });
  }

  // A host wait orders the forked work, as the side stream's events would.
  bool commits_done(bool, const SlotList*, std::unique_lock<std::mutex>*) override {
    run_forked();
    return true;
  }
  void reads_done(const SlotList*) override {}
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
  // without copying it), zeroed. A block of a huge page or more starts on a
  // huge page and asks for huge pages (a hint; where THP is off it is
  // ignored): commits and reads touch rows at random all over a host cache
  // of hundreds of MB, and with 4 KB pages nearly every row is a TLB miss
  // (reads of cold slots take about 10 % longer).
  static void* allocate(size_t bytes) {
    constexpr size_t kHugePage = size_t{2} << 20;
    const size_t align = bytes >= kHugePage ? kHugePage : 64;
    const size_t rounded = (bytes + align - 1) / align * align;
    void* p = rounded < bytes ? nullptr : std::aligned_alloc(align, rounded == 0 ? align : rounded);
    if (p == nullptr) fail(MOECAP_ERROR_OUT_OF_MEMORY, "host backend: cannot allocate ", bytes, " bytes");
    if (align == kHugePage) madvise(p, rounded, MADV_HUGEPAGE);
    std::memset(p, 0, rounded == 0 ? align : rounded);
    return p;
  }

  // The model of the side stream: forked work runs at the join (or at a
  // host wait), never at the call, so a join the engine places after its
  // next write to what the work reads shows as wrong rows. In a recorded
  // graph the fork is recorded: each replay queues the work, and the
  // replay's join (moecap_graph_end records one) runs it.
  template <class Op>
  void fork(Op op) {
    if (!side_stream_) {
      graphs_.run(op);
      return;
    }
    graphs_.run([this, op] { forked_.emplace_back(op); });
  }
  void run_forked() {
    std::vector<std::function<void()>> ops;
    ops.swap(forked_);
    for (const auto& op : ops) op();
  }

  bool side_stream_;
  std::vector<std::function<void()>> forked_;
  HostGraphRecorder graphs_;
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(const Plan& plan) {
  return std::make_unique<HostBackend>((plan.config.flags & MOECAP_FLAG_SIDE_STREAM) != 0);
}

}  // namespace moecap
