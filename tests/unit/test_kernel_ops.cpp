// SPDX-License-Identifier: Apache-2.0
// The operations shared by the kernels and their host twins (kernel_ops.h),
// and the host commit checked against them.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "graphs/kernel_ops.h"

using namespace moecap;

namespace {

// A commit of device ids into a host cache of `dst_elem` ids at top-k
// without weights; the caller sets the buffers, rows and slots.
CommitParams commit_into(int32_t src_elem, int32_t top_k, int32_t layers, int32_t experts, int64_t count,
                         int64_t device_rows, int64_t host_slots, int32_t dst_elem = kU8) {
  CommitParams p{};
  p.count = count;
  p.device_rows = device_rows;
  p.host_slots = host_slots;
  p.dst_no_expert = invalid_id_code(dst_elem);
  p.mode = kCommitRows;
  p.num_layers = layers;
  p.top_k = top_k;
  p.num_experts = experts;
  p.src_id_elem = src_elem;
  p.dst_id_elem = dst_elem;
  p.weight_elem = -1;
  p.src_rows_elem = kI64;
  p.dst_slots_elem = kI64;
  return p;
}


// The per-element operations in kernel order for a commit (every entry that
// goes somewhere, later entries over earlier ones), writing the buffers `p`
// points at. Returns whether a committed row had no real id in some layer;
// counts into *unwritten the elements read from rows their layer did not
// write this step.
bool reference_commit(const CommitParams& p, int* unwritten = nullptr) {
  const int64_t row = int64_t{p.num_layers} * p.top_k;
  bool any_bad = false;
  for (int64_t j = 0; j < p.count; ++j) {
    int64_t from = 0, slot = 0;
    commit_source(p, j, &from, &slot);
    if (!commit_goes_to(p, from, slot)) continue;
    if (p.mode == kInvalidate) {
      p.dst_states[slot] = kSlotEmpty;
      continue;
    }
    bool bad = false;
    for (int64_t e = 0; e < row; ++e) {
      bad |= narrow_element(p, from, e, p.dst_ids + slot * row * elem_bytes(p.dst_id_elem), e);
      if (p.dst_weights != nullptr) commit_weight(p, from, slot, e);
      if (unwritten != nullptr && from >= layer_written_rows(p, e / p.top_k)) ++*unwritten;
    }
    p.dst_states[slot] = committed_state(bad);
    any_bad |= bad;
  }
  return any_bad;
}

// A commit (`p`: shape, dtypes, rows and slots set) run two ways over
// copies of the device ids `src` and, when p.weight_elem is set, weights
// `src_w`: commit_and_release_on_host, and the per-element operations in
// kernel order (commit, consume every named row, finish), each side with
// its own copy of `step` when given. The host caches start as 0x5A, the
// states as 0x7 (no state at all). `unwritten` as for reference_commit.
struct CommitBesideReference {
  std::vector<uint8_t> dev, ref_dev, dev_w, ref_dev_w, ids, ref_ids, w, ref_w, states, ref_states;
  ErrorWord errors{}, ref_errors{};
  StepWord step{}, ref_step{};
};

CommitBesideReference commit_beside_reference(CommitParams p, const std::vector<uint8_t>& src,
                                              const std::vector<uint8_t>& src_w = {}, const StepWord* step = nullptr,
                                              int* unwritten = nullptr) {
  CommitBesideReference r;
  const bool weights = p.weight_elem >= 0;
  const int64_t row = int64_t{p.num_layers} * p.top_k;
  r.dev = r.ref_dev = src;
  r.ids = r.ref_ids = std::vector<uint8_t>(static_cast<size_t>(p.host_slots * row * elem_bytes(p.dst_id_elem)), 0x5A);
  r.states = r.ref_states = std::vector<uint8_t>(static_cast<size_t>(p.host_slots), 0x7);
  if (weights) {
    r.dev_w = r.ref_dev_w = src_w;
    r.w = r.ref_w = std::vector<uint8_t>(static_cast<size_t>(p.host_slots * row * elem_bytes(p.weight_elem)), 0x5A);
  }
  if (step != nullptr) r.step = r.ref_step = *step;
  // Points p at one side's copies.
  const auto aim = [&](std::vector<uint8_t>& dev, std::vector<uint8_t>& dev_w, std::vector<uint8_t>& ids,
                       std::vector<uint8_t>& w, std::vector<uint8_t>& states, ErrorWord& errors, StepWord& side_step) {
    p.src_ids = dev.data();
    p.src_weights = weights ? dev_w.data() : nullptr;
    p.dst_ids = ids.data();
    p.dst_weights = weights ? w.data() : nullptr;
    p.dst_states = states.data();
    p.errors = &errors;
    p.step = step != nullptr ? &side_step : nullptr;
  };
  aim(r.dev, r.dev_w, r.ids, r.w, r.states, r.errors, r.step);
  commit_and_release_on_host(p);
  aim(r.ref_dev, r.ref_dev_w, r.ref_ids, r.ref_w, r.ref_states, r.ref_errors, r.ref_step);
  reference_commit(p, unwritten);
  for (int64_t e = 0; e < row * p.count; ++e) consume_element(p, e);
  finish_commit(p);
  return r;
}

// Rows of one block of the host range kernel at top-k (kBlockRows; at the
// widths without one, a count of rows as small as a block would be).
int64_t block_rows(int32_t top_k) { return top_k == 6 ? 4 : top_k == 3 ? 8 : 32 / top_k; }

}  // namespace

