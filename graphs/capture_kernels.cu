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

// Copies `bytes` with the widest access both addresses and the size allow:
// the destination is usually pinned host memory over the bus, where wide
// writes matter most.
__device__ void copy_row(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane, int lanes) {
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                          static_cast<uintptr_t>(bytes);
  if ((align & 15u) == 0) {
    for (int64_t i = lane; i < bytes / 16; i += lanes)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else if ((align & 3u) == 0) {
    for (int64_t i = lane; i < bytes / 4; i += lanes)
      reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(src)[i];
  } else {
    for (int64_t i = lane; i < bytes; i += lanes) dst[i] = src[i];
  }
}

// One warp per committed row.
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
    copy_row(p.dst_ids + slot * p.id_row_bytes, p.src_ids + src * p.id_row_bytes, p.id_row_bytes, lane, 32);
    if (p.weight_row_bytes > 0) {
      copy_row(p.dst_weights + slot * p.weight_row_bytes, p.src_weights + src * p.weight_row_bytes,
               p.weight_row_bytes, lane, 32);
    }
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
