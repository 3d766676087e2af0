// SPDX-License-Identifier: Apache-2.0
#include "plugin/tensor_args.h"

#include <cstring>

#include "base/status.h"
#include "graphs/element.h"

namespace moecap {

namespace {

// Every Elem with its DLPack dtype and name, in Elem order: the one place the
// two enumerations meet.
struct ElemType {
  Elem elem;
  uint8_t code;  // DLDataTypeCode
  uint8_t bits;
  const char* name;
};
constexpr ElemType kElemTypes[] = {
    {kU8, kDLUInt, 8, "uint8"},       {kI8, kDLInt, 8, "int8"},        {kU16, kDLUInt, 16, "uint16"},
    {kI16, kDLInt, 16, "int16"},      {kI32, kDLInt, 32, "int32"},     {kI64, kDLInt, 64, "int64"},
    {kF32, kDLFloat, 32, "float32"},  {kBF16, kDLBfloat, 16, "bfloat16"}, {kF16, kDLFloat, 16, "float16"},
};
constexpr int32_t kElemCount = static_cast<int32_t>(sizeof kElemTypes / sizeof kElemTypes[0]);

constexpr bool in_elem_order() {
  for (int32_t i = 0; i < kElemCount; ++i)
    if (kElemTypes[i].elem != i) return false;
  return true;
}
static_assert(in_elem_order(), "kElemTypes is indexed by Elem");

}  // namespace

int32_t elem_of(DLDataType d) {
  if (d.lanes != 1) return -1;
  for (const ElemType& t : kElemTypes)
    if (t.code == d.code && t.bits == d.bits) return t.elem;
  return -1;
}

DLDataType dtype_of(int32_t elem) {
  if (elem < 0 || elem >= kElemCount) fail(MOECAP_ERROR_INTERNAL, "no DLPack dtype for Elem ", elem);
  return DLDataType{kElemTypes[elem].code, kElemTypes[elem].bits, 1};
}

const char* elem_name(int32_t e) { return (e >= 0 && e < kElemCount) ? kElemTypes[e].name : "unknown"; }

std::string dtype_name(DLDataType d) {
  const int32_t e = elem_of(d);
  if (e >= 0) return elem_name(e);
  // DLPack's codes spelled as NumPy and torch name them (a caller's tensor
  // may carry one moecap takes nowhere: uint32, bool, complex64, ...).
  // (kDLBool, 6, is newer than the dlpack.h some systems ship.)
  constexpr uint8_t kBool = 6;
  const char* kind = d.code == kDLInt ? "int" : d.code == kDLUInt ? "uint" : d.code == kDLFloat ? "float"
                     : d.code == kDLBfloat ? "bfloat" : d.code == kDLComplex ? "complex" : d.code == kBool ? "bool"
                     : nullptr;
  if (kind != nullptr && d.lanes == 1) return d.code == kBool ? std::string(kind) : cat(kind, int(d.bits));
  return cat("(code ", int(d.code), ", bits ", int(d.bits), ", lanes ", d.lanes, ")");
}

std::string device_name(DLDevice d) {
  switch (device_kind(d)) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return cat("cuda:", d.device_id);
    case kDLCUDAHost: return "cuda_host";
    case kDLCUDAManaged: return cat("cuda_managed:", d.device_id);
    default: return cat("device_type ", device_kind(d));
  }
}

int64_t element_count(const DLTensor* t) {
  for (int i = 0; i < t->ndim; ++i)
    if (t->shape[i] == 0) return 0;
  int64_t n = 1;
  for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];  // check_tensor bounded the product
  return n;
}

namespace {
uintptr_t tensor_bytes(const DLTensor* t) {
  return static_cast<uintptr_t>(element_count(t)) * ((t->dtype.bits * t->dtype.lanes + 7u) / 8u);
}
}  // namespace

bool ranges_meet(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const uintptr_t x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return a_bytes != 0 && b_bytes != 0 && x < y + b_bytes && y < x + a_bytes;
}

bool overlaps(const DLTensor* t, const void* begin, size_t bytes) {
  return ranges_meet(tensor_data(t), static_cast<size_t>(tensor_bytes(t)), begin, bytes);
}

void require_disjoint(const DLTensor* t, const char* name, const DLTensor* other, const char* other_name) {
  if (t == nullptr || other == nullptr) return;
  if (overlaps(t, tensor_data(other), static_cast<size_t>(tensor_bytes(other)))) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, name, " shares memory with ", other_name, "; they must not overlap");
  }
}

