// SPDX-License-Identifier: Apache-2.0
// The CUDA backend: device buffers from cuMemAlloc, the host cache in
// portable, device-mapped pinned memory that the commit kernel writes
// directly, kernels from the embedded fatbin, all on the primary context of
// the configured device. Capture-path calls only launch on the given stream.
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "base/cuda_driver.h"
#include "base/cuda_owners.h"
#include "base/detached_work.h"
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

// A host-side call (a wait, copy or allocation): the backend's context
// current, and relaxed capture mode, so that it neither fails nor breaks a
// graph capture running on any thread.
class HostCallScope {
 public:
  HostCallScope(const Driver& d, CUcontext ctx) : context_(d, ctx), relaxed_(d) {}

 private:
  ContextScope context_;
  RelaxedCaptureScope relaxed_;
};

// Work on the host cache still in flight: an eager commit or a read into
// device tensors, with the slots it touches (sorted; all when every_slot).
// A read queued in pieces is listed from its first piece on, `growing`
// until its last is queued: its event is re-recorded after each piece, so
// retiring it early would hand the event to another call while it is in use.
struct InFlight {
  UniqueEvent event;
  std::vector<int64_t> slots;
  bool every_slot;
  bool growing = false;
};

// An event taken from the spare pool for one call goes back to the pool if
// the call fails before handing it on: another thread's host wait may still
// hold its handle from before it was retired, so it is never destroyed
// before the backend.
class ReturnedIfUnused {
 public:
  ReturnedIfUnused(std::vector<UniqueEvent>& pool, UniqueEvent& event) : pool_(pool), event_(event) {}
  ~ReturnedIfUnused() {
    if (!event_) return;
    try {
      pool_.push_back(std::move(event_));
    } catch (...) {
      static_cast<void>(event_.release());  // no room to keep it: leaked, never destroyed under a waiter
    }
  }
  ReturnedIfUnused(const ReturnedIfUnused&) = delete;
  ReturnedIfUnused& operator=(const ReturnedIfUnused&) = delete;

 private:
  std::vector<UniqueEvent>& pool_;
  UniqueEvent& event_;
};

std::vector<int64_t> sorted_slots(const Backend::SlotList& list) {
  std::vector<int64_t> v(static_cast<size_t>(list.count));
  for (int64_t i = 0; i < list.count; ++i) v[static_cast<size_t>(i)] = load_int(list.data, list.elem, i);
  std::sort(v.begin(), v.end());
  return v;
}

// Whether `f` touches any of `wanted` (sorted), or `wanted` is every slot.
bool touches(const InFlight& f, const std::vector<int64_t>* wanted) {
  if (f.every_slot || wanted == nullptr) return true;
  auto a = f.slots.begin();
  auto b = wanted->begin();
  while (a != f.slots.end() && b != wanted->end()) {
    if (*a == *b) return true;
    if (*a < *b) {
      ++a;
    } else {
      ++b;
    }
  }
  return false;
}

// Releases a held lock for a scope, taking it again after (also on a throw).
class Unlocked {
 public:
  explicit Unlocked(std::unique_lock<std::mutex>* lock) : lock_(lock) {
    if (lock_ != nullptr) lock_->unlock();
  }
  ~Unlocked() {
    if (lock_ != nullptr) lock_->lock();
  }
  Unlocked(const Unlocked&) = delete;
  Unlocked& operator=(const Unlocked&) = delete;

 private:
  std::unique_lock<std::mutex>* lock_;
};

// The events of the commits captured into one graph: each replay records
// them (external event nodes), and host reads wait for them. They live as
// long as the graph does, with every clone and exec of it: `graph_alive`
// goes false when the driver releases the graph's user object, and the
// backend then destroys them once their last records completed.
struct GraphCommits {
  std::vector<UniqueEvent> events;
  std::atomic<bool> graph_alive{true};
};

// What a graph holding moecap's nodes keeps through its user object: the
// capturer (its memory is baked into the nodes) and the graph's commit events.
struct GraphHold {
  std::shared_ptr<void> capturer;
  std::shared_ptr<GraphCommits> commits;
};

// The threads that free graph holds, process-wide, and the holds they could
// not take (no thread could be started, or the process is exiting), kept
// reachable until the process ends. First used by a backend's constructor,
// after cuInit, so its atexit handler runs before the driver's and the
// tools' exit handlers: exit waits for a capturer still being freed instead
// of tearing the driver down under it (a crash after main returned). Never
// destroyed: a release may outlive static destruction when the drain times out.
// It also keeps this library loaded for the rest of the process: a graph may
// release its hold after the engine dlclose()s moecap, and the driver then
// calls release_graph_hold, which must still be mapped.
struct GraphReleases {
  DetachedWork threads;
  std::mutex mu;
  std::vector<GraphHold*> kept;
  pid_t process = getpid();  // a forked child inherits the counts of threads it does not have
};
void drain_graph_releases();
void release_graph_hold(void* held) noexcept;
GraphReleases& graph_releases() {
  static GraphReleases* releases = [] {
    auto* r = new GraphReleases;
    std::atexit(drain_graph_releases);
    Dl_info self{};
    if (dladdr(reinterpret_cast<void*>(&release_graph_hold), &self) != 0 && self.dli_fname != nullptr) {
      static_cast<void>(dlopen(self.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE));  // never closed
    }
    return r;
  }();
  return *releases;
}
void drain_graph_releases() {
  GraphReleases& releases = graph_releases();
  if (releases.process == getpid()) releases.threads.drain(std::chrono::seconds(5));
}

