# SPDX-License-Identifier: Apache-2.0
# Runs COMMAND (a ;-list), requires exit code EXIT and that its output
# matches every regex in MATCH and none in REJECT.
execute_process(COMMAND ${COMMAND} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
set(all "${out}${err}")
message("${all}")
if(NOT rc EQUAL EXIT)
  message(FATAL_ERROR "exit code ${rc}, expected ${EXIT}")
endif()
foreach(re IN LISTS MATCH)
  if(NOT all MATCHES "${re}")
    message(FATAL_ERROR "output does not match '${re}'")
  endif()
endforeach()
foreach(re IN LISTS REJECT)
  if(all MATCHES "${re}")
    message(FATAL_ERROR "output matches '${re}', which it must not")
  endif()
endforeach()
