// Host twins of capture_kernels.cu. The host backend runs these directly and
// its graph emulation records them with their parameters baked.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

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

// Narrows n ids from the device dtype into the host cache's. "No expert" is
// all ones in every host dtype (invalid_id_code), so an out-of-range id
// becomes id | all-ones: no select, and the loop vectorizes. Returns nonzero
// when an id was outside [0, experts).
template <class S, class D>
uint32_t narrow_ids(const S* __restrict in, D* __restrict out, int64_t n, uint32_t experts) {
  // Compared at the source width (the plan keeps num_experts within it), so
  // the vector lanes stay narrow; as unsigned, one compare is both bounds: a
  // negative id wraps above experts.
  using U = std::make_unsigned_t<S>;
  const U limit = static_cast<U>(experts);
  U bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const U id = static_cast<U>(in[i]);
    const U outside = id >= limit ? U{1} : U{0};
    out[i] = static_cast<D>(static_cast<D>(id) | static_cast<D>(U{0} - outside));
    bad = static_cast<U>(bad | outside);
  }
  return bad;
}

// Rows in blocks: first where each row of the block goes (the kernels'
// decision, commit_goes_to), then layer by layer: the block's rows of that
// layer are narrowed in one vectorized pass (read in place when the source
// rows are consecutive, as in a prefill) and scattered to their slots. Rows
// keep list order within every layer, so a slot listed twice keeps its last row.
// TopK > 0 fixes the width at compile time (the common top-k values), so the
// per-row copies are single moves rather than calls.
template <int TopK, class S, class D>
void commit_rows(const CommitParams& p) {
  const int64_t top_k = TopK > 0 ? TopK : p.top_k;
  const int64_t row = p.num_layers * top_k;
  const int64_t layer_stride = p.device_rows * top_k;
  const int64_t block = std::max<int64_t>(1, 4096 / top_k);
  const uint32_t experts = static_cast<uint32_t>(p.num_experts);
  const int64_t w_bytes = p.weight_elem >= 0 ? elem_bytes(p.weight_elem) : 0;
  const size_t id_chunk = static_cast<size_t>(top_k) * sizeof(D);
  const size_t in_chunk = static_cast<size_t>(top_k) * sizeof(S);
  std::vector<int64_t> srcs(static_cast<size_t>(block)), slots(static_cast<size_t>(block));
  std::vector<uint8_t> bad(static_cast<size_t>(block));
  std::vector<S> gathered(static_cast<size_t>(block * top_k));
  std::vector<D> narrowed(static_cast<size_t>(block * top_k));
  for (int64_t first = 0; first < p.count; first += block) {
    int64_t n = 0;
    for (int64_t j = first; j < p.count && j < first + block; ++j) {
      int64_t src = 0, slot = 0;
      if (!commit_target(p, j, &src, &slot)) continue;
      if (p.mode == kInvalidate) {
        p.dst_states[slot] = kSlotEmpty;
        continue;
      }
      srcs[static_cast<size_t>(n)] = src;
      slots[static_cast<size_t>(n)] = slot;
      bad[static_cast<size_t>(n)] = 0;
      ++n;
    }
    bool consecutive = true;
    for (int64_t i = 1; i < n; ++i) consecutive = consecutive && srcs[static_cast<size_t>(i)] == srcs[0] + i;
    for (int64_t l = 0; l < p.num_layers; ++l) {
      const S* layer = reinterpret_cast<const S*>(p.src_ids) + l * layer_stride;
      const S* in = gathered.data();
      if (consecutive && n > 0) {
        in = layer + srcs[0] * top_k;
      } else {
        for (int64_t i = 0; i < n; ++i) {
          std::memcpy(gathered.data() + i * top_k, layer + srcs[static_cast<size_t>(i)] * top_k, in_chunk);
        }
      }
      if (narrow_ids(in, narrowed.data(), n * top_k, experts) != 0) {
        for (int64_t i = 0; i < n; ++i) {  // rare: which rows had an id out of range
          D probe[1];
          uint32_t row_bad = 0;
          for (int64_t k = 0; k < top_k; ++k) row_bad |= narrow_ids(in + i * top_k + k, probe, 1, experts);
          bad[static_cast<size_t>(i)] = static_cast<uint8_t>(bad[static_cast<size_t>(i)] | row_bad);
        }
      }
      D* out = reinterpret_cast<D*>(p.dst_ids) + l * top_k;
      for (int64_t i = 0; i < n; ++i) {
        std::memcpy(out + slots[static_cast<size_t>(i)] * row, narrowed.data() + i * top_k, id_chunk);
      }
      for (int64_t i = 0; w_bytes > 0 && i < n; ++i) {
        std::memcpy(p.dst_weights + (slots[static_cast<size_t>(i)] * row + l * top_k) * w_bytes,
                    p.src_weights + (l * layer_stride + srcs[static_cast<size_t>(i)] * top_k) * w_bytes,
                    static_cast<size_t>(top_k * w_bytes));
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      p.dst_states[slots[static_cast<size_t>(i)]] = committed_state(bad[static_cast<size_t>(i)] != 0);
    }
  }
}

template <class S, class D>
void commit_by_width(const CommitParams& p) {
  switch (p.top_k) {
    case 2: commit_rows<2, S, D>(p); break;
    case 4: commit_rows<4, S, D>(p); break;
    case 6: commit_rows<6, S, D>(p); break;
    case 8: commit_rows<8, S, D>(p); break;
    default: commit_rows<0, S, D>(p); break;
  }
}

template <class S>
void commit_from(const CommitParams& p) {
  switch (p.dst_id_elem) {
    case kU8: commit_by_width<S, uint8_t>(p); break;
    case kU16: commit_by_width<S, uint16_t>(p); break;
    case kI16: commit_by_width<S, int16_t>(p); break;
    default: commit_by_width<S, int32_t>(p); break;
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
    void* dst = static_cast<uint8_t*>(p.dst_ids) + t * row * out_bytes;
    uint8_t* wdst =
        p.dst_weights != nullptr ? static_cast<uint8_t*>(p.dst_weights) + t * row * elem_bytes(p.dst_weight_elem) : nullptr;
    if (!slot_readable(p.states[slot], p.invalid_code)) {
      std::memset(dst, 0xff, static_cast<size_t>(row * out_bytes));  // -1 in every integer width
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
