/* SPDX-License-Identifier: Apache-2.0 */
/*
 * moecap_record.h - the routing record: one request's routed experts as
 * self-describing bytes, the same from C, C++ and Python (moecap.record).
 *
 * A record holds ids [tokens, layers, top_k] (-1 = "no expert"), optional
 * weights of the same shape, one validity bit per token, the expert count
 * and the position of the first token. docs/RECORD_FORMAT.md specifies the
 * bytes; in brief (all integers little-endian):
 *
 *   offset  size  field
 *    0       4    magic "MCRT"
 *    4       2    version (MOECAP_RECORD_VERSION)
 *    6       2    header bytes (MOECAP_RECORD_HEADER_BYTES)
 *    8       1    id_bits: width of one id code
 *    9       1    flags: MOECAP_RECORD_PACKED | _HAS_WEIGHTS | _HAS_VALIDITY
 *   10       1    weight dtype (moecap_weight_dtype; NONE without weights)
 *   11       1    0
 *   12       4    num_layers
 *   16       4    top_k
 *   20       4    num_experts
 *   24       8    num_tokens
 *   32       8    start_position (signed, >= 0)
 *   40            validity bitmap (HAS_VALIDITY only): ceil(tokens / 8) bytes,
 *                 bit t % 8 of byte t / 8 set when token t is valid
 *                 ids: tokens * layers * top_k codes, row-major; code = id, or
 *                 2^id_bits - 1 for "no expert". PACKED: a bit stream, code i
 *                 in bits [i * id_bits, (i + 1) * id_bits), LSB first, zero
 *                 padded to a byte; else id_bits is 8, 16 or 32 and codes
 *                 are plain little-endian integers
 *                 weights (HAS_WEIGHTS only): same count, in the weight dtype
 *
 * id_bits is the narrowest width whose all-ones code is no valid id:
 * ceil(log2(num_experts + 1)) when packed (9 bits for 256 experts), else the
 * smallest of 8, 16, 32 that holds it (16 for 256 experts).
 *
 * These functions need no capturer, touch only host memory, and follow the
 * conventions of moecap.h: on any status but MOECAP_OK nothing was written
 * and moecap_last_error() names the argument and the limit. Any thread.
 */
#ifndef MOECAP_RECORD_H_
#define MOECAP_RECORD_H_

#include "moecap.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOECAP_RECORD_VERSION 1
#define MOECAP_RECORD_HEADER_BYTES 40

/* Flags: moecap_record_source.flags takes PACKED; the header's flags byte
 * (moecap_record_info.flags) holds all three. */
#define MOECAP_RECORD_PACKED 0x1u       /* ids bit-packed at ceil(log2(num_experts + 1)) bits */
#define MOECAP_RECORD_HAS_WEIGHTS 0x2u  /* a weights section follows the ids */
#define MOECAP_RECORD_HAS_VALIDITY 0x4u /* a validity bitmap precedes the ids (some token invalid) */

/* What to encode. Owner: the caller; read only during the call. */
typedef struct moecap_record_source {
  size_t struct_size;      /* sizeof(moecap_record_source) */
  uint32_t flags;          /* 0 or MOECAP_RECORD_PACKED */
  int32_t num_experts;     /* ids are [0, num_experts); >= 1 */
  int64_t start_position;  /* position in its sequence of the first token (prompt offset); >= 0,
                              and the last token's, start_position + tokens - 1, fits in int64 */
  const DLTensor* ids;     /* [tokens, layers, top_k] int8/int16/int32/int64, host memory,
                              compact; every value in [0, num_experts) or -1 ("no expert");
                              layers and top_k >= 1 */
  const DLTensor* weights; /* NULL, or the same shape, float32/bfloat16/float16, stored in
                              its own dtype; where an id is -1 its weight is stored as 0 */
  const DLTensor* valid;   /* NULL (every token valid), or [tokens] uint8/int8: nonzero =
                              valid. An invalid token (an empty slot) is stored as ids
                              "no expert" and weights 0, whatever the inputs hold there */
} moecap_record_source;

/* The first size of moecap_record_source (ABI 1.1): the smallest struct_size accepted. */
#define MOECAP_RECORD_SOURCE_SIZE_1_1 MOECAP_STRUCT_SIZE(moecap_record_source, valid)

/* A record's header, as moecap_record_parse found it. Filled by the library;
 * the caller sets struct_size. */
typedef struct moecap_record_info {
  size_t struct_size;     /* sizeof(moecap_record_info), set by the caller; the library
                             writes min(it, its own size) bytes and sets it to that */
  uint32_t version;       /* MOECAP_RECORD_VERSION */
  uint32_t flags;         /* MOECAP_RECORD_* of the header */
  int32_t id_bits;        /* bits per id code */
  int32_t weight_dtype;   /* moecap_weight_dtype; NONE without weights */
  int32_t num_layers;
  int32_t top_k;
  int32_t num_experts;
  int32_t reserved;       /* 0 */
  int64_t num_tokens;
  int64_t start_position;
  uint64_t bytes;         /* the record's total size, header included */
} moecap_record_info;

/* The first size of moecap_record_info (ABI 1.1). */
#define MOECAP_RECORD_INFO_SIZE_1_1 MOECAP_STRUCT_SIZE(moecap_record_info, bytes)

/* Statuses of the four functions below: INVALID_ARGUMENT for a malformed
 * source or record (a wrong magic, header size, flag, width, count or
 * position, a code that is neither an id nor the sentinel, an invalid token
 * holding an expert or weight bytes other than 0) or a bad output tensor;
 * OUT_OF_RANGE for a source id outside [0, num_experts) other than -1 in a
 * valid token; ABI_MISMATCH for a record version or a struct_size this
 * library does not read; CAPACITY from encode, below. Nothing is written
 * unless the status is MOECAP_OK; moecap_last_error says which field. */

/* Bytes moecap_record_encode will write for `source` (checks it fully). */
MOECAP_API moecap_status moecap_record_size(const moecap_record_source* source, uint64_t* bytes);

/* Encodes `source` into out[0, capacity). *written (non-NULL) receives the
 * size. CAPACITY (nothing written) when capacity is smaller than the record;
 * INVALID_ARGUMENT when the record's bytes would overlap a source tensor
 * or *written. */
MOECAP_API moecap_status moecap_record_encode(const moecap_record_source* source, void* out,
                                              uint64_t capacity, uint64_t* written);

/* Checks that data[0, bytes) is exactly one well-formed record of a version
 * this library reads (header, sizes, every code a valid id or the
 * sentinel, invalid tokens all sentinel with weight bytes 0) and
 * describes it. */
MOECAP_API moecap_status moecap_record_parse(const void* data, uint64_t bytes, moecap_record_info* out);

/* Decodes a record into caller tensors (host memory, compact):
 *   ids_out     [tokens, layers, top_k] int8/int16/int32/int64 that holds
 *               num_experts - 1; "no expert" reads as -1;
 *   weights_out NULL, or the same shape, float32/bfloat16/float16 (converted
 *               from the stored dtype; 0 wherever the id reads -1); refused
 *               if the record has none;
 *   valid_out   NULL, or [tokens] uint8: 1 valid, 0 not.
 * Checks everything moecap_record_parse checks before writing, and that the
 * outputs overlap neither each other nor data (INVALID_ARGUMENT). */
MOECAP_API moecap_status moecap_record_decode(const void* data, uint64_t bytes, DLTensor* ids_out,
                                              DLTensor* weights_out, DLTensor* valid_out);

#ifdef __cplusplus
}
#endif

#endif /* MOECAP_RECORD_H_ */
