// SPDX-License-Identifier: Apache-2.0
// The routing record (abi/moecap_record.h, docs/RECORD_FORMAT.md): encode and
// decode in host memory. python/moecap/record.py calls these through the
// binding.
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "base/status.h"
#include "graphs/element.h"
#include "moecap_record.h"
#include "plugin/abi_structs.h"
#include "plugin/backend.h"
#include "plugin/guarded.h"
#include "plugin/tensor_args.h"

namespace moecap {
namespace {

constexpr uint8_t kMagic[4] = {'M', 'C', 'R', 'T'};
// Weights are copied as their in-memory bytes, which are the record's little-endian ones.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the routing record's weights assume a little-endian host");
constexpr uint32_t kKnownFlags = MOECAP_RECORD_PACKED | MOECAP_RECORD_HAS_WEIGHTS | MOECAP_RECORD_HAS_VALIDITY;

// The narrowest width whose all-ones code is no valid id.
int32_t packed_bits(int64_t num_experts) {
  int32_t bits = 1;
  while ((int64_t{1} << bits) - 1 < num_experts) ++bits;
  return bits;
}

int32_t plain_bits(int64_t num_experts) { return num_experts <= 0xff ? 8 : num_experts <= 0xffff ? 16 : 32; }

int32_t weight_dtype_of(int32_t elem) {
  return elem == kF32 ? MOECAP_WEIGHTS_F32 : elem == kBF16 ? MOECAP_WEIGHTS_BF16 : MOECAP_WEIGHTS_F16;
}

int32_t weight_elem_of(int32_t dtype) { return dtype == MOECAP_WEIGHTS_F32 ? kF32 : dtype == MOECAP_WEIGHTS_BF16 ? kBF16 : kF16; }

uint64_t mul(uint64_t a, uint64_t b, const char* what) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) fail(MOECAP_ERROR_INVALID_ARGUMENT, what, " overflows 64 bits");
  return r;
}

// Where each section sits; everything the encoder and the decoder share.
struct Layout {
  int64_t tokens = 0, layers = 0, top_k = 0, num_experts = 0;
  int64_t start = 0;  // start_position, as parsed (an encoder takes the source's)
  uint64_t codes = 0;
  int32_t id_bits = 0;
  uint32_t flags = 0;
  int32_t weight_elem = -1;
  uint64_t validity_at = 0, ids_at = 0, weights_at = 0, total = 0;

  uint64_t width() const { return static_cast<uint64_t>(id_bits); }
  uint64_t sentinel() const { return (uint64_t{1} << id_bits) - 1; }
  bool packed() const { return flags & MOECAP_RECORD_PACKED; }

  void place() {
    codes = mul(mul(static_cast<uint64_t>(tokens), static_cast<uint64_t>(layers), "tokens * layers"),
                static_cast<uint64_t>(top_k), "tokens * layers * top_k");
    // Bits rounded up to bytes without an addition: near 2^64 bits, `+ 7`
    // would wrap to an empty id section that a 40-byte buffer satisfies.
    const uint64_t id_bits_total = mul(codes, static_cast<uint64_t>(id_bits), "the id section");
    const uint64_t id_bytes = id_bits_total / 8 + (id_bits_total % 8 != 0 ? 1 : 0);
    validity_at = MOECAP_RECORD_HEADER_BYTES;
    ids_at = validity_at + ((flags & MOECAP_RECORD_HAS_VALIDITY) ? (static_cast<uint64_t>(tokens) + 7) / 8 : 0);
    weights_at = ids_at + id_bytes;  // id_bytes <= 2^61 and ids_at < 2^61: no wrap
    const uint64_t weight_bytes = weight_elem < 0 ? 0 : mul(codes, static_cast<uint64_t>(elem_bytes(weight_elem)), "the weight section");
    if (__builtin_add_overflow(weights_at, weight_bytes, &total)) {
      fail(MOECAP_ERROR_INVALID_ARGUMENT, "the record size overflows 64 bits");
    }
  }
};

