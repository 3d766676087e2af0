# SPDX-License-Identifier: Apache-2.0
# moecap.h documents the capturer's lock in two places (the conventions at
# the top, moecap_read's own comment); both must say what the code does: no
# call holds the lock while it blocks on the host (read, write, synchronize
# and get_errors release it while they wait). The header once said in one
# place that a blocking read holds it.
# Usage: cmake -DHEADER=<abi/moecap.h> -P check_header_lock_text.cmake
file(READ "${HEADER}" text)
string(REGEX REPLACE "\n[ ]*\\*[ ]*" " " flat "${text}")  # comment lines joined
string(REGEX REPLACE "[ ]+" " " flat "${flat}")
foreach(wrong "holds the lock while it waits" "holds the capturer's lock while" "keeps the lock while")
  string(FIND "${flat}" "${wrong}" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "moecap.h says a waiting call '${wrong}'; every wait releases the lock")
  endif()
endforeach()
foreach(right
    "No call holds the lock while it blocks on the host"
    "The waits release the capturer's lock")
  string(FIND "${flat}" "${right}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "moecap.h no longer says: '${right}'")
  endif()
endforeach()
message(STATUS "moecap.h: the lock text is consistent")
