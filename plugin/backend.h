/* SPDX-License-Identifier: Apache-2.0 */
// The small device interface both backends implement (docs/DESIGN.md §5). The
// capturer validates every argument first; a backend only executes.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>

#include "base/stream.h"
#include "graphs/backend_graph.h"
#include "graphs/kernel_params.h"
#include "moecap.h"
#include "plugin/plan.h"
#include "plugin/tensor_args.h"

namespace moecap {

// The calling thread's hold on its capturer's lock, for one call: a backend
// that blocks on the host (waiting for commits, reads, a snapshot entry or
// the engine's stream) releases it while it sleeps, so the engine's other
// threads go on meanwhile (an eager engine's per-layer capture must never
// wait for a monitoring thread's get_errors). Thread-local: each thread
// names only the lock it holds itself. After the wait the backend takes the
// lock again; what another thread did meanwhile is that thread's ordering.
class LockHold {
 public:
  explicit LockHold(std::unique_lock<std::mutex>* lock) : previous_(current_) {
    if (lock != nullptr) current_ = lock;
  }
  ~LockHold() { current_ = previous_; }
  LockHold(const LockHold&) = delete;
  LockHold& operator=(const LockHold&) = delete;
  // The lock to release while blocking, or nullptr (none held, or the caller keeps it).
  static std::unique_lock<std::mutex>* current() { return current_; }

 private:
  std::unique_lock<std::mutex>* previous_;
  static inline thread_local std::unique_lock<std::mutex>* current_ = nullptr;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // Where device buffers live, as DLPack reports it.
  virtual DLDevice device() const = 0;
  // Whether kernels may read a tensor on `d` directly.
  virtual bool kernel_can_read(DLDevice d) const = 0;
  // Whether the host may read a tensor on `d` now (at the call).
  // (Device types are compared as integers: see device_kind.)
  static bool host_can_read(const DLDevice& d) {
    const int32_t kind = device_kind(d);
    return kind == kDLCPU || kind == kDLCUDAHost;
  }

  // Allocation happens at create only. Memory comes back zeroed. The frees
  // never throw: they run from destructors, also at process exit.
  virtual void* alloc_device(size_t bytes) = 0;
  virtual void free_device(void* ptr) = 0;
  virtual void* alloc_host(size_t bytes) = 0;
  virtual void free_host(void* ptr) = 0;
  // The address kernels use for host memory from alloc_host.
  virtual void* device_address_of_host(void* host) = 0;

  // What a graph holding moecap's nodes keeps alive (the capturer): set once,
  // right after the capturer is made shared. Without it graphs keep nothing.
  virtual void set_owner(std::weak_ptr<void> owner) { (void)owner; }

  // Stream-ordered work; legal in graphs. With MOECAP_FLAG_SIDE_STREAM,
  // capture, commit and zero_device fork off `stream` onto moecap's side
  // stream and do not join back: join(stream) orders `stream` after every
  // forked operation so far (docs/DESIGN.md, "Capture off the critical path").
  virtual void join(EngineStream stream) = 0;
  virtual void capture(const CaptureParams& p, EngineStream stream) = 0;
  // How a commit's index tensors reach the kernel, and where it is enqueued.
  struct CommitPlacement {
    bool slots_on_host;  // host memory whose values the backend copies at the call (already checked)
    bool rows_on_host;
    bool in_graph;       // `stream` is being captured (by the engine or by moecap)
  };
  virtual void commit(const CommitParams& p, CommitPlacement where, EngineStream stream) = 0;
  virtual void zero_device(void* ptr, size_t bytes, EngineStream stream) = 0;
  // moecap_read into memory only kernels can write (device tensors), ordered
  // on `stream` after the commits that may write p.slots; p.slots is host
  // memory the backend copies at the call. Host outputs never come here.
  // Later commits and invalidations of those slots, and moecap graph
  // replays (order_after_reads), are ordered after it on their streams.
  virtual void gather(const GatherParams& p, EngineStream stream) = 0;
  // Orders `stream` after every read into device tensors enqueued so far
  // (before a moecap graph replay, whose commits may write those slots).
  virtual void order_after_reads(EngineStream stream) { (void)stream; }

  // Host indices (a read's or write's slots), to wait for only the work on them.
  struct SlotList {
    const void* data;
    int32_t elem;  // kI32 / kI64
    int64_t count;
  };

  // Host-side waits and copies (never legal in graphs).
  // Waits for (or, with block = false, polls) the commits enqueued so far
  // that may write `slots` (every commit when nullptr): eager commits to
  // other slots are not waited for; commits in graphs always are. A blocking
  // wait releases `unlock_while_waiting` (the capturer's lock, held by the
  // caller) while it sleeps, so the engine's other calls go on meanwhile.
  virtual bool commits_done(bool block, const SlotList* slots = nullptr,
                            std::unique_lock<std::mutex>* unlock_while_waiting = nullptr) = 0;
  // Waits until reads into device tensors enqueued so far no longer read
  // the host cache rows of `slots` (before the host writes them), or with
  // nullptr until every such read finished (before the cache is freed: a
  // read gathers from it on the engine's stream). Blocking waits here and
  // below release LockHold::current() while they sleep.
  virtual void reads_done(const SlotList* slots) = 0;
  // Waits until the captures and histogram resets enqueued outside graphs
  // on the engines' streams have run (CUDA: their kernels write device
  // memory, and no commit need follow them); where they ran at the call, a
  // no-op.
  virtual void launches_done() {}
  // The error counters; with clear, zeroed in the same atomic step, so
  // that increments by replays running meanwhile are read or kept.
  virtual ErrorWord take_errors(ErrorWord* counters, bool clear) = 0;
  virtual void copy_device_to_host(void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_host_to_device(void* dst, const void* src, size_t bytes) = 0;
  // Waits until the caller's stream finished what it enqueued so far.
  virtual void wait_stream(EngineStream stream) = 0;

  // Whether `stream` is being captured into a graph (by anyone).
  virtual bool stream_capturing(EngineStream stream) = 0;

  // Plugin-owned graphs: every operation until end_graph is recorded.
  virtual void begin_graph(EngineStream stream) = 0;
  virtual std::unique_ptr<BackendGraph> end_graph() = 0;
};

std::unique_ptr<Backend> make_host_backend(const Plan& plan);
// Throws NO_DEVICE / STUB_DRIVER / DRIVER_TOO_OLD / DRIVER as docs/DESIGN.md §5 says.
std::unique_ptr<Backend> make_cuda_backend(const Plan& plan);

}  // namespace moecap
