// SPDX-License-Identifier: Apache-2.0
// The stand-in driver keeps the real driver's rules where moecap could break
// them: each test calls the stand-in directly, as moecap or an engine would,
// and checks the rule the CUDA Programming Guide and Driver API state.
#include <doctest/doctest.h>

#include <functional>
#include <thread>

#include "base/cuda_driver.h"
#include "tests/cuda_standin/engine.h"

using namespace standin;

extern "C" int cuGetProcAddress_v2(const char* name, void** pfn, int version, uint64_t flags, int* status);

namespace {

constexpr CUresult kOk = 0, kInvalidValue = 1, kNotFound = 500, kCaptureUnsupported = 900,
                   kCaptureInvalidated = 901, kCaptureIsolation = 905;

struct Calls {
  CUresult (*mem_free)(unsigned long long) = entry<decltype(mem_free)>("cuMemFree");
  CUresult (*host_free)(void*) = entry<decltype(host_free)>("cuMemFreeHost");
  CUresult (*module_load)(void**, const void*) = entry<decltype(module_load)>("cuModuleLoadData");
  CUresult (*module_unload)(void*) = entry<decltype(module_unload)>("cuModuleUnload");
  CUresult (*exchange_mode)(int*) = entry<decltype(exchange_mode)>("cuThreadExchangeStreamCaptureMode");
  CUresult (*stream_query)(Stream) = entry<decltype(stream_query)>("cuStreamQuery");
  CUresult (*event_create)(void**, unsigned) = entry<decltype(event_create)>("cuEventCreate");
  CUresult (*event_destroy)(void*) = entry<decltype(event_destroy)>("cuEventDestroy");
  CUresult (*event_record)(void*, Stream) = entry<decltype(event_record)>("cuEventRecord");
  CUresult (*event_record_flags)(void*, Stream, unsigned) =
      entry<decltype(event_record_flags)>("cuEventRecordWithFlags");
  CUresult (*event_query)(void*) = entry<decltype(event_query)>("cuEventQuery");
  CUresult (*event_sync)(void*) = entry<decltype(event_sync)>("cuEventSynchronize");
  CUresult (*stream_wait_event)(Stream, void*, unsigned) = entry<decltype(stream_wait_event)>("cuStreamWaitEvent");
  CUresult (*stream_destroy)(Stream) = entry<decltype(stream_destroy)>("cuStreamDestroy");
};

const Calls& calls() {
  static const Calls c;
  return c;
}

// Ends the capture on `s`: 0, or the error (an invalidated capture: 901).
CUresult end(Stream s) {
  Graph g = nullptr;
  const CUresult r = driver().end_capture(s, &g);
  if (g != nullptr) driver().graph_destroy(g);
  return r;
}

// Runs `call` on another thread in `mode`; returns what it returned.
template <class Fn>
CUresult on_thread_in_mode(int mode, Fn call) {
  CUresult r = -1;
  std::thread([&] {
    int m = mode;
    calls().exchange_mode(&m);
    r = call();
    calls().exchange_mode(&m);
  }).join();
  return r;
}

}  // namespace

