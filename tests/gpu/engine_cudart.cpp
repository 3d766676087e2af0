// SPDX-License-Identifier: Apache-2.0
// engine_api.h over the real driver, through cudart as an engine reaches it:
// a hold is a host function that spins until released (a long forward).
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "tests/cuda_standin/engine_api.h"

namespace engine {

#define CUDA_OK(call) REQUIRE_MESSAGE((call) == cudaSuccess, #call)

void setup() {}

Stream new_stream() {
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

void* allocate(size_t bytes, DLDeviceType where) {
  void* p = nullptr;
  if (bytes == 0) return p;  // an empty tensor: moecap takes NULL data for zero elements
  if (where == kDLCUDA) {
    CUDA_OK(cudaMalloc(&p, bytes));
    CUDA_OK(cudaMemset(p, 0, bytes));
  } else {
    CUDA_OK(cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped));
    std::memset(p, 0, bytes);
  }
  return p;
}

void release(void* p, DLDeviceType where) {
  if (where == kDLCUDA) {
    cudaFree(p);
  } else {
    cudaFreeHost(p);
  }
}

void upload(void* dst, const void* src, size_t bytes) { CUDA_OK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault)); }
void download(void* dst, const void* src, size_t bytes) { CUDA_OK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault)); }
void sync(Stream s) { CUDA_OK(cudaStreamSynchronize(s)); }
bool busy(Stream s) { return cudaStreamQuery(s) == cudaErrorNotReady; }

// Under compute-sanitizer a held stream can stall the thread that would open
// it (the tool waits for the device at some host calls), so device_check.sh
// sets MOECAP_TEST_HOLD_LIMIT_MS there: a forward that ends by itself. The
// state has two owners, the stream's last host function and release().
struct HoldState {
  std::atomic<bool> open{false};
  std::atomic<int> owners{2};
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
};
namespace {
void drop(HoldState* h) {
  if (h->owners.fetch_sub(1) == 1) delete h;
}
void spin(void* state) {
  auto* h = static_cast<HoldState*>(state);
  while (!h->open.load() && std::chrono::steady_clock::now() < h->deadline) std::this_thread::yield();
}
void drop_state(void* state) { drop(static_cast<HoldState*>(state)); }
}  // namespace
HoldState* hold(Stream s) {
  auto* h = new HoldState;
  if (const char* limit = std::getenv("MOECAP_TEST_HOLD_LIMIT_MS"))
    h->deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::atoll(limit));
  CUDA_OK(cudaLaunchHostFunc(s, &spin, h));
  CUDA_OK(cudaLaunchHostFunc(s, &drop_state, h));
  return h;
}
void release(HoldState* h) {
  h->open = true;
  drop(h);
}

int begin_capture(Stream s, CaptureMode mode) {
  return static_cast<int>(cudaStreamBeginCapture(s, static_cast<cudaStreamCaptureMode>(mode)));
}
int end_capture(Stream s, Graph* out) {
  cudaGraph_t g = nullptr;
  const cudaError_t r = cudaStreamEndCapture(s, &g);
  *out = g;
  return static_cast<int>(r);
}
bool capturing(Stream s) {
  cudaStreamCaptureStatus status{};
  CUDA_OK(cudaStreamIsCapturing(s, &status));
  return status != cudaStreamCaptureStatusNone;
}
Exec instantiate(Graph g) {
  cudaGraphExec_t e = nullptr;
  CUDA_OK(cudaGraphInstantiate(&e, g, 0));
  return e;
}
void launch(Exec e, Stream s) { CUDA_OK(cudaGraphLaunch(e, s)); }
void destroy(Exec e) { cudaGraphExecDestroy(e); }
void destroy(Graph g) { cudaGraphDestroy(g); }
Graph new_graph() {
  cudaGraph_t g = nullptr;
  CUDA_OK(cudaGraphCreate(&g, 0));
  return g;
}
void add_child(Graph parent, Graph child) {
  cudaGraphNode_t node = nullptr;
  CUDA_OK(cudaGraphAddChildGraphNode(&node, parent, nullptr, 0, child));
}

int64_t violations() { return 0; }
const char* first_violation() { return ""; }
void drain_callbacks() {
  CUDA_OK(cudaDeviceSynchronize());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

}  // namespace engine
