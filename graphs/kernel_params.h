// Parameters of moecap's device operations, as plain structs: the CUDA
// kernels take them by value and the host twins take the same struct, so a
// recorded operation is "this struct, baked". Pointers are device-visible
// addresses (host addresses on the host backend).
//
// Layouts: the device buffer is layer-major, [num_layers, device_rows,
// top_k], so one layer's rows are the compact block a top-k kernel writes;
// the host cache is slot-major, [host_slots, num_layers, top_k], so one
// request's rows are contiguous for read; beside it one state byte per slot.
#pragma once

#include <stdint.h>

namespace moecap {

// Counters the kernels bump where they cannot return an error.
struct ErrorWord {
  unsigned long long skipped_rows;  // commit rows whose slot or source row was out of range
  unsigned long long invalid_ids;   // captured ids outside [0, num_experts)
};

// What a host-cache slot holds; equal to the header's MOECAP_SLOT_* values
// (the kernels do not include the public header; the capturer checks).
enum SlotState : uint8_t {
  kSlotEmpty = 0,       // never committed, or invalidated
  kSlotValid = 1,       // committed or written routing
  kSlotInvalidIds = 2,  // with kSlotValid: some id was out of range at capture
};

// One layer's top-k ids (and weights) into rows [0, n) of that layer's block.
struct CaptureParams {
  const void* ids;          // [n, in_cols], Elem kI32 or kI64
  const void* weights;      // [n, in_cols] or nullptr
  void* dst_ids;            // the layer's [device_rows, top_k] block of device ids
  void* dst_weights;        // same for weights, or nullptr
  unsigned long long* histogram;  // [num_experts] of this layer, or nullptr
  ErrorWord* errors;
  int64_t n;
  int32_t in_cols;          // top_k, or top_k + extra_columns (dropped)
  int32_t top_k;
  int32_t ids_elem;         // input id Elem
  int32_t weights_elem;     // input weight Elem
  int32_t stored_id_elem;   // device id Elem: kU8 / kU16 / kI16 / kI32
  int32_t stored_weight_elem;
  int32_t num_experts;
  int32_t pad_;
};

enum CommitMode : int32_t {
  kCommitRows = 0,    // device rows -> host slots, narrowed; the slot becomes valid
  kInvalidate = 1,    // the slots become empty; no row is read
};

// Rows of the device buffer to host-cache slots; every layer, ids and
// weights. Rows are handled in list order, so a slot listed twice keeps its
// last row (the host twin; see capture_kernels.cu for the kernel).
struct CommitParams {
  const uint8_t* src_ids;   // device buffer base, [num_layers, device_rows, top_k]
  const uint8_t* src_weights;
  uint8_t* dst_ids;         // host cache base (device-mapped address on CUDA)
  uint8_t* dst_weights;
  uint8_t* dst_states;      // [host_slots] SlotState
  const void* src_rows;     // [count] row list, or nullptr for the range below
  const void* dst_slots;    // [count]
  ErrorWord* errors;
  // Duplicate slots: the last entry wins. On CUDA, where rows run in any
  // order, claims[slot] holds 1 + the last entry targeting the slot: set by
  // the claim kernel before the commit kernel, cleared by the release kernel
  // after it (0 between commits). nullptr where rows run in order (host
  // twins) or the slots are known to be distinct (deduplicated at the call).
  int32_t* claims;          // [host_slots]
  int64_t src_start;        // first row when src_rows is nullptr
  int64_t count;
  int64_t device_rows;
  int64_t host_slots;
  int64_t dst_no_expert;    // the host cache's stored "no expert" value
  int32_t mode;             // CommitMode
  int32_t num_layers;
  int32_t top_k;
  int32_t num_experts;
  int32_t src_id_elem;      // device id Elem
  int32_t dst_id_elem;      // host id Elem
  int32_t weight_elem;      // stored weight Elem (both sides), or -1 without weights
  int32_t src_rows_elem;    // kI32 / kI64
  int32_t dst_slots_elem;   // kI32 / kI64
  int32_t pad_;
};

// Host-cache rows of `count` slots into a caller tensor [count, row_elements],
// converting ids (stored "no expert" -> -1) and weights to the caller's
// dtypes; a slot without usable routing reads -1 ids and 0 weights.
struct GatherParams {
  const uint8_t* src_ids;   // host cache base (device-mapped address for the kernel)
  const uint8_t* src_weights;
  const uint8_t* states;    // [host_slots] SlotState
  const void* slots;        // [count], already checked to lie in [0, host_slots)
  void* dst_ids;            // [count, row_elements]
  void* dst_weights;        // or nullptr
  int64_t count;
  int64_t row_elements;
  int64_t invalid_code;     // the stored "no expert" value, or INT64_MIN when it is also a real id
  int32_t slots_elem;       // kI32 / kI64
  int32_t stored_id_elem;
  int32_t dst_id_elem;
  int32_t stored_weight_elem;
  int32_t dst_weight_elem;
  int32_t pad_;
};

// Reads the error counters and zeroes them in one atomic step per counter,
// so increments by replays running meanwhile are either read or kept.
struct TakeErrorsParams {
  ErrorWord* errors;
  ErrorWord* out;
};

// Host twins of the kernels in capture_kernels.cu: same parameters, same effect.
void capture_on_host(const CaptureParams& p);
void commit_on_host(const CommitParams& p);
void gather_on_host(const GatherParams& p);
void claim_on_host(const CommitParams& p);
void release_on_host(const CommitParams& p);
void take_errors_on_host(const TakeErrorsParams& p);

}  // namespace moecap
