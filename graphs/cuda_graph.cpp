#include "graphs/cuda_graph.h"

#include "base/status.h"

namespace moecap::cuda {
namespace {

class CudaGraph final : public BackendGraph {
 public:
  CudaGraph(const Driver& d, CUcontext ctx, CUgraph graph, CUgraphExec exec)
      : d_(d), ctx_(ctx), graph_(graph), exec_(exec) {}
  ~CudaGraph() override {
    d_.cuGraphExecDestroy(exec_);
    d_.cuGraphDestroy(graph_);
  }
  void launch(void* stream) override {
    if (stream == nullptr) fail(MOECAP_ERROR_INVALID_ARGUMENT, "stream is NULL (the legacy default stream)");
    ContextScope scope(d_, ctx_);
    check(d_, d_.cuGraphLaunch(exec_, static_cast<CUstream>(stream)), "cuGraphLaunch");
  }
  void* native() override { return graph_; }

 private:
  const Driver& d_;
  CUcontext ctx_;
  CUgraph graph_;
  CUgraphExec exec_;
};

}  // namespace

void begin_graph(const Driver& d, CUstream stream) {
  check(d, d.cuStreamBeginCapture(stream, kCaptureModeThreadLocal), "cuStreamBeginCapture");
}

std::unique_ptr<BackendGraph> end_graph(const Driver& d, CUcontext ctx, CUstream stream) {
  CUgraph graph = nullptr;
  check(d, d.cuStreamEndCapture(stream, &graph), "cuStreamEndCapture");
  CUgraphExec exec = nullptr;
  const CUresult r = d.cuGraphInstantiateWithFlags(&exec, graph, 0);
  if (r != kSuccess) {
    d.cuGraphDestroy(graph);
    check(d, r, "cuGraphInstantiateWithFlags");
  }
  return std::make_unique<CudaGraph>(d, ctx, graph, exec);
}

}  // namespace moecap::cuda
