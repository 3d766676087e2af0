// Host twins of capture_kernels.cu. The host backend runs these directly and
// its graph emulation records them with their parameters baked.
#include <cstring>

#include "graphs/kernel_ops.h"

namespace moecap {

namespace {

template <class S, class D>
void convert_ids(const S* src, D* dst, int64_t n, int64_t invalid_code) {
  if (invalid_code == INT64_MIN) {  // every stored value is a valid id: plain widening
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<D>(src[i]);
    return;
  }
  const S code = static_cast<S>(invalid_code);
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] == code ? static_cast<D>(-1) : static_cast<D>(src[i]);
}

// One row of stored ids into the caller's dtype, typed so it vectorizes.
template <class S>
void ids_from_stored(const S* src, void* dst, int32_t dst_elem, int64_t n, int64_t invalid_code) {
  switch (dst_elem) {
    case kU8: convert_ids(src, static_cast<uint8_t*>(dst), n, invalid_code); break;
    case kI8: convert_ids(src, static_cast<int8_t*>(dst), n, invalid_code); break;
    case kU16: convert_ids(src, static_cast<uint16_t*>(dst), n, invalid_code); break;
    case kI16: convert_ids(src, static_cast<int16_t*>(dst), n, invalid_code); break;
    case kI32: convert_ids(src, static_cast<int32_t*>(dst), n, invalid_code); break;
    default: convert_ids(src, static_cast<int64_t*>(dst), n, invalid_code); break;
  }
}

// The common case without weights or histogram, typed so the compiler can
// vectorize the narrowing; anything else takes the shared per-element path.
// TopK > 0 fixes the row width at compile time (the common top-k values),
// so each row narrows in a few vector instructions; 0 reads it at run time.
template <int TopK, class In, class Out>
void capture_ids_only(const CaptureParams& p) {
  const In* src = static_cast<const In*>(p.ids);
  Out* dst = static_cast<Out*>(p.dst_ids);
  const Out invalid = static_cast<Out>(invalid_id_code(p.stored_id_elem));
  const int32_t top_k = TopK > 0 ? TopK : p.top_k;
  const In experts = static_cast<In>(p.num_experts);
  unsigned long long bad = 0;
  for (int64_t r = 0; r < p.n; ++r) {
    const In* in = src + r * p.in_cols;
    Out* out = dst + r * p.dst_row_stride;
    for (int32_t k = 0; k < top_k; ++k) {
      const In id = in[k];
      const bool ok = id >= 0 && id < experts;
      out[k] = ok ? static_cast<Out>(id) : invalid;
      bad += ok ? 0u : 1u;
    }
  }
  if (bad != 0) __atomic_fetch_add(&p.errors->invalid_ids, bad, __ATOMIC_RELAXED);
}

template <class In, class Out>
void capture_ids_by_width(const CaptureParams& p) {
  switch (p.top_k) {
    case 2: capture_ids_only<2, In, Out>(p); break;
    case 4: capture_ids_only<4, In, Out>(p); break;
    case 6: capture_ids_only<6, In, Out>(p); break;
    case 8: capture_ids_only<8, In, Out>(p); break;
    default: capture_ids_only<0, In, Out>(p); break;
  }
}

template <class In>
bool capture_fast(const CaptureParams& p) {
  switch (p.stored_id_elem) {
    case kU8: capture_ids_by_width<In, uint8_t>(p); return true;
    case kU16: capture_ids_by_width<In, uint16_t>(p); return true;
    case kI32: capture_ids_by_width<In, int32_t>(p); return true;
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
    if (p.claims != nullptr && p.claims[slot] != static_cast<int32_t>(j + 1)) continue;
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

void claim_on_host(const CommitParams& p) {
  for (int64_t j = 0; j < p.count; ++j) claim_slot(p, j);
}

void release_on_host(const CommitParams& p) {
  for (int64_t j = 0; j < p.count; ++j) release_claim(p, j);
}

void take_errors_on_host(const TakeErrorsParams& p) {
  take_error(&p.errors->skipped_rows, &p.out->skipped_rows);
  take_error(&p.errors->invalid_ids, &p.out->invalid_ids);
}

void gather_on_host(const GatherParams& p) {
  const int64_t row = p.row_elements;
  const int64_t id_bytes = elem_bytes(p.stored_id_elem);
  const int64_t out_bytes = elem_bytes(p.dst_id_elem);
  for (int64_t t = 0; t < p.count; ++t) {
    const int64_t slot = load_int(p.slots, p.slots_elem, t);
    const uint8_t* src = p.src_ids + slot * row * id_bytes;
    void* dst = static_cast<uint8_t*>(p.dst_ids) + t * row * out_bytes;
    if (p.dst_id_elem == p.stored_id_elem) {
      // Same width: "no expert" as -1 truncates back to the stored all-ones value.
      std::memcpy(dst, src, static_cast<size_t>(row * out_bytes));
    } else if (p.stored_id_elem == kU8) {
      ids_from_stored(src, dst, p.dst_id_elem, row, p.invalid_code);
    } else if (p.stored_id_elem == kU16) {
      ids_from_stored(reinterpret_cast<const uint16_t*>(src), dst, p.dst_id_elem, row, p.invalid_code);
    } else {
      ids_from_stored(reinterpret_cast<const int32_t*>(src), dst, p.dst_id_elem, row, p.invalid_code);
    }
    if (p.dst_weights == nullptr) continue;
    const int64_t w_bytes = elem_bytes(p.stored_weight_elem);
    const uint8_t* wsrc = p.src_weights + slot * row * w_bytes;
    uint8_t* wdst = static_cast<uint8_t*>(p.dst_weights) + t * row * elem_bytes(p.dst_weight_elem);
    if (p.dst_weight_elem == p.stored_weight_elem) {
      std::memcpy(wdst, wsrc, static_cast<size_t>(row * w_bytes));
    } else {
      for (int64_t e = 0; e < row; ++e) store_float(wdst, p.dst_weight_elem, e, load_float(wsrc, p.stored_weight_elem, e));
    }
  }
}

}  // namespace moecap
