/* SPDX-License-Identifier: Apache-2.0 */
// The layout plan: sizes every buffer from the engine's configuration, once,
// and places each batch's rows. A pure function of its inputs (docs/DESIGN.md §2).
#pragma once

#include <cstdint>

#include "moecap.h"

namespace moecap {

struct Plan {
  moecap_config config;     // as validated, current size; id dtypes resolved
  int64_t rows_per_rank;
  int64_t device_rows;
  int64_t row_elements;     // num_layers * top_k
  int32_t id_elem;          // Elem of the host cache's ids
  int32_t device_id_elem;   // Elem of the device buffer's ids
  int32_t weight_elem;      // Elem of stored weights, or -1 without weights
  int32_t id_bytes;         // host cache
  int32_t device_id_bytes;
  int32_t weight_bytes;     // 0 without weights
  int64_t no_expert;        // the host cache's stored "no expert" value
  bool no_expert_is_id;     // that value is also a real id (U8 with 256 experts)
  uint64_t device_ids_bytes;
  uint64_t device_weights_bytes;
  uint64_t histogram_bytes; // 0 without MOECAP_FLAG_HISTOGRAM
  uint64_t host_ids_bytes;
  uint64_t host_weights_bytes;
  uint64_t host_states_bytes; // one MOECAP_SLOT_* byte per slot

  bool has_weights() const { return weight_bytes > 0; }
  bool has_histogram() const { return histogram_bytes > 0; }
  int64_t id_row_bytes() const { return row_elements * id_bytes; }
  int64_t weight_row_bytes() const { return row_elements * weight_bytes; }
  // Elements of one layer's block of the device buffer: [device_rows, top_k].
  int64_t layer_elements() const { return device_rows * config.top_k; }
};

// Validates `config` (its struct_size as abi_structs.h says, then every
// field, with the field's name in the error) and computes the plan. Throws
// moecap::Error.
Plan make_plan(const moecap_config* config);

// Ids [0, n) an id Elem holds: 2^bits unsigned, 2^(bits-1) signed, 2^31 for
// int32 and wider. The one answer for the host cache's and the device
// buffer's dtypes (plan) and for a read's output dtype (capturer).
int64_t id_limit(int32_t elem);

// What moecap_config_init writes: every field's default.
moecap_config default_config();

// Public summary of a plan.
void describe_plan(const Plan& plan, moecap_plan_info* out);

// This rank's rows in the gathered batch. Throws CAPACITY when the gathered
// batch does not fit the device buffer.
moecap_rows locate_rows(const Plan& plan, const moecap_batch* batch);

// The sizing engines used before moecap, for comparisons and regression tests:
// max(chunked_prefill * dp_size, max_running_requests), int32 ids.
int64_t legacy_device_rows(const moecap_config& config);

}  // namespace moecap
