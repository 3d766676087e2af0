// SPDX-License-Identifier: Apache-2.0
#include "plugin/capturer.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "base/status.h"
#include "graphs/element.h"
#include "graphs/kernel_ops.h"
#include "plugin/abi_structs.h"
#include "plugin/tensor_args.h"

namespace moecap {
namespace {

constexpr size_t kAlign = 256;
constexpr size_t kGuardBytes = 64;
constexpr uint8_t kGuardByte = 0xA5;

size_t align_up(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

bool is_unsigned(int32_t elem) { return elem == kU8 || elem == kU16; }

static_assert(kSlotEmpty == MOECAP_SLOT_EMPTY && kSlotValid == MOECAP_SLOT_VALID &&
                  kSlotInvalidIds == MOECAP_SLOT_INVALID_IDS,
              "the kernels' slot states are the header's");

}  // namespace

Capturer::Capturer(const Plan& plan) : plan_(plan) {
  const moecap_config& c = plan_.config;
  backend_ = c.device_type == MOECAP_DEVICE_CUDA ? make_cuda_backend(plan_) : make_host_backend(plan_);
#ifndef NDEBUG
  guards_ = c.device_type == MOECAP_DEVICE_HOST;
#endif
  if (c.flags & MOECAP_FLAG_GUARDS) guards_ = true;
  if (c.flags & MOECAP_FLAG_NO_GUARDS) guards_ = false;
  const size_t guard = guards_ ? kGuardBytes : 0;

  size_t at = 0;
  auto place = [&](const char* name, uint64_t bytes) {
    Region r{name, at, static_cast<size_t>(bytes)};
    at = align_up(at + r.bytes + guard);
    return r;
  };
  device_ids_ = place("device ids", plan_.device_ids_bytes);
  device_weights_ = place("device weights", plan_.device_weights_bytes);
  histogram_ = place("histogram", plan_.histogram_bytes);
  error_word_ = place("error word", sizeof(ErrorWord));
  // Which rows each layer holds from the current step (kernel_params.h, StepWord).
  step_word_ = place("step stamps", sizeof(StepWord) + sizeof(LayerStamp) * static_cast<size_t>(c.num_layers));
  const size_t device_block_bytes = at;
  at = 0;
  host_ids_ = place("host ids", plan_.host_ids_bytes);
  host_weights_ = place("host weights", plan_.host_weights_bytes);
  host_states_ = place("host states", plan_.host_states_bytes);
  const size_t host_block_bytes = at;

  device_block_ = static_cast<uint8_t*>(backend_->alloc_device(device_block_bytes));
  try {
    host_block_ = static_cast<uint8_t*>(backend_->alloc_host(host_block_bytes));
    host_block_on_device_ = static_cast<uint8_t*>(backend_->device_address_of_host(host_block_));
    if (guards_) write_guards();
    // Every device row starts as "no routing" (all ones: -1 in a signed
    // dtype), as commit leaves the rows it consumes: a row no kernel wrote
    // never commits as routing.
    const std::vector<uint8_t> no_routing(static_cast<size_t>(device_ids_.bytes), 0xff);
    backend_->copy_host_to_device(device_block_ + device_ids_.offset, no_routing.data(), no_routing.size());
  } catch (...) {
    if (host_block_ != nullptr) backend_->free_host(host_block_);
    backend_->free_device(device_block_);
    throw;
  }
}

Capturer::~Capturer() {
  // Each wait on its own: one that fails (destroy at process exit may find
  // the driver gone, and the memory goes with it) must not skip the others.
  const auto wait = [](auto&& done) {
    try {
      done();
    } catch (...) {
    }
  };
  wait([&] { backend_->commits_done(true); });
  wait([&] { backend_->reads_done(nullptr); });  // reads into GPU tensors still gather from the cache freed below
  wait([&] { backend_->launches_done(); });      // captures still queued write the device memory freed below
  backend_->free_host(host_block_);
  backend_->free_device(device_block_);
}

void Capturer::require_stream(EngineStream stream) {
  if (recording_ && stream != recording_stream_) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "stream differs from the one moecap_graph_begin records on");
  }
}

void Capturer::require_not_recording() const {
  if (recording_) fail(MOECAP_ERROR_CAPTURE_ILLEGAL, "not allowed while moecap records a graph");
}

void Capturer::require_not_capturing(EngineStream stream) {
  require_not_recording();
  if (!stream.is_legacy_default() && backend_->stream_capturing(stream)) {
    fail(MOECAP_ERROR_CAPTURE_ILLEGAL, "not allowed while its stream is being captured into a graph");
  }
}

void Capturer::require_kernel_readable(const DLTensor* t, const char* name) const {
  if (!backend_->kernel_can_read(t->device)) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, name, " is on ", device_name(t->device), "; the capturer is on ",
         device_name(backend_->device()));
  }
}

void Capturer::require_host_memory(const DLTensor* t, const char* name) {
  if (!Backend::host_can_read(t->device)) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, name, " is on ", device_name(t->device), "; expected host memory");
  }
}

