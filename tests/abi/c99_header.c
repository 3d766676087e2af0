/* abi/moecap.h must compile as strict C99 (-std=c99 -pedantic -Werror) and
   link against libmoecap.so. */
#include <stdio.h>

#include "moecap.h"

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
  return 0;
}
