// SPDX-License-Identifier: Apache-2.0
// CUDA kernels of moecap, compiled by nvcc into a fatbin that is embedded in
// libmoecap.so and loaded through the Driver API (no cudart). Their host
// twins are in capture_host.cpp; the shared logic is in kernel_ops.h.
// Grid sizes come from the host call and are frozen in a graph; everything
// a replay may change (ids, slots, row lists) is read from device memory.
#include "graphs/kernel_ops.h"

using namespace moecap;

extern "C" __global__ void moecap_capture_kernel(CaptureParams p) {
  if (blockIdx.x == 0 && threadIdx.x == 0) stamp_capture(p);
  const int64_t elements = p.n * p.top_k;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < elements;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    capture_element(p, i);
  }
}

// Before the commit kernel, when slots may repeat: each slot's last entry.
// (Lost in 0ab1be0; the backend looks it up at create.)
extern "C" __global__ void moecap_claim_kernel(CommitParams p) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < p.count;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    claim_slot(p, j);
  }
}

// After the commit kernel, every commit of rows: consumes the rows read, one
// thread per element of [num_layers, count, top_k] so that the stores
// coalesce (a row range is one run per layer), and marks the commit done
// (finish_commit: the next capture starts a step, the next claims outrank
// this commit's, so no claim needs clearing).
extern "C" __global__ void moecap_release_kernel(CommitParams p) {
  const int64_t elements = static_cast<int64_t>(p.num_layers) * p.count * p.top_k;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (first == 0) finish_commit(p);
  for (int64_t e = first; e < elements; e += static_cast<int64_t>(gridDim.x) * blockDim.x) consume_element(p, e);
}

// Bytes of narrowed ids a warp stages in shared memory before storing them
// over the bus; 8 warps a block (256 threads).
constexpr int64_t kStageBytes = 1024;
constexpr int kWarpsPerBlock = 8;

// Narrows one committed row (every layer) into the host cache's row `slot`:
// the lanes narrow a chunk into shared memory, then store it with copy_row's
// wide writes (the host cache is pinned memory over the bus). Returns
// whether this lane saw an id outside [0, num_experts).
__device__ bool commit_row(const CommitParams& p, int64_t src, int64_t slot, uint8_t* stage, int lane) {
  const int64_t row = static_cast<int64_t>(p.num_layers) * p.top_k;
  const int64_t id_bytes = elem_bytes(p.dst_id_elem);
  const int64_t per_chunk = kStageBytes / id_bytes;
  uint8_t* dst = p.dst_ids + slot * row * id_bytes;
  bool bad = false;
  for (int64_t first = 0; first < row; first += per_chunk) {
    const int64_t n = row - first < per_chunk ? row - first : per_chunk;
    for (int64_t e = lane; e < n; e += 32) bad = narrow_element(p, src, first + e, stage, e) || bad;
    __syncwarp();
    copy_row(dst + first * id_bytes, stage, n * id_bytes, lane, 32);
    __syncwarp();
  }
  if (p.weight_elem >= 0) {
    for (int64_t e = lane; e < row; e += 32) commit_weight(p, src, slot, e);
  }
  return bad;
}

// One warp per committed row: lane 0 decides where it goes (with claims, only
// the slot's last entry goes), the warp narrows the row, and lane 0 then sets
// the slot's state, once every lane's ids are known. An invalidation only
// sets the state.
extern "C" __global__ void __launch_bounds__(kWarpsPerBlock * 32) moecap_commit_kernel(CommitParams p) {
  __shared__ __align__(16) uint8_t stage[kWarpsPerBlock][kStageBytes];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + warp; j < p.count; j += warps) {
    int64_t src = 0;
    int64_t slot = 0;
    bool go = false;
    if (lane == 0) go = commit_target(p, j, &src, &slot);
    go = __shfl_sync(0xffffffffu, go, 0);
    if (!go) continue;
    src = __shfl_sync(0xffffffffu, src, 0);
    slot = __shfl_sync(0xffffffffu, slot, 0);
    bool bad = false;
    if (p.mode == kCommitRows) bad = commit_row(p, src, slot, stage[warp], lane);
    bad = __any_sync(0xffffffffu, bad);
    if (lane == 0) p.dst_states[slot] = p.mode == kInvalidate ? static_cast<uint8_t>(kSlotEmpty) : committed_state(bad);
  }
}

extern "C" __global__ void moecap_take_errors_kernel(TakeErrorsParams p) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    take_error(&p.errors->skipped_rows, &p.out->skipped_rows);
    take_error(&p.errors->invalid_ids, &p.out->invalid_ids);
  }
}

// moecap_read into device memory: gathers host-cache rows over the bus.
extern "C" __global__ void moecap_gather_kernel(GatherParams p) {
  const int64_t elements = p.count * p.row_elements;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < elements;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    gather_element(p, i);
  }
}