bool Capturer::staged_index(const DLTensor* t, const char* name, bool graph) const {
  if (!graph && Backend::host_can_read(t->device)) return true;
  if (!Backend::host_can_read(t->device)) {
    require_kernel_readable(t, name);
    return false;
  }
  // In a graph: the host backend's replays read host memory as it is then,
  // which is the model of device memory there.
  if (on_host()) return false;
  fail(MOECAP_ERROR_CAPTURE_ILLEGAL, name, " is in host memory (", device_name(t->device),
       "), which a graph replay would read at replay time, after the engine refilled it for a later step; ",
       "copy it to a device tensor on the stream (cudaMemcpyAsync) and pass that");
}

void Capturer::check_request_rows(const DLTensor* t, const char* name, int64_t rows, const char* rows_from) const {
  check_dim(t, name, 0, rows, rows_from);
  check_dim(t, name, 1, plan_.config.num_layers, "num_layers");
  check_dim(t, name, 2, plan_.config.top_k, "top_k");
}

void Capturer::settle(bool block, const Backend::SlotList* slots, std::unique_lock<std::mutex>* lock) {
  if (!backend_->commits_done(block, slots, lock)) {
    fail(MOECAP_ERROR_NOT_READY, "commits to these slots are still in flight (MOECAP_READ_NONBLOCKING)");
  }
  check_counters();
}

void Capturer::check_counters() {
  ErrorWord word{};
  backend_->copy_device_to_host(&word, device_block_ + error_word_.offset, sizeof word);
  if (word.skipped_rows > 0) {
    fail(MOECAP_ERROR_ROWS_SKIPPED, word.skipped_rows,
         " rows of commits or invalidations were skipped (slot outside [-1, host_slots = ", plan_.config.host_slots,
         ") or source row outside [0, device_rows = ", plan_.device_rows,
         ")); moecap_get_errors with MOECAP_ERRORS_CLEAR acknowledges them");
  }
  check_guards(true);
}

namespace {

// Index of the first value outside [lowest, limit), or n: a branch-free scan
// the compiler vectorizes, since a clean tensor is the common case.
template <class T>
int64_t first_outside(const T* v, int64_t n, int64_t lowest, int64_t limit) {
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) bad |= static_cast<int64_t>(v[i]) < lowest || static_cast<int64_t>(v[i]) >= limit;
  if (!bad) return n;
  int64_t i = 0;
  while (static_cast<int64_t>(v[i]) >= lowest && static_cast<int64_t>(v[i]) < limit) ++i;
  return i;
}

}  // namespace

void Capturer::check_host_slots(const DLTensor* slots, const char* name, bool allow_drop, int64_t limit) const {
  const uint8_t* data = tensor_data(slots);
  const int64_t n = slots->shape[0];
  const int64_t lowest = allow_drop ? -1 : 0;
  const int64_t i = elem_of(slots->dtype) == kI64 ? first_outside(reinterpret_cast<const int64_t*>(data), n, lowest, limit)
                                                  : first_outside(reinterpret_cast<const int32_t*>(data), n, lowest, limit);
  if (i < n) {
    fail(MOECAP_ERROR_OUT_OF_RANGE, name, "[", i, "] is ", load_int(data, elem_of(slots->dtype), i), "; it must be in [",
         lowest, ", ", limit, ")");
  }
}

