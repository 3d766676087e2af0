#!/usr/bin/env bash
# Quick start 1: installs what is missing, builds the library and the engine
# simulation (C++, no Python needed), and runs it: CUDA where a GPU is
# present, else the host backend. Extra arguments go to engine_sim
# (--help lists them).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh" engine_sim
exec "$root/build/examples/engine_sim" --backend auto "$@"
