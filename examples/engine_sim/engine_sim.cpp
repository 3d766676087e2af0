// SPDX-License-Identifier: Apache-2.0
// engine_sim: a simulated MoE serving engine that loads libmoecap.so with
// dlopen, as a real engine would, and serves thousands of requests on one
// engine process per attention-DP rank: chunked prefill mixed with decode,
// padded graph decode (moecap graphs replayed), speculative verify with a
// random number of accepted tokens at non-contiguous rows (tree acceptance),
// prefix reuse of cached slots, slot reuse after requests finish (freed slots
// are invalidated), prefill/decode disaggregation through read and write, and
// "fused top-k kernels" that write some layers' ids straight into moecap's
// exported layer views (int16, no moecap_capture for those layers). The router is a
// deterministic function of the token prefix, so every finished request's
// rows are checked against the truth. Exits non-zero on any mismatch.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "device_memory.h"
#include "moecap.h"

namespace sim {

struct Options {
  int32_t dp_size = 4;
  int32_t layers = 8;
  int32_t top_k = 4;
  int32_t experts = 64;
  int32_t extra_columns = 1;  // one fused shared expert, captured and dropped
  int32_t verify_tokens = 4;
  int64_t requests = 10000;
  int64_t max_running = 32;
  int64_t chunk = 256;
  int64_t max_graph_batch = 32;
  int64_t prompt_max = 96;
  int64_t output_max = 48;
  int32_t prefix_share_pct = 30;
  int32_t disaggregated_pct = 10;
  int32_t kernel_layers = -1;  // layers whose top-k kernel writes moecap's view; -1: half
  uint64_t seed = 1;
  std::string backend = "auto";
  std::string library = MOECAP_DEFAULT_LIBRARY;
  bool graphs = true;
  bool undersize = false;
  bool side_stream = false;  // MOECAP_FLAG_SIDE_STREAM, joined once per step after the commits
  bool late_join = false;    // debug: join only after the next step wrote its routing
};

void usage() {
  std::printf(
      "usage: engine_sim [--dp-size N] [--layers N] [--top-k N] [--experts N] [--extra-columns N]\n"
      "                  [--verify-tokens N] [--requests N] [--max-running N] [--chunk N]\n"
      "                  [--max-graph-batch N] [--prefix-share PCT] [--disaggregated PCT] [--seed N]\n"
      "                  [--kernel-layers N]  (layers written through moecap's exported views; default half)\n"
      "                  [--backend auto|host|cuda] [--no-graphs] [--library PATH]\n"
      "                  [--undersize]  (debug: a deliberately undersized plan; must fail cleanly)\n"
      "                  [--side-stream]  (capture and commit forked off the engine's stream, joined per step)\n"
      "                  [--late-join]  (debug: with --side-stream, join after the next step's routing\n"
      "                                  is written: breaks the contract; must show mismatches)\n");
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) throw std::runtime_error("missing value after " + a);
      return argv[++i];
    };
    auto num = [&] { return std::strtoll(next(), nullptr, 10); };
    if (a == "--dp-size") o.dp_size = static_cast<int32_t>(num());
    else if (a == "--layers") o.layers = static_cast<int32_t>(num());
    else if (a == "--top-k") o.top_k = static_cast<int32_t>(num());
    else if (a == "--experts") o.experts = static_cast<int32_t>(num());
    else if (a == "--extra-columns") o.extra_columns = static_cast<int32_t>(num());
    else if (a == "--verify-tokens") o.verify_tokens = static_cast<int32_t>(num());
    else if (a == "--requests") o.requests = num();
    else if (a == "--max-running") o.max_running = num();
    else if (a == "--chunk") o.chunk = num();
    else if (a == "--max-graph-batch") o.max_graph_batch = num();
    else if (a == "--prefix-share") o.prefix_share_pct = static_cast<int32_t>(num());
    else if (a == "--disaggregated") o.disaggregated_pct = static_cast<int32_t>(num());
    else if (a == "--kernel-layers") o.kernel_layers = static_cast<int32_t>(num());
    else if (a == "--seed") o.seed = static_cast<uint64_t>(num());
    else if (a == "--backend") o.backend = next();
    else if (a == "--library") o.library = next();
    else if (a == "--no-graphs") o.graphs = false;
    else if (a == "--undersize") o.undersize = true;
    else if (a == "--side-stream") o.side_stream = true;
    else if (a == "--late-join") o.late_join = true;
    else if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else {
      throw std::runtime_error("unknown flag " + a);
    }
  }
  if (o.dp_size < 1 || o.layers < 1 || o.top_k < 1 || o.experts < o.top_k || o.verify_tokens < 1 ||
      o.requests < 1 || o.max_running < 1 || o.chunk < 1 || o.max_graph_batch < 0) {
    throw std::runtime_error("flags out of range (see --help)");
  }
  if (o.kernel_layers < 0) o.kernel_layers = o.layers / 2;
  if (o.kernel_layers > o.layers) throw std::runtime_error("--kernel-layers exceeds --layers");
  if (o.late_join && !o.side_stream) throw std::runtime_error("--late-join needs --side-stream");
  return o;
}

