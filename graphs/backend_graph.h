/* SPDX-License-Identifier: Apache-2.0 */
// A recorded, replayable sequence of backend operations: what a moecap_graph
// handle owns. The host backend records a HostGraph (host_graph.h), the CUDA
// backend a captured and instantiated CUgraph (cuda_graph.h).
#pragma once

#include "base/stream.h"

namespace moecap {

class BackendGraph {
 public:
  virtual ~BackendGraph() = default;
  virtual void launch(EngineStream stream) = 0;
  virtual void* native() = 0;  // CUgraph, or nullptr on the host backend
};

}  // namespace moecap
