#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks (as root, from Debian's
# packages only) and builds moecap into build/. Used by demo.sh and test.sh.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
packages=(cmake g++ make binutils pkg-config doctest-dev libdlpack-dev libbenchmark-dev python3 python3-numpy
          python3-torch python3-pytest)
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
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOECAP_PYTHON="${MOECAP_PYTHON:-/usr/bin/python3}" ${MOECAP_CMAKE_ARGS:-}
cmake --build "$root/build" -j "${MOECAP_JOBS:-2}"
