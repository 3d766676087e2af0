// SPDX-License-Identifier: Apache-2.0
// moecap._moecap: the C ABI as a Python extension. Every tensor argument is
// borrowed in place (see borrow.cpp) and handed to libmoecap.so in the same
// call; the Python package (moecap/__init__.py) adds keyword configuration,
// output allocation and the torch ops on top.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "binding.h"
#include "moecap_record.h"

namespace moecap_python {
namespace {

[[noreturn]] void closed() {
  throw nb::value_error("moecap: the capturer is closed");
}

// Forks this process has been through (pthread_atfork's child handler,
// registered at import), and where an object was made: a capturer or graph
// made before a fork is the parent's. The child has a copy of its memory but
// not the threads that may hold its lock at the fork (a call in progress on
// another thread: the child's first call on it, or close(), waited forever),
// nor, on CUDA, its context. There it refuses every call, and dropping or
// closing it leaks the handle rather than take that lock.
std::atomic<uint64_t> forks{0};

struct Birth {
  uint64_t forks_then = forks.load(std::memory_order_relaxed);
  long pid = static_cast<long>(getpid());
  bool inherited() const { return forks.load(std::memory_order_relaxed) != forks_then; }
  void check(const char* what) const {
    if (inherited()) {
      throw nb::value_error(("moecap: this " + std::string(what) + " was made in process " + std::to_string(pid) +
                             " before a fork; it belongs to that process (the threads that may hold its lock, and "
                             "on CUDA its context, do not cross a fork): make one in this process")
                                .c_str());
    }
  }
};

nb::dict plan_dict(const moecap_plan_info& p) {
  nb::dict d;
  d["rows_per_rank"] = p.rows_per_rank;
  d["device_rows"] = p.device_rows;
  d["row_elements"] = p.row_elements;
  d["id_dtype"] = p.id_dtype;
  d["id_bytes"] = p.id_bytes;
  d["weight_bytes"] = p.weight_bytes;
  d["device_bytes"] = p.device_bytes;
  d["host_bytes"] = p.host_bytes;
  d["device_id_dtype"] = p.device_id_dtype;
  d["device_id_bytes"] = p.device_id_bytes;
  return d;
}

// Appends the borrowed tensors to `holder` (a recording graph's list, or the
// side stream's until-join list), when there is one: the Python object;
// nanobind's import of it where there is one, which owns the producer's
// capsule (a __dlpack__ may hand out memory that nothing else holds); and a
// buffer-protocol export of it where it came that way, which is what pins
// some producers' memory (a JAX array's external reference: without it the
// array may be donated or deleted, its buffer reused, while the object lives).
void keep_alive(nb::list* holder, const Borrowed& a, const Borrowed& b) {
  if (holder == nullptr) return;
  for (const Borrowed* t : {&a, &b}) {
    if (t->keep.is_valid()) holder->append(t->keep);
    if (t->has_buffer) {
      // A memoryview, which the garbage collector sees through (a cycle
      // through a graph's held tensors is still collected).
      nb::object view = nb::steal(PyMemoryView_FromObject(t->keep.ptr()));
      if (!view.is_valid()) throw nb::python_error();
      holder->append(view);
    }
    if (t->array.is_valid()) {
      auto import = std::make_unique<nb::ndarray<nb::ro>>(t->array);
      nb::capsule owner(import.get(), [](void* held) noexcept { delete static_cast<nb::ndarray<nb::ro>*>(held); });
      import.release();  // the capsule owns it from here
      holder->append(owner);
    }
  }
}

class Graph {
 public:
  // commits: the capturer's count of commits, where the graph holds one (each launch is one more).
  // in_flight: the capturer's count of calls in progress without the GIL.
  Graph(moecap_graph* graph, nb::list keep, int32_t device_type, int32_t device_id,
        std::shared_ptr<uint64_t> commits, std::shared_ptr<std::atomic<int>> in_flight)
      : graph_(graph), keep_(std::move(keep)), device_type_(device_type), device_id_(device_id),
        commits_(std::move(commits)), in_flight_(std::move(in_flight)) {}
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph() {
    if (!birth_.inherited()) moecap_graph_destroy(graph_);  // the parent's (Birth): leaked
  }

  // As the capturer's call_taking_lock: with the GIL held unless a call on another thread released it (that
  // call may hold the capturer's lock, and a replay of recorded commits on the host backend takes a while);
  // then counted in flight, so that the capturer's close() waits for it.
  void launch(nb::handle stream) {
    void* s = resolve_stream(stream, device_type_, device_id_);
    moecap_graph* graph = live();
    moecap_status status;
    if (*in_flight_ == 0) {
      status = moecap_graph_launch(graph, s);
    } else {
      GilRelease unlocked(in_flight_.get());
      status = moecap_graph_launch(graph, s);
    }
    check(status);
    if (commits_) ++*commits_;
  }
  uintptr_t native() {
    void* cu_graph = nullptr;
    check(moecap_graph_native(live(), &cu_graph));
    return reinterpret_cast<uintptr_t>(cu_graph);
  }
  void close() {
    if (!birth_.inherited()) check(moecap_graph_destroy(graph_));
    graph_ = nullptr;
    clear();
  }

