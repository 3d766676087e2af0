#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# MOECAP_CUDA takes AUTO (or empty), ON, OFF and their usual spellings (1,
# TRUE, YES, Y; 0, FALSE, NO, N) in any case; anything else stops the
# configure naming the value. (Read as strings, "off" once built the kernels
# and "on" without nvcc the host backend alone.) Each case configures the
# library only.
# Usage: check_cuda_option.sh <moecap source> <cmake> <kernels found by the including build: ON/OFF>
set -euo pipefail
source=$1 cmake=$2 have_kernels=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
configure() {  # value, expected exit (0 or 1), expected text of the output
  local dir="$work/value_${1:-empty}" rc=0
  "$cmake" -S "$source" -B "$dir" -DMOECAP_CUDA="$1" -DMOECAP_BUILD_TESTS=OFF -DMOECAP_BUILD_EXAMPLES=OFF \
    -DMOECAP_BUILD_BENCH=OFF -DMOECAP_PYTHON= >"$dir.log" 2>&1 || rc=$?
  if [ $((rc != 0)) != "$2" ] || ! grep -q -- "$3" "$dir.log"; then
    echo "MOECAP_CUDA=$1: exit $rc, expected $2 with '$3'; the configure said:"
    cat "$dir.log"
    exit 1
  fi
  echo "MOECAP_CUDA=$1: $3"
}
for value in OFF off 0 False no; do
  configure "$value" 0 "CUDA kernels OFF (MOECAP_CUDA=OFF)"
done
configure bogus 1 "not 'bogus'"
configure 2 1 "not '2'"
if [ "$have_kernels" = ON ]; then  # nvcc is there: every spelling of ON builds the kernels, and so does AUTO
  for value in on 1 TRUE ""; do
    configure "$value" 0 "CUDA kernels ON"
  done
elif ! command -v nvcc >/dev/null; then  # no nvcc: ON stops the configure, AUTO builds the host backend
  for value in on 1 TRUE; do
    configure "$value" 1 "MOECAP_CUDA=$value but no nvcc was found"
  done
  configure "" 0 "CUDA kernels OFF (no nvcc)"
fi
echo "cuda option: OK"