// The commit kernel's row copy, run on the host lane by lane: for every
// alignment of source and destination and every row size, the 32 lanes
// together write exactly the row, each byte once, and nothing around it.
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

// The host commit (tiled, vectorized, prefetching) against the per-element
// operations the CUDA kernel is built from, applied entry by entry in list
// order: every device and host id dtype, top-k widths with and without a
// compile-time path, several tiles, row lists and ranges, duplicate slots,
// slot -1, out-of-range slots and rows, out-of-range ids, weights, invalidate.
TEST_CASE("commit_on_host writes what the per-element kernel operations write, entry by entry") {
  std::mt19937 rng(7);
  const int32_t device_elems[] = {kU8, kU16, kI16, kI32};
  const int32_t host_elems[] = {kU8, kU16, kI16, kI32};
  int cases = 0, wrong = 0;
  for (int32_t s_elem : device_elems) {
    for (int32_t d_elem : host_elems) {
      for (int32_t top_k : {1, 3, 6, 8, 10, 12, 20}) {
        for (int32_t experts : {7, 200, 256}) {
          if (s_elem == kU8 && experts > 255) continue;  // the plan keeps num_experts within the device dtype
          const int32_t layers = top_k == 8 ? 48 : 5;
          const int64_t device_rows = 700, host_slots = 900, row = int64_t{layers} * top_k;
          const int mode = cases % 7 == 6 ? kInvalidate : kCommitRows;
          const bool row_list = cases % 2 == 1, weights = cases % 3 == 0;
          const int64_t count = row_list ? 400 : 600;
          std::vector<uint8_t> src(static_cast<size_t>(layers * device_rows * top_k * elem_bytes(s_elem)));
          std::vector<uint8_t> src_w(static_cast<size_t>(layers * device_rows * top_k * 4));
          for (int64_t e = 0; e < layers * device_rows * top_k; ++e) {
            const int64_t id = rng() % 100 == 0 ? static_cast<int64_t>(rng() % 7) - 3 + (rng() % 2) * (experts + 3)
                                                 : static_cast<int64_t>(rng() % static_cast<uint32_t>(experts));
            store_int(src.data(), s_elem, e, id);
          }
          for (uint8_t& b : src_w) b = static_cast<uint8_t>(rng());
          std::vector<int64_t> slots(static_cast<size_t>(count)), rows(static_cast<size_t>(count));
          for (int64_t j = 0; j < count; ++j) {
            const uint32_t r = rng() % 50;
            slots[static_cast<size_t>(j)] = r == 0 ? -1 : r == 1 ? host_slots + 3 : r < 6 ? 17 : rng() % host_slots;
            rows[static_cast<size_t>(j)] = r == 7 ? device_rows : static_cast<int64_t>(rng() % device_rows);
          }
          CommitParams p{};
          p.src_ids = src.data();
          p.src_weights = weights ? src_w.data() : nullptr;
          p.src_rows = row_list ? rows.data() : nullptr;
          p.dst_slots = slots.data();
          p.src_start = row_list ? 0 : 50;
          p.count = count;
          p.device_rows = device_rows;
          p.host_slots = host_slots;
          p.dst_no_expert = invalid_id_code(d_elem);
          p.mode = mode;
          p.num_layers = layers;
          p.top_k = top_k;
          p.num_experts = experts;
          p.src_id_elem = s_elem;
          p.dst_id_elem = d_elem;
          p.weight_elem = weights ? kF32 : -1;
          p.src_rows_elem = kI64;
          p.dst_slots_elem = kI64;
          const size_t id_bytes = static_cast<size_t>(host_slots * row * elem_bytes(d_elem));
          std::vector<uint8_t> ids(id_bytes, 0x5A), ref_ids(id_bytes, 0x5A);
          std::vector<uint8_t> w(static_cast<size_t>(host_slots * row * 4), 0x5A), ref_w(w);
          std::vector<uint8_t> states(static_cast<size_t>(host_slots), 0x7), ref_states(states);
          ErrorWord errors{}, ref_errors{};
          p.dst_ids = ids.data();
          p.dst_weights = weights ? w.data() : nullptr;
          p.dst_states = states.data();
          p.errors = &errors;
          commit_on_host(p);
          p.dst_ids = ref_ids.data();
          p.dst_weights = weights ? ref_w.data() : nullptr;
          p.dst_states = ref_states.data();
          p.errors = &ref_errors;
          reference_commit(p);
          const bool same = ids == ref_ids && w == ref_w && states == ref_states &&
                            errors.skipped_rows == ref_errors.skipped_rows && errors.skipped_rows > 0 &&
                            errors.invalid_ids == ref_errors.invalid_ids;
          if (!same && wrong++ == 0) {
            MESSAGE("first mismatch: device ", s_elem, " host ", d_elem, " top_k ", top_k, " experts ", experts, " mode ",
                    mode, " row list ", row_list, " weights ", weights);
          }
          ++cases;
        }
      }
    }
  }
  CHECK(cases == 308);
  CHECK(wrong == 0);
}

