// SPDX-License-Identifier: Apache-2.0
// The stand-in CUDA driver; standin.h says what it models and what not.
#include "tests/cuda_standin/standin.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "graphs/kernel_ops.h"
#include "graphs/kernel_params.h"

namespace standin_impl {

using CUresult = int;
constexpr CUresult kOk = 0, kInvalidValue = 1, kOutOfMemory = 2, kInvalidHandle = 400, kIllegalState = 401,
                   kNotFound = 500, kNotReady = 600, kNotPermitted = 800, kCaptureUnsupported = 900,
                   kCaptureInvalidated = 901, kCaptureUnjoined = 904, kCaptureIsolation = 905,
                   kCaptureWrongThread = 908;
constexpr int kModeGlobal = 0, kModeRelaxed = 2;
constexpr unsigned kEventBlockingSync = 0x1, kRecordExternal = 0x1, kGraphUserObjectMove = 0x1;

struct Stream;
struct Event;
struct Graph;
struct Launch;
// What an asynchronous call does to the stream it lands on: queue work (or,
// for an event record, note where). Captured, it becomes a graph node and
// does the same at every launch.
using Action = std::function<void(Stream&)>;

// A graph node: what it does at a launch, on its lane. Lane 0 is the
// capture's origin stream; a stream that joins the capture (by waiting on an
// event recorded in it) adds a lane, a branch of the graph. At each launch a
// branch gets a queue of its own, which runs only when a join (a wait on an
// event recorded on it) or a host wait orders it.
struct LaneNode {
  int lane;
  std::function<void(Launch&)> run;
};

struct Capture {
  std::shared_ptr<Graph> graph;
  int mode;
  std::thread::id thread;
  uint64_t id;
  bool invalidated = false;
  std::vector<Stream*> lanes;       // [0] the origin; then the streams that joined
  std::vector<size_t> lane_nodes;   // nodes queued on each lane
  std::vector<size_t> lane_joined;  // of those, how many lane 0 waits for
};
uint64_t g_next_mark = 1;
uint64_t g_next_capture_id = 1;

struct Stream {
  std::deque<std::function<void()>> queue;
  uint64_t enqueued = 0;  // operations ever queued; the sequence number of the last
  uint64_t done = 0;
  std::unique_ptr<Capture> capture;  // a capture begun on this stream
  Capture* joined = nullptr;         // a capture this stream joined as a branch
  int lane = 0;                      // its lane there
  uint64_t push(std::function<void()> op) {
    queue.push_back(std::move(op));
    return ++enqueued;
  }
};

struct Event {
  unsigned flags;
  Stream* stream = nullptr;  // the latest record, or none
  uint64_t seq = 0;
  Capture* captured_in = nullptr;  // the latest record was a plain record in this capture
  int lane = 0;                    // ... on this lane, after this many of its nodes,
  size_t lane_nodes = 0;
  uint64_t mark = 0;               // ... named by this mark at each launch
};

struct UserObject {
  void* ptr;
  void (*destroy)(void*);
  int64_t refs;
};

struct Graph {
  std::vector<LaneNode> nodes;
  std::map<UserObject*, int64_t> refs;
};

struct Exec {
  std::vector<LaneNode> nodes;
  std::map<UserObject*, int64_t> refs;
};

struct Alloc {
  size_t bytes;
  bool pinned;
  bool live;
};

struct Kernel {
  const char* name;
  size_t param_bytes;
  void (*run)(const void* params);
  std::vector<const void*> (*pointers)(const void* params);
};

// The driver's state lives as long as the process, as a real driver's does:
// calls that come late (a capturer released on another thread while the
// process exits) find it intact. Never freed; reachable, so not a leak.
std::recursive_mutex& g_mu = *new std::recursive_mutex;
std::vector<Stream*>& g_streams = *new std::vector<Stream*>;  // every stream from cuStreamCreate
std::vector<Stream*>& g_branches = *new std::vector<Stream*>;  // graph branches' queues, one per branch per launch
std::vector<Stream*>& g_destroyed_streams = *new std::vector<Stream*>;  // cuStreamDestroy'd, their work done
std::map<uintptr_t, Alloc>& g_allocs = *new std::map<uintptr_t, Alloc>;
std::vector<Capture*>& g_captures = *new std::vector<Capture*>;  // active captures, any thread
Stream& g_legacy = *new Stream;
int64_t g_violations = 0;
std::string& g_first_violation = *new std::string;
int64_t g_spin_waits = 0;
std::atomic<void (*)(void*)> g_wait_hook{nullptr};
std::atomic<void*> g_wait_hook_arg{nullptr};
int64_t g_live_user_objects = 0;
std::set<const void*>& g_events = *new std::set<const void*>;  // live: created, not yet destroyed
std::string& g_failing_kernel = *new std::string;  // standin_fail_next_launch
CUresult g_failing_result = 0;
CUresult g_failing_event_sync = 0;  // standin_fail_next_event_sync
// User-object destructors running on their own (detached) threads.
int64_t g_running_callbacks = 0;
std::condition_variable_any& g_callbacks_done = *new std::condition_variable_any;
thread_local int t_capture_mode = kModeGlobal;
thread_local bool t_in_callback = false;
thread_local std::vector<void*> t_contexts;

// STANDIN_EXIT_CHECK=1: a driver that tears itself down in an exit handler
// registered at cuInit, as exit() runs it after the caller's later handlers.
// A driver call after it ran (a thread still freeing what a capturer held
// while the process exits) ends the process with status 70; the handler waits
// half a second for such late calls to show up.
std::atomic<bool> g_exited{false};
[[noreturn]] void late_call(const char* what) {
  std::fprintf(stderr, "stand-in: %s called after the driver's exit handler ran\n", what);
  std::fflush(stderr);
  std::_Exit(70);
}
void driver_exit_handler() {
  g_exited = true;
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
}
// STANDIN_SLOW_FREE_MS, STANDIN_SLOW_USER_OBJECT_MS: a free, or a user
// object's destructor, that takes this long to start.
void slow(const char* knob) {
  if (const char* ms = std::getenv(knob)) std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(ms)));
}
std::atomic<int> g_slow_free_ms{-1};  // standin_set_slow_free_ms; -1: the environment's
void slow_free() {
  const int ms = g_slow_free_ms.load();
  if (ms < 0) return slow("STANDIN_SLOW_FREE_MS");
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

void violation(const std::string& what) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  if (g_violations++ == 0) g_first_violation = what;
}
// An event handle the driver does not know (destroyed, or never created):
// CUDA's behaviour is undefined; here a violation and an invalid handle.
CUresult unknown_event(const Event* e) {
  if (e == nullptr) return kInvalidHandle;
  if (g_events.count(e) != 0) return kOk;
  violation("an event used after cuEventDestroy");
  return kInvalidHandle;
}

