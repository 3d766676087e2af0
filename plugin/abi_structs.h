/* SPDX-License-Identifier: Apache-2.0 */
// How structs cross the ABI across minor versions (PJRT's struct_size
// rules): any struct_size from the struct's first size (its size in the ABI
// version that introduced it: 1.0 for most, 1.1 for the record's) up is accepted; a
// caller's struct is copied into a zeroed current one, so fields an older
// caller lacks take their defaults (zero); a newer caller's bigger struct is
// accepted only if every byte this library does not know is zero; a struct
// the library fills is written up to the smaller of both sizes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "moecap.h"
#include "base/status.h"

namespace moecap {

// How many bytes a newer caller's struct may extend past this library's:
// the trailing bytes read to check they are zero.
constexpr size_t kStructGrowthLimit = 4096;

// Refuses a NULL struct or a struct_size below the struct's first size.
inline void require_struct(const void* ptr, size_t struct_size, size_t first_size, const char* name) {
  if (ptr == nullptr) fail(MOECAP_ERROR_INVALID_ARGUMENT, name, " is NULL");
  if (struct_size < first_size) {
    fail(MOECAP_ERROR_ABI_MISMATCH, name, "->struct_size is ", struct_size, "; the smallest this library (ABI ",
         MOECAP_ABI_VERSION_MAJOR, ".", MOECAP_ABI_VERSION_MINOR, ") accepts is ", first_size,
         " (the struct's first size)");
  }
}

// A struct the caller filled, as this library's current struct.
template <class T>
T read_struct(const T* in, size_t first_size, const char* name) {
  require_struct(in, in != nullptr ? in->struct_size : 0, first_size, name);
  const size_t size = in->struct_size;
  // A caller's struct_size is a claim about its memory: past a bound no
  // newer header can reach, refuse it rather than read that far.
  constexpr size_t kLimit = sizeof(T) + kStructGrowthLimit;
  if (size > kLimit) {
    fail(MOECAP_ERROR_ABI_MISMATCH, name, "->struct_size is ", size, "; the largest this library (ABI ",
         MOECAP_ABI_VERSION_MAJOR, ".", MOECAP_ABI_VERSION_MINOR, ") reads is ", kLimit, " (its ", sizeof(T),
         "-byte struct + ", kStructGrowthLimit, ")");
  }
  const auto* bytes = reinterpret_cast<const unsigned char*>(in);
  for (size_t i = sizeof(T); i < size; ++i) {
    if (bytes[i] != 0) {
      fail(MOECAP_ERROR_ABI_MISMATCH, name, "->struct_size is ", size, " and byte ", i,
           " is set, a field this library (ABI ", MOECAP_ABI_VERSION_MAJOR, ".", MOECAP_ABI_VERSION_MINOR, ", ",
           sizeof(T), " bytes) does not know; use a library as new as the header");
    }
  }
  T out{};
  std::memcpy(&out, in, std::min(size, sizeof(T)));
  out.struct_size = sizeof(T);
  return out;
}

// Checks a struct the library will fill; call before changing anything.
template <class T>
void require_out_struct(const T* out, size_t first_size, const char* name) {
  require_struct(out, out != nullptr ? out->struct_size : 0, first_size, name);
}

// Fills what the caller's struct holds of `value`; struct_size becomes the bytes written.
template <class T>
void write_struct(T* out, const T& value) {
  const size_t size = std::min(out->struct_size, sizeof(T));
  std::memcpy(out, &value, size);
  out->struct_size = size;
}

}  // namespace moecap
