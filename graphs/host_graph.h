// The host backend's model of a CUDA graph: operations recorded with every
// parameter baked (pointers, shapes, row offsets, slot-tensor addresses),
// replayed in order against whatever memory holds at replay time. This is
// what lets CPU tests catch "frozen at capture" bugs.
#pragma once

#include <functional>
#include <utility>
#include <vector>

#include "backend.h"

namespace moecap {

class HostGraph final : public BackendGraph {
 public:
  void record(std::function<void()> op) { ops_.push_back(std::move(op)); }
  void launch(void*) override {
    for (const auto& op : ops_) op();
  }
  void* native() override { return nullptr; }

 private:
  std::vector<std::function<void()>> ops_;
};

}  // namespace moecap
