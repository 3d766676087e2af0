/* SPDX-License-Identifier: Apache-2.0 */
// The one wrapper every C entry point runs its body in (entry_points.cpp,
// record.cpp): any exception becomes a status and thread-local text naming
// the function, so nothing crosses the C boundary.
#pragma once

#include <exception>
#include <new>

#include "base/status.h"

namespace moecap {

template <class Body>
moecap_status guarded(const char* function, Body&& body) noexcept {
  try {
    body();
    return MOECAP_OK;
  } catch (const Error& e) {
    set_last_error(cat(function, ": ", e.what()));
    return e.code();
  } catch (const std::bad_alloc&) {
    set_last_error(cat(function, ": out of host memory"));
    return MOECAP_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_last_error(cat(function, ": internal error: ", e.what()));
    return MOECAP_ERROR_INTERNAL;
  } catch (...) {
    set_last_error(cat(function, ": internal error: unknown exception"));
    return MOECAP_ERROR_INTERNAL;
  }
}

}  // namespace moecap