  // The cyclic collector's view (a tensor the graph holds may refer back to
  // the graph): what it holds, and how to let go of it. Clearing frees the
  // graph first, so nothing can replay what it read.
  int traverse(visitproc visit, void* arg) {
    Py_VISIT(keep_.ptr());
    return 0;
  }
  void clear() {
    if (!birth_.inherited()) moecap_graph_destroy(graph_);  // NULL (closed): a no-op
    graph_ = nullptr;
    keep_ = nb::list();
  }

 private:
  moecap_graph* live() {
    if (graph_ == nullptr) throw nb::value_error("moecap: the graph is closed");
    birth_.check("graph");
    return graph_;
  }
  moecap_graph* graph_;
  Birth birth_;
  nb::list keep_;
  int32_t device_type_, device_id_;
  std::shared_ptr<uint64_t> commits_;
  std::shared_ptr<std::atomic<int>> in_flight_;
};

class Capturer {
 public:
  explicit Capturer(const moecap_config& config)
      : device_type_(config.device_type),
        device_id_(config.device_id),
        side_stream_((config.flags & MOECAP_FLAG_SIDE_STREAM) != 0) {
    check(moecap_create(&config, &handle_));
  }
  Capturer(const Capturer&) = delete;
  Capturer& operator=(const Capturer&) = delete;
  ~Capturer() {
    if (birth_.inherited()) return;  // the parent's (Birth): leaked
    abandon_recording();
    moecap_destroy(handle_);
  }

  void capture(Index layer, Tensor topk_ids, Tensor topk_weights, nb::handle stream) {
    const int32_t layer_index = int32_argument(layer, "moecap_capture", "layer");
    Borrowed ids, weights;
    const CallStream call{stream, device_type_, device_id_};
    borrow(topk_ids, "topk_ids", false, ids, &call);
    const DLTensor* w = borrow_optional(topk_weights, "topk_weights", false, weights, &call);
    void* s = resolve_stream(stream, device_type_, device_id_, &ids);
    const moecap_status status = call_taking_lock(
        [&](moecap_capturer* h) { return moecap_capture(h, layer_index, ids.get(), w, s); }, true);
    check(status, {{"topk_weights is NULL", "topk_weights is None"}});
    keep_alive(held(), ids, weights);
  }

  // The C call's own time, for bench/python_bench.py: borrow once, call
  // moecap_capture `iterations` times; seconds per call.
  double time_capture(int32_t layer, Tensor topk_ids, int64_t iterations) {
    Borrowed ids;
    borrow(topk_ids, "topk_ids", false, ids);
    moecap_capturer* h = live();
    auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < iterations; ++i) check(moecap_capture(h, layer, ids.get(), nullptr, nullptr));
    std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    return elapsed.count() / static_cast<double>(iterations);
  }

  // A call that releases the GIL around its C call does so with
  // `GilRelease unlocked(in_flight_.get())`, which counts it in flight so
  // that close() on another thread waits for it: moecap_destroy must not run
  // while a call on the same capturer is in progress. Nothing after the C
  // call uses the handle. A call a graph may record (commit, invalidate, and
  // capture or join when they release the GIL) also holds one of these, made
  // first: graph_begin and graph_end wait for it until its bookkeeping after
  // the C call (held(), the commit count) is done, with the GIL back.
  class Recordable {
   public:
    explicit Recordable(Capturer& c, bool recordable = true) : c_(c), recordable_(recordable) {
      if (recordable_) ++c_.recordable_in_flight_;
    }
    Recordable(const Recordable&) = delete;
    Recordable& operator=(const Recordable&) = delete;
    ~Recordable() {
      if (recordable_) --c_.recordable_in_flight_;
    }

   private:
    Capturer& c_;
    bool recordable_;
  };

  void commit(Tensor dst_slots, Index src_start, Tensor src_rows, nb::handle stream) {
    const int64_t start = int_argument(src_start, "moecap_commit", "src_start");
    Borrowed slots, rows;
    const CallStream call{stream, device_type_, device_id_};
    borrow(dst_slots, "dst_slots", false, slots, &call);
    moecap_commit_args args{sizeof(moecap_commit_args), start,
                            borrow_optional(src_rows, "src_rows", false, rows, &call), slots.get()};
    void* s = resolve_stream(stream, device_type_, device_id_, &slots);
    pass_graph_gate();
    moecap_capturer* h = live();
    moecap_status status;
    {
      Recordable recorded(*this);
      GilRelease unlocked(in_flight_.get());
      status = moecap_commit(h, &args, s);
    }
    check(status, {{"args->", ""}});
    if (recording_on_) {
      recorded_commit_ = true;  // it runs at each launch of the graph
    } else {
      ++*commits_;
    }
    keep_alive(held(), slots, rows);
  }

