// SPDX-License-Identifier: Apache-2.0
// Host twins of capture_kernels.cu. The host backend runs these directly and
// its graph emulation records them with their parameters baked.
#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

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
      bad += ok || id == -1 ? 0u : 1u;  // -1: the engine's own "no expert" (a padded row)
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

bool capture_flat_i32(const CaptureParams& p);

}  // namespace

void capture_on_host(const CaptureParams& p) {
  stamp_capture(p);
  // A layer's own rows (ids in place, in the device dtype) take the
  // per-element path: it counts each bad id before overwriting it.
  if (p.dst_weights == nullptr && p.histogram == nullptr && p.ids != p.dst_ids) {
    if (p.ids_elem == kI32 && p.in_cols == p.top_k && capture_flat_i32(p)) return;
    if (p.ids_elem == kI32 ? capture_fast<int32_t>(p) : p.ids_elem == kI64 && capture_fast<int64_t>(p)) return;
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
inline __attribute__((always_inline)) uint32_t narrow_body(const S* __restrict in, D* __restrict out, int64_t n,
                                                           uint32_t experts) {
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

// Whether this CPU runs AVX2, decided once; use_avx2 is what the commit and
// read paths follow (allow_host_avx2 turns it off for tests). Chosen by a
// flag, not an ifunc (target_clones): an ifunc resolver runs during
// relocation, before a sanitizer's runtime is up, and crashes under TSan.
// Initialized explicitly: this may run among a library's constructors,
// before libgcc's own has filled in the CPU model.
#if defined(__x86_64__) && defined(__GNUC__)
#define MOECAP_X86_DISPATCH 1
const bool kCpuHasAvx2 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") != 0;
}();
bool use_avx2 = kCpuHasAvx2;
#define MOECAP_AVX2 __attribute__((target("avx2")))
#endif

// One entry point per dtype pair, compiled twice on x86-64 (AVX2 and the
// baseline, narrow_body inlined into each) and picked by use_avx2: the
// narrowing is most of a commit's arithmetic, and AVX2 doubles its lanes.
#if defined(MOECAP_X86_DISPATCH)
#define MOECAP_NARROW(S, D)                                                                                  \
  uint32_t narrow_##S##_##D(const S* __restrict in, D* __restrict out, int64_t n, uint32_t experts) {        \
    return narrow_body(in, out, n, experts);                                                                 \
  }                                                                                                          \
  MOECAP_AVX2 uint32_t narrow_##S##_##D##_avx2(const S* __restrict in, D* __restrict out, int64_t n,         \
                                               uint32_t experts) {                                           \
    return narrow_body(in, out, n, experts);                                                                 \
  }                                                                                                          \
  inline uint32_t narrow_ids(const S* in, D* out, int64_t n, uint32_t experts) {                            \
    return use_avx2 ? narrow_##S##_##D##_avx2(in, out, n, experts) : narrow_##S##_##D(in, out, n, experts);  \
  }
#else
#define MOECAP_NARROW(S, D)                                                                                  \
  inline uint32_t narrow_ids(const S* in, D* out, int64_t n, uint32_t experts) {                            \
    return narrow_body(in, out, n, experts);                                                                 \
  }
#endif
#define MOECAP_NARROW_FROM(S) \
  MOECAP_NARROW(S, uint8_t)   \
  MOECAP_NARROW(S, uint16_t)  \
  MOECAP_NARROW(S, int16_t)   \
  MOECAP_NARROW(S, int32_t)
MOECAP_NARROW_FROM(uint8_t)
MOECAP_NARROW_FROM(uint16_t)
MOECAP_NARROW_FROM(int16_t)
MOECAP_NARROW_FROM(int32_t)
#undef MOECAP_NARROW_FROM
#undef MOECAP_NARROW

// A capture of int32 ids in compact rows (no extra columns to drop): the
// n * top_k ids are one flat array, narrowed as a commit narrows (AVX2 where
// the CPU has it: the per-row loop of capture_ids_only is built for the
// baseline ISA and ran at a fraction of memory speed). The ids outside
// [0, experts) but -1 are counted in a second look, only when there are any.
bool capture_flat_i32(const CaptureParams& p) {
  const auto* in = static_cast<const int32_t*>(p.ids);
  const int64_t count = p.n * p.top_k;
  const auto experts = static_cast<uint32_t>(p.num_experts);
  uint32_t outside = 0;
  switch (p.stored_id_elem) {
    case kU8: outside = narrow_ids(in, static_cast<uint8_t*>(p.dst_ids), count, experts); break;
    case kU16: outside = narrow_ids(in, static_cast<uint16_t*>(p.dst_ids), count, experts); break;
    case kI16: outside = narrow_ids(in, static_cast<int16_t*>(p.dst_ids), count, experts); break;
    case kI32: outside = narrow_ids(in, static_cast<int32_t*>(p.dst_ids), count, experts); break;
    default: return false;
  }
  if (outside != 0) {
    unsigned long long bad = 0;
    for (int64_t i = 0; i < count; ++i) bad += static_cast<uint32_t>(in[i]) >= experts && in[i] != -1 ? 1u : 0u;
    __atomic_fetch_add(&p.errors->invalid_ids, bad, __ATOMIC_RELAXED);
  }
  return true;
}

#if defined(__SSE2__)
// The common pair (int16 device ids, u8 host ids, top-8) narrowed straight
// into the slot-major staging tile: one pass, no intermediate narrowed
// buffer and no second copy per row chunk. Each row's 8 ids are one 16-byte
// load and one 8-byte store at its row's place in the tile; SSE2 is the
// x86-64 baseline, so no dispatch. An id outside [0, experts) (negative ones
// wrap above as unsigned) becomes all ones, as narrow_body does. Returns
// nonzero when any id was outside. Needs 1 <= experts <= 256.
inline bool narrow_rows_i16_u8_k8_sse2(const int16_t* in, uint8_t* out, int64_t out_stride, int64_t n,
                                       uint32_t experts) {
  const __m128i top = _mm_set1_epi16(static_cast<int16_t>(static_cast<uint16_t>(experts - 1)));
  const __m128i zero = _mm_setzero_si128();
  const __m128i low = _mm_set1_epi16(0x00ff);
  __m128i bad = zero;
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {  // two rows per pack: 32 bytes in, two 8-byte stores
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i * 8));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i * 8 + 8));
    // above > 0 exactly where id > experts - 1 as unsigned
    const __m128i oa = _mm_xor_si128(_mm_cmpeq_epi16(_mm_subs_epu16(a, top), zero), _mm_set1_epi16(-1));
    const __m128i ob = _mm_xor_si128(_mm_cmpeq_epi16(_mm_subs_epu16(b, top), zero), _mm_set1_epi16(-1));
    bad = _mm_or_si128(bad, _mm_or_si128(oa, ob));
    const __m128i packed = _mm_packus_epi16(_mm_and_si128(_mm_or_si128(a, oa), low), _mm_and_si128(_mm_or_si128(b, ob), low));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i * out_stride), packed);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + (i + 1) * out_stride), _mm_unpackhi_epi64(packed, packed));
  }
  if (i < n) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i * 8));
    const __m128i oa = _mm_xor_si128(_mm_cmpeq_epi16(_mm_subs_epu16(a, top), zero), _mm_set1_epi16(-1));
    bad = _mm_or_si128(bad, oa);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i * out_stride),
                     _mm_packus_epi16(_mm_and_si128(_mm_or_si128(a, oa), low), zero));
  }
  return _mm_movemask_epi8(bad) != 0;
}
#define MOECAP_HAVE_FUSED_NARROW 1

#if defined(__x86_64__) && defined(__GNUC__)
// The same with AVX2, four rows per pass: the per-row arithmetic halves, and
// what is left is one 8-byte store per row and layer. Packing works per
// 128-bit half, so the packed register holds rows 0, 2, 1, 3.
MOECAP_AVX2 bool narrow_rows_i16_u8_k8_avx2(const int16_t* in, uint8_t* out,
                                                                 int64_t out_stride, int64_t n, uint32_t experts) {
  const __m256i top = _mm256_set1_epi16(static_cast<int16_t>(static_cast<uint16_t>(experts - 1)));
  const __m256i zero = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(-1);
  const __m256i low = _mm256_set1_epi16(0x00ff);
  __m256i bad = zero;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i * 8));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i * 8 + 16));
    const __m256i oa = _mm256_xor_si256(_mm256_cmpeq_epi16(_mm256_subs_epu16(a, top), zero), ones);
    const __m256i ob = _mm256_xor_si256(_mm256_cmpeq_epi16(_mm256_subs_epu16(b, top), zero), ones);
    bad = _mm256_or_si256(bad, _mm256_or_si256(oa, ob));
    const __m256i packed =
        _mm256_packus_epi16(_mm256_and_si256(_mm256_or_si256(a, oa), low), _mm256_and_si256(_mm256_or_si256(b, ob), low));
    const __m128i lo = _mm256_castsi256_si128(packed), hi = _mm256_extracti128_si256(packed, 1);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i * out_stride), lo);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + (i + 1) * out_stride), hi);
    _mm_storeh_pd(reinterpret_cast<double*>(out + (i + 2) * out_stride), _mm_castsi128_pd(lo));
    _mm_storeh_pd(reinterpret_cast<double*>(out + (i + 3) * out_stride), _mm_castsi128_pd(hi));
  }
  const bool tail_bad = i < n && narrow_rows_i16_u8_k8_sse2(in + i * 8, out + i * out_stride, out_stride, n - i, experts);
  return tail_bad || !_mm256_testz_si256(bad, bad);
}

