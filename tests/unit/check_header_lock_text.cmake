# moecap.h documents the capturer's lock in two places (the conventions at
# the top, moecap_read's own comment); both must say what the code does:
# read, write and synchronize release the lock while they wait for commits.
# The header once said in one place that a blocking read holds it.
# Usage: cmake -DHEADER=<abi/moecap.h> -P check_header_lock_text.cmake
file(READ "${HEADER}" text)
string(REGEX REPLACE "\n[ ]*\\*[ ]*" " " flat "${text}")  # comment lines joined
string(REGEX REPLACE "[ ]+" " " flat "${flat}")
foreach(wrong "holds the lock while it waits" "holds the capturer's lock while" "keeps the lock while")
  string(FIND "${flat}" "${wrong}" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "moecap.h says a waiting call '${wrong}'; read, write and synchronize release the lock")
  endif()
endforeach()
foreach(right
    "moecap_read, moecap_write and moecap_synchronize release the lock while they wait for commits"
    "The wait releases the capturer's lock")
  string(FIND "${flat}" "${right}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "moecap.h no longer says: '${right}'")
  endif()
endforeach()
message(STATUS "moecap.h: the lock text is consistent")
