#!/usr/bin/env bash
# Quick start 1: installs what is missing, builds the library and the engine
# simulation (C++, no Python needed), and runs it: CUDA where a GPU is
# present, else the host backend. Extra arguments go to engine_sim
# (--help lists them).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# Without a GPU the kernels would go unused: a first build skips them (the
# longest step of the build). scripts/test.sh asks for them again, and an
# existing build/ keeps what it was configured with.
if [ ! -f "$root/build/CMakeCache.txt" ] && ! { [ -e /dev/nvidia0 ] || nvidia-smi -L >/dev/null 2>&1; }; then
  export MOECAP_CMAKE_ARGS="-DMOECAP_CUDA=OFF ${MOECAP_CMAKE_ARGS:-}"
fi
"$root/scripts/setup.sh" engine_sim
exec "$root/build/examples/engine_sim" --backend auto "$@"