// The user object's destructor. The driver calls it on its own thread, where
// no CUDA call is allowed: it only marks the graph gone, and the capturer
// (whose destruction frees driver memory) is released on a thread of moecap's.
// A hold no thread takes is kept, never freed during the driver's teardown,
// and no exception leaves the driver's C callback.
void release_graph_hold(void* held) noexcept {
  auto* hold = static_cast<GraphHold*>(held);
  hold->commits->graph_alive = false;
  GraphReleases& releases = graph_releases();
  if (releases.threads.run([hold] { delete hold; })) return;
  std::lock_guard<std::mutex> lock(releases.mu);
  try {
    releases.kept.push_back(hold);
  } catch (...) {  // out of memory as well: the hold is leaked
  }
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const Plan& plan)
      : d_(driver()), ordinal_(plan.config.device_id), side_((plan.config.flags & MOECAP_FLAG_SIDE_STREAM) != 0) {
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
    graph_releases();  // its exit handler goes after the driver's (tools' too): it runs before them
    HostCallScope scope(d_, ctx());
    CUmodule module = nullptr;
    check_module_load(d_, d_.cuModuleLoadData(&module, moecap_kernels_fatbin));
    module_ = UniqueModule(d_, ctx(), module);
    for (Kernel* k : {&capture_, &claim_, &commit_, &release_, &gather_, &take_errors_}) {
      check(d_, d_.cuModuleGetFunction(&k->fn, module_.get(), k->name), "cuModuleGetFunction");
    }
    CUstream internal = nullptr;
    check(d_, d_.cuStreamCreate(&internal, kStreamNonBlocking), "cuStreamCreate");
    internal_ = UniqueStream(d_, ctx(), internal);
    if (side_) {
      side_eager_ = create_stream();
      for (CaptureSide& c : capture_sides_) c.stream = create_stream();
      fork_event_ = create_event();
      join_event_ = create_event();
    }
    // Duplicate slots in commits whose slots only the device knows.
    claims_ = allocate_device(static_cast<size_t>(plan.config.host_slots) * sizeof(unsigned long long),
                              "cuMemAlloc (claims)");
    check(d_, d_.cuMemsetD8Async(claims_.get(), 0,
                                 static_cast<size_t>(plan.config.host_slots) * sizeof(unsigned long long),
                                 internal_.get()),
          "cuMemsetD8Async");
    // Index lists copied at the call: two lists of device_rows int64 per entry.
    snapshot_bytes_ = static_cast<size_t>(plan.device_rows) * 2 * sizeof(int64_t);
    snapshot_memory_ = allocate_pinned(snapshot_bytes_ * kSnapshots + sizeof(ErrorWord), "cuMemHostAlloc (snapshots)");
    snapshot_device_ = static_cast<uint8_t*>(device_address(snapshot_memory_.get()));
    for (Snapshot& e : snapshots_) e.done = create_event();
    check(d_, d_.cuStreamSynchronize(internal_.get()), "cuStreamSynchronize");
#endif
  }

  ~CudaBackend() override {
    try {
      HostCallScope scope(d_, ctx());
      d_.cuStreamSynchronize(internal_.get());
      if (side_) d_.cuStreamSynchronize(side_eager_.get());
    } catch (...) {
      // At process exit the driver may be gone; the owners below skip what they cannot free.
    }
  }

  void set_owner(std::weak_ptr<void> owner) override { owner_ = std::move(owner); }

  DLDevice device() const override { return DLDevice{kDLCUDA, ordinal_}; }
  bool kernel_can_read(DLDevice d) const override {
    const int32_t kind = device_kind(d);  // an integer: never a DLDeviceType load
    return ((kind == kDLCUDA || kind == kDLCUDAManaged) && d.device_id == ordinal_) || kind == kDLCUDAHost;
  }

  void* alloc_device(size_t bytes) override {
    HostCallScope scope(d_, ctx());
    UniqueDeviceMemory p = allocate_device(bytes == 0 ? 1 : bytes, "cuMemAlloc");
    check(d_, d_.cuMemsetD8Async(p.get(), 0, bytes, internal_.get()), "cuMemsetD8Async");
    check(d_, d_.cuStreamSynchronize(internal_.get()), "cuStreamSynchronize");
    return reinterpret_cast<void*>(p.release());
  }
  // The owners free in the backend's context and never throw (see cuda_owners.h);
  // relaxed, so that a free never breaks a capture on another thread.
  void free_device(void* ptr) override {
    RelaxedCaptureScope relaxed(d_);
    UniqueDeviceMemory(d_, ctx(), reinterpret_cast<CUdeviceptr>(ptr)).reset();
  }
  void* alloc_host(size_t bytes) override {
    HostCallScope scope(d_, ctx());
    UniquePinnedMemory p = allocate_pinned(bytes == 0 ? 1 : bytes, "cuMemHostAlloc");
    std::memset(p.get(), 0, bytes);
    return p.release();
  }
  void free_host(void* ptr) override {
    RelaxedCaptureScope relaxed(d_);
    UniquePinnedMemory(d_, ctx(), ptr).reset();
  }
  void* device_address_of_host(void* host) override {
    HostCallScope scope(d_, ctx());
    return device_address(host);
  }

  void join(EngineStream stream) override {
    if (!side_) return;
    ContextScope scope(d_, ctx());
    const CUstream engine = cu_stream(stream);
    CUstream side = nullptr;
    if (const uint64_t id = capture_id(engine)) {
      // Only a branch of this capture can join it; none forked, nothing to join.
      for (CaptureSide& c : capture_sides_) {
        if (c.capture_id == id && c.forked) side = c.stream.get();
        if (side != nullptr) {
          c.forked = false;
          break;
        }
      }
    } else if (eager_forked_) {
      side = side_eager_.get();
    }
    if (side == nullptr) return;
    check(d_, d_.cuEventRecord(join_event_.get(), side), "cuEventRecord (join)");
    check(d_, d_.cuStreamWaitEvent(engine, join_event_.get(), 0), "cuStreamWaitEvent (join)");
  }

  void capture(const CaptureParams& p, EngineStream stream) override {
    ContextScope scope(d_, ctx());
    EagerFence* fence = nullptr;
    const CUstream s = enqueue_stream(stream, &fence);
    // At least one block: a zero-row capture still stamps its layer.
    launch(capture_, p, std::max<int64_t>(1, p.n * p.top_k), s);
    record_fence(fence, "cuEventRecord (capture)");
  }

  void commit(const CommitParams& p, CommitPlacement where, EngineStream stream) override {
    HostCallScope scope(d_, ctx());
    GraphCommits* graph_commits = keep_owner_in_capture(cu_stream(stream));
    const CUstream s = fork(cu_stream(stream));
    if (where.in_graph) {
      CommitParams params = p;
      params.claims = reinterpret_cast<unsigned long long*>(claims_.get());
      launch_commit(params, s);
      // A plain record in a capture is only an edge inside the graph; an
      // external one is a node every replay performs. Each captured commit
      // has its own event, so that eager commits never re-record it: read
      // then waits for the latest replay of every graph.
      UniqueEvent e = create_event();
      check(d_, d_.cuEventRecordWithFlags(e.get(), s, kEventRecordExternal), "cuEventRecordWithFlags (commit)");
      graph_commits->events.push_back(std::move(e));
      return;
    }
    retire(commits_);
    CommitParams params = p;
    InFlight done{take_event(), {}, !where.slots_on_host};
    const ReturnedIfUnused loan(spare_, done.event);
    // The slots it writes, for the reads into device tensors it must follow.
    if (where.slots_on_host) done.slots = sorted_slots(SlotList{p.dst_slots, p.dst_slots_elem, p.count});
    Snapshot* snap = where.rows_on_host || where.slots_on_host ? &next_snapshot(cu_stream(stream)) : nullptr;
    size_t at = 0;
    if (where.rows_on_host) params.src_rows = copy_in(*snap, at, p.src_rows, p.count, p.src_rows_elem);
    // A slot listed twice keeps the last entry whose slot and row are in
    // range (the host twin's order): duplicates can be dropped at the call
    // only where every row is known to be in range now (a range, host rows,
    // an invalidation); rows only the device knows take the claim pass.
    const bool rows_known = p.mode == kInvalidate || p.src_rows == nullptr || where.rows_on_host;
    if (where.slots_on_host) snapshot_slots(*snap, at, p, params, rows_known);
    if (!where.slots_on_host || !rows_known) params.claims = reinterpret_cast<unsigned long long*>(claims_.get());
    // A read into device tensors enqueued before this call gathers these
    // slots' rows on its stream: the new rows land after it.
    wait_for_reads(s, done.every_slot ? nullptr : &done.slots);
    try {
      launch_commit(params, s);
    } catch (...) {
      // Part of it may be queued (the claim pass, the commit kernel): the
      // snapshot entry stays in use and host waits cover it, as for a commit.
      if (snap != nullptr) d_.cuEventRecord(snap->done.get(), s);
      if (d_.cuEventRecord(done.event.get(), s) == kSuccess) commits_.push_back(std::move(done));
      throw;
    }
    // The commit is queued: tracked even where marking it fails, so later reads and destroy still wait.
    const CUresult marked = snap != nullptr ? d_.cuEventRecord(snap->done.get(), s) : kSuccess;
    const CUresult recorded = d_.cuEventRecord(done.event.get(), s);
    if (recorded == kSuccess) commits_.push_back(std::move(done));
    check(d_, marked, "cuEventRecord (snapshot)");
    check(d_, recorded, "cuEventRecord (commit)");
  }

  void gather(const GatherParams& p, EngineStream stream) override {
    HostCallScope scope(d_, ctx());
    const CUstream s = cu_stream(stream);
    InFlight pending{{}, sorted_slots(SlotList{p.slots, p.slots_elem, p.count}), false};
    // A snapshot entry holds 2 * device_rows slots; longer requests go in pieces.
    const int64_t per_piece = static_cast<int64_t>(snapshot_bytes_ / sizeof(int64_t));
    const int64_t slot_bytes = elem_bytes(p.slots_elem);
    const int64_t id_row = p.row_elements * elem_bytes(p.dst_id_elem);
    const int64_t w_row = p.dst_weights ? p.row_elements * elem_bytes(p.dst_weight_elem) : 0;
    retire(reads_);
    pending.event = take_event();
    pending.growing = true;
    {
      const ReturnedIfUnused loan(spare_, pending.event);
      reads_.push_back(std::move(pending));  // leaves `pending` as it was if it throws
    }
    // Listed before its first piece (its event not yet recorded: nothing to
    // wait for), so that a commit another thread makes while a piece waits
    // for a snapshot entry (next_snapshot releases the lock) is queued after
    // the pieces queued so far, and that piece waits for the commit: each
    // slot's row is gathered whole before or after it, never during. A
    // deque's elements stay where they are as others come and go.
    InFlight& read = reads_.back();
    Snapshot* unrecorded = nullptr;  // a queued piece whose snapshot entry is not yet marked in use
    bool unmarked = false;           // a queued piece the read's event does not yet cover
    try {
      for (int64_t first = 0; first < p.count; first += per_piece) {
        GatherParams piece = p;
        piece.count = std::min(per_piece, p.count - first);
        Snapshot& snap = next_snapshot(s);
        // Ordered after the commits that may write these rows, on the stream: the host does not wait.
        wait_for_commits(s, read.slots);
        size_t at = 0;
        piece.slots = copy_in(snap, at, static_cast<const uint8_t*>(p.slots) + first * slot_bytes, piece.count,
                              p.slots_elem);
        piece.dst_ids = static_cast<uint8_t*>(p.dst_ids) + first * id_row;
        if (p.dst_weights) piece.dst_weights = static_cast<uint8_t*>(p.dst_weights) + first * w_row;
        launch(gather_, piece, piece.count * p.row_elements, s);
        unmarked = true;
        unrecorded = &snap;
        check(d_, d_.cuEventRecord(snap.done.get(), s), "cuEventRecord (snapshot)");
        unrecorded = nullptr;
        check(d_, d_.cuEventRecord(read.event.get(), s), "cuEventRecord (read)");
        unmarked = false;
      }
    } catch (...) {
      // The pieces already queued read the host cache and their snapshot
      // entries: later commits to these slots and destroy wait for them, as
      // for a read that finished queuing.
      // (Only what is not yet marked: a record on `s` once another thread
      // began capturing it would be a node of that graph.)
      if (unrecorded != nullptr) d_.cuEventRecord(unrecorded->done.get(), s);
      if (unmarked) d_.cuEventRecord(read.event.get(), s);
      read.growing = false;
      throw;
    }
    read.growing = false;
  }

  void order_after_reads(EngineStream stream) override {
    HostCallScope scope(d_, ctx());
    const CUstream s = cu_stream(stream);
    if (capture_id(s) != 0) return;  // a launch into a capture is refused by the driver anyway
    wait_for_reads(s, nullptr);
  }

  void zero_device(void* ptr, size_t bytes, EngineStream stream) override {
    ContextScope scope(d_, ctx());
    EagerFence* fence = nullptr;
    const CUstream s = enqueue_stream(stream, &fence);
    check(d_, d_.cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(ptr), 0, bytes, s), "cuMemsetD8Async");
    record_fence(fence, "cuEventRecord (histogram reset)");
  }

  bool commits_done(bool block, const SlotList* slots, std::unique_lock<std::mutex>* unlock_while_waiting) override {
    HostCallScope scope(d_, ctx());
    std::vector<int64_t> wanted;
    if (slots != nullptr) wanted = sorted_slots(*slots);
    const std::vector<int64_t>* filter = slots != nullptr ? &wanted : nullptr;
    forget_gone_graphs();
    std::vector<CUevent> waits;
    // Held while waiting: a graph dropped meanwhile keeps its events until then.
    const std::vector<std::shared_ptr<GraphCommits>> graphs = graph_commits_;
    for (const auto& g : graphs) {
      for (const UniqueEvent& e : g->events) waits.push_back(e.get());
    }
    for (const InFlight& f : commits_) {
      if (touches(f, filter)) waits.push_back(f.event.get());
    }
    if (!block) {
      for (CUevent e : waits) {
        if (!finished(e, false)) return false;
      }
    } else {
      // Without the capturer's lock: another thread may retire and re-record
      // the eager events meanwhile (a later record: a longer wait, never a
      // shorter one); they are destroyed only with the backend.
      Unlocked unlocked(unlock_while_waiting != nullptr ? unlock_while_waiting : LockHold::current());
      for (CUevent e : waits) finished(e, true);
      // Everything (synchronize, destroy): forked captures too, not only commits.
      if (side_ && slots == nullptr) check(d_, d_.cuStreamSynchronize(side_eager_.get()), "cuStreamSynchronize");
    }
    retire(commits_);
    return true;
  }

  void launches_done() override {
    HostCallScope scope(d_, ctx());
    std::vector<CUevent> waits;
    for (const EagerFence& f : eager_fences_) waits.push_back(f.event.get());
    Unlocked unlocked(LockHold::current());  // fence events are destroyed only with the backend
    for (CUevent e : waits) finished(e, true);
  }

  void reads_done(const SlotList* slots) override {
    HostCallScope scope(d_, ctx());
    std::vector<int64_t> wanted;
    if (slots != nullptr) wanted = sorted_slots(*slots);
    std::vector<CUevent> waits;
    for (const InFlight& f : reads_) {
      if (touches(f, slots != nullptr ? &wanted : nullptr)) waits.push_back(f.event.get());
    }
    {
      // Read events are retired to the spare pool, never destroyed before the backend.
      Unlocked unlocked(LockHold::current());
      for (CUevent e : waits) finished(e, true);
    }
    retire(reads_);
  }

  // The three calls below wait for moecap's own stream, which a forward
  // saturating the GPU can hold up: without the capturer's lock, so that a
  // monitor's get_errors (or a read's check of the counters) never stalls
  // another thread's captures. What they copy into is the caller's, but for
  // take_errors' one readout word, which its callers take turns on.
  ErrorWord take_errors(ErrorWord* counters, bool clear) override {
    HostCallScope scope(d_, ctx());
    const Unlocked unlocked(LockHold::current());
    const std::lock_guard<std::mutex> turn(readout_mutex_);
    ErrorWord* out = reinterpret_cast<ErrorWord*>(snapshot_host() + snapshot_bytes_ * kSnapshots);
    if (clear) {
      TakeErrorsParams p{counters, reinterpret_cast<ErrorWord*>(snapshot_device_ + snapshot_bytes_ * kSnapshots)};
      launch(take_errors_, p, 1, internal_.get());
    } else {
      check(d_, d_.cuMemcpyDtoHAsync(out, reinterpret_cast<CUdeviceptr>(counters), sizeof *out, internal_.get()),
            "cuMemcpyDtoHAsync");
    }
    check(d_, d_.cuStreamSynchronize(internal_.get()), "cuStreamSynchronize");
    return *out;
  }

  void copy_device_to_host(void* dst, const void* src, size_t bytes) override {
    HostCallScope scope(d_, ctx());
    const Unlocked unlocked(LockHold::current());
    check(d_, d_.cuMemcpyDtoHAsync(dst, reinterpret_cast<CUdeviceptr>(src), bytes, internal_.get()),
          "cuMemcpyDtoHAsync");
    check(d_, d_.cuStreamSynchronize(internal_.get()), "cuStreamSynchronize");
  }
  void copy_host_to_device(void* dst, const void* src, size_t bytes) override {
    HostCallScope scope(d_, ctx());
    const Unlocked unlocked(LockHold::current());
    check(d_, d_.cuMemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(dst), src, bytes, internal_.get()),
          "cuMemcpyHtoDAsync");
    check(d_, d_.cuStreamSynchronize(internal_.get()), "cuStreamSynchronize");
  }

  void wait_stream(EngineStream stream) override {
    HostCallScope scope(d_, ctx());
    Unlocked unlocked(LockHold::current());
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
    std::unique_ptr<BackendGraph> graph = cuda::end_graph(d_, ctx(), recording_);
    recording_ = nullptr;
    return graph;
  }

 private:
  static constexpr size_t kSnapshots = 8;
  // Side streams for captures in progress at once (the engine's, moecap's);
  // a capture finding none free runs its work on its own stream.
  static constexpr size_t kCaptureSides = 4;

  // A side stream lent to one capture: it joins that capture at its first
  // fork and leaves it when the capture ends.
  struct CaptureSide {
    UniqueStream stream;
    uint64_t capture_id = 0;
    bool forked = false;  // forked since its last join
  };

  // An engine stream's fence (eager_fence).
  struct EagerFence {
    CUstream stream;
    std::thread::id thread;  // CU_STREAM_PER_THREAD's: the thread whose stream it is
    UniqueEvent event;
  };

  // A pinned entry for the index lists of one call, reused once the event
  // recorded behind the call's kernel has completed.
  struct Snapshot {
    UniqueEvent done;
    bool used = false;
    uint8_t* host = nullptr;
  };

  CUcontext ctx() const { return ctx_.get(); }
  uint8_t* snapshot_host() const { return static_cast<uint8_t*>(snapshot_memory_.get()); }

  UniqueStream create_stream() {
    CUstream s = nullptr;
    check(d_, d_.cuStreamCreate(&s, kStreamNonBlocking), "cuStreamCreate");
    return UniqueStream(d_, ctx(), s);
  }

  // The capture `s` takes part in: its id (0 if none) and the graph being built.
  struct CaptureInfo {
    uint64_t id = 0;
    CUgraph graph = nullptr;
  };
  CaptureInfo capture_info(CUstream s) {
    int status = kCaptureStatusNone;
    CaptureInfo info;
    // No dependencies asked for: where the capture's current edges carry data
    // (a programmatic launch), asking for the nodes without it is a lossy
    // query, which the driver refuses (CUDA_ERROR_LOSSY_QUERY).
    check(d_, d_.cuStreamGetCaptureInfo(s, &status, &info.id, &info.graph, nullptr, nullptr), "cuStreamGetCaptureInfo");
    return status == kCaptureStatusActive ? info : CaptureInfo{};
  }
  uint64_t capture_id(CUstream s) { return capture_info(s).id; }

  // Where forked work goes: with MOECAP_FLAG_SIDE_STREAM, a side stream made
  // to wait for what `engine` holds so far (an event record and a wait; in a
  // capture, a fork edge); otherwise `engine` itself.
  CUstream fork(CUstream engine) {
    if (!side_) return engine;
    CUstream side = nullptr;
    if (const uint64_t id = capture_id(engine)) {
      CaptureSide* lent = nullptr;
      for (CaptureSide& c : capture_sides_) {
        if (c.capture_id == id) lent = &c;
      }
      for (CaptureSide& c : capture_sides_) {
        if (lent != nullptr) break;
        int status = kCaptureStatusNone;
        check(d_, d_.cuStreamIsCapturing(c.stream.get(), &status), "cuStreamIsCapturing");
        if (status == kCaptureStatusNone) {
          lent = &c;
          lent->capture_id = id;
          lent->forked = false;
        }
      }
      if (lent == nullptr) return engine;
      lent->forked = true;
      side = lent->stream.get();
    } else {
      side = side_eager_.get();
      eager_forked_ = true;
    }
    check(d_, d_.cuEventRecord(fork_event_.get(), engine), "cuEventRecord (fork)");
    check(d_, d_.cuStreamWaitEvent(side, fork_event_.get(), 0), "cuStreamWaitEvent (fork)");
    return side;
  }

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

  // With claims: claim, commit, release, in stream order (8 bytes of device
  // memory per host slot). The claims' serial is one per capturer, bumped by
  // every release: commits must be ordered with each other, as steps require
  // (moecap_capture, "Steps"); a release on an unjoined stream between this
  // commit's claim and commit kernels would make its entries lose their claims.
  // Invalidations take no claims: emptying a slot twice is emptying it once.
  // The release kernel consumes a commit's rows, one thread per element.
  // An empty commit of rows runs the release kernel alone, one block: it
  // only ends the step (finish_commit).
  // A launch the driver refuses after the claim pass withdraws the claims
  // (a one-block release that consumes nothing and ends no step, only bumps
  // the serial), so that they never outrank a later commit's.
  void launch_commit(const CommitParams& given, CUstream s) {
    CommitParams p = given;
    if (p.mode == kInvalidate) p.claims = nullptr;
    const bool claimed = p.count > 0 && p.claims != nullptr;
    if (claimed) launch(claim_, p, p.count, s);
    try {
      if (p.count > 0) launch(commit_, p, p.count, s);
      if (p.mode == kCommitRows) {
        launch(release_, p, std::max<int64_t>(1, static_cast<int64_t>(p.num_layers) * p.count * p.top_k), s);
      }
    } catch (...) {
      if (claimed) {
        CommitParams withdraw = p;
        withdraw.mode = kInvalidate;
        withdraw.count = 0;
        try {
          launch(release_, withdraw, 1, s);
        } catch (...) {
          // A driver refusing this too refuses every later commit's launch.
        }
      }
      throw;
    }
  }

  // Needs the context current.
  UniqueDeviceMemory allocate_device(size_t bytes, const char* what) {
    CUdeviceptr p = 0;
    check(d_, d_.cuMemAlloc(&p, bytes), what);
    return UniqueDeviceMemory(d_, ctx(), p);
  }
  UniquePinnedMemory allocate_pinned(size_t bytes, const char* what) {
    void* p = nullptr;
    check(d_, d_.cuMemHostAlloc(&p, bytes, kMemHostAllocPortable | kMemHostAllocDeviceMap), what);
    return UniquePinnedMemory(d_, ctx(), p);
  }
  void* device_address(void* host) {
    CUdeviceptr p = 0;
    check(d_, d_.cuMemHostGetDevicePointer(&p, host, 0), "cuMemHostGetDevicePointer");
    return reinterpret_cast<void*>(p);
  }
  // Host waits on these block the thread instead of spinning.
  UniqueEvent create_event() {
    CUevent e = nullptr;
    check(d_, d_.cuEventCreate(&e, kEventBlockingSync | kEventDisableTiming), "cuEventCreate");
    return UniqueEvent(d_, ctx(), e);
  }
  UniqueEvent take_event() {
    if (spare_.empty()) return create_event();
    UniqueEvent e = std::move(spare_.back());
    spare_.pop_back();
    return e;
  }

  // Where a capture or histogram reset enqueues: the engine's stream, or a
  // side stream forked from it; in a capture the graph takes its reference.
  // *fence is the engine stream's fence where the launch is eager and on
  // that stream (record_fence after it), else nullptr.
  CUstream enqueue_stream(EngineStream stream, EagerFence** fence) {
    const CUstream engine = cu_stream(stream);
    const bool in_capture = keep_owner_in_capture(engine) != nullptr;
    const CUstream s = fork(engine);
    *fence = !in_capture && s == engine ? &eager_fence(engine) : nullptr;
    return s;
  }
  void record_fence(EagerFence* fence, const char* what) {
    if (fence != nullptr) check(d_, d_.cuEventRecord(fence->event.get(), fence->stream), what);
  }

  // The fence of engine stream `s`: an event the caller records behind each
  // eager launch there (capture, histogram reset) that writes moecap's
  // memory with no commit need follow, so that destroy waits for it before
  // that memory is freed. Taken before the launch: a failure here launches
  // nothing. One per stream (per thread for CU_STREAM_PER_THREAD, one handle
  // for each thread's own stream); an entry whose record completed serves
  // the next new stream, so the list stays as long as the streams in use at
  // once. Never destroyed before the backend: a host wait may hold its handle.
  EagerFence& eager_fence(CUstream s) {
    const bool per_thread = reinterpret_cast<uintptr_t>(s) == kStreamPerThreadHandle;
    const std::thread::id thread = per_thread ? std::this_thread::get_id() : std::thread::id();
    for (EagerFence& f : eager_fences_) {
      if (f.stream == s && f.thread == thread) return f;
    }
    // A stream seen for the first time: an event query is a potentially
    // unsafe call, relaxed so that it never breaks another thread's capture.
    RelaxedCaptureScope relaxed(d_);
    EagerFence* fence = nullptr;
    for (EagerFence& f : eager_fences_) {
      if (finished(f.event.get(), false)) {
        fence = &f;
        break;
      }
    }
    if (fence == nullptr) fence = &eager_fences_.emplace_back(EagerFence{nullptr, {}, create_event()});
    fence->stream = s;
    fence->thread = thread;
    return *fence;
  }

  // Whether `e`'s latest record has completed; with block, waits until it has.
  bool finished(CUevent e, bool block) {
    if (block) {
      check(d_, d_.cuEventSynchronize(e), "cuEventSynchronize");
      return true;
    }
    const CUresult r = d_.cuEventQuery(e);
    if (r == kErrorNotReady) return false;
    check(d_, r, "cuEventQuery");
    return true;
  }
  // Returns the events of completed work, oldest first, to the spare pool.
  void retire(std::deque<InFlight>& list) {
    while (!list.empty() && !list.front().growing && finished(list.front().event.get(), false)) {
      spare_.push_back(std::move(list.front().event));
      list.pop_front();
    }
  }

  // The next ring entry, once the call that used it last has completed, for
  // eager work to queue on `queued_on`. The wait releases the capturer's
  // lock; other calls may take entries meanwhile, so the ring is looked at
  // again after it, and another thread may have begun capturing `queued_on`
  // (as it may while a read copies the error counters): what the call
  // queued then would be that graph's nodes, never run at the call, and its
  // events records inside the capture. Refused, with no entry taken.
  Snapshot& next_snapshot(CUstream queued_on) {
    for (;;) {
      Snapshot& e = snapshots_[next_snapshot_];
      if (!e.used || finished(e.done.get(), false)) {
        if (capture_id(queued_on) != 0) {
          fail(MOECAP_ERROR_CAPTURE_ILLEGAL, "the call's stream began a graph capture while the call waited "
               "without moecap's lock (for the error counters or a snapshot entry); nothing more was queued");
        }
        e.host = snapshot_host() + next_snapshot_ * snapshot_bytes_;
        next_snapshot_ = (next_snapshot_ + 1) % kSnapshots;
        e.used = true;
        return e;
      }
      Unlocked unlocked(LockHold::current());
      finished(e.done.get(), true);  // re-recorded meanwhile: a longer wait; destroyed only with the backend
    }
  }

  // Destroys the events of graphs the driver released, once their last
  // replays' records completed (a released exec may still be running).
  void forget_gone_graphs() {
    auto gone = [&](const std::shared_ptr<GraphCommits>& g) {
      if (g->graph_alive) return false;
      for (const UniqueEvent& e : g->events) {
        if (!finished(e.get(), false)) return false;
      }
      return true;
    };
    graph_commits_.erase(std::remove_if(graph_commits_.begin(), graph_commits_.end(), gone), graph_commits_.end());
  }
  // Copies `count` host indices into `snap` at `at`; returns their device address.
  const void* copy_in(Snapshot& snap, size_t& at, const void* host, int64_t count, int32_t elem) {
    const size_t bytes = static_cast<size_t>(count * elem_bytes(elem));
    std::memcpy(snap.host + at, host, bytes);
    const void* device = snapshot_device_ + (snap.host - snapshot_host()) + at;
    at += (bytes + 7) / 8 * 8;
    return device;
  }

  // Copies a commit's host slots into `snap` at `at` as int64 and points
  // `params` at them; with drop_duplicates, each earlier duplicate becomes
  // -1, so that the last entry wins without a claim pass.
  void snapshot_slots(Snapshot& snap, size_t at, const CommitParams& p, CommitParams& params, bool drop_duplicates) {
    int64_t* slots = reinterpret_cast<int64_t*>(snap.host + at);
    params.dst_slots = snapshot_device_ + (snap.host - snapshot_host()) + at;
    params.dst_slots_elem = kI64;
    std::vector<std::pair<int64_t, int64_t>> order(static_cast<size_t>(p.count));
    for (int64_t j = 0; j < p.count; ++j) {
      slots[j] = load_int(p.dst_slots, p.dst_slots_elem, j);
      order[static_cast<size_t>(j)] = {slots[j], j};
    }
    if (!drop_duplicates) return;
    std::sort(order.begin(), order.end());
    for (size_t i = 0; i + 1 < order.size(); ++i) {
      if (order[i + 1].first == order[i].first) slots[order[i].second] = -1;
    }
  }

  // `s` waits (on the device) for the eager commits that write any of
  // `slots` and for every graph's latest commits: the host does not wait.
  void wait_for_commits(CUstream s, const std::vector<int64_t>& slots) {
    for (const InFlight& f : commits_) {
      if (touches(f, &slots)) check(d_, d_.cuStreamWaitEvent(s, f.event.get(), 0), "cuStreamWaitEvent");
    }
    forget_gone_graphs();
    for (const auto& g : graph_commits_) {
      for (const UniqueEvent& e : g->events) check(d_, d_.cuStreamWaitEvent(s, e.get(), 0), "cuStreamWaitEvent");
    }
  }

  // `s` waits (on the device) for the reads into device tensors that gather
  // any of `slots` (all when nullptr). Never in a capture: a replay cannot
  // wait for an eager event; moecap_graph_launch orders the replay instead.
  void wait_for_reads(CUstream s, const std::vector<int64_t>* slots) {
    retire(reads_);
    for (const InFlight& f : reads_) {
      if (touches(f, slots)) check(d_, d_.cuStreamWaitEvent(s, f.event.get(), 0), "cuStreamWaitEvent (read)");
    }
  }

  // Inside a stream capture (the engine's or moecap's), the graph being
  // built takes a reference to the capturer and to the events of its
  // commits, once per capture. Returns those events' holder (nullptr
  // outside a capture).
  GraphCommits* keep_owner_in_capture(CUstream s) {
    const auto [id, graph] = capture_info(s);
    if (id == 0) return nullptr;
    if (id == kept_in_capture_) return kept_commits_.get();
    auto* held = new GraphHold{owner_.lock(), std::make_shared<GraphCommits>()};
    CUuserObject object = nullptr;
    CUresult r = d_.cuUserObjectCreate(&object, held, &release_graph_hold, 1, kUserObjectNoDestructorSync);
    if (r != kSuccess) {
      delete held;
      check(d_, r, "cuUserObjectCreate");
    }
    // From here the driver owns `held` (once the graph holds the object, a
    // thread ending the capture may free it): only `commits` is used after.
    std::shared_ptr<GraphCommits> commits = held->commits;
    graph_commits_.push_back(commits);
    r = d_.cuGraphRetainUserObject(graph, object, 1, kGraphUserObjectMove);
    if (r != kSuccess) {
      d_.cuUserObjectRelease(object, 1);
      check(d_, r, "cuGraphRetainUserObject");
    }
    kept_in_capture_ = id;
    kept_commits_ = std::move(commits);
    return kept_commits_.get();
  }

  const Driver& d_;
  int ordinal_;
  bool side_;  // MOECAP_FLAG_SIDE_STREAM
  std::weak_ptr<void> owner_;
  uint64_t kept_in_capture_ = 0;                 // the capture that last took a reference
  std::shared_ptr<GraphCommits> kept_commits_;  // ... and its commits' events
  // Owners are destroyed in reverse order: the primary context goes last.
  PrimaryContext ctx_;
  UniqueModule module_;
  Kernel capture_{"moecap_capture_kernel", 256, "cuLaunchKernel (capture)"};
  Kernel claim_{"moecap_claim_kernel", 256, "cuLaunchKernel (claim)"};
  Kernel commit_{"moecap_commit_kernel", 8, "cuLaunchKernel (commit)"};  // a warp per row, 8 warps a block
  Kernel release_{"moecap_release_kernel", 256, "cuLaunchKernel (release)"};
  Kernel gather_{"moecap_gather_kernel", 256, "cuLaunchKernel (gather)"};
  Kernel take_errors_{"moecap_take_errors_kernel", 1, "cuLaunchKernel (take errors)"};
  UniqueStream internal_;
  UniqueDeviceMemory claims_;
  UniquePinnedMemory snapshot_memory_;  // kSnapshots entries, then the error readout
  std::mutex readout_mutex_;             // the error readout's user (take_errors, without the capturer's lock)
  uint8_t* snapshot_device_ = nullptr;
  size_t snapshot_bytes_ = 0;
  std::array<Snapshot, kSnapshots> snapshots_;
  size_t next_snapshot_ = 0;
  std::deque<InFlight> commits_;
  std::deque<InFlight> reads_;
  // Per capture, the events of its commits; the last is the capture kept_in_capture_ names.
  std::vector<std::shared_ptr<GraphCommits>> graph_commits_;
  std::vector<UniqueEvent> spare_;
  std::vector<EagerFence> eager_fences_;
  CUstream recording_ = nullptr;
  UniqueStream side_eager_;  // forks from streams not being captured
  std::array<CaptureSide, kCaptureSides> capture_sides_;
  bool eager_forked_ = false;  // side_eager_ ever forked to: joins wait for it
  UniqueEvent fork_event_;     // re-recorded at every fork: a wait takes the latest record
  UniqueEvent join_event_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const Plan& plan) { return std::make_unique<CudaBackend>(plan); }

}  // namespace moecap
