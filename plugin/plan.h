// The layout plan: sizes every buffer from the engine's configuration, once,
// and places each batch's rows. A pure function of its inputs (docs/DESIGN.md §2).
#pragma once

#include <cstdint>

#include "moecap.h"

namespace moecap {

struct Plan {
  moecap_config config;     // as validated; id_dtype resolved
  int64_t rows_per_rank;
  int64_t device_rows;
  int64_t row_elements;     // num_layers * top_k
  int32_t id_elem;          // Elem of stored ids
  int32_t weight_elem;      // Elem of stored weights, or -1 without weights
  int32_t id_bytes;
  int32_t weight_bytes;     // 0 without weights
  uint64_t device_ids_bytes;
  uint64_t device_weights_bytes;
  uint64_t histogram_bytes; // 0 without MOECAP_FLAG_HISTOGRAM
  uint64_t host_ids_bytes;
  uint64_t host_weights_bytes;

  bool has_weights() const { return weight_bytes > 0; }
  bool has_histogram() const { return histogram_bytes > 0; }
  int64_t id_row_bytes() const { return row_elements * id_bytes; }
  int64_t weight_row_bytes() const { return row_elements * weight_bytes; }
};

// Validates `config` (every field, with the field's name in the error) and
// computes the plan. Throws moecap::Error.
Plan make_plan(const moecap_config* config);

// Public summary of a plan.
void describe_plan(const Plan& plan, moecap_plan_info* out);

// This rank's rows in the gathered batch. Throws CAPACITY when the gathered
// batch does not fit the device buffer.
moecap_rows locate_rows(const Plan& plan, const moecap_batch* batch);

// The sizing engines used before moecap, for comparisons and regression tests:
// max(chunked_prefill * dp_size, max_running_requests), int32 ids.
int64_t legacy_device_rows(const moecap_config& config);

}  // namespace moecap
