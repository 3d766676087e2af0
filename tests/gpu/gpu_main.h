/* SPDX-License-Identifier: Apache-2.0 */
// main() of a doctest GPU suite: exit 77 (ctest's SKIP_RETURN_CODE) where
// cudart finds no GPU. Included once, by the suite's .cpp/.cu, after
// DOCTEST_CONFIG_IMPLEMENT and doctest.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: GPU tests skipped\n");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
