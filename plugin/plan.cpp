// SPDX-License-Identifier: Apache-2.0
#include "plugin/plan.h"

#include <algorithm>
#include <limits>

#include "base/status.h"
#include "graphs/element.h"
#include "graphs/kernel_ops.h"
#include "plugin/abi_structs.h"

namespace moecap {
namespace {

void require_at_least(int64_t value, int64_t min, const char* name) {
  if (value < min) fail(MOECAP_ERROR_INVALID_ARGUMENT, "config->", name, " is ", value, "; it must be >= ", min);
}

int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "config: ", what, " overflows int64 (", a, " * ", b, ")");
  }
  return out;
}

int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "config: ", what, " overflows int64 (", a, " + ", b, ")");
  }
  return out;
}

constexpr uint32_t kKnownFlags =
    MOECAP_FLAG_HISTOGRAM | MOECAP_FLAG_GUARDS | MOECAP_FLAG_NO_GUARDS | MOECAP_FLAG_SIDE_STREAM;
constexpr int32_t kMaxExtraColumns = 1 << 16;

}  // namespace

int64_t id_limit(int32_t elem) {
  switch (elem) {
    case kU8: return 256;
    case kI8: return 128;
    case kU16: return 65536;
    case kI16: return 32768;
    default: return int64_t{1} << 31;  // int32 and wider: more than any num_experts (an int32)
  }
}

moecap_config default_config() {
  moecap_config c{};
  c.struct_size = sizeof c;
  c.abi_version = MOECAP_ABI_VERSION;
  c.dp_size = 1;
  c.verify_tokens = 1;
  c.id_dtype = MOECAP_IDS_AUTO;
  c.device_id_dtype = MOECAP_IDS_AUTO;
  c.weight_dtype = MOECAP_WEIGHTS_NONE;
  c.device_type = MOECAP_DEVICE_HOST;
  c.next = nullptr;
  return c;
}

int64_t legacy_device_rows(const moecap_config& c) {
  return std::max(c.chunked_prefill_size * c.dp_size, c.max_running_requests);
}

namespace {

// An id dtype as the Elem it stores; -1 when unknown.
int32_t id_elem_of(int32_t dtype) {
  switch (dtype) {
    case MOECAP_IDS_U8: return kU8;
    case MOECAP_IDS_U16: return kU16;
    case MOECAP_IDS_I16: return kI16;
    case MOECAP_IDS_I32: return kI32;
    default: return -1;
  }
}

int32_t resolve_id_dtype(int32_t dtype, const char* name) {
  if (dtype != MOECAP_IDS_AUTO && id_elem_of(dtype) < 0) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "config->", name, " is ", dtype,
         "; expected MOECAP_IDS_AUTO, _U8, _U16, _I32 or _I16 (0..4)");
  }
  return dtype;
}

