// SPDX-License-Identifier: Apache-2.0
// The float conversions the kernels and host twins share, against exact
// values and against the hardware's float<->half where the compiler has it.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "base/status.h"
#include "graphs/element.h"
#include "plugin/tensor_args.h"

using namespace moecap;

TEST_CASE("bfloat16 rounds to nearest even and round-trips every bf16 value") {
  CHECK(float_to_bf16(1.0f) == 0x3f80);
  CHECK(float_to_bf16(-2.0f) == 0xc000);
  CHECK(bf16_to_float(0x3f80) == 1.0f);
  // 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0).
  CHECK(float_to_bf16(1.0f + 1.0f / 256.0f) == 0x3f80);
  CHECK(float_to_bf16(1.0f + 3.0f / 256.0f) == 0x3f82);
  CHECK(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = bf16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    REQUIRE(float_to_bf16(f) == h);
  }
}

TEST_CASE("float16 matches IEEE binary16 on normals, subnormals, overflow and ties") {
  CHECK(float_to_f16(1.0f) == 0x3c00);
  CHECK(float_to_f16(65504.0f) == 0x7bff);
  CHECK(float_to_f16(65520.0f) == 0x7c00);  // rounds up to infinity
  CHECK(float_to_f16(-0.0f) == 0x8000);
  CHECK(float_to_f16(5.9604645e-8f) == 0x0001);  // smallest subnormal
  CHECK(float_to_f16(1.0f + 1.0f / 2048.0f) == 0x3c00);  // tie to even
  CHECK(float_to_f16(1.0f + 3.0f / 2048.0f) == 0x3c02);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    REQUIRE(float_to_f16(f) == h);
  }
#if defined(__FLT16_MAX__)
  for (float f = -70000.0f; f < 70000.0f; f += 0.37f) {
    const _Float16 hw = static_cast<_Float16>(f);
    uint16_t bits = 0;
    std::memcpy(&bits, &hw, 2);
    REQUIRE(float_to_f16(f) == bits);
  }
  for (float f = 1e-8f; f < 1e-3f; f *= 1.01f) {
    const _Float16 hw = static_cast<_Float16>(f);
    uint16_t bits = 0;
    std::memcpy(&bits, &hw, 2);
    REQUIRE(float_to_f16(f) == bits);
  }
#endif
}

TEST_CASE("integer loads and truncating stores per element type") {
  int64_t buf[2] = {0, 0};
  store_int(buf, kU8, 3, 0x1ff);
  CHECK(load_int(buf, kU8, 3) == 0xff);
  store_int(buf, kI16, 2, -5);
  CHECK(load_int(buf, kI16, 2) == -5);
  CHECK(load_int(buf, kU16, 2) == 0xfffb);
  CHECK(elem_bytes(kBF16) == 2);
  CHECK(elem_bytes(kI64) == 8);
}

TEST_CASE("every Elem maps to one DLPack dtype of its width and back") {
  for (int32_t e = kU8; e <= kF16; ++e) {
    CAPTURE(e);
    const DLDataType d = dtype_of(e);
    CHECK(d.lanes == 1);
    CHECK(d.bits == 8 * elem_bytes(e));
    CHECK(elem_of(d) == e);
    CHECK(std::strcmp(elem_name(e), "unknown") != 0);
  }
  CHECK(dtype_of(kBF16).code == kDLBfloat);
  CHECK(dtype_of(kU16).code == kDLUInt);
  CHECK(elem_of(DLDataType{kDLInt, 32, 2}) == -1);  // vector lanes are refused
  CHECK(elem_of(DLDataType{kDLUInt, 32, 1}) == -1);
  CHECK_THROWS_AS(dtype_of(kF16 + 1), Error);
}
