/* SPDX-License-Identifier: Apache-2.0 */
// Element types moecap moves between tensors, and their conversions. Shared
// by the CUDA kernels and their host twins, so both round and narrow alike.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define MOECAP_HD __host__ __device__ __forceinline__
#else
#define MOECAP_HD inline
#endif

namespace moecap {

// Explicit values: they cross into kernels as plain int32 parameters.
enum Elem : int32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kI32 = 4,
  kI64 = 5,
  kF32 = 6,
  kBF16 = 7,
  kF16 = 8,
};

MOECAP_HD int elem_bytes(int32_t e) {
  return (e == kU8 || e == kI8) ? 1 : (e == kU16 || e == kI16 || e == kBF16 || e == kF16) ? 2 : (e == kI64) ? 8 : 4;
}

MOECAP_HD int64_t load_int(const void* base, int32_t e, int64_t i) {
  switch (e) {
    case kU8: return static_cast<const uint8_t*>(base)[i];
    case kI8: return static_cast<const int8_t*>(base)[i];
    case kU16: return static_cast<const uint16_t*>(base)[i];
    case kI16: return static_cast<const int16_t*>(base)[i];
    case kI32: return static_cast<const int32_t*>(base)[i];
    default: return static_cast<const int64_t*>(base)[i];
  }
}

// Stores `v` truncated to the element's width: callers range-check first.
MOECAP_HD void store_int(void* base, int32_t e, int64_t i, int64_t v) {
  switch (e) {
    case kU8: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(v); break;
    case kI8: static_cast<int8_t*>(base)[i] = static_cast<int8_t>(v); break;
    case kU16: static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(v); break;
    case kI16: static_cast<int16_t*>(base)[i] = static_cast<int16_t>(v); break;
    case kI32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); break;
    default: static_cast<int64_t*>(base)[i] = v; break;
  }
}

MOECAP_HD uint32_t float_bits(float f) {
  union { float f; uint32_t u; } x;
  x.f = f;
  return x.u;
}

MOECAP_HD float bits_float(uint32_t u) {
  union { float f; uint32_t u; } x;
  x.u = u;
  return x.f;
}

// Round to nearest even, NaN kept quiet: what PyTorch's bfloat16 does.
MOECAP_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

MOECAP_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// IEEE binary16 with round to nearest even, overflow to infinity, subnormals kept.
MOECAP_HD uint16_t float_to_f16(float f) {
  uint32_t u = float_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (mag >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (mag < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    if (mag < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t exp = mag >> 23;
    uint32_t mant = (mag & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - exp;  // 14 + (127 - 1 - exp) - 10 + 10
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t mid = 1u << (shift - 1u);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t r = mag - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

MOECAP_HD float f16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    float f = static_cast<float>(mant) * (1.0f / 16777216.0f);  // mant * 2^-24
    return sign ? -f : f;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

MOECAP_HD float load_float(const void* base, int32_t e, int64_t i) {
  switch (e) {
    case kBF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case kF16: return f16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

MOECAP_HD void store_float(void* base, int32_t e, int64_t i, float v) {
  switch (e) {
    case kBF16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); break;
    case kF16: static_cast<uint16_t*>(base)[i] = float_to_f16(v); break;
    default: static_cast<float*>(base)[i] = v; break;
  }
}

}  // namespace moecap
