/* SPDX-License-Identifier: Apache-2.0 */
/* An engine's view of an installed moecap: built only from what `cmake
   --install` put in the prefix (pkg-config or find_package), linked against
   libmoecap.so. Captures one layer, commits it to a slot, reads it back. */
#include <stdio.h>

#include "moecap.h"

static int check(moecap_status s, const char* what) {
  if (s == MOECAP_OK) return 0;
  fprintf(stderr, "consumer: %s: %s: %s\n", what, moecap_status_name(s), moecap_last_error());
  return 1;
}

int main(void) {
  moecap_config config = {0};
  moecap_capturer* cap = NULL;
  int32_t ids[2][2] = {{3, 1}, {0, 2}};
  int64_t ids_shape[2] = {2, 2};
  DLTensor ids_t = {ids, {kDLCPU, 0}, 2, {kDLInt, 32, 1}, ids_shape, NULL, 0};
  int64_t slots[2] = {5, 6};
  int64_t slots_shape[1] = {2};
  DLTensor slots_t = {slots, {kDLCPU, 0}, 1, {kDLInt, 64, 1}, slots_shape, NULL, 0};
  moecap_commit_args commit = {sizeof(moecap_commit_args), 0, NULL, &slots_t};
  int32_t out[2][1][2] = {{{-9, -9}}, {{-9, -9}}};
  int64_t out_shape[3] = {2, 1, 2};
  DLTensor out_t = {out, {kDLCPU, 0}, 3, {kDLInt, 32, 1}, out_shape, NULL, 0};

  if (moecap_abi_version() >> 16 != MOECAP_ABI_VERSION_MAJOR) {
    fprintf(stderr, "consumer: the installed library speaks ABI %u.x, its header %d.x\n",
            moecap_abi_version() >> 16, MOECAP_ABI_VERSION_MAJOR);
    return 1;
  }
  config.struct_size = sizeof config;
  if (check(moecap_config_init(&config), "moecap_config_init")) return 1;
  config.num_layers = 1;
  config.top_k = 2;
  config.num_experts = 4;
  config.max_running_requests = 2;
  config.host_slots = 8;
  if (check(moecap_create(&config, &cap), "moecap_create")) return 1;
  if (check(moecap_capture(cap, 0, &ids_t, NULL, NULL), "moecap_capture")) return 1;
  if (check(moecap_commit(cap, &commit, NULL), "moecap_commit")) return 1;
  if (check(moecap_read(cap, &slots_t, &out_t, NULL, 0, NULL), "moecap_read")) return 1;
  if (check(moecap_destroy(cap), "moecap_destroy")) return 1;
  if (out[0][0][0] != 3 || out[0][0][1] != 1 || out[1][0][0] != 0 || out[1][0][1] != 2) {
    fprintf(stderr, "consumer: read back {%d, %d}, {%d, %d}; captured {3, 1}, {0, 2}\n", out[0][0][0], out[0][0][1],
            out[1][0][0], out[1][0][1]);
    return 1;
  }
  printf("consumer: OK (ABI %u)\n", moecap_abi_version());
  return 0;
}
