/* SPDX-License-Identifier: Apache-2.0 */
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
    const int64_t none = invalid_id_code(p.stored_id_elem);
    store_int(p.dst_ids, p.stored_id_elem, i, none);
    // -1: the engine's own "no expert" (a padded row); in a layer's own rows,
    // the device dtype's (all ones) is the same.
    if (id != -1 && !(p.ids_elem == p.stored_id_elem && id == none)) count_event(&p.errors->invalid_ids);
  }
  if (p.dst_weights != nullptr) {
    store_float(p.dst_weights, p.stored_weight_elem, i, load_float(p.weights, p.weights_elem, src));
  }
}

// Whether an entry's source row exists: an invalidation reads no row.
MOECAP_HD bool source_ok(const CommitParams& p, int64_t src_row) {
  return p.mode == kInvalidate || (src_row >= 0 && src_row < p.device_rows);
}

// Where row j of a commit goes. False when it goes nowhere: slot -1 drops it
// quietly; a slot or source row out of range is skipped and counted.
MOECAP_HD bool commit_goes_to(const CommitParams& p, int64_t src_row, int64_t slot) {
  if (slot == -1) return false;
  if (slot < -1 || slot >= p.host_slots || !source_ok(p, src_row)) {
    count_event(&p.errors->skipped_rows);
    return false;
  }
  return true;
}

MOECAP_HD void commit_source(const CommitParams& p, int64_t j, int64_t* src_row, int64_t* slot) {
  *slot = load_int(p.dst_slots, p.dst_slots_elem, j);
  *src_row = p.src_rows != nullptr ? load_int(p.src_rows, p.src_rows_elem, j) : p.src_start + j;
}

MOECAP_HD bool commit_in_range(const CommitParams& p, int64_t src_row, int64_t slot) {
  return slot >= 0 && slot < p.host_slots && source_ok(p, src_row);
}

// The first capture after a commit of rows starts a step; a layer's stamp
// records the rows captured in it during the step (the most of several
// captures of one layer in a step). On CUDA one thread of the capture kernel
// runs this: captures are stream-ordered with each other and with commits.
MOECAP_HD void stamp_capture(const CaptureParams& p) {
  if (p.step == nullptr) return;
  if (p.step->committed != 0 || p.step->step == 0) {
    p.step->step = p.step->step + 1 == 0 ? 1u : p.step->step + 1;
    p.step->committed = 0;
  }
  if (p.stamp->step != p.step->step) {
    p.stamp->step = p.step->step;
    p.stamp->rows = p.n;
  } else if (p.stamp->rows < p.n) {
    p.stamp->rows = p.n;
  }
}

// Rows [0, result) of `layer` hold routing written this step. A layer never
// captured (written by a kernel through its view, or never written) counts
// every row: its rows hold what that kernel wrote, or create's "no routing".
MOECAP_HD int64_t layer_written_rows(const CommitParams& p, int64_t layer) {
  if (p.step == nullptr) return INT64_MAX;
  const LayerStamp s = p.stamps[layer];
  if (s.step == 0) return INT64_MAX;
  return s.step == p.step->step ? s.rows : 0;
}

// This commit's claim for entry j (see CommitParams::claims). Entries are
// 1..count <= device_rows, so claims order by (serial, entry) until the
// product passes 2^64 (some 10^13 commits at a million device rows); a
// serial shifted into the high 32 bits wrapped after 2^32 commits, below
// every claim taken before.
MOECAP_HD unsigned long long claim_value(const CommitParams& p, int64_t j) {
  const unsigned long long serial = p.step != nullptr ? p.step->claim_serial : 0ull;
  return serial * static_cast<unsigned long long>(p.device_rows + 1) + static_cast<unsigned long long>(j + 1);
}

// Entry j of a commit claims its slot: the largest entry wins (see CommitParams::claims).
MOECAP_HD void claim_slot(const CommitParams& p, int64_t j) {
  int64_t src = 0, slot = 0;
  commit_source(p, j, &src, &slot);
  if (!commit_in_range(p, src, slot)) return;
  const unsigned long long mine = claim_value(p, j);
#if defined(__CUDA_ARCH__)
  atomicMax(&p.claims[slot], mine);
#else
  if (p.claims[slot] < mine) p.claims[slot] = mine;  // host twins run one entry at a time
#endif
}

