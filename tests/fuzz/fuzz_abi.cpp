// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: the input decodes into a fuzzed config (of any struct
// size a 1.0, 1.1 or newer caller passes, sometimes with an extension
// pointer) and a sequence of ABI calls on the host backend (capture, commit
// by range and by row list, invalidate, read (also STRICT), write,
// local_rows, export and release, ids written straight into a layer view,
// graph record and replay, error counters, histogram reset). After every call:
//   - a failed call changed nothing (every buffer byte and counter equal),
//   - a successful one left exactly what a simple model predicts: the
//     buffers (device ids and weights, host cache, slot states, histogram)
//     and both error counters, compared through moecap's own exports
//     (check_buffers says which bytes),
// and the sanitizers watch for everything else.
//
// The model (struct Model) rests on these documented library behaviours;
// when one of them changes, the Model method named beside it changes with it:
//   - create: every device row holds "no routing" (the device dtype's
//     all-ones code), every slot is EMPTY (Model::start);
//   - capture: rows [0, n) of a layer (with no rows it still starts a step
//     and stamps the layer); an id outside [0, num_experts) is stored as the
//     no-routing code and, but for -1, counted in invalid_ids, an id inside
//     it in the histogram; weights rounded to the stored dtype
//     (Model::capture);
//   - a top-k kernel writing a MOECAP_BUFFER_LAYER_IDS view: the values
//     stay as written until a commit reads them (Model::kernel_writes);
//   - commit: entries in list order (a slot listed twice keeps its last
//     row); slot -1 drops a row quietly; a slot outside [-1, host_slots) or a
//     source row outside [0, device_rows) is skipped and counted in
//     skipped_rows; every id outside [0, num_experts) is stored as -1 and
//     marks the slot VALID | INVALID_IDS, counted in invalid_ids unless it is
//     the no-routing code (on the host backend for every entry that reaches
//     a slot, also one a later entry for the same slot overrides); weights
//     are copied bit for bit; then every source row the commit names
//     (whatever its slot) is consumed: every layer back to no routing,
//     weights 0 (Model::commit, Model::consume_row); a layer captured in an
//     earlier step than the commit's reads as no routing (steps: the first
//     capture after a commit starts one; Model::capture, Model::written);
//   - invalidate: slots become EMPTY, -1 ignored (Model::invalidate);
//   - write: ids stored as given, -1 as "no expert"; a token of only -1 ids
//     makes its slot EMPTY, one with some VALID | INVALID_IDS (Model::write);
//   - read: an EMPTY slot, or an INVALID_IDS one where the host dtype has no
//     spare value (U8 with 256 experts), reads -1 throughout; every id that
//     reads -1, whatever made it so, reads weight 0 (Model::read_id,
//     Model::read_weight); STRICT fails unless every slot is exactly VALID;
//   - read and write fail with ROWS_SKIPPED exactly while skipped rows are
//     not cleared by get_errors (step);
//   - local_rows: EAGER packs the ranks back to back, GRAPH puts rank r at
//     r * padded_tokens_per_rank (op_local_rows);
//   - graphs: recording runs nothing; a replay reads what the recorded
//     tensors hold at launch;
//   - a failed call changes nothing and sets moecap_last_error.
// MOECAP_FUZZ_TRACE=1 in the environment prints each call and its status,
// to see what a failing input does.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "graphs/element.h"
#include "moecap.h"
#include "tests/support/tensors.h"