#define NOT_AFTER_EXIT() \
  if (g_exited.load()) late_call(__func__)

#define ENTER()                                                                  \
  NOT_AFTER_EXIT();                                                              \
  if (t_in_callback) {                                                           \
    violation(std::string(__func__) + " called from a user-object destructor");  \
    return kNotPermitted;                                                        \
  }                                                                              \
  std::lock_guard<std::recursive_mutex> lock(g_mu)

constexpr uintptr_t kPerThreadHandle = 2;  // CU_STREAM_PER_THREAD
thread_local Stream* t_per_thread = nullptr;

// 0 and CU_STREAM_LEGACY are the legacy stream; CU_STREAM_PER_THREAD is the
// calling thread's own stream (made at its first use, never destroyed).
Stream* stream_of(void* s) {
  const auto v = reinterpret_cast<uintptr_t>(s);
  if (v == kPerThreadHandle) {
    if (t_per_thread == nullptr) {
      t_per_thread = new Stream;
      g_streams.push_back(t_per_thread);
    }
    return t_per_thread;
  }
  return v < kPerThreadHandle ? &g_legacy : static_cast<Stream*>(s);
}

// The capture `s` takes part in (its own, or one it joined), or nullptr.
Capture* capture_of(Stream& s) { return s.capture ? s.capture.get() : s.joined; }
bool active(const Capture* c) { return std::find(g_captures.begin(), g_captures.end(), c) != g_captures.end(); }

// One launch of a graph: the queue of each lane, and where each mark fell.
struct Launch {
  Stream* origin;
  std::vector<Stream*> branches;  // lane i > 0 is branches[i - 1]
  std::map<uint64_t, std::pair<Stream*, uint64_t>> marks;
  Stream& on(int lane) {
    if (lane == 0) return *origin;
    while (branches.size() < static_cast<size_t>(lane)) {
      g_branches.push_back(new Stream);
      branches.push_back(g_branches.back());
    }
    return *branches[static_cast<size_t>(lane) - 1];
  }
};

void launch_nodes(const std::vector<LaneNode>& nodes, Stream& origin) {
  Launch l{&origin, {}, {}};
  for (const LaneNode& n : nodes) n.run(l);
}

// --- execution ---------------------------------------------------------------

void run_until(Stream& s, uint64_t seq) {
  while (s.done < seq && !s.queue.empty()) {
    std::function<void()> op = std::move(s.queue.front());
    s.queue.pop_front();
    op();
    ++s.done;
  }
}

// Called before a host wait takes the driver's lock: the hook may start
// threads that call the driver, and wait for them.
void host_wait_hook() {
  if (t_in_callback) return;
  if (auto hook = g_wait_hook.load()) hook(g_wait_hook_arg.load());
}

// --- capture rules -------------------------------------------------------------

// A potentially unsafe call: refused (and the captures it conflicts with
// invalidated) under the calling thread's capture mode.
CUresult unsafe_call() {
  if (t_capture_mode == kModeRelaxed) return kOk;
  bool refused = false;
  for (Capture* c : g_captures) {
    const bool mine = c->thread == std::this_thread::get_id();
    if ((mine && c->mode != kModeRelaxed) || (!mine && t_capture_mode == kModeGlobal && c->mode == kModeGlobal)) {
      c->invalidated = true;
      refused = true;
    }
  }
  return refused ? kCaptureUnsupported : kOk;
}

// Where an asynchronous call goes: the capture's graph, or the stream's queue.
CUresult submit(void* stream, Action action) {
  Stream& s = *stream_of(stream);
  if (Capture* c = capture_of(s)) {
    if (c->invalidated) return kCaptureInvalidated;
    const int lane = s.lane;
    c->graph->nodes.push_back(LaneNode{lane, [action = std::move(action), lane](Launch& l) { action(l.on(lane)); }});
    ++c->lane_nodes[static_cast<size_t>(lane)];
    return kOk;
  }
  action(s);
  return kOk;
}

// Waiting for or querying a stream that is being captured, or an event whose
// latest record is a node of a capture, is illegal: the call fails and the
// capture is invalidated (in any capture mode).
CUresult refuse_if_capturing(Stream& s) {
  Capture* c = capture_of(s);
  if (c == nullptr) return kOk;
  c->invalidated = true;
  return kCaptureUnsupported;
}
CUresult refuse_if_captured(Event& e) {
  if (e.captured_in == nullptr) return kOk;
  if (active(e.captured_in)) e.captured_in->invalidated = true;
  return kCaptureUnsupported;
}