// The fused path of the common pair (int16 device ids, u8 host ids, top-8),
// with AVX2 where the CPU has it and with the SSE2 baseline: odd and even
// layer counts (layers narrowed in pairs, the last one alone), tails of 1-3
// rows, ids outside [0, experts) and negative ones, rows read in place and
// through a row list, slots listed twice and -1.
TEST_CASE("commit_on_host: the fused int16 -> u8 top-8 narrowing writes what the per-element operations write") {
  std::mt19937 rng(11);
  int cases = 0, wrong = 0;
  for (const bool avx2 : {true, false}) {
    const bool before = allow_host_avx2(avx2);
    for (int32_t layers : {1, 2, 5, 61}) {
      for (int32_t experts : {7, 256}) {
        for (int64_t count : {1, 3, 86, 301}) {
          for (const bool row_list : {false, true}) {
            const int32_t top_k = 8;
            const int64_t device_rows = 400, host_slots = 500, row = int64_t{layers} * top_k;
            std::vector<int16_t> src(static_cast<size_t>(layers * device_rows * top_k));
            for (int16_t& id : src) {
              const uint32_t r = rng() % 60;
              id = r == 0 ? static_cast<int16_t>(-1 - static_cast<int>(rng() % 3))
                   : r == 1 ? static_cast<int16_t>(experts + static_cast<int>(rng() % 300))
                            : static_cast<int16_t>(rng() % static_cast<uint32_t>(experts));
            }
            std::vector<int64_t> slots(static_cast<size_t>(count)), rows(static_cast<size_t>(count));
            for (int64_t j = 0; j < count; ++j) {
              const uint32_t r = rng() % 40;
              slots[static_cast<size_t>(j)] = r == 0 ? -1 : r < 3 ? 17 : rng() % host_slots;
              rows[static_cast<size_t>(j)] = static_cast<int64_t>(rng() % device_rows);
            }
            CommitParams p = commit_into(kI16, 8, layers, experts, count, device_rows, host_slots);
            p.src_ids = reinterpret_cast<uint8_t*>(src.data());
            p.src_rows = row_list ? rows.data() : nullptr;
            p.dst_slots = slots.data();
            p.src_start = row_list ? 0 : 33;
            std::vector<uint8_t> ids(static_cast<size_t>(host_slots * row), 0x5A), ref_ids(ids);
            std::vector<uint8_t> states(static_cast<size_t>(host_slots), 0x7), ref_states(states);
            ErrorWord errors{}, ref_errors{};
            p.dst_ids = ids.data();
            p.dst_states = states.data();
            p.errors = &errors;
            commit_on_host(p);
            p.dst_ids = ref_ids.data();
            p.dst_states = ref_states.data();
            p.errors = &ref_errors;
            const bool any_bad_row = reference_commit(p);
            const bool same = ids == ref_ids && states == ref_states && errors.invalid_ids == ref_errors.invalid_ids &&
                              errors.skipped_rows == ref_errors.skipped_rows;
            if (!same && wrong++ == 0) {
              MESSAGE("first mismatch: avx2 ", avx2, " layers ", layers, " experts ", experts, " count ", count,
                      " row list ", row_list);
            }
            if (count >= 86) CHECK(any_bad_row);  // the out-of-range ids were exercised
            ++cases;
          }
        }
      }
    }
    allow_host_avx2(before);
  }
  CHECK(cases == 2 * 4 * 2 * 4 * 2);
  CHECK(wrong == 0);
}

