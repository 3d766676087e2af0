#!/usr/bin/env bash
# Quick start 2: set up, build, run every test (GPU tests skip without a GPU).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
ctest --test-dir "$root/build" --output-on-failure -j 2
