/* SPDX-License-Identifier: Apache-2.0 */
// A capturer owned by a doctest case: created (or the test stops) and destroyed with it.
#pragma once

#include <doctest/doctest.h>

#include "moecap.h"

namespace moecap_test {

struct Handle {
  explicit Handle(const moecap_config& c) { REQUIRE(moecap_create(&c, &h) == MOECAP_OK); }
  ~Handle() { moecap_destroy(h); }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  moecap_capturer* h = nullptr;
};

}  // namespace moecap_test