void put_le(uint8_t* p, uint64_t v, uint64_t bytes) {
  for (uint64_t i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

uint64_t get_le(const uint8_t* p, uint64_t bytes) {
  uint64_t v = 0;
  for (uint64_t i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// Bit t of a validity bitmap (LSB first).
bool bit_set(const uint8_t* bitmap, int64_t t) { return ((static_cast<unsigned>(bitmap[t / 8]) >> (t % 8)) & 1u) != 0; }

// Code i of the id section (packed bit stream or plain little-endian ints).
uint64_t get_code(const uint8_t* ids, const Layout& l, uint64_t i) {
  if (!l.packed()) return get_le(ids + i * (l.width() / 8), l.width() / 8);
  const uint64_t bit = i * l.width();
  const uint64_t first = bit / 8, last = (bit + l.width() - 1) / 8;
  uint64_t window = 0;
  for (uint64_t b = first; b <= last; ++b) window |= static_cast<uint64_t>(ids[b]) << (8 * (b - first));
  return (window >> (bit % 8)) & l.sentinel();
}

// --- Fast paths ---------------------------------------------------------------
// The codec works in chunks of kChunk codes (a multiple of 8): each chunk's
// codes are unpacked into (or packed from) a small uint32 scratch array by a
// routine specialised for the code width, then checked or written by plain
// typed loops that the compiler vectorises. get_code above stays the
// definition (and the reference check_contents_reference below uses it).

constexpr uint64_t kChunk = 2048;

inline uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Calls sink(j, code) for codes [first, first + n) of an id section of
// width W, in order (first % 8 == 0, so the first code starts on a byte).
// `avail` is how many bytes of the record follow `ids`: whole 8-byte loads
// stay inside it.
template <int W, class Sink>
inline void for_codes(const uint8_t* ids, uint64_t first, uint64_t n, uint64_t avail, Sink&& sink) {
  static_assert(W >= 1 && W <= 32, "code width");
  const uint64_t at = first / 8 * W;  // 8 codes take exactly W bytes
  const uint8_t* base = ids + at;
  if constexpr (W == 8 || W == 16 || W == 32) {
    using U = std::conditional_t<W == 8, uint8_t, std::conditional_t<W == 16, uint16_t, uint32_t>>;
    for (uint64_t j = 0; j < n; ++j) {
      U v;
      std::memcpy(&v, base + j * sizeof(U), sizeof(U));
      sink(j, static_cast<uint32_t>(v));
    }
    (void)avail;
  } else {
    constexpr uint64_t mask = (uint64_t{1} << W) - 1;
    // Group g (codes 8g..8g+7) reads bytes [g*W, g*W + (W - 1) + 8).
    const uint64_t left = avail - at;
    uint64_t groups = n / 8;
    const uint64_t safe = left >= static_cast<uint64_t>(W) + 7 ? (left - W - 7) / W + 1 : 0;
    if (groups > safe) groups = safe;
    for (uint64_t g = 0; g < groups; ++g) {
      const uint8_t* q = base + g * W;
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        sink(g * 8 + static_cast<uint64_t>(j), static_cast<uint32_t>((load_u64(q + (j * W) / 8) >> ((j * W) % 8)) & mask));
      }
    }
    for (uint64_t j = groups * 8; j < n; ++j) {  // the last codes, byte by byte
      const uint64_t bit = j * W;
      uint64_t window = 0;
      for (uint64_t b = bit / 8; b <= (bit + W - 1) / 8; ++b) window |= static_cast<uint64_t>(base[b]) << (8 * (b - bit / 8));
      sink(j, static_cast<uint32_t>((window >> (bit % 8)) & mask));
    }
  }
}

template <int W>
void unpack_codes(const uint8_t* ids, uint64_t first, uint64_t n, uint64_t avail, uint32_t* out) {
  for_codes<W>(ids, first, n, avail, [out](uint64_t j, uint32_t c) { out[j] = c; });
}

// The largest (code + 1) mod 2^W: the sentinel counts 0, expert e counts
// e + 1, so every code is an expert or the sentinel iff it is <= num_experts.
template <int W>
uint32_t top_code(const uint8_t* ids, uint64_t n, uint64_t avail) {
  constexpr uint32_t mask = static_cast<uint32_t>((uint64_t{1} << W) - 1);
  uint32_t top = 0;
  for_codes<W>(ids, 0, n, avail, [&top](uint64_t, uint32_t c) {
    const uint32_t x = (c + 1u) & mask;
    top = x > top ? x : top;
  });
  return top;
}

// Ids of codes [0, n): -1 for the sentinel (codes checked, and Out holds every expert).
template <int W, class Out>
void decode_ids(const uint8_t* ids, uint64_t n, uint64_t avail, void* out) {
  constexpr uint32_t sentinel = static_cast<uint32_t>((uint64_t{1} << W) - 1);
  Out* o = static_cast<Out*>(out);
  for_codes<W>(ids, 0, n, avail, [o](uint64_t j, uint32_t c) { o[j] = c == sentinel ? Out{-1} : static_cast<Out>(c); });
}

template <int W, int J>
inline void pack_one(const uint32_t* codes, uint64_t* w) {
  constexpr int bit = J * W, k = bit / 64, shift = bit % 64;
  w[k] |= static_cast<uint64_t>(codes[J]) << shift;
  if constexpr (shift + W > 64) w[k + 1] |= static_cast<uint64_t>(codes[J]) >> (64 - shift);
}

template <int W, size_t... J>
inline void pack_group(const uint32_t* codes, uint64_t* w, std::index_sequence<J...>) {
  (pack_one<W, static_cast<int>(J)>(codes, w), ...);
}

// codes[0, n) into an id section of width W from code `first` (first % 8 ==
// 0). Every byte is written, whole bytes in order, the last one holding the
// stream's zero padding (encode clears only the header and validity).
template <int W>
void pack_codes(const uint32_t* codes, uint64_t first, uint64_t n, uint8_t* ids) {
  uint8_t* dst = ids + first / 8 * W;
  if constexpr (W == 8 || W == 16 || W == 32) {
    using U = std::conditional_t<W == 8, uint8_t, std::conditional_t<W == 16, uint16_t, uint32_t>>;
    for (uint64_t j = 0; j < n; ++j) {
      const U v = static_cast<U>(codes[j]);
      std::memcpy(dst + j * sizeof(U), &v, sizeof(U));
    }
  } else {
    // Whole groups: 8 codes fill exactly W bytes, assembled in up to four 64-bit words.
    const uint64_t groups = n / 8;
    for (uint64_t g = 0; g < groups; ++g) {
      uint64_t w[4] = {0, 0, 0, 0};
      pack_group<W>(codes + g * 8, w, std::make_index_sequence<8>{});
      std::memcpy(dst + g * W, w, W);
    }
    dst += groups * W;
    codes += groups * 8;
    n -= groups * 8;
    // The tail (the record's last codes), through a 64-bit buffer.
    uint64_t buf = 0;
    int bits = 0;
    for (uint64_t j = 0; j < n; ++j) {
      buf |= static_cast<uint64_t>(codes[j]) << bits;
      bits += W;
      if (bits >= 32) {
        const uint32_t word = static_cast<uint32_t>(buf);
        std::memcpy(dst, &word, 4);
        dst += 4;
        buf >>= 32;
        bits -= 32;
      }
    }
    for (; bits > 0; bits -= 8, buf >>= 8) *dst++ = static_cast<uint8_t>(buf);
  }
}

using UnpackFn = void (*)(const uint8_t*, uint64_t, uint64_t, uint64_t, uint32_t*);
using PackFn = void (*)(const uint32_t*, uint64_t, uint64_t, uint8_t*);

template <size_t... I>
constexpr std::array<UnpackFn, sizeof...(I)> unpack_table(std::index_sequence<I...>) {
  return {&unpack_codes<static_cast<int>(I) + 1>...};
}
template <size_t... I>
constexpr std::array<PackFn, sizeof...(I)> pack_table(std::index_sequence<I...>) {
  return {&pack_codes<static_cast<int>(I) + 1>...};
}
constexpr auto kUnpack = unpack_table(std::make_index_sequence<32>{});

using TopFn = uint32_t (*)(const uint8_t*, uint64_t, uint64_t);
using DecodeIdsFn = void (*)(const uint8_t*, uint64_t, uint64_t, void*);
template <size_t... I>
constexpr std::array<TopFn, sizeof...(I)> top_table(std::index_sequence<I...>) {
  return {&top_code<static_cast<int>(I) + 1>...};
}
// Rows int8, int16, int32, int64 (ids_out's dtypes).
template <class Out, size_t... I>
constexpr std::array<DecodeIdsFn, sizeof...(I)> decode_row(std::index_sequence<I...>) {
  return {&decode_ids<static_cast<int>(I) + 1, Out>...};
}
constexpr auto kTop = top_table(std::make_index_sequence<32>{});
constexpr std::array<std::array<DecodeIdsFn, 32>, 4> kDecodeIds = {
    decode_row<int8_t>(std::make_index_sequence<32>{}), decode_row<int16_t>(std::make_index_sequence<32>{}),
    decode_row<int32_t>(std::make_index_sequence<32>{}), decode_row<int64_t>(std::make_index_sequence<32>{})};
constexpr auto kPack = pack_table(std::make_index_sequence<32>{});

// Calls f(t, begin, end) for each token t's part [begin, end) of codes [i0, i1).
template <class F>
void for_token_runs(uint64_t i0, uint64_t i1, uint64_t row, F&& f) {
  for (uint64_t i = i0; i < i1;) {
    const uint64_t t = i / row;
    const uint64_t end = (t + 1) * row < i1 ? (t + 1) * row : i1;
    f(t, i, end);
    i = end;
  }
}

// Whether every code is an expert or the sentinel and every invalid token
// holds only sentinels and zero weight bytes: check_contents_reference's
// per-code conditions, answered without saying which one failed.
bool codes_ok(const uint8_t* p, const Layout& l, uint64_t record_bytes) {
  if (!(l.flags & MOECAP_RECORD_HAS_VALIDITY)) {  // every token valid: one pass, no scratch
    return kTop[static_cast<size_t>(l.id_bits - 1)](p + l.ids_at, l.codes, record_bytes - l.ids_at) <=
           static_cast<uint32_t>(l.num_experts);
  }
  const UnpackFn unpack = kUnpack[static_cast<size_t>(l.id_bits - 1)];
  const uint32_t sentinel = static_cast<uint32_t>(l.sentinel());
  const uint32_t experts = static_cast<uint32_t>(l.num_experts);
  const uint64_t row = static_cast<uint64_t>(l.layers * l.top_k);
  const uint64_t wbytes = l.weight_elem >= 0 ? static_cast<uint64_t>(elem_bytes(l.weight_elem)) : 0;
  const uint8_t* ids = p + l.ids_at;
  uint32_t codes[kChunk];
  for (uint64_t i0 = 0; i0 < l.codes; i0 += kChunk) {
    const uint64_t n = l.codes - i0 < kChunk ? l.codes - i0 : kChunk;
    unpack(ids, i0, n, record_bytes - l.ids_at, codes);
    // code + 1 wraps the sentinel to 0 (mod 2^W), an expert e to e + 1 <= experts: all fine iff the max is.
    uint32_t top = 0;
    for (uint64_t j = 0; j < n; ++j) {
      const uint32_t x = (codes[j] + 1u) & sentinel;
      top = x > top ? x : top;
    }
    if (top > experts) return false;
    bool ok = true;
    for_token_runs(i0, i0 + n, row, [&](uint64_t t, uint64_t b, uint64_t e) {
      if (bit_set(p + l.validity_at, static_cast<int64_t>(t))) return;
      uint32_t differ = 0;
      for (uint64_t j = b; j < e; ++j) differ |= codes[j - i0] ^ sentinel;
      uint8_t nonzero = 0;
      const uint8_t* w = p + l.weights_at + b * wbytes;
      for (uint64_t k = 0; k < (e - b) * wbytes; ++k) nonzero |= w[k];
      if (differ != 0 || nonzero != 0) ok = false;
    });
    if (!ok) return false;
  }
  return true;
}

template <class Out>
void write_ids(const uint32_t* codes, uint64_t n, uint32_t sentinel, Out* out) {
  for (uint64_t j = 0; j < n; ++j) out[j] = codes[j] == sentinel ? Out{-1} : static_cast<Out>(codes[j]);
}

template <int32_t In>
float load_weight(const uint8_t* p) {
  if constexpr (In == kF32) {
    uint32_t b;
    std::memcpy(&b, p, 4);
    return bits_float(b);
  } else {
    uint16_t b;
    std::memcpy(&b, p, 2);
    return In == kBF16 ? bf16_to_float(b) : f16_to_float(b);
  }
}

// Weights of codes [0, n) from the record's (dtype In, at src) into out (dtype Out): 0 for "no expert".
template <int32_t In, int32_t Out>
void write_weights(const uint32_t* codes, uint64_t n, uint32_t sentinel, const uint8_t* src, void* out) {
  constexpr uint64_t in_bytes = In == kF32 ? 4 : 2;
  for (uint64_t j = 0; j < n; ++j) {
    const float v = codes[j] == sentinel ? 0.0f : load_weight<In>(src + j * in_bytes);
    store_float(out, Out, static_cast<int64_t>(j), v);
  }
}

using WeightsFn = void (*)(const uint32_t*, uint64_t, uint32_t, const uint8_t*, void*);

WeightsFn weights_fn(int32_t in, int32_t out) {
  constexpr int32_t kF[3] = {kF32, kBF16, kF16};
  static constexpr WeightsFn table[3][3] = {
      {&write_weights<kF32, kF32>, &write_weights<kF32, kBF16>, &write_weights<kF32, kF16>},
      {&write_weights<kBF16, kF32>, &write_weights<kBF16, kBF16>, &write_weights<kBF16, kF16>},
      {&write_weights<kF16, kF32>, &write_weights<kF16, kBF16>, &write_weights<kF16, kF16>}};
  int a = 0, b = 0;
  while (kF[a] != in) ++a;
  while (kF[b] != out) ++b;
  return table[a][b];
}

// Decodes a record parse() accepted into outputs decode checked.
void decode_codes(const uint8_t* p, uint64_t record_bytes, const Layout& l, uint8_t* ids_out, int32_t id_elem,
                  uint8_t* weights_out, int32_t weight_elem) {
  const UnpackFn unpack = kUnpack[static_cast<size_t>(l.id_bits - 1)];
  const uint32_t sentinel = static_cast<uint32_t>(l.sentinel());
  const WeightsFn weights = weight_elem >= 0 ? weights_fn(l.weight_elem, weight_elem) : nullptr;
  const uint64_t in_bytes = weight_elem >= 0 ? static_cast<uint64_t>(elem_bytes(l.weight_elem)) : 0;
  const uint64_t out_bytes = weight_elem >= 0 ? static_cast<uint64_t>(elem_bytes(weight_elem)) : 0;
  const uint64_t id_bytes = static_cast<uint64_t>(elem_bytes(id_elem));
  if (weights == nullptr) {  // ids alone: straight from the record, no scratch
    const size_t row = id_elem == kI8 ? 0 : id_elem == kI16 ? 1 : id_elem == kI32 ? 2 : 3;
    kDecodeIds[row][static_cast<size_t>(l.id_bits - 1)](p + l.ids_at, l.codes, record_bytes - l.ids_at, ids_out);
    return;
  }
  uint32_t codes[kChunk];
  for (uint64_t i0 = 0; i0 < l.codes; i0 += kChunk) {
    const uint64_t n = l.codes - i0 < kChunk ? l.codes - i0 : kChunk;
    unpack(p + l.ids_at, i0, n, record_bytes - l.ids_at, codes);
    uint8_t* o = ids_out + i0 * id_bytes;
    switch (id_elem) {
      case kI8: write_ids(codes, n, sentinel, reinterpret_cast<int8_t*>(o)); break;
      case kI16: write_ids(codes, n, sentinel, reinterpret_cast<int16_t*>(o)); break;
      case kI32: write_ids(codes, n, sentinel, reinterpret_cast<int32_t*>(o)); break;
      default: write_ids(codes, n, sentinel, reinterpret_cast<int64_t*>(o)); break;
    }
    if (weights != nullptr) weights(codes, n, sentinel, p + l.weights_at + i0 * in_bytes, weights_out + i0 * out_bytes);
  }
}

void require_host(const DLTensor* t, const char* name) {
  if (!Backend::host_can_read(t->device)) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, name, " is on ", device_name(t->device), "; expected host memory");
  }
}

struct Source {
  moecap_record_source args{};  // the caller's struct at this library's size
  Layout layout;
  int32_t id_elem = -1;
  const uint8_t* valid = nullptr;  // nullptr: every token valid

  bool token_valid(int64_t t) const { return valid == nullptr || valid[t] != 0; }
};

// Every token's position, start + t, is an int64 (as a reader computes it).
void check_last_position(int64_t start, int64_t tokens, const char* name) {
  if (tokens > 0 && start > INT64_MAX - (tokens - 1)) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, name, " is ", start, " with ", tokens,
         " tokens; the last token's position must be below 2^63");
  }
}