void Capturer::capture(int32_t layer, const DLTensor* ids, const DLTensor* weights, EngineStream stream) {
  const moecap_config& c = plan_.config;
  require_stream(stream);
  if (layer < 0 || layer >= c.num_layers) {
    fail(MOECAP_ERROR_OUT_OF_RANGE, "layer is ", layer, "; it must be in [0, num_layers = ", c.num_layers, ")");
  }
  const int64_t layer_offset = layer * plan_.layer_elements();
  uint8_t* const layer_ids = device_block_ + device_ids_.offset + layer_offset * plan_.device_id_bytes;
  // The layer's own rows (a top-k kernel wrote them through the layer view)
  // come in the device dtype, int16 by default; any other ids are int32/int64.
  const bool own_ids = ids != nullptr && ids->ndim == 2 && ids->shape != nullptr && ids->shape[1] == c.top_k &&
                       elem_of(ids->dtype) == plan_.device_id_elem && tensor_data(ids) == layer_ids;
  if (!own_ids && ids != nullptr && elem_of(ids->dtype) == plan_.device_id_elem && plan_.device_id_elem != kI32) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "topk_ids has dtype ", elem_name(plan_.device_id_elem),
         ", the device dtype, which capture takes only as exactly the layer's own rows in place (rows [0, n) of "
         "its layer view); other ids are int32 or int64");
  }
  const int32_t ids_elem = own_ids ? check_tensor(ids, {"topk_ids", {plan_.device_id_elem}, 2})
                                   : check_tensor(ids, {"topk_ids", {kI32, kI64}, 2});
  require_kernel_readable(ids, "topk_ids");
  const int64_t n = ids->shape[0];
  const int64_t cols = ids->shape[1];
  if (cols != c.top_k && cols != int64_t{c.top_k} + c.extra_columns) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "topk_ids->shape[1] is ", cols, "; expected top_k (", c.top_k,
         ") or top_k + extra_columns (", c.top_k + c.extra_columns, ")");
  }
  if (n > plan_.device_rows) {
    fail(MOECAP_ERROR_CAPACITY, "topk_ids has ", n, " rows; device_rows is ", plan_.device_rows, " (dp_size ",
         c.dp_size, " * rows_per_rank ", plan_.rows_per_rank, ")");
  }
  int32_t weights_elem = -1;
  if (plan_.has_weights()) {
    if (weights == nullptr) {
      fail(MOECAP_ERROR_INVALID_ARGUMENT, "topk_weights is NULL; the capturer keeps weights (config->weight_dtype is ",
           elem_name(plan_.weight_elem), "), so every capture passes them");
    }
    weights_elem = check_tensor(weights, {"topk_weights", {kF32, kBF16, kF16}, 2});
    check_same_shape(weights, "topk_weights", ids, "topk_ids");
    require_kernel_readable(weights, "topk_weights");
  } else if (weights != nullptr) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "topk_weights is given but config->weight_dtype is MOECAP_WEIGHTS_NONE");
  }

  // Even with no rows the call is enqueued: it starts a step and stamps the
  // layer as holding none of it, so the rows an earlier step left there
  // commit as "no routing".
  CaptureParams p{};
  p.ids = tensor_data(ids);
  p.weights = weights_elem >= 0 ? tensor_data(weights) : nullptr;
  p.dst_ids = layer_ids;
  p.dst_weights = weights_elem >= 0 ? device_block_ + device_weights_.offset + layer_offset * plan_.weight_bytes
                                    : nullptr;
  const bool as_stored = cols == c.top_k;
  require_outside_device_block(ids, "topk_ids", as_stored && ids_elem == plan_.device_id_elem ? p.dst_ids : nullptr);
  if (weights_elem >= 0) {
    require_outside_device_block(weights, "topk_weights",
                                 as_stored && weights_elem == plan_.weight_elem ? p.dst_weights : nullptr);
  }
  if (!recording_) check_guards(on_host());
  p.histogram = plan_.has_histogram() ? reinterpret_cast<unsigned long long*>(device_block_ + histogram_.offset) +
                                            static_cast<int64_t>(layer) * c.num_experts
                                      : nullptr;
  p.errors = reinterpret_cast<ErrorWord*>(device_block_ + error_word_.offset);
  p.step = step_word();
  p.stamp = layer_stamps() + layer;
  p.n = n;
  p.in_cols = static_cast<int32_t>(cols);
  p.top_k = c.top_k;
  p.ids_elem = ids_elem;
  p.weights_elem = weights_elem;
  p.stored_id_elem = plan_.device_id_elem;
  p.stored_weight_elem = plan_.weight_elem;
  p.num_experts = c.num_experts;
  backend_->capture(p, stream);
}

void Capturer::commit(const moecap_commit_args* caller_args, EngineStream stream, std::unique_lock<std::mutex>* lock) {
  const LockHold hold(lock);
  const moecap_commit_args args_copy = read_struct(caller_args, MOECAP_COMMIT_ARGS_SIZE_1_0, "args");
  const moecap_commit_args* args = &args_copy;
  require_stream(stream);
  const bool graph = recording_ || (!stream.is_legacy_default() && backend_->stream_capturing(stream));

  const DLTensor* slots = args->dst_slots;
  const int32_t slots_elem = check_tensor(slots, {"args->dst_slots", {kI32, kI64}, 1});
  const int64_t count = slots->shape[0];
  if (count > plan_.device_rows) {
    fail(MOECAP_ERROR_CAPACITY, "args->dst_slots has ", count, " entries; device_rows is ", plan_.device_rows);
  }
  const bool slots_on_host = staged_index(slots, "args->dst_slots", graph);
  require_outside_device_block(slots, "args->dst_slots", nullptr);  // the rows it reads are consumed as it goes

  int32_t rows_elem = kI64;
  bool rows_on_host = false;
  const DLTensor* rows = args->src_rows;
  if (rows == nullptr) {
    if (args->src_start < 0) {
      fail(MOECAP_ERROR_OUT_OF_RANGE, "args->src_start is ", args->src_start, "; it must be >= 0");
    }
    if (args->src_start > plan_.device_rows - count) {
      fail(MOECAP_ERROR_CAPACITY, "args->src_start + count is ", args->src_start, " + ", count,
           "; rows must lie in [0, device_rows = ", plan_.device_rows, ")");
    }
  } else {
    rows_elem = check_tensor(rows, {"args->src_rows", {kI32, kI64}, 1});
    check_dim(rows, "args->src_rows", 0, count, "entries of args->dst_slots");
    rows_on_host = staged_index(rows, "args->src_rows", graph);
    require_outside_device_block(rows, "args->src_rows", nullptr);
    if (!graph && Backend::host_can_read(rows->device)) {
      check_host_slots(rows, "args->src_rows", false, plan_.device_rows);
    }
  }
  // Values the host can see now are checked now; a replay checks in the kernel.
  if (!graph && Backend::host_can_read(slots->device)) {
    check_host_slots(slots, "args->dst_slots", true, plan_.config.host_slots);
  }
  if (!graph) check_guards(on_host());
  // An empty commit (a DP rank without tokens this step) moves no row but
  // still ends the step, as the header promises of every commit: enqueued
  // like any other, so the next capture starts a new step and the rows this
  // step wrote stop counting.

  CommitParams p = commit_params(kCommitRows);
  p.src_rows = rows != nullptr ? tensor_data(rows) : nullptr;
  p.dst_slots = tensor_data(slots);
  p.src_start = rows != nullptr ? 0 : args->src_start;
  p.count = count;
  p.src_rows_elem = rows_elem;
  p.dst_slots_elem = slots_elem;
  backend_->commit(p, Backend::CommitPlacement{slots_on_host, rows_on_host, graph}, stream);
}

