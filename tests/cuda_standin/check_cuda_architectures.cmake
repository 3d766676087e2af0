# SPDX-License-Identifier: Apache-2.0
# cmake -P: the default fatbin architectures for each nvcc release a GPU
# fleet may have: nothing a compiler cannot build (sm_100 needs 12.8, sm_90
# 11.8), never more targets than docs/DESIGN.md names, and PTX of the newest.
include(${CMAKE_CURRENT_LIST_DIR}/../../cmake/cuda_architectures.cmake)

function(expect version want)
  moecap_default_cuda_architectures(got "${version}")
  if(NOT "${got}" STREQUAL "${want}")
    message(FATAL_ERROR "nvcc ${version}: default architectures '${got}', expected '${want}'")
  endif()
endfunction()

expect("13.0.88" "80-real;90-real;100")
expect("12.8" "80-real;90-real;100")
expect("12.7.1" "80-real;90")
expect("12.4.131" "80-real;90")
expect("12.0" "80-real;90")
expect("11.8" "80-real;90")
expect("11.7" "80")
expect("11.4" "80")
expect("11.3" "")
