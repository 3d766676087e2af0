// SPDX-License-Identifier: Apache-2.0
// moecap_bench: each moecap operation beside a baseline doing the same work
// the way engines do it today, so every claim is a ratio from one run.
// Host backend here; CUDA cases are in moecap_bench_cuda.cpp.
#include <benchmark/benchmark.h>
#include <dlfcn.h>
#include <sys/mman.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "moecap.h"
#include "plugin/capturer.h"
#include "plugin/plan.h"

namespace {

// A 128-expert, top-8, 48-layer model (Qwen3-30B-A3B's router shape).
constexpr int32_t kLayers = 48;
constexpr int32_t kTopK = 8;
constexpr int32_t kExperts = 128;
constexpr int64_t kRowElems = int64_t{kLayers} * kTopK;
constexpr int64_t kDeviceRows = 16384;
constexpr int64_t kHostSlots = 1 << 17;
// The large cache: as many KV slots as a serving engine keeps (>= 262,144),
// where random slots miss every cache level and the TLB.
constexpr int64_t kLargeHostSlots = 1 << 18;

// id_dtype: the host cache's; device_id_dtype: what capture (or a kernel) writes.
moecap_config bench_config(int32_t id_dtype, int32_t device_id_dtype = MOECAP_IDS_AUTO,
                           int64_t host_slots = kHostSlots, int32_t top_k = kTopK, int32_t experts = kExperts,
                           int32_t weight_dtype = MOECAP_WEIGHTS_NONE) {
  moecap_config c{};
  c.struct_size = sizeof c;
  if (moecap_config_init(&c) != MOECAP_OK) std::abort();
  c.flags = MOECAP_FLAG_NO_GUARDS;
  c.num_layers = kLayers;
  c.top_k = top_k;
  c.num_experts = experts;
  c.max_running_requests = 256;
  c.chunked_prefill_size = kDeviceRows;
  c.host_slots = host_slots;
  c.id_dtype = id_dtype;
  c.device_id_dtype = device_id_dtype;
  c.weight_dtype = weight_dtype;
  return c;
}

struct Handle {
  explicit Handle(int32_t id_dtype, int32_t device_id_dtype = MOECAP_IDS_AUTO, int64_t host_slots = kHostSlots,
                  int32_t top_k = kTopK, int32_t experts = kExperts, int32_t weight_dtype = MOECAP_WEIGHTS_NONE) {
    const moecap_config c = bench_config(id_dtype, device_id_dtype, host_slots, top_k, experts, weight_dtype);
    if (moecap_create(&c, &h) != MOECAP_OK) std::abort();
  }
  ~Handle() { moecap_destroy(h); }
  moecap_capturer* h = nullptr;
};

DLTensor tensor(void* data, int ndim, int64_t* shape, DLDataType dtype) {
  return DLTensor{data, {kDLCPU, 0}, ndim, dtype, shape, nullptr, 0};
}

// Host rows for a floor, page-aligned like moecap's cache (a std::vector
// this large starts 16 bytes into a page, so every row straddled one more
// line: that alone made the floor 20-30 % slower): on 2 MB pages as moecap's
// host backend gives its cache (where transparent huge pages are allowed),
// so the floor differs from a commit only in the work; or on 4 KB pages, as
// a framework tensor an engine would scatter into has them by default.
class FloorBytes {
 public:
  FloorBytes(int64_t bytes, bool huge_pages) {
    const size_t page = huge_pages ? size_t{2} << 20 : size_t{4096};
    const size_t rounded = (static_cast<size_t>(bytes) + page - 1) / page * page;
    data_ = static_cast<uint8_t*>(std::aligned_alloc(page, rounded));
    if (data_ == nullptr) std::abort();
    madvise(data_, rounded, huge_pages ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    std::memset(data_, 0, rounded);
  }
  ~FloorBytes() { std::free(data_); }
  FloorBytes(const FloorBytes&) = delete;
  FloorBytes& operator=(const FloorBytes&) = delete;
  uint8_t* data() { return data_; }

 private:
  uint8_t* data_;
};

std::vector<int64_t> random_slots(int64_t n, uint32_t seed, int64_t host_slots = kHostSlots) {
  std::vector<int64_t> s(static_cast<size_t>(host_slots));
  for (int64_t i = 0; i < host_slots; ++i) s[static_cast<size_t>(i)] = i;
  std::shuffle(s.begin(), s.end(), std::mt19937(seed));
  s.resize(static_cast<size_t>(n));
  return s;
}

std::vector<int64_t> sequential_slots(int64_t n) {
  std::vector<int64_t> s(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) s[static_cast<size_t>(i)] = 1000 + i;
  return s;
}

const DLDataType kI32{kDLInt, 32, 1};
const DLDataType kI64{kDLInt, 64, 1};
const DLDataType kF32{kDLFloat, 32, 1};

// Whether every slot reads as real routing (a strict read): what the timed
// commits stored was routing, not rows an earlier commit consumed.
bool holds_routing(moecap_capturer* h, std::vector<int64_t>& slots, int32_t top_k = kTopK) {
  const int64_t t = static_cast<int64_t>(slots.size());
  std::vector<int32_t> out(static_cast<size_t>(t * kLayers * top_k));
  int64_t sshape[1] = {t};
  int64_t oshape[3] = {t, kLayers, top_k};
  DLTensor st = tensor(slots.data(), 1, sshape, kI64);
  DLTensor ot = tensor(out.data(), 3, oshape, kI32);
  return moecap_read(h, &st, &ot, nullptr, MOECAP_READ_STRICT, nullptr) == MOECAP_OK;
}

// --- capture --------------------------------------------------------------------

// Args: n, input bits (32/64), device id dtype (what capture narrows into).
void BM_Capture_Moecap(benchmark::State& state) {
  const int64_t n = state.range(0);
  const bool wide = state.range(1) == 64;
  Handle cap(MOECAP_IDS_AUTO, static_cast<int32_t>(state.range(2)));
  std::vector<int64_t> ids(static_cast<size_t>(n * kTopK));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i % kExperts);
  std::vector<int32_t> ids32(ids.begin(), ids.end());
  int64_t shape[2] = {n, kTopK};
  DLTensor t = wide ? tensor(ids.data(), 2, shape, kI64) : tensor(ids32.data(), 2, shape, kI32);
  int32_t layer = 0;
  for (auto _ : state) {
    moecap_capture(cap.h, layer, &t, nullptr, nullptr);
    layer = (layer + 1) % kLayers;
  }
  state.SetBytesProcessed(state.iterations() * n * kTopK * (wide ? 8 : 4));
  state.SetItemsProcessed(state.iterations() * n);
}

// What slice assignment into an int32 [rows, layers, top_k] buffer does.
void BM_Capture_Baseline(benchmark::State& state) {
  const int64_t n = state.range(0);
  std::vector<int32_t> buffer(static_cast<size_t>(kDeviceRows * kRowElems));
  std::vector<int32_t> ids(static_cast<size_t>(n * kTopK), 7);
  int32_t layer = 0;
  for (auto _ : state) {
    int32_t* dst = buffer.data() + layer * kTopK;
    for (int64_t r = 0; r < n; ++r) std::memcpy(dst + r * kRowElems, ids.data() + r * kTopK, kTopK * 4);
    benchmark::ClobberMemory();
    layer = (layer + 1) % kLayers;
  }
  state.SetBytesProcessed(state.iterations() * n * kTopK * 4);
  state.SetItemsProcessed(state.iterations() * n);
}

// --- commit ---------------------------------------------------------------------

// The slots each commit of n rows goes to. Order 0: the same n consecutive
// slots every time; 1: the same n random slots every time (they stay in the
// caches between commits); 2: n random slots not used by the commits just
// before (a walk through one permutation of every slot), as an engine's
// decode steps write new tokens' slots: the host rows are cold, so memory
// decides.
struct SlotWalk {
  SlotWalk(int64_t n, int64_t order, int64_t host_slots)
      : n(n), slots(order == 0 ? sequential_slots(n) : random_slots(order == 2 ? host_slots : n, 1, host_slots)) {}
  const int64_t* next() {
    const int64_t* at = slots.data() + offset;
    offset += n;
    if (offset + n > static_cast<int64_t>(slots.size())) offset = 0;
    return at;
  }
  int64_t n;
  std::vector<int64_t> slots;
  int64_t offset = 0;
};

// Args: rows, slot order (SlotWalk), host slots. Commit
// consumes its rows, so every iteration first writes the rows again into
// the device buffer (every layer, as a top-k kernel writing moecap's layer
// views would; captured once before, so they count as this step's): each
// commit narrows and moves real routing, freshly written as in an engine.
// BM_Commit_Rewrite times the writes alone; the commit is the difference
// (bench/report.py, bench/guard.py), in CPU time like the baselines.
// Timing each commit alone would need a clock per call that costs as much
// as a decode step's commit (CPU-time clocks are system calls here), and
// wall time counts the preemptions of a shared machine.
// device_id_dtype: AUTO (int16, what the top-k kernels writing moecap's
// layer views write) or U8 (what an engine whose routing goes through
// moecap_capture can choose for <= 255 experts: half the bytes to read).
// top_k: the model's (8 by default; 6 for DeepSeek-V2, 4 for gpt-oss, 2 for Mixtral); experts: 128 by
// default (u8 host ids; 384, Kimi K2's, takes u16 ones). weight_dtype: the
// routing weights stored beside the ids (none by default), rewritten too.
struct CommitCase {
  explicit CommitCase(const benchmark::State& state, int32_t device_id_dtype = MOECAP_IDS_AUTO,
                      int32_t top_k = kTopK, int32_t experts = kExperts, int32_t weight_dtype = MOECAP_WEIGHTS_NONE)
      : n(state.range(0)), top_k(top_k),
        cap(MOECAP_IDS_AUTO, device_id_dtype, state.range(2), top_k, experts, weight_dtype),
        slots(n, state.range(1), state.range(2)) {
    std::vector<int32_t> ids(static_cast<size_t>(n * top_k));
    std::vector<float> weights(ids.size());
    int64_t ids_shape[2] = {n, top_k};
    DLTensor it = tensor(ids.data(), 2, ids_shape, kI32), wt = tensor(weights.data(), 2, ids_shape, kF32);
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      for (size_t i = 0; i < ids.size(); ++i) {
        ids[i] = static_cast<int32_t>((i * 7 + static_cast<size_t>(layer)) % static_cast<size_t>(experts));
        weights[i] = 1.0f / static_cast<float>(1 + i % static_cast<size_t>(top_k));
      }
      const DLTensor* w = weight_dtype == MOECAP_WEIGHTS_NONE ? nullptr : &wt;
      if (moecap_capture(cap.h, layer, &it, w, nullptr) != MOECAP_OK) std::abort();
    }
    ids_rows = DeviceRows(cap.h, MOECAP_BUFFER_DEVICE_IDS, n, top_k);
    if (weight_dtype != MOECAP_WEIGHTS_NONE) weight_rows = DeviceRows(cap.h, MOECAP_BUFFER_DEVICE_WEIGHTS, n, top_k);
    shape[0] = n;
    st = tensor(nullptr, 1, shape, kI64);
    args = moecap_commit_args{sizeof args, 0, nullptr, &st};
  }
  // Commits the rows to the walk's next slots.
  void commit() {
    last = slots.next();
    st.data = const_cast<int64_t*>(last);
    moecap_commit(cap.h, &args, nullptr);
  }
  bool committed_routing() {
    std::vector<int64_t> s(last, last + n);
    return holds_routing(cap.h, s, top_k);
  }
  void rewrite() {
    ids_rows.rewrite();
    weight_rows.rewrite();
    benchmark::ClobberMemory();
  }
  // The first n rows of every layer of one device buffer (ids or weights),
  // and what they hold before each commit.
  struct DeviceRows {
    DeviceRows() = default;
    DeviceRows(moecap_capturer* h, int32_t buffer, int64_t n, int32_t top_k) {
      DLManagedTensorVersioned* v = nullptr;
      if (moecap_export(h, buffer, 0, &v) != MOECAP_OK) std::abort();
      device = static_cast<uint8_t*>(v->dl_tensor.data);
      layer_bytes = n * top_k * v->dl_tensor.dtype.bits / 8;
      device_layer_bytes = v->dl_tensor.shape[1] * top_k * v->dl_tensor.dtype.bits / 8;
      v->deleter(v);  // the capturer keeps the memory
      routing.resize(static_cast<size_t>(kLayers * layer_bytes));
      for (int32_t layer = 0; layer < kLayers; ++layer) {
        std::memcpy(routing.data() + layer * layer_bytes, device + layer * device_layer_bytes,
                    static_cast<size_t>(layer_bytes));
      }
    }
    void rewrite() {
      if (device == nullptr) return;
      for (int32_t layer = 0; layer < kLayers; ++layer) {
        std::memcpy(device + layer * device_layer_bytes, routing.data() + layer * layer_bytes,
                    static_cast<size_t>(layer_bytes));
      }
    }
    std::vector<uint8_t> routing;    // [layers, n, top_k]: what the rows hold before each commit
    uint8_t* device = nullptr;       // the device buffer, [layers, device_rows, top_k]
    int64_t layer_bytes = 0;         // n rows of one layer
    int64_t device_layer_bytes = 0;  // all device rows of one layer
  };
  int64_t n;
  int32_t top_k;
  Handle cap;
  SlotWalk slots;
  const int64_t* last = nullptr;  // the slots of the last commit
  DeviceRows ids_rows, weight_rows;  // weight_rows holds nothing without weights
  int64_t shape[1] = {0};
  DLTensor st{};
  moecap_commit_args args{};
};