// --- moecap, loaded as an engine loads it -------------------------------------

// A moecap call failed: the simulation stops and reports it (exit code 3).
struct Refused : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Moecap {
 public:
  explicit Moecap(const std::string& path) {
    lib_ = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib_ == nullptr) throw std::runtime_error(std::string("cannot load ") + path + ": " + dlerror());
    auto get = reinterpret_cast<moecap_status (*)(moecap_api*)>(dlsym(lib_, "moecap_get_api"));
    if (get == nullptr) throw std::runtime_error(path + " has no moecap_get_api");
    api_.struct_size = sizeof api_;
    if (get(&api_) != MOECAP_OK || (api_.abi_version >> 16) != MOECAP_ABI_VERSION_MAJOR) {
      throw std::runtime_error(path + ": incompatible moecap ABI");
    }
  }
  const moecap_api* operator->() const { return &api_; }

  void check(moecap_status s, const char* what) const {
    if (s != MOECAP_OK) {
      // last_error already names the function; `what` says which of the engine's calls it was.
      throw Refused(std::string(api_.last_error()) + " [" + api_.status_name(s) + ", in " + what + "]");
    }
  }

 private:
  void* lib_ = nullptr;
  moecap_api api_{};
};

// --- the model: routing as a function of the token prefix ------------------------

uint64_t mix(uint64_t h, uint64_t v) {
  uint64_t x = h ^ (v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2));
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

int32_t route(uint64_t prefix_hash, int32_t layer, int32_t k, int32_t experts) {
  return static_cast<int32_t>(mix(prefix_hash, static_cast<uint64_t>(layer) * 64 + static_cast<uint64_t>(k)) %
                              static_cast<uint64_t>(experts));
}

constexpr int32_t kVocab = 50000;

struct Request {
  int64_t id = 0;
  int64_t prompt_len = 0;
  int64_t target_len = 0;  // prompt + output positions whose rows get committed
  std::vector<int32_t> tokens;
  std::vector<uint64_t> hash;  // hash[p]: the prefix up to and including p
  std::vector<int64_t> slots;  // one per computed position
  int64_t computed = 0;
  int64_t shared = 0;          // positions reused from a donor's cache
  bool disaggregated = false;
};

// Extends `r` to target_len tokens: generated tokens follow from the prefix.
void generate_tail(Request& r, std::mt19937_64& rng) {
  while (static_cast<int64_t>(r.tokens.size()) < r.target_len) {
    const int64_t p = static_cast<int64_t>(r.tokens.size());
    const uint64_t prev = p == 0 ? 0 : r.hash[static_cast<size_t>(p - 1)];
    const int32_t t = p < r.prompt_len ? static_cast<int32_t>(rng() % kVocab)
                                       : static_cast<int32_t>(mix(prev, 7) % kVocab);
    r.tokens.push_back(t);
    r.hash.push_back(mix(prev, static_cast<uint64_t>(t)));
  }
}

// --- one rank's engine state ------------------------------------------------------

class SlotPool {
 public:
  explicit SlotPool(int64_t slots) : refs_(static_cast<size_t>(slots), 0) {
    for (int64_t s = slots - 1; s >= 1; --s) free_.push_back(s);  // slot 0: the padding slot
  }
  bool empty() const { return free_.empty(); }
  size_t available() const { return free_.size(); }
  int64_t take() {
    const int64_t s = free_.back();
    free_.pop_back();
    refs_[static_cast<size_t>(s)] = 1;
    return s;
  }
  void share(int64_t s) { ++refs_[static_cast<size_t>(s)]; }
  // True when the slot became free (no request holds it any more).
  bool release(int64_t s) {
    if (--refs_[static_cast<size_t>(s)] != 0) return false;
    free_.push_back(s);
    return true;
  }

 private:
  std::vector<int32_t> refs_;
  std::vector<int64_t> free_;
};

struct GraphBuffers {
  moecap_graph* graph = nullptr;
  void* rows = nullptr;   // [padded] int64 device rows (accepted tokens)
  void* slots = nullptr;  // [padded] int64 slots, -1 for rejected drafts and padding
};

struct Rank {
  int32_t index = 0;
  moecap_capturer* cap = nullptr;
  std::vector<DLManagedTensorVersioned*> layer_views;  // [kernel_layers]: what the fused kernels write
  std::unique_ptr<SlotPool> pool;
  std::vector<std::unique_ptr<Request>> running;
  std::deque<std::unique_ptr<Request>> cache;  // finished requests whose slots serve prefix reuse
  std::map<int64_t, GraphBuffers> graphs;      // by padded tokens per rank
};

// One row of a forward batch on one rank.
struct Row {
  uint64_t hash;        // what the router sees
  Request* req;         // nullptr: padding
  int64_t pos;          // position in req
  bool commit;          // false: a rejected draft
};

struct Stats {
  int64_t served = 0, tokens = 0, rows_checked = 0, mismatches = 0, prefill_steps = 0, graph_steps = 0,
          eager_decode_steps = 0, replays = 0, shared_positions = 0, disaggregated = 0, old_overflow_steps = 0,
          max_rows_used = 0, kernel_writes = 0, invalidated = 0;
};

