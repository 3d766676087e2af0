# SPDX-License-Identifier: Apache-2.0
# moecap_default_cuda_architectures(<out_var> <nvcc_version>)
#
# The default GPU architectures of the kernels' fatbin for an nvcc version
# ("12.4.131" or "12.4"): SASS for Ampere, Hopper and Blackwell, and PTX of
# the newest of them the compiler knows, which later chips JIT-compile.
# Blackwell (sm_100) needs nvcc 12.8 and Hopper (sm_90) 11.8, so older
# toolkits (CUDA 12.0-12.7 is common on H100/H200 fleets) get PTX of the
# newest they have instead of a compile error. Below CUDA 11.4 moecap's
# driver entry points do not exist: <out_var> is left empty.
function(moecap_default_cuda_architectures out version)
  if(NOT version MATCHES "^([0-9]+)\\.([0-9]+)")
    message(FATAL_ERROR "moecap_default_cuda_architectures: '${version}' is not an nvcc version")
  endif()
  math(EXPR v "${CMAKE_MATCH_1} * 1000 + ${CMAKE_MATCH_2} * 10")
  if(v GREATER_EQUAL 12080)
    set(archs 80-real 90-real 100)
  elseif(v GREATER_EQUAL 11080)
    set(archs 80-real 90)
  elseif(v GREATER_EQUAL 11040)
    set(archs 80)
  else()
    set(archs "")
  endif()
  set(${out} "${archs}" PARENT_SCOPE)
endfunction()

# The nvcc version ("12.4") of `compiler`, before enable_language(CUDA) knows it.
function(moecap_nvcc_version out compiler)
  execute_process(COMMAND "${compiler}" --version OUTPUT_VARIABLE text ERROR_QUIET RESULT_VARIABLE rc)
  if(rc EQUAL 0 AND text MATCHES "release ([0-9]+\\.[0-9]+)")
    set(${out} "${CMAKE_MATCH_1}" PARENT_SCOPE)
  else()
    set(${out} "" PARENT_SCOPE)
  endif()
endfunction()
