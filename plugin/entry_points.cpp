// SPDX-License-Identifier: Apache-2.0
// The C ABI. Every entry point runs its body inside `guarded`, which turns
// any exception into a status and thread-local text: nothing crosses the C
// boundary. Calls on one capturer serialize on its lock.
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "base/status.h"
#include "plugin/abi_structs.h"
#include "base/stream.h"
#include "plugin/guarded.h"
#include "plugin/handles.h"
#include "plugin/plan.h"

namespace moecap {
namespace {

thread_local std::string t_last_error;

Capturer& live(const moecap_capturer* h) {
  if (h == nullptr) fail(MOECAP_ERROR_INVALID_ARGUMENT, "capturer is NULL");
  if (h->magic != moecap_capturer::kLive || !h->impl) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "capturer is not a live handle (used after moecap_destroy?)");
  }
  return *h->impl;
}

moecap_graph& live(moecap_graph* g) {
  if (g == nullptr) fail(MOECAP_ERROR_INVALID_ARGUMENT, "graph is NULL");
  if (g->magic != moecap_graph::kLive || !g->graph) {
    fail(MOECAP_ERROR_INVALID_ARGUMENT, "graph is not a live handle (used after moecap_graph_destroy?)");
  }
  return *g;
}

template <class T>
void require_out(T* out, const char* name) {
  if (out == nullptr) fail(MOECAP_ERROR_INVALID_ARGUMENT, name, " is NULL");
}

// Debug builds keep a destroyed handle's shell, marked dead, so a later use
// is reported instead of reading freed memory. The shells stay reachable
// from a list, so leak checkers do not count them.
template <class Handle>
void retire(Handle* h) {
  h->magic = Handle::kDead;
#ifdef NDEBUG
  delete h;
#else
  static std::mutex mu;
  static std::vector<std::unique_ptr<Handle>> graveyard;
  std::lock_guard<std::mutex> lock(mu);
  graveyard.emplace_back(h);
#endif
}

}  // namespace

void set_last_error(const std::string& message) { t_last_error = message; }
const char* last_error() { return t_last_error.c_str(); }

}  // namespace moecap

using moecap::Capturer;
using moecap::EngineStream;
using moecap::fail;
using moecap::guarded;
using moecap::live;
using moecap::require_out;