// Two layers at once (a layer's rows, then the next layer's `layer_stride`
// elements further): their chunks sit side by side in each staged row, so
// every row gets one 16-byte store for both instead of two 8-byte ones,
// halving the stores that bound the single-layer loop.
MOECAP_AVX2 bool narrow_layer_pair_i16_u8_k8_avx2(const int16_t* in, int64_t layer_stride,
                                                                       uint8_t* out, int64_t out_stride, int64_t n,
                                                                       uint32_t experts) {
  const __m256i top = _mm256_set1_epi16(static_cast<int16_t>(static_cast<uint16_t>(experts - 1)));
  const __m256i zero = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(-1);
  const __m256i low = _mm256_set1_epi16(0x00ff);
  const int16_t* in2 = in + layer_stride;
  __m256i bad = zero;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    // Rows i..i+3 of each layer, narrowed: bytes hold rows 0, 2 | 1, 3 (packing is per 128-bit half).
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i * 8));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i * 8 + 16));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in2 + i * 8));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in2 + i * 8 + 16));
    const __m256i oa = _mm256_xor_si256(_mm256_cmpeq_epi16(_mm256_subs_epu16(a, top), zero), ones);
    const __m256i ob = _mm256_xor_si256(_mm256_cmpeq_epi16(_mm256_subs_epu16(b, top), zero), ones);
    const __m256i oc = _mm256_xor_si256(_mm256_cmpeq_epi16(_mm256_subs_epu16(c, top), zero), ones);
    const __m256i od = _mm256_xor_si256(_mm256_cmpeq_epi16(_mm256_subs_epu16(d, top), zero), ones);
    bad = _mm256_or_si256(bad, _mm256_or_si256(_mm256_or_si256(oa, ob), _mm256_or_si256(oc, od)));
    const __m256i first =
        _mm256_packus_epi16(_mm256_and_si256(_mm256_or_si256(a, oa), low), _mm256_and_si256(_mm256_or_si256(b, ob), low));
    const __m256i second =
        _mm256_packus_epi16(_mm256_and_si256(_mm256_or_si256(c, oc), low), _mm256_and_si256(_mm256_or_si256(d, od), low));
    const __m256i rows01 = _mm256_unpacklo_epi64(first, second);  // row 0 | row 1, each both layers
    const __m256i rows23 = _mm256_unpackhi_epi64(first, second);  // row 2 | row 3
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i * out_stride), _mm256_castsi256_si128(rows01));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (i + 1) * out_stride), _mm256_extracti128_si256(rows01, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (i + 2) * out_stride), _mm256_castsi256_si128(rows23));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (i + 3) * out_stride), _mm256_extracti128_si256(rows23, 1));
  }
  bool tail_bad = false;
  if (i < n) {
    tail_bad = narrow_rows_i16_u8_k8_sse2(in + i * 8, out + i * out_stride, out_stride, n - i, experts);
    tail_bad = narrow_rows_i16_u8_k8_sse2(in2 + i * 8, out + i * out_stride + 8, out_stride, n - i, experts) || tail_bad;
  }
  return tail_bad || !_mm256_testz_si256(bad, bad);
}

// The rare part of a range commit, element by element: which of rows
// [first, first + rows) of layers [layer, layer + layers) hold an id outside
// [0, experts), counting those that are not the no-routing code (as
// committed_id_bad does) in rows that go to a slot (to[r] is not
// `nowhere`). Runs before the rows are consumed.
template <class S>
void mark_bad_rows(const CommitParams& p, int64_t layer, int64_t layers, int64_t first, int64_t rows,
                   uint8_t* const* to, const uint8_t* nowhere, uint8_t* row_bad) {
  const S* src = reinterpret_cast<const S*>(p.src_ids);
  for (int64_t r = 0; r < rows; ++r) {
    if (to[r] == nowhere) continue;
    for (int64_t l = layer; l < layer + layers; ++l) {
      const S* in = src + (l * p.device_rows + first + r) * p.top_k;
      for (int64_t k = 0; k < p.top_k; ++k) {
        if (committed_id_bad(p, in[k])) row_bad[r] = 1;
      }
    }
  }
}

// Rows [from, n) of a range starting at device row `first`, fewer than a
// block, element by element: checked as a block is (before they are
// consumed), each top-K id kept or, outside [0, experts), made all ones in
// its host row of D ids, then consumed. Inline with K fixed: a decode step
// of an odd batch meets these rows in every commit (a call to narrow_ids
// per layer made a 63-row commit 40 % slower).
template <class S, class D, int K>
inline void narrow_consume_rows_by_element(const CommitParams& p, int64_t first, int64_t from, int64_t n,
                                           uint8_t* const* to, const uint8_t* nowhere, uint8_t* row_bad) {
  S* const src = reinterpret_cast<S*>(p.src_ids);
  const auto experts = static_cast<uint32_t>(p.num_experts);
  for (int64_t i = from; i < n; ++i) {
    mark_bad_rows<S>(p, 0, p.num_layers, first + i, 1, to + i, nowhere, row_bad + i);
    for (int64_t l = 0; l < p.num_layers; ++l) {
      S* const in = src + (l * p.device_rows + first + i) * K;
      D* const out = reinterpret_cast<D*>(to[i]) + l * K;
      for (int k = 0; k < K; ++k) {
        const auto id = static_cast<std::make_unsigned_t<S>>(in[k]);
        out[k] = id < experts ? static_cast<D>(id) : static_cast<D>(~D{0});
        in[k] = static_cast<S>(-1);
      }
    }
  }
}

// The range kernel works on blocks of rows of one layer packed into one
// vector register of u8 host ids: 32 ids (32 / K rows) at top-8, 4, 2 and 1;
// 24 ids at top-6 (four rows, each padded to 8 bytes) and at top-3 (eight
// rows, each padded to 4 bytes): pack_padded_block. Which id of
// its block the register's byte b holds: from u8 the b-th; from int16 the
// ids were packed per 128-bit half (_mm256_packus_epi16 of ids 0..15 and
// 16..31), so the halves hold ids 0..7, 16..23 | 8..15, 24..31.
template <class S>
constexpr int packed_id(int b) {
  if constexpr (std::is_same_v<S, uint8_t>) {
    return b;
  } else {
    return (b % 16 < 8 ? 0 : 16) + b / 16 * 8 + b % 8;
  }
}

// Rows of a block at top-K.
template <int K>
constexpr size_t kBlockRows = K == 6 ? 4 : K == 3 ? 8 : 32 / K;
// Bytes a row's ids of one layer take in a packed block: one place.
template <int K>
constexpr int kChunkBytes = K == 6 ? 8 : K == 3 ? 4 : K;
// The widths whose rows are padded in their blocks (top-6 and top-3).
template <int K>
constexpr bool kPaddedRows = kChunkBytes<K> != K;
// Which place of a packed block holds each of its rows.
template <class S, int K>
constexpr std::array<int, kBlockRows<K>> places_of_rows() {
  std::array<int, kBlockRows<K>> place_of{};
  for (int place = 0; place < static_cast<int>(kBlockRows<K>); ++place) {
    place_of[static_cast<size_t>(kPaddedRows<K> ? place : packed_id<S>(place * K) / K)] = place;  // padded: in row order
  }
  return place_of;
}
template <class S, int K>
constexpr std::array<int, kBlockRows<K>> kPlaceOfRow = places_of_rows<S, K>();

// A block's 32 ids (int16 or u8, `at`) as u8 host ids, by a clamp: min(id,
// experts) as unsigned (negative int16 ids wrap above), and every byte equal
// to experts becomes 0xff (experts <= 255); with 256 experts
// (kEveryByteAnId, int16 only) min(id, 255), 0xff being both id 255 and "no
// expert". Bytes in packed_id order.
template <class S, bool kEveryByteAnId>
MOECAP_AVX2 inline __attribute__((always_inline)) __m256i clamp_block(const S* at, __m256i limit,
                                                                      __m256i limit_bytes) {
  __m256i packed;
  if constexpr (std::is_same_v<S, int16_t>) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at) + 1);
    packed = _mm256_packus_epi16(_mm256_min_epu16(x, limit), _mm256_min_epu16(y, limit));
    if constexpr (kEveryByteAnId) return packed;
  } else {
    static_assert(std::is_same_v<S, uint8_t> && !kEveryByteAnId, "u8 device ids hold at most 255 experts");
    packed = _mm256_min_epu8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)), limit_bytes);
  }
  return _mm256_or_si256(packed, _mm256_cmpeq_epi8(packed, limit_bytes));
}

// The common case of clamp_block, when no id is outside [0, experts): the
// block packed to u8 as it is (int16 ids below 256 pack exactly), and
// `seen` accumulating its largest ids (as unsigned: a negative int16 id is
// above every id), or with 256 experts the bits of their high bytes, for
// any_outside to test once per group of blocks. Half the instructions of
// the clamp; a group where any_outside finds an id outside is clamped again.
template <class S, bool kEveryByteAnId>
MOECAP_AVX2 inline __attribute__((always_inline)) __m256i pack_block(const S* at, __m256i* seen) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
  if constexpr (std::is_same_v<S, uint8_t>) {
    *seen = _mm256_max_epu8(*seen, x);
    return x;
  } else {
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at) + 1);
    *seen = kEveryByteAnId ? _mm256_or_si256(*seen, _mm256_or_si256(x, y))
                           : _mm256_max_epu16(*seen, _mm256_max_epu16(x, y));
    return _mm256_packus_epi16(x, y);
  }
}

// Whether an id pack_block saw is outside [0, experts); `top` holds
// experts - 1 in every lane of S's width.
template <class S, bool kEveryByteAnId>
MOECAP_AVX2 inline __attribute__((always_inline)) bool any_outside(__m256i seen, __m256i top) {
  if constexpr (std::is_same_v<S, uint8_t>) {
    const __m256i above = _mm256_subs_epu8(seen, top);
    return !_mm256_testz_si256(above, above);
  } else if constexpr (kEveryByteAnId) {
    return !_mm256_testz_si256(seen, _mm256_set1_epi16(static_cast<int16_t>(0xff00)));
  } else {
    const __m256i above = _mm256_subs_epu16(seen, top);
    return !_mm256_testz_si256(above, above);
  }
}

// A block consumed: all ones, the device buffer's "no routing".
template <class S>
MOECAP_AVX2 inline __attribute__((always_inline)) void consume_block(S* at) {
  const __m256i ones = _mm256_set1_epi8(-1);
  for (size_t half = 0; half < sizeof(S); ++half) _mm256_storeu_si256(reinterpret_cast<__m256i*>(at) + half, ones);
}