// Every field on its own, before anything is derived from it.
void validate_config(const moecap_config& c) {
  if ((c.abi_version >> 16) != MOECAP_ABI_VERSION_MAJOR) {
    fail(MOECAP_ERROR_ABI_MISMATCH, "config->abi_version is ", (c.abi_version >> 16), ".",
         (c.abi_version & 0xffffu), "; this library implements major version ", MOECAP_ABI_VERSION_MAJOR);
  }
  if (c.next != nullptr) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "config->next is not NULL; ABI ", MOECAP_ABI_VERSION_MAJOR, ".",
         MOECAP_ABI_VERSION_MINOR, " defines no extension");
  }
  if (c.reserved != 0) fail(MOECAP_ERROR_INVALID_ARGUMENT, "config->reserved is ", c.reserved, "; it must be 0");
  if ((c.flags & ~kKnownFlags) != 0) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "config->flags has unknown bits 0x", std::hex, (c.flags & ~kKnownFlags));
  }
  if ((c.flags & MOECAP_FLAG_GUARDS) && (c.flags & MOECAP_FLAG_NO_GUARDS)) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "config->flags sets both MOECAP_FLAG_GUARDS and MOECAP_FLAG_NO_GUARDS");
  }
  require_at_least(c.num_layers, 1, "num_layers");
  require_at_least(c.top_k, 1, "top_k");
  require_at_least(c.extra_columns, 0, "extra_columns");
  require_at_least(c.num_experts, 1, "num_experts");
  if (c.top_k > c.num_experts) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "config->top_k is ", c.top_k, "; it must be <= num_experts (", c.num_experts,
         ")");
  }
  // A router's row is top_k plus a few fused columns; the bound keeps
  // top_k + extra_columns (and every column index) far from int32 overflow.
  if (c.extra_columns > kMaxExtraColumns) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "config->extra_columns is ", c.extra_columns, "; it must be <= ",
         kMaxExtraColumns);
  }
  require_at_least(c.dp_size, 1, "dp_size");
  require_at_least(c.verify_tokens, 1, "verify_tokens");
  require_at_least(c.max_running_requests, 1, "max_running_requests");
  require_at_least(c.chunked_prefill_size, 0, "chunked_prefill_size");
  require_at_least(c.max_graph_batch, 0, "max_graph_batch");
  require_at_least(c.max_batch_tokens, 0, "max_batch_tokens");
  require_at_least(c.host_slots, 1, "host_slots");
  require_at_least(c.device_id, 0, "device_id");
  if (c.device_type != MOECAP_DEVICE_HOST && c.device_type != MOECAP_DEVICE_CUDA) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "config->device_type is ", c.device_type,
         "; expected MOECAP_DEVICE_HOST (1) or MOECAP_DEVICE_CUDA (2)");
  }
  if (c.device_type == MOECAP_DEVICE_HOST && c.device_id != 0) {  // its views say cpu:0: nothing else is meant
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "config->device_id is ", c.device_id, "; the host backend is device 0");
  }
}

// The host cache's id dtype. AUTO leaves room for the fused columns' ids
// too; an explicit dtype only has to hold what is stored, the routed ids
// [0, num_experts), since the extra columns are dropped at capture.
void choose_host_ids(Plan& p) {
  const moecap_config& c = p.config;
  const int64_t ids_needed = static_cast<int64_t>(c.num_experts) + c.extra_columns;
  int32_t id_dtype = resolve_id_dtype(c.id_dtype, "id_dtype");
  if (id_dtype == MOECAP_IDS_AUTO) {
    id_dtype = ids_needed <= 256 ? MOECAP_IDS_U8 : ids_needed <= 65536 ? MOECAP_IDS_U16 : MOECAP_IDS_I32;
  }
  p.id_elem = id_elem_of(id_dtype);
  p.id_bytes = elem_bytes(p.id_elem);
  if (c.num_experts > id_limit(p.id_elem)) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "config->id_dtype holds ", id_limit(p.id_elem),
         " expert ids; num_experts is ", c.num_experts);
  }
  p.no_expert = invalid_id_code(p.id_elem);
  p.no_expert_is_id = p.no_expert >= 0 && p.no_expert < c.num_experts;
  p.config.id_dtype = id_dtype;
}

// The device buffer's id dtype: signed by default, so every id a kernel
// writes, and "no expert", stays recognisable until commit narrows it. An
// explicit dtype needs a value beyond the ids for "no expert".
void choose_device_ids(Plan& p) {
  const moecap_config& c = p.config;
  int32_t device_dtype = resolve_id_dtype(c.device_id_dtype, "device_id_dtype");
  if (device_dtype == MOECAP_IDS_AUTO) device_dtype = c.num_experts <= 32768 ? MOECAP_IDS_I16 : MOECAP_IDS_I32;
  p.device_id_elem = id_elem_of(device_dtype);
  p.device_id_bytes = elem_bytes(p.device_id_elem);
  const int64_t device_code = invalid_id_code(p.device_id_elem);
  const int64_t device_ids = device_code < 0 ? id_limit(p.device_id_elem) : device_code;
  if (c.num_experts > device_ids) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "config->device_id_dtype holds ", device_ids,
         " expert ids besides its \"no expert\" value; num_experts is ", c.num_experts);
  }
  p.config.device_id_dtype = device_dtype;
}