template <class T>
bool source_ids_ok_t(const T* ids, int64_t tokens, int64_t row, int64_t num_experts, const uint8_t* valid,
                     bool* any_invalid) {
  // v in [-1, num_experts) as two compares in T: the largest id T can hold is below num_experts or is T's max.
  const T lo = -1;
  const T hi = static_cast<T>(num_experts - 1 < std::numeric_limits<T>::max() ? num_experts - 1
                                                                              : std::numeric_limits<T>::max());
  for (int64_t t = 0; t < tokens; ++t) {
    if (valid != nullptr && valid[t] == 0) {
      *any_invalid = true;
      continue;
    }
    const T* r = ids + t * row;
    T mn = r[0], mx = r[0];  // min / max reductions vectorise where a flag does not
    for (int64_t j = 1; j < row; ++j) {
      mn = r[j] < mn ? r[j] : mn;
      mx = r[j] > mx ? r[j] : mx;
    }
    if (mn < lo || mx > hi) return false;
  }
  return true;
}

// Whether every id of a valid token is an expert or -1 (the loop in check_source, without naming which is not).
bool source_ids_ok(const uint8_t* ids, int32_t elem, int64_t tokens, int64_t row, int64_t num_experts,
                   const uint8_t* valid, bool* any_invalid) {
  switch (elem) {
    case kI8: return source_ids_ok_t(reinterpret_cast<const int8_t*>(ids), tokens, row, num_experts, valid, any_invalid);
    case kI16: return source_ids_ok_t(reinterpret_cast<const int16_t*>(ids), tokens, row, num_experts, valid, any_invalid);
    case kI32: return source_ids_ok_t(reinterpret_cast<const int32_t*>(ids), tokens, row, num_experts, valid, any_invalid);
    default: return source_ids_ok_t(reinterpret_cast<const int64_t*>(ids), tokens, row, num_experts, valid, any_invalid);
  }
}