namespace {

[[noreturn]] void violated(const char* what) {
  std::fprintf(stderr, "fuzz_abi: invariant violated: %s (last error: %s)\n", what, moecap_last_error());
  std::abort();
}
#define REQUIRE(cond) \
  do {                \
    if (!(cond)) violated(#cond); \
  } while (0)

class Input {
 public:
  Input(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  bool done() const { return i_ >= n_; }
  uint8_t byte() { return i_ < n_ ? p_[i_++] : 0; }
  // A value in [lo, hi], from one or two bytes.
  int64_t range(int64_t lo, int64_t hi) {
    const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
    uint64_t v = byte();
    if (span > 256) v = v << 8 | byte();
    return lo + static_cast<int64_t>(v % span);
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t i_ = 0;
};

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  std::vector<uint8_t> bytes;
  DLTensor t{};
  Tensor(std::vector<int64_t> s, DLDataType dt) : shape(std::move(s)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    bytes.assign(static_cast<size_t>(n) * dt.bits / 8 + 8, 0);
    t = DLTensor{bytes.data(), {kDLCPU, 0}, static_cast<int>(shape.size()), dt, shape.data(), nullptr, 0};
  }
  int32_t elem() const {
    if (t.dtype.code == kDLFloat) return t.dtype.bits == 32 ? moecap::kF32 : moecap::kF16;
    if (t.dtype.code == kDLBfloat) return moecap::kBF16;
    switch (t.dtype.bits) {
      case 8: return t.dtype.code == kDLUInt ? moecap::kU8 : moecap::kI8;
      case 16: return t.dtype.code == kDLUInt ? moecap::kU16 : moecap::kI16;
      case 32: return moecap::kI32;
      default: return moecap::kI64;
    }
  }
  bool floating() const { return t.dtype.code == kDLFloat || t.dtype.code == kDLBfloat; }
  void set(int64_t i, int64_t v) {
    if (floating()) {
      moecap::store_float(bytes.data(), elem(), i, static_cast<float>(v));
    } else {
      moecap::store_int(bytes.data(), elem(), i, v);
    }
  }
  int64_t get(int64_t i) const {
    return floating() ? static_cast<int64_t>(moecap::load_float(bytes.data(), elem(), i))
                      : moecap::load_int(bytes.data(), elem(), i);
  }
  void setf(int64_t i, float v) { moecap::store_float(bytes.data(), elem(), i, v); }
  float getf(int64_t i) const { return moecap::load_float(bytes.data(), elem(), i); }
};

const DLDataType kIdTypes[] = {{kDLInt, 32, 1}, {kDLInt, 64, 1}, {kDLUInt, 8, 1}, {kDLInt, 16, 1}, {kDLFloat, 32, 1}};
const DLDataType kFloatTypes[] = {{kDLFloat, 32, 1}, {kDLBfloat, 16, 1}, {kDLFloat, 16, 1}, {kDLInt, 32, 1}};

// "No expert" as the model keeps it in the host cache and as read returns it.
constexpr int64_t kNoExpert = -1;

// What the capturer must hold. Device ids are kept as the raw values the
// device buffer holds (layer-major); host ids as moecap_read returns them
// from a readable slot (kNoExpert for "no expert"), beside each slot's state.
struct Model {
  int64_t rows = 0, slots = 0, row = 0, layers = 0, k = 0, experts = 0;
  int32_t device_elem = 0, host_elem = 0, weight_elem = -1;
  int64_t device_no_expert = -1;  // the device dtype's no-routing code (all ones)
  bool no_expert_is_id = false;   // the host dtype has no spare value (u8 with 256 experts)
  std::vector<int64_t> dev_ids, host_ids;
  std::vector<float> dev_w, host_w;
  std::vector<uint8_t> states;
  std::vector<int64_t> histogram;
  bool has_histogram = false;
  uint64_t skipped = 0, invalid = 0;
  // Steps (moecap_capture, "Steps"): the first capture after a commit starts
  // one; a layer's rows count at commit only if captured this step, and a
  // layer never captured (written through its view, or never) counts every row.
  uint32_t step = 0;
  bool committed = false;
  std::vector<uint32_t> layer_step;
  std::vector<int64_t> layer_rows;
  bool written(int64_t layer, int64_t src) const {
    const uint32_t s = layer_step[static_cast<size_t>(layer)];
    return s == 0 || (s == step && src < layer_rows[static_cast<size_t>(layer)]);
  }

  // The state after create: no routing in any device row, every slot EMPTY.
  void start() {
    dev_ids.assign(static_cast<size_t>(rows * row), device_no_expert);
    dev_w.assign(dev_ids.size(), 0.0f);
    host_ids.assign(static_cast<size_t>(slots * row), 0);
    host_w.assign(host_ids.size(), 0.0f);
    states.assign(static_cast<size_t>(slots), MOECAP_SLOT_EMPTY);
    histogram.assign(static_cast<size_t>(layers * experts), 0);
    layer_step.assign(static_cast<size_t>(layers), 0);
    layer_rows.assign(static_cast<size_t>(layers), 0);
  }

  float round_weight(float v) const {
    uint8_t buf[4];
    moecap::store_float(buf, weight_elem, 0, v);
    return moecap::load_float(buf, weight_elem, 0);
  }
  size_t dev_at(int64_t layer, int64_t r, int64_t c) const { return static_cast<size_t>((layer * rows + r) * k + c); }
  size_t host_at(int64_t slot, int64_t e) const { return static_cast<size_t>(slot * row + e); }
  bool real_id(int64_t v) const { return v >= 0 && v < experts; }

  // Whether a slot's stored ids are what a read returns; otherwise it reads
  // kNoExpert throughout (EMPTY, or an out-of-range id hidden in a dtype
  // with no spare value).
  bool readable(int64_t slot) const {
    const uint8_t st = states[static_cast<size_t>(slot)];
    return (st & MOECAP_SLOT_VALID) != 0 && !((st & MOECAP_SLOT_INVALID_IDS) != 0 && no_expert_is_id);
  }
  // kNoExpert comes from: an EMPTY slot (never filled, invalidated, or
  // written with only -1 ids), an id out of range at capture, a bad value a
  // kernel wrote into a layer view, a layer not written since the row's last
  // commit (all stored as kNoExpert by commit), -1 given to write, and an
  // INVALID_IDS slot that readable() rejects.
  int64_t read_id(int64_t slot, int64_t e) const { return readable(slot) ? host_ids[host_at(slot, e)] : kNoExpert; }
  // Every id that reads -1 carries weight 0, whatever made it -1.
  float read_weight(int64_t slot, int64_t e) const {
    return read_id(slot, e) != kNoExpert ? host_w[host_at(slot, e)] : 0.0f;
  }

  // capture of ids [n, cols] (the first k columns kept) into rows [0, n) of `layer`.
  void capture(int32_t layer, const Tensor& ids, const Tensor* w) {
    const int64_t n = ids.shape[0], cols = ids.shape[1];
    // A capture of no rows too starts a step and stamps its layer (with none
    // of that step's rows, unless an earlier capture this step wrote some).
    if (committed || step == 0) {
      ++step;
      committed = false;
    }
    const auto l = static_cast<size_t>(layer);
    layer_rows[l] = layer_step[l] == step ? std::max(layer_rows[l], n) : n;
    layer_step[l] = step;
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < k; ++c) {
        const int64_t v = ids.get(r * cols + c);
        const bool ok = real_id(v);
        const size_t at = dev_at(layer, r, c);
        dev_ids[at] = ok ? v : device_no_expert;
        if (!ok && v != -1) ++invalid;
        if (ok && has_histogram) ++histogram[static_cast<size_t>(layer * experts + v)];
        if (w != nullptr) dev_w[at] = round_weight(w->getf(r * cols + c));
      }
  }

  // Element i of a top-k kernel's output in `layer`'s view, as the device dtype stored it.
  void kernel_writes(int32_t layer, int64_t i, int64_t stored) { dev_ids[dev_at(layer, i / k, i % k)] = stored; }

  // Whether entry (src, slot) of a commit reaches a slot; counts the ones
  // out of range. Slot -1 drops quietly.
  bool reaches(int64_t src, int64_t slot) {
    if (slot == -1) return false;
    if (slot < -1 || slot >= slots || src < 0 || src >= rows) {
      ++skipped;
      return false;
    }
    return true;
  }

  void consume_row(int64_t src) {
    for (int64_t e = 0; e < row; ++e) {
      const size_t at = dev_at(e / k, src, e % k);
      dev_ids[at] = device_no_expert;
      dev_w[at] = 0.0f;
    }
  }

  // commit of `count` entries: source row src_rows[j] (or src_start + j) to
  // slot slots[j], in list order.
  void commit(int64_t count, const Tensor* src_rows, int64_t src_start, const Tensor& dst) {
    auto source = [&](int64_t j) { return src_rows ? src_rows->get(j) : src_start + j; };
    for (int64_t j = 0; j < count; ++j) {
      const int64_t slot = dst.get(j), src = source(j);
      if (!reaches(src, slot)) continue;
      bool bad = false;
      for (int64_t e = 0; e < row; ++e) {
        const size_t from = dev_at(e / k, src, e % k);
        const bool fresh = written(e / k, src);  // a row a layer did not write this step has no routing
        const int64_t v = fresh ? dev_ids[from] : device_no_expert;
        const bool ok = real_id(v);
        bad = bad || !ok;
        if (!ok && v != device_no_expert) ++invalid;  // a bad id a kernel wrote into a layer view
        host_ids[host_at(slot, e)] = ok ? v : kNoExpert;
        if (weight_elem >= 0) host_w[host_at(slot, e)] = fresh ? dev_w[from] : 0.0f;
      }
      states[static_cast<size_t>(slot)] = static_cast<uint8_t>(MOECAP_SLOT_VALID | (bad ? MOECAP_SLOT_INVALID_IDS : 0));
    }
    committed = true;  // the next capture starts a step (an empty commit too)
    // Once every entry was read, each source row named (slot -1 and skipped
    // slots too) is consumed: it holds no routing until written again.
    for (int64_t j = 0; j < count; ++j) {
      const int64_t src = source(j);
      if (src >= 0 && src < rows) consume_row(src);
    }
  }

  // invalidate reads no source row: only its slots are checked.
  void invalidate(int64_t count, const Tensor& dst) {
    for (int64_t j = 0; j < count; ++j) {
      const int64_t slot = dst.get(j);
      if (slot == -1) continue;
      if (slot < -1 || slot >= slots) {
        ++skipped;
        continue;
      }
      states[static_cast<size_t>(slot)] = MOECAP_SLOT_EMPTY;
    }
  }

  void write(int64_t count, const Tensor& dst, const Tensor& ids, const Tensor& w) {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t slot = dst.get(i);
      int64_t none = 0;
      for (int64_t e = 0; e < row; ++e) {
        const int64_t v = ids.get(i * row + e);
        none += v == -1 ? 1 : 0;
        host_ids[host_at(slot, e)] = v == -1 ? kNoExpert : v;
        if (weight_elem >= 0) host_w[host_at(slot, e)] = round_weight(w.getf(i * row + e));
      }
      states[static_cast<size_t>(slot)] =
          none == row ? static_cast<uint8_t>(MOECAP_SLOT_EMPTY)
                      : static_cast<uint8_t>(MOECAP_SLOT_VALID | (none > 0 ? MOECAP_SLOT_INVALID_IDS : 0));
    }
  }
};

Tensor fuzz_ids(Input& in, const Model& m, int64_t max_rows) {
  const int64_t n = in.range(0, max_rows + 1);
  const int64_t choice = in.range(0, 3);
  const int64_t cols = choice == 0 ? m.k : choice == 1 ? m.k + 1 : m.k + in.range(0, 3);
  Tensor t({n, cols}, kIdTypes[in.range(0, 4)]);
  for (int64_t i = 0; i < n * cols; ++i) {
    const uint8_t b = in.byte();
    t.set(i, b < 8 ? static_cast<int64_t>(b) - 4 + (b & 1) * m.experts : b % m.experts);
  }
  return t;
}

Tensor fuzz_slots(Input& in, int64_t n, int64_t limit, bool bad) {
  Tensor t({n}, in.range(0, 1) ? DLDataType{kDLInt, 64, 1} : DLDataType{kDLInt, 32, 1});
  for (int64_t i = 0; i < n; ++i) t.set(i, bad && in.range(0, 15) == 0 ? in.range(-3, limit + 2) : in.range(-1, limit - 1));
  return t;
}

// A config as a caller of some ABI version passes it: the bytes live in a
// buffer with room for a newer caller's unknown tail.
struct CallerConfig {
  moecap_config c;
  uint64_t tail;
};

CallerConfig fuzz_config(Input& in) {
  CallerConfig cc{};
  moecap_config& c = cc.c;
  c.struct_size = sizeof c;
  REQUIRE(moecap_config_init(&c) == MOECAP_OK);
  c.abi_version = in.range(0, 31) == 0 ? (2u << 16) : MOECAP_ABI_VERSION;
  const int64_t flag_bits = in.range(0, 15);
  c.flags = static_cast<uint32_t>((flag_bits & 1 ? MOECAP_FLAG_HISTOGRAM : 0) | (flag_bits & 2 ? MOECAP_FLAG_GUARDS : 0) |
                                  (flag_bits == 15 ? 0x80 : 0));
  c.num_layers = static_cast<int32_t>(in.range(0, 4));
  c.top_k = static_cast<int32_t>(in.range(0, 4));
  c.extra_columns = in.range(0, 63) == 0 ? INT32_MAX - static_cast<int32_t>(in.range(0, 4))
                                          : static_cast<int32_t>(in.range(-1, 2));
  static const int32_t experts[] = {1, 2, 4, 8, 200, 255, 256, 300};
  c.num_experts = experts[in.range(0, 7)];
  c.dp_size = static_cast<int32_t>(in.range(0, 4));
  c.verify_tokens = static_cast<int32_t>(in.range(0, 3));
  c.max_running_requests = in.range(0, 8);
  c.chunked_prefill_size = in.range(-1, 8);
  c.max_graph_batch = in.range(0, 4);
  c.max_batch_tokens = in.range(0, 8);
  c.host_slots = in.range(0, 32);
  c.id_dtype = static_cast<int32_t>(in.range(0, 5));
  c.device_id_dtype = static_cast<int32_t>(in.range(0, 5));
  c.weight_dtype = static_cast<int32_t>(in.range(0, 4));
  c.device_type = in.range(0, 15) == 0 ? MOECAP_DEVICE_CUDA : MOECAP_DEVICE_HOST;
  static const int dummy = 0;
  if (in.range(0, 31) == 0) c.next = &dummy;  // no extension is defined: refused
  // The caller's ABI: 1.0 (fields after device_id unseen), one field short,
  // current, a newer caller with a zero or a set tail, or nonsense.
  switch (in.range(0, 15)) {
    case 0: c.struct_size = MOECAP_CONFIG_SIZE_1_0; break;
    case 1: c.struct_size = offsetof(moecap_config, reserved); break;
    case 2: c.struct_size = sizeof cc; break;
    case 3:
      c.struct_size = sizeof cc;
      cc.tail = 1;
      break;
    case 4: c.struct_size = static_cast<size_t>(in.range(0, MOECAP_CONFIG_SIZE_1_0)); break;
    default: c.struct_size = sizeof c; break;
  }
  return cc;
}

// What the library saw of the caller's config: its bytes, defaults past its struct_size.
moecap_config config_as_seen(const CallerConfig& caller) {
  moecap_config config = caller.c;
  if (config.struct_size < sizeof config) {
    moecap_config defaults{};
    defaults.struct_size = sizeof defaults;
    REQUIRE(moecap_config_init(&defaults) == MOECAP_OK);
    std::memcpy(reinterpret_cast<char*>(&config) + config.struct_size,
                reinterpret_cast<const char*>(&defaults) + config.struct_size, sizeof config - config.struct_size);
  }
  REQUIRE(caller.tail == 0 || caller.c.struct_size <= sizeof(moecap_config));
  return config;
}

// The model of a capturer just created from `config`, sized by its plan.
Model model_of(moecap_capturer* h, const CallerConfig& caller, const moecap_config& config) {
  moecap_plan_info plan{};
  plan.struct_size = sizeof plan;
  REQUIRE(moecap_get_plan(h, &plan) == MOECAP_OK);
  // A device_id_dtype past the caller's struct_size was never read: AUTO's choice.
  if (caller.c.struct_size <= offsetof(moecap_config, device_id_dtype)) {
    REQUIRE(plan.device_id_dtype == (config.num_experts <= 32768 ? MOECAP_IDS_I16 : MOECAP_IDS_I32));
  }
  Model m;
  m.rows = plan.device_rows;
  m.slots = config.host_slots;
  m.layers = config.num_layers;
  m.k = config.top_k;
  m.row = plan.row_elements;
  m.experts = config.num_experts;
  auto elem_of = [](int32_t id_dtype) {
    return id_dtype == MOECAP_IDS_U8    ? moecap::kU8
           : id_dtype == MOECAP_IDS_U16 ? moecap::kU16
           : id_dtype == MOECAP_IDS_I16 ? moecap::kI16
                                        : moecap::kI32;
  };
  m.device_elem = elem_of(plan.device_id_dtype);
  m.host_elem = elem_of(plan.id_dtype);
  const bool device_unsigned = m.device_elem == moecap::kU8 || m.device_elem == moecap::kU16;
  m.device_no_expert = device_unsigned ? (int64_t{1} << (8 * plan.device_id_bytes)) - 1 : -1;
  REQUIRE(m.device_no_expert < 0 || m.device_no_expert >= m.experts);  // the plan keeps it apart from the ids
  const bool host_unsigned = plan.id_dtype == MOECAP_IDS_U8 || plan.id_dtype == MOECAP_IDS_U16;
  m.no_expert_is_id = host_unsigned && (int64_t{1} << (8 * plan.id_bytes)) == m.experts;
  m.weight_elem = config.weight_dtype == MOECAP_WEIGHTS_F32    ? moecap::kF32
                  : config.weight_dtype == MOECAP_WEIGHTS_BF16 ? moecap::kBF16
                  : config.weight_dtype == MOECAP_WEIGHTS_F16  ? moecap::kF16
                                                               : -1;
  m.has_histogram = (config.flags & MOECAP_FLAG_HISTOGRAM) != 0;
  m.start();
  return m;
}

bool tracing() {
  static const bool on = std::getenv("MOECAP_FUZZ_TRACE") != nullptr;
  return on;
}

// One fuzzed run: the input, the capturer under test and its model.
struct Run {
  Input& in;
  moecap_capturer* h;
  Model& m;
  const moecap_config& config;
  std::vector<uint8_t> before;  // every buffer byte and counter before the current call
};

// Each op_* below decodes one call from the input, makes it, checks what
// the call returned, and applies a success to the model. The caller checks
// that a failure changed nothing.

moecap_status op_capture(Run& r) {
  Input& in = r.in;
  Model& m = r.m;
  const int32_t layer = static_cast<int32_t>(in.range(-1, m.layers));
  Tensor ids = fuzz_ids(in, m, m.rows);
  const bool with_w = in.range(0, 3) != 0;
  const bool wider_w = in.range(0, 15) == 0;  // weights of another shape than the ids: refused
  const DLDataType w_type = kFloatTypes[in.range(0, 3)];
  Tensor w({ids.shape[0], ids.shape[1] + (wider_w ? 1 : 0)}, w_type);
  for (int64_t i = 0; i < w.shape[0] * w.shape[1]; ++i) w.setf(i, static_cast<float>(in.byte()) / 37.0f);
  int64_t strides[2] = {1, ids.shape[0]};
  if (in.range(0, 15) == 0 && ids.shape[0] > 1) ids.t.strides = strides;
  const moecap_status s = moecap_capture(r.h, layer, &ids.t, with_w ? &w.t : nullptr, nullptr);
  if (s == MOECAP_OK) m.capture(layer, ids, m.weight_elem >= 0 ? &w : nullptr);
  return s;
}

// A commit of a contiguous range of rows, or of a row list.
moecap_status op_commit(Run& r) {
  Input& in = r.in;
  Model& m = r.m;
  const int64_t count = in.range(0, m.rows + 1);
  Tensor slots = fuzz_slots(in, count, m.slots, true);
  const bool list = in.range(0, 1) != 0;
  Tensor rows({count}, DLDataType{kDLInt, 64, 1});
  for (int64_t i = 0; i < count; ++i) rows.set(i, in.range(0, 31) == 0 ? m.rows : in.range(0, m.rows - 1));
  const int64_t start = in.range(-1, m.rows);
  moecap_commit_args a{sizeof a, start, list ? &rows.t : nullptr, &slots.t};
  const moecap_status s = moecap_commit(r.h, &a, nullptr);
  if (s == MOECAP_OK) m.commit(count, list ? &rows : nullptr, start, slots);
  return s;
}

moecap_status op_read(Run& r) {
  Input& in = r.in;
  const Model& m = r.m;
  const int64_t t = in.range(0, 6);
  Tensor slots = fuzz_slots(in, t, m.slots, true);
  static const DLDataType outs[] = {{kDLInt, 32, 1}, {kDLInt, 64, 1}, {kDLUInt, 8, 1}, {kDLInt, 16, 1}};
  Tensor out({t, m.layers, m.k}, outs[in.range(0, 3)]);
  Tensor wout({t, m.layers, m.k}, DLDataType{kDLFloat, 32, 1});
  std::memset(out.bytes.data(), 0x5a, out.bytes.size());
  const std::vector<uint8_t> untouched = out.bytes;
  const bool with_w = in.range(0, 1) != 0;
  const bool strict = in.range(0, 3) == 0;
  const moecap_status s =
      moecap_read(r.h, &slots.t, &out.t, with_w ? &wout.t : nullptr, strict ? MOECAP_READ_STRICT : 0, nullptr);
  if (s != MOECAP_OK) {
    REQUIRE(out.bytes == untouched);
    if (s == MOECAP_ERROR_NO_ROUTING) {
      REQUIRE(strict);
      bool some_unusable = false;
      for (int64_t i = 0; i < t; ++i) some_unusable |= m.states[static_cast<size_t>(slots.get(i))] != MOECAP_SLOT_VALID;
      REQUIRE(some_unusable);
    }
    return s;
  }
  // A successful unsigned read without STRICT: all ones is no expert id.
  if (!strict && out.t.dtype.code == kDLUInt) REQUIRE((int64_t{1} << out.t.dtype.bits) > m.experts);
  for (int64_t i = 0; i < t; ++i) {
    if (strict) REQUIRE(m.states[static_cast<size_t>(slots.get(i))] == MOECAP_SLOT_VALID);
    for (int64_t e = 0; e < m.row; ++e) {
      Tensor probe({1}, out.t.dtype);
      probe.set(0, m.read_id(slots.get(i), e));  // the caller's dtype truncates -1 the same way
      REQUIRE(out.get(i * m.row + e) == probe.get(0));
      if (with_w) REQUIRE(wout.getf(i * m.row + e) == m.read_weight(slots.get(i), e));
    }
  }
  return s;
}

moecap_status op_write(Run& r) {
  Input& in = r.in;
  Model& m = r.m;
  const int64_t t = in.range(0, 4);
  Tensor slots = fuzz_slots(in, t, m.slots, true);
  Tensor ids({t, m.layers, m.k}, in.range(0, 1) ? DLDataType{kDLInt, 32, 1} : DLDataType{kDLInt, 64, 1});
  Tensor w({t, m.layers, m.k}, DLDataType{kDLFloat, 32, 1});
  for (int64_t i = 0; i < t * m.row; ++i) {
    const uint8_t b = in.byte();
    ids.set(i, b == 0 ? m.experts : b == 1 ? -1 : b == 2 ? -2 : b % m.experts);
    w.setf(i, static_cast<float>(b) / 16.0f);
  }
  const moecap_status s = moecap_write(r.h, &slots.t, &ids.t, m.weight_elem >= 0 ? &w.t : nullptr, nullptr);
  if (s == MOECAP_OK) m.write(t, slots, ids, w);
  return s;
}

moecap_status op_local_rows(Run& r) {
  Input& in = r.in;
  const Model& m = r.m;
  std::vector<int64_t> tokens(static_cast<size_t>(in.range(0, r.config.dp_size + 1)));
  for (int64_t& t : tokens) t = in.range(-1, m.rows);
  moecap_batch b{sizeof b, static_cast<int32_t>(in.range(0, 2)), static_cast<int32_t>(in.range(-1, r.config.dp_size)),
                 static_cast<int32_t>(tokens.size()), 0, tokens.data(), in.range(0, m.rows + 1)};
  moecap_rows rows{};
  rows.struct_size = sizeof rows;
  const moecap_status s = moecap_local_rows(r.h, &b, &rows);
  if (s == MOECAP_OK) {
    REQUIRE(rows.start >= 0 && rows.count >= 0);
    REQUIRE(rows.start + rows.count <= m.rows);
    REQUIRE(rows.total <= m.rows);
    // EAGER packs the ranks back to back; GRAPH puts rank r at r * padded.
    REQUIRE(rows.count == tokens[static_cast<size_t>(b.dp_rank)]);
    int64_t before = 0, total = 0;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (static_cast<int32_t>(i) < b.dp_rank) before += tokens[i];
      total += tokens[i];
    }
    if (b.mode == MOECAP_BATCH_EAGER) {
      REQUIRE(rows.start == before && rows.total == total);
    } else {
      REQUIRE(rows.start == b.dp_rank * b.padded_tokens_per_rank);
      REQUIRE(rows.total == r.config.dp_size * b.padded_tokens_per_rank);
    }
  }
  return s;
}

