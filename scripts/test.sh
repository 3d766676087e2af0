#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Quick start 2: installs what is missing, makes the Python venv
# (scripts/venv.sh; the first run downloads torch and its CUDA libraries, a
# few GB), builds everything and runs every test (GPU tests skip without a
# GPU). Extra arguments go to ctest (e.g. -R unit, -L standin).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# The kernels are built wherever nvcc is (the CUDA backend's scenarios run
# on the stand-in driver without a GPU), also in a build/ the demo began
# without them.
MOECAP_CMAKE_ARGS="-DMOECAP_CUDA=${MOECAP_CUDA:-AUTO} ${MOECAP_CMAKE_ARGS:-}" "$root/scripts/setup.sh" --python
ctest --test-dir "$root/build" --output-on-failure -j "${MOECAP_JOBS:-2}" "$@"