// --- memory ------------------------------------------------------------------

void* map_bytes(size_t bytes) {
  void* p = mmap(nullptr, bytes == 0 ? 1 : bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

// The allocation holding p, or nullptr.
Alloc* alloc_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = g_allocs.upper_bound(a);
  if (it == g_allocs.begin()) return nullptr;
  --it;
  return a < it->first + std::max<size_t>(it->second.bytes, 1) ? &it->second : nullptr;
}

bool pinned(const void* p, size_t bytes);
bool pinned_unlocked(const void* p, size_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  return pinned(p, bytes);
}

bool pinned(const void* p, size_t bytes) {
  Alloc* a = alloc_of(p);
  Alloc* b = bytes > 0 ? alloc_of(static_cast<const uint8_t*>(p) + bytes - 1) : a;
  return a != nullptr && a == b && a->live && a->pinned;
}

// Freed memory stays mapped, never reused: a late access is seen, not a crash.
CUresult free_alloc(const void* p, bool pinned_kind) {
  auto it = g_allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == g_allocs.end() || !it->second.live || it->second.pinned != pinned_kind) return kInvalidValue;
  it->second.live = false;
  std::memset(const_cast<void*>(p), 0xDD, it->second.bytes);
  return kOk;
}

// --- kernels -------------------------------------------------------------------

using namespace moecap;

void run_capture(const void* p) { capture_on_host(*static_cast<const CaptureParams*>(p)); }
void run_gather(const void* p) { gather_on_host(*static_cast<const GatherParams*>(p)); }
void run_claim(const void* p) { claim_on_host(*static_cast<const CommitParams*>(p)); }
void run_release(const void* p) { release_on_host(*static_cast<const CommitParams*>(p)); }
void run_take_errors(const void* p) { take_errors_on_host(*static_cast<const TakeErrorsParams*>(p)); }
// One warp per row on the GPU, rows in any order: here the last row first,
// each through the host twin as a one-row commit. A row whose slot another
// entry claimed (CommitParams::claims) is the kernel's to skip.
void run_commit(const void* v) {
  const CommitParams& p = *static_cast<const CommitParams*>(v);
  for (int64_t j = p.count - 1; j >= 0; --j) {
    int64_t src = 0, slot = 0;
    commit_source(p, j, &src, &slot);
    if (commit_in_range(p, src, slot) && !claim_won(p, j, slot)) continue;
    CommitParams row = p;
    row.count = 1;
    row.claims = nullptr;
    row.dst_slots = static_cast<const uint8_t*>(p.dst_slots) + j * elem_bytes(p.dst_slots_elem);
    if (p.src_rows != nullptr) {
      row.src_rows = static_cast<const uint8_t*>(p.src_rows) + j * elem_bytes(p.src_rows_elem);
    } else {
      row.src_start = p.src_start + j;
    }
    commit_on_host(row);
  }
}

std::vector<const void*> capture_pointers(const void* v) {
  const auto& p = *static_cast<const CaptureParams*>(v);
  return {p.ids, p.weights, p.dst_ids, p.dst_weights, p.histogram, p.errors};
}
std::vector<const void*> commit_pointers(const void* v) {
  const auto& p = *static_cast<const CommitParams*>(v);
  return {p.src_ids, p.src_weights, p.dst_ids, p.dst_weights, p.dst_states, p.src_rows, p.dst_slots, p.errors, p.claims};
}
std::vector<const void*> gather_pointers(const void* v) {
  const auto& p = *static_cast<const GatherParams*>(v);
  return {p.src_ids, p.src_weights, p.states, p.slots, p.dst_ids, p.dst_weights};
}

std::vector<const void*> take_errors_pointers(const void* v) {
  const auto& p = *static_cast<const TakeErrorsParams*>(v);
  return {p.errors, p.out};
}

const Kernel kKernels[] = {
    {"moecap_claim_kernel", sizeof(CommitParams), run_claim, commit_pointers},
    {"moecap_release_kernel", sizeof(CommitParams), run_release, commit_pointers},
    {"moecap_take_errors_kernel", sizeof(TakeErrorsParams), run_take_errors, take_errors_pointers},
    {"moecap_capture_kernel", sizeof(CaptureParams), run_capture, capture_pointers},
    {"moecap_commit_kernel", sizeof(CommitParams), run_commit, commit_pointers},
    {"moecap_gather_kernel", sizeof(GatherParams), run_gather, gather_pointers},
};

// --- user objects ----------------------------------------------------------------

void release_user_object(UserObject* u, int64_t count) {
  u->refs -= count;
  if (u->refs > 0) return;
  --g_live_user_objects;
  // CUDA runs destructors on an internal thread, where no driver call is allowed.
  ++g_running_callbacks;
  std::thread([u] {
    t_in_callback = true;
    slow("STANDIN_SLOW_USER_OBJECT_MS");
    u->destroy(u->ptr);
    delete u;
    std::lock_guard<std::recursive_mutex> lock(g_mu);
    --g_running_callbacks;
    g_callbacks_done.notify_all();
  }).detach();
}

void retain_all(const std::map<UserObject*, int64_t>& refs) {
  for (const auto& [u, n] : refs) u->refs += n;
}
void release_all(const std::map<UserObject*, int64_t>& refs) {
  for (const auto& [u, n] : refs) release_user_object(u, n);
}

// --- the Driver API ------------------------------------------------------------

