# SPDX-License-Identifier: Apache-2.0
# Every source, build and script file of the repository names its licence in
# its first two lines (after a shebang), so a file copied into an engine's tree
# keeps saying under which terms it came. Frozen copies of the 1.0 headers and
# fuzz inputs are data, not sources.
file(GLOB_RECURSE candidates RELATIVE "${ROOT}"
  "${ROOT}/*.c" "${ROOT}/*.h" "${ROOT}/*.cpp" "${ROOT}/*.cu" "${ROOT}/*.py" "${ROOT}/*.sh"
  "${ROOT}/*.cmake" "${ROOT}/*.in" "${ROOT}/CMakeLists.txt" "${ROOT}/pyproject.toml" "${ROOT}/.ci/run")
set(missing "")
set(checked 0)
foreach(f IN LISTS candidates)
  if(f MATCHES "^(build[^/]*|\\.deps|\\.whl|\\.git)/|^tests/abi/v1_0/|^tests/fuzz/corpus/|/_deps/")
    continue()
  endif()
  file(STRINGS "${ROOT}/${f}" head LIMIT_COUNT 2)
  math(EXPR checked "${checked} + 1")
  if(NOT head MATCHES "SPDX-License-Identifier: Apache-2\\.0")
    list(APPEND missing "${f}")
  endif()
endforeach()
if(checked LESS 100)
  message(FATAL_ERROR "only ${checked} files found under ${ROOT}: is ROOT the repository?")
endif()
if(missing)
  list(JOIN missing "\n  " text)
  message(FATAL_ERROR "no 'SPDX-License-Identifier: Apache-2.0' in the first two lines of:\n  ${text}")
endif()
message(STATUS "${checked} files name their licence")