TEST_CASE("stand-in: frees and module unloads are unsafe during another thread's global capture") {
  Stream s = new_stream();
  unsigned long long device = 0;
  void* pinned = nullptr;
  void* module = nullptr;
  const unsigned char image[1] = {0};
  REQUIRE(driver().mem_alloc(&device, 16) == kOk);
  REQUIRE(driver().host_alloc(&pinned, 16, 0x3) == kOk);
  REQUIRE(calls().module_load(&module, image) == kOk);

  struct Case {
    const char* what;
    std::function<CUresult()> call;
  };
  for (const Case& k : {Case{"cuMemFree", [&] { return calls().mem_free(device); }},
                        Case{"cuMemFreeHost", [&] { return calls().host_free(pinned); }},
                        Case{"cuModuleUnload", [&] { return calls().module_unload(module); }}}) {
    CAPTURE(k.what);
    // Global mode (the default) on another thread: refused, and the capture is invalidated.
    REQUIRE(driver().begin_capture(s, kModeGlobal) == kOk);
    CHECK(on_thread_in_mode(kModeGlobal, k.call) == kCaptureUnsupported);
    CHECK(end(s) == kCaptureInvalidated);
  }
  CHECK(standin_is_pinned(pinned, 16) == 1);  // nothing was freed
  // Relaxed: allowed, and the capture survives.
  REQUIRE(driver().begin_capture(s, kModeGlobal) == kOk);
  CHECK(on_thread_in_mode(kModeRelaxed, [&] { return calls().mem_free(device); }) == kOk);
  CHECK(on_thread_in_mode(kModeRelaxed, [&] { return calls().host_free(pinned); }) == kOk);
  CHECK(on_thread_in_mode(kModeRelaxed, [&] { return calls().module_unload(module); }) == kOk);
  CHECK(end(s) == kOk);
  CHECK(standin_is_pinned(pinned, 16) == 0);
}

TEST_CASE("stand-in: synchronizing or querying a capturing stream invalidates its capture, in any mode") {
  Stream s = new_stream();
  for (const int mode : {kModeGlobal, kModeRelaxed}) {
    CAPTURE(mode);
    REQUIRE(driver().begin_capture(s, mode) == kOk);
    CHECK(on_thread_in_mode(kModeRelaxed, [&] { return driver().stream_sync(s); }) == kCaptureUnsupported);
    CHECK(end(s) == kCaptureInvalidated);
    REQUIRE(driver().begin_capture(s, mode) == kOk);
    CHECK(on_thread_in_mode(kModeRelaxed, [&] { return calls().stream_query(s); }) == kCaptureUnsupported);
    CHECK(end(s) == kCaptureInvalidated);
  }
}

TEST_CASE("stand-in: querying or synchronizing an event recorded in a capture invalidates the capture") {
  Stream s = new_stream();
  void* e = nullptr;
  REQUIRE(calls().event_create(&e, 0x1) == kOk);
  for (const bool query : {true, false}) {
    CAPTURE(query);
    REQUIRE(driver().begin_capture(s, kModeRelaxed) == kOk);
    REQUIRE(calls().event_record(e, s) == kOk);
    CHECK(on_thread_in_mode(kModeRelaxed, [&] { return query ? calls().event_query(e) : calls().event_sync(e); }) ==
          kCaptureUnsupported);
    CHECK(end(s) == kCaptureInvalidated);
  }
  calls().event_destroy(e);
}

TEST_CASE("stand-in: a capturing stream waiting on an event recorded outside the capture invalidates it") {
  // Completed, pending or never recorded alike: the Programming Guide makes
  // a wait on a non-captured event from a capturing stream invalid (without
  // CU_EVENT_WAIT_EXTERNAL).
  Stream s = new_stream();
  Stream other = new_stream();
  void* e = nullptr;
  REQUIRE(calls().event_create(&e, 0x1) == kOk);
  for (const int recorded : {0, 1, 2}) {  // never, completed, still pending
    CAPTURE(recorded);
    if (recorded > 0) REQUIRE(calls().event_record(e, other) == kOk);
    if (recorded == 1) REQUIRE(driver().stream_sync(other) == kOk);
    REQUIRE(driver().begin_capture(s, kModeRelaxed) == kOk);
    CHECK(calls().stream_wait_event(s, e, 0) == kCaptureIsolation);
    CHECK(end(s) == kCaptureInvalidated);
  }
  standin_run_stream(other);  // only this test's stream: others may hold earlier tests' work
  calls().event_destroy(e);
}