// Blocks of 24 ids with each row padded by zeros, so they transpose as a
// full width's do: at top-6 rows 0, 1 | 2, 3, each row's 6 ids in 8 bytes
// (as top-8); at top-3 rows 0-3 | 4-7, each row's 3 ids in 4 bytes (as
// top-4). From `at`, exactly the block's 24 ids are read; `seen` as
// pack_block's.
template <int K, class S, bool kEveryByteAnId>
MOECAP_AVX2 inline __attribute__((always_inline)) __m256i pack_padded_block(const S* at, __m256i* seen) {
  static_assert(kPaddedRows<K>, "padded blocks: top-6 or top-3");
  __m128i x, y;  // ids 0..15 and 16..23 as u8 (y's upper half zero)
  if constexpr (std::is_same_v<S, uint8_t>) {
    x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
    y = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at + 16));
    *seen = _mm256_max_epu8(*seen, _mm256_inserti128_si256(_mm256_castsi128_si256(x), y, 1));
  } else {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 16));
    const __m256i ab = _mm256_inserti128_si256(_mm256_setzero_si256(), b, 0);
    *seen = kEveryByteAnId ? _mm256_or_si256(*seen, _mm256_or_si256(a, ab))
                           : _mm256_max_epu16(*seen, _mm256_max_epu16(a, ab));
    x = _mm_packus_epi16(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    y = _mm_packus_epi16(b, _mm_setzero_si128());
  }
  // Each half takes 12 ids (2 rows at top-6, 4 at top-3), row by row into its places.
  const __m128i spread = K == 6 ? _mm_setr_epi8(0, 1, 2, 3, 4, 5, -1, -1, 6, 7, 8, 9, 10, 11, -1, -1)
                                : _mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
  const __m128i lo = _mm_shuffle_epi8(x, spread);
  const __m128i hi = _mm_shuffle_epi8(_mm_alignr_epi8(y, x, 12), spread);  // ids 12..23 first
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

// A padded block holding an id outside (rare), laid out as
// pack_padded_block's, each row narrowed by the plain rule (narrow_ids), as
// clamp_block clamps.
template <int K, class S>
MOECAP_AVX2 inline __m256i clamp_padded_block(const S* at, uint32_t experts) {
  alignas(32) uint8_t bytes[32] = {};
  for (size_t r = 0; r < kBlockRows<K>; ++r) narrow_ids(at + r * K, bytes + r * kChunkBytes<K>, K, experts);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(bytes));
}

// A padded block's 24 ids consumed.
template <class S>
MOECAP_AVX2 inline __attribute__((always_inline)) void consume_block_24(S* at) {
  const __m128i ones = _mm_set1_epi8(-1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(at), ones);
  if constexpr (sizeof(S) == 2) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(at) + 1, ones);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(at) + 2, ones);
  } else {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(at) + 1, ones);
  }
}

// The block operations at top-K.
template <int K, class S, bool kEveryByteAnId>
MOECAP_AVX2 inline __attribute__((always_inline)) __m256i pack_rows(const S* at, __m256i* seen) {
  if constexpr (kPaddedRows<K>) {
    return pack_padded_block<K, S, kEveryByteAnId>(at, seen);
  } else {
    return pack_block<S, kEveryByteAnId>(at, seen);
  }
}

template <int K, class S, bool kEveryByteAnId>
MOECAP_AVX2 inline __attribute__((always_inline)) __m256i clamp_rows(const S* at, __m256i limit, __m256i limit_bytes,
                                                                     uint32_t experts) {
  if constexpr (kPaddedRows<K>) {
    return clamp_padded_block<K>(at, kEveryByteAnId ? 256u : experts);
  } else {
    return clamp_block<S, kEveryByteAnId>(at, limit, limit_bytes);
  }
}

template <int K, class S>
MOECAP_AVX2 inline __attribute__((always_inline)) void consume_rows(S* at) {
  if constexpr (kPaddedRows<K>) {
    consume_block_24(at);
  } else {
    consume_block(at);
  }
}

// Layers per pass of the range kernel at top-K: as many as make each row's
// chunk of a pass 32 bytes (one store per row), but 16 bytes at top-2,
// whose 16-bit elements transpose within 128-bit halves, and 24 at top-6
// and top-3.
template <int K>
constexpr size_t kLayersPerPass = K == 8 || K == 6 ? 4 : 8;

// Each row's place of a pass of 32-byte places (as store_pass transposed
// them: top-8 and 4, and the padded widths) stored into its host row, in row
// order: 32 bytes, or at top-6 and 3 the padding squeezed out of each
// 128-bit half (12 bytes of ids kept) and the halves joined, 24 bytes stored
// as 16 and 8.
template <class S, int K>
MOECAP_AVX2 inline __attribute__((always_inline)) void store_places(const __m256i* place, uint8_t* const* to,
                                                                    int64_t at) {
  if constexpr (!kPaddedRows<K>) {
#pragma GCC unroll 8
    for (size_t row = 0; row < kBlockRows<K>; ++row) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to[row] + at), place[kPlaceOfRow<S, K>[row]]);
    }
  } else {
    const __m256i squeeze = K == 6 ? _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13, -1, -1, -1, -1, 0, 1, 2, 3,
                                                      4, 5, 8, 9, 10, 11, 12, 13, -1, -1, -1, -1)
                                   : _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1, 0, 1, 2, 4,
                                                      5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    const __m256i join = _mm256_setr_epi32(0, 1, 2, 4, 5, 6, 3, 7);
#pragma GCC unroll 8
    for (size_t row = 0; row < kBlockRows<K>; ++row) {
      const __m256i chunk =
          _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(place[kPlaceOfRow<S, K>[row]], squeeze), join);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(to[row] + at), _mm256_castsi256_si128(chunk));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(to[row] + at + 16), _mm256_extracti128_si256(chunk, 1));
    }
  }
}

// The blocks of kLayersPerPass<K> consecutive layers (`r`, packed) turned
// into each row's chunk of that pass, written to `to` (the block's rows'
// host rows, already offset to the pass's first layer) in row order, so a
// slot two rows go to keeps the later one. A transpose of a
// [layers, places] matrix of kChunkBytes<K>-byte elements (at top-6 and
// top-3 the padding is then squeezed out).
template <class S, int K>
MOECAP_AVX2 inline __attribute__((always_inline)) void store_pass(const __m256i* r, uint8_t* const* to,
                                                                  int64_t at) {
  constexpr size_t rows = kBlockRows<K>;
  if constexpr (K == 8 || K == 6) {
    // Per 128-bit half, places 0, 2 (lo) and 1, 3 (hi) of layers 0, 1 and 2, 3.
    const __m256i lo01 = _mm256_unpacklo_epi64(r[0], r[1]);
    const __m256i hi01 = _mm256_unpackhi_epi64(r[0], r[1]);
    const __m256i lo23 = _mm256_unpacklo_epi64(r[2], r[3]);
    const __m256i hi23 = _mm256_unpackhi_epi64(r[2], r[3]);
    const __m256i place[4] = {
        _mm256_permute2x128_si256(lo01, lo23, 0x20), _mm256_permute2x128_si256(hi01, hi23, 0x20),
        _mm256_permute2x128_si256(lo01, lo23, 0x31), _mm256_permute2x128_si256(hi01, hi23, 0x31)};
    store_places<S, K>(place, to, at);
  } else if constexpr (K == 4 || K == 3) {
    // An 8 x 8 transpose of 4-byte elements: pairs, quads within halves, then halves.
    __m256i t[8], u[8];
    for (int q = 0; q < 4; ++q) {
      t[2 * q] = _mm256_unpacklo_epi32(r[2 * q], r[2 * q + 1]);      // places 0, 1 | 4, 5
      t[2 * q + 1] = _mm256_unpackhi_epi32(r[2 * q], r[2 * q + 1]);  // places 2, 3 | 6, 7
    }
    for (int h = 0; h < 2; ++h) {  // layers 0-3, then 4-7
      u[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);          // place 0 | 4
      u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);      // place 1 | 5
      u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);  // place 2 | 6
      u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);  // place 3 | 7
    }
    __m256i place[8];
    for (int q = 0; q < 4; ++q) {
      place[q] = _mm256_permute2x128_si256(u[q], u[4 + q], 0x20);
      place[4 + q] = _mm256_permute2x128_si256(u[q], u[4 + q], 0x31);
    }
    store_places<S, K>(place, to, at);
  } else if constexpr (K == 1) {
    // A 16 x 8 transpose of bytes in each 128-bit half at once: layer
    // pairs, then quads, then all eight, so that qword w of half h of c[j]
    // is place 16h + 2j + w (a row's 8 bytes of the pass).
    __m256i a[8], b[8], c[8];
    for (int q = 0; q < 4; ++q) {
      a[2 * q] = _mm256_unpacklo_epi8(r[2 * q], r[2 * q + 1]);      // in-half places 0-7
      a[2 * q + 1] = _mm256_unpackhi_epi8(r[2 * q], r[2 * q + 1]);  // in-half places 8-15
    }
    for (int g = 0; g < 4; ++g) {  // in-half places 4g..4g+3: layers 0-3 (b[g]) and 4-7 (b[4 + g])
      const int h = g / 2;
      b[g] = g % 2 == 0 ? _mm256_unpacklo_epi16(a[h], a[2 + h]) : _mm256_unpackhi_epi16(a[h], a[2 + h]);
      b[4 + g] = g % 2 == 0 ? _mm256_unpacklo_epi16(a[4 + h], a[6 + h]) : _mm256_unpackhi_epi16(a[4 + h], a[6 + h]);
    }
    for (int g = 0; g < 4; ++g) {
      c[2 * g] = _mm256_unpacklo_epi32(b[g], b[4 + g]);      // in-half places 4g, 4g + 1
      c[2 * g + 1] = _mm256_unpackhi_epi32(b[g], b[4 + g]);  // in-half places 4g + 2, 4g + 3
    }
#pragma GCC unroll 32
    for (size_t row = 0; row < rows; ++row) {
      const int place = kPlaceOfRow<S, K>[row];
      const __m256i v = c[place % 16 / 2];
      const __m128i half = place < 16 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
      const int64_t bytes = place % 2 == 0 ? _mm_cvtsi128_si64(half) : _mm_extract_epi64(half, 1);
      std::memcpy(to[row] + at, &bytes, 8);
    }
  } else {
    static_assert(K == 2, "the range kernel's top-k: 1, 2, 3, 4, 6 or 8");
    // An 8 x 8 transpose of 2-byte elements in each 128-bit half at once:
    // half h of c[j] is place 8h + j.
    __m256i a[8], b[8], c[8];
    for (int q = 0; q < 4; ++q) {
      a[2 * q] = _mm256_unpacklo_epi16(r[2 * q], r[2 * q + 1]);      // in-half places 0-3
      a[2 * q + 1] = _mm256_unpackhi_epi16(r[2 * q], r[2 * q + 1]);  // in-half places 4-7
    }
    for (int h = 0; h < 2; ++h) {  // layers 0-3, then 4-7
      b[4 * h] = _mm256_unpacklo_epi32(a[4 * h], a[4 * h + 2]);          // places 0, 1
      b[4 * h + 1] = _mm256_unpackhi_epi32(a[4 * h], a[4 * h + 2]);      // places 2, 3
      b[4 * h + 2] = _mm256_unpacklo_epi32(a[4 * h + 1], a[4 * h + 3]);  // places 4, 5
      b[4 * h + 3] = _mm256_unpackhi_epi32(a[4 * h + 1], a[4 * h + 3]);  // places 6, 7
    }
    for (int q = 0; q < 4; ++q) {
      c[2 * q] = _mm256_unpacklo_epi64(b[q], b[4 + q]);
      c[2 * q + 1] = _mm256_unpackhi_epi64(b[q], b[4 + q]);
    }
#pragma GCC unroll 16
    for (size_t row = 0; row < rows; ++row) {
      const int place = kPlaceOfRow<S, K>[row];
      const __m256i v = c[place % 8];
      const __m128i half = place < 8 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(to[row] + at), half);
    }
  }
}