void BM_Commit_Moecap(benchmark::State& state) {
  CommitCase c(state);
  for (auto _ : state) {
    c.rewrite();
    c.commit();
  }
  if (!c.committed_routing()) state.SkipWithError("commit stored no routing");
  state.SetItemsProcessed(state.iterations() * c.n);  // tokens
}

void BM_Commit_Rewrite(benchmark::State& state) {
  CommitCase c(state);
  for (auto _ : state) c.rewrite();
  state.SetItemsProcessed(state.iterations() * c.n);
}

// The framework way: copy the int32 slice out, then scatter its rows into an int32 host cache.
void BM_Commit_Baseline(benchmark::State& state) {
  const int64_t n = state.range(0);
  const int64_t host_slots = state.range(2);
  std::vector<int32_t> device(static_cast<size_t>(kDeviceRows * kRowElems), 3);
  std::vector<int32_t> host(static_cast<size_t>(host_slots * kRowElems));
  std::vector<int32_t> staged(static_cast<size_t>(n * kRowElems));
  SlotWalk walk(n, state.range(1), host_slots);
  for (auto _ : state) {
    std::memcpy(staged.data(), device.data(), staged.size() * 4);
    const int64_t* slots = walk.next();
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(host.data() + slots[i] * kRowElems, staged.data() + i * kRowElems, kRowElems * 4);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * kRowElems * 4);
}

