// SPDX-License-Identifier: Apache-2.0
// CUDA cases of moecap_bench (skipped without a GPU): what moecap adds to a
// graph replay per MoE layer (a capture node, a side branch, or nothing but
// a top-k kernel writing moecap's layer view), the host link's bandwidth (a
// plain pinned copy), and commit straight into pinned memory against it and
// against the staged copy engines use today.
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

moecap_capturer* make_cuda_capturer(uint32_t flags = 0) {
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
  c.flags = flags;
  moecap_capturer* h = nullptr;
  return moecap_create(&c, &h) == MOECAP_OK ? h : nullptr;
}

DLTensor device_tensor(void* p, int ndim, int64_t* shape, DLDataType dt) {
  return DLTensor{p, {kDLCUDA, 0}, ndim, dt, shape, nullptr, 0};
}

// How moecap is in the graph (arg 1 of BM_CudaGraph_Replay).
enum ReplayMode : int64_t {
  kNoMoecap = 0,     // the engine alone
  kCaptureNode = 1,  // moecap_capture per layer on the engine's stream
  kSideBranch = 2,   // the same under MOECAP_FLAG_SIDE_STREAM, joined once after the commit
  kLayerView = 3,    // the top-k writes moecap's int16 layer view; no moecap_capture
};

// Arg 0: batch tokens; arg 1: ReplayMode. The engine's work per layer is a
// 256 KiB memset (a stand-in for its kernels) and its top-k output, a memset
// of [n, top_k] ids into its own buffer (or, kLayerView, into moecap's view).
// Every moecap mode ends with one commit of n rows (slots -1: the kernel runs,
// nothing lands), so (mode - kNoMoecap) / 48 is moecap's cost per MoE layer
// on the critical path, the commit included.
void BM_CudaGraph_Replay(benchmark::State& state) {
  if (!have_gpu()) return state.SkipWithError("no GPU");
  const int64_t n = state.range(0);
  const auto mode = static_cast<ReplayMode>(state.range(1));
  const bool with = mode != kNoMoecap;
  moecap_capturer* h = make_cuda_capturer(mode == kSideBranch ? MOECAP_FLAG_SIDE_STREAM : 0u);
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
  std::vector<DLManagedTensorVersioned*> views;
  if (mode == kLayerView) {
    for (int32_t l = 0; l < kLayers; ++l) {
      DLManagedTensorVersioned* v = nullptr;
      if (moecap_export(h, MOECAP_BUFFER_LAYER_IDS, l, &v) != MOECAP_OK) return state.SkipWithError(moecap_last_error());
      views.push_back(v);
    }
  }
  cudaGraph_t g;
  cudaGraphExec_t exec;
  bool recorded = true;
  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  for (int32_t l = 0; l < kLayers; ++l) {
    cudaMemsetAsync(work, l, 256 << 10, s);
    if (mode == kLayerView) {
      cudaMemsetAsync(views[static_cast<size_t>(l)]->dl_tensor.data, 0, static_cast<size_t>(n * kTopK * 2), s);
    } else {
      cudaMemsetAsync(ids, 0, static_cast<size_t>(n * kTopK * 4), s);
    }
    if (mode == kCaptureNode || mode == kSideBranch) {
      recorded = recorded && moecap_capture(h, l, &t, nullptr, s) == MOECAP_OK;
    }
  }
  if (with) {
    moecap_commit_args a{sizeof a, 0, nullptr, &st};
    recorded = recorded && moecap_commit(h, &a, s) == MOECAP_OK;
    recorded = recorded && moecap_join(h, s) == MOECAP_OK;
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
  for (DLManagedTensorVersioned* v : views) v->deleter(v);
  cudaFree(ids);
  cudaFree(work);
  cudaFree(slots);
  cudaStreamDestroy(s);
  moecap_destroy(h);
}

// The host link: a plain device-to-pinned-host copy of arg 0 bytes, timed
// like a commit (enqueue, then wait). The largest size is the link's
// bandwidth that commit is reported against.
void BM_CudaLink_PinnedCopy(benchmark::State& state) {
  if (!have_gpu()) return state.SkipWithError("no GPU");
  const auto bytes = static_cast<size_t>(state.range(0));
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  void* device;
  void* host;
  cudaMalloc(&device, bytes);
  cudaMemset(device, 1, bytes);
  cudaMallocHost(&host, bytes);
  for (auto _ : state) {
    cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, s);
    cudaStreamSynchronize(s);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes));
  cudaFree(device);
  cudaFreeHost(host);
  cudaStreamDestroy(s);
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

BENCHMARK(BM_CudaGraph_Replay)->ArgsProduct({{64, 512, 4096}, {kNoMoecap, kCaptureNode, kSideBranch, kLayerView}})
    ->UseManualTime();
// The bytes of the commits below (u8 rows of 48 x 8 ids), then 64 MiB: the link's bandwidth.
BENCHMARK(BM_CudaLink_PinnedCopy)
    ->Arg(64 * kRowElems)
    ->Arg(512 * kRowElems)
    ->Arg(4096 * kRowElems)
    ->Arg(16384 * kRowElems)
    ->Arg(int64_t{64} << 20);
BENCHMARK(BM_CudaCommit_Direct)->Arg(64)->Arg(512)->Arg(4096)->Arg(16384);
BENCHMARK(BM_CudaCommit_Staged)->Arg(64)->Arg(512)->Arg(4096)->Arg(16384);
