// The commit kernel's row copy, run on the host lane by lane: for every
// alignment of source and destination and every row size, the 32 lanes
// together write exactly the row, each byte once, and nothing around it.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "graphs/kernel_ops.h"

using namespace moecap;

TEST_CASE("copy_row: every alignment and size, 32 lanes write the row exactly") {
  alignas(16) uint8_t src[256];
  alignas(16) uint8_t dst[256];
  for (int i = 0; i < 256; ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  int wrong = 0;
  for (int src_at = 0; src_at < 16; ++src_at) {
    for (int dst_at = 0; dst_at < 16; ++dst_at) {
      for (int64_t bytes = 0; bytes <= 100; ++bytes) {
        for (uint8_t& b : dst) b = 0xEE;
        for (int lane = 0; lane < 32; ++lane) copy_row(dst + dst_at, src + src_at, bytes, lane, 32);
        bool exact = true;
        for (int i = 0; i < 256; ++i) {
          const bool inside = i >= dst_at && i < dst_at + bytes;
          exact &= dst[i] == (inside ? src[src_at + i - dst_at] : 0xEE);
        }
        if (!exact && wrong++ == 0) MESSAGE("first wrong copy: src+", src_at, " dst+", dst_at, " bytes ", bytes);
      }
    }
  }
  CHECK(wrong == 0);
}