// The host backend's commit (commit_and_release_on_host: the consumption of
// a row range folded into the commit's pass, the fused int16 -> u8 top-8
// narrowing, layers taken in pairs, and the one-pass range kernel that
// narrows, consumes and writes each slot's row in place for up to 256
// experts when every layer holds this step's rows) against the per-element
// operations in kernel order (commit, then consume every named row, then
// finish), with the step stamps in play: layers captured this step with
// fewer rows than the commit reads, layers stamped in an earlier step,
// layers never captured, or every layer written. Row ranges running past
// the device rows, slots listed twice and -1. Compares the host cache, the
// states, the counters and the consumed device buffer.
TEST_CASE("commit_and_release_on_host with step stamps writes and consumes what the per-element operations do") {
  std::mt19937 rng(23);
  int cases = 0, wrong = 0, unwritten_rows_seen = 0;
  struct Pair {
    int32_t s, d, experts;
  };
  for (const bool avx2 : {true, false}) {
    const bool before = allow_host_avx2(avx2);
    for (const Pair pair : {Pair{kI16, kU8, 256}, Pair{kI16, kU8, 255}, Pair{kI16, kU8, 9}, Pair{kI32, kI16, 256},
                            Pair{kU16, kU8, 256}, Pair{kU8, kU8, 200}, Pair{kU8, kU8, 255}, Pair{kU8, kU8, 9},
                            Pair{kI16, kU16, 384}, Pair{kI16, kU16, 32768}}) {
      // The one-pass widths, fixed-width staging (10, 12; and the one-pass
      // widths with weights, row lists or other dtypes) and run-time widths
      // (5, 16: ids of a layer of up to 16 bytes in one 16-byte move; 20, and
      // 16 into u16: in a sized copy).
      for (int32_t top_k : {8, 6, 4, 3, 2, 1, 10, 12, 5, 16, 20}) {
        for (int32_t layers : {1, 4, 7, 61}) {
          for (const bool row_list : {false, true}) {
            for (const bool weights : {false, true}) {
              for (const bool every_layer_written : {false, true}) {
                const int32_t experts = pair.experts;
                const int64_t device_rows = 300, host_slots = 400, row = int64_t{layers} * top_k;
                const int64_t count = 1 + static_cast<int64_t>(rng() % 250);
                const int64_t elems = layers * device_rows * top_k;
                std::vector<uint8_t> src(static_cast<size_t>(elems * elem_bytes(pair.s)));
                for (int64_t e = 0; e < elems; ++e) {
                  const uint32_t r = rng() % 80;
                  const uint32_t outside = rng() % 3;
                  const int64_t id = r == 0 ? -1
                                     : r == 1 ? (outside == 0 ? experts : outside == 1 ? experts + 5 : -2)
                                              : static_cast<int64_t>(rng() % experts);
                  store_int(src.data(), pair.s, e, r == 0 ? invalid_id_code(pair.s) : id);
                }
                std::vector<uint8_t> src_w(static_cast<size_t>(elems * 4));
                for (uint8_t& b : src_w) b = static_cast<uint8_t>(rng() | 1);
                StepWord step{};
                step.step = 5;
                step.claim_serial = 9;
                std::vector<LayerStamp> stamps(static_cast<size_t>(layers));
                for (LayerStamp& s : stamps) {
                  // Every layer written: never captured (every row counts) or all rows this step.
                  const uint32_t r = every_layer_written ? rng() % 2 * 2 : rng() % 4;
                  s.step = r == 0 ? 0u : r == 1 ? 4u : 5u;
                  s.rows = r == 3 ? static_cast<int64_t>(rng() % device_rows) : device_rows;
                }
                // Slots -1 (dropped), 17 (listed twice), outside (skipped and counted), as int64 or int32.
                std::vector<int64_t> slots(static_cast<size_t>(count)), rows(static_cast<size_t>(count));
                for (int64_t j = 0; j < count; ++j) {
                  const uint32_t r = rng() % 30;
                  slots[static_cast<size_t>(j)] = r == 0   ? -1
                                                  : r < 3  ? 17
                                                  : r == 5 ? (rng() % 2 == 0 ? -2 : host_slots)
                                                           : static_cast<int64_t>(rng() % host_slots);
                  rows[static_cast<size_t>(j)] = r == 4 ? rows[0] : static_cast<int64_t>(rng() % device_rows);
                }
                const std::vector<int32_t> slots32(slots.begin(), slots.end());
                const bool int32_slots = rng() % 2 == 0;
                CommitParams p{};
                p.src_rows = row_list ? rows.data() : nullptr;
                p.dst_slots = int32_slots ? static_cast<const void*>(slots32.data()) : slots.data();
                // A range sometimes runs past the last device row (those entries are skipped and counted).
                p.src_start = row_list ? 0
                              : rng() % 4 == 0 ? device_rows - count / 2 - 1
                                               : static_cast<int64_t>(rng() % (device_rows - count + 1));
                p.count = count;
                p.device_rows = device_rows;
                p.host_slots = host_slots;
                p.dst_no_expert = invalid_id_code(pair.d);
                p.mode = kCommitRows;
                p.num_layers = layers;
                p.top_k = top_k;
                p.num_experts = experts;
                p.src_id_elem = pair.s;
                p.dst_id_elem = pair.d;
                // f32 or bf16 weights: rows of 4 or 2 bytes a weight (copied as bytes).
                p.weight_elem = weights ? (rng() % 2 == 0 ? kF32 : kBF16) : -1;
                p.src_rows_elem = kI64;
                p.dst_slots_elem = int32_slots ? kI32 : kI64;
                p.stamps = stamps.data();
                const CommitBesideReference r = commit_beside_reference(p, src, src_w, &step, &unwritten_rows_seen);
                const bool same = r.ids == r.ref_ids && r.w == r.ref_w && r.states == r.ref_states &&
                                  r.dev == r.ref_dev && r.dev_w == r.ref_dev_w &&
                                  r.errors.skipped_rows == r.ref_errors.skipped_rows &&
                                  r.errors.invalid_ids == r.ref_errors.invalid_ids && r.step.step == r.ref_step.step &&
                                  r.step.committed == r.ref_step.committed &&
                                  r.step.claim_serial == r.ref_step.claim_serial;
                if (!same && wrong++ == 0) {
                  MESSAGE("first mismatch: avx2 ", avx2, " device ", pair.s, " host ", pair.d, " experts ", pair.experts,
                          " top_k ", top_k, " layers ", layers, " row list ", row_list, " weights ", weights, " count ",
                          count, " ids ", r.ids == r.ref_ids, " w ", r.w == r.ref_w, " states ",
                          r.states == r.ref_states, " dev ", r.dev == r.ref_dev, " dev_w ", r.dev_w == r.ref_dev_w,
                          " invalid ", r.errors.invalid_ids, "/", r.ref_errors.invalid_ids, " skipped ",
                          r.errors.skipped_rows, "/", r.ref_errors.skipped_rows);
                }
                CHECK(r.step.committed == 1);
                ++cases;
              }
            }
          }
        }
      }
    }
    allow_host_avx2(before);
  }
  CHECK(cases == 2 * 10 * 11 * 4 * 2 * 2 * 2);
  CHECK(unwritten_rows_seen > 0);
  CHECK(wrong == 0);
}