CUresult cuGetErrorName(CUresult r, const char** out) {
  NOT_AFTER_EXIT();
  switch (r) {
    case kCaptureUnsupported: *out = "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"; break;
    case kCaptureInvalidated: *out = "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"; break;
    case kCaptureWrongThread: *out = "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"; break;
    case kNotReady: *out = "CUDA_ERROR_NOT_READY"; break;
    default: *out = "CUDA_ERROR (stand-in)"; break;
  }
  return kOk;
}
CUresult cuGetErrorString(CUresult r, const char** out) { return cuGetErrorName(r, out); }

CUresult cuDeviceGetCount(int* n) {
  NOT_AFTER_EXIT();
  *n = 1;
  return kOk;
}
CUresult cuDeviceGet(int* d, int ordinal) {
  NOT_AFTER_EXIT();
  if (ordinal != 0) return kInvalidValue;
  *d = 0;
  return kOk;
}
int g_context_tag;
CUresult cuDevicePrimaryCtxRetain(void** ctx, int) {
  NOT_AFTER_EXIT();
  *ctx = &g_context_tag;
  return kOk;
}
CUresult cuDevicePrimaryCtxRelease(int) {
  NOT_AFTER_EXIT();
  return kOk;
}
CUresult cuCtxPushCurrent(void* ctx) {
  ENTER();
  t_contexts.push_back(ctx);
  return kOk;
}
CUresult cuCtxPopCurrent(void** ctx) {
  NOT_AFTER_EXIT();
  if (t_contexts.empty()) return kInvalidValue;
  if (ctx != nullptr) *ctx = t_contexts.back();
  t_contexts.pop_back();
  return kOk;
}

CUresult cuMemAlloc(unsigned long long* out, size_t bytes) {
  ENTER();
  if (CUresult r = unsafe_call()) return r;
  void* p = map_bytes(bytes);
  if (p == nullptr) return kOutOfMemory;
  g_allocs[reinterpret_cast<uintptr_t>(p)] = Alloc{bytes, false, true};
  *out = reinterpret_cast<uintptr_t>(p);
  return kOk;
}
CUresult cuMemFree(unsigned long long p) {
  slow_free();
  ENTER();
  if (CUresult r = unsafe_call()) return r;
  return free_alloc(reinterpret_cast<void*>(p), false);
}
CUresult cuMemHostAlloc(void** out, size_t bytes, unsigned) {
  ENTER();
  if (CUresult r = unsafe_call()) return r;
  void* p = map_bytes(bytes);
  if (p == nullptr) return kOutOfMemory;
  g_allocs[reinterpret_cast<uintptr_t>(p)] = Alloc{bytes, true, true};
  *out = p;
  return kOk;
}
CUresult cuMemFreeHost(void* p) {
  ENTER();
  if (CUresult r = unsafe_call()) return r;
  return free_alloc(p, true);
}
CUresult cuMemHostGetDevicePointer(unsigned long long* out, void* p, unsigned) {
  ENTER();
  if (!pinned(p, 1)) return kInvalidValue;
  *out = reinterpret_cast<uintptr_t>(p);
  return kOk;
}

CUresult cuMemsetD8Async(unsigned long long dst, unsigned char v, size_t n, void* stream) {
  ENTER();
  return submit(stream, [dst, v, n](Stream& s) { s.push([=] { std::memset(reinterpret_cast<void*>(dst), v, n); }); });
}

CUresult cuMemcpyHtoDAsync(unsigned long long dst, const void* src, size_t n, void* stream) {
  ENTER();
  if (pinned(src, n)) {
    return submit(stream, [dst, src, n](Stream& s) {
      s.push([=] { std::memcpy(reinterpret_cast<void*>(dst), src, n); });
    });
  }
  // Pageable: staged by the driver before the call returns; not capturable.
  if (Capture* c = capture_of(*stream_of(stream))) {
    c->invalidated = true;
    return kCaptureUnsupported;
  }
  auto copy = std::make_shared<std::vector<uint8_t>>(static_cast<const uint8_t*>(src),
                                                     static_cast<const uint8_t*>(src) + n);
  return submit(stream, [dst, copy](Stream& s) {
    s.push([=] { std::memcpy(reinterpret_cast<void*>(dst), copy->data(), copy->size()); });
  });
}

CUresult cuMemcpyDtoHAsync(void* dst, unsigned long long src, size_t n, void* stream) {
  if (!pinned_unlocked(dst, n)) host_wait_hook();
  ENTER();
  auto op = [dst, src, n] { std::memcpy(dst, reinterpret_cast<const void*>(src), n); };
  if (pinned(dst, n)) return submit(stream, [op](Stream& s) { s.push(op); });
  // Pageable: the call returns once the copy is done, so it is a host wait.
  Stream& s = *stream_of(stream);
  if (Capture* c = capture_of(s)) {
    c->invalidated = true;
    return kCaptureUnsupported;
  }
  if (CUresult r = unsafe_call()) return r;
  run_until(s, s.push(op));
  return kOk;
}

struct Module {};
CUresult cuModuleLoadData(void** module, const void* image) {
  ENTER();
  if (CUresult r = unsafe_call()) return r;
  if (image == nullptr) return kInvalidValue;
  if (const char* e = std::getenv("STANDIN_MODULE_LOAD_ERROR")) {
    if (const int r = std::atoi(e)) return r;
  }
  *module = new Module;
  return kOk;
}
CUresult cuModuleUnload(void* module) {
  ENTER();
  if (CUresult r = unsafe_call()) return r;
  delete static_cast<Module*>(module);
  return kOk;
}
CUresult cuModuleGetFunction(const void** fn, void*, const char* name) {
  ENTER();
  for (const Kernel& k : kKernels) {
    if (std::strcmp(k.name, name) == 0) {
      *fn = &k;
      return kOk;
    }
  }
  return kNotFound;
}

