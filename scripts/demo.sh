#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Quick start 1: installs what is missing, builds the library and the engine
# simulation (C++, no Python needed), and runs it: CUDA where a GPU is
# present, else the host backend. Extra arguments go to engine_sim
# (--help lists them).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# The kernels are the longest step of the build. A first build on a machine
# without a GPU skips them (they would go unused; scripts/test.sh asks for
# them again), and on one with GPUs builds them for those GPUs only (unless
# CUDAARCHS says otherwise). An existing build/ keeps its configuration.
if [ ! -f "$root/build/CMakeCache.txt" ]; then
  if ! { [ -e /dev/nvidia0 ] || nvidia-smi -L >/dev/null 2>&1; }; then
    export MOECAP_CMAKE_ARGS="-DMOECAP_CUDA=OFF ${MOECAP_CMAKE_ARGS:-}"
  elif [ -z "${CUDAARCHS:-}" ]; then
    # "9.0" per GPU -> "90-real"; nothing (an older nvidia-smi) keeps the default list.
    archs=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
            sed -n 's/^ *\([0-9]*\)\.\([0-9]*\) *$/\1\2-real/p' | sort -u | paste -sd ';' || true)
    [ -z "$archs" ] || export MOECAP_CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=$archs ${MOECAP_CMAKE_ARGS:-}"
  fi
fi
"$root/scripts/setup.sh" --demo engine_sim
exec "$root/build/examples/engine_sim" --backend auto "$@"