// The range commit's last rows short of a block and its rows sent nowhere:
// a bad id in a row that goes to no slot (-1) is consumed but not counted,
// one in a row that goes to a slot is counted and marks it INVALID_IDS, in
// a block (in a pass of layers and in the layers after the last pass) and
// in the rows after the last block, at top-8, 6, 4, 3, 2 and 1 (blocks of
// 4, 4, 8, 8, 16 and 32 rows), at top-12 (a width fixed at compile time,
// without a block kernel) and at top-5 (a width fixed only at run time,
// through the staging tile), with AVX2 and without, from int16 device ids
// at 200 and 256 experts and from u8 ones at 200, against the per-element
// operations.
TEST_CASE("commit_and_release_on_host counts bad ids only in rows that go to a slot, in blocks and in the tail") {
  struct Source {
    int32_t elem, experts, host = kU8;
  };
  for (const bool avx2 : {true, false}) {
    const bool before = allow_host_avx2(avx2);
    for (const Source source : {Source{kI16, 200}, Source{kI16, 256}, Source{kU8, 200}, Source{kI16, 384, kU16}}) {
      for (const int32_t top_k : {8, 6, 4, 2, 1, 3, 12, 5}) {
        CAPTURE(avx2);
        CAPTURE(source.elem);
        CAPTURE(source.experts);
        CAPTURE(source.host);
        CAPTURE(top_k);
        // Nine layers: two passes of four at top-8 and 6 or one of eight, then one more.
        const int32_t layers = 9, experts = source.experts;
        // Rows 1-3 and the two after the first block hold the bad ids: at least 4 rows a block.
        const int64_t block = std::max<int64_t>(4, block_rows(top_k)), count = block + 3, device_rows = 48,
                      host_slots = 64;
        const int64_t elems = layers * device_rows * top_k;
        std::vector<uint8_t> src(static_cast<size_t>(elems * elem_bytes(source.elem)));
        for (int64_t e = 0; e < elems; ++e) store_int(src.data(), source.elem, e, e % 97 % experts);
        // Rows 1 (slot -1), 2 (slot 9) and 3 (slot 10) of the first block, and
        // rows block + 1 (slot -1) and block + 2 (slot 11) after it; those going
        // to a slot hold exactly `experts`, the first id outside.
        const auto put = [&](int64_t layer, int64_t r, int64_t k, int64_t id) {
          store_int(src.data(), source.elem, (layer * device_rows + r) * top_k + k, id);
        };
        put(3, 1, top_k - 1, experts + 5);
        put(3, 2, 0, experts);
        put(8, 3, top_k / 2, experts);  // in the layer after the last pass
        const int32_t second = std::min(1, top_k - 1);  // a row's second id, or its only one at top-1
        put(3, block + 1, second, experts + 5);
        put(5, block + 2, 0, experts);
        put(4, block + 2, second, invalid_id_code(source.elem));  // no routing: not counted
        std::vector<int64_t> slots(static_cast<size_t>(count));
        for (int64_t j = 0; j < count; ++j) slots[static_cast<size_t>(j)] = 20 + j;
        slots[1] = -1;
        slots[2] = 9;
        slots[3] = 10;
        slots[static_cast<size_t>(block + 1)] = -1;
        slots[static_cast<size_t>(block + 2)] = 11;
        CommitParams p = commit_into(source.elem, top_k, layers, experts, count, device_rows, host_slots, source.host);
        p.dst_slots = slots.data();
        const CommitBesideReference r = commit_beside_reference(p, src);
        CHECK(r.errors.invalid_ids == 3);  // rows 2, 3 and block + 2
        CHECK(r.errors.invalid_ids == r.ref_errors.invalid_ids);
        CHECK(r.states[9] == (kSlotValid | kSlotInvalidIds));
        CHECK(r.states[10] == (kSlotValid | kSlotInvalidIds));
        CHECK(r.states[11] == (kSlotValid | kSlotInvalidIds));
        CHECK(r.states[20] == kSlotValid);
        CHECK(r.ids == r.ref_ids);
        CHECK(r.states == r.ref_states);
        CHECK(r.dev == r.ref_dev);
      }
    }
    allow_host_avx2(before);
  }
}

// A range commit where two rows go to one slot keeps the later row, for
// every pair of positions in and across blocks of rows (4 at top-8 and 6, 8
// at top-4 and 3, 16 at top-2, 32 at top-1; 2 into u16 host ids) and the rows
// after them, through two passes of layers and the single layer after them,
// from int16 and u8 device ids (whose rows lie in a vector register in
// different orders) into u8, and from int16 into u16; at top-12, a width
// without a block kernel, and at top-5, a width fixed only at run time,
// whose moves into the staging tile spill into the next layers' places.
TEST_CASE("commit_and_release_on_host: a slot two rows of a range go to holds the later row") {
  struct Pair {
    int32_t device, host, experts;
  };
  int cases = 0, wrong = 0;
  for (const bool avx2 : {true, false}) {
    const bool before = allow_host_avx2(avx2);
    for (const Pair pair : {Pair{kI16, kU8, 200}, Pair{kU8, kU8, 200}, Pair{kI16, kU16, 384}}) {
      const int32_t elem = pair.device;
      for (const int32_t top_k : {8, 6, 4, 2, 1, 3, 12, 5}) {
        // Two passes of eight layers (of four at top-8 and 6), then one more.
        const int32_t layers = 17, experts = pair.experts;
        const int64_t count = 2 * block_rows(top_k) + 1, device_rows = count + 7, host_slots = count + 7;
        for (int64_t first = 0; first < count; ++first) {
          for (int64_t second = first + 1; second < count; ++second) {
            const int64_t elems = layers * device_rows * top_k;
            std::vector<uint8_t> src(static_cast<size_t>(elems * elem_bytes(elem)));
            for (int64_t e = 0; e < elems; ++e) store_int(src.data(), elem, e, (e * 7 + e / top_k) % experts);
            std::vector<int64_t> slots(static_cast<size_t>(count));
            for (int64_t j = 0; j < count; ++j) slots[static_cast<size_t>(j)] = j;
            slots[static_cast<size_t>(second)] = first;
            CommitParams p = commit_into(elem, top_k, layers, experts, count, device_rows, host_slots, pair.host);
            p.dst_slots = slots.data();
            const CommitBesideReference r = commit_beside_reference(p, src);
            if (r.ids != r.ref_ids || r.states != r.ref_states || r.dev != r.ref_dev) {
              if (wrong++ == 0) {
                MESSAGE("first mismatch: avx2 ", avx2, " device ", elem, " host ", pair.host, " top_k ", top_k, " rows ",
                        first, " and ", second);
              }
            }
            ++cases;
          }
        }
      }
    }
    allow_host_avx2(before);
  }
  // block_rows is 8 at top-3, 2 at top-12 and 6 at top-5: 17, 5 and 13 rows.
  CHECK(cases == 2 * 3 * (9 * 8 + 9 * 8 + 17 * 16 + 33 * 32 + 65 * 64 + 17 * 16 + 5 * 4 + 13 * 12) / 2);
  CHECK(wrong == 0);
}