// Export of any buffer (or nonsense) as a versioned or legacy view, then its release.
moecap_status op_export(Run& r) {
  Input& in = r.in;
  DLManagedTensorVersioned* v = nullptr;
  DLManagedTensor* legacy = nullptr;
  const int32_t which = static_cast<int32_t>(in.range(0, 9));
  const int32_t layer = static_cast<int32_t>(in.range(-1, r.m.layers));
  const moecap_status s =
      in.range(0, 1) ? moecap_export(r.h, which, layer, &v) : moecap_export_legacy(r.h, which, layer, &legacy);
  if (s == MOECAP_OK) {
    const DLTensor& t = v ? v->dl_tensor : legacy->dl_tensor;
    REQUIRE(t.byte_offset == 0 && t.strides != nullptr && t.shape != nullptr);
    if (v) v->deleter(v);
    if (legacy) legacy->deleter(legacy);
  } else {
    REQUIRE(v == nullptr && legacy == nullptr);
  }
  return s;
}

// A graph records a capture, a commit and maybe an invalidate; the inputs
// change after recording; the replay must act on the new contents.
moecap_status op_graph(Run& r) {
  Input& in = r.in;
  Model& m = r.m;
  Tensor ids = fuzz_ids(in, m, m.rows);
  const int64_t count = in.range(0, m.rows);
  Tensor slots = fuzz_slots(in, count, m.slots, false);
  const int32_t layer = static_cast<int32_t>(in.range(0, m.layers - 1));
  Tensor w({ids.shape[0], ids.shape[1]}, DLDataType{kDLFloat, 32, 1});
  REQUIRE(moecap_graph_begin(r.h, nullptr) == MOECAP_OK);
  const moecap_status cs = moecap_capture(r.h, layer, &ids.t, m.weight_elem >= 0 ? &w.t : nullptr, nullptr);
  moecap_commit_args a{sizeof a, 0, nullptr, &slots.t};
  const moecap_status ms = moecap_commit(r.h, &a, nullptr);
  Tensor freed = fuzz_slots(in, in.range(0, 3), m.slots, false);
  const bool with_invalidate = in.range(0, 1) != 0;
  const moecap_status is = with_invalidate ? moecap_invalidate(r.h, &freed.t, nullptr) : MOECAP_ERROR_INTERNAL;
  moecap_graph* g = nullptr;
  REQUIRE(moecap_graph_end(r.h, &g) == MOECAP_OK);
  REQUIRE(moecap_test::snapshot(r.h) == r.before);  // recording ran nothing
  for (int64_t i = 0; i < ids.shape[0] * ids.shape[1]; ++i) {
    const uint8_t b = in.byte();
    ids.set(i, b < 4 ? -1 : b % m.experts);
    w.setf(i, static_cast<float>(b) / 8.0f);
  }
  for (int64_t i = 0; i < count; ++i) slots.set(i, in.range(0, 15) == 0 ? m.slots + 1 : in.range(-1, m.slots - 1));
  for (int64_t i = 0; i < freed.shape[0]; ++i) freed.set(i, in.range(0, 15) == 0 ? -2 : in.range(-1, m.slots - 1));
  REQUIRE(moecap_graph_launch(g, nullptr) == MOECAP_OK);
  if (tracing()) {
    std::fprintf(stderr, "fuzz_abi: recorded capture %s, commit %s, invalidate %s\n", moecap_status_name(cs),
                 moecap_status_name(ms), with_invalidate ? moecap_status_name(is) : "not called");
  }
  if (cs == MOECAP_OK) m.capture(layer, ids, m.weight_elem >= 0 ? &w : nullptr);
  if (ms == MOECAP_OK) m.commit(count, nullptr, 0, slots);
  if (is == MOECAP_OK) m.invalidate(freed.shape[0], freed);
  REQUIRE(moecap_graph_destroy(g) == MOECAP_OK);
  return MOECAP_OK;
}