extern "C" {

uint32_t moecap_abi_version(void) { return MOECAP_ABI_VERSION; }

const char* moecap_last_error(void) { return moecap::last_error(); }

const char* moecap_status_name(moecap_status status) {
  switch (status) {
    case MOECAP_OK: return "MOECAP_OK";
    case MOECAP_ERROR_INVALID_ARGUMENT: return "MOECAP_ERROR_INVALID_ARGUMENT";
    case MOECAP_ERROR_OUT_OF_RANGE: return "MOECAP_ERROR_OUT_OF_RANGE";
    case MOECAP_ERROR_CAPACITY: return "MOECAP_ERROR_CAPACITY";
    case MOECAP_ERROR_NO_DEVICE: return "MOECAP_ERROR_NO_DEVICE";
    case MOECAP_ERROR_DRIVER: return "MOECAP_ERROR_DRIVER";
    case MOECAP_ERROR_OUT_OF_MEMORY: return "MOECAP_ERROR_OUT_OF_MEMORY";
    case MOECAP_ERROR_ABI_MISMATCH: return "MOECAP_ERROR_ABI_MISMATCH";
    case MOECAP_ERROR_NOT_READY: return "MOECAP_ERROR_NOT_READY";
    case MOECAP_ERROR_CAPTURE_ILLEGAL: return "MOECAP_ERROR_CAPTURE_ILLEGAL";
    case MOECAP_ERROR_INTERNAL: return "MOECAP_ERROR_INTERNAL";
    case MOECAP_ERROR_ROWS_SKIPPED: return "MOECAP_ERROR_ROWS_SKIPPED";
    case MOECAP_ERROR_STUB_DRIVER: return "MOECAP_ERROR_STUB_DRIVER";
    case MOECAP_ERROR_DRIVER_TOO_OLD: return "MOECAP_ERROR_DRIVER_TOO_OLD";
    case MOECAP_ERROR_CORRUPTION: return "MOECAP_ERROR_CORRUPTION";
    case MOECAP_ERROR_NO_ROUTING: return "MOECAP_ERROR_NO_ROUTING";
  }
  return "MOECAP_STATUS_UNKNOWN";
}

moecap_status moecap_config_init(moecap_config* config) {
  return guarded("moecap_config_init", [&] {
    moecap::require_out_struct(config, MOECAP_CONFIG_SIZE_1_0, "config");
    // The caller's struct_size stays: a newer caller's fields past this
    // library's, set after this call, must reach moecap_plan/moecap_create's
    // check (ABI_MISMATCH), not be dropped by a struct_size cut to ours.
    const size_t caller_size = config->struct_size;
    moecap::write_struct(config, moecap::default_config());
    config->struct_size = caller_size;
  });
}

moecap_status moecap_plan(const moecap_config* config, moecap_plan_info* out) {
  return guarded("moecap_plan", [&] {
    moecap::require_out_struct(out, MOECAP_PLAN_INFO_SIZE_1_0, "out");
    const moecap::Plan plan = moecap::make_plan(config);
    moecap::describe_plan(plan, out);
  });
}

moecap_status moecap_create(const moecap_config* config, moecap_capturer** out) {
  return guarded("moecap_create", [&] {
    require_out(out, "out");
    const moecap::Plan plan = moecap::make_plan(config);
    auto handle = std::make_unique<moecap_capturer>();
    handle->impl = std::make_shared<Capturer>(plan);
    handle->impl->set_owner(handle->impl);
    *out = handle.release();
  });
}

moecap_status moecap_destroy(moecap_capturer* capturer) {
  if (capturer == nullptr) return MOECAP_OK;
  return guarded("moecap_destroy", [&] {
    Capturer& c = live(capturer);
    {
      std::unique_lock<std::mutex> lock(c.mutex());
      if (c.recording()) {
        fail(MOECAP_ERROR_CAPTURE_ILLEGAL, "the capturer is recording a graph; call moecap_graph_end first");
      }
      // Here, not only when the memory goes: exported views or graphs may
      // keep it long after the caller freed the tensors that commits and
      // side-stream work in flight still read.
      c.finish_work(&lock);
    }
    std::shared_ptr<Capturer> last = std::move(capturer->impl);
    moecap::retire(capturer);
    last.reset();  // frees memory unless exported views or graphs still hold it
  });
}

moecap_status moecap_get_plan(const moecap_capturer* capturer, moecap_plan_info* out) {
  return guarded("moecap_get_plan", [&] { moecap::describe_plan(live(capturer).plan(), out); });
}

moecap_status moecap_capture(moecap_capturer* capturer, int32_t layer, const DLTensor* topk_ids,
                             const DLTensor* topk_weights, void* stream) {
  return guarded("moecap_capture", [&] {
    Capturer& c = live(capturer);
    std::lock_guard<std::mutex> lock(c.mutex());
    c.capture(layer, topk_ids, topk_weights, EngineStream::from_abi(stream));
  });
}

moecap_status moecap_local_rows(const moecap_capturer* capturer, const moecap_batch* batch, moecap_rows* out) {
  return guarded("moecap_local_rows", [&] {
    moecap::require_out_struct(out, MOECAP_ROWS_SIZE_1_0, "out");
    moecap::write_struct(out, moecap::locate_rows(live(capturer).plan(), batch));
  });
}

moecap_status moecap_commit(moecap_capturer* capturer, const moecap_commit_args* args, void* stream) {
  return guarded("moecap_commit", [&] {
    Capturer& c = live(capturer);
    std::unique_lock<std::mutex> lock(c.mutex());
    c.commit(args, EngineStream::from_abi(stream), &lock);
  });
}

moecap_status moecap_invalidate(moecap_capturer* capturer, const DLTensor* slots, void* stream) {
  return guarded("moecap_invalidate", [&] {
    Capturer& c = live(capturer);
    std::unique_lock<std::mutex> lock(c.mutex());
    c.invalidate(slots, EngineStream::from_abi(stream), &lock);
  });
}

moecap_status moecap_join(moecap_capturer* capturer, void* stream) {
  return guarded("moecap_join", [&] {
    Capturer& c = live(capturer);
    std::lock_guard<std::mutex> lock(c.mutex());
    c.join(EngineStream::from_abi(stream));
  });
}

moecap_status moecap_read(moecap_capturer* capturer, const DLTensor* slots, DLTensor* ids_out,
                          DLTensor* weights_out, uint32_t flags, void* stream) {
  return guarded("moecap_read", [&] {
    Capturer& c = live(capturer);
    std::unique_lock<std::mutex> lock(c.mutex());
    c.read(slots, ids_out, weights_out, flags, EngineStream::from_abi(stream), &lock);
  });
}

moecap_status moecap_write(moecap_capturer* capturer, const DLTensor* slots, const DLTensor* ids,
                           const DLTensor* weights, void* stream) {
  return guarded("moecap_write", [&] {
    Capturer& c = live(capturer);
    std::unique_lock<std::mutex> lock(c.mutex());
    c.write(slots, ids, weights, EngineStream::from_abi(stream), &lock);
  });
}

moecap_status moecap_synchronize(moecap_capturer* capturer) {
  return guarded("moecap_synchronize", [&] {
    Capturer& c = live(capturer);
    std::unique_lock<std::mutex> lock(c.mutex());
    c.synchronize(&lock);
  });
}

moecap_status moecap_get_errors(moecap_capturer* capturer, moecap_error_counts* out, uint32_t flags) {
  return guarded("moecap_get_errors", [&] {
    Capturer& c = live(capturer);
    moecap::require_out_struct(out, MOECAP_ERROR_COUNTS_SIZE_1_0, "out");
    if ((flags & ~MOECAP_ERRORS_CLEAR) != 0) {
      fail(MOECAP_ERROR_INVALID_ARGUMENT, "flags has unknown bits 0x", std::hex, (flags & ~MOECAP_ERRORS_CLEAR));
    }
    std::unique_lock<std::mutex> lock(c.mutex());
    moecap::write_struct(out, c.errors((flags & MOECAP_ERRORS_CLEAR) != 0, &lock));
  });
}

moecap_status moecap_histogram_reset(moecap_capturer* capturer, void* stream) {
  return guarded("moecap_histogram_reset", [&] {
    Capturer& c = live(capturer);
    std::lock_guard<std::mutex> lock(c.mutex());
    c.histogram_reset(EngineStream::from_abi(stream));
  });
}

moecap_status moecap_export(moecap_capturer* capturer, int32_t which, int32_t layer,
                            DLManagedTensorVersioned** out) {
  return guarded("moecap_export", [&] {
    Capturer& c = live(capturer);
    require_out(out, "out");
    *out = moecap::export_versioned(capturer->impl, c.view(which, layer));
  });
}

moecap_status moecap_export_legacy(moecap_capturer* capturer, int32_t which, int32_t layer, DLManagedTensor** out) {
  return guarded("moecap_export_legacy", [&] {
    Capturer& c = live(capturer);
    require_out(out, "out");
    *out = moecap::export_legacy(capturer->impl, c.view(which, layer));
  });
}

moecap_status moecap_graph_begin(moecap_capturer* capturer, void* stream) {
  return guarded("moecap_graph_begin", [&] {
    Capturer& c = live(capturer);
    std::lock_guard<std::mutex> lock(c.mutex());
    c.graph_begin(EngineStream::from_abi(stream));
  });
}

moecap_status moecap_graph_end(moecap_capturer* capturer, moecap_graph** out) {
  return guarded("moecap_graph_end", [&] {
    Capturer& c = live(capturer);
    require_out(out, "out");
    auto handle = std::make_unique<moecap_graph>();
    std::lock_guard<std::mutex> lock(c.mutex());
    handle->graph = c.graph_end();
    handle->owner = capturer->impl;
    *out = handle.release();
  });
}

moecap_status moecap_graph_launch(moecap_graph* graph, void* stream) {
  return guarded("moecap_graph_launch", [&] {
    moecap_graph& g = live(graph);
    std::lock_guard<std::mutex> lock(g.owner->mutex());
    if (g.owner->recording()) {
      fail(MOECAP_ERROR_CAPTURE_ILLEGAL, "the capturer is recording a graph; replay after moecap_graph_end");
    }
    g.owner->join_before_replay(EngineStream::from_abi(stream));
    g.graph->launch(EngineStream::from_abi(stream));
  });
}

moecap_status moecap_graph_native(moecap_graph* graph, void** cu_graph) {
  return guarded("moecap_graph_native", [&] {
    moecap_graph& g = live(graph);
    require_out(cu_graph, "cu_graph");
    void* native = g.graph->native();
    if (native == nullptr) fail(MOECAP_ERROR_INVALID_ARGUMENT, "the host backend records no CUgraph");
    *cu_graph = native;
  });
}

moecap_status moecap_graph_destroy(moecap_graph* graph) {
  if (graph == nullptr) return MOECAP_OK;
  return guarded("moecap_graph_destroy", [&] {
    live(graph);
    graph->graph.reset();
    graph->owner.reset();
    moecap::retire(graph);
  });
}

moecap_status moecap_get_api(moecap_api* out) {
  return guarded("moecap_get_api", [&] {
    if (out == nullptr) fail(MOECAP_ERROR_INVALID_ARGUMENT, "out is NULL");
    const size_t minimum = offsetof(moecap_api, destroy) + sizeof(out->destroy);
    if (out->struct_size < minimum) {
      fail(MOECAP_ERROR_ABI_MISMATCH, "out->struct_size is ", out->struct_size, "; at least ", minimum,
           " is needed");
    }
    moecap_api api{};
    api.struct_size = sizeof(moecap_api);
    api.abi_version = MOECAP_ABI_VERSION;
    api.abi_version_fn = moecap_abi_version;
    api.last_error = moecap_last_error;
    api.status_name = moecap_status_name;
    api.plan = moecap_plan;
    api.create = moecap_create;
    api.destroy = moecap_destroy;
    api.get_plan = moecap_get_plan;
    api.capture = moecap_capture;
    api.local_rows = moecap_local_rows;
    api.commit = moecap_commit;
    api.read = moecap_read;
    api.write = moecap_write;
    api.synchronize = moecap_synchronize;
    api.get_errors = moecap_get_errors;
    api.histogram_reset = moecap_histogram_reset;
    api.export_versioned = moecap_export;
    api.export_legacy = moecap_export_legacy;
    api.graph_begin = moecap_graph_begin;
    api.graph_end = moecap_graph_end;
    api.graph_launch = moecap_graph_launch;
    api.graph_native = moecap_graph_native;
    api.graph_destroy = moecap_graph_destroy;
    api.config_init = moecap_config_init;
    api.invalidate = moecap_invalidate;
    api.join = moecap_join;
    // A caller compiled against an older header gets the prefix it knows.
    moecap::write_struct(out, api);
  });
}

}  // extern "C"
