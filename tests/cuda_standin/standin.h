/* SPDX-License-Identifier: Apache-2.0 */
// A stand-in CUDA driver for CI machines without a GPU: a shared library
// that MOECAP_LIBCUDA names, implementing the Driver API subset moecap uses
// with CUDA's asynchronous semantics on the CPU, so orchestration bugs
// (ordering, lifetime, capture mode, which event means what) fail in CI.
//
// What it models:
// - Streams are queues (0 and CU_STREAM_LEGACY the legacy stream,
//   CU_STREAM_PER_THREAD each calling thread's own); nothing runs until the host waits (cuStreamSynchronize,
//   cuEventSynchronize, a pageable device-to-host copy) or a test calls
//   standin_run. A wait runs exactly what it must: the waited stream up to the
//   point, and the streams it waits on (cuStreamWaitEvent) up to theirs.
// - cuMemcpyHtoDAsync from pageable memory snapshots the source at the call;
//   from pinned memory (cuMemHostAlloc) it reads the source when it runs.
//   Kernels read pinned memory when they run.
// - An event means its latest record: cuEventSynchronize/cuEventQuery look at
//   the record enqueued last, on whatever stream.
// - Stream capture: operations on a capturing stream become graph nodes, in
//   order. Capture modes follow the Programming Guide: in the calling thread's
//   mode (cuThreadExchangeStreamCaptureMode, default global), a potentially
//   unsafe call (allocation, host wait, event query, module load) made while
//   this thread captures (not relaxed), or, in global mode, while another
//   thread captures in global mode, returns
//   CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates those captures.
//   Frees (cuMemFree, cuMemFreeHost) and cuModuleUnload are unsafe calls too.
//   Synchronizing or querying a capturing stream, or an event whose latest
//   record is a node of a capture, fails and invalidates that capture in any
//   mode. CU_EVENT_RECORD_EXTERNAL outside a capture is CUDA_ERROR_INVALID_VALUE.
//   cuStreamEndCapture from another thread than the beginning one fails with
//   CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD unless the capture is relaxed.
//   Pageable copies and waits on events recorded outside the capture are
//   refused inside a capture.
// - Plain event records inside a capture are internal dependencies; external
//   ones (CU_EVENT_RECORD_EXTERNAL) become nodes that record at every launch.
// - Fork and join inside a capture: a stream that waits on an event recorded
//   in a capture joins it as a branch. At each launch a branch gets a queue
//   of its own, made to wait for the origin where it forked, and runs only
//   when a join (the origin waiting on an event recorded on the branch) or a
//   host wait orders it: the latest schedule CUDA allows, so a join placed
//   after the engine's next write to what the branch reads shows as wrong
//   rows. Ending a capture with a branch whose last node the origin does not
//   wait for fails with CUDA_ERROR_STREAM_CAPTURE_UNJOINED. (Only joins into
//   the origin count; a branch joining another branch is not modeled.)
// - Graphs: instantiate, launch, child-graph nodes (cloned, with the child's
//   user-object references), user objects whose destructors run on a
//   separate callback thread, where any driver call is a violation.
// - cuLaunchKernel dispatches moecap's kernels by name to their host twins
//   (graphs/), with the parameter struct copied at the launch. The commit
//   kernel's rows run in reverse order (one-row host-twin commits, skipping
//   rows whose slot a later entry claimed), one legal GPU schedule, so a
//   result that depends on the order of duplicate slots shows.
// - Freed device and pinned memory is never reused: a kernel whose parameters
//   point into it is skipped and recorded as a violation. An event used after
//   cuEventDestroy is a violation too, and the call returns
//   CUDA_ERROR_INVALID_HANDLE.
//
// What it cannot model: real concurrency between streams and the host (a
// stream runs only inside a host wait or standin_run, so a race shows only
// in the schedule a test forces), memory coherence and partial writes
// (copies are atomic, kernels run whole), the legacy default stream's implicit synchronization, timing,
// and the kernels' device code itself (their host twins run instead).
//
// - cuGetProcAddress finds an entry point only for a CUDA version at or after
//   the one that introduced it (the ABI asked for), as the real driver does.
//
// Environment: STANDIN_DRIVER_VERSION (default 13000), STANDIN_MODULE_LOAD_ERROR
// (a CUresult cuModuleLoadData returns; default 0), STANDIN_EXIT_CHECK (an exit
// handler registered at cuInit after which any driver call ends the process
// with status 70), STANDIN_SLOW_FREE_MS and STANDIN_SLOW_USER_OBJECT_MS (a
// cuMemFree, or a user object's destructor, that waits that long first;
// standin_set_slow_free_ms overrides the first).
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st* StandinStream;

// A Driver API entry point by name (as cuGetProcAddress resolves it), or NULL.
void* standin_entry(const char* name);

// The "GPU" catches up: runs every queued operation on every stream.
void standin_run_all(void);
// Runs one stream (and what it waits on) until its queue is empty.
void standin_run_stream(StandinStream stream);
// Operations queued on `stream` and not yet run.
int64_t standin_pending(StandinStream stream);
// Called at the start of every host wait (cuStreamSynchronize,
// cuEventSynchronize, pageable device-to-host copy), on the waiting thread,
// before the driver's lock is taken: "meanwhile", the hook may call the
// driver, or start threads that call moecap and wait for them. NULL removes it.
void standin_set_wait_hook(void (*hook)(void*), void* arg);
// Violations seen so far (kernels touching freed memory, driver calls from a
// user-object destructor, ...), and the first one's text ("" if none).
int64_t standin_violations(void);
const char* standin_first_violation(void);
// Host waits on events created without CU_EVENT_BLOCKING_SYNC (spin waits).
int64_t standin_spin_waits(void);
// Waits until every user-object destructor the driver started has finished.
void standin_drain_callbacks(void);
// Live user objects (created, not yet destroyed).
int64_t standin_live_user_objects(void);
// Live events (created, not yet destroyed) and live device and pinned allocations.
int64_t standin_live_events(void);
int64_t standin_live_allocations(void);
// The next cuLaunchKernel of `kernel` (its name in the fatbin) returns
// `result` (a CUresult) and launches nothing, as a launch the driver refuses;
// NULL cancels.
void standin_fail_next_launch(const char* kernel, int result);
// The next cuEventSynchronize returns `result` (a CUresult) and waits for
// nothing, as a wait the driver fails; 0 cancels.
void standin_fail_next_event_sync(int result);
// cuMemFree waits `ms` milliseconds before it starts (0: not at all; -1: as
// STANDIN_SLOW_FREE_MS says, the default).
void standin_set_slow_free_ms(int ms);
// Whether [p, p + bytes) lies in live pinned memory from cuMemHostAlloc.
int standin_is_pinned(const void* p, uint64_t bytes);

#ifdef __cplusplus
}
#endif
