/* Variant: 2-bit packed ids (num_experts 2), tokens*layers*top_k*2 = 2^64-2; also through moecap_record_decode. */
#include <moecap_record.h>
#include <stdio.h>
#include <string.h>
#include <stdint.h>
static void put(uint8_t* p, uint64_t v, int n) { for (int i = 0; i < n; ++i) p[i] = (uint8_t)(v >> (8 * i)); }
int main(void) {
  uint8_t rec[40] = {0};
  memcpy(rec, "MCRT", 4); put(rec + 4, 1, 2); put(rec + 6, 40, 2);
  rec[8] = 2; rec[9] = MOECAP_RECORD_PACKED; rec[10] = 0;
  put(rec + 12, 7, 4); put(rec + 16, 1, 4); put(rec + 20, 2, 4);
  put(rec + 24, 1317624576693539401ULL, 8);  /* (2^63-1)/7 */
  int64_t out[1]; int64_t shape[3] = {1, 7, 1};
  DLTensor t; memset(&t, 0, sizeof t); t.data = out; t.ndim = 3; t.shape = shape; t.device.device_type = kDLCPU;
  t.dtype.code = kDLInt; t.dtype.bits = 64; t.dtype.lanes = 1;
  fprintf(stderr, "calling moecap_record_decode on a 40-byte buffer...\n");
  moecap_status s = moecap_record_decode(rec, sizeof rec, &t, NULL, NULL);
  printf("decode -> %s : %s\n", moecap_status_name(s), s ? moecap_last_error() : "");
  return 0;
}
