/* SPDX-License-Identifier: Apache-2.0 */
/* abi/moecap.h and abi/moecap_record.h must compile as strict C99
   (-std=c99 -pedantic -Werror) and link against libmoecap.so. */
#include <stdio.h>

#include "moecap.h"
#include "moecap_record.h"

int main(void) {
  moecap_config config = {0};
  moecap_plan_info info = {0};
  config.struct_size = sizeof config;
  info.struct_size = sizeof info;
  if (moecap_config_init(&config) != MOECAP_OK) {
    fprintf(stderr, "config_init failed: %s\n", moecap_last_error());
    return 1;
  }
  config.num_layers = 2;
  config.top_k = 2;
  config.num_experts = 4;
  config.max_running_requests = 2;
  config.host_slots = 4;
  if (moecap_abi_version() != MOECAP_ABI_VERSION) {
    fprintf(stderr, "ABI version mismatch\n");
    return 1;
  }
  if (moecap_plan(&config, &info) != MOECAP_OK || info.device_rows != 2 || info.id_bytes != 1) {
    fprintf(stderr, "plan failed: %s\n", moecap_last_error());
    return 1;
  }
  {
    /* One token, one layer, top-2 of 4 experts, as a C engine would emit it. */
    int32_t ids[2] = {3, 1};
    int64_t shape[3] = {1, 1, 2};
    DLTensor t;
    moecap_record_source src = {0};
    moecap_record_info parsed = {0};
    unsigned char record[64];
    uint64_t written = 0;
    t.data = ids;
    t.device.device_type = kDLCPU;
    t.device.device_id = 0;
    t.ndim = 3;
    t.dtype.code = kDLInt;
    t.dtype.bits = 32;
    t.dtype.lanes = 1;
    t.shape = shape;
    t.strides = NULL;
    t.byte_offset = 0;
    src.struct_size = sizeof src;
    src.flags = MOECAP_RECORD_PACKED;
    src.num_experts = 4;
    src.ids = &t;
    parsed.struct_size = sizeof parsed;
    if (moecap_record_encode(&src, record, sizeof record, &written) != MOECAP_OK || written != 41 ||
        moecap_record_parse(record, written, &parsed) != MOECAP_OK || parsed.id_bits != 3) {
      fprintf(stderr, "record failed: %s\n", moecap_last_error());
      return 1;
    }
  }
  return 0;
}