  void read_into(Tensor slots, Tensor out, Tensor weights_out, bool nonblocking, bool strict,
                 nb::handle stream) {
    Borrowed s, ids, weights;
    const CallStream call{stream, device_type_, device_id_};
    borrow(slots, "slots", false, s, &call);
    borrow(out, "out", true, ids, &call);
    DLTensor* w = const_cast<DLTensor*>(borrow_optional(weights_out, "weights_out", true, weights, &call));
    void* st = resolve_stream(stream, device_type_, device_id_, &ids);
    moecap_capturer* h = live();
    moecap_status status;
    {
      GilRelease unlocked(in_flight_.get());
      const uint32_t flags = (nonblocking ? MOECAP_READ_NONBLOCKING : 0u) | (strict ? MOECAP_READ_STRICT : 0u);
      status = moecap_read(h, s.get(), ids.get_mut(), w, flags, st);
    }
    check(status,
          {{"ids_out", "out"}, {"MOECAP_READ_STRICT", "strict=True"}, {"MOECAP_READ_NONBLOCKING", "nonblocking=True"}});
  }

  void write(Tensor slots, Tensor ids, Tensor weights, nb::handle stream) {
    Borrowed s, i, w;
    const CallStream call{stream, device_type_, device_id_};
    borrow(slots, "slots", false, s, &call);
    borrow(ids, "ids", false, i, &call);
    const DLTensor* wp = borrow_optional(weights, "weights", false, w, &call);
    void* st = resolve_stream(stream, device_type_, device_id_, &i);
    moecap_capturer* h = live();
    moecap_status status;
    {
      GilRelease unlocked(in_flight_.get());
      status = moecap_write(h, s.get(), i.get(), wp, st);
    }
    check(status, {{"weights is NULL", "weights is None"}});
  }

  void invalidate(Tensor slots, nb::handle stream) {
    Borrowed s;
    const CallStream call{stream, device_type_, device_id_};
    borrow(slots, "slots", false, s, &call);
    void* st = resolve_stream(stream, device_type_, device_id_, &s);
    pass_graph_gate();
    moecap_capturer* h = live();
    moecap_status status;
    {
      // With host slots, it may wait for a snapshot-ring entry in use.
      Recordable recorded(*this);
      GilRelease unlocked(in_flight_.get());
      status = moecap_invalidate(h, s.get(), st);
    }
    check(status);
    keep_alive(held(), s, Borrowed{});
  }

  // MOECAP_FLAG_SIDE_STREAM: `stream` waits for the work forked so far; the
  // tensors that work read are released (a reuse now comes after the join).
  void join(nb::handle stream) {
    void* s = resolve_stream(stream, device_type_, device_id_);
    // Recordable: a graph does not begin or end between the join and the release of what it joined.
    check(call_taking_lock([s](moecap_capturer* h) { return moecap_join(h, s); }, true));
    if (!recording_on_) forked_ = nb::list();
  }

  void synchronize() {
    moecap_capturer* h = live();
    moecap_status status;
    {
      GilRelease unlocked(in_flight_.get());
      status = moecap_synchronize(h);
    }
    check(status);
  }

  nb::dict errors(bool clear) {
    moecap_error_counts e{sizeof(moecap_error_counts), 0, 0};
    moecap_capturer* h = live();
    moecap_status status;
    {
      // It waits for every commit: a monitoring thread must not stall the engine's.
      GilRelease unlocked(in_flight_.get());
      status = moecap_get_errors(h, &e, clear ? MOECAP_ERRORS_CLEAR : 0u);
    }
    check(status);
    nb::dict d;
    d["skipped_rows"] = e.skipped_rows;
    d["invalid_ids"] = e.invalid_ids;
    return d;
  }

  void histogram_reset(nb::handle stream) {
    void* s = resolve_stream(stream, device_type_, device_id_);
    check(call_taking_lock([s](moecap_capturer* h) { return moecap_histogram_reset(h, s); }, false));
  }

  std::tuple<int64_t, int64_t, int64_t> local_rows(Index dp_rank, IndexSequence tokens_per_rank_arg,
                                                   Index padded_tokens_per_rank) {
    const bool graph = !padded_tokens_per_rank.is_none();
    const std::vector<int64_t> tokens_per_rank = int_list(tokens_per_rank_arg, "moecap_local_rows", "tokens_per_rank");
    moecap_batch batch{sizeof(moecap_batch),
                       graph ? MOECAP_BATCH_GRAPH : MOECAP_BATCH_EAGER,
                       int32_argument(dp_rank, "moecap_local_rows", "dp_rank"),
                       as_int32(static_cast<int64_t>(tokens_per_rank.size()), "moecap_local_rows",
                                "len(tokens_per_rank)"),
                       0,
                       tokens_per_rank.data(),
                       graph ? int_argument(padded_tokens_per_rank, "moecap_local_rows", "padded_tokens_per_rank") : 0};
    moecap_rows rows{sizeof(moecap_rows), 0, 0, 0};
    check(moecap_local_rows(live(), &batch, &rows), {{"batch->num_ranks", "len(tokens_per_rank)"}, {"batch->", ""}});
    return {rows.start, rows.count, rows.total};
  }

