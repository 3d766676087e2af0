// SPDX-License-Identifier: Apache-2.0
// The RAII owners of driver objects, against a Driver whose entry points are
// counters: each object is freed once, in its context, by whoever owns it
// last; release() gives it up; a context that cannot be made current (the
// driver unloading at exit) keeps the object rather than throw.
#include <doctest/doctest.h>

#include <utility>
#include <vector>

#include "base/cuda_driver.h"
#include "base/cuda_owners.h"

using namespace moecap::cuda;

namespace {

struct Calls {
  std::vector<CUevent> destroyed;
  std::vector<CUcontext> pushed;
  int pops = 0;
  int primary_released = 0;
  CUresult push_result = kSuccess;
};
Calls g_calls;

CUcontext fake_context(int i) { return reinterpret_cast<CUcontext>(static_cast<uintptr_t>(0x1000 + i)); }
CUevent fake_event(int i) { return reinterpret_cast<CUevent>(static_cast<uintptr_t>(0x2000 + i)); }

Driver counting_driver() {
  g_calls = Calls{};
  Driver d{};
  d.cuCtxPushCurrent = [](CUcontext c) {
    g_calls.pushed.push_back(c);
    return g_calls.push_result;
  };
  d.cuCtxPopCurrent = [](CUcontext*) {
    ++g_calls.pops;
    return kSuccess;
  };
  d.cuEventDestroy = [](CUevent e) {
    g_calls.destroyed.push_back(e);
    return kSuccess;
  };
  d.cuDevicePrimaryCtxRetain = [](CUcontext* c, CUdevice dev) {
    *c = fake_context(dev);
    return kSuccess;
  };
  d.cuDevicePrimaryCtxRelease = [](CUdevice) {
    ++g_calls.primary_released;
    return kSuccess;
  };
  return d;
}

}  // namespace

TEST_CASE("a Unique owner frees its object once, in its context, from the last owner") {
  const Driver d = counting_driver();
  {
    UniqueEvent a(d, fake_context(1), fake_event(1));
    UniqueEvent b = std::move(a);
    CHECK_FALSE(a);
    CHECK(b.get() == fake_event(1));
    UniqueEvent c;
    c = std::move(b);
    CHECK(g_calls.destroyed.empty());
  }
  REQUIRE(g_calls.destroyed.size() == 1);
  CHECK(g_calls.destroyed[0] == fake_event(1));
  REQUIRE(g_calls.pushed.size() == 1);
  CHECK(g_calls.pushed[0] == fake_context(1));
  CHECK(g_calls.pops == 1);
}

TEST_CASE("move assignment frees what the target held; release gives the object up") {
  const Driver d = counting_driver();
  UniqueEvent a(d, fake_context(1), fake_event(1));
  UniqueEvent b(d, fake_context(2), fake_event(2));
  a = std::move(b);
  REQUIRE(g_calls.destroyed.size() == 1);
  CHECK(g_calls.destroyed[0] == fake_event(1));
  CHECK(g_calls.pushed.back() == fake_context(1));
  CHECK(a.release() == fake_event(2));
  a.reset();
  CHECK(g_calls.destroyed.size() == 1);
}

TEST_CASE("an owner whose context cannot be made current keeps the object and does not throw") {
  const Driver d = counting_driver();
  g_calls.push_result = kErrorDeinitialized;
  {
    UniqueEvent a(d, fake_context(1), fake_event(1));
  }
  CHECK(g_calls.pushed.size() == 1);
  CHECK(g_calls.destroyed.empty());
  CHECK(g_calls.pops == 0);
}

TEST_CASE("the primary context is released once, by its last owner") {
  const Driver d = counting_driver();
  {
    PrimaryContext a(d, 3);
    CHECK(a.get() == fake_context(3));
    PrimaryContext b = std::move(a);
    CHECK(a.get() == nullptr);
    CHECK(g_calls.primary_released == 0);
  }
  CHECK(g_calls.primary_released == 1);
}
