// Checks of borrowed DLTensor arguments. Each check names the argument and
// what was expected, and runs before any operation touches memory.
#pragma once

#include <cstdint>
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
// the enum (a value outside it would be undefined behaviour).
int32_t device_kind(const DLDevice& device);
// The largest DLDeviceType value the checks accept as a device type.
constexpr int32_t kMaxDeviceType = 17;  // kDLMAIA in DLPack 1.0

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

}  // namespace moecap