// A range commit's whole tile in one pass over the device rows: rows
// [first, first + n) of every layer, top-K (1, 2, 3, 4, 6 or 8) int16 or u8 ids
// clamped to u8 (clamp_block, clamp_padded_block) straight into each row's host-cache row
// (to[r], or `nowhere`, a scratch row, for a row that goes to no slot), and
// consumed (all ones written back) right after they are read.
// kLayersPerPass<K> layers at a time, so each host row gets one store per
// pass, and layer by layer through the rows (a layer's rows are contiguous;
// the layers are the device buffer's rows apart, a power-of-two stride that
// would make every layer's line compete for one cache set if a pass went
// across them). Rows in order within each pass, so a slot listed twice
// keeps its later row. row_bad[r] is set for rows with an id outside [0,
// experts) (the blocks are looked at element by element before they are
// consumed, mark_bad_rows); every layer must hold routing written this step
// for all n rows.
template <int K, class S, bool kEveryByteAnId>
MOECAP_AVX2 void narrow_consume_range_u8_avx2(const CommitParams& p, int64_t first, int64_t n, uint8_t* const* to,
                                              uint8_t* nowhere, uint8_t* row_bad) {
  constexpr int64_t rows = static_cast<int64_t>(kBlockRows<K>);
  constexpr int64_t pass = static_cast<int64_t>(kLayersPerPass<K>);

  S* src = reinterpret_cast<S*>(p.src_ids) + first * K;
  const int64_t layer_stride = p.device_rows * K;
  const int64_t layers = p.num_layers;
  const __m256i limit = _mm256_set1_epi16(static_cast<int16_t>(kEveryByteAnId ? 255 : p.num_experts));
  const __m256i limit_bytes = _mm256_set1_epi8(static_cast<char>(p.num_experts));
  const auto experts = static_cast<uint32_t>(p.num_experts);
  const __m256i top = sizeof(S) == 1 ? _mm256_set1_epi8(static_cast<char>(p.num_experts - 1))
                                     : _mm256_set1_epi16(static_cast<int16_t>(p.num_experts - 1));
  const int64_t blocks = n / rows * rows;
  int64_t l = 0;
  for (; l + pass <= layers; l += pass) {
    S* const in = src + l * layer_stride;
    for (int64_t i = 0; i < blocks; i += rows) {
      __m256i r[kLayersPerPass<K>], seen = _mm256_setzero_si256();
      for (int q = 0; q < pass; ++q) r[q] = pack_rows<K, S, kEveryByteAnId>(in + q * layer_stride + i * K, &seen);
      if (any_outside<S, kEveryByteAnId>(seen, top)) {  // rare: clamped, and the rows looked at
        for (int q = 0; q < pass; ++q) {
          r[q] = clamp_rows<K, S, kEveryByteAnId>(in + q * layer_stride + i * K, limit, limit_bytes, experts);
        }
        mark_bad_rows<S>(p, l, pass, first + i, rows, to + i, nowhere, row_bad + i);
      }
      for (int q = 0; q < pass; ++q) consume_rows<K>(in + q * layer_stride + i * K);
      store_pass<S, K>(r, to + i, l * K);
    }
  }
  for (; l < layers; ++l) {  // the last layers short of a pass: K bytes per row and layer
    S* const in = src + l * layer_stride;
    for (int64_t i = 0; i < blocks; i += rows) {
      __m256i seen = _mm256_setzero_si256();
      __m256i block = pack_rows<K, S, kEveryByteAnId>(in + i * K, &seen);
      if (any_outside<S, kEveryByteAnId>(seen, top)) {
        block = clamp_rows<K, S, kEveryByteAnId>(in + i * K, limit, limit_bytes, experts);
        mark_bad_rows<S>(p, l, 1, first + i, rows, to + i, nowhere, row_bad + i);
      }
      consume_rows<K>(in + i * K);
      alignas(32) uint8_t bytes[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), block);
#pragma GCC unroll 16
      for (size_t row = 0; row < kBlockRows<K>; ++row) {  // in row order, as above
        std::memcpy(to[i + static_cast<int64_t>(row)] + l * K, bytes + kPlaceOfRow<S, K>[row] * kChunkBytes<K>, K);
      }
    }
  }
  // The last rows short of a block (tiles are multiples of 16 rows, so only
  // at a range's end or where it was clipped to the device rows).
  narrow_consume_rows_by_element<S, uint8_t, K>(p, first, blocks, n, to, nowhere, row_bad);
}

// int16 ids as u16 host ids: kept below `limit` (experts), else all ones.
MOECAP_AVX2 inline __attribute__((always_inline)) __m256i clamp_u16(__m256i ids, __m256i limit) {
  const __m256i kept = _mm256_min_epu16(ids, limit);
  return _mm256_or_si256(kept, _mm256_cmpeq_epi16(kept, limit));
}

// The same pass for top-8 int16 device ids into a u16 host cache (257 to
// 32768 experts: Kimi K2's 384): no narrowing, each id kept or, outside
// [0, experts), made all ones (`min(id, experts)` as unsigned, then the
// lanes equal to experts). Blocks of two rows (16 ids) of one layer, passes
// of two layers: a row's 32 bytes of a pass are the two layers' 16-byte
// halves of their blocks.
MOECAP_AVX2 void consume_range_i16_u16_k8_avx2(const CommitParams& p, int64_t first, int64_t n, uint8_t* const* to,
                                               uint8_t* nowhere, uint8_t* row_bad) {
  int16_t* src = reinterpret_cast<int16_t*>(p.src_ids) + first * 8;
  const int64_t layer_stride = p.device_rows * 8;
  const int64_t layers = p.num_layers;
  const auto experts = static_cast<uint32_t>(p.num_experts);
  const __m256i limit = _mm256_set1_epi16(static_cast<int16_t>(experts));
  const __m256i top = _mm256_set1_epi16(static_cast<int16_t>(experts - 1));
  const __m256i ones = _mm256_set1_epi8(-1);
  const int64_t blocks = n / 2 * 2;
  int64_t l = 0;
  for (; l + 2 <= layers; l += 2) {
    int16_t* const in = src + l * layer_stride;
    for (int64_t i = 0; i < blocks; i += 2) {
      __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i * 8));
      __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + layer_stride + i * 8));
      if (any_outside<int16_t, false>(_mm256_max_epu16(a, b), top)) {  // rare
        a = clamp_u16(a, limit);
        b = clamp_u16(b, limit);
        mark_bad_rows<int16_t>(p, l, 2, first + i, 2, to + i, nowhere, row_bad + i);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(in + i * 8), ones);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(in + layer_stride + i * 8), ones);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to[i] + l * 16), _mm256_permute2x128_si256(a, b, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to[i + 1] + l * 16), _mm256_permute2x128_si256(a, b, 0x31));
    }
  }
  for (; l < layers; ++l) {  // the last layer short of a pass: 16 bytes per row
    int16_t* const in = src + l * layer_stride;
    for (int64_t i = 0; i < blocks; i += 2) {
      __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i * 8));
      if (any_outside<int16_t, false>(a, top)) {
        a = clamp_u16(a, limit);
        mark_bad_rows<int16_t>(p, l, 1, first + i, 2, to + i, nowhere, row_bad + i);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(in + i * 8), ones);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(to[i] + l * 16), _mm256_castsi256_si128(a));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(to[i + 1] + l * 16), _mm256_extracti128_si256(a, 1));
    }
  }
  narrow_consume_rows_by_element<int16_t, uint16_t, 8>(p, first, blocks, n, to, nowhere, row_bad);  // a last odd row
}

