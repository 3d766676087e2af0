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
    Out* out = dst + r * top_k;
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
    case kI16: capture_ids_by_width<In, int16_t>(p); return true;
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

// One layer's top_k ids of a committed row, narrowed from the device dtype
// into the host cache's; typed so it vectorizes. Returns whether any id was
// outside [0, experts).
template <class S, class D>
bool narrow_ids(const S* src, D* dst, int32_t top_k, int64_t experts, D no_expert) {
  bool bad = false;
  for (int32_t k = 0; k < top_k; ++k) {
    const int64_t id = static_cast<int64_t>(src[k]);
    const bool ok = id >= 0 && id < experts;
    dst[k] = ok ? static_cast<D>(id) : no_expert;
    bad |= !ok;
  }
  return bad;
}

// Rows in list order, so a slot listed twice keeps its last row; the
// decision per row is the kernels' (commit_goes_to).
template <class S, class D>
void commit_rows(const CommitParams& p) {
  const int64_t row = static_cast<int64_t>(p.num_layers) * p.top_k;
  const int64_t layer_stride = p.device_rows * p.top_k;
  const D no_expert = static_cast<D>(p.dst_no_expert);
  const int64_t w_bytes = p.weight_elem >= 0 ? elem_bytes(p.weight_elem) : 0;
  for (int64_t j = 0; j < p.count; ++j) {
    int64_t src = 0, slot = 0;
    if (!commit_target(p, j, &src, &slot)) continue;
    if (p.mode == kInvalidate) {
      p.dst_states[slot] = kSlotEmpty;
      continue;
    }
    const S* in = reinterpret_cast<const S*>(p.src_ids) + src * p.top_k;
    D* out = reinterpret_cast<D*>(p.dst_ids) + slot * row;
    bool bad = false;
    for (int32_t l = 0; l < p.num_layers; ++l) {
      bad |= narrow_ids(in + l * layer_stride, out + l * p.top_k, p.top_k, p.num_experts, no_expert);
    }
    for (int32_t l = 0; w_bytes > 0 && l < p.num_layers; ++l) {
      std::memcpy(p.dst_weights + (slot * row + l * p.top_k) * w_bytes,
                  p.src_weights + (l * layer_stride + src * p.top_k) * w_bytes, static_cast<size_t>(p.top_k * w_bytes));
    }
    p.dst_states[slot] = committed_state(bad);
  }
}

template <class S>
void commit_from(const CommitParams& p) {
  switch (p.dst_id_elem) {
    case kU8: commit_rows<S, uint8_t>(p); break;
    case kU16: commit_rows<S, uint16_t>(p); break;
    case kI16: commit_rows<S, int16_t>(p); break;
    default: commit_rows<S, int32_t>(p); break;
  }
}

}  // namespace

void commit_on_host(const CommitParams& p) {
  switch (p.src_id_elem) {
    case kU8: commit_from<uint8_t>(p); break;
    case kU16: commit_from<uint16_t>(p); break;
    case kI16: commit_from<int16_t>(p); break;
    default: commit_from<int32_t>(p); break;
  }
}

void gather_on_host(const GatherParams& p) {
  const int64_t row = p.row_elements;
  const int64_t id_bytes = elem_bytes(p.stored_id_elem);
  const int64_t out_bytes = elem_bytes(p.dst_id_elem);
  for (int64_t t = 0; t < p.count; ++t) {
    const int64_t slot = load_int(p.slots, p.slots_elem, t);
    void* dst = static_cast<uint8_t*>(p.dst_ids) + t * row * out_bytes;
    uint8_t* wdst =
        p.dst_weights != nullptr ? static_cast<uint8_t*>(p.dst_weights) + t * row * elem_bytes(p.dst_weight_elem) : nullptr;
    if (!slot_readable(p.states[slot], p.invalid_code)) {
      for (int64_t e = 0; e < row; ++e) store_int(dst, p.dst_id_elem, e, -1);
      if (wdst != nullptr) std::memset(wdst, 0, static_cast<size_t>(row * elem_bytes(p.dst_weight_elem)));
      continue;
    }
    const uint8_t* src = p.src_ids + slot * row * id_bytes;
    if (p.dst_id_elem == p.stored_id_elem) {
      // Same width: "no expert" as -1 truncates back to the stored all-ones value.
      std::memcpy(dst, src, static_cast<size_t>(row * out_bytes));
    } else if (p.stored_id_elem == kU8) {
      ids_from_stored(src, dst, p.dst_id_elem, row, p.invalid_code);
    } else if (p.stored_id_elem == kU16) {
      ids_from_stored(reinterpret_cast<const uint16_t*>(src), dst, p.dst_id_elem, row, p.invalid_code);
    } else if (p.stored_id_elem == kI16) {
      ids_from_stored(reinterpret_cast<const int16_t*>(src), dst, p.dst_id_elem, row, p.invalid_code);
    } else {
      ids_from_stored(reinterpret_cast<const int32_t*>(src), dst, p.dst_id_elem, row, p.invalid_code);
    }
    if (wdst == nullptr) continue;
    const int64_t w_bytes = elem_bytes(p.stored_weight_elem);
    const uint8_t* wsrc = p.src_weights + slot * row * w_bytes;
    if (p.dst_weight_elem == p.stored_weight_elem) {
      std::memcpy(wdst, wsrc, static_cast<size_t>(row * w_bytes));
    } else {
      for (int64_t e = 0; e < row; ++e) store_float(wdst, p.dst_weight_elem, e, load_float(wsrc, p.stored_weight_elem, e));
    }
  }
}

}  // namespace moecap
