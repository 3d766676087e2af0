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

// The stored value of an id outside [0, num_experts): all ones.
MOECAP_HD int64_t invalid_id_code(int32_t stored_elem) {
  return stored_elem == kU8 ? 0xff : stored_elem == kU16 ? 0xffff : -1;
}

// Element i of the [n, top_k] kept block: narrow one id, convert one weight.
MOECAP_HD void capture_element(const CaptureParams& p, int64_t i) {
  const int64_t row = i / p.top_k;
  const int64_t col = i - row * p.top_k;
  const int64_t src = row * p.in_cols + col;
  const int64_t dst = row * p.dst_row_stride + col;
  const int64_t id = load_int(p.ids, p.ids_elem, src);
  if (id >= 0 && id < p.num_experts) {
    store_int(p.dst_ids, p.stored_id_elem, dst, id);
    if (p.histogram != nullptr) count_event(&p.histogram[id]);
  } else {
    store_int(p.dst_ids, p.stored_id_elem, dst, invalid_id_code(p.stored_id_elem));
    count_event(&p.errors->invalid_ids);
  }
  if (p.dst_weights != nullptr) {
    store_float(p.dst_weights, p.stored_weight_elem, dst, load_float(p.weights, p.weights_elem, src));
  }
}

// Where row j of a commit goes. False when it goes nowhere: slot -1 drops it
// quietly; a slot or source row out of range is skipped and counted.
MOECAP_HD bool commit_goes_to(const CommitParams& p, int64_t src_row, int64_t slot) {
  if (slot == -1) return false;
  if (slot < -1 || slot >= p.host_slots || src_row < 0 || src_row >= p.device_rows) {
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

// Element i of a gather's [count, row_elements] output.
MOECAP_HD void gather_element(const GatherParams& p, int64_t i) {
  const int64_t t = i / p.row_elements;
  const int64_t e = i - t * p.row_elements;
  const int64_t at = load_int(p.slots, p.slots_elem, t) * p.row_elements + e;
  const int64_t id = load_int(p.src_ids, p.stored_id_elem, at);
  store_int(p.dst_ids, p.dst_id_elem, i, id == p.invalid_code ? -1 : id);
  if (p.dst_weights != nullptr) {
    store_float(p.dst_weights, p.dst_weight_elem, i, load_float(p.src_weights, p.stored_weight_elem, at));
  }
}

}  // namespace moecap