// The floor of a commit: a bare memcpy of each finished u8 row (the bytes
// moecap stores) from a contiguous source to its slot, no narrowing, no
// checks, no consuming. Same args as BM_Commit_Moecap, and the same rewrite
// of the device rows before each scatter (BM_Commit_Rewrite is taken out of
// both): the floor then runs in the caches a commit meets after a step wrote
// its routing, not in caches holding nothing but its own rows.
void BM_Commit_MemcpyRows(benchmark::State& state) {
  CommitCase c(state);
  const int64_t n = c.n;
  const int64_t host_slots = state.range(2);
  std::vector<uint8_t> src(static_cast<size_t>(n * kRowElems), 1);
  FloorBytes dst(host_slots * kRowElems, true);
  for (auto _ : state) {
    c.rewrite();
    const int64_t* slots = c.slots.next();
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst.data() + slots[i] * kRowElems, src.data() + i * kRowElems, kRowElems);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
}

// The least a commit from S device ids into u8 host rows can do: each
// finished row's ids, slot-major already (no transpose), narrowed to u8
// by truncation (no range check) into its slot, row by row, and with
// `consume` all ones written back over them, the device buffer's "no
// routing". A commit has to write them: a top-k kernel may write moecap's
// layer views directly, so the ids are the only mark a later step sees of
// what this one wrote. `row` ids a row, a multiple of 32. False where the
// CPU lacks AVX2. A bound only with sequential slots: into cold random
// slots its stores wait behind the misses that moecap requests ahead.
#if defined(__x86_64__)
template <class S>
__attribute__((target("avx2"))) void narrow_rows_avx2(S* src, uint8_t* dst, const int64_t* at, int64_t n,
                                                      int64_t row, bool consume) {
  const __m256i ones = _mm256_set1_epi8(-1);
  for (int64_t i = 0; i < n; ++i) {
    S* from = src + i * row;
    uint8_t* to = dst + at[i] * row;
    for (int64_t j = 0; j < row; j += 32) {
      auto* in = reinterpret_cast<__m256i*>(from + j);
      if constexpr (sizeof(S) == 1) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + j), _mm256_loadu_si256(in));
        if (consume) _mm256_storeu_si256(in, ones);
      } else {
        const __m256i lo = _mm256_and_si256(_mm256_loadu_si256(in), _mm256_set1_epi16(0xff));
        const __m256i hi = _mm256_and_si256(_mm256_loadu_si256(in + 1), _mm256_set1_epi16(0xff));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + j),
                            _mm256_permute4x64_epi64(_mm256_packus_epi16(lo, hi), 0xd8));
        if (consume) {
          _mm256_storeu_si256(in, ones);
          _mm256_storeu_si256(in + 1, ones);
        }
      }
    }
  }
}
#endif
template <class S>
bool narrow_rows(S* src, uint8_t* dst, const int64_t* at, int64_t n, int64_t row, bool consume) {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2")) {
    narrow_rows_avx2(src, dst, at, n, row, consume);
    return true;
  }