Source check_source(const moecap_record_source* caller) {
  Source out;
  out.args = read_struct(caller, MOECAP_RECORD_SOURCE_SIZE_1_1, "source");
  const moecap_record_source* s = &out.args;
  if (s->flags & ~uint32_t{MOECAP_RECORD_PACKED}) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "source->flags is ", s->flags, "; only MOECAP_RECORD_PACKED (1) is defined");
  }
  if (s->num_experts < 1) fail(MOECAP_ERROR_INVALID_ARGUMENT, "source->num_experts is ", s->num_experts, "; must be >= 1");
  if (s->start_position < 0) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "source->start_position is ", s->start_position, "; must be >= 0");
  }
  Layout& l = out.layout;
  out.id_elem = check_tensor(s->ids, {"source->ids", {kI8, kI16, kI32, kI64}, 3});
  require_host(s->ids, "source->ids");
  l.tokens = s->ids->shape[0];
  check_last_position(s->start_position, l.tokens, "source->start_position");
  l.layers = s->ids->shape[1];
  l.top_k = s->ids->shape[2];
  if (l.layers < 1 || l.top_k < 1 || l.layers > INT32_MAX || l.top_k > INT32_MAX) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "source->ids has shape [", l.tokens, ", ", l.layers, ", ", l.top_k,
         "]; layers and top_k must be in [1, 2^31)");
  }
  l.num_experts = s->num_experts;
  l.flags = s->flags;
  l.id_bits = l.packed() ? packed_bits(l.num_experts) : plain_bits(l.num_experts);
  if (s->weights != nullptr) {
    l.weight_elem = check_tensor(s->weights, {"source->weights", {kF32, kBF16, kF16}, 3});
    require_host(s->weights, "source->weights");
    check_same_shape(s->weights, "source->weights", s->ids, "source->ids");
    l.flags |= MOECAP_RECORD_HAS_WEIGHTS;
  }
  if (s->valid != nullptr) {
    check_tensor(s->valid, {"source->valid", {kU8, kI8}, 1});
    require_host(s->valid, "source->valid");
    check_dim(s->valid, "source->valid", 0, l.tokens, "tokens of source->ids");
    out.valid = tensor_data(s->valid);
  }
  // Every id of a valid token must be an expert or -1; an invalid token's are ignored.
  const uint8_t* ids = tensor_data(s->ids);
  const int64_t row = l.layers * l.top_k;
  bool any_invalid = false;
  if (source_ids_ok(ids, out.id_elem, l.tokens, row, l.num_experts, out.valid, &any_invalid)) {
    if (any_invalid) l.flags |= MOECAP_RECORD_HAS_VALIDITY;
    l.place();
    return out;
  }
  // Some id is out of range: the reference loop names the first one.
  for (int64_t t = 0; t < l.tokens; ++t) {
    if (!out.token_valid(t)) {
      l.flags |= MOECAP_RECORD_HAS_VALIDITY;
      continue;
    }
    for (int64_t j = 0; j < row; ++j) {
      const int64_t v = load_int(ids, out.id_elem, t * row + j);
      if (v < -1 || v >= l.num_experts) {
        fail(MOECAP_ERROR_OUT_OF_RANGE, "source->ids[", t, ", ", j / l.top_k, ", ", j % l.top_k, "] is ", v,
             "; expected [0, num_experts = ", l.num_experts, ") or -1");
      }
    }
  }
  l.place();
  return out;
}