class Engine {
 public:
  Engine(const Options& o, Moecap& mc) : o_(o), mc_(mc), rng_(o.seed) {
    bool cuda = o.backend == "cuda";
    if (o.backend == "auto") {
      void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
      auto init = lib ? reinterpret_cast<int (*)(unsigned)>(dlsym(lib, "cuInit")) : nullptr;
      int count = 0;
      auto devices = lib ? reinterpret_cast<int (*)(int*)>(dlsym(lib, "cuDeviceGetCount")) : nullptr;
      cuda = init != nullptr && devices != nullptr && init(0) == 0 && devices(&count) == 0 && count > 0;
    }
    mem_ = std::make_unique<DeviceMemory>(cuda);
    stream_ = mem_->stream();
    host_slots_ = 1 + o.max_running * (o.prompt_max + o.output_max + o.verify_tokens) * 3;

    config_ = moecap_config{};
    config_.struct_size = sizeof config_;
    mc_.check(mc_->config_init(&config_), "moecap_config_init");
    if (o.side_stream) config_.flags |= MOECAP_FLAG_SIDE_STREAM;
    config_.num_layers = o.layers;
    config_.top_k = o.top_k;
    config_.extra_columns = o.extra_columns;
    config_.num_experts = o.experts;
    config_.dp_size = o.dp_size;
    config_.verify_tokens = o.verify_tokens;
    config_.max_running_requests = o.max_running;
    config_.chunked_prefill_size = o.chunk;
    config_.max_graph_batch = o.graphs ? o.max_graph_batch : 0;
    // Mixed batches carry decode tokens on top of a full prefill chunk.
    config_.max_batch_tokens = o.chunk + o.max_running;
    config_.host_slots = host_slots_;
    config_.device_type = cuda ? MOECAP_DEVICE_CUDA : MOECAP_DEVICE_HOST;
    // What the fused top-k kernels write: int16, as FlashInfer's routing-replay output.
    config_.device_id_dtype = MOECAP_IDS_I16;
    if (o.undersize) {
      // The shipped bugs' sizing: no verify headroom, no mixed-batch term.
      config_.verify_tokens = 1;
      config_.max_batch_tokens = 0;
      config_.max_graph_batch = 0;
    }
    moecap_plan_info plan{};
    plan.struct_size = sizeof plan;
    mc_.check(mc_->plan(&config_, &plan), "moecap_plan");
    plan_ = plan;

    ranks_.resize(static_cast<size_t>(o.dp_size));
    for (int32_t r = 0; r < o.dp_size; ++r) {
      Rank& rank = ranks_[static_cast<size_t>(r)];
      rank.index = r;
      mc_.check(mc_->create(&config_, &rank.cap), "moecap_create");
      rank.pool = std::make_unique<SlotPool>(host_slots_);
      // Layer views: graph-stable addresses, taken once, handed to the kernels as out=.
      for (int32_t l = 0; l < o.kernel_layers; ++l) {
        DLManagedTensorVersioned* v = nullptr;
        mc_.check(mc_->export_versioned(rank.cap, MOECAP_BUFFER_LAYER_IDS, l, &v), "moecap_export (layer view)");
        rank.layer_views.push_back(v);
        const DLTensor& t = v->dl_tensor;
        if (t.ndim != 2 || t.strides[0] != o.top_k || t.strides[1] != 1 || t.dtype.bits != 16) {
          throw std::runtime_error("engine_sim: the layer view is not a compact int16 [rows, top_k] tensor");
        }
      }
    }
    // The prefill instance of prefill/decode disaggregation: its own engine, one rank.
    moecap_config pc = config_;
    pc.dp_size = 1;
    pc.host_slots = o.prompt_max + 1;
    pc.chunked_prefill_size = std::max(o.chunk, o.prompt_max);
    mc_.check(mc_->create(&pc, &prefill_instance_), "moecap_create (prefill instance)");

    // The engine's own router outputs hold its largest gathered batch, whatever moecap planned.
    const int64_t engine_rows =
        o.dp_size * std::max({o.chunk + o.max_running, o.max_running * o.verify_tokens,
                              o.max_graph_batch * o.verify_tokens, o.prompt_max});
    const size_t cols = static_cast<size_t>(o.top_k + o.extra_columns);
    for (int32_t l = 0; l < o.layers; ++l) layer_ids_.push_back(mem_->allocate(static_cast<size_t>(engine_rows) * cols * 4));
    host_ids_.resize(static_cast<size_t>(engine_rows) * cols);
    for (int64_t g = 1; g <= config_.max_graph_batch; g *= 2) graph_sizes_.push_back(g);
    if (config_.max_graph_batch > 0 && graph_sizes_.back() != config_.max_graph_batch) {
      graph_sizes_.push_back(config_.max_graph_batch);
    }
  }

  ~Engine() {
    for (Rank& r : ranks_) {
      for (auto& [padded, g] : r.graphs) mc_->graph_destroy(g.graph);
      for (DLManagedTensorVersioned* v : r.layer_views) v->deleter(v);
      mc_->destroy(r.cap);
    }
    mc_->destroy(prefill_instance_);
  }