moecap_status op_errors(Run& r) {
  Model& m = r.m;
  moecap_error_counts e{};
  e.struct_size = sizeof e;
  const bool clear = r.in.range(0, 1) != 0;
  const moecap_status s = moecap_get_errors(r.h, &e, clear ? MOECAP_ERRORS_CLEAR : 0);
  REQUIRE(s == MOECAP_OK);
  REQUIRE(e.skipped_rows == m.skipped);
  REQUIRE(e.invalid_ids == m.invalid);
  if (clear) m.skipped = m.invalid = 0;
  return s;
}

// The engine freed these slots' KV.
moecap_status op_invalidate(Run& r) {
  const int64_t count = r.in.range(0, r.m.slots + 1);
  Tensor slots = fuzz_slots(r.in, count, r.m.slots, true);
  const moecap_status s = moecap_invalidate(r.h, &slots.t, nullptr);
  if (s == MOECAP_OK) r.m.invalidate(count, slots);
  return s;
}

// A top-k kernel writes one layer's ids straight into its exported view,
// bad values included.
moecap_status op_layer_view(Run& r) {
  Input& in = r.in;
  Model& m = r.m;
  const int32_t layer = static_cast<int32_t>(in.range(0, m.layers - 1));
  DLManagedTensorVersioned* v = nullptr;
  REQUIRE(moecap_export(r.h, MOECAP_BUFFER_LAYER_IDS, layer, &v) == MOECAP_OK);
  REQUIRE(v->dl_tensor.ndim == 2 && v->dl_tensor.strides[0] == m.k && v->dl_tensor.strides[1] == 1);
  const int64_t n = in.range(0, m.rows);
  for (int64_t i = 0; i < n * m.k; ++i) {
    const uint8_t b = in.byte();
    const int64_t id = b < 8 ? static_cast<int64_t>(b) - 4 + (b & 1) * m.experts : b % m.experts;
    moecap::store_int(v->dl_tensor.data, m.device_elem, i, id);
    m.kernel_writes(layer, i, moecap::load_int(v->dl_tensor.data, m.device_elem, i));
  }
  v->deleter(v);
  return MOECAP_OK;
}

