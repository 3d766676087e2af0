/* SPDX-License-Identifier: Apache-2.0 */
// Errors inside the plugin are C++ exceptions of one type; the entry points
// (plugin/entry_points.cpp) turn them into a status code and thread-local text, so
// nothing ever crosses the C boundary.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "moecap.h"

namespace moecap {

class Error : public std::runtime_error {
 public:
  Error(moecap_status code, const std::string& message) : std::runtime_error(message), code_(code) {}
  moecap_status code() const { return code_; }

 private:
  moecap_status code_;
};

template <class... Parts>
std::string cat(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}

template <class... Parts>
[[noreturn]] void fail(moecap_status code, Parts&&... parts) {
  throw Error(code, cat(std::forward<Parts>(parts)...));
}

// The caller-facing text of the last failure on this thread.
void set_last_error(const std::string& message);
const char* last_error();

}  // namespace moecap