// Codes of source ids [first, first + n) (of a valid token, checked): the id, or the sentinel for -1.
template <class T>
void source_codes_t(const T* ids, uint64_t n, uint32_t sentinel, uint32_t* out) {
  for (uint64_t j = 0; j < n; ++j) out[j] = ids[j] < 0 ? sentinel : static_cast<uint32_t>(ids[j]);
}

void source_codes(const uint8_t* ids, int32_t elem, uint64_t first, uint64_t n, uint32_t sentinel, uint32_t* out) {
  switch (elem) {
    case kI8: return source_codes_t(reinterpret_cast<const int8_t*>(ids) + first, n, sentinel, out);
    case kI16: return source_codes_t(reinterpret_cast<const int16_t*>(ids) + first, n, sentinel, out);
    case kI32: return source_codes_t(reinterpret_cast<const int32_t*>(ids) + first, n, sentinel, out);
    default: return source_codes_t(reinterpret_cast<const int64_t*>(ids) + first, n, sentinel, out);
  }
}

// Weight bytes of codes [0, n) as given, 0 where the code is "no expert".
template <class U>
void copy_weights(const uint32_t* codes, uint64_t n, uint32_t sentinel, const uint8_t* in, uint8_t* out) {
  for (uint64_t j = 0; j < n; ++j) {
    U v;
    std::memcpy(&v, in + j * sizeof(U), sizeof(U));
    v = codes[j] == sentinel ? U{0} : v;
    std::memcpy(out + j * sizeof(U), &v, sizeof(U));
  }
}