#endif
  (void)src, (void)dst, (void)at, (void)n, (void)row, (void)consume;
  return false;
}

// Commit and its floor paired: every iteration rewrites the rows and
// commits them, then rewrites them again and scatters the floor's rows to
// the same walk of slots on 2 MB pages (the floor, floor_over_commit), and
// once more on 4 KB pages (small_pages_floor_over_commit: what scattering
// into a framework tensor costs), each timed alone by the monotonic clock
// (a vDSO call, about 20 ns). Reports the median of each per call
// (preemptions by other jobs land in a few calls and leave the median
// alone) and floor / commit: interleaved, they see the same machine state,
// where the separate cases above run half a minute apart.
// With weights (weight_bytes per weight), the floor scatters each row's
// weights too, into host weights of their own as moecap's are. With
// `narrowing_floors` (u8 host rows of a multiple of 32 ids, no weights), two more loops
// paired the same way, from device-width ids (narrow_rows):
// narrow_floor_over_commit narrows them into their slots, and
// narrow_consume_floor_over_commit writes "no routing" back over them as
// well. They move more memory between the commits, so their cases are
// separate from the plain floor's, whose ratios stay comparable run to run.
void commit_against_floor(benchmark::State& state, int32_t device_id_dtype, int32_t top_k = kTopK,
                          int32_t experts = kExperts, int32_t weight_dtype = MOECAP_WEIGHTS_NONE,
                          int64_t weight_bytes = 0, bool narrowing_floors = false) {
  using Clock = std::chrono::steady_clock;
  CommitCase c(state, device_id_dtype, top_k, experts, weight_dtype);
  const int64_t n = c.n;
  const int64_t slots = state.range(2);
  const int64_t row = int64_t{kLayers} * top_k * (experts > 256 ? 2 : 1);  // bytes of a host row (u8 or u16 ids)
  const int64_t weight_row = int64_t{kLayers} * top_k * weight_bytes;    // bytes of a host row's weights
  std::vector<uint8_t> src(static_cast<size_t>(n * row), 1), weight_src(static_cast<size_t>(n * weight_row), 1);
  FloorBytes dst(slots * row, true), small_pages_dst(slots * row, false);
  FloorBytes weight_dst(std::max<int64_t>(slots * weight_row, 1), true);
  FloorBytes small_pages_weight_dst(std::max<int64_t>(slots * weight_row, 1), false);
  SlotWalk floor_slots(n, state.range(1), slots), small_pages_slots(n, state.range(1), slots);
  std::vector<double> commit_ns, floor_ns, small_pages_ns;
  const auto scatter = [&](FloorBytes& to, FloorBytes& weights_to, SlotWalk& walk) {
    c.rewrite();
    const int64_t* at = walk.next();
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(to.data() + at[i] * row, src.data() + i * row, static_cast<size_t>(row));
      if (weight_row > 0) {
        std::memcpy(weights_to.data() + at[i] * weight_row, weight_src.data() + i * weight_row,
                    static_cast<size_t>(weight_row));
      }
    }
    benchmark::ClobberMemory();
    return std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
  };
  // The narrowing floors' device-width source, slot-major, refilled with
  // routing before each call as the device rows are.
  const bool u8_device = device_id_dtype == MOECAP_IDS_U8;
  const int64_t row_ids = int64_t{kLayers} * top_k;
  narrowing_floors = narrowing_floors && weight_row == 0 && experts <= 256 && row_ids % 32 == 0;
  const int64_t narrow_bytes = narrowing_floors ? n * row_ids * (u8_device ? 1 : 2) : 0;
  std::vector<uint8_t> narrow_routing(static_cast<size_t>(narrow_bytes), 3);
  std::vector<uint8_t> narrow_src(narrow_routing.size());
  FloorBytes narrow_dst(narrowing_floors ? slots * row : 1, true);
  SlotWalk narrow_slots(n, state.range(1), slots);
  std::vector<double> narrow_ns, narrow_consume_ns;
  bool have_narrowing_floors = narrowing_floors;
  const auto narrow = [&](bool consume) {
    c.rewrite();
    std::memcpy(narrow_src.data(), narrow_routing.data(), narrow_src.size());
    benchmark::ClobberMemory();
    const int64_t* at = narrow_slots.next();
    const auto t0 = Clock::now();
    auto* const ids16 = reinterpret_cast<int16_t*>(narrow_src.data());
    have_narrowing_floors = u8_device ? narrow_rows(narrow_src.data(), narrow_dst.data(), at, n, row_ids, consume)
                                      : narrow_rows(ids16, narrow_dst.data(), at, n, row_ids, consume);
    benchmark::ClobberMemory();
    return std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
  };
  for (auto _ : state) {
    c.rewrite();
    const auto t0 = Clock::now();
    c.commit();
    const auto t1 = Clock::now();
    commit_ns.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count());
    floor_ns.push_back(scatter(dst, weight_dst, floor_slots));
    small_pages_ns.push_back(scatter(small_pages_dst, small_pages_weight_dst, small_pages_slots));
    if (have_narrowing_floors) {
      narrow_ns.push_back(narrow(false));
      narrow_consume_ns.push_back(narrow(true));
    }
  }
  if (!c.committed_routing()) state.SkipWithError("commit stored no routing");
  auto median = [](std::vector<double>& v) {
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    return v[v.size() / 2];
  };
  const double commit = median(commit_ns), floor = median(floor_ns), small_pages = median(small_pages_ns);
  state.counters["commit_ns"] = commit;
  state.counters["floor_ns"] = floor;
  state.counters["floor_over_commit"] = floor / commit;
  state.counters["small_pages_floor_ns"] = small_pages;
  state.counters["small_pages_floor_over_commit"] = small_pages / commit;
  if (have_narrowing_floors && !narrow_ns.empty()) {
    state.counters["narrow_floor_ns"] = median(narrow_ns);
    state.counters["narrow_floor_over_commit"] = median(narrow_ns) / commit;
    state.counters["narrow_consume_floor_ns"] = median(narrow_consume_ns);
    state.counters["narrow_consume_floor_over_commit"] = median(narrow_consume_ns) / commit;
  }
  state.SetItemsProcessed(state.iterations() * n);
}

