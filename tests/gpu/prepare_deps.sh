#!/usr/bin/env bash
# Unpacks the Debian packages the build needs into .deps/ (git-ignored), for
# a machine that reaches no package registry (the GPU device machine):
#   tests/gpu/prepare_deps.sh   here, then carry .deps there.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download doctest-dev libdlpack-dev libbenchmark-dev libbenchmark1debian)
rm -rf "$root/.deps"
for deb in "$work"/*.deb; do dpkg -x "$deb" "$root/.deps"; done
echo "unpacked into $root/.deps: $(ls "$work" | tr '\n' ' ')"