CUresult cuLaunchKernel(const void* fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned, void* stream, void** params, void** extra) {
  ENTER();
  if (fn == nullptr || params == nullptr || extra != nullptr) return kInvalidValue;
  // CUDA refuses an empty grid or block (a launch sized by a count of 0).
  if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0) return kInvalidValue;
  const Kernel* k = static_cast<const Kernel*>(fn);
  if (!g_failing_kernel.empty() && g_failing_kernel == k->name) {
    g_failing_kernel.clear();
    return g_failing_result;
  }
  // Kernel parameters are copied at the launch, as CUDA does.
  auto bytes = std::make_shared<std::vector<uint8_t>>(static_cast<const uint8_t*>(params[0]),
                                                      static_cast<const uint8_t*>(params[0]) + k->param_bytes);
  return submit(stream, [k, bytes](Stream& s) {
    s.push([k, bytes] {
      for (const void* p : k->pointers(bytes->data())) {
        const Alloc* a = p != nullptr ? alloc_of(p) : nullptr;
        if (a != nullptr && !a->live) {
          violation(std::string(k->name) + " ran with a pointer into freed memory");
          return;
        }
      }
      k->run(bytes->data());
    });
  });
}

CUresult cuStreamCreate(void** out, unsigned) {
  ENTER();
  g_streams.push_back(new Stream);
  *out = g_streams.back();
  return kOk;
}
CUresult cuStreamDestroy(void* stream) {
  ENTER();
  if (reinterpret_cast<uintptr_t>(stream) == kPerThreadHandle) return kInvalidHandle;
  Stream* s = stream_of(stream);
  if (s == &g_legacy) return kInvalidHandle;
  run_until(*s, s->enqueued);  // queued work still completes, as on a GPU
  g_streams.erase(std::find(g_streams.begin(), g_streams.end(), s));
  // Kept, not deleted: CUDA releases a stream once its work is done, while waits queued on other streams
  // (cuStreamWaitEvent) and events recorded on it may still name it.
  g_destroyed_streams.push_back(s);
  return kOk;
}
CUresult cuStreamSynchronize(void* stream) {
  host_wait_hook();
  ENTER();
  if (CUresult r = unsafe_call()) return r;
  Stream& s = *stream_of(stream);
  if (CUresult r = refuse_if_capturing(s)) return r;
  run_until(s, s.enqueued);
  return kOk;
}
CUresult cuStreamQuery(void* stream) {
  ENTER();
  if (CUresult r = unsafe_call()) return r;
  Stream& s = *stream_of(stream);
  if (CUresult r = refuse_if_capturing(s)) return r;
  return s.done == s.enqueued ? kOk : kNotReady;
}
CUresult cuStreamWaitEvent(void* stream, Event* e, unsigned) {
  ENTER();
  if (CUresult r = unknown_event(e)) return r;
  Stream* waited = e->stream;
  const uint64_t seq = e->seq;
  Stream& s = *stream_of(stream);
  Capture* c = capture_of(s);
  Capture* into = e->captured_in;
  if (into != nullptr && (c == nullptr || c == into)) {
    if (!active(into)) return kCaptureIsolation;  // recorded in a capture that has ended
    if (into->invalidated) return kCaptureInvalidated;
    if (c == nullptr) {  // the stream joins the capture: a new branch
      s.joined = into;
      s.lane = static_cast<int>(into->lanes.size());
      into->lanes.push_back(&s);
      into->lane_nodes.push_back(0);
      into->lane_joined.push_back(0);
    }
    if (e->lane == s.lane) return kOk;  // the same lane is in order already
    const uint64_t mark = e->mark;
    const int lane = s.lane;
    into->graph->nodes.push_back(LaneNode{lane, [mark, lane](Launch& l) {
                                        const std::pair<Stream*, uint64_t> at = l.marks.at(mark);
                                        l.on(lane).push([at] { run_until(*at.first, at.second); });
                                      }});
    ++into->lane_nodes[static_cast<size_t>(lane)];
    if (lane == 0) {
      size_t& joined = into->lane_joined[static_cast<size_t>(e->lane)];
      joined = std::max(joined, e->lane_nodes);
    }
    return kOk;
  }
  if (c != nullptr) {
    // An event of another capture, or one recorded outside any (even one
    // that has completed, or never recorded): CUDA refuses a wait on a
    // non-captured event from a capturing stream without
    // CU_EVENT_WAIT_EXTERNAL, which moecap never asks for.
    c->invalidated = true;
    return kCaptureIsolation;
  }
  if (waited == nullptr) return kOk;
  return submit(stream, [waited, seq](Stream& on) { on.push([waited, seq] { run_until(*waited, seq); }); });
}
CUresult cuStreamIsCapturing(void* stream, int* status) {
  ENTER();
  Capture* c = capture_of(*stream_of(stream));
  *status = c == nullptr ? 0 : c->invalidated ? 2 : 1;
  return kOk;
}
// CUDA 11.3's ABI (cuStreamGetCaptureInfo_v2) and 12.3's (_v3, with edge
// data); cuGetProcAddress picks by the version asked for. The capture's
// graph is the one being built: user objects retained on it go with it.
CUresult capture_info_v3(void* stream, int* status, uint64_t* id, Graph** graph, const void** deps,
                         const void** edges, size_t* ndeps) {
  ENTER();
  Capture* c = capture_of(*stream_of(stream));
  *status = c == nullptr ? 0 : c->invalidated ? 2 : 1;
  if (id != nullptr) *id = c != nullptr ? c->id : 0;
  if (graph != nullptr) *graph = c != nullptr ? c->graph.get() : nullptr;
  if (deps != nullptr) *deps = nullptr;
  if (edges != nullptr) *edges = nullptr;
  if (ndeps != nullptr) *ndeps = 0;
  return kOk;
}
CUresult capture_info_v2(void* stream, int* status, uint64_t* id, Graph** graph, const void** deps, size_t* ndeps) {
  return capture_info_v3(stream, status, id, graph, deps, nullptr, ndeps);
}