void BM_Commit_AgainstFloor(benchmark::State& state) { commit_against_floor(state, MOECAP_IDS_AUTO); }
void BM_Commit_AgainstFloor_U8Device(benchmark::State& state) { commit_against_floor(state, MOECAP_IDS_U8); }
// The same beside the narrowing loops (narrow_rows).
void BM_Commit_AgainstNarrowing(benchmark::State& state) {
  commit_against_floor(state, MOECAP_IDS_AUTO, kTopK, kExperts, MOECAP_WEIGHTS_NONE, 0, true);
}
void BM_Commit_AgainstNarrowing_U8Device(benchmark::State& state) {
  commit_against_floor(state, MOECAP_IDS_U8, kTopK, kExperts, MOECAP_WEIGHTS_NONE, 0, true);
}
// The same at the other top-k the one-pass range commit covers (int16 device ids).
void BM_Commit_AgainstFloor_Top6(benchmark::State& state) { commit_against_floor(state, MOECAP_IDS_AUTO, 6); }
void BM_Commit_AgainstFloor_Top4(benchmark::State& state) { commit_against_floor(state, MOECAP_IDS_AUTO, 4); }
void BM_Commit_AgainstFloor_Top2(benchmark::State& state) { commit_against_floor(state, MOECAP_IDS_AUTO, 2); }
// Top-8 of 384 experts (Kimi K2): u16 host ids.
void BM_Commit_AgainstFloor_U16Host(benchmark::State& state) {
  commit_against_floor(state, MOECAP_IDS_AUTO, kTopK, 384);
}
// Top-1 of 128 experts (Llama 4 Maverick), top-10 of 512 (Qwen3-Next) and
// top-12 of 768 (LongCat-Flash: 512 experts and 256 zero-computation ones)
// into u16 host ids, and top-3 of 64 (Step-3 routes to 3 of 48).
void BM_Commit_AgainstFloor_Top1(benchmark::State& state) { commit_against_floor(state, MOECAP_IDS_AUTO, 1, 128); }
void BM_Commit_AgainstFloor_Top10U16Host(benchmark::State& state) {
  commit_against_floor(state, MOECAP_IDS_AUTO, 10, 512);
}
void BM_Commit_AgainstFloor_Top12U16Host(benchmark::State& state) {
  commit_against_floor(state, MOECAP_IDS_AUTO, 12, 768);
}
void BM_Commit_AgainstFloor_Top3(benchmark::State& state) { commit_against_floor(state, MOECAP_IDS_AUTO, 3, 64); }
// Routing weights beside the ids, stored as bf16 (2 bytes each).
void BM_Commit_AgainstFloor_Bf16Weights(benchmark::State& state) {
  commit_against_floor(state, MOECAP_IDS_AUTO, kTopK, kExperts, MOECAP_WEIGHTS_BF16, 2);
}

