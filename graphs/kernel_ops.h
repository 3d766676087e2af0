// The per-element and per-row logic of capture and commit, written once and
// compiled into both the CUDA kernels and their host twins.
#pragma once

#include "graphs/element.h"
#include "graphs/kernel_params.h"

namespace moecap {

MOECAP_HD void count_event(unsigned long long* counter) {
#if defined(__CUDA_ARCH__)
  atomicAdd(counter, 1ull);
#else
  __atomic_fetch_add(counter, 1ull, __ATOMIC_RELAXED);
#endif
}

// The stored value of an id outside [0, num_experts): all ones (-1 when signed).
MOECAP_HD int64_t invalid_id_code(int32_t stored_elem) {
  return stored_elem == kU8 ? 0xff : stored_elem == kU16 ? 0xffff : -1;
}

// Element i of the [n, top_k] kept block: narrow one id, convert one weight.
// The destination block is compact, so element i of it is i.
MOECAP_HD void capture_element(const CaptureParams& p, int64_t i) {
  const int64_t row = i / p.top_k;
  const int64_t col = i - row * p.top_k;
  const int64_t src = row * p.in_cols + col;
  const int64_t id = load_int(p.ids, p.ids_elem, src);
  if (id >= 0 && id < p.num_experts) {
    store_int(p.dst_ids, p.stored_id_elem, i, id);
    if (p.histogram != nullptr) count_event(&p.histogram[id]);
  } else {
    store_int(p.dst_ids, p.stored_id_elem, i, invalid_id_code(p.stored_id_elem));
    count_event(&p.errors->invalid_ids);
  }
  if (p.dst_weights != nullptr) {
    store_float(p.dst_weights, p.stored_weight_elem, i, load_float(p.weights, p.weights_elem, src));
  }
}

// Where row j of a commit goes. False when it goes nowhere: slot -1 drops it
// quietly; a slot or source row out of range is skipped and counted. An
// invalidation reads no row.
MOECAP_HD bool commit_goes_to(const CommitParams& p, int64_t src_row, int64_t slot) {
  if (slot == -1) return false;
  const bool row_ok = p.mode == kInvalidate || (src_row >= 0 && src_row < p.device_rows);
  if (slot < -1 || slot >= p.host_slots || !row_ok) {
    count_event(&p.errors->skipped_rows);
    return false;
  }
  return true;
}

MOECAP_HD bool commit_target(const CommitParams& p, int64_t j, int64_t* src_row, int64_t* slot) {
  *slot = load_int(p.dst_slots, p.dst_slots_elem, j);
  *src_row = p.src_rows != nullptr ? load_int(p.src_rows, p.src_rows_elem, j) : p.src_start + j;
  return commit_goes_to(p, *src_row, *slot);
}

// Copies element si of src to element di of dst, `bytes` wide, bit for bit.
MOECAP_HD void copy_element(void* dst, int64_t di, const void* src, int64_t si, int bytes) {
  if (bytes == 2) {
    static_cast<uint16_t*>(dst)[di] = static_cast<const uint16_t*>(src)[si];
  } else {
    static_cast<uint32_t*>(dst)[di] = static_cast<const uint32_t*>(src)[si];
  }
}

// Elements first, first + step, ... of one committed row: the device buffer's
// row `src` of every layer, narrowed into the host cache's row `slot`.
// Returns whether any id was outside [0, num_experts).
MOECAP_HD bool commit_row_elements(const CommitParams& p, int64_t src, int64_t slot, int64_t first, int64_t step) {
  const int64_t row = static_cast<int64_t>(p.num_layers) * p.top_k;
  const int weight_bytes = p.weight_elem >= 0 ? elem_bytes(p.weight_elem) : 0;
  bool bad = false;
  for (int64_t e = first; e < row; e += step) {
    const int64_t layer = e / p.top_k;
    const int64_t at = (layer * p.device_rows + src) * p.top_k + (e - layer * p.top_k);
    const int64_t id = load_int(p.src_ids, p.src_id_elem, at);
    const bool ok = id >= 0 && id < p.num_experts;
    bad = bad || !ok;
    store_int(p.dst_ids, p.dst_id_elem, slot * row + e, ok ? id : p.dst_no_expert);
    if (weight_bytes > 0) copy_element(p.dst_weights, slot * row + e, p.src_weights, at, weight_bytes);
  }
  return bad;
}

MOECAP_HD uint8_t committed_state(bool bad_ids) {
  return static_cast<uint8_t>(kSlotValid | (bad_ids ? kSlotInvalidIds : 0));
}

// Whether a slot's ids can be read as stored: it holds routing, and no
// out-of-range id hides behind a value that is also a real id.
MOECAP_HD bool slot_readable(uint8_t state, int64_t invalid_code) {
  return (state & kSlotValid) != 0 && !((state & kSlotInvalidIds) != 0 && invalid_code == INT64_MIN);
}

// Element i of a gather's [count, row_elements] output.
MOECAP_HD void gather_element(const GatherParams& p, int64_t i) {
  const int64_t t = i / p.row_elements;
  const int64_t e = i - t * p.row_elements;
  const int64_t slot = load_int(p.slots, p.slots_elem, t);
  const bool readable = slot_readable(p.states[slot], p.invalid_code);
  const int64_t at = slot * p.row_elements + e;
  const int64_t id = readable ? load_int(p.src_ids, p.stored_id_elem, at) : -1;
  store_int(p.dst_ids, p.dst_id_elem, i, id == p.invalid_code ? -1 : id);
  if (p.dst_weights != nullptr) {
    store_float(p.dst_weights, p.dst_weight_elem, i,
                readable ? load_float(p.src_weights, p.stored_weight_elem, at) : 0.0f);
  }
}

}  // namespace moecap