  void run() {
    const auto t0 = std::chrono::steady_clock::now();
    while (stats_.served < o_.requests) {
      admit();
      const bool prefill = std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) {
        return std::any_of(r.running.begin(), r.running.end(),
                           [](const auto& q) { return q->computed < q->prompt_len; });
      });
      int64_t most = 0;
      for (const Rank& r : ranks_) most = std::max<int64_t>(most, static_cast<int64_t>(r.running.size()));
      if (most == 0) continue;
      if (prefill) {
        eager_step(/*verify=*/false);
      } else if (o_.graphs && most <= config_.max_graph_batch) {
        graph_step(most);
      } else {
        eager_step(/*verify=*/true);
      }
      // The end of the forward: before anything writes the routing buffers,
      // the layer views or the graphs' slot lists again (the side stream's contract).
      if (!o_.late_join) join_all();
      finish();
    }
    seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  void report() const {
    const double row32 = 4.0 * o_.layers * o_.top_k;
    const int64_t old_rows = std::max<int64_t>(o_.chunk * o_.dp_size, o_.max_running);
    std::printf("engine_sim: backend %s, dp_size %d, %d layers, top-%d of %d experts (+%d fused), verify %d\n",
                mem_->cuda() ? "cuda" : "host", o_.dp_size, o_.layers, o_.top_k, o_.experts, o_.extra_columns,
                o_.verify_tokens);
    std::printf("  requests served      %lld\n", static_cast<long long>(stats_.served));
    std::printf("  tokens committed     %lld\n", static_cast<long long>(stats_.tokens));
    std::printf("  rows checked         %lld\n", static_cast<long long>(stats_.rows_checked));
    std::printf("  mismatches           %lld\n", static_cast<long long>(stats_.mismatches));
    std::printf("  steps                %lld eager prefill/mixed, %lld graph decode (%lld replays), %lld eager decode\n",
                static_cast<long long>(stats_.prefill_steps), static_cast<long long>(stats_.graph_steps),
                static_cast<long long>(stats_.replays), static_cast<long long>(stats_.eager_decode_steps));
    std::printf("  prefix reuse         %lld positions from cached slots\n",
                static_cast<long long>(stats_.shared_positions));
    std::printf("  disaggregated        %lld requests prefilled elsewhere (read -> write)\n",
                static_cast<long long>(stats_.disaggregated));
    std::printf("  kernel layers        %d of %d layers written by the top-k kernel into moecap's int16 views "
                "(%lld kernel writes), the rest via moecap_capture\n",
                o_.kernel_layers, o_.layers, static_cast<long long>(stats_.kernel_writes));
    std::printf("  invalidated slots    %lld freed KV slots emptied with moecap_invalidate\n",
                static_cast<long long>(stats_.invalidated));
    std::printf("  device rows          %lld planned, %lld used at most; the old sizing had %lld and would have "
                "overflowed in %lld steps\n",
                static_cast<long long>(plan_.device_rows), static_cast<long long>(stats_.max_rows_used),
                static_cast<long long>(old_rows), static_cast<long long>(stats_.old_overflow_steps));
    std::printf("  memory per rank      device %.2f MiB, host %.2f MiB (%d-byte ids); int32 layout: device %.2f MiB, "
                "host %.2f MiB\n",
                static_cast<double>(plan_.device_bytes) / (1 << 20), static_cast<double>(plan_.host_bytes) / (1 << 20),
                plan_.id_bytes, static_cast<double>(old_rows) * row32 / (1 << 20),
                static_cast<double>(host_slots_) * row32 / (1 << 20));
    std::printf("  throughput           %.0f tokens/s, %.0f requests/s (%.2f s)\n",
                static_cast<double>(stats_.tokens) / seconds_, static_cast<double>(stats_.served) / seconds_, seconds_);
  }

  int64_t mismatches() const { return stats_.mismatches; }

 private:
  std::mt19937_64 request_rng(int64_t id) const { return std::mt19937_64(o_.seed * 1000003u + static_cast<uint64_t>(id)); }

  // Requests join ranks round-robin while they have room; some reuse a cached
  // prefix, some arrive already prefilled by another instance.
  void admit() {
    // A request may need a slot for every position; keep room for all running ones.
    const size_t room = static_cast<size_t>(o_.prompt_max + o_.output_max + o_.verify_tokens) *
                        static_cast<size_t>(o_.max_running);
    for (Rank& rank : ranks_) {
      // Arrivals come in bursts: a rank refills once half its batch finished,
      // so decode-only stretches (graphs, speculation) alternate with prefill.
      if (static_cast<int64_t>(rank.running.size()) > o_.max_running / 2) continue;
      while (static_cast<int64_t>(rank.running.size()) < o_.max_running && next_id_ < o_.requests) {
        while (rank.pool->available() <= room && !rank.cache.empty()) evict(rank, false);
        if (rank.pool->available() <= room) break;
        auto req = std::make_unique<Request>();
        req->id = next_id_++;
        std::mt19937_64 rng = request_rng(req->id);
        req->prompt_len = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(o_.prompt_max));
        req->target_len = req->prompt_len + 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(o_.output_max));
        const Request* donor = pick_donor(rank, rng);
        if (donor != nullptr && static_cast<int32_t>(rng() % 100) < o_.prefix_share_pct) {
          const int64_t most = std::min(donor->computed, req->prompt_len - 1);
          if (most >= 1) {
            const int64_t p = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(most));
            req->tokens.assign(donor->tokens.begin(), donor->tokens.begin() + p);
            req->hash.assign(donor->hash.begin(), donor->hash.begin() + p);
            for (int64_t i = 0; i < p; ++i) {
              req->slots.push_back(donor->slots[static_cast<size_t>(i)]);
              rank.pool->share(donor->slots[static_cast<size_t>(i)]);
            }
            req->computed = req->shared = p;
            stats_.shared_positions += p;
          }
        }
        generate_tail(*req, rng);
        if (req->shared == 0 && static_cast<int32_t>(rng() % 100) < o_.disaggregated_pct) prefill_elsewhere(rank, *req);
        rank.running.push_back(std::move(req));
      }
    }
  }

  const Request* pick_donor(const Rank& rank, std::mt19937_64& rng) const {
    const size_t n = rank.cache.size() + rank.running.size();
    if (n == 0) return nullptr;
    const size_t i = static_cast<size_t>(rng() % n);
    return i < rank.cache.size() ? rank.cache[i].get() : rank.running[i - rank.cache.size()].get();
  }

  // Disaggregation: a prefill instance computes the prompt; its rows travel
  // with moecap_read there and moecap_write here, into this rank's slots.
  void prefill_elsewhere(Rank& rank, Request& req) {
    const int64_t n = req.prompt_len;
    const int32_t cols = o_.top_k + o_.extra_columns;
    std::vector<int32_t> ids(static_cast<size_t>(n * cols));
    for (int32_t l = 0; l < o_.layers; ++l) {
      for (int64_t i = 0; i < n; ++i)
        for (int32_t k = 0; k < cols; ++k)
          ids[static_cast<size_t>(i * cols + k)] =
              k < o_.top_k ? route(req.hash[static_cast<size_t>(i)], l, k, o_.experts) : o_.experts + k - o_.top_k;
      mem_->upload(layer_ids_[static_cast<size_t>(l)], ids.data(), ids.size() * 4);
      int64_t shape[2] = {n, cols};
      DLTensor t{layer_ids_[static_cast<size_t>(l)], mem_->device(), 2, {kDLInt, 32, 1}, shape, nullptr, 0};
      mc_.check(mc_->capture(prefill_instance_, l, &t, nullptr, stream_), "moecap_capture (prefill instance)");
    }
    std::vector<int64_t> there(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) there[static_cast<size_t>(i)] = 1 + i;
    int64_t sshape[1] = {n};
    DLTensor st{there.data(), {kDLCPU, 0}, 1, {kDLInt, 64, 1}, sshape, nullptr, 0};
    moecap_commit_args a{sizeof a, 0, nullptr, &st};
    mc_.check(mc_->commit(prefill_instance_, &a, stream_), "moecap_commit (prefill instance)");
    std::vector<int32_t> rows(static_cast<size_t>(n * o_.layers * o_.top_k));
    int64_t rshape[3] = {n, o_.layers, o_.top_k};
    DLTensor rt{rows.data(), {kDLCPU, 0}, 3, {kDLInt, 32, 1}, rshape, nullptr, 0};
    mc_.check(mc_->read(prefill_instance_, &st, &rt, nullptr, 0, nullptr), "moecap_read (prefill instance)");
    std::vector<int64_t> here(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) here[static_cast<size_t>(i)] = rank.pool->take();
    DLTensor ht{here.data(), {kDLCPU, 0}, 1, {kDLInt, 64, 1}, sshape, nullptr, 0};
    mc_.check(mc_->write(rank.cap, &ht, &rt, nullptr, nullptr), "moecap_write");
    req.slots = here;
    req.computed = n;
    req.disaggregated = true;
    ++stats_.disaggregated;
  }

  // Router output for the gathered batch, one layer: [rows, top_k + extra].
  void route_layer(const std::vector<Row>& gathered, int32_t layer) {
    const int32_t cols = o_.top_k + o_.extra_columns;
    for (size_t i = 0; i < gathered.size(); ++i)
      for (int32_t k = 0; k < cols; ++k)
        host_ids_[i * static_cast<size_t>(cols) + static_cast<size_t>(k)] =
            k < o_.top_k ? route(gathered[i].hash, layer, k, o_.experts) : o_.experts + k - o_.top_k;
  }

  uint64_t garbage() { return rng_(); }

  // Positions of one decode/verify block: row 0 is the request's next
  // position; accepted drafts sit at random later rows (tree acceptance).
  void verify_block(Request& r, int32_t width, std::vector<Row>& rows) {
    const int64_t left = r.target_len - r.computed;
    const int32_t accept = static_cast<int32_t>(1 + rng_() % static_cast<uint64_t>(std::min<int64_t>(width, left)));
    std::vector<int32_t> picked(static_cast<size_t>(width - 1));
    for (int32_t i = 0; i < width - 1; ++i) picked[static_cast<size_t>(i)] = i + 1;
    std::shuffle(picked.begin(), picked.end(), rng_);
    picked.resize(static_cast<size_t>(accept - 1));
    std::sort(picked.begin(), picked.end());
    const size_t base = rows.size();
    for (int32_t i = 0; i < width; ++i) rows.push_back(Row{garbage(), nullptr, 0, false});
    rows[base] = Row{r.hash[static_cast<size_t>(r.computed)], &r, r.computed, true};
    for (int32_t j = 0; j < accept - 1; ++j) {
      const int64_t pos = r.computed + 1 + j;
      rows[base + static_cast<size_t>(picked[static_cast<size_t>(j)])] = Row{r.hash[static_cast<size_t>(pos)], &r, pos, true};
    }
  }

  // Eager step: prefill chunks (plus plain decode tokens: a mixed batch), or
  // speculative verify too large for the graphs. Ranks packed back to back.
  void eager_step(bool verify) {
    std::vector<std::vector<Row>> local(ranks_.size());
    for (size_t r = 0; r < ranks_.size(); ++r) {
      int64_t budget = o_.chunk;
      for (auto& q : ranks_[r].running) {
        if (q->computed < q->prompt_len) {
          const int64_t take = std::min(budget, q->prompt_len - q->computed);
          for (int64_t p = q->computed; p < q->computed + take; ++p)
            local[r].push_back(Row{q->hash[static_cast<size_t>(p)], q.get(), p, true});
          budget -= take;
        } else if (verify) {
          verify_block(*q, o_.verify_tokens, local[r]);
        } else {
          local[r].push_back(Row{q->hash[static_cast<size_t>(q->computed)], q.get(), q->computed, true});
        }
      }
    }
    std::vector<int64_t> tokens(ranks_.size());
    std::vector<Row> gathered;
    for (size_t r = 0; r < ranks_.size(); ++r) {
      tokens[r] = static_cast<int64_t>(local[r].size());
      gathered.insert(gathered.end(), local[r].begin(), local[r].end());
    }
    note_rows(static_cast<int64_t>(gathered.size()));
    upload_layers(gathered);
    const int32_t cols = o_.top_k + o_.extra_columns;
    for (size_t r = 0; r < ranks_.size(); ++r) {
      Rank& rank = ranks_[r];
      moecap_batch batch{sizeof batch, MOECAP_BATCH_EAGER, rank.index, o_.dp_size, 0, tokens.data(), 0};
      moecap_rows rows{};
      rows.struct_size = sizeof rows;
      mc_.check(mc_->local_rows(rank.cap, &batch, &rows), "moecap_local_rows");
      int64_t shape[2] = {rows.total, cols};
      run_kernels(rank, gathered);
      for (int32_t l = o_.kernel_layers; l < o_.layers; ++l) {
        DLTensor t{layer_ids_[static_cast<size_t>(l)], mem_->device(), 2, {kDLInt, 32, 1}, shape, nullptr, 0};
        mc_.check(mc_->capture(rank.cap, l, &t, nullptr, stream_), "moecap_capture");
      }
      // Host slot and row lists: the backend stages them where it must.
      std::vector<int64_t> slots, src;
      bool all_commit = true;
      for (size_t i = 0; i < local[r].size(); ++i) {
        const Row& row = local[r][i];
        all_commit = all_commit && row.commit;
        slots.push_back(row.commit ? assign_slot(rank, *row.req, row.pos) : -1);
        src.push_back(rows.start + static_cast<int64_t>(i));
      }
      int64_t n[1] = {static_cast<int64_t>(slots.size())};
      DLTensor st{slots.data(), {kDLCPU, 0}, 1, {kDLInt, 64, 1}, n, nullptr, 0};
      DLTensor rt{src.data(), {kDLCPU, 0}, 1, {kDLInt, 64, 1}, n, nullptr, 0};
      // A prefill (all rows kept) commits a contiguous range; a verify, a row list.
      moecap_commit_args a{sizeof a, rows.start, all_commit ? nullptr : &rt, &st};
      mc_.check(mc_->commit(rank.cap, &a, stream_), "moecap_commit");
      advance(local[r]);
    }
    ++(verify ? stats_.eager_decode_steps : stats_.prefill_steps);
  }

  // Graph step: every rank decodes (with verify) in the same padded graph size.
  void graph_step(int64_t most_running) {
    const int64_t g = *std::lower_bound(graph_sizes_.begin(), graph_sizes_.end(), most_running);
    const int64_t padded = g * o_.verify_tokens;
    std::vector<std::vector<Row>> local(ranks_.size());
    std::vector<int64_t> tokens(ranks_.size());
    std::vector<Row> gathered;
    for (size_t r = 0; r < ranks_.size(); ++r) {
      for (auto& q : ranks_[r].running) verify_block(*q, o_.verify_tokens, local[r]);
      tokens[r] = static_cast<int64_t>(local[r].size());
      while (static_cast<int64_t>(local[r].size()) < padded) local[r].push_back(Row{garbage(), nullptr, 0, false});
      gathered.insert(gathered.end(), local[r].begin(), local[r].end());
    }
    note_rows(static_cast<int64_t>(gathered.size()));
    upload_layers(gathered);
    for (size_t r = 0; r < ranks_.size(); ++r) {
      Rank& rank = ranks_[r];
      moecap_batch batch{sizeof batch, MOECAP_BATCH_GRAPH, rank.index, o_.dp_size, 0, tokens.data(), padded};
      moecap_rows rows{};
      rows.struct_size = sizeof rows;
      mc_.check(mc_->local_rows(rank.cap, &batch, &rows), "moecap_local_rows");
      GraphBuffers& gb = graph_for(rank, padded, rows.start);
      std::vector<int64_t> slots(static_cast<size_t>(padded), -1), src(static_cast<size_t>(padded));
      for (int64_t i = 0; i < padded; ++i) {
        const Row& row = local[r][static_cast<size_t>(i)];
        src[static_cast<size_t>(i)] = rows.start + i;
        if (row.commit) slots[static_cast<size_t>(i)] = assign_slot(rank, *row.req, row.pos);
      }
      mem_->upload(gb.rows, src.data(), src.size() * 8);
      mem_->upload(gb.slots, slots.data(), slots.size() * 8);
      run_kernels(rank, gathered);  // the engine's graph: its kernels, then moecap's replay
      mc_.check(mc_->graph_launch(gb.graph, stream_), "moecap_graph_launch");
      ++stats_.replays;
      advance(local[r]);
    }
    ++stats_.graph_steps;
  }

  // Records this rank's graph for a padded size once: capture of every layer
  // from the engine's static router outputs, then a row-list commit.
  GraphBuffers& graph_for(Rank& rank, int64_t padded, int64_t start) {
    auto it = rank.graphs.find(padded);
    if (it != rank.graphs.end()) return it->second;
    GraphBuffers gb;
    gb.rows = mem_->allocate(static_cast<size_t>(padded) * 8);
    gb.slots = mem_->allocate(static_cast<size_t>(padded) * 8);
    const int32_t cols = o_.top_k + o_.extra_columns;
    int64_t shape[2] = {padded * o_.dp_size, cols};
    int64_t n[1] = {padded};
    mc_.check(mc_->graph_begin(rank.cap, stream_), "moecap_graph_begin");
    for (int32_t l = o_.kernel_layers; l < o_.layers; ++l) {
      DLTensor t{layer_ids_[static_cast<size_t>(l)], mem_->device(), 2, {kDLInt, 32, 1}, shape, nullptr, 0};
      mc_.check(mc_->capture(rank.cap, l, &t, nullptr, stream_), "moecap_capture (recording)");
    }
    DLTensor rt{gb.rows, mem_->device(), 1, {kDLInt, 64, 1}, n, nullptr, 0};
    DLTensor st{gb.slots, mem_->device(), 1, {kDLInt, 64, 1}, n, nullptr, 0};
    moecap_commit_args a{sizeof a, start, &rt, &st};
    mc_.check(mc_->commit(rank.cap, &a, stream_), "moecap_commit (recording)");
    mc_.check(mc_->graph_end(rank.cap, &gb.graph), "moecap_graph_end");
    return rank.graphs.emplace(padded, gb).first->second;
  }

  // The fused top-k kernels of the first kernel_layers layers: each writes its
  // [rows, top_k] routing (no extra columns) straight into moecap's exported
  // int16 layer view, on the engine's stream. No moecap call at all.
  void run_kernels(Rank& rank, const std::vector<Row>& gathered) {
    kernel_ids_.resize(gathered.size() * static_cast<size_t>(o_.top_k));
    for (int32_t l = 0; l < o_.kernel_layers; ++l) {
      for (size_t i = 0; i < gathered.size(); ++i)
        for (int32_t k = 0; k < o_.top_k; ++k)
          kernel_ids_[i * static_cast<size_t>(o_.top_k) + static_cast<size_t>(k)] =
              static_cast<int16_t>(route(gathered[i].hash, l, k, o_.experts));
      mem_->upload(rank.layer_views[static_cast<size_t>(l)]->dl_tensor.data, kernel_ids_.data(),
                   kernel_ids_.size() * sizeof(int16_t));
      ++stats_.kernel_writes;
    }
  }

  void upload_layers(const std::vector<Row>& gathered) {
    const size_t bytes = gathered.size() * static_cast<size_t>(o_.top_k + o_.extra_columns) * 4;
    for (int32_t l = 0; l < o_.layers; ++l) {
      route_layer(gathered, l);
      mem_->upload(layer_ids_[static_cast<size_t>(l)], host_ids_.data(), bytes);
    }
    if (o_.late_join) join_all();  // too late: the previous step's forked captures read this step's routing
  }

  // moecap_join on every capturer (a no-op without the side stream).
  void join_all() {
    for (Rank& r : ranks_) mc_.check(mc_->join(r.cap, stream_), "moecap_join");
    mc_.check(mc_->join(prefill_instance_, stream_), "moecap_join (prefill instance)");
  }

  void note_rows(int64_t total) {
    stats_.max_rows_used = std::max(stats_.max_rows_used, total);
    if (total > std::max<int64_t>(o_.chunk * o_.dp_size, o_.max_running)) ++stats_.old_overflow_steps;
  }

  int64_t assign_slot(Rank& rank, Request& r, int64_t pos) {
    if (rank.pool->empty()) evict(rank, true);
    const int64_t s = rank.pool->take();
    if (static_cast<int64_t>(r.slots.size()) != pos) throw std::runtime_error("engine_sim: slot order broken");
    r.slots.push_back(s);
    return s;
  }

  void advance(const std::vector<Row>& rows) {
    for (const Row& row : rows) {
      if (row.commit) {
        ++row.req->computed;
        ++stats_.tokens;
      }
    }
  }

  // Finished requests: read their rows, check them, keep them as prefix donors.
  void finish() {
    for (Rank& rank : ranks_) {
      for (auto it = rank.running.begin(); it != rank.running.end();) {
        Request& r = **it;
        if (r.computed < r.target_len) {
          ++it;
          continue;
        }
        check(rank, r);
        ++stats_.served;
        rank.cache.push_back(std::move(*it));
        it = rank.running.erase(it);
      }
      while (rank.cache.size() > 64) evict(rank, false);
    }
  }

  void evict(Rank& rank, bool required) {
    if (rank.cache.empty()) {
      if (required) throw std::runtime_error("engine_sim: out of KV slots");
      return;
    }
    // The engine frees the KV of slots no request holds any more: moecap
    // forgets their routing, so a stale read would show -1, not old experts.
    std::vector<int64_t> freed;
    for (int64_t s : rank.cache.front()->slots)
      if (rank.pool->release(s)) freed.push_back(s);
    int64_t n[1] = {static_cast<int64_t>(freed.size())};
    DLTensor ft{freed.data(), {kDLCPU, 0}, 1, {kDLInt, 64, 1}, n, nullptr, 0};
    mc_.check(mc_->invalidate(rank.cap, &ft, stream_), "moecap_invalidate");
    stats_.invalidated += n[0];
    rank.cache.pop_front();
  }

  void check(Rank& rank, const Request& r) {
    const int64_t n = r.computed;
    int64_t sshape[1] = {n};
    int64_t oshape[3] = {n, o_.layers, o_.top_k};
    std::vector<int32_t> out(static_cast<size_t>(n * o_.layers * o_.top_k));
    DLTensor st{const_cast<int64_t*>(r.slots.data()), {kDLCPU, 0}, 1, {kDLInt, 64, 1}, sshape, nullptr, 0};
    DLTensor ot{out.data(), {kDLCPU, 0}, 3, {kDLInt, 32, 1}, oshape, nullptr, 0};
    // STRICT: a slot of a finished request without committed routing is an error, never -1s to compare.
    mc_.check(mc_->read(rank.cap, &st, &ot, nullptr, MOECAP_READ_STRICT, nullptr), "moecap_read");
    for (int64_t p = 0; p < n; ++p) {
      bool ok = true;
      for (int32_t l = 0; l < o_.layers; ++l)
        for (int32_t k = 0; k < o_.top_k; ++k)
          ok = ok && out[static_cast<size_t>((p * o_.layers + l) * o_.top_k + k)] ==
                         route(r.hash[static_cast<size_t>(p)], l, k, o_.experts);
      if (!ok && stats_.mismatches++ < 5) {
        std::fprintf(stderr, "engine_sim: MISMATCH request %lld position %lld (slot %lld)\n",
                     static_cast<long long>(r.id), static_cast<long long>(p), static_cast<long long>(r.slots[static_cast<size_t>(p)]));
      }
    }
    stats_.rows_checked += n;
  }

  const Options& o_;
  Moecap& mc_;
  std::mt19937_64 rng_;
  std::unique_ptr<DeviceMemory> mem_;
  void* stream_ = nullptr;
  moecap_config config_{};
  moecap_plan_info plan_{};
  int64_t host_slots_ = 0;
  std::vector<Rank> ranks_;
  moecap_capturer* prefill_instance_ = nullptr;
  std::vector<void*> layer_ids_;
  std::vector<int32_t> host_ids_;
  std::vector<int16_t> kernel_ids_;
  std::vector<int64_t> graph_sizes_;
  int64_t next_id_ = 0;
  Stats stats_;
  double seconds_ = 0;
};

}  // namespace sim

int main(int argc, char** argv) {
  try {
    const sim::Options options = sim::parse(argc, argv);
    sim::Moecap moecap(options.library);
    sim::Engine engine(options, moecap);
    engine.run();
    engine.report();
    if (engine.mismatches() != 0) {
      std::fprintf(stderr, "engine_sim: FAILED: %lld mismatched rows\n", static_cast<long long>(engine.mismatches()));
      return 1;
    }
    std::printf("engine_sim: OK: every finished request's routed experts match the truth\n");
    return 0;
  } catch (const sim::Refused& e) {
    std::fprintf(stderr, "engine_sim: moecap refused a call, nothing was corrupted: %s\n", e.what());
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "engine_sim: %s\n", e.what());
    return 2;
  }
}