moecap_status op_histogram_reset(Run& r) {
  const moecap_status s = moecap_histogram_reset(r.h, nullptr);
  REQUIRE((s == MOECAP_OK) == r.m.has_histogram);
  if (s == MOECAP_OK) std::fill(r.m.histogram.begin(), r.m.histogram.end(), 0);
  return s;
}

// A view of one of the capturer's buffers, released at scope exit.
class View {
 public:
  View(moecap_capturer* h, int32_t which) { status_ = moecap_export(h, which, 0, &v_); }
  ~View() {
    if (v_ != nullptr) v_->deleter(v_);
  }
  View(const View&) = delete;
  View& operator=(const View&) = delete;
  moecap_status status() const { return status_; }
  const void* data() const { return v_->dl_tensor.data; }
  int64_t elements() const {
    int64_t n = 1;
    for (int32_t d = 0; d < v_->dl_tensor.ndim; ++d) n *= v_->dl_tensor.shape[d];
    return n;
  }

 private:
  DLManagedTensorVersioned* v_ = nullptr;
  moecap_status status_;
};

// Element i of `view` (of dtype `elem`) is `expected`, truncated to the
// dtype as a store would (-1 becomes all ones in an unsigned one).
bool same_int(const View& view, int32_t elem, int64_t i, int64_t expected) {
  uint8_t want[8];
  moecap::store_int(want, elem, 0, expected);
  return moecap::load_int(view.data(), elem, i) == moecap::load_int(want, elem, 0);
}