// The physical ceiling: one memcpy of the bytes moecap's commit moves (u8 rows).
void BM_Commit_Memcpy(benchmark::State& state) {
  const int64_t n = state.range(0);
  std::vector<uint8_t> src(static_cast<size_t>(n * kRowElems), 1);
  FloorBytes dst(kHostSlots * kRowElems, true);
  for (auto _ : state) {
    std::memcpy(dst.data() + 1000 * kRowElems, src.data(), src.size());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * kRowElems);
}

// --- read -----------------------------------------------------------------------

// A finished request of T tokens, scattered over the cache, into int32 [T, layers, top_k].
void BM_Read_Moecap(benchmark::State& state) {
  const int64_t t = state.range(0);
  Handle cap(MOECAP_IDS_AUTO);
  std::vector<int64_t> slots = random_slots(t, 2);
  std::vector<int32_t> out(static_cast<size_t>(t * kRowElems));
  int64_t sshape[1] = {t};
  int64_t oshape[3] = {t, kLayers, kTopK};
  DLTensor st = tensor(slots.data(), 1, sshape, kI64);
  DLTensor ot = tensor(out.data(), 3, oshape, kI32);
  // Committed slots, as a finished request's are (an empty slot reads as a -1 fill).
  for (int64_t first = 0; first < t; first += kDeviceRows) {
    int64_t n[1] = {std::min(kDeviceRows, t - first)};
    DLTensor part = tensor(slots.data() + first, 1, n, kI64);
    moecap_commit_args a{sizeof a, 0, nullptr, &part};
    if (moecap_commit(cap.h, &a, nullptr) != MOECAP_OK) std::abort();
  }
  for (auto _ : state) moecap_read(cap.h, &st, &ot, nullptr, 0, nullptr);
  state.SetItemsProcessed(state.iterations() * t);
}

