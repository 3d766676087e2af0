/* SPDX-License-Identifier: Apache-2.0 */
// One capturer per model per engine process: owns the plan, the backend and
// every buffer, validates each operation completely before any of it runs.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "base/stream.h"
#include "moecap.h"
#include "plugin/backend.h"
#include "plugin/plan.h"

namespace moecap {

struct HostView;

// A non-owning description of one exportable buffer.
struct BufferView {
  void* data;
  DLDevice device;
  DLDataType dtype;
  int32_t ndim;
  int64_t shape[3];  // compact row-major: strides follow from the shape
  int64_t strides[3];
};

class Capturer {
 public:
  explicit Capturer(const Plan& plan);
  ~Capturer();
  Capturer(const Capturer&) = delete;
  Capturer& operator=(const Capturer&) = delete;

  const Plan& plan() const { return plan_; }
  // Graphs that bake this capturer's memory (the engine's captures, moecap's
  // own graphs and their clones) keep `self`, its owner, alive.
  void set_owner(const std::shared_ptr<Capturer>& self) { backend_->set_owner(self); }
  std::mutex& mutex() { return mutex_; }

  void capture(int32_t layer, const DLTensor* ids, const DLTensor* weights, EngineStream stream);
  // Calls that may block on the host take `lock`, the caller's hold on
  // mutex(), which the backend releases while it sleeps (LockHold).
  void commit(const moecap_commit_args* args, EngineStream stream, std::unique_lock<std::mutex>* lock = nullptr);
  void invalidate(const DLTensor* slots, EngineStream stream, std::unique_lock<std::mutex>* lock = nullptr);
  // MOECAP_FLAG_SIDE_STREAM: `stream` waits for the work forked so far.
  void join(EngineStream stream);
  // Before a moecap graph replays on `stream`: eager forked work (an
  // invalidate of a slot the replay commits to) runs on another stream than
  // the replay's branch, so the branch must fork after it.
  void join_before_replay(EngineStream stream);
  void read(const DLTensor* slots, DLTensor* ids_out, DLTensor* weights_out, uint32_t flags, EngineStream stream,
            std::unique_lock<std::mutex>* lock = nullptr);
  void write(const DLTensor* slots, const DLTensor* ids, const DLTensor* weights, EngineStream stream,
             std::unique_lock<std::mutex>* lock = nullptr);
  void synchronize(std::unique_lock<std::mutex>* lock = nullptr);
  // Runs (host) or waits for (CUDA) every commit and side-stream call still
  // pending, raising nothing: what destroy owes the caller's tensors.
  void finish_work(std::unique_lock<std::mutex>* lock) noexcept;
  moecap_error_counts errors(bool clear, std::unique_lock<std::mutex>* lock = nullptr);
  void histogram_reset(EngineStream stream);
  BufferView view(int32_t which, int32_t layer) const;

  void graph_begin(EngineStream stream);
  std::unique_ptr<BackendGraph> graph_end();
  bool recording() const { return recording_; }

  // Guard canaries: the first overwritten region, or nullptr. Device
  // regions cost a copy on CUDA, so the capture path leaves them out.
  const char* damaged_guard(bool device_regions);

 private:
  struct Region {
    const char* name;
    size_t offset;
    size_t bytes;
  };

  // Host-side waits (synchronize, errors) take no stream: only moecap's own recording forbids them.
  void require_not_recording() const;
  void require_not_capturing(EngineStream stream);
  // A commit or invalidation's parameters, without its index tensors.
  CommitParams commit_params(int32_t mode) const;
  // read's outputs, checked: dtype, shape [t, num_layers, top_k], placement.
  struct ReadOutputs;
  ReadOutputs check_read_outputs(DLTensor* ids_out, DLTensor* weights_out, int64_t t, bool strict) const;
  // MOECAP_READ_STRICT: fails with NO_ROUTING unless every slot is plainly valid.
  void require_routing(const DLTensor* slots) const;
  std::string why_no_routing(int64_t slot) const;
  // Argument placement: refuses a tensor the kernels cannot read in place.
  void require_kernel_readable(const DLTensor* t, const char* name) const;
  // Refuses a tensor the host cannot read now.
  static void require_host_memory(const DLTensor* t, const char* name);
  // A commit's index tensor: true when it is host memory whose values the
  // backend copies at the call (eager commits, pinned memory too: the engine
  // may refill it before the stream runs the commit), false when kernels read
  // it in place (device memory). In a graph on CUDA host memory is refused,
  // pinned too: a replay would read the values the host holds then, which an
  // engine refilling its pinned lists for the next step changes under it.
  // Foreign devices are refused.
  bool staged_index(const DLTensor* t, const char* name, bool graph) const;
  // Requires [rows, num_layers, top_k]: the shape of a request's rows.
  void check_request_rows(const DLTensor* t, const char* name, int64_t rows, const char* rows_from) const;
  // Refuses a caller tensor whose bytes meet the host cache (ids, weights, states).
  void require_outside_host_cache(const DLTensor* t, const char* name) const;
  // Refuses a caller tensor whose bytes meet the device block: it is
  // moecap's, and the call writes there (rows, histogram, stamps; a commit
  // consumes the rows it reads), so such an argument could change under the
  // call (a layer view shifted by a row smears rows over themselves). The one
  // exception, for a capture (`own` non-null): a tensor starting at `own`,
  // the very rows it writes in their stored dtype and width, which a top-k
  // kernel may have filled through a layer view; each is copied onto itself.
  void require_outside_device_block(const DLTensor* t, const char* name, const void* own) const;
  void require_stream(EngineStream stream);
  // Waits for the commits that may write `slots` (all when nullptr), then
  // fails with ROWS_SKIPPED while the counter is set.
  void settle(bool block, const Backend::SlotList* slots, std::unique_lock<std::mutex>* lock);
  // ROWS_SKIPPED while the counter is set; CORRUPTION for a damaged guard.
  void check_counters();
  // Fails with OUT_OF_RANGE naming the first index tensor entry outside [allow_drop ? -1 : 0, limit).
  void check_host_slots(const DLTensor* slots, const char* name, bool allow_drop, int64_t limit) const;
  void write_guards();
  void check_guards(bool device_regions);
  HostView host_view(const DLTensor* t, const char* name, EngineStream stream);
  bool on_host() const { return plan_.config.device_type == MOECAP_DEVICE_HOST; }
  // The step record in the device block: the word, then one stamp per layer.
  StepWord* step_word() const { return reinterpret_cast<StepWord*>(device_block_ + step_word_.offset); }
  LayerStamp* layer_stamps() const { return reinterpret_cast<LayerStamp*>(step_word() + 1); }

  Plan plan_;
  std::unique_ptr<Backend> backend_;
  std::mutex mutex_;
  bool guards_ = false;
  uint8_t* device_block_ = nullptr;
  uint8_t* host_block_ = nullptr;
  uint8_t* host_block_on_device_ = nullptr;  // the host cache as kernels address it
  Region device_ids_{}, device_weights_{}, histogram_{}, error_word_{}, step_word_{};
  Region host_ids_{}, host_weights_{}, host_states_{};
  bool recording_ = false;
  EngineStream recording_stream_ = EngineStream::legacy_default();
};

}  // namespace moecap
