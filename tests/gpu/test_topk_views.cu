// SPDX-License-Identifier: Apache-2.0
// Zero-kernel capture on a GPU: a small top-k kernel (the engine's fused
// MoE routing) writes int16 or int32 expert ids straight into
// moecap_export(MOECAP_BUFFER_LAYER_IDS, layer), recorded in a CUDA graph
// with moecap_commit, no moecap_capture; what moecap_read returns after the
// replays must equal the host backend fed the same top-k through
// moecap_capture. Also with MOECAP_FLAG_SIDE_STREAM (commit forked, joined
// before the graph ends). Skips (exit 77) without a GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "moecap.h"
#include "tests/support/tensors.h"

using namespace moecap_test;

namespace {

#define CUDA_OK(call) REQUIRE_MESSAGE((call) == cudaSuccess, #call)

constexpr int32_t kLayers = 4, kTopK = 4, kExperts = 64;
constexpr int64_t kTokens = 24;

// Router logit of (step, token, layer, expert): distinct per token, so top-k has no ties.
__host__ __device__ float logit(int64_t step, int64_t token, int32_t layer, int32_t expert) {
  uint32_t x = static_cast<uint32_t>(step * 7919 + token * 104729 + layer * 15485863) ^ 0x9E3779B9u;
  x = x * 2654435761u + static_cast<uint32_t>(expert) * 40503u;
  x ^= x >> 15;
  return static_cast<float>(x % 1000003u) + static_cast<float>(expert) * 1e-3f;
}

// One thread per token: the top_k largest logits, largest first, by
// repeated selection (experts fit a register mask of 64).
template <class Id>
__global__ void topk_kernel(const int64_t* step, int32_t layer, int64_t tokens, Id* out) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= tokens) return;
  uint64_t taken = 0;
  for (int32_t k = 0; k < kTopK; ++k) {
    int32_t best = -1;
    float best_v = 0;
    for (int32_t e = 0; e < kExperts; ++e) {
      const float v = logit(*step, t, layer, e);
      if (!(taken >> e & 1) && (best < 0 || v > best_v)) {
        best = e;
        best_v = v;
      }
    }
    taken |= uint64_t{1} << best;
    out[t * kTopK + k] = static_cast<Id>(best);
  }
}

// The same top-k on the host, as moecap_capture's int32 input.
std::vector<int32_t> host_topk(int64_t step, int32_t layer) {
  std::vector<int32_t> ids;
  for (int64_t t = 0; t < kTokens; ++t) {
    uint64_t taken = 0;
    for (int32_t k = 0; k < kTopK; ++k) {
      int32_t best = -1;
      float best_v = 0;
      for (int32_t e = 0; e < kExperts; ++e) {
        const float v = logit(step, t, layer, e);
        if (!(taken >> e & 1) && (best < 0 || v > best_v)) {
          best = e;
          best_v = v;
        }
      }
      taken |= uint64_t{1} << best;
      ids.push_back(best);
    }
  }
  return ids;
}

moecap_config config(int32_t device_id_dtype, bool side) {
  moecap_config c{};
  c.struct_size = sizeof c;
  REQUIRE(moecap_config_init(&c) == MOECAP_OK);
  c.num_layers = kLayers;
  c.top_k = kTopK;
  c.num_experts = kExperts;
  c.max_running_requests = kTokens;
  c.chunked_prefill_size = kTokens;
  c.host_slots = 256;
  c.device_id_dtype = device_id_dtype;
  if (side) c.flags |= MOECAP_FLAG_SIDE_STREAM;
  return c;
}

std::vector<int64_t> read_all(moecap_capturer* h, const std::vector<int64_t>& slots) {
  const auto n = static_cast<int64_t>(slots.size());
  HostTensor s({n}, i64());
  for (int64_t i = 0; i < n; ++i) s.set(i, slots[static_cast<size_t>(i)]);
  HostTensor out({n, kLayers, kTopK}, i64());
  REQUIRE_MESSAGE(moecap_read(h, s.get(), out.get(), nullptr, MOECAP_READ_STRICT, nullptr) == MOECAP_OK,
                  std::string(moecap_last_error()));
  std::vector<int64_t> v(static_cast<size_t>(out.numel()));
  for (int64_t i = 0; i < out.numel(); ++i) v[static_cast<size_t>(i)] = out.at(i);
  return v;
}