// Top-K int16 ids into u16 host ids at the other widths (top-10 of 512
// experts: Qwen3-Next): a layer at a time, its n rows checked as one run of
// n * K ids (their largest once), each row's 2K bytes moved straight into
// its host row, in row order, then the run consumed. Only a layer holding an
// id outside is looked at and clamped row by row (narrow_ids). Against the
// staged path it skips the narrowed copy and the staging tile's copy.
template <int K>
MOECAP_AVX2 void consume_range_i16_u16_avx2(const CommitParams& p, int64_t first, int64_t n, uint8_t* const* to,
                                            uint8_t* nowhere, uint8_t* row_bad) {
  int16_t* const src = reinterpret_cast<int16_t*>(p.src_ids) + first * K;
  const int64_t layer_stride = p.device_rows * K;
  const auto experts = static_cast<uint32_t>(p.num_experts);
  const __m256i top = _mm256_set1_epi16(static_cast<int16_t>(experts - 1));
  const int64_t ids = n * K;
  constexpr size_t kRowBytes = 2 * K;  // one row's ids of one layer
  for (int64_t l = 0; l < p.num_layers; ++l) {
    int16_t* const in = src + l * layer_stride;
    __m256i seen = _mm256_setzero_si256();
    int64_t e = 0;
    for (; e + 16 <= ids; e += 16) seen = _mm256_max_epu16(seen, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + e)));
    bool outside = any_outside<int16_t, false>(seen, top);
    for (; e < ids; ++e) outside = outside || static_cast<uint16_t>(in[e]) >= experts;
    const int64_t at = l * static_cast<int64_t>(kRowBytes);
    if (!outside) {
      for (int64_t i = 0; i < n; ++i) std::memcpy(to[i] + at, in + i * K, kRowBytes);
    } else {  // rare
      mark_bad_rows<int16_t>(p, l, 1, first, n, to, nowhere, row_bad);
      for (int64_t i = 0; i < n; ++i) narrow_ids(in + i * K, reinterpret_cast<uint16_t*>(to[i] + at), K, experts);
    }
    std::memset(in, 0xff, static_cast<size_t>(ids) * 2);
  }
}
#define MOECAP_HAVE_RANGE_NARROW_CONSUME 1

// Rows [0, result) hold routing written this step in every layer.
int64_t rows_written_in_every_layer(const CommitParams& p) {
  int64_t rows = INT64_MAX;
  for (int64_t l = 0; l < p.num_layers; ++l) rows = std::min(rows, layer_written_rows(p, l));
  return rows;
}

#endif

inline bool narrow_rows_i16_u8_k8(const int16_t* in, uint8_t* out, int64_t out_stride, int64_t n,
                                  uint32_t experts) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (use_avx2) return narrow_rows_i16_u8_k8_avx2(in, out, out_stride, n, experts);
#endif
  return narrow_rows_i16_u8_k8_sse2(in, out, out_stride, n, experts);
}

// Layers l and l + 1 of rows read in place; true when an id of either was outside.
inline bool narrow_layer_pair_i16_u8_k8(const int16_t* in, int64_t layer_stride, uint8_t* out, int64_t out_stride,
                                        int64_t n, uint32_t experts) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (use_avx2) return narrow_layer_pair_i16_u8_k8_avx2(in, layer_stride, out, out_stride, n, experts);
#endif
  const bool first = narrow_rows_i16_u8_k8_sse2(in, out, out_stride, n, experts);
  return narrow_rows_i16_u8_k8_sse2(in + layer_stride, out + 8, out_stride, n, experts) || first;
}
#endif

// The device buffer's "no routing" is all ones in every dtype, its no weight
// zero: consuming is a fill of bytes.
void consume_run(const CommitParams& p, int64_t layer, int64_t first_row, int64_t rows) {
  const int64_t id_bytes = elem_bytes(p.src_id_elem);
  const int64_t at = (layer * p.device_rows + first_row) * p.top_k;
  std::memset(p.src_ids + at * id_bytes, 0xff, static_cast<size_t>(rows * p.top_k * id_bytes));
  if (p.src_weights != nullptr) {
    const int64_t w_bytes = elem_bytes(p.weight_elem);
    std::memset(p.src_weights + at * w_bytes, 0, static_cast<size_t>(rows * p.top_k * w_bytes));
  }
}

// Entries [first, last) of a commit that go somewhere, in list order, into
// srcs and slots (what commit_target decides), with the slot tensor's dtype
// fixed at compile time (void: read by load_int) rather than switched on for
// every entry. Returns how many.
template <class Slot>
int64_t tile_entries(const CommitParams& params, int64_t first, int64_t last, int64_t* srcs, int64_t* slots) {
  // A copy the stores below cannot alias: the fields stay in registers.
  const CommitParams p = params;
  int64_t n = 0;
  if constexpr (!std::is_void_v<Slot>) {
    if (p.src_rows == nullptr && p.claims == nullptr && p.mode == kCommitRows) {
      // A row range (a decode step, a prefill chunk): an entry whose slot
      // and row are both in range goes there (one unsigned compare each);
      // any other is commit_goes_to's to drop or count.
      const Slot* slot_of = static_cast<const Slot*>(p.dst_slots);
      const auto host_slots = static_cast<uint64_t>(p.host_slots);
      const auto device_rows = static_cast<uint64_t>(p.device_rows);
      for (int64_t j = first; j < last; ++j) {
        const auto slot = static_cast<int64_t>(slot_of[j]);
        const int64_t src = p.src_start + j;
        if ((static_cast<uint64_t>(slot) < host_slots && static_cast<uint64_t>(src) < device_rows) ||
            commit_goes_to(p, src, slot)) {
          srcs[n] = src;
          slots[n] = slot;
          ++n;
        }
      }
      return n;
    }
  }
  for (int64_t j = first; j < last; ++j) {
    int64_t slot;
    if constexpr (std::is_void_v<Slot>) {
      slot = load_int(p.dst_slots, p.dst_slots_elem, j);
    } else {
      slot = static_cast<int64_t>(static_cast<const Slot*>(p.dst_slots)[j]);
    }
    const int64_t src = p.src_rows != nullptr ? load_int(p.src_rows, p.src_rows_elem, j) : p.src_start + j;
    if (!commit_goes_to(p, src, slot) || !claim_won(p, j, slot)) continue;
    srcs[n] = src;
    slots[n] = slot;
    ++n;
  }
  return n;
}

// Requests every 64-byte line of [at, at + bytes) ahead of its use, so that
// the misses of many scattered host rows are in flight together rather than
// met one at a time: a read's slots and a commit's (a decode step's new
// tokens, a new request's) lie over a cache larger than the CPU's, rows
// last touched long ago. Reads into L1; writes into L2 (prefetcht1), since
// a commit tile's rows alone overflow the 32 KiB L1 (into L1 they gained
// nothing).
template <bool kForWriting>
inline void prefetch_lines(const uint8_t* at, int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(at) & ~uintptr_t{63};
  const uintptr_t end = reinterpret_cast<uintptr_t>(at) + static_cast<uintptr_t>(bytes);
  for (uintptr_t line = first; line < end; line += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(line), kForWriting ? 1 : 0, kForWriting ? 2 : 3);
  }
}

// The first and last N bytes of [0, b), N <= b <= 2N: every byte of it.
template <size_t N>
inline void copy_ends(uint8_t* dst, const uint8_t* src, size_t b) {
  uint8_t head[N], tail[N];
  std::memcpy(head, src, N);
  std::memcpy(tail, src + b - N, N);
  std::memcpy(dst, head, N);
  std::memcpy(dst + b - N, tail, N);
}

// A few bytes (one row of one layer: its top_k ids or weights), copied
// inline up to 64. Where the width is known only at run time a memcpy call
// per row and layer cost several times the copy (4096-row commits at top-3
// ran at 0.03x a memcpy per row); where it is fixed at compile time this
// folds to one or two moves.
inline void copy_few_bytes(void* dst_v, const void* src_v, size_t b) {
  auto* dst = static_cast<uint8_t*>(dst_v);
  const auto* src = static_cast<const uint8_t*>(src_v);
  if (b > 64) {
    std::memcpy(dst, src, b);
  } else if (b >= 32) {
    copy_ends<32>(dst, src, b);
  } else if (b >= 16) {
    copy_ends<16>(dst, src, b);
  } else if (b >= 8) {
    copy_ends<8>(dst, src, b);
  } else if (b >= 4) {
    copy_ends<4>(dst, src, b);
  } else if (b >= 2) {
    copy_ends<2>(dst, src, b);
  } else if (b == 1) {
    dst[0] = src[0];
  }
}

struct CommitScratch {
  std::vector<uint64_t> srcs, slots, bad, gathered, narrowed, staged, staged_w, to;
  // `n` elements of T, 8-byte aligned, contents unspecified.
  template <class T>
  T* get(std::vector<uint64_t>& v, int64_t n) {
    const size_t words = (static_cast<size_t>(n) * sizeof(T) + 7) / 8;
    if (v.size() < words) v.resize(words);
    return reinterpret_cast<T*>(v.data());
  }
};