// Bit for bit: weights are copied, never recomputed, after their first rounding.
bool same_weight(const View& view, int32_t elem, int64_t i, float expected) {
  uint8_t want[4];
  moecap::store_float(want, elem, 0, expected);
  const int64_t bytes = moecap::elem_bytes(elem);
  return std::memcmp(static_cast<const uint8_t*>(view.data()) + i * bytes, want, static_cast<size_t>(bytes)) == 0;
}

// After every call, the buffers and counters, through moecap's own exports,
// hold what the model says: a disagreement shows at the call that caused
// it, not only when a read happens to look. Only what the ABI documents is
// compared: every device id (capture's and commit's "no routing" code
// included), every slot state, the histogram and both counters; weights
// where the id beside them is a real one; the host ids and weights of the
// slots a read returns as stored (not an EMPTY slot's leftovers, nor the
// weight kept behind an id that reads -1).
void check_buffers(const Run& r) {
  const Model& m = r.m;
  {
    View states(r.h, MOECAP_BUFFER_HOST_STATES);
    REQUIRE(states.status() == MOECAP_OK && states.elements() == m.slots);
    REQUIRE(std::memcmp(states.data(), m.states.data(), m.states.size()) == 0);
  }
  {
    View ids(r.h, MOECAP_BUFFER_DEVICE_IDS);
    REQUIRE(ids.status() == MOECAP_OK && ids.elements() == static_cast<int64_t>(m.dev_ids.size()));
    for (size_t i = 0; i < m.dev_ids.size(); ++i) REQUIRE(same_int(ids, m.device_elem, static_cast<int64_t>(i), m.dev_ids[i]));
    if (m.weight_elem >= 0) {
      View w(r.h, MOECAP_BUFFER_DEVICE_WEIGHTS);
      REQUIRE(w.status() == MOECAP_OK);
      for (size_t i = 0; i < m.dev_w.size(); ++i) {
        if (m.real_id(m.dev_ids[i])) REQUIRE(same_weight(w, m.weight_elem, static_cast<int64_t>(i), m.dev_w[i]));
      }
    }
  }
  {
    View ids(r.h, MOECAP_BUFFER_HOST_IDS);
    REQUIRE(ids.status() == MOECAP_OK && ids.elements() == static_cast<int64_t>(m.host_ids.size()));
    std::unique_ptr<View> w;
    if (m.weight_elem >= 0) {
      w = std::make_unique<View>(r.h, MOECAP_BUFFER_HOST_WEIGHTS);
      REQUIRE(w->status() == MOECAP_OK);
    }
    for (int64_t slot = 0; slot < m.slots; ++slot) {
      if (!m.readable(slot)) continue;
      for (int64_t e = 0; e < m.row; ++e) {
        const size_t at = m.host_at(slot, e);
        REQUIRE(same_int(ids, m.host_elem, static_cast<int64_t>(at), m.host_ids[at]));
        if (w && m.host_ids[at] != kNoExpert) {
          REQUIRE(same_weight(*w, m.weight_elem, static_cast<int64_t>(at), m.host_w[at]));
        }
      }
    }
  }
  moecap_error_counts e{};
  e.struct_size = sizeof e;
  REQUIRE(moecap_get_errors(r.h, &e, 0) == MOECAP_OK);
  REQUIRE(e.skipped_rows == m.skipped);
  REQUIRE(e.invalid_ids == m.invalid);
  // Last: without a histogram this export fails, and its message would hide the call's own.
  {
    View hist(r.h, MOECAP_BUFFER_HISTOGRAM);
    REQUIRE(hist.status() == (m.has_histogram ? MOECAP_OK : MOECAP_ERROR_INVALID_ARGUMENT));
    if (hist.status() == MOECAP_OK) {
      REQUIRE(std::memcmp(hist.data(), m.histogram.data(), m.histogram.size() * 8) == 0);
    }
  }
}

