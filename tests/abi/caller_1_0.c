/* SPDX-License-Identifier: Apache-2.0 */
/* A caller compiled against the frozen ABI 1.0 header (tests/abi/v1_0/),
 * driving the current library: create, capture, local_rows, commit, read,
 * get_plan and get_errors, with 1.0-sized structs. A 1.x library must keep
 * every 1.0 caller working, so this test stays, permanently. Structs the
 * library fills sit before canary bytes: it must not write past a 1.0 size. */
#include <stdio.h>
#include <string.h>

#include "moecap.h" /* the frozen 1.0 header: -I tests/abi/v1_0 comes first */

#if MOECAP_ABI_VERSION_MINOR != 0
#error "caller_1_0.c must be compiled against the frozen 1.0 header"
#endif

#define CANARY 0x5a

/* The 1.0 sizes the library names MOECAP_*_SIZE_1_0 (test_abi_versions.cpp checks those). */
typedef char config_is_96_bytes[sizeof(moecap_config) == 96 ? 1 : -1];
typedef char plan_info_is_64_bytes[sizeof(moecap_plan_info) == 64 ? 1 : -1];
typedef char batch_is_40_bytes[sizeof(moecap_batch) == 40 ? 1 : -1];
typedef char rows_is_32_bytes[sizeof(moecap_rows) == 32 ? 1 : -1];
typedef char commit_args_is_32_bytes[sizeof(moecap_commit_args) == 32 ? 1 : -1];
typedef char error_counts_is_24_bytes[sizeof(moecap_error_counts) == 24 ? 1 : -1];
typedef char api_is_192_bytes[sizeof(moecap_api) == 192 ? 1 : -1];

static int fail_on(moecap_status s, const char* what) {
  if (s == MOECAP_OK) return 0;
  fprintf(stderr, "caller_1_0: %s: %s: %s\n", what, moecap_status_name(s), moecap_last_error());
  return 1;
}

static int canary_intact(const unsigned char* p, size_t n) {
  size_t i;
  for (i = 0; i < n; ++i)
    if (p[i] != CANARY) return 0;
  return 1;
}

int main(void) {
  struct {
    moecap_plan_info info;
    unsigned char canary[64];
  } plan;
  struct {
    moecap_error_counts counts;
    unsigned char canary[64];
  } errors;
  struct {
    moecap_rows rows;
    unsigned char canary[64];
  } rows;
  moecap_config c;
  moecap_capturer* cap = NULL;
  int32_t ids[2][2] = {{3, 1}, {2, 7}};
  int64_t ids_shape[2] = {2, 2};
  DLTensor ids_t = {ids, {kDLCPU, 0}, 2, {kDLInt, 32, 1}, ids_shape, NULL, 0};
  int64_t tokens[1] = {2};
  moecap_batch batch;
  int64_t slots[2] = {5, 6};
  int64_t slots_shape[1] = {2};
  DLTensor slots_t = {slots, {kDLCPU, 0}, 1, {kDLInt, 64, 1}, slots_shape, NULL, 0};
  moecap_commit_args commit;
  int64_t want[3] = {5, 6, 9}; /* slot 9 was never committed */
  int64_t want_shape[1] = {3};
  DLTensor want_t = {want, {kDLCPU, 0}, 1, {kDLInt, 64, 1}, want_shape, NULL, 0};
  int32_t out[3][2][2];
  int64_t out_shape[3] = {3, 2, 2};
  DLTensor out_t = {out, {kDLCPU, 0}, 3, {kDLInt, 32, 1}, out_shape, NULL, 0};
  int layer, i;

  /* Hand-filled, the 1.0 way: sizeof is the 1.0 size. */
  memset(&c, 0, sizeof c);
  c.struct_size = sizeof c;
  c.abi_version = MOECAP_ABI_VERSION;
  c.num_layers = 2;
  c.top_k = 2;
  c.num_experts = 8;
  c.dp_size = 1;
  c.verify_tokens = 1;
  c.max_running_requests = 4;
  c.chunked_prefill_size = 4;
  c.host_slots = 16;
  c.device_type = MOECAP_DEVICE_HOST;
  if (fail_on(moecap_create(&c, &cap), "moecap_create")) return 1;

  memset(&plan, CANARY, sizeof plan);
  plan.info.struct_size = sizeof plan.info;
  if (fail_on(moecap_get_plan(cap, &plan.info), "moecap_get_plan")) return 1;
  if (plan.info.struct_size != sizeof plan.info || !canary_intact(plan.canary, sizeof plan.canary) ||
      plan.info.device_rows != 4 || plan.info.id_bytes != 1) {
    fprintf(stderr, "caller_1_0: moecap_get_plan wrote past or wrong in a 1.0 struct\n");
    return 1;
  }

  memset(&batch, 0, sizeof batch);
  batch.struct_size = sizeof batch;
  batch.mode = MOECAP_BATCH_EAGER;
  batch.num_ranks = 1;
  batch.tokens_per_rank = tokens;
  memset(&rows, CANARY, sizeof rows);
  rows.rows.struct_size = sizeof rows.rows;
  if (fail_on(moecap_local_rows(cap, &batch, &rows.rows), "moecap_local_rows")) return 1;
  if (rows.rows.count != 2 || !canary_intact(rows.canary, sizeof rows.canary)) {
    fprintf(stderr, "caller_1_0: moecap_local_rows wrote past or wrong in a 1.0 struct\n");
    return 1;
  }

  for (layer = 0; layer < 2; ++layer) {
    if (fail_on(moecap_capture(cap, layer, &ids_t, NULL, NULL), "moecap_capture")) return 1;
  }
  commit.struct_size = sizeof commit;
  commit.src_start = rows.rows.start;
  commit.src_rows = NULL;
  commit.dst_slots = &slots_t;
  if (fail_on(moecap_commit(cap, &commit, NULL), "moecap_commit")) return 1;
  if (fail_on(moecap_read(cap, &want_t, &out_t, NULL, 0, NULL), "moecap_read")) return 1;
  for (layer = 0; layer < 2; ++layer) {
    for (i = 0; i < 2; ++i) {
      if (out[0][layer][i] != ids[0][i] || out[1][layer][i] != ids[1][i] || out[2][layer][i] != -1) {
        fprintf(stderr, "caller_1_0: read back %d %d %d at layer %d column %d\n", out[0][layer][i], out[1][layer][i],
                out[2][layer][i], layer, i);
        return 1;
      }
    }
  }

  memset(&errors, CANARY, sizeof errors);
  errors.counts.struct_size = sizeof errors.counts;
  if (fail_on(moecap_get_errors(cap, &errors.counts, 0), "moecap_get_errors")) return 1;
  if (errors.counts.skipped_rows != 0 || !canary_intact(errors.canary, sizeof errors.canary)) {
    fprintf(stderr, "caller_1_0: moecap_get_errors wrote past or wrong in a 1.0 struct\n");
    return 1;
  }
  if (fail_on(moecap_destroy(cap), "moecap_destroy")) return 1;
  printf("caller_1_0: a 1.0 caller created, captured, committed and read against ABI %u.%u\n",
         moecap_abi_version() >> 16, moecap_abi_version() & 0xffffu);
  return 0;
}