// Claims are never cleared, so each commit's must outrank every earlier one
// for as long as a capturer lives: past 2^32 claim-using commits too (a
// decode step a millisecond is 50 days), where a serial in the high 32 bits
// wrapped to 0 and every slot claimed before the wrap refused its entries.
TEST_CASE("claims outrank every earlier commit's, also past 2^32 commits") {
  for (const unsigned long long serial : {0ull, 5ull, 0xffffffffull, 0x1ffffffffull}) {
    CAPTURE(serial);
    const int64_t device_rows = 4, host_slots = 4;
    std::vector<int32_t> src(static_cast<size_t>(device_rows), 0);
    std::vector<int32_t> ids(static_cast<size_t>(host_slots), 0);
    std::vector<uint8_t> states(static_cast<size_t>(host_slots), 0);
    std::vector<unsigned long long> claims(static_cast<size_t>(host_slots), 0);
    std::vector<int64_t> slots = {2, 2};
    ErrorWord errors{};
    StepWord step{};
    step.claim_serial = serial;
    LayerStamp stamp{};  // never captured: every row counts as written
    CommitParams p{};
    p.src_ids = reinterpret_cast<uint8_t*>(src.data());
    p.dst_ids = reinterpret_cast<uint8_t*>(ids.data());
    p.dst_states = states.data();
    p.dst_slots = slots.data();
    p.errors = &errors;
    p.step = &step;
    p.stamps = &stamp;
    p.claims = claims.data();
    p.count = 2;
    p.device_rows = device_rows;
    p.host_slots = host_slots;
    p.dst_no_expert = -1;
    p.mode = kCommitRows;
    p.num_layers = 1;
    p.top_k = 1;
    p.num_experts = 100;
    p.src_id_elem = kI32;
    p.dst_id_elem = kI32;
    p.weight_elem = -1;
    p.src_rows_elem = kI64;
    p.dst_slots_elem = kI64;
    for (int32_t commit = 0; commit < 3; ++commit) {
      CAPTURE(commit);
      src[0] = 10 + commit;
      src[1] = 20 + commit;  // the last entry for slot 2
      claim_on_host(p);
      commit_on_host(p);
      release_on_host(p);
      CHECK(ids[2] == 20 + commit);
      CHECK(states[2] == kSlotValid);
    }
  }
}