CommitParams Capturer::commit_params(int32_t mode) const {
  const moecap_config& c = plan_.config;
  CommitParams p{};
  p.mode = mode;
  p.src_ids = device_block_ + device_ids_.offset;
  p.src_weights = plan_.has_weights() ? device_block_ + device_weights_.offset : nullptr;
  p.dst_ids = host_block_on_device_ + host_ids_.offset;
  p.dst_weights = plan_.has_weights() ? host_block_on_device_ + host_weights_.offset : nullptr;
  p.dst_states = host_block_on_device_ + host_states_.offset;
  p.errors = reinterpret_cast<ErrorWord*>(device_block_ + error_word_.offset);
  p.step = step_word();
  p.stamps = layer_stamps();
  p.device_rows = plan_.device_rows;
  p.host_slots = c.host_slots;
  p.dst_no_expert = plan_.no_expert;
  p.num_layers = c.num_layers;
  p.top_k = c.top_k;
  p.num_experts = c.num_experts;
  p.src_id_elem = plan_.device_id_elem;
  p.dst_id_elem = plan_.id_elem;
  p.weight_elem = plan_.weight_elem;
  p.src_rows_elem = kI64;
  return p;
}

void Capturer::invalidate(const DLTensor* slots, EngineStream stream, std::unique_lock<std::mutex>* lock) {
  const LockHold hold(lock);
  require_stream(stream);
  const bool graph = recording_ || (!stream.is_legacy_default() && backend_->stream_capturing(stream));
  const int32_t slots_elem = check_tensor(slots, {"slots", {kI32, kI64}, 1});
  const bool slots_on_host = staged_index(slots, "slots", graph);
  if (!graph && Backend::host_can_read(slots->device)) check_host_slots(slots, "slots", true, plan_.config.host_slots);
  if (!graph) check_guards(on_host());
  const int64_t count = slots->shape[0];
  // Host slots are copied at the call into one of the backend's snapshot
  // entries, which hold a commit's lists (device_rows entries each): a longer
  // list (a long request's KV) is enqueued in pieces, in order.
  const int64_t piece = slots_on_host ? plan_.device_rows : count;
  for (int64_t first = 0; first < count; first += piece) {
    CommitParams p = commit_params(kInvalidate);
    p.dst_slots = tensor_data(slots) + first * elem_bytes(slots_elem);
    p.count = std::min(piece, count - first);
    p.dst_slots_elem = slots_elem;
    backend_->commit(p, Backend::CommitPlacement{slots_on_host, false, graph}, stream);
  }
}

void Capturer::join(EngineStream stream) {
  require_stream(stream);
  backend_->join(stream);
}

void Capturer::join_before_replay(EngineStream stream) {
  backend_->join(stream);
  backend_->order_after_reads(stream);
}

// What read writes into: the ids output's dtype and where both outputs are.
struct Capturer::ReadOutputs {
  int32_t id_elem;
  int32_t weight_elem;  // -1 without weights_out
  bool on_device;       // on the capturer's GPU (a gather kernel), else host memory
};

Capturer::ReadOutputs Capturer::check_read_outputs(DLTensor* ids_out, DLTensor* weights_out, int64_t t,
                                                   bool strict) const {
  const moecap_config& c = plan_.config;
  ReadOutputs o{};
  o.id_elem = check_tensor(ids_out, {"ids_out", {kU8, kI8, kU16, kI16, kI32, kI64}, 3});
  o.on_device = !Backend::host_can_read(ids_out->device);
  if (o.on_device && !backend_->kernel_can_read(ids_out->device)) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "ids_out is on ", device_name(ids_out->device),
         "; expected host memory or the capturer's device (", device_name(backend_->device()), ")");
  }
  check_request_rows(ids_out, "ids_out", t, "entries of slots");
  if (id_limit(o.id_elem) < c.num_experts) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "ids_out has dtype ", elem_name(o.id_elem), ", which holds ids below ",
         id_limit(o.id_elem), "; num_experts is ", c.num_experts);
  }
  if (!strict && is_unsigned(o.id_elem) && id_limit(o.id_elem) == c.num_experts) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "ids_out has dtype ", elem_name(o.id_elem), ", where -1 (no routing) reads as ",
         id_limit(o.id_elem) - 1, ", a real expert id with num_experts ", c.num_experts,
         "; use a signed dtype, or MOECAP_READ_STRICT");
  }
  o.weight_elem = -1;
  if (weights_out != nullptr) {
    if (!plan_.has_weights()) {
      fail(MOECAP_ERROR_INVALID_ARGUMENT, "weights_out is given but config->weight_dtype is MOECAP_WEIGHTS_NONE");
    }
    o.weight_elem = check_tensor(weights_out, {"weights_out", {kF32, kBF16, kF16}, 3});
    if (Backend::host_can_read(weights_out->device) == o.on_device) {
      fail(MOECAP_ERROR_INVALID_ARGUMENT, "weights_out is on ", device_name(weights_out->device), " but ids_out on ",
           device_name(ids_out->device), "; both must be host memory or both device memory");
    }
    check_same_shape(weights_out, "weights_out", ids_out, "ids_out");
  }
  return o;
}

