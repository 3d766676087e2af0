/* SPDX-License-Identifier: Apache-2.0 */
/* The smallest complete moecap host in C: load the library, check the ABI,
 * create a capturer, capture two layers, commit, read back. Every failure
 * prints moecap's own message. Usage: c_host [path/to/libmoecap.so] */
#include <dlfcn.h>
#include <stdio.h>

#include "moecap.h"

/* The build names the library it built; compiled on its own, the installed one (its SONAME). */
#ifndef MOECAP_DEFAULT_LIBRARY
#define MOECAP_DEFAULT_LIBRARY "libmoecap.so.1"
#endif

static int failed(const moecap_api* m, moecap_status s, const char* what) {
  if (s == MOECAP_OK) return 0;
  fprintf(stderr, "c_host: %s failed: %s: %s\n", what, m->status_name(s), m->last_error());
  return 1;
}

int main(int argc, char** argv) {
  const char* path = argc > 1 ? argv[1] : MOECAP_DEFAULT_LIBRARY;
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  moecap_status (*get_api)(moecap_api*);
  moecap_api m = {0};
  moecap_config config = {0};
  moecap_capturer* cap = NULL;
  int32_t ids[3][2] = {{4, 1}, {7, 2}, {0, 5}}; /* the router's top-2 of 3 tokens */
  int64_t ids_shape[2] = {3, 2};
  DLTensor ids_t = {ids, {kDLCPU, 0}, 2, {kDLInt, 32, 1}, ids_shape, NULL, 0};
  int64_t slots[3] = {10, -1, 11}; /* token 1 is graph padding: dropped */
  int64_t slots_shape[1] = {3};
  DLTensor slots_t = {slots, {kDLCPU, 0}, 1, {kDLInt, 64, 1}, slots_shape, NULL, 0};
  moecap_commit_args commit = {sizeof(moecap_commit_args), 0, NULL, &slots_t};
  int64_t want[2] = {10, 11};
  int64_t want_shape[1] = {2};
  DLTensor want_t = {want, {kDLCPU, 0}, 1, {kDLInt, 64, 1}, want_shape, NULL, 0};
  int32_t out[2][2][2];
  int64_t out_shape[3] = {2, 2, 2};
  DLTensor out_t = {out, {kDLCPU, 0}, 3, {kDLInt, 32, 1}, out_shape, NULL, 0};
  int layer, i;

  if (lib == NULL) {
    fprintf(stderr, "c_host: cannot load %s: %s\n", path, dlerror());
    return 1;
  }
  *(void**)&get_api = dlsym(lib, "moecap_get_api");
  m.struct_size = sizeof m;
  if (get_api == NULL || get_api(&m) != MOECAP_OK) {
    fprintf(stderr, "c_host: %s is not a moecap library\n", path);
    return 1;
  }
  if ((m.abi_version >> 16) != MOECAP_ABI_VERSION_MAJOR) {
    fprintf(stderr, "c_host: library ABI %u.x, this host speaks %d.x\n", m.abi_version >> 16, MOECAP_ABI_VERSION_MAJOR);
    return 1;
  }
  /* An older 1.x library fills a shorter table: config_init and invalidate came in 1.1. */
  if (m.struct_size < MOECAP_STRUCT_SIZE(moecap_api, invalidate)) {
    fprintf(stderr, "c_host: library ABI %u.%u has no moecap_config_init; this host needs 1.1\n",
            m.abi_version >> 16, m.abi_version & 0xffffu);
    return 1;
  }

  config.struct_size = sizeof config; /* first: config_init fills that many bytes */
  if (failed(&m, m.config_init(&config), "moecap_config_init")) return 1; /* every default */
  config.num_layers = 2;
  config.top_k = 2;
  config.num_experts = 8;
  config.max_running_requests = 4;
  config.chunked_prefill_size = 16;
  config.host_slots = 64;
  if (failed(&m, m.create(&config, &cap), "moecap_create")) return 1;

  for (layer = 0; layer < 2; ++layer) {
    if (failed(&m, m.capture(cap, layer, &ids_t, NULL, NULL), "moecap_capture")) return 1;
  }
  if (failed(&m, m.commit(cap, &commit, NULL), "moecap_commit")) return 1;
  if (failed(&m, m.read(cap, &want_t, &out_t, NULL, 0, NULL), "moecap_read")) return 1;
  for (i = 0; i < 2; ++i) {
    printf("slot %lld: layer 0 experts {%d, %d}, layer 1 experts {%d, %d}\n", (long long)want[i], out[i][0][0],
           out[i][0][1], out[i][1][0], out[i][1][1]);
  }
  /* The engine frees slot 10's KV: its routing is gone, and reads as -1, never as an expert. */
  if (failed(&m, m.invalidate(cap, &want_t, NULL), "moecap_invalidate")) return 1;
  if (failed(&m, m.read(cap, &want_t, &out_t, NULL, 0, NULL), "moecap_read")) return 1;
  printf("after moecap_invalidate: slot %lld layer 0 experts {%d, %d}\n", (long long)want[0], out[0][0][0],
         out[0][0][1]);
  /* A bad call: layer 2 of 2. moecap refuses it and says why. */
  failed(&m, m.capture(cap, 2, &ids_t, NULL, NULL), "moecap_capture (layer 2, on purpose)");
  return failed(&m, m.destroy(cap), "moecap_destroy");
}