// The host read (gather_on_host: a widening picked once per read, AVX2 where
// the CPU has it and allow_host_avx2 lets it, plain code otherwise)
// against the per-element operation the gather kernel runs, for every stored
// id dtype into every output dtype: rows shorter than a vector, with a tail,
// and 488 long; the stored "no expert" code at every position of a row;
// u8 ids 128..254 and u16 ids above 32767 (zero-extended); negative int16 and
// int32 values; the u8 code that is also a real id (invalid_code INT64_MIN);
// empty slots and slots whose ids cannot be told from "no expert" (-1 fill,
// weight 0); weights copied or converted between every pair of weight
// dtypes (special values included), zero where the id reads -1; int32
// and int64 slot lists; and nothing written past the output.
TEST_CASE("gather_on_host reads what the per-element gather operation reads, with and without AVX2") {
  std::mt19937 rng(31);
  const int32_t stored_elems[] = {kU8, kU16, kI16, kI32};
  const int32_t dst_elems[] = {kU8, kI8, kU16, kI16, kI32, kI64};
  int cases = 0, wrong = 0, codes_read = 0, unreadable_read = 0;
  for (const bool avx2 : {true, false}) {
    const bool before = allow_host_avx2(avx2);
    for (int32_t stored : stored_elems) {
      for (int32_t dst : dst_elems) {
        for (int64_t row : {1, 7, 16, 33, 488}) {
          const bool unsigned_stored = stored == kU8 || stored == kU16;
          for (const bool code_is_id : {false, true}) {
            if (code_is_id && !unsigned_stored) continue;  // the plan has a spare code in signed dtypes
            const int64_t invalid_code = code_is_id ? INT64_MIN : invalid_id_code(stored);
            const int64_t host_slots = row + 40, count = cases % 5 == 4 ? 3 : row + 60;
            const int id_bytes = elem_bytes(stored), out_bytes = elem_bytes(dst);
            const bool weights = cases % 2 == 0;
            // Over the cases with weights, every pair of stored and output weight dtypes.
            const int32_t weight_elems[] = {kF32, kBF16, kF16};
            const int32_t stored_w = weight_elems[cases % 3], dst_w = weight_elems[(cases / 3) % 3];
            std::vector<uint8_t> cache(static_cast<size_t>(host_slots * row * id_bytes));
            std::vector<uint8_t> cache_w(static_cast<size_t>(host_slots * row * 4));
            std::vector<uint8_t> states(static_cast<size_t>(host_slots));
            for (int64_t s = 0; s < host_slots; ++s) {
              const uint32_t r = rng() % 10;
              const uint8_t state = r == 0 ? uint8_t{kSlotEmpty}
                                    : r < 4 ? static_cast<uint8_t>(kSlotValid | kSlotInvalidIds)
                                            : uint8_t{kSlotValid};
              states[static_cast<size_t>(s)] = state;
              // A slot flagged INVALID_IDS holds the code at position s % row
              // (every position over the slots) and now and then elsewhere; an
              // unflagged one never, unless the code is also a real id.
              const bool codes = (state & kSlotInvalidIds) != 0 || code_is_id;
              for (int64_t e = 0; e < row; ++e) {
                const int64_t at = s * row + e;
                int64_t v;
                const uint32_t pick = rng() % 8;
                if (codes && (e == s % row || pick == 0)) {
                  v = invalid_code == INT64_MIN ? (stored == kU8 ? 0xff : 0xffff) : invalid_code;
                } else if (stored == kU8) {
                  v = pick < 4 ? 128 + rng() % 127 : rng() % 128;  // 128..254 are real ids
                } else if (stored == kU16) {
                  v = pick < 4 ? 32768 + rng() % 32767 : rng() % 32768;
                } else {
                  v = pick == 1 ? -2 - static_cast<int64_t>(rng() % 100) : static_cast<int64_t>(rng() % 30000);
                }
                store_int(cache.data(), stored, at, v);
                // Now and then a value each conversion treats apart: zeros, half and
                // float subnormals, past the half range, infinity, NaN, negative.
                const float specials[] = {0.0f, -0.0f, 3e-6f, 1e-30f, 70000.0f, INFINITY, NAN, -3.5f};
                const uint32_t w = rng();
                store_float(cache_w.data(), stored_w, at,
                            w % 16 == 0 ? specials[(w >> 4) % 8] : 0.25f + static_cast<float>(w % 1000) / 64.0f);
                if (w % 16 == 1) {  // a NaN with a payload, signalling: read bit for bit into its own dtype
                  if (elem_bytes(stored_w) == 2) {
                    reinterpret_cast<uint16_t*>(cache_w.data())[at] = stored_w == kF16 ? 0x7d01 : 0x7f81;
                  } else {
                    reinterpret_cast<uint32_t*>(cache_w.data())[at] = 0x7f800001u;
                  }
                }
              }
            }
            std::vector<int64_t> slots64(static_cast<size_t>(count));
            std::vector<int32_t> slots32(static_cast<size_t>(count));
            for (int64_t t = 0; t < count; ++t) {
              // Slot t % host_slots first, so every slot's row (every code position) is read.
              const int64_t s = t < host_slots ? t : static_cast<int64_t>(rng() % host_slots);
              slots64[static_cast<size_t>(t)] = s;
              slots32[static_cast<size_t>(t)] = static_cast<int32_t>(s);
            }
            std::swap(slots64.front(), slots64.back());
            std::swap(slots32.front(), slots32.back());
            const int64_t guard = 64;  // bytes past the output that must stay as they were
            const int dst_w_bytes = elem_bytes(dst_w);
            std::vector<uint8_t> out(static_cast<size_t>(count * row * out_bytes + guard), 0xA5), ref_out(out);
            std::vector<uint8_t> out_w(static_cast<size_t>(count * row * dst_w_bytes + guard), 0xA5), ref_w(out_w);
            GatherParams p{};
            p.src_ids = cache.data();
            p.src_weights = weights ? cache_w.data() : nullptr;
            p.states = states.data();
            const bool slots_i32 = cases % 3 == 1;
            p.slots = slots_i32 ? static_cast<const void*>(slots32.data()) : static_cast<const void*>(slots64.data());
            p.slots_elem = slots_i32 ? kI32 : kI64;
            p.count = count;
            p.row_elements = row;
            p.invalid_code = invalid_code;
            p.stored_id_elem = stored;
            p.dst_id_elem = dst;
            p.stored_weight_elem = weights ? stored_w : -1;
            p.dst_weight_elem = weights ? dst_w : -1;
            p.dst_ids = out.data();
            p.dst_weights = weights ? out_w.data() : nullptr;
            gather_on_host(p);
            p.dst_ids = ref_out.data();
            p.dst_weights = weights ? ref_w.data() : nullptr;
            for (int64_t i = 0; i < count * row; ++i) {
              gather_element(p, i);
              const int64_t slot = slots64[static_cast<size_t>(i / row)];
              if (!slot_readable(states[static_cast<size_t>(slot)], invalid_code)) {
                ++unreadable_read;
              } else if (load_int(cache.data(), stored, slot * row + i % row) == invalid_code) {
                ++codes_read;
              }
            }
            if ((out != ref_out || out_w != ref_w) && wrong++ == 0) {
              MESSAGE("first mismatch: avx2 ", avx2, " stored ", stored, " dst ", dst, " row ", row, " code is id ",
                      code_is_id, " weights ", weights, " count ", count);
            }
            ++cases;
          }
        }
      }
    }
    allow_host_avx2(before);
  }
  CHECK(cases == 2 * (2 * 6 * 5 * 2 + 2 * 6 * 5));
  CHECK(codes_read > 1000);
  CHECK(unreadable_read > 1000);
  CHECK(wrong == 0);
}