  nb::object export_view(Index which, Index layer) {
    DLManagedTensorVersioned* managed = nullptr;
    check(moecap_export(live(), int32_argument(which, "moecap_export", "which"),
                        int32_argument(layer, "moecap_export", "layer"), &managed));
    return make_dlpack_view(managed);
  }

  nb::dict plan() {
    moecap_plan_info info{};
    info.struct_size = sizeof info;
    check(moecap_get_plan(live(), &info));
    return plan_dict(info);
  }

  // A commit or invalidate on another thread that released the GIL may
  // have been recorded (or not) without having handed its tensors to the
  // recording's list yet. graph_begin and graph_end close the gate (new
  // commits and invalidations wait before they start), wait for those in
  // flight, and hold the GIL from their C call until the lists are swapped
  // (moves only: no Python runs there).
  class GraphGate {
   public:
    explicit GraphGate(Capturer& c) : c_(c) { ++c_.graph_waiting_; }
    GraphGate(const GraphGate&) = delete;
    GraphGate& operator=(const GraphGate&) = delete;
    ~GraphGate() { --c_.graph_waiting_; }

   private:
    Capturer& c_;
  };

  // Sleeps with the GIL released until `done()`; a signal (Ctrl-C) raises.
  template <class Done>
  static void wait_until(Done done) {
    while (!done()) {
      {
        GilRelease unlocked;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      if (PyErr_CheckSignals() != 0) throw nb::python_error();
    }
  }

  // Before a commit or invalidate counts itself in flight.
  void pass_graph_gate() {
    birth_.check("capturer");  // a count inherited from another process never drops
    wait_until([this] { return graph_waiting_ == 0; });
  }

  // A short C call that takes the capturer's lock, with the GIL held unless
  // a call on another thread released it. Only such a call can be holding
  // the lock (it let go of the GIL before taking the lock and gives the lock
  // back before taking the GIL again), and waiting for it with the GIL held
  // would stall every Python thread for as long as it runs (a read of many
  // slots). With none in flight, capture keeps the GIL: no release and
  // reacquire on the hot path. recordable: a graph may record the call.
  template <class Call>
  moecap_status call_taking_lock(Call c_call, bool recordable) {
    if (*in_flight_ == 0) return c_call(live());
    if (recordable) pass_graph_gate();
    moecap_capturer* h = live();
    Recordable recorded(*this, recordable);
    GilRelease unlocked(in_flight_.get());
    return c_call(h);
  }

  void graph_begin(nb::handle stream) {
    void* s = resolve_stream(stream, device_type_, device_id_);
    nb::list fresh;
    live();  // before waiting on counts another process may have left
    const GraphGate gate(*this);
    wait_until([this] { return recordable_in_flight_ == 0; });
    check(moecap_graph_begin(live(), s));
    recording_ = std::move(fresh);
    recording_on_ = true;
    recorded_commit_ = false;
  }

  Graph* graph_end() {
    nb::list fresh;
    moecap_graph* graph = nullptr;
    nb::list keep;
    {
      live();  // before waiting on counts another process may have left
      const GraphGate gate(*this);
      wait_until([this] { return recordable_in_flight_ == 0; });
      check(moecap_graph_end(live(), &graph));
      keep = std::move(recording_);
      recording_ = std::move(fresh);
      recording_on_ = false;
    }
    return new Graph(graph, std::move(keep), device_type_, device_id_, recorded_commit_ ? commits_ : nullptr,
                     in_flight_);
  }

  // Waits for calls in progress on other threads (they released the GIL),
  // refusing new ones meanwhile, then destroys the handle. A signal (Ctrl-C)
  // during the wait leaves the capturer open and usable.
  void close() {
    if (handle_ == nullptr) return;
    if (birth_.inherited()) {  // the parent's (Birth): leaked, and closed here
      handle_ = nullptr;
      recording_on_ = false;
      return;
    }
    closing_ = true;
    try {
      wait_until([this] { return *in_flight_ == 0; });
    } catch (...) {
      closing_ = false;
      throw;
    }
    closing_ = false;
    abandon_recording();
    check(moecap_destroy(handle_));
    handle_ = nullptr;
  }

  // moecap_destroy is refused while a graph is recorded, which left a
  // capturer dropped (or closed, or left by an exception out of its `with`)
  // mid-recording alive and unreachable: the recording is ended and its graph
  // freed first (on CUDA that also ends the stream capture graph_begin began).
  // Where moecap_graph_end fails the library still records: the tensors
  // held for the recording stay held, and moecap_destroy says so.
  void abandon_recording() {
    if (!recording_on_ || handle_ == nullptr) return;
    moecap_graph* graph = nullptr;
    if (moecap_graph_end(handle_, &graph) != MOECAP_OK) return;
    moecap_graph_destroy(graph);
    recording_.reset();  // no allocation: this also runs in the destructor
    recording_on_ = false;
  }

  bool is_closed() const { return handle_ == nullptr; }
  bool is_recording() const { return recording_on_; }

  // The cyclic collector's view: the tensors held for a recording graph or
  // for forked work. An unreachable capturer has no call in progress, so
  // clearing destroys the handle first (pending host-backend forked work
  // runs, or is waited for, while its tensors are still held), then lets go.
  int traverse(visitproc visit, void* arg) {
    Py_VISIT(recording_.ptr());
    Py_VISIT(forked_.ptr());
    return 0;
  }
  void clear() {
    if (birth_.inherited()) {
      handle_ = nullptr;  // the parent's (Birth): leaked
      recording_on_ = false;
    }
    abandon_recording();
    if (handle_ != nullptr && moecap_destroy(handle_) == MOECAP_OK) handle_ = nullptr;
    recording_ = nb::list();
    recording_on_ = false;
    forked_ = nb::list();
  }
  int32_t device_type() const { return device_type_; }
  int32_t device_id() const { return device_id_; }
  uint64_t commits() const { return *commits_; }

 private:
  moecap_capturer* live() {
    if (handle_ == nullptr || closing_) closed();
    birth_.check("capturer");
    return handle_;
  }
  nb::list* recording() { return recording_on_ ? &recording_ : nullptr; }
  // Where the tensors a call read are held: by the graph being recorded (for
  // its lifetime), or, with the side stream, until the next join (forked work
  // reads them after the call returns, and the caching allocator would hand
  // a dropped tensor's memory to the next op). Taken after the call: a join
  // meanwhile replaced the forked list, and a graph never begins or ends
  // while a call it may record is between its C call and here.
  nb::list* held() { return recording_on_ ? &recording_ : side_stream_ ? &forked_ : nullptr; }

  moecap_capturer* handle_ = nullptr;
  Birth birth_;
  // Calls from before their GIL release until their C call returned (GilRelease): counted with the GIL held,
  // uncounted without it, hence atomic. Shared with the capturer's graphs, whose launches count there.
  std::shared_ptr<std::atomic<int>> in_flight_ = std::make_shared<std::atomic<int>>(0);
  int recordable_in_flight_ = 0;  // ... of them, those a graph may record, until Recordable's end (the GIL guards it)
  int graph_waiting_ = 0;         // graph_begin / graph_end waiting for those: new ones wait
  // Commits that returned OK through this object or a graph of its recording (moecap.hf reads it).
  std::shared_ptr<uint64_t> commits_ = std::make_shared<uint64_t>(0);
  bool recorded_commit_ = false;  // the graph being recorded holds a commit
  bool closing_ = false;  // close() waits for in_flight_: no new calls
  int32_t device_type_, device_id_;
  nb::list recording_;
  bool recording_on_ = false;
  bool side_stream_;
  nb::list forked_;
};

// tp_traverse / tp_clear of a class holding Python lists: without them a
// tensor that refers back to its graph or capturer made a cycle the
// collector never freed. The type is visited as every heap type's instances must.
template <class T>
int gc_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;  // before or during __init__
  return nb::inst_ptr<T>(self)->traverse(visit, arg);
}

template <class T>
int gc_clear(PyObject* self) {
  if (nb::inst_ready(self)) nb::inst_ptr<T>(self)->clear();
  return 0;
}

template <class T>
PyType_Slot gc_slots[] = {{Py_tp_traverse, reinterpret_cast<void*>(gc_traverse<T>)},
                          {Py_tp_clear, reinterpret_cast<void*>(gc_clear<T>)},
                          {0, nullptr}};

// The #define'd bit sets of abi/moecap.h and abi/moecap_record.h as C++
// enums, so nanobind can export them as Python IntFlags beside the C enums.
enum class ConfigFlag : uint32_t {
  HISTOGRAM = MOECAP_FLAG_HISTOGRAM,
  GUARDS = MOECAP_FLAG_GUARDS,
  NO_GUARDS = MOECAP_FLAG_NO_GUARDS,
  SIDE_STREAM = MOECAP_FLAG_SIDE_STREAM,
};
enum class ReadFlag : uint32_t { NONBLOCKING = MOECAP_READ_NONBLOCKING, STRICT = MOECAP_READ_STRICT };
enum class SlotState : uint32_t {
  EMPTY = MOECAP_SLOT_EMPTY,
  VALID = MOECAP_SLOT_VALID,
  INVALID_IDS = MOECAP_SLOT_INVALID_IDS,
};
enum class RecordFlag : uint32_t {
  PACKED = MOECAP_RECORD_PACKED,
  HAS_WEIGHTS = MOECAP_RECORD_HAS_WEIGHTS,
  HAS_VALIDITY = MOECAP_RECORD_HAS_VALIDITY,
};

// Every enum, flag set, buffer id and status of the C ABI, named as in the
// header without its prefix: the Python package takes them from here, never
// from a copy of its own.
void bind_constants(nb::module_& m) {
  nb::enum_<moecap_status>(m, "Status", nb::is_arithmetic(), "moecap_status (abi/moecap.h).")
      .value("OK", MOECAP_OK)
      .value("INVALID_ARGUMENT", MOECAP_ERROR_INVALID_ARGUMENT)
      .value("OUT_OF_RANGE", MOECAP_ERROR_OUT_OF_RANGE)
      .value("CAPACITY", MOECAP_ERROR_CAPACITY)
      .value("NO_DEVICE", MOECAP_ERROR_NO_DEVICE)
      .value("DRIVER", MOECAP_ERROR_DRIVER)
      .value("OUT_OF_MEMORY", MOECAP_ERROR_OUT_OF_MEMORY)
      .value("ABI_MISMATCH", MOECAP_ERROR_ABI_MISMATCH)
      .value("NOT_READY", MOECAP_ERROR_NOT_READY)
      .value("CAPTURE_ILLEGAL", MOECAP_ERROR_CAPTURE_ILLEGAL)
      .value("INTERNAL", MOECAP_ERROR_INTERNAL)
      .value("ROWS_SKIPPED", MOECAP_ERROR_ROWS_SKIPPED)
      .value("STUB_DRIVER", MOECAP_ERROR_STUB_DRIVER)
      .value("DRIVER_TOO_OLD", MOECAP_ERROR_DRIVER_TOO_OLD)
      .value("CORRUPTION", MOECAP_ERROR_CORRUPTION)
      .value("NO_ROUTING", MOECAP_ERROR_NO_ROUTING);
  nb::enum_<moecap_id_dtype>(m, "IdDtype", nb::is_arithmetic(), "moecap_id_dtype: ids of the host cache and device buffer.")
      .value("AUTO", MOECAP_IDS_AUTO)
      .value("U8", MOECAP_IDS_U8)
      .value("U16", MOECAP_IDS_U16)
      .value("I32", MOECAP_IDS_I32)
      .value("I16", MOECAP_IDS_I16);
  nb::enum_<moecap_weight_dtype>(m, "WeightDtype", nb::is_arithmetic(), "moecap_weight_dtype: stored routing weights.")
      .value("NONE", MOECAP_WEIGHTS_NONE)
      .value("F32", MOECAP_WEIGHTS_F32)
      .value("BF16", MOECAP_WEIGHTS_BF16)
      .value("F16", MOECAP_WEIGHTS_F16);
  nb::enum_<moecap_device_type>(m, "DeviceType", nb::is_arithmetic(), "moecap_device_type (DLPack's DLDeviceType).")
      .value("HOST", MOECAP_DEVICE_HOST)
      .value("CUDA", MOECAP_DEVICE_CUDA);
  nb::enum_<moecap_buffer>(m, "Buffer", nb::is_arithmetic(), "moecap_buffer: what Capturer.export views.")
      .value("DEVICE_IDS", MOECAP_BUFFER_DEVICE_IDS)
      .value("DEVICE_WEIGHTS", MOECAP_BUFFER_DEVICE_WEIGHTS)
      .value("HOST_IDS", MOECAP_BUFFER_HOST_IDS)
      .value("HOST_WEIGHTS", MOECAP_BUFFER_HOST_WEIGHTS)
      .value("HISTOGRAM", MOECAP_BUFFER_HISTOGRAM)
      .value("LAYER_IDS", MOECAP_BUFFER_LAYER_IDS)
      .value("LAYER_WEIGHTS", MOECAP_BUFFER_LAYER_WEIGHTS)
      .value("HOST_STATES", MOECAP_BUFFER_HOST_STATES);
  nb::enum_<ConfigFlag>(m, "ConfigFlag", nb::is_flag(), nb::is_arithmetic(), "MOECAP_FLAG_*: moecap_config.flags.")
      .value("HISTOGRAM", ConfigFlag::HISTOGRAM)
      .value("GUARDS", ConfigFlag::GUARDS)
      .value("NO_GUARDS", ConfigFlag::NO_GUARDS)
      .value("SIDE_STREAM", ConfigFlag::SIDE_STREAM);
  nb::enum_<ReadFlag>(m, "ReadFlag", nb::is_flag(), nb::is_arithmetic(), "MOECAP_READ_*: moecap_read's flags.")
      .value("NONBLOCKING", ReadFlag::NONBLOCKING)
      .value("STRICT", ReadFlag::STRICT);
  nb::enum_<SlotState>(m, "SlotState", nb::is_flag(), nb::is_arithmetic(),
                       "MOECAP_SLOT_*: what a host-cache slot holds (MOECAP_BUFFER_HOST_STATES).")
      .value("EMPTY", SlotState::EMPTY)
      .value("VALID", SlotState::VALID)
      .value("INVALID_IDS", SlotState::INVALID_IDS);
  nb::enum_<RecordFlag>(m, "RecordFlag", nb::is_flag(), nb::is_arithmetic(),
                        "MOECAP_RECORD_*: the routing record header's flags (abi/moecap_record.h).")
      .value("PACKED", RecordFlag::PACKED)
      .value("HAS_WEIGHTS", RecordFlag::HAS_WEIGHTS)
      .value("HAS_VALIDITY", RecordFlag::HAS_VALIDITY);
  m.attr("ERRORS_CLEAR") = MOECAP_ERRORS_CLEAR;
  m.attr("RECORD_VERSION") = MOECAP_RECORD_VERSION;
  m.attr("RECORD_HEADER_BYTES") = MOECAP_RECORD_HEADER_BYTES;
}

void bind_config(nb::module_& m) {
  nb::class_<moecap_config>(m, "Config", "moecap_config (abi/moecap.h documents every field).")
      .def("__init__",
           [](moecap_config* c) {
             new (c) moecap_config{};
             c->struct_size = sizeof(moecap_config);
             check(moecap_config_init(c));  // the library's defaults (dp_size 1, AUTO ids, host, ...)
           })
      .def_rw("flags", &moecap_config::flags)
      .def_rw("num_layers", &moecap_config::num_layers)
      .def_rw("top_k", &moecap_config::top_k)
      .def_rw("extra_columns", &moecap_config::extra_columns)
      .def_rw("num_experts", &moecap_config::num_experts)
      .def_rw("dp_size", &moecap_config::dp_size)
      .def_rw("verify_tokens", &moecap_config::verify_tokens)
      .def_rw("max_running_requests", &moecap_config::max_running_requests)
      .def_rw("chunked_prefill_size", &moecap_config::chunked_prefill_size)
      .def_rw("max_graph_batch", &moecap_config::max_graph_batch)
      .def_rw("max_batch_tokens", &moecap_config::max_batch_tokens)
      .def_rw("host_slots", &moecap_config::host_slots)
      .def_rw("id_dtype", &moecap_config::id_dtype)
      .def_rw("weight_dtype", &moecap_config::weight_dtype)
      .def_rw("device_type", &moecap_config::device_type)
      .def_rw("device_id", &moecap_config::device_id)
      .def_rw("device_id_dtype", &moecap_config::device_id_dtype);
}

}  // namespace
}  // namespace moecap_python