void Capturer::read(const DLTensor* slots, DLTensor* ids_out, DLTensor* weights_out, uint32_t flags, EngineStream stream,
                    std::unique_lock<std::mutex>* lock) {
  const LockHold hold(lock);
  require_not_capturing(stream);
  constexpr uint32_t kKnownFlags = MOECAP_READ_NONBLOCKING | MOECAP_READ_STRICT;
  if ((flags & ~kKnownFlags) != 0) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "flags has unknown bits 0x", std::hex, (flags & ~kKnownFlags));
  }
  const bool strict = (flags & MOECAP_READ_STRICT) != 0;
  check_tensor(slots, {"slots", {kI32, kI64}, 1});
  require_host_memory(slots, "slots");
  const int64_t t = slots->shape[0];
  const ReadOutputs out = check_read_outputs(ids_out, weights_out, t, strict);
  // The gather loads each slot as it writes the rows before it, and reads
  // the cache it would be writing: outputs share memory with neither.
  require_disjoint(ids_out, "ids_out", slots, "slots");
  require_disjoint(weights_out, "weights_out", slots, "slots");
  require_disjoint(weights_out, "weights_out", ids_out, "ids_out");
  require_outside_host_cache(ids_out, "ids_out");
  require_outside_host_cache(weights_out, "weights_out");
  // Written there, the rows would commit later as some token's routing.
  require_outside_device_block(ids_out, "ids_out", nullptr);
  require_outside_device_block(weights_out, "weights_out", nullptr);
  check_host_slots(slots, "slots", false, plan_.config.host_slots);
  const Backend::SlotList slot_list{tensor_data(slots), elem_of(slots->dtype), t};
  // Device outputs: the gather waits for the commits on `stream`, not the
  // host; STRICT reads the slots' states on the host, so it waits as a host
  // output does.
  if (out.on_device && !strict) {
    check_counters();
  } else {
    settle((flags & MOECAP_READ_NONBLOCKING) == 0, &slot_list, lock);
  }
  if (strict) require_routing(slots);
  if (t == 0) return;

  const uint8_t* cache = out.on_device ? host_block_on_device_ : host_block_;
  GatherParams g{};
  g.src_ids = cache + host_ids_.offset;
  g.src_weights = cache + host_weights_.offset;
  g.states = cache + host_states_.offset;
  g.slots = tensor_data(slots);
  g.dst_ids = tensor_data(ids_out);
  g.dst_weights = out.weight_elem >= 0 ? tensor_data(weights_out) : nullptr;
  g.count = t;
  g.row_elements = plan_.row_elements;
  g.invalid_code = plan_.no_expert_is_id ? INT64_MIN : plan_.no_expert;
  g.slots_elem = elem_of(slots->dtype);
  g.stored_id_elem = plan_.id_elem;
  g.dst_id_elem = out.id_elem;
  g.stored_weight_elem = plan_.weight_elem;
  g.dst_weight_elem = out.weight_elem;
  if (out.on_device) {
    backend_->gather(g, stream);
  } else {
    gather_on_host(g);
  }
}

void Capturer::require_routing(const DLTensor* slots) const {
  const uint8_t* states = host_block_ + host_states_.offset;
  const int32_t elem = elem_of(slots->dtype);
  int64_t first = -1, missing = 0;
  for (int64_t i = 0; i < slots->shape[0]; ++i) {
    if (states[load_int(tensor_data(slots), elem, i)] != kSlotValid) {
      if (first < 0) first = i;
      ++missing;
    }
  }
  if (missing > 0) {
    const int64_t slot = load_int(tensor_data(slots), elem, first);
    fail(MOECAP_ERROR_NO_ROUTING, "slots[", first, "] = ", slot, " ",
         states[slot] == kSlotEmpty ? "holds no committed routing (never committed, or invalidated)"
                                    : why_no_routing(slot),
         "; ", missing, " of ", slots->shape[0], " slots have no usable routing (MOECAP_READ_STRICT)");
  }
}

