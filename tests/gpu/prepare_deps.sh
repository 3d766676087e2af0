#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Puts what the build and the tests need, and a machine without a package
# registry (the GPU device machine) may lack, into .deps/ (git-ignored):
#   .deps/usr/     Debian packages, unpacked: doctest, DLPack, Google Benchmark;
#   .deps/python/  pure-Python wheels, unpacked, for that machine's python3 to
#                  find on PYTHONPATH: nanobind (with its CMake config, which
#                  builds the extension) and pytest with its dependencies.
# Nothing that would shadow the machine's own torch or NumPy. The wheels are
# pinned, at the newest that still support Python 3.9 when they were chosen
# (the machine's Python is unknown; the venv's nanobind 3.1 needs 3.10, so the GPU build's
# nanobind is 2.15, not the venv's; tomli and exceptiongroup are what pytest
# needs below 3.11).
#   tests/gpu/prepare_deps.sh   here, then carry .deps there (device_check.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/deb" "$work/wheels"
chmod 755 "$work" && chmod 777 "$work/deb"  # apt-get downloads as user _apt
(cd "$work/deb" && apt-get download doctest-dev libdlpack-dev libbenchmark-dev libbenchmark1debian)
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.9 -d "$work/wheels" \
  nanobind==2.15.0 pytest==8.4.2 pluggy==1.6.0 iniconfig==2.1.0 packaging==26.3 pygments==2.21.0 tomli==2.5.0 \
  exceptiongroup==1.3.2
rm -rf "$root/.deps"
for deb in "$work"/deb/*.deb; do dpkg -x "$deb" "$root/.deps"; done
for wheel in "$work"/wheels/*.whl; do "$python" -m zipfile -e "$wheel" "$root/.deps/python"; done
echo "unpacked into $root/.deps ($(du -sh "$root/.deps" | cut -f1)):" \
  $(ls "$work/deb" "$work/wheels" | grep -E '\.(deb|whl)$')
