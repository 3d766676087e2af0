// Host twins of capture_kernels.cu. The host backend runs these directly and
// its graph emulation records them with their parameters baked.
#include <cstring>

#include "kernel_ops.h"

namespace moecap {

void capture_on_host(const CaptureParams& p) {
  const int64_t elements = p.n * p.top_k;
  for (int64_t i = 0; i < elements; ++i) capture_element(p, i);
}

void commit_on_host(const CommitParams& p) {
  for (int64_t j = 0; j < p.count; ++j) {
    int64_t src = 0;
    int64_t slot = 0;
    if (!commit_target(p, j, &src, &slot)) continue;
    std::memcpy(p.dst_ids + slot * p.id_row_bytes, p.src_ids + src * p.id_row_bytes,
                static_cast<size_t>(p.id_row_bytes));
    if (p.weight_row_bytes > 0) {
      std::memcpy(p.dst_weights + slot * p.weight_row_bytes, p.src_weights + src * p.weight_row_bytes,
                  static_cast<size_t>(p.weight_row_bytes));
    }
  }
}

}  // namespace moecap