TEST_CASE("stand-in: a wait on an event of a destroyed stream still runs, as CUDA releases streams when done") {
  // moecap_destroy destroys its side stream while the engine's stream may
  // still hold a queued wait on an event recorded there. A stand-in that
  // freed the stream shows here under ASan (.ci/sanitizers.sh runs these).
  Stream waiter = new_stream();
  Stream gone = nullptr;
  REQUIRE(driver().stream_create(&gone, 1) == kOk);
  void* e = nullptr;
  REQUIRE(calls().event_create(&e, 0x1) == kOk);
  REQUIRE(calls().event_record(e, gone) == kOk);
  REQUIRE(calls().stream_wait_event(waiter, e, 0) == kOk);
  REQUIRE(calls().stream_destroy(gone) == kOk);
  CHECK(driver().stream_sync(waiter) == kOk);
  CHECK(calls().event_sync(e) == kOk);
  calls().event_destroy(e);
}

TEST_CASE("stand-in: CU_EVENT_RECORD_EXTERNAL is refused outside a capture, accepted inside one") {
  Stream s = new_stream();
  void* e = nullptr;
  REQUIRE(calls().event_create(&e, 0x1) == kOk);
  CHECK(calls().event_record_flags(e, s, 0x1) == kInvalidValue);
  REQUIRE(driver().begin_capture(s, kModeRelaxed) == kOk);
  CHECK(calls().event_record_flags(e, s, 0x1) == kOk);
  CHECK(end(s) == kOk);
  calls().event_destroy(e);
}

TEST_CASE("stand-in: cuGetProcAddress finds an entry point only in the ABI of a CUDA version that has it") {
  struct Case {
    const char* name;
    int too_old, enough;
  };
  for (Case k : {Case{"cuGraphInstantiateWithFlags", 11030, 11040}, Case{"cuUserObjectCreate", 11020, 11030},
                 Case{"cuEventRecordWithFlags", 11000, 11010}, Case{"cuStreamGetCaptureInfo", 11020, 11030},
                 Case{"cuThreadExchangeStreamCaptureMode", 10000, 10010}}) {
    CAPTURE(k.name);
    void* fn = nullptr;
    int status = -1;
    CHECK(cuGetProcAddress_v2(k.name, &fn, k.too_old, 0, &status) == kNotFound);
    CHECK(fn == nullptr);
    CHECK(status == 2);  // CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
    CHECK(cuGetProcAddress_v2(k.name, &fn, k.enough, 0, &status) == kOk);
    CHECK(fn != nullptr);
    CHECK(status == 0);
  }
  void* fn = nullptr;
  int status = -1;
  CHECK(cuGetProcAddress_v2("cuNoSuchCall", &fn, 13000, 0, &status) == kNotFound);
  CHECK(status == 1);  // CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
}

TEST_CASE("every entry point moecap resolves exists in the ABI of the oldest driver it accepts") {
  // kEntryPointsVersion is the floor of kMinDriverVersion whatever toolkit built the kernels.
  static_assert(moecap::cuda::kMinDriverVersion >= moecap::cuda::kEntryPointsVersion, "");
#define MOECAP_TEST_RESOLVE(name, params)                                                                \
  {                                                                                                     \
    void* fn = nullptr;                                                                                 \
    CHECK_MESSAGE(cuGetProcAddress_v2(#name, &fn, moecap::cuda::kEntryPointsVersion, 0, nullptr) == kOk, \
                  #name);                                                                               \
  }
  MOECAP_CUDA_ENTRY_POINTS(MOECAP_TEST_RESOLVE)
#undef MOECAP_TEST_RESOLVE
  void* fn = nullptr;
  CHECK(cuGetProcAddress_v2("cuStreamGetCaptureInfo", &fn, moecap::cuda::kCaptureInfoVersion, 0, nullptr) == kOk);
  // A CUDA 11.0 build asking for 11.0's ABI, as moecap did before the floor, finds none of these.
  CHECK(cuGetProcAddress_v2("cuGraphInstantiateWithFlags", &fn, 11000, 0, nullptr) == kNotFound);
}