// Rows in tiles, each slot's row written once: first where each entry of the
// tile goes (the kernels' decision, commit_goes_to), then layer by layer the
// tile's rows of that layer are narrowed in one vectorized pass (read in place
// when the source rows are consecutive, as in a prefill) into a slot-major
// staging tile that stays in L1/L2, and finally each row of the tile goes to
// its slot as one contiguous copy: the layer-major -> slot-major transpose
// costs what a memcpy per row costs. Rows keep list order, so a slot listed
// twice keeps its last row. With `consume`, a row range is consumed layer by
// layer right after it was read (rows of a range are distinct, so each is
// read once before it is consumed). TopK > 0 fixes the width at compile time
// (the common top-k values), so the per-row copies are single moves; at
// other widths a row's ids of a layer of up to 16 bytes move as 16 bytes
// into padded staging rows (spill_moves below), longer ones by copy_few_bytes.
template <int TopK, class S, class D>
void commit_rows(const CommitParams& p, bool consume) {
  const int64_t top_k = TopK > 0 ? TopK : p.top_k;
  const int64_t row = p.num_layers * top_k;
  const int64_t layer_stride = p.device_rows * top_k;
  const uint32_t experts = static_cast<uint32_t>(p.num_experts);
  const int64_t w_bytes = p.weight_elem >= 0 ? elem_bytes(p.weight_elem) : 0;
  const int64_t w_row = row * w_bytes;
  // A tile of about 32 KiB of staged ids (the narrowed rows and the gathered
  // source rows of one layer stay in L1), at least 16 rows, at most 512.
  // A multiple of 16, so whole blocks of the range kernel (32 ids of a
  // layer: 4 rows at top-8, 16 at top-2) and of the other vectorized passes.
  const int64_t tile =
      std::min<int64_t>(512, std::max<int64_t>(16, 32768 / std::max<int64_t>(1, row * static_cast<int64_t>(sizeof(D))))) / 16 * 16;
  const size_t id_chunk = static_cast<size_t>(top_k) * sizeof(D);
  const size_t in_chunk = static_cast<size_t>(top_k) * sizeof(S);
  const D no_expert = static_cast<D>(p.dst_no_expert);
  // Scratch kept per thread: a decode step's commit is a few microseconds,
  // which fresh allocations would lengthen.
  thread_local CommitScratch scratch;
  int64_t* srcs = scratch.get<int64_t>(scratch.srcs, tile);
  int64_t* slots = scratch.get<int64_t>(scratch.slots, tile);
  uint8_t* bad = scratch.get<uint8_t>(scratch.bad, tile);
  S* gathered = scratch.get<S>(scratch.gathered, tile * top_k);
  // At a width fixed only at run time with up to 16 bytes of ids per row and
  // layer, each row's ids of a layer go to its staging row as one 16-byte
  // move, spilling into the places of the layers after it, written later, or
  // into the row's padding: a move per row and layer rather than a sized copy.
  constexpr int64_t kSpill = TopK > 0 ? 0 : 16 / static_cast<int64_t>(sizeof(D));
  const bool spill_moves = TopK == 0 && id_chunk <= 16;
  const int64_t srow = row + kSpill;  // elements from one staged row to the next
  D* narrowed = scratch.get<D>(scratch.narrowed, tile * top_k + kSpill);
  D* staged = scratch.get<D>(scratch.staged, tile * srow);
  uint8_t* staged_w = scratch.get<uint8_t>(scratch.staged_w, tile * w_row);
#ifdef MOECAP_HAVE_RANGE_NARROW_CONSUME
  uint8_t** to = scratch.get<uint8_t*>(scratch.to, tile);
  // A range commit of int16 or u8 ids into u8 at top-1, 2, 3, 4, 6 or 8, or of
  // int16 ids into u16 at those widths, 10 and 12, without weights: the common
  // decode and prefill commit, with its own one-pass kernels (u8 device ids
  // hold at most 255 experts, their 0xff being "no routing").
  const uint32_t most_experts = std::is_same_v<D, uint16_t> ? 32768u : sizeof(S) == 1 ? 255u : 256u;
  const bool range_in_one_pass = use_avx2 && consume && p.mode == kCommitRows && p.src_rows == nullptr &&
                                 w_bytes == 0 && experts >= 1 && experts <= most_experts;
  const int64_t written_in_every_layer = range_in_one_pass ? rows_written_in_every_layer(p) : 0;
#endif
  for (int64_t first = 0; first < p.count; first += tile) {
    const int64_t last = std::min(p.count, first + tile);
    if (p.mode == kInvalidate) {
      for (int64_t j = first; j < last; ++j) {
        int64_t src = 0, slot = 0;
        if (commit_target(p, j, &src, &slot)) p.dst_states[slot] = kSlotEmpty;
      }
      continue;
    }
    int64_t n;
    switch (p.dst_slots_elem) {  // the engines' slot tensors: int64 or int32
      case kI64: n = tile_entries<int64_t>(p, first, last, srcs, slots); break;
      case kI32: n = tile_entries<int32_t>(p, first, last, srcs, slots); break;
      default: n = tile_entries<void>(p, first, last, srcs, slots); break;
    }
    // The tile's part of a row range, clipped to the device rows: consumed whatever its slots.
    const int64_t run_first = std::max<int64_t>(0, p.src_start + first);
    const int64_t run_rows = std::min<int64_t>(p.device_rows, p.src_start + last) - run_first;
#ifdef MOECAP_HAVE_RANGE_NARROW_CONSUME
    constexpr bool into_u8 = (TopK == 1 || TopK == 2 || TopK == 3 || TopK == 4 || TopK == 6 || TopK == 8) &&
                             (std::is_same_v<S, int16_t> || std::is_same_v<S, uint8_t>) && std::is_same_v<D, uint8_t>;
    constexpr bool into_u16 = TopK > 0 && std::is_same_v<S, int16_t> && std::is_same_v<D, uint16_t>;
    if constexpr (into_u8 || into_u16) {
      if (range_in_one_pass && n > 0 && run_rows > 0 && run_first + run_rows <= written_in_every_layer) {
        // The tile's rows are one run: narrowed and consumed in one pass
        // straight into their slots' rows (a row that goes nowhere into a
        // scratch row); then the slots' states, in list order.
        uint8_t* scratch_row = reinterpret_cast<uint8_t*>(staged);
        if (n < run_rows) {  // rows distinct, so with every row going somewhere each to[] is set below
          for (int64_t r = 0; r < run_rows; ++r) to[r] = scratch_row;
        }
        uint8_t* const host_ids = reinterpret_cast<uint8_t*>(p.dst_ids);  // held in a register past the stores
        uint8_t* const states = p.dst_states;
        const int64_t row_bytes = row * static_cast<int64_t>(sizeof(D));
        for (int64_t i = 0; i < n; ++i) {
          to[srcs[i] - run_first] = host_ids + slots[i] * row_bytes;
          prefetch_lines<true>(host_ids + slots[i] * row_bytes, row_bytes);
        }
        std::memset(bad, 0, static_cast<size_t>(run_rows));
        if constexpr (into_u16 && TopK == 8) {
          consume_range_i16_u16_k8_avx2(p, run_first, run_rows, to, scratch_row, bad);
        } else if constexpr (into_u16) {
          consume_range_i16_u16_avx2<TopK>(p, run_first, run_rows, to, scratch_row, bad);
        } else if constexpr (std::is_same_v<S, uint8_t>) {
          narrow_consume_range_u8_avx2<TopK, S, false>(p, run_first, run_rows, to, scratch_row, bad);
        } else if (experts == 256) {
          narrow_consume_range_u8_avx2<TopK, S, true>(p, run_first, run_rows, to, scratch_row, bad);
        } else {
          narrow_consume_range_u8_avx2<TopK, S, false>(p, run_first, run_rows, to, scratch_row, bad);
        }
        for (int64_t i = 0; i < n; ++i) states[slots[i]] = committed_state(bad[srcs[i] - run_first] != 0);
        continue;
      }
    }
#endif
    std::memset(bad, 0, static_cast<size_t>(n));
    const int64_t id_row_bytes = row * static_cast<int64_t>(sizeof(D));
    for (int64_t i = 0; i < n; ++i) {  // written after the tile's layers are narrowed
      prefetch_lines<true>(p.dst_ids + slots[i] * id_row_bytes, id_row_bytes);
      if (w_bytes > 0) prefetch_lines<true>(p.dst_weights + slots[i] * w_row, w_row);
    }
    bool consecutive = true;
    int64_t last_src = -1;  // the tile's highest source row: most layers wrote every row of a tile
    for (int64_t i = 1; i < n; ++i) consecutive = consecutive && srcs[i] == srcs[0] + i;
    for (int64_t i = 0; i < n; ++i) last_src = std::max(last_src, srcs[i]);
    bool pair_bad = false;
    for (int64_t l = 0; l < p.num_layers && n > 0; ++l) {
      const S* layer = reinterpret_cast<const S*>(p.src_ids) + l * layer_stride;
      const S* in = gathered;
      if (consecutive) {
        in = layer + srcs[0] * top_k;
      } else {
        for (int64_t i = 0; i < n; ++i) {
          copy_few_bytes(gathered + i * top_k, layer + srcs[i] * top_k, in_chunk);
        }
      }
      const int64_t written = layer_written_rows(p, l);
      const bool all_written = last_src < written;
      D* out = staged + l * top_k;
      bool any_bad;
#ifdef MOECAP_HAVE_FUSED_NARROW
      constexpr bool fused = TopK == 8 && std::is_same_v<S, int16_t> && std::is_same_v<D, uint8_t>;
#else
      constexpr bool fused = false;
#endif
      if constexpr (fused) {
        if (experts >= 1 && experts <= 256 && consecutive && l % 2 == 1) {
          any_bad = pair_bad;  // narrowed with the layer before; exact per row below when set
        } else if (experts >= 1 && experts <= 256 && consecutive && l + 1 < p.num_layers) {
          // This layer and the next in one pass (both read in place); the
          // next layer's iteration keeps only its checks, fill and consume.
          any_bad = pair_bad = narrow_layer_pair_i16_u8_k8(reinterpret_cast<const int16_t*>(in), layer_stride,
                                                           reinterpret_cast<uint8_t*>(out), srow, n, experts);
        } else if (experts >= 1 && experts <= 256) {
          any_bad = narrow_rows_i16_u8_k8(reinterpret_cast<const int16_t*>(in), reinterpret_cast<uint8_t*>(out), srow, n, experts);
        } else {
          any_bad = narrow_ids(in, narrowed, n * top_k, experts) != 0;
          for (int64_t i = 0; i < n; ++i) copy_few_bytes(out + i * srow, narrowed + i * top_k, id_chunk);
        }
      } else {
        any_bad = narrow_ids(in, narrowed, n * top_k, experts) != 0;
        if (spill_moves) {
          for (int64_t i = 0; i < n; ++i) std::memcpy(out + i * srow, narrowed + i * top_k, 16);
        } else {
          for (int64_t i = 0; i < n; ++i) copy_few_bytes(out + i * srow, narrowed + i * top_k, id_chunk);
        }
      }
      if (any_bad) {
        for (int64_t i = 0; i < n; ++i) {  // rare: which rows had no real id, counting the bad ones
          if (!all_written && srcs[i] >= written) continue;
          uint8_t row_bad = 0;
          for (int64_t k = 0; k < top_k; ++k) if (committed_id_bad(p, in[i * top_k + k])) row_bad = 1;
          bad[i] = static_cast<uint8_t>(bad[i] | row_bad);
        }
      }
      uint8_t* wout = staged_w + l * top_k * w_bytes;
      for (int64_t i = 0; w_bytes > 0 && i < n; ++i) {
        copy_few_bytes(wout + i * w_row, p.src_weights + (l * layer_stride + srcs[i] * top_k) * w_bytes,
                       static_cast<size_t>(top_k * w_bytes));
      }
      if (!all_written) {  // rows this step did not write in this layer: no routing
        for (int64_t i = 0; i < n; ++i) {
          if (srcs[i] < written) continue;
          for (int64_t k = 0; k < top_k; ++k) out[i * srow + k] = no_expert;
          if (w_bytes > 0) std::memset(wout + i * w_row, 0, static_cast<size_t>(top_k * w_bytes));
          bad[i] = 1;
        }
      }
      if (consume && run_rows > 0) consume_run(p, l, run_first, run_rows);
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t slot = slots[i];
      std::memcpy(reinterpret_cast<D*>(p.dst_ids) + slot * row, staged + i * srow, static_cast<size_t>(row) * sizeof(D));
      if (w_bytes > 0) std::memcpy(p.dst_weights + slot * w_row, staged_w + i * w_row, static_cast<size_t>(w_row));
      p.dst_states[slot] = committed_state(bad[i] != 0);
    }
    if (consume && n == 0 && run_rows > 0) {  // nothing went anywhere (slots -1): still consumed
      for (int64_t l = 0; l < p.num_layers; ++l) consume_run(p, l, run_first, run_rows);
    }
  }
}

