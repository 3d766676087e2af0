// CUDA cases of moecap_bench (skipped without a GPU): what L capture nodes
// add to a graph replay, and commit straight into pinned memory against the
// staged copy engines use today.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "moecap.h"

namespace {

constexpr int32_t kLayers = 48;
constexpr int32_t kTopK = 8;
constexpr int64_t kRowElems = int64_t{kLayers} * kTopK;
constexpr int64_t kSlots = 1 << 16;

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

moecap_capturer* make_cuda_capturer() {
  moecap_config c{};
  c.struct_size = sizeof c;
  if (moecap_config_init(&c) != MOECAP_OK) return nullptr;
  c.num_layers = kLayers;
  c.top_k = kTopK;
  c.num_experts = 128;
  c.max_running_requests = 512;
  c.chunked_prefill_size = 16384;
  c.host_slots = kSlots;
  c.device_type = MOECAP_DEVICE_CUDA;
  moecap_capturer* h = nullptr;
  return moecap_create(&c, &h) == MOECAP_OK ? h : nullptr;
}

DLTensor device_tensor(void* p, int ndim, int64_t* shape, DLDataType dt) {
  return DLTensor{p, {kDLCUDA, 0}, ndim, dt, shape, nullptr, 0};
}

// Arg 0: batch tokens; arg 1: with (1) or without (0) moecap capture nodes.
// The "engine" work per layer is a 256 KiB memset, a stand-in for its kernels.
void BM_CudaGraph_Replay(benchmark::State& state) {
  if (!have_gpu()) return state.SkipWithError("no GPU");
  const int64_t n = state.range(0);
  const bool with = state.range(1) != 0;
  moecap_capturer* h = make_cuda_capturer();
  if (h == nullptr) return state.SkipWithError(moecap_last_error());
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  void *ids, *work, *slots;
  cudaMalloc(&ids, static_cast<size_t>(n * kTopK * 4));
  cudaMemset(ids, 0, static_cast<size_t>(n * kTopK * 4));
  cudaMalloc(&work, 256 << 10);
  cudaMalloc(&slots, static_cast<size_t>(n * 8));
  cudaMemset(slots, 0xff, static_cast<size_t>(n * 8));  // all -1: dropped
  int64_t shape[2] = {n, kTopK};
  int64_t sshape[1] = {n};
  DLTensor t = device_tensor(ids, 2, shape, DLDataType{kDLInt, 32, 1});
  DLTensor st = device_tensor(slots, 1, sshape, DLDataType{kDLInt, 64, 1});
  cudaGraph_t g;
  cudaGraphExec_t exec;
  bool recorded = true;
  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  for (int32_t l = 0; l < kLayers; ++l) {
    cudaMemsetAsync(work, l, 256 << 10, s);
    if (with) recorded = recorded && moecap_capture(h, l, &t, nullptr, s) == MOECAP_OK;
  }
  if (with) {
    moecap_commit_args a{sizeof a, 0, nullptr, &st};
    recorded = recorded && moecap_commit(h, &a, s) == MOECAP_OK;
  }
  cudaStreamEndCapture(s, &g);
  if (!recorded) return state.SkipWithError(moecap_last_error());
  cudaGraphInstantiate(&exec, g, 0);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (auto _ : state) {
    cudaEventRecord(a, s);
    for (int i = 0; i < 20; ++i) cudaGraphLaunch(exec, s);
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    state.SetIterationTime(ms / 1e3 / 20);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(g);
  cudaFree(ids);
  cudaFree(work);
  cudaFree(slots);
  cudaStreamDestroy(s);
  moecap_destroy(h);
}

// Arg 0: rows. moecap's commit kernel writes rows straight into the pinned host cache.
void BM_CudaCommit_Direct(benchmark::State& state) {
  if (!have_gpu()) return state.SkipWithError("no GPU");
  const int64_t n = state.range(0);
  moecap_capturer* h = make_cuda_capturer();
  if (h == nullptr) return state.SkipWithError(moecap_last_error());
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  std::vector<int64_t> host_slots(static_cast<size_t>(kSlots));
  std::iota(host_slots.begin(), host_slots.end(), 0);
  std::shuffle(host_slots.begin(), host_slots.end(), std::mt19937(3));
  void* slots;
  cudaMalloc(&slots, static_cast<size_t>(n * 8));
  cudaMemcpy(slots, host_slots.data(), static_cast<size_t>(n * 8), cudaMemcpyHostToDevice);
  int64_t sshape[1] = {n};
  DLTensor st = device_tensor(slots, 1, sshape, DLDataType{kDLInt, 64, 1});
  moecap_commit_args a{sizeof a, 0, nullptr, &st};
  if (moecap_commit(h, &a, s) != MOECAP_OK) return state.SkipWithError(moecap_last_error());
  for (auto _ : state) {
    moecap_commit(h, &a, s);
    cudaStreamSynchronize(s);
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * kRowElems);
  cudaFree(slots);
  cudaStreamDestroy(s);
  moecap_destroy(h);
}

// The staged way: copy the int32 slice to pinned memory, wait, scatter rows on the host.
void BM_CudaCommit_Staged(benchmark::State& state) {
  if (!have_gpu()) return state.SkipWithError("no GPU");
  const int64_t n = state.range(0);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  void* device;
  cudaMalloc(&device, static_cast<size_t>(n * kRowElems * 4));
  int32_t* staged;
  cudaMallocHost(&staged, static_cast<size_t>(n * kRowElems * 4));
  std::vector<int32_t> cache(static_cast<size_t>(kSlots * kRowElems));
  std::vector<int64_t> slots(static_cast<size_t>(kSlots));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), std::mt19937(3));
  for (auto _ : state) {
    cudaMemcpyAsync(staged, device, static_cast<size_t>(n * kRowElems * 4), cudaMemcpyDeviceToHost, s);
    cudaStreamSynchronize(s);
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(cache.data() + slots[static_cast<size_t>(i)] * kRowElems, staged + i * kRowElems, kRowElems * 4);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * kRowElems * 4);
  cudaFree(device);
  cudaFreeHost(staged);
  cudaStreamDestroy(s);
}

}  // namespace

BENCHMARK(BM_CudaGraph_Replay)->ArgsProduct({{64, 512, 4096}, {0, 1}})->UseManualTime();
BENCHMARK(BM_CudaCommit_Direct)->Arg(64)->Arg(512)->Arg(4096)->Arg(16384);
BENCHMARK(BM_CudaCommit_Staged)->Arg(64)->Arg(512)->Arg(4096)->Arg(16384);
