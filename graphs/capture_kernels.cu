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

// After the commit kernel: clears this commit's claims for the next one.
extern "C" __global__ void moecap_release_kernel(CommitParams p) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < p.count;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    release_claim(p, j);
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