template <class S, class D>
void commit_by_width(const CommitParams& p, bool consume) {
  switch (p.top_k) {
    case 1: commit_rows<1, S, D>(p, consume); break;
    case 2: commit_rows<2, S, D>(p, consume); break;
    case 3: commit_rows<3, S, D>(p, consume); break;
    case 4: commit_rows<4, S, D>(p, consume); break;
    case 6: commit_rows<6, S, D>(p, consume); break;
    case 8: commit_rows<8, S, D>(p, consume); break;
    case 10: commit_rows<10, S, D>(p, consume); break;
    case 12: commit_rows<12, S, D>(p, consume); break;
    default: commit_rows<0, S, D>(p, consume); break;
  }
}

template <class S>
void commit_from(const CommitParams& p, bool consume) {
  switch (p.dst_id_elem) {
    case kU8: commit_by_width<S, uint8_t>(p, consume); break;
    case kU16: commit_by_width<S, uint16_t>(p, consume); break;
    case kI16: commit_by_width<S, int16_t>(p, consume); break;
    default: commit_by_width<S, int32_t>(p, consume); break;
  }
}

void commit_dispatch(const CommitParams& p, bool consume) {
  switch (p.src_id_elem) {
    case kU8: commit_from<uint8_t>(p, consume); break;
    case kU16: commit_from<uint16_t>(p, consume); break;
    case kI16: commit_from<int16_t>(p, consume); break;
    default: commit_from<int32_t>(p, consume); break;
  }
}

}  // namespace

void commit_on_host(const CommitParams& p) { commit_dispatch(p, false); }

bool allow_host_avx2(bool allowed) {
#if defined(MOECAP_X86_DISPATCH)
  const bool before = use_avx2;
  use_avx2 = allowed && kCpuHasAvx2;
  return before;
#else
  (void)allowed;
  return false;
#endif
}

void claim_on_host(const CommitParams& p) {
  for (int64_t j = 0; j < p.count; ++j) claim_slot(p, j);
}

// The release kernel's twin, a run of bytes at a time rather than an element
// (the same stores: every listed row, every layer, all ones; weights zero).
void release_on_host(const CommitParams& p) {
  if (p.mode == kCommitRows) {
    for (int64_t l = 0; l < p.num_layers; ++l) {
      if (p.src_rows == nullptr) {
        const int64_t run_first = std::max<int64_t>(0, p.src_start);
        const int64_t run_rows = std::min<int64_t>(p.device_rows, p.src_start + p.count) - run_first;
        if (run_rows > 0) consume_run(p, l, run_first, run_rows);
        continue;
      }
      for (int64_t j = 0; j < p.count; ++j) {
        const int64_t src = load_int(p.src_rows, p.src_rows_elem, j);
        if (src >= 0 && src < p.device_rows) consume_run(p, l, src, 1);
      }
    }
  }
  finish_commit(p);
}

void commit_and_release_on_host(const CommitParams& p) {
  if (p.mode == kCommitRows && p.src_rows == nullptr) {
    commit_dispatch(p, true);
    finish_commit(p);
    return;
  }
  // A row list may name a row twice: every entry reads it before any consumes it.
  commit_on_host(p);
  release_on_host(p);
}

void take_errors_on_host(const TakeErrorsParams& p) {
  take_error(&p.errors->skipped_rows, &p.out->skipped_rows);
  take_error(&p.errors->invalid_ids, &p.out->invalid_ids);
}

namespace {

// One cache row of ids into the caller's dtype: the stored "no expert" code
// reads as -1, every other value as itself. Picked once per read, so the
// per-row loop makes one predictable indirect call and no dtype switch.
using RowWidening = void (*)(const uint8_t* src, void* dst, int64_t n, int64_t invalid_code);

template <class S, class D>
void widen_row_plain(const uint8_t* src, void* dst, int64_t n, int64_t invalid_code) {
  convert_ids(reinterpret_cast<const S*>(src), static_cast<D*>(dst), n, invalid_code);
}

// Every stored value read as itself, widened or truncated: right for
// INT64_MIN, for a signed code of -1 (sign extension keeps -1), and for an
// all-ones code into a narrower dtype (truncation keeps all ones).
template <class S, class D>
void widen_row_as_is(const uint8_t* src, void* dst, int64_t n, int64_t) {
  convert_ids(reinterpret_cast<const S*>(src), static_cast<D*>(dst), n, INT64_MIN);
}

// An unsigned stored dtype whose code is all ones, into a wider one: adding
// one wraps the code to 0, so zero-extending that and taking one off reads
// the code as -1 and every other id as itself, with no compare or select.
// Plain arithmetic that vectorizes on any target (on x86-64's SSE2 an add,
// the unpacks and a subtract; the compare-and-select form took three times
// the instructions).
template <class S, class D>
void widen_row_past_code(const uint8_t* src_bytes, void* dst_void, int64_t n, int64_t) {
  const S* __restrict src = reinterpret_cast<const S*>(src_bytes);
  D* __restrict dst = static_cast<D*>(dst_void);
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<D>(static_cast<D>(static_cast<S>(src[i] + 1u)) - 1);
}

// Same width: "no expert" as -1 truncates back to the stored all-ones value.
template <int Bytes>
void copy_row_as_stored(const uint8_t* src, void* dst, int64_t n, int64_t) {
  std::memcpy(dst, src, static_cast<size_t>(n * Bytes));
}

#if defined(MOECAP_X86_DISPATCH)
// 32 bytes of D lanes from the ids at s: zero-extended from an unsigned
// stored dtype (u8 ids 128..254 are real experts), sign-extended from a
// signed one. Reads exactly the bytes of those ids, so a row's last vector
// never reads past the row.
template <class S, class D>
MOECAP_AVX2 inline __attribute__((always_inline)) __m256i load_widened(const S* s) {
  constexpr bool sign = std::is_signed_v<S>;
  if constexpr (sizeof(S) == 1 && sizeof(D) == 2) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    return sign ? _mm256_cvtepi8_epi16(v) : _mm256_cvtepu8_epi16(v);
  } else if constexpr (sizeof(S) == 1 && sizeof(D) == 4) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
    return sign ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
  } else if constexpr (sizeof(S) == 1 && sizeof(D) == 8) {
    int32_t w;
    std::memcpy(&w, s, sizeof w);
    const __m128i v = _mm_cvtsi32_si128(w);
    return sign ? _mm256_cvtepi8_epi64(v) : _mm256_cvtepu8_epi64(v);
  } else if constexpr (sizeof(S) == 2 && sizeof(D) == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    return sign ? _mm256_cvtepi16_epi32(v) : _mm256_cvtepu16_epi32(v);
  } else if constexpr (sizeof(S) == 2 && sizeof(D) == 8) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
    return sign ? _mm256_cvtepi16_epi64(v) : _mm256_cvtepu16_epi64(v);
  } else {
    static_assert(sizeof(S) == 4 && sizeof(D) == 8, "a widening pair");
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    return sign ? _mm256_cvtepi32_epi64(v) : _mm256_cvtepu32_epi64(v);
  }
}

template <class D>
MOECAP_AVX2 inline __attribute__((always_inline)) __m256i lanes_equal(__m256i a, __m256i b) {
  if constexpr (sizeof(D) == 2) return _mm256_cmpeq_epi16(a, b);
  else if constexpr (sizeof(D) == 4) return _mm256_cmpeq_epi32(a, b);
  else return _mm256_cmpeq_epi64(a, b);
}

// One vector of ids; with MapCode the lanes equal to the (zero-extended)
// code become all ones, -1. Without it the widening alone is the answer: a
// signed stored code of -1 sign-extends to -1, and INT64_MIN means every
// stored value is a real id.
template <class S, class D, bool MapCode>
MOECAP_AVX2 inline __attribute__((always_inline)) void widen_lanes(const S* src, D* dst, __m256i code) {
  __m256i v = load_widened<S, D>(src);
  if constexpr (MapCode) v = _mm256_or_si256(v, lanes_equal<D>(v, code));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v);
}

