// SPDX-License-Identifier: Apache-2.0
// engine_api.h over the stand-in driver: its device memory is host memory,
// and a stream runs only when the host waits, so a hold needs nothing.
#include <cstdlib>
#include <cstring>

#include "tests/cuda_standin/engine.h"
#include "tests/cuda_standin/engine_api.h"

namespace engine {
namespace {

struct Calls {
  standin::CUresult (*mem_free)(unsigned long long) = standin::entry<decltype(mem_free)>("cuMemFree");
  standin::CUresult (*host_free)(void*) = standin::entry<decltype(host_free)>("cuMemFreeHost");
};
const Calls& calls() {
  static const Calls c;
  return c;
}

}  // namespace

void setup() { setenv("MOECAP_LIBCUDA", MOECAP_STANDIN_DRIVER, 1); }

Stream new_stream() { return standin::new_stream(); }

void* allocate(size_t bytes, DLDeviceType where) {
  void* p = nullptr;
  if (where == kDLCUDA) {
    unsigned long long d = 0;
    REQUIRE(standin::driver().mem_alloc(&d, bytes) == 0);
    p = reinterpret_cast<void*>(d);
  } else {
    REQUIRE(standin::driver().host_alloc(&p, bytes, 0x3) == 0);
  }
  std::memset(p, 0, bytes);
  return p;
}

void release(void* p, DLDeviceType where) {
  if (where == kDLCUDA) {
    calls().mem_free(reinterpret_cast<unsigned long long>(p));
  } else {
    calls().host_free(p);
  }
}

void upload(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
void download(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
void sync(Stream s) { REQUIRE(standin::driver().stream_sync(s) == 0); }
bool busy(Stream s) { return standin_pending(s) > 0; }

struct HoldState {};
HoldState* hold(Stream) { return new HoldState; }
void release(HoldState* h) { delete h; }

int begin_capture(Stream s, CaptureMode mode) { return standin::driver().begin_capture(s, mode); }
int end_capture(Stream s, Graph* out) { return standin::driver().end_capture(s, out); }
bool capturing(Stream s) {
  int status = -1;
  REQUIRE(standin::driver().is_capturing(s, &status) == 0);
  return status != 0;
}
Exec instantiate(Graph g) {
  Exec e = nullptr;
  REQUIRE(standin::driver().instantiate(&e, g, 0) == 0);
  return e;
}
void launch(Exec e, Stream s) { REQUIRE(standin::driver().launch(e, s) == 0); }
void destroy(Exec e) { standin::driver().exec_destroy(e); }
void destroy(Graph g) { standin::driver().graph_destroy(g); }
Graph new_graph() {
  Graph g = nullptr;
  REQUIRE(standin::driver().graph_create(&g, 0) == 0);
  return g;
}
void add_child(Graph parent, Graph child) {
  void* node = nullptr;
  REQUIRE(standin::driver().add_child(&node, parent, nullptr, 0, child) == 0);
}

int64_t violations() { return standin_violations(); }
const char* first_violation() { return standin_first_violation(); }
void drain_callbacks() { standin_drain_callbacks(); }

}  // namespace engine
