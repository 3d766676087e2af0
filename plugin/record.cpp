// SPDX-License-Identifier: Apache-2.0
// The routing record (abi/moecap_record.h, docs/RECORD_FORMAT.md): encode and
// decode in host memory. python/moecap/record.py calls these through the
// binding.
#include <cstdint>
#include <cstring>
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
    const uint64_t id_bytes = (mul(codes, static_cast<uint64_t>(id_bits), "the id section") + 7) / 8;
    validity_at = MOECAP_RECORD_HEADER_BYTES;
    ids_at = validity_at + ((flags & MOECAP_RECORD_HAS_VALIDITY) ? (static_cast<uint64_t>(tokens) + 7) / 8 : 0);
    weights_at = ids_at + id_bytes;
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

void encode(const Source& src, uint8_t* out) {
  const moecap_record_source* s = &src.args;
  const Layout& l = src.layout;
  std::memset(out, 0, l.total);
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
  const uint8_t* ids = tensor_data(s->ids);
  const uint64_t row = static_cast<uint64_t>(l.layers * l.top_k);
  uint8_t* dst = out + l.ids_at;
  const uint8_t* w = l.weight_elem >= 0 ? tensor_data(s->weights) : nullptr;
  const uint64_t w_bytes = w != nullptr ? static_cast<uint64_t>(elem_bytes(l.weight_elem)) : 0;
  for (uint64_t i = 0; i < l.codes; ++i) {
    const int64_t v = src.token_valid(static_cast<int64_t>(i / row)) ? load_int(ids, src.id_elem, static_cast<int64_t>(i)) : -1;
    const uint64_t code = v < 0 ? l.sentinel() : static_cast<uint64_t>(v);
    if (!l.packed()) {
      put_le(dst + i * (l.width() / 8), code, l.width() / 8);
    } else {
      const uint64_t bit = i * l.width();
      const uint64_t shifted = code << (bit % 8);  // at most 32 + 7 bits
      for (uint64_t b = bit / 8; b <= (bit + l.width() - 1) / 8; ++b) {
        dst[b] |= static_cast<uint8_t>(shifted >> (8 * (b - bit / 8)));
      }
    }
    // "No expert" keeps the memset's weight 0, as a read gives it.
    if (w != nullptr && v >= 0) std::memcpy(out + l.weights_at + i * w_bytes, w + i * w_bytes, w_bytes);
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
// invalid tokens all sentinel with zero weights, padding bits zero.
void check_contents(const uint8_t* p, const Layout& l) {
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

// Reads and checks a record completely, before anything is decoded from it;
// the Layout says where everything is.
Layout parse(const void* data, uint64_t bytes) {
  if (data == nullptr && bytes > 0) fail(MOECAP_ERROR_INVALID_ARGUMENT, "data is NULL");
  if (bytes < MOECAP_RECORD_HEADER_BYTES) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "bytes is ", bytes, "; a record is at least ", MOECAP_RECORD_HEADER_BYTES);
  }
  const uint8_t* p = static_cast<const uint8_t*>(data);
  const Layout l = parse_header(p, bytes);
  check_contents(p, l);
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
    const uint64_t w_bytes = weight_elem >= 0 ? static_cast<uint64_t>(elem_bytes(l.weight_elem)) : 0;
    for (uint64_t i = 0; i < l.codes; ++i) {
      const uint64_t code = get_code(p + l.ids_at, l, i);
      const bool none = code == l.sentinel();
      store_int(tensor_data(ids_out), id_elem, static_cast<int64_t>(i), none ? -1 : static_cast<int64_t>(code));
      if (weight_elem < 0) continue;
      // "No expert" reads weight 0, as from moecap_read, whatever the bytes hold.
      const uint64_t bits = none ? 0 : get_le(p + l.weights_at + i * w_bytes, w_bytes);
      const float v = l.weight_elem == kF32 ? bits_float(static_cast<uint32_t>(bits))
                      : l.weight_elem == kBF16 ? bf16_to_float(static_cast<uint16_t>(bits))
                                               : f16_to_float(static_cast<uint16_t>(bits));
      store_float(tensor_data(weights_out), weight_elem, static_cast<int64_t>(i), v);
    }
    if (valid_out != nullptr) {
      const bool validity = l.flags & MOECAP_RECORD_HAS_VALIDITY;
      for (int64_t t = 0; t < l.tokens; ++t) {
        tensor_data(valid_out)[t] = !validity || bit_set(p + l.validity_at, t) ? 1 : 0;
      }
    }
  });
}

}  // extern "C"