// The common pair by value rather than against another implementation: a u8
// cache read into int32 and int64, 0xff at each position of a 33-id row (a
// vector's worth, and a tail), ids 128..254 kept as they are.
TEST_CASE("gather_on_host: u8 ids read as themselves into int32 and int64, 0xff as -1 at every position") {
  const int64_t row = 33, slots_n = row;
  std::vector<uint8_t> cache(static_cast<size_t>(slots_n * row));
  std::vector<uint8_t> states(static_cast<size_t>(slots_n), kSlotValid | kSlotInvalidIds);
  std::vector<int64_t> slots(static_cast<size_t>(slots_n));
  for (int64_t s = 0; s < slots_n; ++s) {
    slots[static_cast<size_t>(s)] = slots_n - 1 - s;
    for (int64_t e = 0; e < row; ++e) {
      cache[static_cast<size_t>(s * row + e)] = e == s ? 0xff : static_cast<uint8_t>(100 + (s + e) % 155);
    }
  }
  for (const bool avx2 : {true, false}) {
    const bool before = allow_host_avx2(avx2);
    for (const int32_t dst : {kI32, kI64}) {
      CAPTURE(avx2);
      CAPTURE(dst);
      std::vector<int64_t> out64(static_cast<size_t>(slots_n * row), 7);
      std::vector<int32_t> out32(static_cast<size_t>(slots_n * row), 7);
      GatherParams p{};
      p.src_ids = cache.data();
      p.states = states.data();
      p.slots = slots.data();
      p.slots_elem = kI64;
      p.dst_ids = dst == kI32 ? static_cast<void*>(out32.data()) : static_cast<void*>(out64.data());
      p.count = slots_n;
      p.row_elements = row;
      p.invalid_code = 0xff;
      p.stored_id_elem = kU8;
      p.dst_id_elem = dst;
      p.stored_weight_elem = -1;
      p.dst_weight_elem = -1;
      gather_on_host(p);
      int wrong = 0;
      for (int64_t t = 0; t < slots_n; ++t) {
        const int64_t s = slots_n - 1 - t;
        for (int64_t e = 0; e < row; ++e) {
          const int64_t want = e == s ? -1 : 100 + (s + e) % 155;
          const int64_t got = dst == kI32 ? out32[static_cast<size_t>(t * row + e)] : out64[static_cast<size_t>(t * row + e)];
          wrong += got != want ? 1 : 0;
        }
      }
      CHECK(wrong == 0);
      // The same cache with 256 experts: 0xff is expert 255 and reads as such.
      p.invalid_code = INT64_MIN;
      states.assign(states.size(), kSlotValid);
      gather_on_host(p);
      const int64_t got = dst == kI32 ? out32[static_cast<size_t>(row - 1)] : out64[static_cast<size_t>(row - 1)];
      CHECK(got == 255);  // slot 32's id at position 32
      states.assign(states.size(), kSlotValid | kSlotInvalidIds);
    }
    allow_host_avx2(before);
  }
}

// capture_on_host's fast paths (int32 ids: compact rows narrowed as one flat
// array, with AVX2 where the CPU has it and without; rows with extra columns
// to drop) against capture_element, id by id: the stored ids and the count
// of ids outside [0, experts), for every stored dtype.
TEST_CASE("capture_on_host: int32 ids store and count what capture_element does, with and without AVX2") {
  std::mt19937 rng(23);
  int cases = 0, wrong = 0;
  for (const bool avx2 : {true, false}) {
    const bool before = allow_host_avx2(avx2);
    for (const int32_t stored : {kU8, kU16, kI16, kI32}) {
      const int32_t experts = stored == kU8 ? 255 : 300;
      for (const int32_t top_k : {1, 2, 8, 10}) {
        for (const int32_t extra : {0, 1}) {
          for (const int64_t n : {1, 7, 33, 500}) {
            const int32_t in_cols = top_k + extra;
            std::vector<int32_t> ids(static_cast<size_t>(n * in_cols));
            for (int32_t& id : ids) {  // ids outside at the edges (-1, experts) and far beyond the stored width
              const uint32_t r = rng() % 40;
              id = r == 0   ? -1 - static_cast<int32_t>(rng() % 2)
                   : r == 1 ? -1 - static_cast<int32_t>(rng() % 70000)
                   : r == 2 ? experts + static_cast<int32_t>(rng() % 2)
                   : r == 3 ? experts + static_cast<int32_t>(rng() % 70000)
                   : r == 4 ? experts - 1
                            : static_cast<int32_t>(rng() % static_cast<uint32_t>(experts));
            }
            const size_t bytes = static_cast<size_t>(n * top_k * 4);
            std::vector<uint8_t> got(bytes, 0x5A), want(bytes, 0x5A);
            ErrorWord got_errors{}, want_errors{};
            CaptureParams p{};
            p.ids = ids.data();
            p.n = n;
            p.in_cols = in_cols;
            p.top_k = top_k;
            p.ids_elem = kI32;
            p.stored_id_elem = stored;
            p.num_experts = experts;
            p.dst_ids = got.data();
            p.errors = &got_errors;
            capture_on_host(p);
            p.dst_ids = want.data();
            p.errors = &want_errors;
            for (int64_t i = 0; i < n * top_k; ++i) capture_element(p, i);
            if ((got != want || got_errors.invalid_ids != want_errors.invalid_ids) && wrong++ == 0) {
              MESSAGE("first mismatch: avx2 ", avx2, " stored ", stored, " top_k ", top_k, " extra ", extra, " n ", n);
            }
            if (n == 500) CHECK(want_errors.invalid_ids > 0);  // ids outside were exercised
            ++cases;
          }
        }
      }
    }
    allow_host_avx2(before);
  }
  CHECK(cases == 2 * 4 * 4 * 2 * 4);
  CHECK(wrong == 0);
}
