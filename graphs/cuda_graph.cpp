// SPDX-License-Identifier: Apache-2.0
#include "graphs/cuda_graph.h"

#include <utility>

#include "base/cuda_owners.h"
#include "base/status.h"

namespace moecap::cuda {
namespace {

class CudaGraph final : public BackendGraph {
 public:
  CudaGraph(const Driver& d, CUcontext ctx, UniqueGraph graph, UniqueGraphExec exec)
      : d_(d), ctx_(ctx), graph_(std::move(graph)), exec_(std::move(exec)) {}
  // Any stream, the legacy default stream too (torch's default stream):
  // only capturing one is refused, and a replay is no capture.
  void launch(EngineStream stream) override {
    ContextScope scope(d_, ctx_);
    check(d_, d_.cuGraphLaunch(exec_.get(), cu_stream(stream)), "cuGraphLaunch");
  }
  void* native() override { return graph_.get(); }

 private:
  const Driver& d_;
  CUcontext ctx_;
  UniqueGraph graph_;     // declared first: the exec made from it goes first
  UniqueGraphExec exec_;
};

}  // namespace

// Relaxed: moecap_graph_end may come from another thread, and the capture
// never makes another thread's host calls fail (nor do they invalidate it).
void begin_graph(const Driver& d, CUstream stream) {
  check(d, d.cuStreamBeginCapture(stream, kCaptureModeRelaxed), "cuStreamBeginCapture");
}

std::unique_ptr<BackendGraph> end_graph(const Driver& d, CUcontext ctx, CUstream stream) {
  CUgraph captured = nullptr;
  check(d, d.cuStreamEndCapture(stream, &captured), "cuStreamEndCapture");
  UniqueGraph graph(d, ctx, captured);
  CUgraphExec exec = nullptr;
  check(d, d.cuGraphInstantiateWithFlags(&exec, graph.get(), 0), "cuGraphInstantiateWithFlags");
  return std::make_unique<CudaGraph>(d, ctx, std::move(graph), UniqueGraphExec(d, ctx, exec));
}

}  // namespace moecap::cuda
