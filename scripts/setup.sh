#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what a fresh Debian machine lacks (from Debian's packages; as root,
# or through sudo) and builds moecap into build/.
#
#   scripts/setup.sh [--python | --demo] [target...]
#
# Targets default to everything; scripts/demo.sh builds engine_sim only.
# --demo installs only what the library and the examples need (no doctest, no
# Google Benchmark) and configures a new build/ without the tests and the
# bench; otherwise they are configured in (an existing build/ the demo began
# gets them).
# --python also makes the Python venv the package is built and tested with
# (scripts/venv.sh: PyPI, kept between runs at ${MOECAP_VENV:-~/.cache/moecap/venv})
# and configures the Python package against it; scripts/test.sh passes it.
# MOECAP_PYTHON=<interpreter> uses an interpreter of your own instead (with
# nanobind, torch, numpy and pytest); without either, an existing build/ keeps
# the interpreter it was configured with, and a new one has no Python package.
# The CUDA toolkit is optional: where nvcc exists the kernels are built and
# embedded. MOECAP_CMAKE_ARGS and MOECAP_JOBS (default 2) reach CMake.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
want_python=0
demo=0
targets=()
for arg in "$@"; do
  case "$arg" in
    --python) want_python=1 ;;
    --demo) demo=1 ;;
    -*) echo "setup: unknown option $arg (usage: setup.sh [--python | --demo] [target...])" >&2; exit 2 ;;
    *) targets+=("$arg") ;;
  esac
done

# What the library and the examples need: compiler, CMake and make, DLPack's
# header. The tests and the bench add binutils (the exports test reads the
# .so), pkg-config (the install test), doctest and Google Benchmark.
packages=(cmake g++ make libdlpack-dev)
suite_args=(-DMOECAP_BUILD_TESTS=ON -DMOECAP_BUILD_BENCH=ON)
if [ "$demo" = 1 ]; then
  suite_args=()  # an existing build/ keeps what it was configured with
  [ -f "$root/build/CMakeCache.txt" ] || suite_args=(-DMOECAP_BUILD_TESTS=OFF -DMOECAP_BUILD_BENCH=OFF)
else
  packages+=(binutils pkg-config doctest-dev libbenchmark-dev)
fi
if [ "$want_python" = 1 ] && [ -z "${MOECAP_PYTHON:-}" ]; then
  # The venv's base interpreter needs its C headers and venv/ensurepip, and
  # pip needs the CA certificates to reach PyPI. Debian's python3 has them
  # with these packages; an interpreter of your own (MOECAP_VENV_PYTHON,
  # pyenv's) needs none of them.
  base=${MOECAP_VENV_PYTHON:-python3}
  if ! "$base" -c 'import sysconfig, os, ensurepip, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null; then
    packages+=(python3 python3-dev python3-venv)
  fi
  packages+=(ca-certificates)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=()
  [ "$(id -u)" = 0 ] || sudo=(sudo)
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"

python_args=()
if [ -n "${MOECAP_PYTHON:-}" ]; then
  python_args=(-DMOECAP_PYTHON="$MOECAP_PYTHON")
elif [ "$want_python" = 1 ]; then
  python_args=(-DMOECAP_PYTHON="$("$root/scripts/venv.sh")")
fi
# shellcheck disable=SC2086  # MOECAP_CMAKE_ARGS is a list of arguments
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${suite_args[@]}" "${python_args[@]}" \
  ${MOECAP_CMAKE_ARGS:-}
build_args=()
[ ${#targets[@]} -eq 0 ] || build_args=(--target "${targets[@]}")
cmake --build "$root/build" -j "${MOECAP_JOBS:-2}" "${build_args[@]}"
