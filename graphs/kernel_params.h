/* SPDX-License-Identifier: Apache-2.0 */
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
  unsigned long long invalid_ids;   // ids outside [0, num_experts) but -1 at capture, or written so into a layer view (counted at commit)
};

// What a host-cache slot holds; equal to the header's MOECAP_SLOT_* values
// (the kernels do not include the public header; the capturer checks).
enum SlotState : uint8_t {
  kSlotEmpty = 0,       // never committed, or invalidated
  kSlotValid = 1,       // committed or written routing
  kSlotInvalidIds = 2,  // with kSlotValid: some id is no real id (out of range, or a layer not written)
};

// Which device rows hold routing of the current step, so that a commit never
// takes a row an earlier step left behind (another rank's row at dp >= 2, a
// layer skipped or captured with fewer rows this step). A step starts at the
// first capture after a commit of rows; commits until the next capture belong
// to the same step (prefill part, decode part, accepted verify rows). Lives in
// the device block beside the error word; zero at create.
struct StepWord {
  unsigned long long claim_serial;  // CUDA claims: bumped by every release, the major key of each claim
  uint32_t step;                    // 0 until the first capture; then 1, 2, ... (0 skipped on wrap)
  uint32_t committed;               // 1 from a commit of rows until the next capture
};

// One per layer, after the StepWord.
struct LayerStamp {
  int64_t rows;   // rows [0, rows) of the layer were captured during `step`
  uint32_t step;  // step of the layer's last moecap_capture; 0: never captured (a kernel
                  // writing the layer view owns its rows: every row it commits counts as written)
  uint32_t pad_;
};

// One layer's top-k ids (and weights) into rows [0, n) of that layer's block.
struct CaptureParams {
  const void* ids;          // [n, in_cols], Elem kI32 or kI64
  const void* weights;      // [n, in_cols] or nullptr
  void* dst_ids;            // the layer's [device_rows, top_k] block of device ids
  void* dst_weights;        // same for weights, or nullptr
  unsigned long long* histogram;  // [num_experts] of this layer, or nullptr
  ErrorWord* errors;
  StepWord* step;           // the capturer's, or nullptr (no stamping)
  LayerStamp* stamp;        // this layer's
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
  uint8_t* src_ids;         // device buffer base, [num_layers, device_rows, top_k]; rows consumed (consume_element)
  uint8_t* src_weights;
  uint8_t* dst_ids;         // host cache base (device-mapped address on CUDA)
  uint8_t* dst_weights;
  uint8_t* dst_states;      // [host_slots] SlotState
  const void* src_rows;     // [count] row list, or nullptr for the range below
  const void* dst_slots;    // [count]
  ErrorWord* errors;
  StepWord* step;           // the capturer's step word, or nullptr (every row counts as written; no claims then:
                            // the release bumps the claims' serial in it)
  const LayerStamp* stamps; // [num_layers], beside it
  // Duplicate slots: the last entry wins. On CUDA, where rows run in any
  // order, the claim kernel raises claims[slot] to claim_serial *
  // (device_rows + 1) + 1 + entry (claim_value) for every entry before the
  // commit kernel; an entry writes its
  // slot only if the claim there is its own. Nothing is cleared: the release
  // kernel bumps claim_serial, so every claim of the next commit is above
  // every claim of this one, whatever slots the tensor held when each kernel
  // read it. nullptr where rows run in order (host twins), the slots are
  // known to be distinct (deduplicated at the call), or for invalidations
  // (idempotent).
  unsigned long long* claims;  // [host_slots]
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
// The host backend's commit: commit_on_host then release_on_host in effect,
// with the consumption of a row range folded into the commit's pass.
void commit_and_release_on_host(const CommitParams& p);
void take_errors_on_host(const TakeErrorsParams& p);

}  // namespace moecap