template <class Id>
void run_case(int32_t device_id_dtype, bool side) {
  const moecap_config c = config(device_id_dtype, side);
  moecap_capturer* cuda = nullptr;
  moecap_config cc = c;
  cc.device_type = MOECAP_DEVICE_CUDA;
  REQUIRE_MESSAGE(moecap_create(&cc, &cuda) == MOECAP_OK, std::string(moecap_last_error()));
  moecap_capturer* host = nullptr;
  moecap_config hc = c;
  hc.flags &= ~MOECAP_FLAG_SIDE_STREAM;
  REQUIRE(moecap_create(&hc, &host) == MOECAP_OK);

  std::vector<DLManagedTensorVersioned*> views(kLayers);
  for (int32_t l = 0; l < kLayers; ++l) {
    REQUIRE(moecap_export(cuda, MOECAP_BUFFER_LAYER_IDS, l, &views[static_cast<size_t>(l)]) == MOECAP_OK);
    const DLTensor& v = views[static_cast<size_t>(l)]->dl_tensor;
    CHECK(v.device.device_type == kDLCUDA);
    CHECK(v.dtype.bits == sizeof(Id) * 8);
    CHECK(v.shape[1] == kTopK);
    CHECK(v.strides[0] == kTopK);  // compact: the kernel's out= as is
  }
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int64_t* step = nullptr;  // what the replay routes: written before each replay
  int64_t* slots = nullptr;
  CUDA_OK(cudaMalloc(&step, sizeof(int64_t)));
  CUDA_OK(cudaMalloc(&slots, kTokens * sizeof(int64_t)));
  int64_t slot_shape[1] = {kTokens};
  DLTensor slot_tensor{slots, {kDLCUDA, 0}, 1, DLDataType{kDLInt, 64, 1}, slot_shape, nullptr, 0};

  // The engine's graph: per layer the top-k kernel into moecap's view, then the commit.
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int32_t l = 0; l < kLayers; ++l) {
    topk_kernel<Id><<<1, 32, 0, s>>>(step, l, kTokens, static_cast<Id*>(views[static_cast<size_t>(l)]->dl_tensor.data));
  }
  moecap_commit_args a{sizeof a, 0, nullptr, &slot_tensor};
  const moecap_status committed = moecap_commit(cuda, &a, s);
  const moecap_status joined = moecap_join(cuda, s);
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  REQUIRE_MESSAGE(committed == MOECAP_OK, std::string(moecap_last_error()));
  REQUIRE(joined == MOECAP_OK);
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  for (int64_t replay = 0; replay < 3; ++replay) {
    CAPTURE(replay);
    const int64_t step_value = 10 + replay;
    std::vector<int64_t> dst(kTokens);
    for (int64_t t = 0; t < kTokens; ++t) dst[static_cast<size_t>(t)] = replay * kTokens + t;
    CUDA_OK(cudaMemcpyAsync(step, &step_value, sizeof step_value, cudaMemcpyHostToDevice, s));
    CUDA_OK(cudaMemcpyAsync(slots, dst.data(), kTokens * sizeof(int64_t), cudaMemcpyHostToDevice, s));
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));

    // The host backend, fed the same top-k through moecap_capture.
    for (int32_t l = 0; l < kLayers; ++l) {
      std::vector<int32_t> ids = host_topk(step_value, l);
      int64_t shape[2] = {kTokens, kTopK};
      DLTensor t{ids.data(), {kDLCPU, 0}, 2, DLDataType{kDLInt, 32, 1}, shape, nullptr, 0};
      REQUIRE(moecap_capture(host, l, &t, nullptr, nullptr) == MOECAP_OK);
    }
    int64_t hs_shape[1] = {kTokens};
    DLTensor hs{dst.data(), {kDLCPU, 0}, 1, DLDataType{kDLInt, 64, 1}, hs_shape, nullptr, 0};
    moecap_commit_args ha{sizeof ha, 0, nullptr, &hs};
    REQUIRE(moecap_commit(host, &ha, nullptr) == MOECAP_OK);

    const std::vector<int64_t> got = read_all(cuda, dst);
    CHECK(got == read_all(host, dst));
    CHECK(got[0] == host_topk(step_value, 0)[0]);
  }
  moecap_error_counts e{};
  e.struct_size = sizeof e;
  REQUIRE(moecap_get_errors(cuda, &e, 0) == MOECAP_OK);
  CHECK(e.skipped_rows == 0);
  CHECK(e.invalid_ids == 0);

  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  for (DLManagedTensorVersioned* v : views) v->deleter(v);
  cudaFree(step);
  cudaFree(slots);
  cudaStreamDestroy(s);
  CHECK(moecap_destroy(cuda) == MOECAP_OK);
  CHECK(moecap_destroy(host) == MOECAP_OK);
}

}  // namespace

TEST_CASE("a top-k kernel writes int16 ids into the layer views in a graph; read matches the host backend") {
  run_case<int16_t>(MOECAP_IDS_I16, false);
}

TEST_CASE("a top-k kernel writes int32 ids into the layer views in a graph; read matches the host backend") {
  run_case<int32_t>(MOECAP_IDS_I32, false);
}

TEST_CASE("the same with MOECAP_FLAG_SIDE_STREAM: the commit is a branch joined before the graph ends") {
  run_case<int16_t>(MOECAP_IDS_I16, true);
}

#include "tests/gpu/gpu_main.h"