// A VALID | INVALID_IDS slot has two causes, told apart by what it stores.
// Commit consumes device rows, so a row no capture (or top-k kernel) wrote
// again in some layer commits that whole layer as "no expert"; an id out of
// range at capture, or a bad value written into a layer view, makes single
// ids "no expert". A layer of all "no expert" is named as the first cause
// (it is also what a layer of only bad ids gives). Where the host dtype has
// no spare value (u8 with 256 experts), the stored ids cannot say which.
std::string Capturer::why_no_routing(int64_t slot) const {
  const moecap_config& c = plan_.config;
  if (plan_.no_expert_is_id) {
    return cat("holds ids that are no real expert: a layer not captured again since the row's last commit, or ids "
               "out of range (with ", c.num_experts, " experts in ", elem_name(plan_.id_elem),
               " the two cannot be told apart)");
  }
  const uint8_t* row = host_block_ + host_ids_.offset + slot * plan_.id_row_bytes();
  int32_t partial_layer = -1;
  for (int32_t layer = 0; layer < c.num_layers; ++layer) {
    int32_t none = 0;
    for (int32_t k = 0; k < c.top_k; ++k) {
      none += load_int(row, plan_.id_elem, int64_t{layer} * c.top_k + k) == plan_.no_expert ? 1 : 0;
    }
    if (none == c.top_k) {
      return cat("has no routing in layer ", layer, ": its row was not captured again in that layer before it was "
                 "committed (commit consumes rows), or every id there was out of range (or -1 in moecap_write)");
    }
    if (none > 0 && partial_layer < 0) partial_layer = layer;
  }
  return cat("holds ids that were out of range in layer ", partial_layer,
             " (at capture, or written so into a layer view by a kernel)");
}

// Where write's inputs are read from: host tensors in place, device tensors
// through a host copy made after the caller's stream finished writing them.
struct HostView {
  DLTensor tensor{};
  std::vector<uint8_t> copy;
};

HostView Capturer::host_view(const DLTensor* t, const char* name, EngineStream stream) {
  HostView v;
  v.tensor = *t;
  if (Backend::host_can_read(t->device)) return v;
  if (!backend_->kernel_can_read(t->device)) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, name, " is on ", device_name(t->device),
         "; expected host memory or the capturer's device (", device_name(backend_->device()), ")");
  }
  v.copy.resize(static_cast<size_t>(element_count(t) * elem_bytes(elem_of(t->dtype))));
  backend_->wait_stream(stream);
  backend_->copy_device_to_host(v.copy.data(), tensor_data(t), v.copy.size());
  v.tensor.data = v.copy.data();
  v.tensor.byte_offset = 0;
  v.tensor.device = DLDevice{kDLCPU, 0};
  return v;
}

void Capturer::require_outside_device_block(const DLTensor* t, const char* name, const void* own) const {
  if (t == nullptr || (own != nullptr && tensor_data(t) == own)) return;
  if (overlaps(t, device_block_, step_word_.offset + step_word_.bytes)) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, name, " lies in the capturer's device buffer (an exported device_ids, ",
         "device_weights, layer or histogram view)",
         own != nullptr ? " other than exactly the layer's own rows in their stored dtype and width" : "",
         "; pass a copy");
  }
}

void Capturer::require_outside_host_cache(const DLTensor* t, const char* name) const {
  if (t == nullptr) return;
  const size_t cache_bytes = host_states_.offset + host_states_.bytes;
  if (overlaps(t, host_block_, cache_bytes)) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, name, " lies in the capturer's host cache (an exported host_ids, host_weights "
         "or host_states view); pass a copy");
  }
}

void Capturer::write(const DLTensor* slots, const DLTensor* ids, const DLTensor* weights, EngineStream stream,
                     std::unique_lock<std::mutex>* lock) {
  const LockHold hold(lock);
  const moecap_config& c = plan_.config;
  require_not_capturing(stream);
  check_tensor(slots, {"slots", {kI32, kI64}, 1});
  require_host_memory(slots, "slots");
  const int64_t t = slots->shape[0];
  const int32_t in_elem = check_tensor(ids, {"ids", {kU8, kI8, kU16, kI16, kI32, kI64}, 3});
  check_request_rows(ids, "ids", t, "entries of slots");
  int32_t w_elem = -1;
  if (plan_.has_weights()) {
    if (weights == nullptr) {
      fail(MOECAP_ERROR_INVALID_ARGUMENT, "weights is NULL; the capturer keeps weights (config->weight_dtype is ",
           elem_name(plan_.weight_elem), "), so every write passes them");
    }
    w_elem = check_tensor(weights, {"weights", {kF32, kBF16, kF16}, 3});
    check_same_shape(weights, "weights", ids, "ids");
  } else if (weights != nullptr) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "weights is given but config->weight_dtype is MOECAP_WEIGHTS_NONE");
  }
  // Rows are stored slot by slot while later slots and ids are still to be
  // loaded: none of them may lie in the cache being written.
  require_outside_host_cache(slots, "slots");
  require_outside_host_cache(ids, "ids");
  require_outside_host_cache(weights, "weights");
  check_host_slots(slots, "slots", false, c.host_slots);
  const HostView id_view = host_view(ids, "ids", stream);
  const HostView w_view = w_elem >= 0 ? host_view(weights, "weights", stream) : HostView{};
  const int64_t row = plan_.row_elements;
  const uint8_t* in = tensor_data(&id_view.tensor);
  // -1 is "no routing"; in an unsigned dtype it is all ones, as moecap_read
  // writes it there (never a real id: read allows the dtype only above every id).
  const int64_t all_ones = in_elem == kU8 ? 0xFF : in_elem == kU16 ? 0xFFFF : -1;
  const auto id_at = [&](int64_t i) {
    const int64_t v = load_int(in, in_elem, i);
    return v == all_ones && v >= c.num_experts ? int64_t{-1} : v;
  };
  for (int64_t i = 0; i < t * row; ++i) {
    const int64_t v = id_at(i);
    if (v >= c.num_experts || v < -1) {
      fail(MOECAP_ERROR_OUT_OF_RANGE, "ids[", i / row, "][", (i % row) / c.top_k, "][", i % c.top_k, "] is ", v,
           "; ids must be in [0, num_experts = ", c.num_experts, ") or -1 (all ones in an unsigned dtype)");
    }
  }
  // The host writes these rows now: after every queued read of them into
  // device tensors, and every commit that may write them.
  const Backend::SlotList slot_list{tensor_data(slots), elem_of(slots->dtype), t};
  backend_->reads_done(&slot_list);
  settle(true, &slot_list, lock);

  uint8_t* host_ids = host_block_ + host_ids_.offset;
  uint8_t* host_w = host_block_ + host_weights_.offset;
  uint8_t* states = host_block_ + host_states_.offset;
  const int32_t slot_elem = elem_of(slots->dtype);
  for (int64_t i = 0; i < t; ++i) {
    const int64_t slot = load_int(tensor_data(slots), slot_elem, i);
    uint8_t* dst = host_ids + slot * plan_.id_row_bytes();
    int64_t none = 0;
    for (int64_t e = 0; e < row; ++e) {
      const int64_t v = id_at(i * row + e);
      none += v == -1 ? 1 : 0;
      store_int(dst, plan_.id_elem, e, v == -1 ? plan_.no_expert : v);
    }
    if (w_elem >= 0) {
      uint8_t* wdst = host_w + slot * plan_.weight_row_bytes();
      for (int64_t e = 0; e < row; ++e) {
        store_float(wdst, plan_.weight_elem, e, load_float(tensor_data(&w_view.tensor), w_elem, i * row + e));
      }
    }
    // A token read from an empty slot elsewhere (all -1) stays empty here.
    states[slot] = none == row ? static_cast<uint8_t>(kSlotEmpty) : committed_state(none > 0);
  }
}

