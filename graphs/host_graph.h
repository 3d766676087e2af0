/* SPDX-License-Identifier: Apache-2.0 */
// The host backend's model of a CUDA graph: operations recorded with every
// parameter baked (pointers, shapes, row offsets, slot-tensor addresses),
// replayed in order against whatever memory holds at replay time. This is
// what lets CPU tests catch "frozen at capture" bugs.
#pragma once

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "graphs/backend_graph.h"

namespace moecap {

class HostGraph final : public BackendGraph {
 public:
  void record(std::function<void()> op) { ops_.push_back(std::move(op)); }
  void launch(EngineStream) override {
    for (const auto& op : ops_) op();
  }
  void* native() override { return nullptr; }

 private:
  std::vector<std::function<void()>> ops_;
};

// Between begin and end, operations are recorded into a HostGraph; outside,
// they run at once (what stream capture does on the CUDA backend).
class HostGraphRecorder {
 public:
  void begin() { recording_ = std::make_unique<HostGraph>(); }
  std::unique_ptr<BackendGraph> end() { return std::move(recording_); }

  template <class Op>
  void run(Op op) {
    if (recording_) {
      recording_->record(op);
    } else {
      op();
    }
  }

 private:
  std::unique_ptr<HostGraph> recording_;
};

}  // namespace moecap
