# SPDX-License-Identifier: Apache-2.0
# moecap_nvcc_fatbin(<output> <source.cu> DEPENDS <headers...>)
#
# The fatbin as one nvcc command, for CMake versions without
# CUDA_FATBIN_COMPILATION (before 3.27). It takes what the CUDA language
# support would: CMAKE_CUDA_ARCHITECTURES, CMAKE_CUDA_FLAGS and the host
# compiler, and the repository as the include root. No -O: nvcc's -O is for
# host code (a fatbin has none, ptxas optimizes device code by default), and a
# second -O from CMAKE_CUDA_FLAGS would be an nvcc error.
function(moecap_nvcc_fatbin output source)
  cmake_parse_arguments(F "" "" "DEPENDS" ${ARGN})
  set(gencode)
  foreach(arch IN LISTS CMAKE_CUDA_ARCHITECTURES)
    if(NOT arch MATCHES "^([0-9]+[a-z]?)(-real|-virtual)?$")
      message(FATAL_ERROR "CMAKE_CUDA_ARCHITECTURES entry '${arch}': with CMake ${CMAKE_VERSION} moecap builds "
        "its fatbin with one nvcc command, which takes entries like 90, 90-real or 90-virtual; "
        "'all', 'native' and the like need CMake 3.27 or newer")
    endif()
    set(sm ${CMAKE_MATCH_1})
    if(CMAKE_MATCH_2 STREQUAL "-real")
      list(APPEND gencode -gencode arch=compute_${sm},code=sm_${sm})
    elseif(CMAKE_MATCH_2 STREQUAL "-virtual")
      list(APPEND gencode -gencode arch=compute_${sm},code=compute_${sm})
    else()
      list(APPEND gencode -gencode arch=compute_${sm},code=[sm_${sm},compute_${sm}])
    endif()
  endforeach()
  separate_arguments(user_flags UNIX_COMMAND "${CMAKE_CUDA_FLAGS}")
  set(host_compiler)
  if(CMAKE_CUDA_HOST_COMPILER)
    set(host_compiler -ccbin ${CMAKE_CUDA_HOST_COMPILER})
  endif()
  add_custom_command(
    OUTPUT ${output}
    COMMAND ${CMAKE_CUDA_COMPILER} -fatbin -std=c++17 ${host_compiler} ${user_flags} ${gencode}
            -I${PROJECT_SOURCE_DIR} -o ${output} ${CMAKE_CURRENT_SOURCE_DIR}/${source}
    DEPENDS ${source} ${F_DEPENDS}
    COMMENT "nvcc: building the moecap kernels fatbin (${CMAKE_CUDA_ARCHITECTURES})"
    VERBATIM)
endfunction()