CUresult cuStreamBeginCapture(void* stream, int mode) {
  ENTER();
  Stream* s = stream_of(stream);
  if (s == &g_legacy) return kCaptureUnsupported;
  if (capture_of(*s) != nullptr) return kIllegalState;
  s->capture = std::make_unique<Capture>(
      Capture{std::make_shared<Graph>(), mode, std::this_thread::get_id(), g_next_capture_id++, false, {s}, {0}, {0}});
  g_captures.push_back(s->capture.get());
  return kOk;
}
CUresult cuStreamEndCapture(void* stream, Graph** out) {
  ENTER();
  Stream& s = *stream_of(stream);
  if (!s.capture) return kIllegalState;
  if (s.capture->mode != kModeRelaxed && s.capture->thread != std::this_thread::get_id()) return kCaptureWrongThread;
  std::unique_ptr<Capture> c = std::move(s.capture);
  g_captures.erase(std::find(g_captures.begin(), g_captures.end(), c.get()));
  *out = nullptr;
  // Every branch must have joined the origin after its last node.
  bool unjoined = false;
  for (size_t i = 1; i < c->lanes.size(); ++i) {
    unjoined = unjoined || c->lane_nodes[i] > c->lane_joined[i];
    c->lanes[i]->joined = nullptr;
    c->lanes[i]->lane = 0;
  }
  if (c->invalidated || unjoined) {
    release_all(c->graph->refs);
    return unjoined ? kCaptureUnjoined : kCaptureInvalidated;
  }
  *out = new Graph(std::move(*c->graph));
  return kOk;
}
CUresult cuThreadExchangeStreamCaptureMode(int* mode) {
  const int previous = t_capture_mode;
  t_capture_mode = *mode;
  *mode = previous;
  return kOk;
}

CUresult cuEventCreate(Event** out, unsigned flags) {
  ENTER();
  *out = new Event{flags};
  g_events.insert(*out);
  return kOk;
}
CUresult cuEventDestroy(Event* e) {
  ENTER();
  if (CUresult r = unknown_event(e)) return r;
  g_events.erase(e);
  delete e;
  return kOk;
}
CUresult cuEventRecordWithFlags(Event* e, void* stream, unsigned flags) {
  ENTER();
  if (CUresult r = unknown_event(e)) return r;
  Stream& s = *stream_of(stream);
  Capture* c = capture_of(s);
  // An external record is a graph node; outside a capture the flag is invalid.
  if (c == nullptr && (flags & kRecordExternal)) return kInvalidValue;
  if (c != nullptr && !(flags & kRecordExternal)) {
    // A dependency inside the graph only: at each launch, a mark of where this lane's queue stands.
    e->captured_in = c;
    e->lane = s.lane;
    e->lane_nodes = c->lane_nodes[static_cast<size_t>(s.lane)];
    e->mark = g_next_mark++;
    const uint64_t mark = e->mark;
    const int lane = s.lane;
    c->graph->nodes.push_back(LaneNode{lane, [mark, lane](Launch& l) {
                                     Stream& on = l.on(lane);
                                     l.marks[mark] = {&on, on.enqueued};
                                   }});
    return c->invalidated ? kCaptureInvalidated : kOk;
  }
  return submit(stream, [e](Stream& on) {
    e->captured_in = nullptr;
    e->stream = &on;
    e->seq = on.push([] {});
  });
}
CUresult cuEventRecord(Event* e, void* stream) { return cuEventRecordWithFlags(e, stream, 0); }
CUresult cuEventQuery(Event* e) {
  ENTER();
  if (CUresult r = unknown_event(e)) return r;
  if (CUresult r = unsafe_call()) return r;
  if (CUresult r = refuse_if_captured(*e)) return r;
  return e->stream == nullptr || e->stream->done >= e->seq ? kOk : kNotReady;
}
CUresult cuEventSynchronize(Event* e) {
  host_wait_hook();
  ENTER();
  if (CUresult r = unknown_event(e)) return r;
  if (CUresult r = std::exchange(g_failing_event_sync, 0)) return r;
  if (CUresult r = unsafe_call()) return r;
  if (CUresult r = refuse_if_captured(*e)) return r;
  if (!(e->flags & kEventBlockingSync)) ++g_spin_waits;
  if (e->stream != nullptr) run_until(*e->stream, e->seq);
  return kOk;
}