void Capturer::finish_work(std::unique_lock<std::mutex>* lock) noexcept {
  try {
    backend_->commits_done(true, nullptr, lock);
  } catch (...) {
    // A driver that is gone (destroy at process exit) has no work left to wait for.
  }
}

void Capturer::synchronize(std::unique_lock<std::mutex>* lock) {
  const LockHold hold(lock);
  require_not_recording();
  settle(true, nullptr, lock);
  backend_->launches_done();
}

moecap_error_counts Capturer::errors(bool clear, std::unique_lock<std::mutex>* lock) {
  const LockHold hold(lock);
  require_not_recording();
  backend_->commits_done(true, nullptr, lock);
  check_guards(true);  // before the counters are taken (and, with clear, reset)
  const ErrorWord word = backend_->take_errors(reinterpret_cast<ErrorWord*>(device_block_ + error_word_.offset), clear);
  moecap_error_counts out{};
  out.struct_size = sizeof out;
  out.skipped_rows = word.skipped_rows;
  out.invalid_ids = word.invalid_ids;
  return out;
}

void Capturer::histogram_reset(EngineStream stream) {
  if (!plan_.has_histogram()) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "the capturer was created without ",
         "MOECAP_FLAG_HISTOGRAM");
  }
  require_stream(stream);
  backend_->zero_device(device_block_ + histogram_.offset, histogram_.bytes, stream);
}

