/* SPDX-License-Identifier: Apache-2.0 */
/*
 * moecap_dlpack.h - the DLPack part of moecap's C ABI.
 *
 * moecap borrows `DLTensor` for every tensor it is given and hands out
 * `DLManagedTensorVersioned` (DLPack 1.x) or the legacy `DLManagedTensor`.
 * Debian ships dlpack 0.6, which has only the legacy types; where the
 * included <dlpack/dlpack.h> predates 1.0 this header declares the 1.x
 * versioned types itself, with the exact layout of the DLPack 1.0 spec
 * (checked below at compile time, also when compiled as C99).
 */
#ifndef MOECAP_DLPACK_H_
#define MOECAP_DLPACK_H_

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifndef DLPACK_MAJOR_VERSION
/* dlpack.h older than 1.0: declare the versioned ABI ourselves. */

#define DLPACK_MAJOR_VERSION 1
#define DLPACK_MINOR_VERSION 0

/* Bit 0 of DLManagedTensorVersioned.flags: the consumer must not write. */
#define DLPACK_FLAG_BITMASK_READ_ONLY (1ULL << 0)
/* Bit 1: the producer copied the data; writes are not seen by it. */
#define DLPACK_FLAG_BITMASK_IS_COPIED (1ULL << 1)

/* The DLPack ABI version a managed tensor was produced against. */
typedef struct {
  uint32_t major; /* incompatible layout changes */
  uint32_t minor; /* compatible additions */
} DLPackVersion;

/* DLPack 1.x managed tensor: 80 bytes on LP64, layout fixed by the spec. */
typedef struct DLManagedTensorVersioned {
  DLPackVersion version; /* offset 0: the producer's DLPack version */
  void* manager_ctx;     /* offset 8: producer-private, for the deleter */
  /* offset 16: called once by the consumer when done; may be NULL. */
  void (*deleter)(struct DLManagedTensorVersioned* self);
  uint64_t flags;        /* offset 24: DLPACK_FLAG_BITMASK_* */
  DLTensor dl_tensor;    /* offset 32 */
} DLManagedTensorVersioned;

#endif /* DLPACK_MAJOR_VERSION */

/* Layout checks, valid in C99 and C++: a negative array size fails to compile. */
#define MOECAP_DLPACK_CHECK_(name, cond) typedef char moecap_dlpack_check_##name[(cond) ? 1 : -1]
#if UINTPTR_MAX == 0xffffffffffffffffULL
MOECAP_DLPACK_CHECK_(dltensor_size, sizeof(DLTensor) == 48);
MOECAP_DLPACK_CHECK_(versioned_size, sizeof(DLManagedTensorVersioned) == 80);
MOECAP_DLPACK_CHECK_(versioned_ctx, offsetof(DLManagedTensorVersioned, manager_ctx) == 8);
MOECAP_DLPACK_CHECK_(versioned_deleter, offsetof(DLManagedTensorVersioned, deleter) == 16);
MOECAP_DLPACK_CHECK_(versioned_flags, offsetof(DLManagedTensorVersioned, flags) == 24);
MOECAP_DLPACK_CHECK_(versioned_tensor, offsetof(DLManagedTensorVersioned, dl_tensor) == 32);
MOECAP_DLPACK_CHECK_(legacy_size, sizeof(DLManagedTensor) == 64);
#endif
#undef MOECAP_DLPACK_CHECK_

#ifdef __cplusplus
}
#endif

#endif /* MOECAP_DLPACK_H_ */