CUresult cuGraphCreate(Graph** out, unsigned) {
  ENTER();
  *out = new Graph;
  return kOk;
}
CUresult cuGraphDestroy(Graph* g) {
  ENTER();
  if (g == nullptr) return kInvalidHandle;
  release_all(g->refs);
  delete g;
  return kOk;
}
struct Node {};
Node g_node_tag;
// The child is cloned, with its user-object references (Programming Guide:
// references of a child graph node belong to the child graph).
CUresult cuGraphAddChildGraphNode(Node** node, Graph* parent, const Node* const*, size_t, Graph* child) {
  ENTER();
  if (parent == nullptr || child == nullptr) return kInvalidHandle;
  auto clone = std::make_shared<Graph>(*child);
  retain_all(clone->refs);
  for (const auto& [u, n] : clone->refs) parent->refs[u] += n;
  parent->nodes.push_back(LaneNode{0, [clone](Launch& l) { launch_nodes(clone->nodes, l.on(0)); }});
  *node = &g_node_tag;
  return kOk;
}
CUresult cuGraphInstantiateWithFlags(Exec** out, Graph* g, unsigned long long) {
  ENTER();
  if (g == nullptr) return kInvalidHandle;
  *out = new Exec{g->nodes, g->refs};
  retain_all(g->refs);
  return kOk;
}
CUresult cuGraphLaunch(Exec* exec, void* stream) {
  ENTER();
  if (exec == nullptr) return kInvalidHandle;
  if (capture_of(*stream_of(stream)) != nullptr) return kCaptureUnsupported;  // not modeled: a graph node inside a capture
  launch_nodes(exec->nodes, *stream_of(stream));
  return kOk;
}
CUresult cuGraphExecDestroy(Exec* exec) {
  ENTER();
  if (exec == nullptr) return kInvalidHandle;
  release_all(exec->refs);
  delete exec;
  return kOk;
}

CUresult cuUserObjectCreate(UserObject** out, void* ptr, void (*destroy)(void*), unsigned refs, unsigned flags) {
  ENTER();
  if (destroy == nullptr || refs == 0 || flags != 1 /* CU_USER_OBJECT_NO_DESTRUCTOR_SYNC */) return kInvalidValue;
  *out = new UserObject{ptr, destroy, refs};
  ++g_live_user_objects;
  return kOk;
}
CUresult cuUserObjectRetain(UserObject* u, unsigned n) {
  ENTER();
  u->refs += n;
  return kOk;
}
CUresult cuUserObjectRelease(UserObject* u, unsigned n) {
  ENTER();
  release_user_object(u, n);
  return kOk;
}
CUresult cuGraphRetainUserObject(Graph* g, UserObject* u, unsigned n, unsigned flags) {
  ENTER();
  if (g == nullptr || u == nullptr || n == 0) return kInvalidValue;
  if (!(flags & kGraphUserObjectMove)) u->refs += n;
  g->refs[u] += n;
  return kOk;
}
CUresult cuGraphReleaseUserObject(Graph* g, UserObject* u, unsigned n) {
  ENTER();
  auto it = g->refs.find(u);
  if (it == g->refs.end() || it->second < n) return kInvalidValue;
  if ((it->second -= n) == 0) g->refs.erase(it);
  release_user_object(u, n);
  return kOk;
}

// An entry point and the CUDA version whose ABI it first appeared in:
// cuGetProcAddress finds it only for that version or a later one, as the
// real driver does (CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT otherwise).
struct Entry {
  const char* name;
  void* fn;
  int since;
};
#define ENTRY(f, since) {#f, reinterpret_cast<void*>(&f), since}
const Entry kEntries[] = {
    ENTRY(cuGetErrorName, 6000), ENTRY(cuGetErrorString, 6000), ENTRY(cuDeviceGetCount, 2000),
    ENTRY(cuDeviceGet, 2000), ENTRY(cuDevicePrimaryCtxRetain, 7000), ENTRY(cuDevicePrimaryCtxRelease, 7000),
    ENTRY(cuCtxPushCurrent, 4000), ENTRY(cuCtxPopCurrent, 4000), ENTRY(cuMemAlloc, 3020), ENTRY(cuMemFree, 3020),
    ENTRY(cuMemHostAlloc, 2020), ENTRY(cuMemFreeHost, 2000), ENTRY(cuMemHostGetDevicePointer, 3020),
    ENTRY(cuMemsetD8Async, 3020), ENTRY(cuMemcpyHtoDAsync, 3020), ENTRY(cuMemcpyDtoHAsync, 3020),
    ENTRY(cuModuleLoadData, 2000), ENTRY(cuModuleUnload, 2000), ENTRY(cuModuleGetFunction, 2000),
    ENTRY(cuLaunchKernel, 4000), ENTRY(cuStreamCreate, 2000), ENTRY(cuStreamDestroy, 4000),
    ENTRY(cuStreamSynchronize, 2000), ENTRY(cuStreamQuery, 2000), ENTRY(cuStreamWaitEvent, 3020),
    ENTRY(cuStreamIsCapturing, 10000), ENTRY(cuStreamBeginCapture, 10010), ENTRY(cuStreamEndCapture, 10000),
    ENTRY(cuThreadExchangeStreamCaptureMode, 10010), ENTRY(cuEventCreate, 2000), ENTRY(cuEventDestroy, 4000),
    ENTRY(cuEventRecord, 2000), ENTRY(cuEventRecordWithFlags, 11010), ENTRY(cuEventQuery, 2000),
    ENTRY(cuEventSynchronize, 2000), ENTRY(cuGraphCreate, 10000), ENTRY(cuGraphDestroy, 10000),
    ENTRY(cuGraphAddChildGraphNode, 10000), ENTRY(cuGraphInstantiateWithFlags, 11040),
    ENTRY(cuGraphLaunch, 10000), ENTRY(cuGraphExecDestroy, 10000), ENTRY(cuUserObjectCreate, 11030),
    ENTRY(cuUserObjectRetain, 11030), ENTRY(cuUserObjectRelease, 11030), ENTRY(cuGraphRetainUserObject, 11030),
    ENTRY(cuGraphReleaseUserObject, 11030),
};

}  // namespace standin_impl

using namespace standin_impl;