BufferView Capturer::view(int32_t which, int32_t layer) const {
  const moecap_config& c = plan_.config;
  BufferView v{};
  // A compact row-major view of `ndim` extents.
  auto compact = [&](const uint8_t* base, size_t offset, int32_t elem, DLDevice dev,
                     std::initializer_list<int64_t> shape) {
    v.data = const_cast<uint8_t*>(base) + offset;
    v.device = dev;
    v.dtype = dtype_of(elem);
    v.ndim = static_cast<int32_t>(shape.size());
    int32_t d = 0;
    for (int64_t extent : shape) v.shape[d++] = extent;
    int64_t stride = 1;
    for (d = v.ndim - 1; d >= 0; --d) {
      v.strides[d] = stride;
      stride *= v.shape[d];
    }
  };
  const bool weights = which == MOECAP_BUFFER_DEVICE_WEIGHTS || which == MOECAP_BUFFER_HOST_WEIGHTS ||
                       which == MOECAP_BUFFER_LAYER_WEIGHTS;
  if (weights && !plan_.has_weights()) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "which is a weights buffer but config->weight_dtype is MOECAP_WEIGHTS_NONE");
  }
  const DLDevice host{kDLCPU, 0};
  const DLDevice dev = backend_->device();
  switch (which) {
    case MOECAP_BUFFER_DEVICE_IDS:
      compact(device_block_, device_ids_.offset, plan_.device_id_elem, dev, {c.num_layers, plan_.device_rows, c.top_k});
      break;
    case MOECAP_BUFFER_DEVICE_WEIGHTS:
      compact(device_block_, device_weights_.offset, plan_.weight_elem, dev, {c.num_layers, plan_.device_rows, c.top_k});
      break;
    case MOECAP_BUFFER_HOST_IDS:
      compact(host_block_, host_ids_.offset, plan_.id_elem, host, {c.host_slots, c.num_layers, c.top_k});
      break;
    case MOECAP_BUFFER_HOST_WEIGHTS:
      compact(host_block_, host_weights_.offset, plan_.weight_elem, host, {c.host_slots, c.num_layers, c.top_k});
      break;
    case MOECAP_BUFFER_HOST_STATES: compact(host_block_, host_states_.offset, kU8, host, {c.host_slots}); break;
    case MOECAP_BUFFER_HISTOGRAM:
      if (!plan_.has_histogram()) {
        fail(MOECAP_ERROR_INVALID_ARGUMENT, "which is MOECAP_BUFFER_HISTOGRAM but the capturer was created without ",
             "MOECAP_FLAG_HISTOGRAM");
      }
      compact(device_block_, histogram_.offset, kI64, dev, {c.num_layers, c.num_experts});
      break;
    case MOECAP_BUFFER_LAYER_IDS:
    case MOECAP_BUFFER_LAYER_WEIGHTS: {
      if (layer < 0 || layer >= c.num_layers) {
        fail(MOECAP_ERROR_OUT_OF_RANGE, "layer is ", layer, "; it must be in [0, num_layers = ", c.num_layers, ")");
      }
      const bool ids = which == MOECAP_BUFFER_LAYER_IDS;
      const int32_t elem = ids ? plan_.device_id_elem : plan_.weight_elem;
      const size_t offset = (ids ? device_ids_ : device_weights_).offset +
                            static_cast<size_t>(layer * plan_.layer_elements() * elem_bytes(elem));
      compact(device_block_, offset, elem, dev, {plan_.device_rows, c.top_k});
      break;
    }
    default:
      fail(MOECAP_ERROR_INVALID_ARGUMENT, "which is ", which, "; expected a moecap_buffer (1..8)");
  }
  return v;
}

void Capturer::graph_begin(EngineStream stream) {
  if (recording_) fail(MOECAP_ERROR_CAPTURE_ILLEGAL, "this capturer already records a graph");
  if (plan_.config.device_type == MOECAP_DEVICE_CUDA && stream.is_legacy_default()) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "stream is NULL; the legacy default stream cannot be ",
         "captured");
  }
  if (!stream.is_legacy_default() && backend_->stream_capturing(stream)) {
    fail(MOECAP_ERROR_CAPTURE_ILLEGAL, "stream is already being captured; call moecap ",
         "directly inside the engine's own capture instead");
  }
  backend_->begin_graph(stream);
  recording_ = true;
  recording_stream_ = stream;
}

std::unique_ptr<BackendGraph> Capturer::graph_end() {
  if (!recording_) fail(MOECAP_ERROR_INVALID_ARGUMENT, "no moecap_graph_begin on this capturer");
  // Recording ends with the capture: if ending it fails and the stream still
  // captures, the capturer still records (graph_end may be retried).
  try {
    // A capture cannot end with an unjoined branch; the replay is whole.
    backend_->join(recording_stream_);
    std::unique_ptr<BackendGraph> graph = backend_->end_graph();
    recording_ = false;
    recording_stream_ = EngineStream::legacy_default();
    return graph;
  } catch (...) {
    if (!backend_->stream_capturing(recording_stream_)) {
      recording_ = false;
      recording_stream_ = EngineStream::legacy_default();
    }
    throw;
  }
}

void Capturer::write_guards() {
  std::vector<uint8_t> pattern(kGuardBytes, kGuardByte);
  for (const Region* r : {&device_ids_, &device_weights_, &histogram_, &error_word_, &step_word_}) {
    backend_->copy_host_to_device(device_block_ + r->offset + r->bytes, pattern.data(), kGuardBytes);
  }
  for (const Region* r : {&host_ids_, &host_weights_, &host_states_}) {
    std::memcpy(host_block_ + r->offset + r->bytes, pattern.data(), kGuardBytes);
  }
}

const char* Capturer::damaged_guard(bool device_regions) {
  if (!guards_) return nullptr;
  uint8_t seen[kGuardBytes];
  auto intact = [&](const uint8_t* p) {
    for (size_t i = 0; i < kGuardBytes; ++i)
      if (p[i] != kGuardByte) return false;
    return true;
  };
  for (const Region* r : {&host_ids_, &host_weights_, &host_states_}) {
    if (!intact(host_block_ + r->offset + r->bytes)) return r->name;
  }
  if (!device_regions) return nullptr;
  for (const Region* r : {&device_ids_, &device_weights_, &histogram_, &error_word_, &step_word_}) {
    backend_->copy_device_to_host(seen, device_block_ + r->offset + r->bytes, kGuardBytes);
    if (!intact(seen)) return r->name;
  }
  return nullptr;
}

void Capturer::check_guards(bool device_regions) {
  if (const char* region = damaged_guard(device_regions)) {
    fail(MOECAP_ERROR_CORRUPTION, "the guard after the ", region,
         " buffer was overwritten: something wrote past its end");
  }
}

}  // namespace moecap
