// SPDX-License-Identifier: Apache-2.0
// An engine that dlopen()s moecap, records a capture into its own graph,
// destroys the capturer and dlclose()s the library, then destroys the graph:
// the driver then calls moecap's user-object destructor, which must still be
// mapped. A plain program (not linked to libmoecap, so dlclose could unmap
// it); exit status 0 when the library stayed and no stand-in rule broke.
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "moecap.h"
#include "tests/cuda_standin/standin.h"

namespace {

template <class F>
F entry(void* lib, const char* name) {
  void* p = lib != nullptr ? dlsym(lib, name) : standin_entry(name);
  if (p == nullptr) {
    std::fprintf(stderr, "dlclose_with_graph: no %s\n", name);
    std::exit(2);
  }
  return reinterpret_cast<F>(p);
}

int fail(const char* what, const char* why) {
  std::fprintf(stderr, "dlclose_with_graph: %s: %s\n", what, why);
  return 1;
}

}  // namespace

int main() {
  setenv("MOECAP_LIBCUDA", MOECAP_STANDIN_DRIVER, 1);
  void* lib = dlopen(MOECAP_LIBRARY, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return fail("dlopen", dlerror());
  auto config_init = entry<moecap_status (*)(moecap_config*)>(lib, "moecap_config_init");
  auto create = entry<moecap_status (*)(const moecap_config*, moecap_capturer**)>(lib, "moecap_create");
  auto destroy = entry<moecap_status (*)(moecap_capturer*)>(lib, "moecap_destroy");
  auto capture = entry<moecap_status (*)(moecap_capturer*, int32_t, const DLTensor*, const DLTensor*, void*)>(
      lib, "moecap_capture");
  auto last_error = entry<const char* (*)()>(lib, "moecap_last_error");
  using Stream = void*;
  using Graph = void*;
  auto stream_create = entry<int (*)(Stream*, unsigned)>(nullptr, "cuStreamCreate");
  auto begin_capture = entry<int (*)(Stream, int)>(nullptr, "cuStreamBeginCapture");
  auto end_capture = entry<int (*)(Stream, Graph*)>(nullptr, "cuStreamEndCapture");
  auto graph_destroy = entry<int (*)(Graph)>(nullptr, "cuGraphDestroy");
  auto mem_alloc = entry<int (*)(unsigned long long*, size_t)>(nullptr, "cuMemAlloc");

  moecap_config c{};
  c.struct_size = sizeof c;
  config_init(&c);
  c.device_type = MOECAP_DEVICE_CUDA;
  c.num_layers = 2;
  c.top_k = 2;
  c.num_experts = 8;
  c.host_slots = 16;
  c.max_running_requests = 4;
  moecap_capturer* h = nullptr;
  if (create(&c, &h) != MOECAP_OK) return fail("moecap_create", last_error());
  Stream s = nullptr;
  if (stream_create(&s, 1) != 0) return fail("cuStreamCreate", "refused");
  unsigned long long ids_memory = 0;
  if (mem_alloc(&ids_memory, 16) != 0) return fail("cuMemAlloc", "refused");
  int64_t shape[2] = {2, 2};
  DLTensor ids{};
  ids.data = reinterpret_cast<void*>(ids_memory);
  ids.device = {kDLCUDA, 0};
  ids.ndim = 2;
  ids.dtype = {kDLInt, 32, 1};
  ids.shape = shape;
  if (begin_capture(s, 0) != 0) return fail("cuStreamBeginCapture", "refused");
  if (capture(h, 0, &ids, nullptr, s) != MOECAP_OK) return fail("moecap_capture", last_error());
  Graph graph = nullptr;
  if (end_capture(s, &graph) != 0) return fail("cuStreamEndCapture", "refused");
  if (destroy(h) != MOECAP_OK) return fail("moecap_destroy", last_error());  // the graph holds it now
  if (standin_live_user_objects() < 1) return fail("the graph", "holds no user object");
  if (dlclose(lib) != 0) return fail("dlclose", dlerror());
  if (dlopen(MOECAP_LIBRARY, RTLD_NOW | RTLD_NOLOAD) == nullptr) {
    return fail("dlclose", "unmapped libmoecap while a graph holds one of its capturers");
  }
  graph_destroy(graph);  // the driver calls moecap's destructor for the capturer's hold
  standin_drain_callbacks();
  if (standin_violations() != 0) return fail("the stand-in", standin_first_violation());
  std::printf("dlclose_with_graph: OK: libmoecap stayed mapped and its hold was released\n");
  return 0;
}