void encode(const Source& src, uint8_t* out) {
  const moecap_record_source* s = &src.args;
  const Layout& l = src.layout;
  std::memset(out, 0, l.ids_at);  // header and validity; the loop below writes every id and weight byte
  std::memcpy(out, kMagic, 4);
  put_le(out + 4, MOECAP_RECORD_VERSION, 2);
  put_le(out + 6, MOECAP_RECORD_HEADER_BYTES, 2);
  out[8] = static_cast<uint8_t>(l.id_bits);
  out[9] = static_cast<uint8_t>(l.flags);
  out[10] = static_cast<uint8_t>(l.weight_elem < 0 ? MOECAP_WEIGHTS_NONE : weight_dtype_of(l.weight_elem));
  put_le(out + 12, static_cast<uint64_t>(l.layers), 4);
  put_le(out + 16, static_cast<uint64_t>(l.top_k), 4);
  put_le(out + 20, static_cast<uint64_t>(l.num_experts), 4);
  put_le(out + 24, static_cast<uint64_t>(l.tokens), 8);
  put_le(out + 32, static_cast<uint64_t>(s->start_position), 8);
  if (l.flags & MOECAP_RECORD_HAS_VALIDITY) {
    for (int64_t t = 0; t < l.tokens; ++t) {
      if (src.token_valid(t)) out[l.validity_at + static_cast<uint64_t>(t) / 8] |= static_cast<uint8_t>(1u << (t % 8));
    }
  }
  const uint64_t row = static_cast<uint64_t>(l.layers * l.top_k);
  const uint8_t* w = l.weight_elem >= 0 ? tensor_data(s->weights) : nullptr;
  const uint64_t w_bytes = w != nullptr ? static_cast<uint64_t>(elem_bytes(l.weight_elem)) : 0;
  const PackFn pack = kPack[static_cast<size_t>(l.id_bits - 1)];
  const uint32_t sentinel = static_cast<uint32_t>(l.sentinel());
  uint32_t codes[kChunk];
  for (uint64_t i0 = 0; i0 < l.codes; i0 += kChunk) {
    const uint64_t n = l.codes - i0 < kChunk ? l.codes - i0 : kChunk;
    for_token_runs(i0, i0 + n, row, [&](uint64_t t, uint64_t b, uint64_t e) {
      if (src.token_valid(static_cast<int64_t>(t))) {
        source_codes(tensor_data(s->ids), src.id_elem, b, e - b, sentinel, codes + (b - i0));
      } else {
        for (uint64_t j = b; j < e; ++j) codes[j - i0] = sentinel;
      }
    });
    pack(codes, i0, n, out + l.ids_at);
    // "No expert" keeps weight 0, as a read gives it.
    if (w != nullptr) {
      uint8_t* wo = out + l.weights_at + i0 * w_bytes;
      const uint8_t* wi = w + i0 * w_bytes;
      if (w_bytes == 4) {
        copy_weights<uint32_t>(codes, n, sentinel, wi, wo);
      } else {
        copy_weights<uint16_t>(codes, n, sentinel, wi, wo);
      }
    }
  }
}

// The fixed header: every field in range and consistent with the others,
// and the record exactly as long as the sections it announces.
Layout parse_header(const uint8_t* p, uint64_t bytes) {
  if (std::memcmp(p, kMagic, 4) != 0) fail(MOECAP_ERROR_INVALID_ARGUMENT, "data is not a routing record (magic is not \"MCRT\")");
  const uint64_t version = get_le(p + 4, 2);
  if (version != MOECAP_RECORD_VERSION) {
    fail(MOECAP_ERROR_ABI_MISMATCH, "record version is ", version, "; this library reads version ", MOECAP_RECORD_VERSION);
  }
  if (get_le(p + 6, 2) != MOECAP_RECORD_HEADER_BYTES) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "record header bytes is ", get_le(p + 6, 2), "; version 1 has ",
         MOECAP_RECORD_HEADER_BYTES);
  }
  Layout l;
  l.id_bits = p[8];
  l.flags = p[9];
  const int32_t weight_dtype = p[10];
  l.layers = static_cast<int64_t>(get_le(p + 12, 4));
  l.top_k = static_cast<int64_t>(get_le(p + 16, 4));
  l.num_experts = static_cast<int64_t>(get_le(p + 20, 4));
  const uint64_t tokens = get_le(p + 24, 8);
  if (l.flags & ~kKnownFlags) fail(MOECAP_ERROR_INVALID_ARGUMENT, "record flags ", l.flags, " has unknown bits");
  if (p[11] != 0) fail(MOECAP_ERROR_INVALID_ARGUMENT, "record header byte 11 is ", int(p[11]), "; must be 0");
  if (l.layers < 1 || l.top_k < 1 || l.layers > INT32_MAX || l.top_k > INT32_MAX) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "record layers ", l.layers, " and top_k ", l.top_k, " must be in [1, 2^31)");
  }
  if (l.num_experts < 1 || l.num_experts > INT32_MAX) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "record num_experts is ", l.num_experts, "; must be in [1, 2^31)");
  }
  if (tokens > static_cast<uint64_t>(INT64_MAX)) fail(MOECAP_ERROR_INVALID_ARGUMENT, "record num_tokens ", tokens, " exceeds 2^63");
  l.tokens = static_cast<int64_t>(tokens);
  l.start = static_cast<int64_t>(get_le(p + 32, 8));
  if (l.start < 0) fail(MOECAP_ERROR_INVALID_ARGUMENT, "record start_position is ", l.start, "; must be >= 0");
  check_last_position(l.start, l.tokens, "record start_position");
  const int32_t want_bits = l.packed() ? packed_bits(l.num_experts) : plain_bits(l.num_experts);
  if (l.id_bits != want_bits) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "record id_bits is ", l.id_bits, "; ", l.packed() ? "packed" : "plain",
         " ids of ", l.num_experts, " experts take ", want_bits);
  }
  const bool has_weights = l.flags & MOECAP_RECORD_HAS_WEIGHTS;
  if (has_weights != (weight_dtype != MOECAP_WEIGHTS_NONE) || weight_dtype < 0 || weight_dtype > MOECAP_WEIGHTS_F16) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "record weight dtype ", weight_dtype, " does not match its weights flag");
  }
  l.weight_elem = has_weights ? weight_elem_of(weight_dtype) : -1;
  l.place();
  if (l.total != bytes) fail(MOECAP_ERROR_INVALID_ARGUMENT, "bytes is ", bytes, "; the record's header says ", l.total);
  return l;
}