// Whether entry j, targeting `slot`, holds the slot's claim.
MOECAP_HD bool claim_won(const CommitParams& p, int64_t j, int64_t slot) {
  return p.claims == nullptr || p.claims[slot] == claim_value(p, j);
}

// A commit consumes the device rows it names: source row `src` of every
// layer goes back to "no routing" (the device dtype's all-ones code, -1 when
// signed; what create fills the buffer with), its weights to 0. So a row
// commits real routing only when every layer was written since the last
// commit, never what an earlier request left behind. Element e of the
// commit's [num_layers, count, top_k] grid, so that neighbouring elements
// are neighbouring stores (a row range is one contiguous run per layer).
MOECAP_HD void consume_element(const CommitParams& p, int64_t e) {
  const int64_t per_layer = p.count * p.top_k;
  const int64_t layer = e / per_layer;
  const int64_t rest = e - layer * per_layer;
  const int64_t j = rest / p.top_k;
  const int64_t k = rest - j * p.top_k;
  const int64_t src = p.src_rows != nullptr ? load_int(p.src_rows, p.src_rows_elem, j) : p.src_start + j;
  if (src < 0 || src >= p.device_rows) return;
  const int64_t at = (layer * p.device_rows + src) * p.top_k + k;
  store_int(p.src_ids, p.src_id_elem, at, invalid_id_code(p.src_id_elem));
  if (p.src_weights == nullptr) return;
  if (elem_bytes(p.weight_elem) == 2) {
    reinterpret_cast<uint16_t*>(p.src_weights)[at] = 0;
  } else {
    reinterpret_cast<uint32_t*>(p.src_weights)[at] = 0;
  }
}

// After every commit of rows, once (the release kernel's first thread, the
// host twin): the next capture starts a step, the next claims outrank this
// commit's.
MOECAP_HD void finish_commit(const CommitParams& p) {
  if (p.step == nullptr) return;
  if (p.mode == kCommitRows) p.step->committed = 1;
  if (p.claims != nullptr) p.step->claim_serial += 1;
}

// Where entry j goes, counting it when out of range; false as well when a
// later entry of the commit targets the same slot.
MOECAP_HD bool commit_target(const CommitParams& p, int64_t j, int64_t* src_row, int64_t* slot) {
  commit_source(p, j, src_row, slot);
  if (!commit_goes_to(p, *src_row, *slot)) return false;
  return claim_won(p, j, *slot);
}

MOECAP_HD void take_error(unsigned long long* counter, unsigned long long* out) {
#if defined(__CUDA_ARCH__)
  *out = atomicExch(counter, 0ull);
#else
  *out = __atomic_exchange_n(counter, 0ull, __ATOMIC_RELAXED);
#endif
}

#if defined(__CUDACC__)
using Vec16 = uint4;
#else
struct alignas(16) Vec16 {
  uint32_t x, y, z, w;
};
#endif

// Lane `lane` of `lanes` copies its share of a row of `bytes`, with the
// widest stores both addresses and the size allow. The destination is
// usually pinned host memory over the bus, where each store is a bus
// transaction: rows whose size is not a multiple of 4 (byte ids, odd layer
// counts) are stored 16 bytes at a time at the destination's alignment,
// assembled from byte loads of the source, with bytes only at the ends.
MOECAP_HD void copy_row(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane, int lanes) {
  const uintptr_t both = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                         static_cast<uintptr_t>(bytes);
  if ((both & 15u) == 0) {
    for (int64_t i = lane; i < bytes / 16; i += lanes) reinterpret_cast<Vec16*>(dst)[i] = reinterpret_cast<const Vec16*>(src)[i];
    return;
  }
  if ((both & 3u) == 0) {
    for (int64_t i = lane; i < bytes / 4; i += lanes)
      reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(src)[i];
    return;
  }
  const int64_t misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) & 15u);
  const int64_t head = misalign == 0 ? 0 : (16 - misalign < bytes ? 16 - misalign : bytes);
  const int64_t blocks = (bytes - head) / 16;
  for (int64_t i = lane; i < head; i += lanes) dst[i] = src[i];
  for (int64_t b = lane; b < blocks; b += lanes) {
    union {
      Vec16 v;
      uint8_t u[16];
    } pack;
    const uint8_t* from = src + head + b * 16;
    for (int k = 0; k < 16; ++k) pack.u[k] = from[k];
    reinterpret_cast<Vec16*>(dst + head)[b] = pack.v;
  }
  for (int64_t i = head + blocks * 16 + lane; i < bytes; i += lanes) dst[i] = src[i];
}