using namespace moecap_python;

NB_MODULE(_moecap, m) {
  m.doc() = "libmoecap.so's C ABI, called directly (the moecap package wraps it).";
  pthread_atfork(nullptr, nullptr, [] { forks.fetch_add(1, std::memory_order_relaxed); });
  // A Capturer still referenced at exit from what Python never frees there (a torch autograd graph that saved
  // one: hf.attach's hooks under gradient checkpointing) made nanobind report moecap's types as leaked, "likely
  // caused by a reference counting issue in the binding code", which it is not. MOECAP_LEAK_WARNINGS=1 turns
  // the report back on, to look for a real one.
  const char* leak_warnings = std::getenv("MOECAP_LEAK_WARNINGS");
  nb::set_leak_warnings(leak_warnings != nullptr && std::string(leak_warnings) == "1");
  m.attr("ABI_VERSION") = MOECAP_ABI_VERSION;
  // The package's version as the wheel's metadata spells it (pyproject.toml reads the same three macros).
  m.attr("VERSION") = std::to_string(MOECAP_ABI_VERSION_MAJOR) + "." + std::to_string(MOECAP_ABI_VERSION_MINOR) + "." +
                      std::to_string(MOECAP_VERSION_PATCH);
  m.def("abi_version", &moecap_abi_version, "MOECAP_ABI_VERSION of the loaded library (major << 16 | minor).");
  m.def("status_name", [](int status) { return std::string(moecap_status_name(static_cast<moecap_status>(status))); });
  m.def(
      "plan",
      [](const moecap_config& config) {
        moecap_plan_info info{};
        info.struct_size = sizeof info;
        check(moecap_plan(&config, &info));
        return plan_dict(info);
      },
      "The layout for a config, without allocating.");
  m.def(
      "slots_for_read",
      [](Tensor tensor) -> std::pair<int64_t, nb::object> {
        Borrowed b;
        borrow(tensor, "slots", false, b);
        if (b.dl.ndim != 1) {
          raise_error(MOECAP_ERROR_INVALID_ARGUMENT,
                      "moecap_read: slots has ndim " + std::to_string(b.dl.ndim) + "; expected 1");
        }
        if (b.shape[0] < 0) {
          raise_error(MOECAP_ERROR_INVALID_ARGUMENT,
                      "moecap_read: slots.shape[0] is " + std::to_string(b.shape[0]) + "; must be >= 0");
        }
        // A producer's capsule is used up here (and some producers export
        // once): the read then borrows nanobind's array of it, not the producer.
        nb::object again = b.array.is_valid() ? nb::cast(b.array, nb::rv_policy::reference) : nb::object(tensor);
        return {b.shape[0], again};
      },
      // None too, so that it meets borrow's TypeError naming `slots`.
      nb::arg("slots").none(),
      "(entries, the slots to pass on to read_into) of a read's slots, any 1-D tensor (DLPack producers need not "
      "have len(), and are asked for their capsule once); MoecapError as moecap_read refuses another ndim.");
  m.def("_fast_paths", &set_fast_paths, nb::arg("exchange_api"), nb::arg("torch_attributes"),
        "Test hook: which tensor-description fast paths borrow() tries.");
  bind_constants(m);
  bind_config(m);
  bind_dlpack_view(m);
  bind_record(m);

  nb::class_<Graph>(m, "Graph", "A moecap-owned graph: replay with launch(); close() frees it.",
                   nb::type_slots(gc_slots<Graph>))
      .def("launch", &Graph::launch, nb::arg("stream") = nb::none())
      .def("native", &Graph::native, "The CUgraph (CUDA backend) to embed as a child graph node.")
      .def("close", &Graph::close);

  nb::class_<Capturer>(m, "Capturer", "One routed-experts capturer over libmoecap.so (abi/moecap.h).",
                      nb::type_slots(gc_slots<Capturer>))
      .def(nb::init<const moecap_config&>(), nb::arg("config"))
      .def("capture", &Capturer::capture, nb::arg("layer"), nb::arg("topk_ids"),
           nb::arg("topk_weights").none() = nb::none(), nb::arg("stream") = nb::none(),
           "One layer's [n, top_k(+extra)] ids (and weights) into device rows [0, n).")
      .def("_time_capture", &Capturer::time_capture, nb::arg("layer"), nb::arg("topk_ids"), nb::arg("iterations"),
           "Seconds per moecap_capture call with the borrowing done once (the C call's own cost).")
      .def("commit", &Capturer::commit, nb::arg("dst_slots"), nb::arg("src_start") = 0,
           nb::arg("src_rows").none() = nb::none(), nb::arg("stream") = nb::none(),
           "Device rows (src_start.. or src_rows) to host-cache slots; slot -1 drops the row.")
      .def("read_into", &Capturer::read_into, nb::arg("slots"), nb::arg("out"), nb::arg("weights_out").none() = nb::none(),
           nb::arg("nonblocking") = false, nb::arg("strict") = false, nb::arg("stream") = nb::none())
      .def("invalidate", &Capturer::invalidate, nb::arg("slots"), nb::arg("stream") = nb::none(),
           "Mark slots empty (their KV was freed): they read -1 until committed again; -1 entries are ignored.")
      .def("write", &Capturer::write, nb::arg("slots"), nb::arg("ids"), nb::arg("weights").none() = nb::none(),
           nb::arg("stream") = nb::none(), "Store rows captured elsewhere (the inverse of read).")
      .def("join", &Capturer::join, nb::arg("stream") = nb::none(),
           "side_stream: `stream` waits for every capture and commit forked so far (call it before the "
           "engine writes or frees a tensor they read); the tensors they read are held until then.")
      .def("synchronize", &Capturer::synchronize, "Wait until every enqueued commit landed.")
      .def("errors", &Capturer::errors, nb::arg("clear") = false,
           "{'skipped_rows', 'invalid_ids'}: problems found where no status could be returned.")
      .def("histogram_reset", &Capturer::histogram_reset, nb::arg("stream") = nb::none())
      .def("local_rows", &Capturer::local_rows, nb::arg("dp_rank"), nb::arg("tokens_per_rank"),
           nb::arg("padded_tokens_per_rank").none() = nb::none(),
           "(start, count, total) of this rank's rows; graph layout when padded_tokens_per_rank is given.")
      .def("export_view", &Capturer::export_view, nb::arg("which"), nb::arg("layer") = 0)
      .def("get_plan", &Capturer::plan)
      .def("graph_begin", &Capturer::graph_begin, nb::arg("stream") = nb::none())
      .def("graph_end", &Capturer::graph_end, nb::rv_policy::take_ownership)
      .def("close", &Capturer::close,
           "Release the handle (views and graphs keep the memory alive; a graph being recorded is abandoned). "
           "Waits for calls in progress on other threads (a signal during the wait raises and leaves it open); "
           "later calls raise ValueError.")
      .def_prop_ro("closed", &Capturer::is_closed)
      .def_prop_ro("recording", &Capturer::is_recording,
                   "Whether a graph_begin() recording is open: calls made now are recorded into it, not run.")
      .def_prop_ro("device_type", &Capturer::device_type)
      .def_prop_ro("device_id", &Capturer::device_id)
      .def_prop_ro("_commits", &Capturer::commits,
                   "Commits that returned OK through this object or a graph it recorded: moecap.hf tells a "
                   "forward whose rows were never committed by it.");
}
