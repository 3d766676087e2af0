// SPDX-License-Identifier: Apache-2.0
// The routing record (abi/moecap_record.h): exact bytes of a small record,
// round trips packed and plain at every width boundary, validity, weights,
// and every malformed input refused without writing.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "graphs/element.h"
#include "moecap_record.h"
#include "tests/support/tensors.h"

using moecap_test::HostTensor;

namespace {

DLDataType i8() { return DLDataType{kDLInt, 8, 1}; }
DLDataType i16() { return DLDataType{kDLInt, 16, 1}; }

moecap_record_source source_of(HostTensor& ids, int32_t experts, uint32_t flags = 0, DLTensor* weights = nullptr,
                               DLTensor* valid = nullptr, int64_t start = 0) {
  moecap_record_source s{};
  s.struct_size = sizeof s;
  s.flags = flags;
  s.num_experts = experts;
  s.start_position = start;
  s.ids = ids.get();
  s.weights = weights;
  s.valid = valid;
  return s;
}

std::vector<uint8_t> encode(const moecap_record_source& s) {
  uint64_t bytes = 0;
  REQUIRE(moecap_record_size(&s, &bytes) == MOECAP_OK);
  std::vector<uint8_t> out(bytes, 0xAB);
  uint64_t written = 0;
  REQUIRE(moecap_record_encode(&s, out.data(), out.size(), &written) == MOECAP_OK);
  CHECK(written == bytes);
  return out;
}

moecap_record_info parse(const std::vector<uint8_t>& r, moecap_status expect = MOECAP_OK) {
  moecap_record_info info{};
  info.struct_size = sizeof info;
  CHECK(moecap_record_parse(r.data(), r.size(), &info) == expect);
  return info;
}

}  // namespace

TEST_CASE("a packed record of 2 tokens, 1 layer, top-2 of 5 experts has these exact bytes") {
  HostTensor ids({2, 1, 2}, moecap_test::i32());
  ids.fill<int32_t>({4, 0, -1, 3});  // codes 3 bits wide; "no expert" = 7
  const auto r = encode(source_of(ids, 5, MOECAP_RECORD_PACKED, nullptr, nullptr, 17));
  const std::vector<uint8_t> header = {'M', 'C', 'R', 'T', 1, 0, 40, 0, 3, MOECAP_RECORD_PACKED, 0, 0,
                                       1, 0, 0, 0, 2, 0, 0, 0, 5, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0,
                                       17, 0, 0, 0, 0, 0, 0, 0};
  REQUIRE(r.size() == 40 + 2);  // 4 codes * 3 bits = 12 bits -> 2 bytes
  CHECK(std::vector<uint8_t>(r.begin(), r.begin() + 40) == header);
  // bits LSB first: 4 = 100, 0 = 000, 7 = 111, 3 = 011 -> 0b11'000'100, 0b0000'011'1
  CHECK(r[40] == 0xC4);
  CHECK(r[41] == 0x07);
  const auto info = parse(r);
  CHECK(info.id_bits == 3);
  CHECK(info.num_tokens == 2);
  CHECK(info.start_position == 17);
  CHECK(info.bytes == r.size());
}

TEST_CASE("ids round-trip packed and plain at every width boundary, with weights and validity") {
  std::mt19937 rng(7);
  for (int32_t experts : {1, 2, 7, 8, 127, 128, 255, 256, 257, 1000, 65535, 65536, 100000}) {
    for (uint32_t flags : {0u, uint32_t{MOECAP_RECORD_PACKED}}) {
      CAPTURE(experts);
      CAPTURE(flags);
      const int64_t tokens = 11, layers = 3, top_k = 5;
      HostTensor ids({tokens, layers, top_k}, moecap_test::i64());
      HostTensor weights({tokens, layers, top_k}, moecap_test::f32());
      HostTensor valid({tokens}, moecap_test::u8());
      for (int64_t i = 0; i < ids.numel(); ++i) {
        ids.set(i, (rng() % 17 == 0) ? -1 : static_cast<int64_t>(rng() % static_cast<uint32_t>(experts)));
        weights.as<float>()[i] = static_cast<float>(rng() % 1000) / 1000.0f;
      }
      for (int64_t t = 0; t < tokens; ++t) valid.as<uint8_t>()[t] = t % 4 != 2;
      const auto r = encode(source_of(ids, experts, flags, weights.get(), valid.get(), int64_t{1} << 40));
      const auto info = parse(r);
      CHECK(info.flags == (flags | MOECAP_RECORD_HAS_WEIGHTS | MOECAP_RECORD_HAS_VALIDITY));
      CHECK(info.start_position == int64_t{1} << 40);
      int32_t bits = 1;
      while ((int64_t{1} << bits) - 1 < experts) ++bits;
      CHECK(info.id_bits == (flags ? bits : experts <= 255 ? 8 : experts <= 65535 ? 16 : 32));

      HostTensor back({tokens, layers, top_k}, moecap_test::i32());
      HostTensor wback({tokens, layers, top_k}, moecap_test::f32());
      HostTensor vback({tokens}, moecap_test::u8());
      REQUIRE(moecap_record_decode(r.data(), r.size(), back.get(), wback.get(), vback.get()) == MOECAP_OK);
      for (int64_t i = 0; i < ids.numel(); ++i) {
        const bool ok = valid.as<uint8_t>()[i / (layers * top_k)];
        REQUIRE(back.at(i) == (ok ? ids.at(i) : -1));
        REQUIRE(wback.as<float>()[i] == (ok && ids.at(i) >= 0 ? weights.as<float>()[i] : 0.0f));
      }
      for (int64_t t = 0; t < tokens; ++t) CHECK(vback.as<uint8_t>()[t] == valid.as<uint8_t>()[t]);
    }
  }
}

