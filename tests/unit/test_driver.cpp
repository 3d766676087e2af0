// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's three driver failures, on any machine: no driver
// library, the toolkit's stub library, and a driver too old. Each is a
// distinct status with a clear message, and create hands out nothing.
#include <doctest/doctest.h>

#include <dlfcn.h>
#include <stdlib.h>

#include <string>

#include "moecap.h"
#include "tests/support/tensors.h"

namespace {

moecap_status create_cuda(const char* libcuda, moecap_capturer** h) {
  if (libcuda != nullptr) {
    setenv("MOECAP_LIBCUDA", libcuda, 1);
  } else {
    unsetenv("MOECAP_LIBCUDA");
  }
  moecap_config c = moecap_test::small_config();
  c.device_type = MOECAP_DEVICE_CUDA;
  const moecap_status s = moecap_create(&c, h);
  unsetenv("MOECAP_LIBCUDA");
  return s;
}

bool real_driver_present() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return false;
  using Init = int (*)(unsigned);
  auto init = reinterpret_cast<Init>(dlsym(lib, "cuInit"));
  return init != nullptr && init(0) == 0;
}

}  // namespace

// First: once the stub is loaded, its soname (libcuda.so.1) resolves to it for
// the rest of the process.
TEST_CASE("the default driver on a machine without a GPU: NO_DEVICE") {
  if (real_driver_present()) {
    MESSAGE("a CUDA driver and GPU are present; the GPU suite covers this machine");
    return;
  }
  moecap_capturer* h = nullptr;
  CHECK(create_cuda(nullptr, &h) == MOECAP_ERROR_NO_DEVICE);
  CHECK(h == nullptr);
}

TEST_CASE("no driver library: NO_DEVICE naming the library") {
  moecap_capturer* h = nullptr;
  CHECK(create_cuda("/nonexistent/libcuda.so.1", &h) == MOECAP_ERROR_NO_DEVICE);
  CHECK(h == nullptr);
  CHECK(std::string(moecap_last_error()).find("cannot load /nonexistent/libcuda.so.1") != std::string::npos);
}

TEST_CASE("the toolkit's stub library: STUB_DRIVER") {
#ifdef MOECAP_CUDA_STUB
  moecap_capturer* h = nullptr;
  CHECK(create_cuda(MOECAP_CUDA_STUB, &h) == MOECAP_ERROR_STUB_DRIVER);
  CHECK(h == nullptr);
  CHECK(std::string(moecap_last_error()).find("stub") != std::string::npos);
#else
  MESSAGE("no CUDA toolkit stub library at build time; case not exercised");
#endif
}

TEST_CASE("a driver too old: DRIVER_TOO_OLD, by version and by missing entry point") {
  moecap_capturer* h = nullptr;
  unsetenv("FAKE_CUDA_VERSION");
  CHECK(create_cuda(MOECAP_FAKE_OLD_DRIVER, &h) == MOECAP_ERROR_DRIVER_TOO_OLD);
  CHECK(std::string(moecap_last_error()).find("supports CUDA 10.2; moecap needs ") != std::string::npos);
  setenv("FAKE_CUDA_VERSION", "99000", 1);  // newer than any toolkit: the entry points decide
  CHECK(create_cuda(MOECAP_FAKE_OLD_DRIVER, &h) == MOECAP_ERROR_DRIVER_TOO_OLD);
  CHECK(std::string(moecap_last_error()).find("has no cuGetErrorName") != std::string::npos);
  unsetenv("FAKE_CUDA_VERSION");
  CHECK(h == nullptr);
}