// A row of n ids, four vectors an iteration; a tail shorter than a vector
// is the row's last full vector again (overlapping lanes get the same
// values), so only rows shorter than one vector take the scalar loop.
template <class S, class D, bool MapCode>
MOECAP_AVX2 void widen_row_avx2(const uint8_t* src_bytes, void* dst_void, int64_t n, int64_t invalid_code) {
  const S* src = reinterpret_cast<const S*>(src_bytes);
  D* dst = static_cast<D*>(dst_void);
  constexpr int64_t lanes = 32 / sizeof(D);
  if (n < lanes) {
    convert_ids(src, dst, n, MapCode ? invalid_code : INT64_MIN);
    return;
  }
  using UD = std::make_unsigned_t<D>;
  const UD code_lane = static_cast<UD>(static_cast<std::make_unsigned_t<S>>(invalid_code));
  __m256i code;
  if constexpr (sizeof(D) == 2) code = _mm256_set1_epi16(static_cast<short>(code_lane));
  else if constexpr (sizeof(D) == 4) code = _mm256_set1_epi32(static_cast<int>(code_lane));
  else code = _mm256_set1_epi64x(static_cast<long long>(code_lane));
  int64_t i = 0;
  for (; i + 4 * lanes <= n; i += 4 * lanes) {
    widen_lanes<S, D, MapCode>(src + i, dst + i, code);
    widen_lanes<S, D, MapCode>(src + i + lanes, dst + i + lanes, code);
    widen_lanes<S, D, MapCode>(src + i + 2 * lanes, dst + i + 2 * lanes, code);
    widen_lanes<S, D, MapCode>(src + i + 3 * lanes, dst + i + 3 * lanes, code);
  }
  for (; i + lanes <= n; i += lanes) widen_lanes<S, D, MapCode>(src + i, dst + i, code);
  if (i < n) widen_lanes<S, D, MapCode>(src + n - lanes, dst + n - lanes, code);
}

// The AVX2 widening of a stored dtype S into a wider D, or nullptr where the
// plain code should run (a signed stored code other than -1 is not one the
// plan makes, and sign extension alone would not map it).
template <class S, class D>
RowWidening avx2_widening(int64_t invalid_code) {
  if (invalid_code == INT64_MIN) return widen_row_avx2<S, D, false>;
  if constexpr (std::is_signed_v<S>) {
    return invalid_code == -1 ? widen_row_avx2<S, D, false> : nullptr;
  } else {
    return widen_row_avx2<S, D, true>;
  }
}

RowWidening pick_avx2_widening(int32_t stored, int32_t dst, int64_t invalid_code) {
  const int dst_bytes = elem_bytes(dst);
  switch (stored) {
    case kU8:
      return dst_bytes == 2   ? avx2_widening<uint8_t, uint16_t>(invalid_code)
             : dst_bytes == 4 ? avx2_widening<uint8_t, int32_t>(invalid_code)
             : dst_bytes == 8 ? avx2_widening<uint8_t, int64_t>(invalid_code)
                              : nullptr;
    case kU16:
      return dst_bytes == 4   ? avx2_widening<uint16_t, int32_t>(invalid_code)
             : dst_bytes == 8 ? avx2_widening<uint16_t, int64_t>(invalid_code)
                              : nullptr;
    case kI16:
      return dst_bytes == 4   ? avx2_widening<int16_t, int32_t>(invalid_code)
             : dst_bytes == 8 ? avx2_widening<int16_t, int64_t>(invalid_code)
                              : nullptr;
    case kI32:
      return dst_bytes == 8 ? avx2_widening<int32_t, int64_t>(invalid_code) : nullptr;
    default:
      return nullptr;
  }
}
#endif

// pick(D{}) with D the C type of the read's output id dtype `dst`.
template <class Pick>
RowWidening with_dst_type(int32_t dst, Pick pick) {
  switch (dst) {
    case kU8: return pick(uint8_t{});
    case kI8: return pick(int8_t{});
    case kU16: return pick(uint16_t{});
    case kI16: return pick(int16_t{});
    case kI32: return pick(int32_t{});
    default: return pick(int64_t{});
  }
}

RowWidening pick_row_widening(int32_t stored, int32_t dst, int64_t invalid_code) {
  // The plan's code is all ones in the stored dtype, or there is none
  // (INT64_MIN); either way no output width needs a compare: all ones
  // truncates to all ones, which is -1, and a wider dtype takes the
  // add-one trick (unsigned) or sign extension (signed).
  const bool code_all_ones = invalid_code == invalid_id_code(stored);
  const bool no_compare = code_all_ones || invalid_code == INT64_MIN;
  if (stored == dst || (no_compare && elem_bytes(stored) == elem_bytes(dst))) {
    switch (elem_bytes(stored)) {
      case 1: return copy_row_as_stored<1>;
      case 2: return copy_row_as_stored<2>;
      case 4: return copy_row_as_stored<4>;
      default: return copy_row_as_stored<8>;
    }
  }
#if defined(MOECAP_X86_DISPATCH)
  if (use_avx2) {
    if (const RowWidening w = pick_avx2_widening(stored, dst, invalid_code)) return w;
  }
#endif
  const auto from = [&](auto stored_type) {
    using S = decltype(stored_type);
    return with_dst_type(dst, [&](auto dst_type) -> RowWidening {
      using D = decltype(dst_type);
      if (!no_compare) return widen_row_plain<S, D>;
      if constexpr (std::is_unsigned_v<S> && sizeof(D) > sizeof(S)) {
        if (code_all_ones) return widen_row_past_code<S, D>;
      }
      return widen_row_as_is<S, D>;
    });
  };
  switch (stored) {
    case kU8: return from(uint8_t{});
    case kU16: return from(uint16_t{});
    case kI16: return from(int16_t{});
    default: return from(int32_t{});
  }
}

// One cache row of weights into the caller's weight dtype, picked once per
// read like the ids: with both dtypes fixed at compile time the per-element
// switches of load_float/store_float fold away and the conversion
// vectorizes, where the switch per element cost more than the memory did.
using RowWeights = void (*)(const uint8_t* src, uint8_t* dst, int64_t n);

template <int Bytes>
void copy_weights_as_stored(const uint8_t* src, uint8_t* dst, int64_t n) {
  std::memcpy(dst, src, static_cast<size_t>(n * Bytes));
}

template <int32_t Stored, int32_t Dst>
void convert_weights(const uint8_t* src, uint8_t* dst, int64_t n) {
  for (int64_t e = 0; e < n; ++e) store_float(dst, Dst, e, load_float(src, Stored, e));
}

template <int32_t Stored>
RowWeights weights_from(int32_t dst) {
  switch (dst) {
    case kBF16: return convert_weights<Stored, kBF16>;
    case kF16: return convert_weights<Stored, kF16>;
    default: return convert_weights<Stored, kF32>;
  }
}

RowWeights pick_row_weights(int32_t stored, int32_t dst) {
  if (stored == dst) return elem_bytes(stored) == 2 ? copy_weights_as_stored<2> : copy_weights_as_stored<4>;
  switch (stored) {
    case kBF16: return weights_from<kBF16>(dst);
    case kF16: return weights_from<kF16>(dst);
    default: return weights_from<kF32>(dst);
  }
}

// How many slots ahead the rows are requested: enough to cover a miss to
// memory with a few hundred bytes of rows in flight, few enough that the
// prefetched lines are still in L1/L2 when their turn comes.
constexpr int64_t kReadAhead = 8;

template <class Slot>
void gather_slots(const GatherParams& p, RowWidening widen, RowWeights weights_row) {
  const Slot* slots = static_cast<const Slot*>(p.slots);
  const int64_t row = p.row_elements;
  const int64_t id_row_bytes = row * elem_bytes(p.stored_id_elem);
  const int64_t out_row_bytes = row * elem_bytes(p.dst_id_elem);
  const bool weights = p.dst_weights != nullptr;
  const int64_t w_bytes = weights ? elem_bytes(p.stored_weight_elem) : 0;
  const int64_t w_row_bytes = row * w_bytes;
  const int64_t dst_w_row_bytes = weights ? row * elem_bytes(p.dst_weight_elem) : 0;
  for (int64_t t = 0; t < p.count; ++t) {
    if (t + kReadAhead < p.count) {
      const int64_t ahead = static_cast<int64_t>(slots[t + kReadAhead]);
      __builtin_prefetch(p.states + ahead, 0, 3);
      prefetch_lines<false>(p.src_ids + ahead * id_row_bytes, id_row_bytes);
      if (weights) prefetch_lines<false>(p.src_weights + ahead * w_row_bytes, w_row_bytes);
    }
    const int64_t slot = static_cast<int64_t>(slots[t]);
    const uint8_t state = p.states[slot];
    void* dst = static_cast<uint8_t*>(p.dst_ids) + t * out_row_bytes;
    uint8_t* wdst = weights ? static_cast<uint8_t*>(p.dst_weights) + t * dst_w_row_bytes : nullptr;
    if (!slot_readable(state, p.invalid_code)) {
      std::memset(dst, 0xff, static_cast<size_t>(out_row_bytes));  // -1 in every integer width
      if (weights) std::memset(wdst, 0, static_cast<size_t>(dst_w_row_bytes));
      continue;
    }
    const uint8_t* src = p.src_ids + slot * id_row_bytes;
    widen(src, dst, row, p.invalid_code);
    if (!weights) continue;
    weights_row(p.src_weights + slot * w_row_bytes, wdst, row);
    if ((state & kSlotInvalidIds) == 0) continue;
    for (int64_t e = 0; e < row; ++e) {  // an id read as -1 carries no weight
      if (load_int(src, p.stored_id_elem, e) == p.invalid_code) store_float(wdst, p.dst_weight_elem, e, 0.0f);
    }
  }
}

}  // namespace

void gather_on_host(const GatherParams& p) {
  const RowWidening widen = pick_row_widening(p.stored_id_elem, p.dst_id_elem, p.invalid_code);
  const RowWeights weights = p.dst_weights != nullptr ? pick_row_weights(p.stored_weight_elem, p.dst_weight_elem) : nullptr;
  if (p.slots_elem == kI32) {
    gather_slots<int32_t>(p, widen, weights);
  } else {
    gather_slots<int64_t>(p, widen, weights);
  }
}

}  // namespace moecap