// The sections the header placed: every code an expert or the sentinel,
// invalid tokens all sentinel with zero weights, padding bits zero. One code
// at a time: the definition, run in full only to name what codes_ok refused.
void check_contents_reference(const uint8_t* p, const Layout& l) {
  const bool has_weights = l.weight_elem >= 0;
  const uint64_t row = static_cast<uint64_t>(l.layers * l.top_k);
  const bool validity = l.flags & MOECAP_RECORD_HAS_VALIDITY;
  for (int64_t t = l.tokens; validity && t < ((l.tokens + 7) / 8) * 8; ++t) {
    if (bit_set(p + l.validity_at, t)) fail(MOECAP_ERROR_INVALID_ARGUMENT, "record validity padding bits are not 0");
  }
  const uint64_t wbytes = has_weights ? static_cast<uint64_t>(elem_bytes(l.weight_elem)) : 0;
  for (uint64_t i = 0; i < l.codes; ++i) {
    const uint64_t t = i / row;
    const uint64_t code = get_code(p + l.ids_at, l, i);
    const bool valid = !validity || bit_set(p + l.validity_at, static_cast<int64_t>(t));
    if (code >= static_cast<uint64_t>(l.num_experts) && code != l.sentinel()) {
      fail(MOECAP_ERROR_INVALID_ARGUMENT, "record id ", i, " is ", code, "; expected [0, ", l.num_experts, ") or ", l.sentinel());
    }
    if (!valid && code != l.sentinel()) {
      fail(MOECAP_ERROR_INVALID_ARGUMENT, "record token ", t, " is invalid but holds expert ", code);
    }
    if (!valid && wbytes && get_le(p + l.weights_at + i * wbytes, wbytes) != 0) {
      fail(MOECAP_ERROR_INVALID_ARGUMENT, "record token ", t, " is invalid but its weight bytes are not all 0");
    }
  }
  const uint64_t used_bits = l.codes * l.width();
  if (l.packed() && used_bits % 8 != 0 && (p[l.ids_at + used_bits / 8] >> (used_bits % 8)) != 0) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "record id padding bits are not 0");
  }
}

// check_contents_reference's checks in its order, the per-code ones by codes_ok.
void check_contents(const uint8_t* p, const Layout& l, uint64_t bytes) {
  const bool validity = l.flags & MOECAP_RECORD_HAS_VALIDITY;
  for (int64_t t = l.tokens; validity && t < ((l.tokens + 7) / 8) * 8; ++t) {
    if (bit_set(p + l.validity_at, t)) fail(MOECAP_ERROR_INVALID_ARGUMENT, "record validity padding bits are not 0");
  }
  if (!codes_ok(p, l, bytes)) check_contents_reference(p, l);
  const uint64_t used_bits = l.codes * l.width();
  if (l.packed() && used_bits % 8 != 0 && (p[l.ids_at + used_bits / 8] >> (used_bits % 8)) != 0) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "record id padding bits are not 0");
  }
}

// Reads and checks a record completely, before anything is decoded from it;
// the Layout says where everything is.
Layout parse(const void* data, uint64_t bytes) {
  if (data == nullptr && bytes > 0) fail(MOECAP_ERROR_INVALID_ARGUMENT, "data is NULL");
  if (bytes < MOECAP_RECORD_HEADER_BYTES) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "bytes is ", bytes, "; a record is at least ", MOECAP_RECORD_HEADER_BYTES);
  }
  const uint8_t* p = static_cast<const uint8_t*>(data);
  const Layout l = parse_header(p, bytes);
  check_contents(p, l, bytes);
  return l;
}

void check_out(const DLTensor* t, const char* name, const Layout& l, std::initializer_list<int32_t> elems,
               int32_t* elem) {
  *elem = check_tensor(t, {name, elems, 3});
  require_host(t, name);
  check_dim(t, name, 0, l.tokens, "record num_tokens");
  check_dim(t, name, 1, l.layers, "record num_layers");
  check_dim(t, name, 2, l.top_k, "record top_k");
}

