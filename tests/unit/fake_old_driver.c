/* SPDX-License-Identifier: Apache-2.0 */
/* A stand-in libcuda for tests: initializes, then reports a driver version
   from FAKE_CUDA_VERSION (default 10.2) and resolves no entry point, so
   moecap must report MOECAP_ERROR_DRIVER_TOO_OLD. */
#include <stdint.h>
#include <stdlib.h>

int cuInit(unsigned flags) {
  (void)flags;
  return 0;
}

int cuDriverGetVersion(int* version) {
  const char* v = getenv("FAKE_CUDA_VERSION");
  *version = v ? atoi(v) : 10020;
  return 0;
}

int cuGetProcAddress(const char* symbol, void** pfn, int version, uint64_t flags) {
  (void)symbol;
  (void)version;
  (void)flags;
  *pfn = 0;
  return 500; /* CUDA_ERROR_NOT_FOUND */
}
