// CUDA kernels of moecap, compiled by nvcc into a fatbin that is embedded in
// libmoecap.so and loaded through the Driver API (no cudart). Their host
// twins are in capture_host.cpp; the shared logic is in kernel_ops.h.
// Grid sizes come from the host call and are frozen in a graph; everything
// a replay may change (ids, slots, row lists) is read from device memory.
#include "graphs/kernel_ops.h"

using namespace moecap;

extern "C" __global__ void moecap_capture_kernel(CaptureParams p) {
  const int64_t elements = p.n * p.top_k;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < elements;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    capture_element(p, i);
  }
}

// One warp per committed row: lane 0 decides where it goes, the lanes narrow
// its elements (every layer) into the host cache over the bus, and lane 0
// then sets the slot's state, once every lane's ids are known. An
// invalidation only sets the state. Rows run in parallel, so a slot listed
// twice in one commit is written by two warps.
extern "C" __global__ void moecap_commit_kernel(CommitParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; j < p.count;
       j += warps) {
    int64_t src = 0;
    int64_t slot = 0;
    bool go = false;
    if (lane == 0) go = commit_target(p, j, &src, &slot);
    go = __shfl_sync(0xffffffffu, go, 0);
    if (!go) continue;
    src = __shfl_sync(0xffffffffu, src, 0);
    slot = __shfl_sync(0xffffffffu, slot, 0);
    bool bad = false;
    if (p.mode == kCommitRows) bad = commit_row_elements(p, src, slot, lane, 32);
    bad = __any_sync(0xffffffffu, bad);
    if (lane == 0) p.dst_states[slot] = p.mode == kInvalidate ? static_cast<uint8_t>(kSlotEmpty) : committed_state(bad);
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
