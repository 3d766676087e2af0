// Host twins of capture_kernels.cu. The host backend runs these directly and
// its graph emulation records them with their parameters baked.
#include <cstring>

#include "kernel_ops.h"

namespace moecap {

namespace {

// The common case without weights or histogram, typed so the compiler can
// vectorize the narrowing; anything else takes the shared per-element path.
template <class In, class Out>
void capture_ids_only(const CaptureParams& p) {
  const In* src = static_cast<const In*>(p.ids);
  Out* dst = static_cast<Out*>(p.dst_ids);
  const Out invalid = static_cast<Out>(invalid_id_code(p.stored_id_elem));
  unsigned long long bad = 0;
  for (int64_t r = 0; r < p.n; ++r) {
    const In* in = src + r * p.in_cols;
    Out* out = dst + r * p.dst_row_stride;
    for (int32_t k = 0; k < p.top_k; ++k) {
      const In id = in[k];
      const bool ok = id >= 0 && id < p.num_experts;
      out[k] = ok ? static_cast<Out>(id) : invalid;
      bad += ok ? 0u : 1u;
    }
  }
  if (bad != 0) __atomic_fetch_add(&p.errors->invalid_ids, bad, __ATOMIC_RELAXED);
}

template <class In>
bool capture_fast(const CaptureParams& p) {
  switch (p.stored_id_elem) {
    case kU8: capture_ids_only<In, uint8_t>(p); return true;
    case kU16: capture_ids_only<In, uint16_t>(p); return true;
    case kI32: capture_ids_only<In, int32_t>(p); return true;
    default: return false;
  }
}

}  // namespace

void capture_on_host(const CaptureParams& p) {
  if (p.dst_weights == nullptr && p.histogram == nullptr) {
    if (p.ids_elem == kI32 ? capture_fast<int32_t>(p) : capture_fast<int64_t>(p)) return;
  }
  const int64_t elements = p.n * p.top_k;
  for (int64_t i = 0; i < elements; ++i) capture_element(p, i);
}

namespace {

// Typed over the slot and row-list index types, so the per-row loop has no
// dtype switch; the decision per row is the kernels' (commit_goes_to).
template <class Slot, class Row>
void commit_rows(const CommitParams& p) {
  const Slot* slots = static_cast<const Slot*>(p.dst_slots);
  const Row* rows = static_cast<const Row*>(p.src_rows);
  // Rows whose sources and slots both run consecutively (a prefill into a
  // fresh block of slots) go out as one copy.
  int64_t run_src = 0, run_slot = 0, run_len = 0;
  auto flush = [&] {
    if (run_len == 0) return;
    std::memcpy(p.dst_ids + run_slot * p.id_row_bytes, p.src_ids + run_src * p.id_row_bytes,
                static_cast<size_t>(run_len * p.id_row_bytes));
    if (p.weight_row_bytes > 0) {
      std::memcpy(p.dst_weights + run_slot * p.weight_row_bytes, p.src_weights + run_src * p.weight_row_bytes,
                  static_cast<size_t>(run_len * p.weight_row_bytes));
    }
    run_len = 0;
  };
  for (int64_t j = 0; j < p.count; ++j) {
    const int64_t slot = static_cast<int64_t>(slots[j]);
    const int64_t src = rows != nullptr ? static_cast<int64_t>(rows[j]) : p.src_start + j;
    if (!commit_goes_to(p, src, slot)) continue;
    if (run_len > 0 && src == run_src + run_len && slot == run_slot + run_len) {
      ++run_len;
      continue;
    }
    flush();
    run_src = src;
    run_slot = slot;
    run_len = 1;
  }
  flush();
}

template <class Slot>
void commit_with_slots(const CommitParams& p) {
  if (p.src_rows == nullptr || p.src_rows_elem == kI64) {
    commit_rows<Slot, int64_t>(p);
  } else {
    commit_rows<Slot, int32_t>(p);
  }
}

}  // namespace

void commit_on_host(const CommitParams& p) {
  if (p.dst_slots_elem == kI64) {
    commit_with_slots<int64_t>(p);
  } else {
    commit_with_slots<int32_t>(p);
  }
}

}  // namespace moecap