// Frameworks' advanced indexing: an element-wise gather through an index array.
void BM_Read_Baseline(benchmark::State& state) {
  const int64_t t = state.range(0);
  std::vector<int32_t> cache(static_cast<size_t>(kHostSlots * kRowElems), 5);
  std::vector<int64_t> slots = random_slots(t, 2);
  std::vector<int32_t> out(static_cast<size_t>(t * kRowElems));
  for (auto _ : state) {
    for (int64_t i = 0; i < t * kRowElems; ++i) {
      const int64_t row = i / kRowElems;
      const int64_t col = i - row * kRowElems;
      out[static_cast<size_t>(i)] = cache[static_cast<size_t>(slots[static_cast<size_t>(row)] * kRowElems + col)];
    }
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * t);
}

// --- ABI overhead ----------------------------------------------------------------

void BM_Abi_CaptureThroughDlopen(benchmark::State& state) {
  void* lib = dlopen(MOECAP_LIBRARY, RTLD_NOW | RTLD_LOCAL);
  using Create = moecap_status (*)(const moecap_config*, moecap_capturer**);
  using Capture = moecap_status (*)(moecap_capturer*, int32_t, const DLTensor*, const DLTensor*, void*);
  using Destroy = moecap_status (*)(moecap_capturer*);
  auto create = reinterpret_cast<Create>(dlsym(lib, "moecap_create"));
  auto capture = reinterpret_cast<Capture>(dlsym(lib, "moecap_capture"));
  auto destroy = reinterpret_cast<Destroy>(dlsym(lib, "moecap_destroy"));
  const moecap_config c = bench_config(MOECAP_IDS_AUTO);
  moecap_capturer* h = nullptr;
  create(&c, &h);
  int32_t ids[kTopK] = {1, 2, 3, 4, 5, 6, 7, 8};
  int64_t shape[2] = {1, kTopK};
  DLTensor t = tensor(ids, 2, shape, kI32);
  for (auto _ : state) benchmark::DoNotOptimize(capture(h, 0, &t, nullptr, nullptr));
  destroy(h);
}

void BM_Abi_CaptureDirectCpp(benchmark::State& state) {
  const moecap_config c = bench_config(MOECAP_IDS_AUTO);
  moecap::Capturer cap(moecap::make_plan(&c));
  int32_t ids[kTopK] = {1, 2, 3, 4, 5, 6, 7, 8};
  int64_t shape[2] = {1, kTopK};
  DLTensor t = tensor(ids, 2, shape, kI32);
  for (auto _ : state) cap.capture(0, &t, nullptr, moecap::EngineStream::legacy_default());
}

// --- memory -----------------------------------------------------------------------

struct Shape {
  const char* name;
  int32_t layers, top_k, experts;
};
constexpr Shape kShapes[] = {{"128e-top8-48L", 48, 8, 128}, {"256e-top8-61L", 61, 8, 256}, {"64e-top6-27L", 27, 6, 64}};

