#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# A C/C++ engine that builds moecap from source inside its own CMake project
# (tests/install/subproject): once through add_subdirectory, once through
# FetchContent from a local path, offline. Both must configure, build and run
# the consumer, with the version abi/moecap.h defines. moecap is built with
# ASan+UBSan there, so the check also shows that the sanitizer options reach
# moecap's targets (and the link of what uses moecap) but no target of the
# including project. Usage: check_subproject.sh <moecap source> <cmake> <C compiler> <C++ compiler>
set -euo pipefail
source=$1 cmake=$2 cc=$3 cxx=$4
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
major=$(sed -n 's/^#define MOECAP_ABI_VERSION_MAJOR \([0-9]*\).*/\1/p' "$source/abi/moecap.h")
minor=$(sed -n 's/^#define MOECAP_ABI_VERSION_MINOR \([0-9]*\).*/\1/p' "$source/abi/moecap.h")
patch=$(sed -n 's/^#define MOECAP_VERSION_PATCH \([0-9]*\).*/\1/p' "$source/abi/moecap.h")

for via in add_subdirectory FetchContent; do
  echo "$via:"
  "$cmake" -S "$here/subproject" -B "$work/$via" -DMOECAP_SOURCE="$source" -DMOECAP_VIA="$via" \
    -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=Debug -DEXPECTED_BUILD_TYPE=Debug \
    -DMOECAP_CUDA=OFF -DMOECAP_SANITIZE=address -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >"$work/$via.log" 2>&1 || { cat "$work/$via.log"; exit 1; }
  "$cmake" --build "$work/$via" -j "${MOECAP_JOBS:-2}" --target consumer >>"$work/$via.log" 2>&1 ||
    { cat "$work/$via.log"; exit 1; }
  version=$(cat "$work/$via/moecap_version.txt")
  if [ "$version" != "$major.$minor.$patch $major" ]; then
    echo "subproject: the library's VERSION and SOVERSION are $version; abi/moecap.h says $major.$minor.$patch"
    exit 1
  fi
  # The library was instrumented, the consumer's own object was not.
  entries=$(tr '}' '\n' <"$work/$via/compile_commands.json")
  if ! grep 'plugin/capturer.cpp' <<<"$entries" | grep -q -- '-fsanitize=address'; then
    echo "subproject: moecap's own sources were not built with MOECAP_SANITIZE=address"
    exit 1
  fi
  if grep 'consumer.c' <<<"$entries" | grep -q -- '-fsanitize'; then
    echo "subproject: the including project's consumer.c got moecap's sanitizer flags"
    exit 1
  fi
  ASAN_OPTIONS=detect_leaks=1 "$work/$via/consumer"
done
