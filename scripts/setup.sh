#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks (as root, from Debian's
# packages), makes the Python venv (scripts/venv.sh: PyPI, kept between runs
# at ${MOECAP_VENV:-~/.cache/moecap/venv}; MOECAP_NO_VENV=1 skips it and the
# Python package), and builds moecap into build/. Used by demo.sh and test.sh.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
packages=(cmake g++ make binutils pkg-config doctest-dev libdlpack-dev libbenchmark-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The CUDA toolkit is optional: where nvcc exists the kernels are built and embedded.
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
python=${MOECAP_PYTHON:-}  # an interpreter of your own (with nanobind, torch >= 2.4, numpy 2, pytest)
[ -n "$python" ] || [ "${MOECAP_NO_VENV:-0}" = 1 ] || python=$("$root/scripts/venv.sh")
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOECAP_PYTHON="$python" ${MOECAP_CMAKE_ARGS:-}
cmake --build "$root/build" -j "${MOECAP_JOBS:-2}"