// Whether a device id read by commit is no real id. The no-routing code (a
// row no kernel wrote, or an id capture already counted) is not counted
// again; any other value outside [0, num_experts) was written by a kernel
// straight into a layer view and bumps invalid_ids.
MOECAP_HD bool committed_id_bad(const CommitParams& p, int64_t id) {
  if (id >= 0 && id < p.num_experts) return false;
  if (id != invalid_id_code(p.src_id_elem)) count_event(&p.errors->invalid_ids);
  return true;
}

// Element e of a committed row (layer e / top_k): the device buffer's row
// `src` of that layer, narrowed into element `at` of `out` in the host id
// dtype. Returns whether the id was outside [0, num_experts).
MOECAP_HD bool narrow_element(const CommitParams& p, int64_t src, int64_t e, void* out, int64_t at) {
  const int64_t layer = e / p.top_k;
  if (src >= layer_written_rows(p, layer)) {  // not written this step: no routing
    store_int(out, p.dst_id_elem, at, p.dst_no_expert);
    return true;
  }
  const int64_t from = (layer * p.device_rows + src) * p.top_k + (e - layer * p.top_k);
  const int64_t id = load_int(p.src_ids, p.src_id_elem, from);
  const bool bad = committed_id_bad(p, id);
  store_int(out, p.dst_id_elem, at, bad ? p.dst_no_expert : id);
  return bad;
}

// Weight e of a committed row, bit for bit (the stored weight dtype is the same on both sides).
MOECAP_HD void commit_weight(const CommitParams& p, int64_t src, int64_t slot, int64_t e) {
  const int64_t layer = e / p.top_k;
  const int64_t from = (layer * p.device_rows + src) * p.top_k + (e - layer * p.top_k);
  const int64_t to = slot * p.num_layers * p.top_k + e;
  const bool written = src < layer_written_rows(p, layer);
  if (elem_bytes(p.weight_elem) == 2) {
    reinterpret_cast<uint16_t*>(p.dst_weights)[to] = written ? reinterpret_cast<const uint16_t*>(p.src_weights)[from] : 0;
  } else {
    reinterpret_cast<uint32_t*>(p.dst_weights)[to] = written ? reinterpret_cast<const uint32_t*>(p.src_weights)[from] : 0;
  }
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
  const int64_t stored = readable ? load_int(p.src_ids, p.stored_id_elem, at) : -1;
  const int64_t id = stored == p.invalid_code ? -1 : stored;
  store_int(p.dst_ids, p.dst_id_elem, i, id);
  if (p.dst_weights == nullptr) return;
  if (id == -1) {  // an id read as -1 carries no weight
    store_float(p.dst_weights, p.dst_weight_elem, i, 0.0f);
  } else if (p.dst_weight_elem == p.stored_weight_elem) {  // bit for bit, NaN payloads too, as the host reads
    if (elem_bytes(p.dst_weight_elem) == 2) {
      static_cast<uint16_t*>(p.dst_weights)[i] = reinterpret_cast<const uint16_t*>(p.src_weights)[at];
    } else {
      static_cast<uint32_t*>(p.dst_weights)[i] = reinterpret_cast<const uint32_t*>(p.src_weights)[at];
    }
  } else {
    store_float(p.dst_weights, p.dst_weight_elem, i, load_float(p.src_weights, p.stored_weight_elem, at));
  }
}

// Host twins only: whether the commit's narrowing and the read's widening may
// use AVX2 where the CPU has it (the default); false runs the baseline code,
// so tests cover the path a CPU without AVX2 takes. Returns the previous
// setting; not for use while a commit or read runs.
bool allow_host_avx2(bool allowed);

}  // namespace moecap