int32_t check_tensor(const DLTensor* t, const TensorRules& r) {
  if (t == nullptr) fail(MOECAP_ERROR_INVALID_ARGUMENT, r.name, " is NULL");
  if (t->ndim != r.ndim) fail(MOECAP_ERROR_INVALID_ARGUMENT, r.name, " has ndim ", t->ndim, "; expected ", r.ndim);
  if (t->shape == nullptr) fail(MOECAP_ERROR_INVALID_ARGUMENT, r.name, "->shape is NULL");
  // Read as an integer: a value outside DLDeviceType must not be loaded as one.
  // DLPack only adds types (kDLTrn, 18, came in 1.2), so every positive one
  // counts as a device, and one moecap cannot read fails as the wrong device.
  const int32_t kind = device_kind(t->device);
  if (kind < kDLCPU) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, r.name, "->device.device_type is ", kind, "; not a DLPack device type");
  }
  const int32_t e = elem_of(t->dtype);
  bool accepted = false;
  for (int32_t a : r.elems) accepted = accepted || a == e;
  if (!accepted) {
    std::string expected;
    for (int32_t a : r.elems) expected += expected.empty() ? elem_name(a) : cat(", ", elem_name(a));
    fail(MOECAP_ERROR_INVALID_ARGUMENT, r.name, " has dtype ", dtype_name(t->dtype), "; expected one of ", expected);
  }
  for (int i = 0; i < t->ndim; ++i) {
    if (t->shape[i] < 0) fail(MOECAP_ERROR_INVALID_ARGUMENT, r.name, "->shape[", i, "] is ", t->shape[i], "; must be >= 0");
  }
  // A tensor with no elements is compact whatever its strides (NumPy gives
  // an empty array strides (0,)), and its byte size is 0.
  bool empty = false;
  for (int i = 0; i < t->ndim; ++i) empty = empty || t->shape[i] == 0;
  // The byte size must be representable, or no later bound means anything.
  int64_t bytes = elem_bytes(e);
  for (int i = 0; i < t->ndim && !empty; ++i) {
    if (__builtin_mul_overflow(bytes, t->shape[i], &bytes)) {
      fail(MOECAP_ERROR_INVALID_ARGUMENT, r.name, " has a shape whose byte size overflows int64");
    }
  }
  if (t->strides != nullptr && !empty) {
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; --i) {
      // A stride of a dimension of extent 1 never matters: PyTorch reports any value there.
      if (t->shape[i] != 1 && t->strides[i] != expect) {
        fail(MOECAP_ERROR_INVALID_ARGUMENT, r.name, " is not compact row-major: strides[", i, "] is ",
             t->strides[i], ", expected ", expect);
      }
      expect *= t->shape[i];
    }
  }
  const int64_t n = element_count(t);
  if (n > 0 && t->data == nullptr) fail(MOECAP_ERROR_INVALID_ARGUMENT, r.name, "->data is NULL");
  // Every later bound compares addresses: the tensor's bytes must not wrap past the address space's end.
  uintptr_t first = 0, end = 0;
  if (n > 0 && (__builtin_add_overflow(reinterpret_cast<uintptr_t>(t->data), t->byte_offset, &first) ||
                __builtin_add_overflow(first, static_cast<uintptr_t>(bytes), &end))) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, r.name, "->byte_offset is ", t->byte_offset,
         "; data + byte_offset + its bytes wraps around the address space");
  }
  if (n > 0 && (reinterpret_cast<uintptr_t>(tensor_data(t)) % static_cast<uintptr_t>(elem_bytes(e))) != 0) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, r.name, " data + byte_offset is not aligned to its ", elem_bytes(e),
         "-byte elements");
  }
  return e;
}

void check_dim(const DLTensor* t, const char* name, int dim, int64_t expected, const char* what) {
  if (t->shape[dim] != expected) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, name, "->shape[", dim, "] is ", t->shape[dim], "; expected ", expected, " (",
         what, ")");
  }
}

void check_same_shape(const DLTensor* t, const char* name, const DLTensor* ref, const char* ref_name) {
  const std::string what = cat("shape of ", ref_name);
  for (int d = 0; d < ref->ndim; ++d) check_dim(t, name, d, ref->shape[d], what.c_str());
}

}  // namespace moecap
