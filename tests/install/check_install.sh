#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `cmake --install` into a temporary prefix, then both ways a C/C++ engine
# finds moecap there: a C program built with `pkg-config --cflags --libs
# moecap`, and a CMake project with find_package(moecap). Both must build and
# run. Usage: check_install.sh <build dir> <cmake> <C compiler> [C flags...]
set -euo pipefail
build=$1 cmake=$2 cc=$3
shift 3
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"

"$cmake" --install "$build" --prefix "$prefix" >/dev/null
pc=$(find "$prefix" -name moecap.pc)
export PKG_CONFIG_PATH=$(dirname "$pc")

echo "pkg-config: $(pkg-config --cflags --libs moecap)"
# shellcheck disable=SC2046  # pkg-config's output is meant to be split
"$cc" "$@" -o "$work/consumer_pc" "$here/consumer.c" $(pkg-config --cflags --libs moecap)
LD_LIBRARY_PATH=$(pkg-config --variable=libdir moecap) "$work/consumer_pc"

# The C example README calls the complete program, built on its own against the installed header: it
# dlopens the installed library by its SONAME.
echo "examples/c_host/c_host.c:"
# shellcheck disable=SC2046
"$cc" "$@" -std=c99 -Wall -Wextra -pedantic -Werror -o "$work/c_host" "$here/../../examples/c_host/c_host.c" \
  $(pkg-config --cflags moecap) -ldl
LD_LIBRARY_PATH=$(pkg-config --variable=libdir moecap) "$work/c_host" | grep -q "slot 11: layer 0 experts {0, 5}"
echo "c_host: OK"

echo "find_package:"
"$cmake" -S "$here/find_package" -B "$work/find_package" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_C_FLAGS="$*" -DCMAKE_BUILD_TYPE=Release >/dev/null
"$cmake" --build "$work/find_package" >/dev/null
"$work/find_package/consumer"

# The same install, its package configured against a copy of dlpack.h in a
# folder of its own, and the system's hidden from the consumer's search.
echo "find_package, DLPack outside the search path:"
cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
system_dlpack=$(cache DLPACK_INCLUDE_DIR)
mkdir -p "$work/dlpack/include/dlpack"
cp "$system_dlpack/dlpack/dlpack.h" "$work/dlpack/include/dlpack/"
"$cmake" -S "$(cache CMAKE_HOME_DIRECTORY)" -B "$work/own_dlpack" -DDLPACK_INCLUDE_DIR="$work/dlpack/include" \
  -DMOECAP_CUDA=OFF -DMOECAP_BUILD_TESTS=OFF -DMOECAP_BUILD_EXAMPLES=OFF -DMOECAP_BUILD_BENCH=OFF -DMOECAP_PYTHON= \
  >/dev/null
cp "$work/own_dlpack/moecapConfig.cmake" "$(dirname "$(find "$prefix" -name moecapConfig.cmake)")/"
"$cmake" -S "$here/find_package" -B "$work/find_package_own_dlpack" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_IGNORE_PATH="$system_dlpack" -DCMAKE_C_COMPILER="$cc" -DCMAKE_C_FLAGS="$*" \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
"$cmake" --build "$work/find_package_own_dlpack" >/dev/null
"$work/find_package_own_dlpack/consumer"