void choose_weights(Plan& p) {
  const moecap_config& c = p.config;
  switch (c.weight_dtype) {
    case MOECAP_WEIGHTS_NONE: p.weight_elem = -1; p.weight_bytes = 0; break;
    case MOECAP_WEIGHTS_F32: p.weight_elem = kF32; p.weight_bytes = 4; break;
    case MOECAP_WEIGHTS_BF16: p.weight_elem = kBF16; p.weight_bytes = 2; break;
    case MOECAP_WEIGHTS_F16: p.weight_elem = kF16; p.weight_bytes = 2; break;
    default:
      fail(MOECAP_ERROR_INVALID_ARGUMENT, "config->weight_dtype is ", c.weight_dtype,
           "; expected MOECAP_WEIGHTS_NONE, _F32, _BF16 or _F16 (0..3)");
  }
}

// Rows (docs/DESIGN.md §2) and the bytes of every buffer, each product and
// sum checked: they become allocation sizes.
void size_buffers(Plan& p) {
  const moecap_config& c = p.config;
  p.rows_per_rank = std::max({c.chunked_prefill_size,
                              checked_mul(c.max_running_requests, c.verify_tokens,
                                          "max_running_requests * verify_tokens"),
                              checked_mul(c.max_graph_batch, c.verify_tokens, "max_graph_batch * verify_tokens"),
                              c.max_batch_tokens});
  p.device_rows = checked_mul(p.rows_per_rank, c.dp_size, "dp_size * rows_per_rank");
  p.row_elements = checked_mul(c.num_layers, c.top_k, "num_layers * top_k");
  const int64_t device_elements = checked_mul(p.device_rows, p.row_elements, "device_rows * num_layers * top_k");
  const int64_t host_elements = checked_mul(c.host_slots, p.row_elements, "host_slots * num_layers * top_k");
  p.device_ids_bytes = static_cast<uint64_t>(checked_mul(device_elements, p.device_id_bytes, "device id bytes"));
  p.device_weights_bytes = static_cast<uint64_t>(checked_mul(device_elements, p.weight_bytes, "device weight bytes"));
  p.host_ids_bytes = static_cast<uint64_t>(checked_mul(host_elements, p.id_bytes, "host id bytes"));
  p.host_weights_bytes = static_cast<uint64_t>(checked_mul(host_elements, p.weight_bytes, "host weight bytes"));
  p.host_states_bytes = static_cast<uint64_t>(c.host_slots);
  if (c.flags & MOECAP_FLAG_HISTOGRAM) {
    p.histogram_bytes = static_cast<uint64_t>(
        checked_mul(checked_mul(c.num_layers, c.num_experts, "num_layers * num_experts"), 8, "histogram bytes"));
  }
  // The sums must fit too.
  checked_add(checked_add(static_cast<int64_t>(p.device_ids_bytes), static_cast<int64_t>(p.device_weights_bytes),
                          "device bytes"),
              static_cast<int64_t>(p.histogram_bytes), "device bytes");
  checked_add(checked_add(static_cast<int64_t>(p.host_ids_bytes), static_cast<int64_t>(p.host_weights_bytes),
                          "host bytes"),
              static_cast<int64_t>(p.host_states_bytes), "host bytes");
}

}  // namespace

Plan make_plan(const moecap_config* config) {
  const moecap_config c = read_struct(config, MOECAP_CONFIG_SIZE_1_0, "config");
  validate_config(c);
  Plan p{};
  p.config = c;
  choose_host_ids(p);
  choose_device_ids(p);
  choose_weights(p);
  size_buffers(p);
  return p;
}

void describe_plan(const Plan& p, moecap_plan_info* out) {
  require_out_struct(out, MOECAP_PLAN_INFO_SIZE_1_0, "out");
  moecap_plan_info info{};
  info.struct_size = sizeof(moecap_plan_info);
  info.rows_per_rank = p.rows_per_rank;
  info.device_rows = p.device_rows;
  info.row_elements = p.row_elements;
  info.id_dtype = p.config.id_dtype;
  info.id_bytes = p.id_bytes;
  info.weight_bytes = p.weight_bytes;
  info.device_bytes = p.device_ids_bytes + p.device_weights_bytes + p.histogram_bytes;
  info.host_bytes = p.host_ids_bytes + p.host_weights_bytes + p.host_states_bytes;
  info.device_id_dtype = p.config.device_id_dtype;
  info.device_id_bytes = p.device_id_bytes;
  write_struct(out, info);
}