struct OpKind {
  const char* name;
  moecap_status (*run)(Run&);
  bool settles;  // waits for commits first, so it fails with ROWS_SKIPPED while rows were skipped
};

// The first byte of each call picks its kind from this table (commit twice
// as often as the rest). The table's order and length are part of the
// corpus's encoding: appending a kind re-maps every seed.
const OpKind kOps[] = {
    {"capture", op_capture, false},          {"commit", op_commit, false},
    {"commit", op_commit, false},            {"read", op_read, true},
    {"write", op_write, true},               {"local_rows", op_local_rows, false},
    {"export", op_export, false},            {"graph", op_graph, false},
    {"get_errors", op_errors, false},        {"histogram_reset", op_histogram_reset, false},
    {"invalidate", op_invalidate, false},    {"layer_view", op_layer_view, false},
};
constexpr int64_t kOpCount = sizeof kOps / sizeof kOps[0];

// One call, decoded from the input and checked.
void step(Run& r, int index) {
  r.before = moecap_test::snapshot(r.h);
  const OpKind& op = kOps[r.in.range(0, kOpCount - 1)];
  const moecap_status s = op.run(r);
  if (tracing()) {
    std::fprintf(stderr, "fuzz_abi: op %d %s: %s%s%s\n", index, op.name, moecap_status_name(s), s != MOECAP_OK ? ": " : "",
                 s != MOECAP_OK ? moecap_last_error() : "");
  }
  if (s != MOECAP_OK) {
    REQUIRE(moecap_last_error()[0] != '\0');
    REQUIRE(moecap_test::snapshot(r.h) == r.before);
  }
  // Skipped rows fail every later read and write, and only they fail a
  // call with ROWS_SKIPPED, until get_errors clears the count.
  if (s == MOECAP_ERROR_ROWS_SKIPPED) REQUIRE(op.settles && r.m.skipped > 0);
  if (s == MOECAP_OK && op.settles) REQUIRE(r.m.skipped == 0);
  check_buffers(r);
}