// Device and host bytes for a serving config (256 running requests, 8192-token
// chunks, graphs to 256 requests, 4 verify tokens, 1M KV slots) against the
// int32 layout with the old sizing.
void BM_Memory(benchmark::State& state) {
  const Shape& s = kShapes[state.range(0)];
  moecap_config c = bench_config(MOECAP_IDS_AUTO);
  c.num_layers = s.layers;
  c.top_k = s.top_k;
  c.num_experts = s.experts;
  c.dp_size = static_cast<int32_t>(state.range(1));
  c.max_running_requests = 256;
  c.chunked_prefill_size = 8192;
  c.max_graph_batch = 256;
  c.verify_tokens = 4;
  c.host_slots = 1 << 20;
  moecap_plan_info info{};
  info.struct_size = sizeof info;
  for (auto _ : state) benchmark::DoNotOptimize(moecap_plan(&c, &info));
  const double row32 = 4.0 * s.layers * s.top_k;
  state.SetLabel(s.name);
  state.counters["moecap_device_MiB"] = static_cast<double>(info.device_bytes) / (1 << 20);
  state.counters["moecap_host_MiB"] = static_cast<double>(info.host_bytes) / (1 << 20);
  state.counters["old_device_MiB"] = static_cast<double>(moecap::legacy_device_rows(c)) * row32 / (1 << 20);
  state.counters["old_host_MiB"] = static_cast<double>(c.host_slots) * row32 / (1 << 20);
  state.counters["device_rows"] = static_cast<double>(info.device_rows);
  state.counters["old_device_rows"] = static_cast<double>(moecap::legacy_device_rows(c));
}

}  // namespace

BENCHMARK(BM_Capture_Moecap)
    ->ArgsProduct({{1, 64, 512, 4096, 16384}, {32, 64}, {MOECAP_IDS_U8, MOECAP_IDS_U16, MOECAP_IDS_I16, MOECAP_IDS_I32}});
BENCHMARK(BM_Capture_Baseline)->Arg(1)->Arg(64)->Arg(512)->Arg(4096)->Arg(16384);
// Args: rows, slot order (SlotWalk), host slots: sequential and random in
// the small cache, random and fresh random in the large one.
void commit_args(benchmark::internal::Benchmark* b) {
  for (int64_t rows : {64, 512, 4096}) {
    b->Args({rows, 0, kHostSlots});
    b->Args({rows, 1, kHostSlots});
    b->Args({rows, 1, kLargeHostSlots});
    b->Args({rows, 2, kLargeHostSlots});
  }
}
BENCHMARK(BM_Commit_Moecap)->Apply(commit_args);
BENCHMARK(BM_Commit_Rewrite)->Apply(commit_args);
BENCHMARK(BM_Commit_MemcpyRows)->Apply(commit_args);
BENCHMARK(BM_Commit_Baseline)->Apply(commit_args);
BENCHMARK(BM_Commit_AgainstFloor)->Apply(commit_args);
BENCHMARK(BM_Commit_AgainstFloor_U8Device)->Apply(commit_args);
// Sequential slots in the small cache and fresh random ones in the large.
void top_k_commit_args(benchmark::internal::Benchmark* b) {
  for (int64_t rows : {64, 512, 4096}) {
    b->Args({rows, 0, kHostSlots});
    b->Args({rows, 2, kLargeHostSlots});
  }
}
BENCHMARK(BM_Commit_AgainstNarrowing)->Apply(top_k_commit_args);
BENCHMARK(BM_Commit_AgainstNarrowing_U8Device)->Apply(top_k_commit_args);
BENCHMARK(BM_Commit_AgainstFloor_Top6)->Apply(top_k_commit_args);
BENCHMARK(BM_Commit_AgainstFloor_Top4)->Apply(top_k_commit_args);
BENCHMARK(BM_Commit_AgainstFloor_Top2)->Apply(top_k_commit_args);
BENCHMARK(BM_Commit_AgainstFloor_U16Host)->Apply(top_k_commit_args);
BENCHMARK(BM_Commit_AgainstFloor_Top1)->Apply(top_k_commit_args);
BENCHMARK(BM_Commit_AgainstFloor_Top10U16Host)->Apply(top_k_commit_args);
BENCHMARK(BM_Commit_AgainstFloor_Top12U16Host)->Apply(top_k_commit_args);
BENCHMARK(BM_Commit_AgainstFloor_Top3)->Apply(top_k_commit_args);
BENCHMARK(BM_Commit_AgainstFloor_Bf16Weights)->Apply(top_k_commit_args);
BENCHMARK(BM_Commit_Memcpy)->Arg(64)->Arg(512)->Arg(4096);
BENCHMARK(BM_Read_Moecap)->Arg(128)->Arg(4096)->Arg(32768);
BENCHMARK(BM_Read_Baseline)->Arg(128)->Arg(4096)->Arg(32768);
BENCHMARK(BM_Abi_CaptureThroughDlopen);
BENCHMARK(BM_Abi_CaptureDirectCpp);
BENCHMARK(BM_Memory)->ArgsProduct({{0, 1, 2}, {1, 8}})->Iterations(1);

BENCHMARK_MAIN();