// A buffer written while another is read (or written) must not meet it: the
// decode would read bytes it already overwrote, and return them as routing.
void require_apart(const DLTensor* t, const char* name, const void* begin, uint64_t bytes, const char* what) {
  if (t != nullptr && overlaps(t, begin, static_cast<size_t>(bytes))) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, name, " shares memory with ", what, "; they must not overlap");
  }
}

}  // namespace
}  // namespace moecap

using moecap::fail;
using moecap::guarded;

extern "C" {

moecap_status moecap_record_size(const moecap_record_source* source, uint64_t* bytes) {
  return guarded("moecap_record_size", [&] {
    if (bytes == nullptr) fail(MOECAP_ERROR_INVALID_ARGUMENT, "bytes is NULL");
    *bytes = moecap::check_source(source).layout.total;
  });
}

moecap_status moecap_record_encode(const moecap_record_source* source, void* out, uint64_t capacity,
                                   uint64_t* written) {
  return guarded("moecap_record_encode", [&] {
    const moecap::Source src = moecap::check_source(source);
    if (out == nullptr) fail(MOECAP_ERROR_INVALID_ARGUMENT, "out is NULL");
    if (capacity < src.layout.total) {
      fail(MOECAP_ERROR_CAPACITY, "capacity is ", capacity, " bytes; the record needs ", src.layout.total);
    }
    moecap::require_apart(src.args.ids, "source->ids", out, src.layout.total, "out");
    moecap::require_apart(src.args.weights, "source->weights", out, src.layout.total, "out");
    moecap::require_apart(src.args.valid, "source->valid", out, src.layout.total, "out");
    if (written != nullptr && moecap::ranges_meet(written, sizeof *written, out, src.layout.total)) {
      fail(MOECAP_ERROR_INVALID_ARGUMENT, "written points into out; they must not overlap");
    }
    moecap::encode(src, static_cast<uint8_t*>(out));
    if (written != nullptr) *written = src.layout.total;
  });
}

moecap_status moecap_record_parse(const void* data, uint64_t bytes, moecap_record_info* out) {
  return guarded("moecap_record_parse", [&] {
    moecap::require_out_struct(out, MOECAP_RECORD_INFO_SIZE_1_1, "out");
    const moecap::Layout l = moecap::parse(data, bytes);
    moecap_record_info info{};
    info.struct_size = sizeof info;
    info.version = MOECAP_RECORD_VERSION;
    info.flags = l.flags;
    info.id_bits = l.id_bits;
    info.weight_dtype = l.weight_elem < 0 ? MOECAP_WEIGHTS_NONE : moecap::weight_dtype_of(l.weight_elem);
    info.num_layers = static_cast<int32_t>(l.layers);
    info.top_k = static_cast<int32_t>(l.top_k);
    info.num_experts = static_cast<int32_t>(l.num_experts);
    info.num_tokens = l.tokens;
    info.start_position = l.start;
    info.bytes = l.total;
    moecap::write_struct(out, info);
  });
}

moecap_status moecap_record_decode(const void* data, uint64_t bytes, DLTensor* ids_out, DLTensor* weights_out,
                                   DLTensor* valid_out) {
  return guarded("moecap_record_decode", [&] {
    using namespace moecap;
    const Layout l = parse(data, bytes);
    int32_t id_elem, weight_elem = -1;
    check_out(ids_out, "ids_out", l, {kI8, kI16, kI32, kI64}, &id_elem);
    const int64_t id_max = id_elem == kI8 ? INT8_MAX : id_elem == kI16 ? INT16_MAX : INT64_MAX;
    if (l.num_experts - 1 > id_max) {
      fail(MOECAP_ERROR_INVALID_ARGUMENT, "ids_out has dtype ", elem_name(id_elem), ", which cannot hold expert ",
           l.num_experts - 1);
    }
    if (weights_out != nullptr) {
      if (l.weight_elem < 0) fail(MOECAP_ERROR_INVALID_ARGUMENT, "weights_out is given but the record has no weights");
      check_out(weights_out, "weights_out", l, {kF32, kBF16, kF16}, &weight_elem);
    }
    if (valid_out != nullptr) {
      check_tensor(valid_out, {"valid_out", {kU8}, 1});
      require_host(valid_out, "valid_out");
      check_dim(valid_out, "valid_out", 0, l.tokens, "record num_tokens");
    }
    require_apart(ids_out, "ids_out", data, bytes, "data (the record)");
    require_apart(weights_out, "weights_out", data, bytes, "data (the record)");
    require_apart(valid_out, "valid_out", data, bytes, "data (the record)");
    require_disjoint(weights_out, "weights_out", ids_out, "ids_out");
    require_disjoint(valid_out, "valid_out", ids_out, "ids_out");
    require_disjoint(valid_out, "valid_out", weights_out, "weights_out");
    const uint8_t* p = static_cast<const uint8_t*>(data);
    decode_codes(p, bytes, l, tensor_data(ids_out), id_elem, weights_out != nullptr ? tensor_data(weights_out) : nullptr,
                 weight_elem);
    if (valid_out != nullptr) {
      const bool validity = l.flags & MOECAP_RECORD_HAS_VALIDITY;
      for (int64_t t = 0; t < l.tokens; ++t) {
        tensor_data(valid_out)[t] = !validity || bit_set(p + l.validity_at, t) ? 1 : 0;
      }
    }
  });
}

}  // extern "C"