// A read of every slot must match the model exactly.
void check_final_read(moecap_capturer* h, const Model& m) {
  Tensor all({m.slots}, DLDataType{kDLInt, 64, 1});
  for (int64_t i = 0; i < m.slots; ++i) all.set(i, i);
  Tensor out({m.slots, m.layers, m.k}, DLDataType{kDLInt, 64, 1});
  const moecap_status s = moecap_read(h, &all.t, &out.t, nullptr, 0, nullptr);
  REQUIRE(s == MOECAP_OK || (s == MOECAP_ERROR_ROWS_SKIPPED && m.skipped > 0));
  if (s == MOECAP_OK) {
    for (int64_t i = 0; i < m.slots * m.row; ++i) REQUIRE(out.get(i) == m.read_id(i / m.row, i % m.row));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  setenv("MOECAP_LIBCUDA", "/nonexistent/libcuda.so.1", 1);  // CUDA configs fail cleanly, never touch a GPU
  const CallerConfig caller = fuzz_config(in);
  moecap_capturer* h = nullptr;
  if (moecap_create(&caller.c, &h) != MOECAP_OK) {
    REQUIRE(h == nullptr);
    REQUIRE(moecap_last_error()[0] != '\0');
    return 0;
  }
  const moecap_config config = config_as_seen(caller);
  Model m = model_of(h, caller, config);
  Run run{in, h, m, config, {}};
  for (int op = 0; op < 48 && !in.done(); ++op) step(run, op);
  check_final_read(h, m);
  REQUIRE(moecap_destroy(h) == MOECAP_OK);
  return 0;
}
