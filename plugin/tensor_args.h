/* SPDX-License-Identifier: Apache-2.0 */
// Checks of borrowed DLTensor arguments. Each check names the argument and
// what was expected, and runs before any operation touches memory.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>

#include "moecap.h"

namespace moecap {

// The Elem of a DLPack dtype, or -1 if moecap does not handle it; dtype_of
// is the inverse (Elem values only).
int32_t elem_of(DLDataType dtype);
DLDataType dtype_of(int32_t elem);
std::string dtype_name(DLDataType dtype);
const char* elem_name(int32_t elem);
std::string device_name(DLDevice device);
// DLDevice::device_type as the integer the caller stored, never loaded as
// the enum. Every read of a caller's device type goes through this: DLPack
// 1.0 defines types past the end of the enum the header we compile against
// may declare (Debian's DLPack 0.6 ends at kDLCUDAManaged = 13, so 16 and 17
// are outside its range), and loading such a value as DLDeviceType is
// undefined behaviour.
inline int32_t device_kind(const DLDevice& device) {
  int32_t raw = 0;
  static_assert(sizeof raw == sizeof device.device_type, "DLDeviceType is 32 bits");
  std::memcpy(&raw, &device.device_type, sizeof raw);
  return raw;
}
// Stores a device type as the integer it is: the writing twin of device_kind.
inline void set_device_kind(DLDevice& device, int32_t kind) {
  static_assert(sizeof kind == sizeof device.device_type, "DLDeviceType is 32 bits");
  std::memcpy(&device.device_type, &kind, sizeof kind);
}

struct TensorRules {
  const char* name;                     // "topk_ids", "dst_slots", ...
  std::initializer_list<int32_t> elems; // accepted Elem values
  int32_t ndim;
};

// Validates non-NULL, ndim, dtype, compact strides and (for non-empty
// tensors) a non-NULL data pointer. Returns the tensor's Elem.
int32_t check_tensor(const DLTensor* t, const TensorRules& rules);

// Requires shape[dim] == expected; `what` says where the number comes from.
void check_dim(const DLTensor* t, const char* name, int dim, int64_t expected, const char* what);

// Requires t's shape to equal ref's (weights beside their ids).
void check_same_shape(const DLTensor* t, const char* name, const DLTensor* ref, const char* ref_name);

// Pointer to element 0 (data + byte_offset).
inline uint8_t* tensor_data(const DLTensor* t) { return static_cast<uint8_t*>(t->data) + t->byte_offset; }

int64_t element_count(const DLTensor* t);

// Whether [a, a + a_bytes) meets [b, b + b_bytes); empty ranges meet nothing.
bool ranges_meet(const void* a, size_t a_bytes, const void* b, size_t b_bytes);

// Whether a compact tensor's bytes (check_tensor passed) meet [begin, begin + bytes).
bool overlaps(const DLTensor* t, const void* begin, size_t bytes);

// Refuses `t` where its bytes meet `other`'s (INVALID_ARGUMENT naming both):
// a call that writes one while it reads the other would act on values it
// never checked. NULL tensors meet nothing.
void require_disjoint(const DLTensor* t, const char* name, const DLTensor* other, const char* other_name);

}  // namespace moecap
