#!/usr/bin/env bash
# Quick start 1: set up, build, run the engine simulation (CUDA where a GPU
# is present, else the host backend). Extra arguments go to engine_sim.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
exec "$root/build/examples/engine_sim" --backend auto "$@"