TEST_CASE("packing saves what it should: 61 layers, top-8 of 256 experts") {
  HostTensor ids({100, 61, 8}, i16());
  moecap_record_source s = source_of(ids, 256);
  uint64_t plain = 0, packed = 0;
  REQUIRE(moecap_record_size(&s, &plain) == MOECAP_OK);
  s.flags = MOECAP_RECORD_PACKED;
  REQUIRE(moecap_record_size(&s, &packed) == MOECAP_OK);
  CHECK(plain == 40 + 100 * 488 * 2);      // u16: 255 is an expert, so the sentinel needs 9 bits
  CHECK(packed == 40 + 100 * 488 * 9 / 8);
}

TEST_CASE("weights keep their dtype and decode into any float dtype") {
  HostTensor ids({1, 1, 2}, moecap_test::i32());
  ids.fill<int32_t>({1, 2});
  HostTensor w({1, 1, 2}, moecap_test::bf16());
  w.fill<uint16_t>({0x3f80, 0x3e80});  // 1.0, 0.25
  const auto r = encode(source_of(ids, 4, 0, w.get()));
  CHECK(parse(r).weight_dtype == MOECAP_WEIGHTS_BF16);
  HostTensor back({1, 1, 2}, i8());
  HostTensor wf({1, 1, 2}, moecap_test::f32());
  REQUIRE(moecap_record_decode(r.data(), r.size(), back.get(), wf.get(), nullptr) == MOECAP_OK);
  CHECK(wf.as<float>()[0] == 1.0f);
  CHECK(wf.as<float>()[1] == 0.25f);
  // A record without weights refuses a weights output.
  const auto bare = encode(source_of(ids, 4));
  CHECK(moecap_record_decode(bare.data(), bare.size(), back.get(), wf.get(), nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::strstr(moecap_last_error(), "weights_out") != nullptr);
}

TEST_CASE("bad sources are refused, naming the argument, and nothing is written") {
  HostTensor ids({2, 1, 2}, moecap_test::i32());
  ids.fill<int32_t>({0, 1, 2, 5});
  std::vector<uint8_t> out(256, 0xAB);
  const std::vector<uint8_t> untouched = out;
  uint64_t written = 99;
  auto s = source_of(ids, 5);
  CHECK(moecap_record_encode(&s, out.data(), out.size(), &written) == MOECAP_ERROR_OUT_OF_RANGE);
  CHECK(std::strstr(moecap_last_error(), "source->ids[1, 0, 1] is 5") != nullptr);
  ids.set(3, -2);
  CHECK(moecap_record_encode(&s, out.data(), out.size(), &written) == MOECAP_ERROR_OUT_OF_RANGE);
  ids.set(3, 4);
  s.num_experts = 0;
  CHECK(moecap_record_encode(&s, out.data(), out.size(), &written) == MOECAP_ERROR_INVALID_ARGUMENT);
  s.num_experts = 5;
  s.flags = 8;
  CHECK(moecap_record_encode(&s, out.data(), out.size(), &written) == MOECAP_ERROR_INVALID_ARGUMENT);
  s.flags = 0;
  s.start_position = -1;
  CHECK(moecap_record_encode(&s, out.data(), out.size(), &written) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::strstr(moecap_last_error(), "source->start_position is -1; must be >= 0") != nullptr);
  s.start_position = INT64_MAX;  // two tokens: the second's position would be 2^63
  CHECK(moecap_record_encode(&s, out.data(), out.size(), &written) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::strstr(moecap_last_error(), "source->start_position is 9223372036854775807 with 2 tokens") != nullptr);
  uint64_t size = 0;
  CHECK(moecap_record_size(&s, &size) == MOECAP_ERROR_INVALID_ARGUMENT);
  s.start_position = INT64_MAX - 1;  // positions 2^63 - 2 and 2^63 - 1
  CHECK(moecap_record_size(&s, &size) == MOECAP_OK);
  s.start_position = 0;
  CHECK(moecap_record_encode(&s, out.data(), out.size(), reinterpret_cast<uint64_t*>(out.data() + 8)) ==
        MOECAP_ERROR_INVALID_ARGUMENT);  // the size would land in the record's header
  CHECK(std::strstr(moecap_last_error(), "written points into out") != nullptr);
  s.struct_size = sizeof s - 8;
  CHECK(moecap_record_encode(&s, out.data(), out.size(), &written) == MOECAP_ERROR_ABI_MISMATCH);
  s.struct_size = sizeof s;
  CHECK(moecap_record_encode(&s, out.data(), 40, &written) == MOECAP_ERROR_CAPACITY);
  HostTensor u8ids({2, 1, 2}, moecap_test::u8());
  auto su = source_of(u8ids, 5);
  CHECK(moecap_record_encode(&su, out.data(), out.size(), &written) == MOECAP_ERROR_INVALID_ARGUMENT);
  HostTensor short_valid({1}, moecap_test::u8());
  s.valid = short_valid.get();
  CHECK(moecap_record_encode(&s, out.data(), out.size(), &written) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(out == untouched);
  CHECK(written == 99);
}

TEST_CASE("a no-expert id is stored and read with weight 0, as a read of the capturer gives it") {
  HostTensor ids({1, 1, 2}, moecap_test::i32());
  ids.fill<int32_t>({-1, 2});
  HostTensor w({1, 1, 2}, moecap_test::f32());
  w.fill<float>({0.75f, 0.25f});
  auto r = encode(source_of(ids, 4, 0, w.get()));
  const size_t weights_at = r.size() - 2 * sizeof(float);
  float stored[2];
  std::memcpy(stored, r.data() + weights_at, sizeof stored);
  CHECK(stored[0] == 0.0f);
  CHECK(stored[1] == 0.25f);
  // A record whose bytes pair the sentinel with a weight (an encoder that
  // kept it) still reads 0 there.
  const float kept = 0.75f;
  std::memcpy(r.data() + weights_at, &kept, sizeof kept);
  HostTensor back({1, 1, 2}, moecap_test::i32());
  HostTensor wback({1, 1, 2}, moecap_test::f32());
  REQUIRE(moecap_record_decode(r.data(), r.size(), back.get(), wback.get(), nullptr) == MOECAP_OK);
  CHECK(back.at(0) == -1);
  CHECK(wback.as<float>()[0] == 0.0f);
  CHECK(wback.as<float>()[1] == 0.25f);
}

TEST_CASE("decode and encode refuse buffers that overlap what they read, and write nothing") {
  HostTensor ids({2, 1, 2}, moecap_test::i32());
  ids.fill<int32_t>({4, 2, 3, 4});
  HostTensor w({2, 1, 2}, moecap_test::f32());
  w.fill<float>({0.5f, 0.5f, 0.25f, 0.75f});
  auto r = encode(source_of(ids, 5, 0, w.get()));
  const auto original = r;

  // Outputs over one another: the ids, then validity bytes written over them.
  std::vector<int32_t> shared(8, 42);
  HostTensor ids_out({2, 1, 2}, moecap_test::i32());
  ids_out.dl().data = shared.data();
  HostTensor valid_out({2}, moecap_test::u8());
  valid_out.dl().data = shared.data();
  HostTensor weights_out({2, 1, 2}, moecap_test::f32());
  weights_out.dl().data = shared.data() + 2;
  CHECK(moecap_record_decode(r.data(), r.size(), ids_out.get(), nullptr, valid_out.get()) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::strstr(moecap_last_error(), "valid_out shares memory with ids_out") != nullptr);
  CHECK(moecap_record_decode(r.data(), r.size(), ids_out.get(), weights_out.get(), nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::strstr(moecap_last_error(), "weights_out shares memory with ids_out") != nullptr);
  CHECK(shared == std::vector<int32_t>(8, 42));

  // An output over the record itself.
  HostTensor over_record({2, 1, 2}, moecap_test::i32());
  over_record.dl().data = r.data() + 40;
  CHECK(moecap_record_decode(r.data(), r.size(), over_record.get(), nullptr, nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::strstr(moecap_last_error(), "ids_out shares memory with data (the record)") != nullptr);
  CHECK(r == original);

  // A record written over its own source.
  std::vector<uint8_t> buffer(256, 0xAB);
  HostTensor ids_in_buffer({2, 1, 2}, moecap_test::i32());
  ids_in_buffer.dl().data = buffer.data() + 16;
  std::memcpy(buffer.data() + 16, ids.as<int32_t>(), 4 * sizeof(int32_t));
  const auto before = buffer;
  auto s = source_of(ids_in_buffer, 5);
  uint64_t written = 99;
  CHECK(moecap_record_encode(&s, buffer.data(), buffer.size(), &written) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::strstr(moecap_last_error(), "source->ids shares memory with out") != nullptr);
  CHECK(buffer == before);
  CHECK(written == 99);
  // Past the record's end is not the record: encoding there is fine.
  ids_in_buffer.dl().data = buffer.data() + 128;
  std::memcpy(buffer.data() + 128, ids.as<int32_t>(), 4 * sizeof(int32_t));
  CHECK(moecap_record_encode(&s, buffer.data(), buffer.size(), &written) == MOECAP_OK);
  CHECK(written < 128);
}

TEST_CASE("malformed records are refused before anything is decoded") {
  HostTensor ids({3, 2, 2}, moecap_test::i32());
  ids.fill<int32_t>({0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2});
  HostTensor valid({3}, moecap_test::u8());
  valid.fill<uint8_t>({1, 0, 1});
  const auto good = encode(source_of(ids, 9, MOECAP_RECORD_PACKED, nullptr, valid.get()));
  HostTensor back({3, 2, 2}, moecap_test::i32());
  back.set(0, 42);
  auto refused = [&](std::vector<uint8_t> r, moecap_status status, const char* says) {
    CAPTURE(says);
    CHECK(moecap_record_decode(r.data(), r.size(), back.get(), nullptr, nullptr) == status);
    CHECK(std::strstr(moecap_last_error(), says) != nullptr);
    CHECK(back.at(0) == 42);
  };
  auto with = [&](size_t at, uint8_t v) {
    auto r = good;
    r[at] = v;
    return r;
  };
  refused(with(0, 'X'), MOECAP_ERROR_INVALID_ARGUMENT, "magic");
  refused(with(4, 2), MOECAP_ERROR_ABI_MISMATCH, "version");
  refused(with(8, 5), MOECAP_ERROR_INVALID_ARGUMENT, "id_bits");
  refused(with(9, 0x80), MOECAP_ERROR_INVALID_ARGUMENT, "unknown bits");
  refused(with(10, MOECAP_WEIGHTS_F32), MOECAP_ERROR_INVALID_ARGUMENT, "weight dtype");
  refused(with(24, 4), MOECAP_ERROR_INVALID_ARGUMENT, "header says");
  refused(with(39, 0x80), MOECAP_ERROR_INVALID_ARGUMENT, "start_position is -9223372036854775808; must be >= 0");
  {
    auto before_zero = good;  // start -1
    std::fill(before_zero.begin() + 32, before_zero.begin() + 40, uint8_t{0xFF});
    refused(before_zero, MOECAP_ERROR_INVALID_ARGUMENT, "start_position is -1; must be >= 0");
    moecap_record_info info{};
    info.struct_size = sizeof info;
    CHECK(moecap_record_parse(before_zero.data(), before_zero.size(), &info) == MOECAP_ERROR_INVALID_ARGUMENT);
  }
  refused(std::vector<uint8_t>(good.begin(), good.end() - 1), MOECAP_ERROR_INVALID_ARGUMENT, "header says");
  refused(std::vector<uint8_t>(good.begin(), good.begin() + 12), MOECAP_ERROR_INVALID_ARGUMENT, "at least 40");
  refused(with(40, 0x0D), MOECAP_ERROR_INVALID_ARGUMENT, "padding");            // bit 3: a fourth token
  refused(with(40, 0x03), MOECAP_ERROR_INVALID_ARGUMENT, "invalid but holds expert");  // token 1 invalid but routed
  {
    auto last_past = good;  // start 2^63 - 1 with three tokens
    std::fill(last_past.begin() + 32, last_past.begin() + 39, uint8_t{0xFF});
    last_past[39] = 0x7F;
    refused(last_past, MOECAP_ERROR_INVALID_ARGUMENT, "start_position is 9223372036854775807 with 3 tokens");
  }
  // 9 experts in 4 bits: codes 9..14 are neither experts nor the sentinel.
  refused(with(41, static_cast<uint8_t>((good[41] & 0xF0) | 0x0C)), MOECAP_ERROR_INVALID_ARGUMENT, "record id 0 is 12");
  const auto many = [&] {
    HostTensor big({1, 1, 1}, moecap_test::i32());
    big.fill<int32_t>({199});
    return encode(source_of(big, 200));
  }();
  HostTensor narrow1({1, 1, 1}, i8());
  CHECK(moecap_record_decode(many.data(), many.size(), narrow1.get(), nullptr, nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
  CHECK(std::strstr(moecap_last_error(), "cannot hold expert 199") != nullptr);
  HostTensor wrong_shape({3, 2, 3}, moecap_test::i32());
  CHECK(moecap_record_decode(good.data(), good.size(), wrong_shape.get(), nullptr, nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
  // The good record still decodes.
  REQUIRE(moecap_record_decode(good.data(), good.size(), back.get(), nullptr, nullptr) == MOECAP_OK);
  CHECK(back.at(4) == -1);
  CHECK(back.at(8) == 8);
}

TEST_CASE("a header whose id section is within 7 bits of 2^64 is refused, not read past its 40 bytes") {
  // Packed ids, no weights, no validity: the sizes a header could make wrap
  // to an empty id section. 1-bit ids (1 expert) at 3 layers, top-5 and
  // (2^64 - 1) / 15 tokens: 2^64 - 1 bits; 2-bit ids (2 experts) at 7
  // layers, top-1 and (2^63 - 1) / 7 tokens: 2^64 - 2 bits.
  struct Wrap {
    int32_t experts, layers, top_k;
    uint64_t tokens;
  };
  for (const Wrap& w : {Wrap{1, 3, 5, UINT64_MAX / 15}, Wrap{2, 7, 1, (UINT64_MAX / 2) / 7}}) {
    CAPTURE(w.experts);
    HostTensor ids({1, w.layers, w.top_k}, moecap_test::i32());
    for (int64_t i = 0; i < int64_t{w.layers} * w.top_k; ++i) ids.set(i, 0);
    auto r = encode(source_of(ids, w.experts, MOECAP_RECORD_PACKED));
    r.resize(MOECAP_RECORD_HEADER_BYTES);
    for (int b = 0; b < 8; ++b) r[24 + b] = static_cast<uint8_t>(w.tokens >> (8 * b));
    moecap_record_info info{};
    info.struct_size = sizeof info;
    info.num_tokens = 42;
    CHECK(moecap_record_parse(r.data(), r.size(), &info) == MOECAP_ERROR_INVALID_ARGUMENT);
    CHECK(info.num_tokens == 42);
    HostTensor back({1, w.layers, w.top_k}, moecap_test::i32());
    back.set(0, 42);
    CHECK(moecap_record_decode(r.data(), r.size(), back.get(), nullptr, nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
    CHECK(back.at(0) == 42);
  }
}

TEST_CASE("every single-byte corruption and truncation is either refused untouched or decodes in range") {
  HostTensor ids({5, 2, 3}, moecap_test::i32());
  for (int64_t i = 0; i < ids.numel(); ++i) ids.set(i, (i * 7) % 11);
  ids.set(4, -1);
  HostTensor w({5, 2, 3}, moecap_test::f16());
  HostTensor valid({5}, moecap_test::u8());
  valid.fill<uint8_t>({1, 1, 0, 1, 1});
  for (uint32_t flags : {0u, uint32_t{MOECAP_RECORD_PACKED}}) {
    const auto good = encode(source_of(ids, 11, flags, w.get(), valid.get()));
    for (size_t at = 0; at <= good.size(); ++at) {
      for (int v : {0x00, 0x01, 0x80, 0xFF, -1}) {  // -1: truncate at `at`
        std::vector<uint8_t> r = good;
        if (v < 0) {
          r.resize(at);
        } else if (at < r.size()) {
          r[at] = static_cast<uint8_t>(v);
        } else {
          r.push_back(static_cast<uint8_t>(v));
        }
        HostTensor out({5, 2, 3}, i16());
        HostTensor wout({5, 2, 3}, moecap_test::f32());
        for (int64_t i = 0; i < out.numel(); ++i) out.set(i, 77);
        const moecap_status s = moecap_record_decode(r.data(), r.size(), out.get(), wout.get(), nullptr);
        for (int64_t i = 0; i < out.numel(); ++i) {
          if (s == MOECAP_OK) {
            REQUIRE((out.at(i) >= -1 && out.at(i) < 11));
          } else {
            REQUIRE(out.at(i) == 77);
          }
        }
      }
    }
  }
}

TEST_CASE("record structs follow the ABI's struct_size rules") {
  HostTensor ids({1, 1, 1}, moecap_test::i32());
  ids.fill<int32_t>({2});
  // A newer caller's longer source: accepted with a zero tail, refused with anything in it.
  struct Longer {
    moecap_record_source s;
    uint64_t tail;
  } longer{};
  longer.s = source_of(ids, 4);
  longer.s.struct_size = sizeof longer;
  uint64_t bytes = 0;
  CHECK(moecap_record_size(&longer.s, &bytes) == MOECAP_OK);
  longer.tail = 1;
  CHECK(moecap_record_size(&longer.s, &bytes) == MOECAP_ERROR_ABI_MISMATCH);
  auto shorter = source_of(ids, 4);
  shorter.struct_size = MOECAP_RECORD_SOURCE_SIZE_1_1 - 1;
  CHECK(moecap_record_size(&shorter, &bytes) == MOECAP_ERROR_ABI_MISMATCH);
  // An info struct is written up to the caller's size.
  const auto r = encode(source_of(ids, 4));
  struct LongerInfo {
    moecap_record_info info;
    uint64_t tail;
  } out{};
  out.info.struct_size = sizeof out;
  out.tail = 0x5555;
  REQUIRE(moecap_record_parse(r.data(), r.size(), &out.info) == MOECAP_OK);
  CHECK(out.info.struct_size == sizeof(moecap_record_info));
  CHECK(out.tail == 0x5555);
  CHECK(out.info.num_experts == 4);
}

// --- The codec against a one-bit-at-a-time reference of docs/RECORD_FORMAT.md ---

namespace {

struct Case {
  int64_t tokens, layers, top_k;
  int32_t experts;
  bool packed;
};

int32_t width_of(int32_t experts, bool packed) {
  if (!packed) return experts <= 0xff ? 8 : experts <= 0xffff ? 16 : 32;
  int32_t bits = 1;
  while ((int64_t{1} << bits) - 1 < experts) ++bits;
  return bits;
}

void put(std::vector<uint8_t>& r, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) r.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

// The record, bit by bit: ids [i] (any value where the token is invalid), weight bytes of `wbytes` each.
std::vector<uint8_t> reference_record(const Case& c, const std::vector<int64_t>& ids, const std::vector<uint8_t>& w,
                                      int wbytes, int32_t wdtype, const std::vector<uint8_t>& valid) {
  const int32_t bits = width_of(c.experts, c.packed);
  const uint64_t sentinel = (uint64_t{1} << bits) - 1, row = static_cast<uint64_t>(c.layers * c.top_k);
  bool some_invalid = false;
  for (uint8_t v : valid) some_invalid |= v == 0;
  std::vector<uint8_t> r = {'M', 'C', 'R', 'T', 1, 0, 40, 0, static_cast<uint8_t>(bits),
                            static_cast<uint8_t>((c.packed ? 1 : 0) | (wbytes ? 2 : 0) | (some_invalid ? 4 : 0)),
                            static_cast<uint8_t>(wdtype), 0};
  put(r, static_cast<uint64_t>(c.layers), 4);
  put(r, static_cast<uint64_t>(c.top_k), 4);
  put(r, static_cast<uint64_t>(c.experts), 4);
  put(r, static_cast<uint64_t>(c.tokens), 8);
  put(r, 0, 8);
  auto ok = [&](uint64_t t) { return valid.empty() || valid[t] != 0; };
  if (some_invalid) {
    const size_t at = r.size();
    r.resize(at + static_cast<size_t>(c.tokens + 7) / 8, 0);
    for (int64_t t = 0; t < c.tokens; ++t) r[at + static_cast<size_t>(t / 8)] |= static_cast<uint8_t>(ok(static_cast<uint64_t>(t)) << (t % 8));
  }
  const size_t at = r.size();
  r.resize(at + (ids.size() * static_cast<size_t>(bits) + 7) / 8, 0);
  std::vector<uint64_t> codes(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    codes[i] = ok(i / row) && ids[i] >= 0 ? static_cast<uint64_t>(ids[i]) : sentinel;
    for (int b = 0; b < bits; ++b) {
      const size_t bit = i * static_cast<size_t>(bits) + static_cast<size_t>(b);
      if ((codes[i] >> b) & 1) r[at + bit / 8] |= static_cast<uint8_t>(1u << (bit % 8));
    }
  }
  for (size_t i = 0; wbytes && i < ids.size(); ++i) {
    for (int b = 0; b < wbytes; ++b) r.push_back(codes[i] == sentinel ? 0 : w[i * static_cast<size_t>(wbytes) + static_cast<size_t>(b)]);
  }
  return r;
}

// Code i of a record, bit by bit.
uint64_t reference_code(const std::vector<uint8_t>& r, size_t ids_at, int32_t bits, size_t i) {
  uint64_t code = 0;
  for (int b = 0; b < bits; ++b) {
    const size_t bit = i * static_cast<size_t>(bits) + static_cast<size_t>(b);
    code |= static_cast<uint64_t>((r[ids_at + bit / 8] >> (bit % 8)) & 1) << b;
  }
  return code;
}

DLDataType int_type(int bits) { return DLDataType{kDLInt, static_cast<uint8_t>(bits), 1}; }

// Every case: 1, 21 and 2,250 codes (past the codec's 2,048-code chunk, with a tail that is no multiple of 8 codes).
std::vector<Case> cases_of_width(int32_t bits, bool packed) {
  std::vector<Case> out;
  // The fewest and the most experts of this width.
  const int32_t lo = packed ? (bits == 1 ? 1 : static_cast<int32_t>(int64_t{1} << (bits - 1)))
                            : bits == 8 ? 1 : bits == 16 ? 256 : 65536;
  const int32_t hi = packed ? static_cast<int32_t>((int64_t{1} << bits) - 1) : bits == 8 ? 255 : bits == 16 ? 65535 : INT32_MAX;
  for (int32_t experts : {lo, hi}) {
    out.push_back({1, 1, 1, experts, packed});
    out.push_back({3, 1, 7, experts, packed});
    out.push_back({150, 3, 5, experts, packed});
  }
  return out;
}

std::vector<std::pair<int32_t, bool>> every_width() {
  std::vector<std::pair<int32_t, bool>> out;
  for (int32_t bits = 1; bits <= 31; ++bits) out.push_back({bits, true});  // packed: 1..31 bits (num_experts < 2^31)
  for (int32_t bits : {8, 16, 32}) out.push_back({bits, false});
  return out;
}

}  // namespace

TEST_CASE("encode and decode match a bit-by-bit reference at every width, dtype, length, with and without weights") {
  std::mt19937_64 rng(11);
  const DLDataType wtypes[3] = {moecap_test::f32(), moecap_test::bf16(), moecap_test::f16()};
  const int32_t wdtypes[3] = {MOECAP_WEIGHTS_F32, MOECAP_WEIGHTS_BF16, MOECAP_WEIGHTS_F16};
  const int32_t welems[3] = {moecap::kF32, moecap::kBF16, moecap::kF16};
  int round = 0;
  for (const auto& [bits, packed] : every_width()) {
    for (const Case& c : cases_of_width(bits, packed)) {
      for (int weighted = -1; weighted < 3; ++weighted) {  // -1: no weights, else wtypes[weighted]
        for (bool some_invalid : {false, true}) {
          CAPTURE(bits);
          CAPTURE(packed);
          CAPTURE(c.experts);
          CAPTURE(c.tokens);
          CAPTURE(weighted);
          CAPTURE(some_invalid);
          ++round;
          const int64_t n = c.tokens * c.layers * c.top_k;
          // Source ids in the narrowest dtype that holds them, or a wider one in turn.
          const int min_bits = c.experts - 1 <= INT8_MAX ? 8 : c.experts - 1 <= INT16_MAX ? 16 : 32;
          const int in_bits = std::max(min_bits, 8 << (round % 4));
          HostTensor ids({c.tokens, c.layers, c.top_k}, int_type(in_bits));
          HostTensor valid({c.tokens}, moecap_test::u8());
          std::vector<int64_t> values(static_cast<size_t>(n));
          for (int64_t i = 0; i < n; ++i) {
            const uint64_t pick = rng() % 8;  // -1, the extremes, or any expert
            values[static_cast<size_t>(i)] = pick == 0 ? -1 : pick == 1 ? 0 : pick == 2 ? c.experts - 1
                                            : static_cast<int64_t>(rng() % static_cast<uint64_t>(c.experts));
            ids.set(i, values[static_cast<size_t>(i)]);
          }
          std::vector<uint8_t> valid_bytes;
          if (some_invalid) {
            for (int64_t t = 0; t < c.tokens; ++t) valid.as<uint8_t>()[t] = (t % 3 == 1 || t == c.tokens - 1) ? 0 : 1;
            valid_bytes.assign(valid.as<uint8_t>(), valid.as<uint8_t>() + c.tokens);
          }
          const int wbytes = weighted < 0 ? 0 : wtypes[weighted].bits / 8;
          HostTensor weights({c.tokens, c.layers, c.top_k}, weighted < 0 ? moecap_test::f32() : wtypes[weighted]);
          std::vector<uint8_t> wsrc(static_cast<size_t>(n * wbytes));
          for (auto& b : wsrc) b = static_cast<uint8_t>(rng());
          if (wbytes) std::memcpy(weights.as<uint8_t>(), wsrc.data(), wsrc.size());
          const auto r = encode(source_of(ids, c.experts, packed ? MOECAP_RECORD_PACKED : 0, wbytes ? weights.get() : nullptr,
                                          some_invalid ? valid.get() : nullptr));
          const auto expect = reference_record(c, values, wsrc, wbytes, weighted < 0 ? 0 : wdtypes[weighted], valid_bytes);
          REQUIRE(r == expect);

          // Decode into every ids dtype that holds the experts, and every weight dtype.
          const size_t ids_at = 40 + (some_invalid ? static_cast<size_t>(c.tokens + 7) / 8 : 0);
          const uint64_t sentinel = (uint64_t{1} << bits) - 1;
          for (int out_bits : {8, 16, 32, 64}) {
            if (out_bits < min_bits) continue;
            for (int wout = 0; wout < (wbytes ? 3 : 1); ++wout) {
              HostTensor back({c.tokens, c.layers, c.top_k}, int_type(out_bits));
              HostTensor wback({c.tokens, c.layers, c.top_k}, wtypes[wout]);
              HostTensor vback({c.tokens}, moecap_test::u8());
              REQUIRE(moecap_record_decode(r.data(), r.size(), back.get(), wbytes ? wback.get() : nullptr, vback.get()) ==
                      MOECAP_OK);
              for (int64_t i = 0; i < n; ++i) {
                const uint64_t code = reference_code(r, ids_at, bits, static_cast<size_t>(i));
                REQUIRE(back.at(i) == (code == sentinel ? -1 : static_cast<int64_t>(code)));
                if (!wbytes) continue;
                // The library's element conversions, one value at a time; "no expert" reads 0.
                const float v = code == sentinel ? 0.0f : moecap::load_float(wsrc.data(), welems[weighted], i);
                std::vector<uint8_t> want(static_cast<size_t>(wtypes[wout].bits / 8));
                moecap::store_float(want.data(), welems[wout], 0, v);
                REQUIRE(std::memcmp(wback.as<uint8_t>() + static_cast<size_t>(i) * want.size(), want.data(), want.size()) == 0);
              }
              for (int64_t t = 0; t < c.tokens; ++t) {
                REQUIRE(vback.as<uint8_t>()[t] == (some_invalid ? valid.as<uint8_t>()[t] : 1));
              }
            }
          }
        }
      }
    }
  }
}

TEST_CASE("a bad code in the middle or the tail of the ids is refused with its index, at every width") {
  for (const auto& [bits, packed] : every_width()) {
    // 2^(bits-1) experts leave codes between the last expert and the sentinel (none at 1 bit).
    if (bits == 1) continue;
    const int32_t experts = packed ? static_cast<int32_t>(int64_t{1} << (bits - 1)) : bits == 8 ? 100 : bits == 16 ? 1000 : 70000;
    const Case c{150, 3, 5, experts, packed};
    const int64_t n = c.tokens * c.layers * c.top_k;
    HostTensor ids({c.tokens, c.layers, c.top_k}, moecap_test::i32());
    for (int64_t i = 0; i < n; ++i) ids.set(i, i % experts);
    HostTensor weights({c.tokens, c.layers, c.top_k}, moecap_test::f16());
    HostTensor valid({c.tokens}, moecap_test::u8());
    for (int64_t t = 0; t < c.tokens; ++t) valid.as<uint8_t>()[t] = t != 70 && t != c.tokens - 1;
    const auto good = encode(source_of(ids, experts, packed ? MOECAP_RECORD_PACKED : 0, weights.get(), valid.get()));
    const size_t ids_at = 40 + static_cast<size_t>(c.tokens + 7) / 8;
    const size_t weights_at = ids_at + (static_cast<size_t>(n) * static_cast<size_t>(bits) + 7) / 8;
    const uint64_t sentinel = (uint64_t{1} << bits) - 1;
    auto with_code = [&](size_t i, uint64_t code) {
      auto r = good;
      for (int b = 0; b < bits; ++b) {
        const size_t bit = i * static_cast<size_t>(bits) + static_cast<size_t>(b);
        r[ids_at + bit / 8] = static_cast<uint8_t>((r[ids_at + bit / 8] & ~(1u << (bit % 8))) | (((code >> b) & 1) << (bit % 8)));
      }
      return r;
    };
    auto refused = [&](const std::vector<uint8_t>& r, const std::string& says) {
      CAPTURE(bits);
      CAPTURE(packed);
      CAPTURE(says);
      HostTensor back({c.tokens, c.layers, c.top_k}, moecap_test::i32());
      HostTensor wback({c.tokens, c.layers, c.top_k}, moecap_test::f32());
      for (int64_t i = 0; i < n; ++i) back.set(i, 42);
      CHECK(moecap_record_decode(r.data(), r.size(), back.get(), wback.get(), nullptr) == MOECAP_ERROR_INVALID_ARGUMENT);
      CHECK(std::string(moecap_last_error()) == "moecap_record_decode: " + says);
      for (int64_t i = 0; i < n; ++i) REQUIRE(back.at(i) == 42);
      for (int64_t i = 0; i < n; ++i) REQUIRE(wback.as<float>()[i] == 0.0f);
      moecap_record_info info{};
      info.struct_size = sizeof info;
      CHECK(moecap_record_parse(r.data(), r.size(), &info) == MOECAP_ERROR_INVALID_ARGUMENT);
      CHECK(std::string(moecap_last_error()) == "moecap_record_parse: " + says);
    };
    const uint64_t bad = static_cast<uint64_t>(experts);  // neither an expert nor the sentinel
    const std::string range = "; expected [0, " + std::to_string(experts) + ") or " + std::to_string(sentinel);
    // The middle, the tail, and the last code (of an invalid token: the range is still what is named).
    for (size_t i : {size_t{1000}, static_cast<size_t>(n) - 16, static_cast<size_t>(n) - 1}) {
      refused(with_code(i, bad), "record id " + std::to_string(i) + " is " + std::to_string(bad) + range);
    }
    // An invalid token holding an expert: token 70 (the middle) and the last token (the tail).
    refused(with_code(70 * 15 + 4, 1), "record token 70 is invalid but holds expert 1");
    refused(with_code(static_cast<size_t>(n) - 1, 0), "record token 149 is invalid but holds expert 0");
    // Two faults: the first is named.
    {
      auto r = with_code(1200, bad);
      const auto tail = with_code(static_cast<size_t>(n) - 1, 1);  // token 149 invalid, holding expert 1
      for (size_t b = ids_at + (static_cast<size_t>(n) - 1) * static_cast<size_t>(bits) / 8; b < weights_at; ++b) r[b] = tail[b];
      refused(r, "record id 1200 is " + std::to_string(bad) + range);
    }
    // An invalid token's weight bytes not all 0.
    {
      auto r = good;
      r[weights_at + (70 * 15 + 2) * 2 + 1] = 0x80;
      refused(r, "record token 70 is invalid but its weight bytes are not all 0");
      r = good;
      r.back() = 1;
      refused(r, "record token 149 is invalid but its weight bytes are not all 0");
    }
  }
}

TEST_CASE("encode refuses an id out of range in the middle or the tail, naming it, for every ids dtype") {
  for (int in_bits : {8, 16, 32, 64}) {
    for (uint32_t flags : {0u, uint32_t{MOECAP_RECORD_PACKED}}) {
      const int64_t tokens = 150, layers = 3, top_k = 5, n = tokens * layers * top_k;
      for (int64_t at : {int64_t{1000}, n - 1}) {
        for (int64_t bad : {int64_t{-2}, int64_t{100}, int64_t{INT8_MAX}}) {
          CAPTURE(in_bits);
          CAPTURE(at);
          CAPTURE(bad);
          HostTensor ids({tokens, layers, top_k}, int_type(in_bits));
          for (int64_t i = 0; i < n; ++i) ids.set(i, i % 100 - 1);
          ids.set(at, bad);
          HostTensor valid({tokens}, moecap_test::u8());
          for (int64_t t = 0; t < tokens; ++t) valid.as<uint8_t>()[t] = 1;
          valid.as<uint8_t>()[3] = 0;  // an invalid token's ids are not checked
          ids.set(3 * layers * top_k, -5);
          auto s = source_of(ids, 100, flags, nullptr, valid.get());
          uint64_t bytes = 0;
          CHECK(moecap_record_size(&s, &bytes) == MOECAP_ERROR_OUT_OF_RANGE);
          const std::string says = "source->ids[" + std::to_string(at / 15) + ", " + std::to_string(at % 15 / 5) + ", " +
                                   std::to_string(at % 5) + "] is " + std::to_string(bad) +
                                   "; expected [0, num_experts = 100) or -1";
          CHECK(std::string(moecap_last_error()) == "moecap_record_size: " + says);
          std::vector<uint8_t> out(100000, 0xAB);
          CHECK(moecap_record_encode(&s, out.data(), out.size(), nullptr) == MOECAP_ERROR_OUT_OF_RANGE);
          CHECK(std::string(moecap_last_error()) == "moecap_record_encode: " + says);
          for (uint8_t b : out) REQUIRE(b == 0xAB);
        }
      }
    }
  }
}