extern "C" {

__attribute__((visibility("default"))) int cuInit(unsigned) {
  static std::once_flag exit_check;
  if (std::getenv("STANDIN_EXIT_CHECK") != nullptr) std::call_once(exit_check, [] { std::atexit(driver_exit_handler); });
  return kOk;
}

__attribute__((visibility("default"))) int cuDriverGetVersion(int* version) {
  const char* v = std::getenv("STANDIN_DRIVER_VERSION");
  *version = v != nullptr ? std::atoi(v) : 13000;
  return kOk;
}

__attribute__((visibility("default"))) int cuGetProcAddress_v2(const char* name, void** pfn, int version, uint64_t,
                                                                int* status) {
  // CUdriverProcAddressQueryResult: 0 found, 1 no such symbol, 2 not in the ABI of `version`.
  auto answer = [&](void* fn, int since) {
    const bool found = version >= since;
    *pfn = found ? fn : nullptr;
    if (status != nullptr) *status = found ? 0 : 2;
    return found ? kOk : kNotFound;
  };
  if (std::strcmp(name, "cuStreamGetCaptureInfo") == 0) {
    // 10.1's ABI (no graph) is not modeled: found from 11.3 on.
    return answer(version >= 12030 ? reinterpret_cast<void*>(&capture_info_v3) : reinterpret_cast<void*>(&capture_info_v2),
                  11030);
  }
  for (const Entry& e : kEntries) {
    if (std::strcmp(e.name, name) == 0) return answer(e.fn, e.since);
  }
  *pfn = nullptr;
  if (status != nullptr) *status = 1;
  return kNotFound;
}

__attribute__((visibility("default"))) int cuGetProcAddress(const char* name, void** pfn, int v, uint64_t f) {
  return cuGetProcAddress_v2(name, pfn, v, f, nullptr);
}

// What an engine that dlsym()s libcuda itself (examples/engine_sim) finds.
#define STANDIN_EXPORT(name, impl, params, args) \
  __attribute__((visibility("default"))) int name params { return standin_impl::impl args; }
STANDIN_EXPORT(cuDeviceGet, cuDeviceGet, (int* d, int ordinal), (d, ordinal))
STANDIN_EXPORT(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, (void** ctx, int d), (ctx, d))
STANDIN_EXPORT(cuMemAlloc_v2, cuMemAlloc, (unsigned long long* p, size_t n), (p, n))
STANDIN_EXPORT(cuMemFree_v2, cuMemFree, (unsigned long long p), (p))
STANDIN_EXPORT(cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync, (unsigned long long d, const void* s, size_t n, void* st),
               (d, s, n, st))
STANDIN_EXPORT(cuStreamCreate, cuStreamCreate, (void** s, unsigned f), (s, f))
STANDIN_EXPORT(cuStreamSynchronize, cuStreamSynchronize, (void* s), (s))
// One context: making it current changes nothing.
__attribute__((visibility("default"))) int cuCtxSetCurrent(void*) { return 0; }

// Tests reach the driver directly too, as an engine would (its own streams,
// pinned buffers, captures and graphs).
__attribute__((visibility("default"))) void* standin_entry(const char* name) {
  void* fn = nullptr;
  cuGetProcAddress_v2(name, &fn, 13000, 0, nullptr);
  return fn;
}

__attribute__((visibility("default"))) void standin_run_stream(StandinStream stream) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  Stream& s = *stream_of(stream);
  run_until(s, s.enqueued);
}

__attribute__((visibility("default"))) void standin_run_all(void) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  run_until(g_legacy, g_legacy.enqueued);
  for (Stream* s : g_streams) run_until(*s, s->enqueued);
  for (Stream* s : g_branches) run_until(*s, s->enqueued);
}

__attribute__((visibility("default"))) int64_t standin_pending(StandinStream stream) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  const Stream& s = *stream_of(stream);
  return static_cast<int64_t>(s.enqueued - s.done);
}

__attribute__((visibility("default"))) void standin_set_wait_hook(void (*hook)(void*), void* arg) {
  g_wait_hook_arg = arg;
  g_wait_hook = hook;
}

__attribute__((visibility("default"))) int64_t standin_violations(void) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  return g_violations;
}
__attribute__((visibility("default"))) const char* standin_first_violation(void) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  return g_first_violation.c_str();
}
__attribute__((visibility("default"))) int64_t standin_spin_waits(void) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  return g_spin_waits;
}
__attribute__((visibility("default"))) void standin_set_slow_free_ms(int ms) { g_slow_free_ms = ms; }
__attribute__((visibility("default"))) void standin_drain_callbacks(void) {
  std::unique_lock<std::recursive_mutex> lock(g_mu);
  g_callbacks_done.wait(lock, [] { return g_running_callbacks == 0; });
}
__attribute__((visibility("default"))) int64_t standin_live_user_objects(void) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  return g_live_user_objects;
}
__attribute__((visibility("default"))) int64_t standin_live_events(void) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  return static_cast<int64_t>(g_events.size());
}
__attribute__((visibility("default"))) void standin_fail_next_event_sync(int result) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  g_failing_event_sync = static_cast<CUresult>(result);
}
__attribute__((visibility("default"))) void standin_fail_next_launch(const char* kernel, int result) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  g_failing_kernel = kernel != nullptr ? kernel : "";
  g_failing_result = static_cast<CUresult>(result);
}
__attribute__((visibility("default"))) int64_t standin_live_allocations(void) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  int64_t n = 0;
  for (const auto& [at, a] : g_allocs) n += a.live ? 1 : 0;
  return n;
}
__attribute__((visibility("default"))) int standin_is_pinned(const void* p, uint64_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  return pinned(p, bytes) ? 1 : 0;
}

}  // extern "C"