moecap_rows locate_rows(const Plan& p, const moecap_batch* batch) {
  const moecap_batch b = read_struct(batch, MOECAP_BATCH_SIZE_1_0, "batch");
  const int32_t dp = p.config.dp_size;
  if (b.mode != MOECAP_BATCH_EAGER && b.mode != MOECAP_BATCH_GRAPH) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "batch->mode is ", b.mode,
         "; expected MOECAP_BATCH_EAGER (0) or MOECAP_BATCH_GRAPH (1)");
  }
  if (b.dp_rank < 0 || b.dp_rank >= dp) {
    fail(MOECAP_ERROR_OUT_OF_RANGE, "batch->dp_rank is ", b.dp_rank, "; it must be in [0, dp_size = ", dp, ")");
  }
  if (b.num_ranks != dp) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "batch->num_ranks is ", b.num_ranks, "; it must equal dp_size (", dp, ")");
  }
  if (b.reserved != 0) fail(MOECAP_ERROR_INVALID_ARGUMENT, "batch->reserved is ", b.reserved, "; it must be 0");
  if (b.tokens_per_rank == nullptr) fail(MOECAP_ERROR_INVALID_ARGUMENT, "batch->tokens_per_rank is NULL");
  // Every term below is bounded by device_rows before it is added, so no sum overflows.
  const int64_t limit = p.device_rows;
  for (int32_t r = 0; r < dp; ++r) {
    const int64_t t = b.tokens_per_rank[r];
    if (t < 0) fail(MOECAP_ERROR_INVALID_ARGUMENT, "batch->tokens_per_rank[", r, "] is ", t, "; it must be >= 0");
    if (t > limit) {
      fail(MOECAP_ERROR_CAPACITY, "batch->tokens_per_rank[", r, "] is ", t, "; device_rows is ", limit);
    }
  }
  moecap_rows rows{};
  rows.struct_size = sizeof(moecap_rows);
  rows.count = b.tokens_per_rank[b.dp_rank];
  if (b.mode == MOECAP_BATCH_EAGER) {
    if (b.padded_tokens_per_rank != 0) {
      fail(MOECAP_ERROR_INVALID_ARGUMENT, "batch->padded_tokens_per_rank is ", b.padded_tokens_per_rank,
           "; it must be 0 for MOECAP_BATCH_EAGER");
    }
    for (int32_t r = 0; r < dp; ++r) {
      if (r == b.dp_rank) rows.start = rows.total;
      rows.total += b.tokens_per_rank[r];
      if (rows.total > limit) {
        fail(MOECAP_ERROR_CAPACITY, "batch: ranks 0..", r, " hold ", rows.total, " tokens; device_rows is ", limit,
             " (dp_size ", dp, " * rows_per_rank ", p.rows_per_rank, ")");
      }
    }
  } else {
    const int64_t padded = b.padded_tokens_per_rank;
    if (padded < 1) {
      fail(MOECAP_ERROR_INVALID_ARGUMENT, "batch->padded_tokens_per_rank is ", padded,
           "; it must be >= 1 for MOECAP_BATCH_GRAPH");
    }
    if (padded > p.rows_per_rank) {
      fail(MOECAP_ERROR_CAPACITY, "batch->padded_tokens_per_rank is ", padded, "; rows_per_rank is ",
           p.rows_per_rank, " (a graph of ", dp, " ranks needs ", dp, " * ", padded, " rows, device_rows is ", limit,
           ")");
    }
    for (int32_t r = 0; r < dp; ++r) {
      if (b.tokens_per_rank[r] > padded) {
        fail(MOECAP_ERROR_INVALID_ARGUMENT, "batch->tokens_per_rank[", r, "] is ", b.tokens_per_rank[r],
             "; it must be <= padded_tokens_per_rank (", padded, ")");
      }
    }
    rows.start = b.dp_rank * padded;
    rows.total = dp * padded;
  }
  if (rows.start + rows.count > limit) {
    fail(MOECAP_ERROR_INTERNAL, "locate_rows: start ", rows.start, " + count ", rows.count, " > device_rows ", limit);
  }
  return rows;
}

}  // namespace moecap
