/* SPDX-License-Identifier: Apache-2.0 */
/*
 * moecap.h - C ABI of libmoecap.so, the routed-experts capturer for
 * Mixture-of-Experts inference engines.
 *
 * An engine loads libmoecap.so (dlopen, or links it), creates one capturer
 * per model per engine process (one process per attention-DP rank), and per
 * forward pass:
 *   1. moecap_capture(layer, topk_ids[, topk_weights]) in every MoE layer,
 *      inside or outside the engine's CUDA graph: rows [0, n) of that layer
 *      in the device buffer;
 *   2. moecap_local_rows(batch) on the host: where this rank's tokens sit;
 *   3. moecap_commit(rows, slots) after the forward, on the same stream:
 *      those rows go to the host cache, indexed by the token's KV slot;
 * when a request finishes, moecap_read(its slots) into a caller tensor, and
 * when the engine frees KV slots, moecap_invalidate(them): a slot that holds
 * no committed routing reads as -1, never as an expert id.
 *
 * Conventions for every function:
 * - Returns a moecap_status. On any status but MOECAP_OK nothing was changed
 *   (no buffer, no counter, no output) and moecap_last_error() says which
 *   argument was wrong and what the limit was.
 * - No C++ exception and no signal crosses this boundary.
 * - Every struct passed across starts with `struct_size`, which the caller
 *   sets to sizeof(the struct) as compiled against its header; a minor
 *   version only appends fields (and functions). The library accepts any
 *   struct_size from the struct's 1.0 size (MOECAP_*_SIZE_1_0 below) up:
 *   fields an older caller's struct lacks take their default (zero), and a
 *   struct the library fills is written only up to min(struct_size, the
 *   library's size), with struct_size set to what was written. A struct the
 *   caller fills with a struct_size above what the library knows (a newer
 *   caller) is accepted only if every byte past the library's size is zero
 *   (fields this library does not know are left at their defaults) and it
 *   is at most 4096 bytes past that size; otherwise, or below the 1.0 size,
 *   the call fails with MOECAP_ERROR_ABI_MISMATCH naming the struct.
 * - Tensors passed in are borrowed `DLTensor*`: the struct is only read
 *   during the call; its *data* is read or written by the operation, on
 *   `stream`, so the caller keeps that memory valid until the enqueued work
 *   ran, and for as long as a graph that recorded the call may replay (a
 *   graph bakes the address and reads the contents at each replay). Shapes
 *   and strides are in elements; NULL strides means compact row-major;
 *   byte_offset is honoured.
 * - `stream` is a CUstream: the engine's stream, on which moecap enqueues its
 *   work and nothing else (NULL is the legacy default stream, accepted where
 *   the engine itself runs there; moecap never uses it on its own). The host
 *   backend ignores it. While recording a moecap graph it must be the
 *   recording stream.
 * - Thread safety: every call on one capturer takes that capturer's lock, so
 *   calls from several threads are safe and serialize; different capturers
 *   share nothing. No call holds the lock while it blocks on the host: a
 *   wait for commits, reads or the engine's stream (read, write,
 *   synchronize, get_errors), for a snapshot entry (an eager commit or
 *   invalidate with host lists, a read into GPU tensors) or for moecap's
 *   own copies of its counters and guard bytes (read, write, synchronize,
 *   get_errors) releases it while it sleeps and takes it again after, so
 *   another thread's capture or commit never waits behind a monitoring
 *   thread's get_errors. A capture of the call's stream that another
 *   thread begins meanwhile makes an eager commit, invalidate or GPU read
 *   still to be queued return MOECAP_ERROR_CAPTURE_ILLEGAL. Calls racing
 *   on the same slots from several threads are ordered by the engine, not
 *   by the lock.
 *   moecap_destroy is the exception: it frees the handle, so the caller
 *   makes sure no other call on that capturer is in progress or follows
 *   (the Python package's close() waits for its other threads' calls).
 *   Using a capturer after moecap_destroy is undefined behaviour (debug builds
 *   detect it and return MOECAP_ERROR_INVALID_ARGUMENT).
 * - fork(): a capturer and its graphs belong to the process that created
 *   them. The child of a fork must not call moecap on them, moecap_destroy
 *   included: a thread of the parent may hold the lock at the fork, and on
 *   CUDA the context does not cross it. The child creates its own (the
 *   Python package refuses the parent's objects there and leaks them on
 *   close).
 */
#ifndef MOECAP_H_
#define MOECAP_H_

#include <stddef.h>
#include <stdint.h>

#include "moecap_dlpack.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define MOECAP_API
#else
#define MOECAP_API __attribute__((visibility("default")))
#endif

/* ABI version: major in the high 16 bits, minor in the low 16 bits. A major
 * bump breaks compatibility; a minor bump only appends fields or functions.
 * The release is MAJOR.MINOR.PATCH, PATCH counting releases that change no
 * interface. These three lines are the only place the version is written:
 * CMake's project version (so the SONAME libmoecap.so.MAJOR), moecap.pc, the
 * CMake package's version file and the Python wheel's version are read from
 * them. */
#define MOECAP_ABI_VERSION_MAJOR 1
#define MOECAP_ABI_VERSION_MINOR 1
#define MOECAP_VERSION_PATCH 0
#define MOECAP_ABI_VERSION ((uint32_t)((MOECAP_ABI_VERSION_MAJOR << 16) | MOECAP_ABI_VERSION_MINOR))

/* ------------------------------------------------------------------------ */
/* Status codes                                                             */
/* ------------------------------------------------------------------------ */

typedef enum {
  MOECAP_OK = 0,
  MOECAP_ERROR_INVALID_ARGUMENT = 1, /* NULL, wrong dtype/device/ndim/strides, bad enum */
  MOECAP_ERROR_OUT_OF_RANGE = 2,     /* a layer, rank or slot outside its range */
  MOECAP_ERROR_CAPACITY = 3,         /* a batch or tensor larger than the plan holds */
  MOECAP_ERROR_NO_DEVICE = 4,        /* CUDA asked for: no driver library or no GPU */
  MOECAP_ERROR_DRIVER = 5,           /* the CUDA driver returned an error */
  MOECAP_ERROR_OUT_OF_MEMORY = 6,    /* an allocation failed (at create; on CUDA also an event a call creates) */
  MOECAP_ERROR_ABI_MISMATCH = 7,     /* struct_size, major ABI version or record version unknown */
  MOECAP_ERROR_NOT_READY = 8,        /* non-blocking read: commits still in flight */
  MOECAP_ERROR_CAPTURE_ILLEGAL = 9,  /* call not allowed while a graph is captured */
  MOECAP_ERROR_INTERNAL = 10,        /* a bug in moecap; please report */
  MOECAP_ERROR_ROWS_SKIPPED = 11,    /* commits/invalidations read at run time skipped rows (moecap_get_errors) */
  MOECAP_ERROR_STUB_DRIVER = 12,     /* libcuda.so.1 is the toolkit's stub, not a driver */
  MOECAP_ERROR_DRIVER_TOO_OLD = 13,  /* the driver lacks an entry point moecap needs */
  MOECAP_ERROR_CORRUPTION = 14,      /* a guard canary was overwritten (MOECAP_FLAG_GUARDS) */
  MOECAP_ERROR_NO_ROUTING = 15       /* MOECAP_READ_STRICT: a slot read holds no usable routing (1.1) */
} moecap_status;

/* Bytes of a struct up to and including `field`: how the named 1.0 sizes
 * below are computed, and how a caller can pass an older layout. */
#define MOECAP_STRUCT_SIZE(type, field) (offsetof(type, field) + sizeof(((type*)0)->field))

/* ------------------------------------------------------------------------ */
/* Enumerations used in the structs (stored as int32_t fields)              */
/* ------------------------------------------------------------------------ */

/* Dtype of expert ids, chosen separately for the host cache (id_dtype) and
 * the device buffer (device_id_dtype).
 * Host cache: AUTO picks the narrowest that holds num_experts +
 * extra_columns ids: U8 up to 256, U16 up to 65536, else I32. An explicit
 * dtype must hold num_experts ids (extra columns are not stored): U8 serves
 * 256 routed experts plus a fused shared expert.
 * Device buffer: what a top-k kernel writes into a MOECAP_BUFFER_LAYER_IDS
 * view. AUTO picks I16 up to 32768 experts (ids 0..32767), else I32. An
 * explicit dtype must hold num_experts ids and a value that is none (U8 up
 * to 255 experts, U16 up to 65535, I16 up to 32768: -1), so an id out of range at capture stays
 * recognisable until commit narrows the rows into the host cache. */
typedef enum {
  MOECAP_IDS_AUTO = 0,
  MOECAP_IDS_U8 = 1,
  MOECAP_IDS_U16 = 2,
  MOECAP_IDS_I32 = 3,
  MOECAP_IDS_I16 = 4 /* 1.1 */
} moecap_id_dtype;

/* Stored dtype of routing weights; NONE captures no weights. */
typedef enum {
  MOECAP_WEIGHTS_NONE = 0,
  MOECAP_WEIGHTS_F32 = 1,
  MOECAP_WEIGHTS_BF16 = 2,
  MOECAP_WEIGHTS_F16 = 3
} moecap_weight_dtype;

/* Where the device buffer lives; values equal DLPack's DLDeviceType. */
typedef enum {
  MOECAP_DEVICE_HOST = 1, /* kDLCPU: the host backend, plain memory */
  MOECAP_DEVICE_CUDA = 2  /* kDLCUDA: the CUDA backend (Driver API) */
} moecap_device_type;

/* moecap_config.flags */
#define MOECAP_FLAG_HISTOGRAM 0x1u /* keep a [layers, num_experts] int64 expert-load histogram */
#define MOECAP_FLAG_GUARDS 0x2u    /* 64 canary bytes after every buffer, checked by read, write,
                                      synchronize and get_errors, and (the host cache's only, on
                                      CUDA; not while recording) by capture, commit, invalidate;
                                      not by destroy, which frees them */
#define MOECAP_FLAG_NO_GUARDS 0x4u /* turn off guards where a build enables them by default */
/* Side stream (1.1): capture, commit, invalidate and histogram_reset leave
 * the engine's stream. Each call forks: an event recorded on `stream`, a
 * stream of moecap's waits for it, and the work runs there (inside the
 * engine's capture this is a branch of the engine's graph, off its critical
 * path). Nothing joins back until moecap_join, so until the engine calls
 * moecap_join on a stream, it must not write, free or reuse on that stream
 * (or any stream ordered after it) any tensor a forked call reads: topk_ids
 * and topk_weights of moecap_capture, device dst_slots / src_rows of commit
 * and invalidate, the MOECAP_BUFFER_LAYER_* views commit reads. Host index
 * tensors are copied at the call as without the flag. A capture of the
 * engine's must call moecap_join before it ends (CUDA refuses to end a
 * capture with an unjoined branch); moecap_graph_end joins by itself.
 * Eager forked calls and the forked calls of a graph replay run on
 * different streams of moecap's: moecap_graph_launch joins the eager ones
 * into `stream` first, and an engine launching its own graph that contains
 * forked calls calls moecap_join on that stream before the launch if it made
 * eager forked calls since its last join (e.g. moecap_invalidate of slots
 * the replay commits to). Host calls (read, write, synchronize,
 * get_errors, destroy) wait for forked work as for any commit. The host
 * backend models the ordering: forked work runs at the join (or at a host
 * call), never at the call. A library without this flag (1.0) refuses it as
 * an unknown bit of config->flags. */
#define MOECAP_FLAG_SIDE_STREAM 0x8u

/* ------------------------------------------------------------------------ */
/* Configuration and plan                                                   */
/* ------------------------------------------------------------------------ */

/* Everything moecap needs to size its buffers once, before any graph.
 * Owner: the caller; read only during moecap_plan / moecap_create.
 * Start from moecap_config_init, which sets every default below. */
typedef struct moecap_config {
  size_t struct_size;    /* sizeof(moecap_config) */
  uint32_t abi_version;  /* MOECAP_ABI_VERSION; only its major is checked */
  uint32_t flags;        /* MOECAP_FLAG_* */
  int32_t num_layers;    /* MoE layers captured; layer ids are [0, num_layers) */
  int32_t top_k;         /* routed experts kept per token */
  int32_t extra_columns; /* columns after top_k that the router emits (fused shared
                            experts): accepted at capture, then dropped; >= 0 */
  int32_t num_experts;   /* routed experts; stored ids are [0, num_experts) */
  int32_t dp_size;       /* attention data-parallel ranks whose tokens the MoE
                            layers see gathered; 1 without DP attention */
  int32_t verify_tokens; /* tokens per request in a speculative verify pass; 1 without */
  int64_t max_running_requests; /* scheduler bound on requests per rank */
  int64_t chunked_prefill_size; /* tokens per prefill chunk per rank */
  int64_t max_graph_batch;      /* largest captured CUDA-graph batch, in requests */
  int64_t max_batch_tokens;     /* engine's own bound on tokens per forward per rank
                                   where its scheduler exceeds the terms above (prefill
                                   graphs, mixed prefill+decode); 0 if none */
  int64_t host_slots;           /* rows of the host cache: KV slots incl. padding slot */
  int32_t id_dtype;             /* moecap_id_dtype */
  int32_t weight_dtype;         /* moecap_weight_dtype */
  int32_t device_type;          /* moecap_device_type */
  int32_t device_id;            /* CUDA ordinal; 0 for the host backend (anything else
                                   is refused) */
  /* ---- 1.1 ---- */
  const void* next;             /* extension chain: NULL (no extension is defined yet;
                                   anything else is refused) */
  int32_t device_id_dtype;      /* moecap_id_dtype of the device buffer (AUTO: I16/I32) */
  int32_t reserved;             /* 0 */
} moecap_config;

/* Sizes of the 1.0 structs: the smallest struct_size the library accepts. */
#define MOECAP_CONFIG_SIZE_1_0 MOECAP_STRUCT_SIZE(moecap_config, device_id)

/* What a config costs. Filled by moecap_plan / moecap_get_plan; the caller
 * owns it and sets struct_size. The bytes are those of the buffers named
 * below; they exclude guard canaries, 256-byte alignment between regions,
 * bookkeeping (an error word, a step stamp per layer), the host backend's
 * rounding of blocks of 2 MiB or more to whole huge pages, and the CUDA
 * backend's own state: 8 x host_slots device bytes of commit claims and a
 * pinned ring of 8 x 16 x device_rows bytes. */
typedef struct moecap_plan_info {
  size_t struct_size;      /* sizeof(moecap_plan_info); set to the bytes filled */
  int64_t rows_per_rank;   /* max(chunked_prefill, max_running*verify,
                              max_graph_batch*verify, max_batch_tokens) */
  int64_t device_rows;     /* dp_size * rows_per_rank: rows of the device buffer */
  int64_t row_elements;    /* num_layers * top_k: ids per row */
  int32_t id_dtype;        /* resolved moecap_id_dtype of the host cache (never AUTO) */
  int32_t id_bytes;        /* bytes per host-cache id: 1, 2 or 4 */
  int32_t weight_bytes;    /* bytes per weight: 0 (no weights), 2 or 4 */
  int32_t reserved;        /* 0 */
  uint64_t device_bytes;   /* device ids + weights + histogram */
  uint64_t host_bytes;     /* host cache ids + weights + one state byte per slot */
  /* ---- 1.1 ---- */
  int32_t device_id_dtype; /* resolved moecap_id_dtype of the device buffer (never AUTO) */
  int32_t device_id_bytes; /* bytes per device id: 1, 2 or 4 */
} moecap_plan_info;

#define MOECAP_PLAN_INFO_SIZE_1_0 MOECAP_STRUCT_SIZE(moecap_plan_info, host_bytes)

/* Opaque handles. */
typedef struct moecap_capturer moecap_capturer;
typedef struct moecap_graph moecap_graph;

/* ------------------------------------------------------------------------ */
/* Library                                                                  */
/* ------------------------------------------------------------------------ */

/* MOECAP_ABI_VERSION of the loaded library. Any thread. */
MOECAP_API uint32_t moecap_abi_version(void);

/* Message of the last failed call on this thread ("" if none). Thread-local;
 * valid until the next moecap call on this thread. Never NULL. */
MOECAP_API const char* moecap_last_error(void);

/* Static name of a status ("MOECAP_ERROR_CAPACITY"). Never NULL. */
MOECAP_API const char* moecap_status_name(moecap_status status);

/* Fills the caller's config with every default: abi_version, flags 0,
 * extra_columns 0, dp_size 1, verify_tokens 1, chunked_prefill_size,
 * max_graph_batch and max_batch_tokens 0, AUTO id dtypes, no weights,
 * MOECAP_DEVICE_HOST, device 0, next NULL; the model and scheduler fields
 * (num_layers, top_k, num_experts, max_running_requests, host_slots) are 0
 * and must be set. The caller sets struct_size first, and only that many
 * bytes are written (of a newer caller's bigger struct, the fields this
 * library knows; struct_size is left as set, so a newer field set afterwards
 * is refused by moecap_plan / moecap_create with ABI_MISMATCH, not ignored):
 *   moecap_config c = {0}; c.struct_size = sizeof c; moecap_config_init(&c);
 * Any thread. (1.1) */
MOECAP_API moecap_status moecap_config_init(moecap_config* config);

/* Computes the layout for `config` without allocating. Any thread. */
MOECAP_API moecap_status moecap_plan(const moecap_config* config, moecap_plan_info* out);

/* ------------------------------------------------------------------------ */
/* Capturer lifetime                                                        */
/* ------------------------------------------------------------------------ */

/* Allocates every buffer of the plan (the device ids "no routing": -1, all
 * ones in an unsigned dtype; every other buffer zeroed) and, for CUDA, loads the
 * driver and kernels on the primary context of config->device_id. *out is
 * set only on MOECAP_OK. Call it before capturing graphs: an allocation the
 * driver refuses because a capture is in progress is reported as
 * MOECAP_ERROR_CAPTURE_ILLEGAL. Any thread. */
MOECAP_API moecap_status moecap_create(const moecap_config* config, moecap_capturer** out);

/* Releases the handle. NULL is a no-op returning MOECAP_OK. Memory stays
 * alive while exported DLPack views of it exist (their deleters free it),
 * and, on CUDA, while any CUgraph or CUgraphExec holding moecap's nodes
 * exists (the engine's captures, moecap graphs, their child-graph clones):
 * each holds a CUDA user object, and the memory is freed, on a thread of
 * moecap's, once the driver releases the last of them (a CUDA capturer
 * keeps this library loaded until the process ends, so a dlclose before
 * then does not unmap it); reads into GPU
 * tensors still queued on their streams finish before the memory they
 * gather from is freed (the freeing waits for them), as do captures and
 * histogram resets still queued on the engine's streams, which write the
 * memory freed. Before it returns,
 * the commits and side-stream calls still pending have run (host) or
 * finished (CUDA), so the caller may free the tensors they read, even while
 * views or graphs keep the memory. Illegal while the capturer records a graph. Legal while another
 * thread captures a graph (in any capture mode): every free and unload runs
 * in relaxed capture mode, on whichever thread releases the memory, so it
 * never invalidates that capture. The events of commits recorded in a graph
 * are freed with that graph (once the driver releases its last copy and
 * its last replay completed), so recapturing graphs does not grow them. */
MOECAP_API moecap_status moecap_destroy(moecap_capturer* capturer);

/* The plan the capturer was created with. */
MOECAP_API moecap_status moecap_get_plan(const moecap_capturer* capturer, moecap_plan_info* out);

/* ------------------------------------------------------------------------ */
/* Capture path (legal inside a CUDA graph capture)                         */
/* ------------------------------------------------------------------------ */

/* Copies one layer's routing into device rows [0, n) of that layer:
 *   topk_ids     [n, top_k] or [n, top_k + extra_columns], int32 or int64
 *                (or the layer's own rows below, in the device dtype),
 *                compact row-major, on the capturer's device (host memory
 *                for the host backend). Extra columns are dropped; ids
 *                outside [0, num_experts) are stored as "no expert" (a value
 *                the device dtype keeps apart from every id) and, but for
 *                -1, counted (moecap_get_errors); moecap_read returns them
 *                as -1.
 *   topk_weights NULL, or the same shape, float32/bfloat16/float16; required
 *                iff weight_dtype != NONE. Converted to the stored dtype.
 * Neither may lie in the capturer's device buffer (an exported device or
 * layer view: INVALID_ARGUMENT), but for exactly this layer's own rows in
 * their stored dtype and width (rows [0, n) of its MOECAP_BUFFER_LAYER_IDS
 * view), which a top-k kernel may have written there: checked, counted and
 * stamped in place, as captured rows are.
 * n <= device_rows, checked here on the host, so a check made at graph
 * capture holds for every replay. With MOECAP_FLAG_HISTOGRAM the same kernel
 * adds each kept id to histogram[layer][id]. Enqueued on `stream`.
 * Steps: the first moecap_capture after a commit of rows starts a step; the
 * commits that follow before the next capture (any number: a prefill part,
 * a decode part, accepted verify rows) end it. An empty commit ends it too:
 * a DP rank without tokens in a step commits an empty dst_slots. A commit
 * reads layer L of a row as routing only if moecap_capture wrote that row of L in the current
 * step (rows [0, n) of any capture of L since the step began; n may be 0,
 * which starts a step like any capture); any other row
 * of L (another DP rank's row of an earlier step, a layer skipped this step,
 * rows past a smaller batch) commits as "no routing" (see moecap_commit).
 * Enqueued on `stream`; the bookkeeping is device memory, so captures and
 * commits recorded in graphs keep it at every replay. It is one record per
 * capturer: a step's captures and commits must be ordered with each other
 * (one stream, or streams the engine joins, as a forward pass is); commits of
 * rows running concurrently on unjoined streams may drop each other's rows.
 * A top-k kernel may instead write a layer's ids (and weights) straight into
 * the MOECAP_BUFFER_LAYER_IDS (_WEIGHTS) view: commit checks every id. A
 * layer never passed to moecap_capture is such a layer: moecap cannot see
 * which of its rows a step wrote, so every row of it counts as written, and
 * the kernel must write, every step, every row it wants committed in that
 * layer (commit consumes rows; at dp >= 2 also the other ranks' rows, which
 * this rank's commits never consume). */
MOECAP_API moecap_status moecap_capture(moecap_capturer* capturer, int32_t layer,
                                        const DLTensor* topk_ids, const DLTensor* topk_weights,
                                        void* stream);

/* How a forward batch lays out the gathered rows the MoE layers see. */
typedef enum {
  MOECAP_BATCH_EAGER = 0, /* ranks packed back to back: prefix sum of tokens */
  MOECAP_BATCH_GRAPH = 1  /* rank r at r * padded_tokens_per_rank */
} moecap_batch_mode;

/* A forward batch, as the engine's scheduler knows it on the host.
 * Owner: the caller; read only during the call. */
typedef struct moecap_batch {
  size_t struct_size;             /* sizeof(moecap_batch) */
  int32_t mode;                   /* moecap_batch_mode */
  int32_t dp_rank;                /* this process's rank, [0, dp_size) */
  int32_t num_ranks;              /* entries in tokens_per_rank; must equal dp_size */
  int32_t reserved;               /* 0; anything else is INVALID_ARGUMENT */
  const int64_t* tokens_per_rank; /* host array [num_ranks]: real tokens per rank */
  int64_t padded_tokens_per_rank; /* GRAPH: rows each rank occupies (the graph's
                                     token count); every real count <= it. EAGER: 0 */
} moecap_batch;

#define MOECAP_BATCH_SIZE_1_0 MOECAP_STRUCT_SIZE(moecap_batch, padded_tokens_per_rank)

/* This rank's slice of a gathered batch. Owner: the caller, who sets
 * struct_size; moecap_local_rows fills the rest and keeps no reference. */
typedef struct moecap_rows {
  size_t struct_size; /* sizeof(moecap_rows), set by the caller */
  int64_t start;      /* first device row of this rank's tokens */
  int64_t count;      /* this rank's real tokens */
  int64_t total;      /* rows the gathered batch occupies: the n of moecap_capture */
} moecap_rows;

#define MOECAP_ROWS_SIZE_1_0 MOECAP_STRUCT_SIZE(moecap_rows, total)

/* Computes this rank's rows from `batch`. Pure host arithmetic; fails with
 * MOECAP_ERROR_CAPACITY when the gathered batch would not fit device_rows.
 * Legal at any time, also while recording a graph. */
MOECAP_API moecap_status moecap_local_rows(const moecap_capturer* capturer, const moecap_batch* batch,
                                           moecap_rows* out);

/* Which device rows go to which host slots. Owner: the caller. The struct
 * itself is read only during moecap_commit; the tensors it points to live as
 * moecap_commit says (host lists copied at the call, device lists read when
 * the commit runs). */
typedef struct moecap_commit_args {
  size_t struct_size;        /* sizeof(moecap_commit_args) */
  int64_t src_start;         /* with src_rows NULL: rows [src_start, src_start + count);
                                with src_rows given: not read (src_rows names the rows) */
  const DLTensor* src_rows;  /* NULL, or [count] int32/int64 device rows (accepted
                                speculative tokens, in any order) */
  const DLTensor* dst_slots; /* [count] int32/int64 host-cache slots; count is its
                                length. Slot -1 drops the row (padding, rejected
                                drafts). A slot listed twice gets the row of its
                                last entry whose row is in range. Host memory,
                                or device memory on CUDA (in a graph on CUDA:
                                device memory only, see moecap_commit). Neither
                                list may lie in the capturer's device buffer. */
} moecap_commit_args;

#define MOECAP_COMMIT_ARGS_SIZE_1_0 MOECAP_STRUCT_SIZE(moecap_commit_args, dst_slots)

/* Copies rows of the device buffer (all layers, ids and weights) to the host
 * cache at the given slots, stream-ordered after the forward on `stream`,
 * narrowing ids from the device dtype to the host cache's: an id outside
 * [0, num_experts) there (no expert at capture, or a bad value a kernel
 * wrote into a layer view) is stored as "no expert" and marks the slot
 * MOECAP_SLOT_INVALID_IDS. Every slot written becomes MOECAP_SLOT_VALID.
 * Rows are consumed by commit: every device row a commit names (whatever
 * its slot) is reset, in every layer, to "no routing" (-1 in a signed
 * device dtype, all ones in an unsigned one; weights 0), which is also what
 * every row holds after create. So the device views show -1 after a
 * commit. And a commit takes from each layer only rows captured in the
 * current step (see moecap_capture, "Steps"): with DP attention each rank
 * commits only its own rows of the gathered batch, and the other ranks'
 * rows, never consumed here, stop counting once the next step begins. So
 * every row a step wrote is unusable after that step's commits, whichever
 * rank committed it; a row not written in every layer in its step commits
 * as VALID | INVALID_IDS (its unwritten layers read -1, weight 0), never as
 * expert 0 or as an earlier request's routing. A device id outside
 * [0, num_experts) other than that code (a bad value a kernel wrote) is
 * counted in invalid_ids, per entry that reads it for a slot (not for slot
 * -1; an entry whose slot a later entry takes is read and counted by the
 * host backend, skipped by CUDA's). A row listed twice is read twice, then
 * consumed.
 * A slot listed twice gets the row of its last entry whose slot and row are
 * in range (on every backend; an entry skipped at run time leaves the slot
 * to the entry before it).
 * Slots whose values the host can see now (host tensors, outside a graph)
 * are checked here: one outside [-1, host_slots) fails with OUT_OF_RANGE and
 * nothing is written. Slots read at run time (device tensors, graph replays)
 * outside that range are skipped and counted; the next moecap_read /
 * moecap_write / moecap_synchronize then returns MOECAP_ERROR_ROWS_SKIPPED
 * until moecap_get_errors clears the count. Outside a graph, host slots and
 * rows (pageable or pinned) are copied at the call: the caller may refill
 * them at once. In a graph on CUDA (the engine's capture or a moecap graph)
 * slots and rows must be device tensors, read at each replay: host memory,
 * pinned (kDLCUDAHost, or pin_memory's kDLCPU) too, fails with
 * MOECAP_ERROR_CAPTURE_ILLEGAL, since a replay would read what the host
 * holds then, after the engine refilled its pinned lists for a later step;
 * copy them to a device tensor on the stream instead. (The host backend's
 * graphs read host memory at each replay.) An eager commit is ordered on
 * the GPU after earlier reads of its slots into GPU tensors (any stream);
 * a moecap_graph_launch after every earlier such read. */
MOECAP_API moecap_status moecap_commit(moecap_capturer* capturer, const moecap_commit_args* args,
                                       void* stream);

/* ------------------------------------------------------------------------ */
/* Host side (read, write, synchronize, get_errors: illegal during graph     */
/* capture; invalidate, join and histogram_reset are legal in a graph)      */
/* ------------------------------------------------------------------------ */

#define MOECAP_READ_NONBLOCKING 0x1u /* return NOT_READY instead of waiting */
#define MOECAP_READ_STRICT 0x2u      /* fail with NO_ROUTING unless every id read is a real one (1.1) */

/* What each host-cache slot holds (MOECAP_BUFFER_HOST_STATES, one byte per
 * slot). Every slot is EMPTY after create; commit and write set VALID (plus
 * INVALID_IDS when the row holds an id that is no real id: out of range at
 * capture, or a layer not written since the row's previous commit);
 * moecap_invalidate sets EMPTY again. (1.1) */
#define MOECAP_SLOT_EMPTY 0x0u
#define MOECAP_SLOT_VALID 0x1u
#define MOECAP_SLOT_INVALID_IDS 0x2u

/* Gathers the host cache rows of `slots` ([T] int32/int64, host memory,
 * every value in [0, host_slots)) into ids_out ([T, num_layers, top_k],
 * compact, dtype uint8/int8/uint16/int16/int32/int64) and, if non-NULL,
 * weights_out (same shape, float32/bfloat16/float16).
 * No value read can be mistaken for real routing:
 * - an EMPTY slot (never committed, or invalidated) reads -1 for every id
 *   and 0 for every weight;
 * - an id that was out of range at capture, or a layer no kernel wrote
 *   since the row's previous commit, reads -1 with weight 0; where the host cache
 *   dtype has no spare value (U8 with 256 experts, U16 with 65536), such a
 *   token reads like an EMPTY one (-1 ids, 0 weights), since which of its
 *   ids were bad is not stored;
 * - -1 in an unsigned output is all ones, so uint8 (uint16) outputs need
 *   num_experts < 256 (65536), unless MOECAP_READ_STRICT.
 * A token has no usable routing when its slot is EMPTY or INVALID_IDS,
 * i.e. when any id it reads is -1 (every -1 comes with weight 0). With
 * MOECAP_READ_STRICT such a slot fails the call with
 * MOECAP_ERROR_NO_ROUTING (naming the first such entry and the count) and
 * nothing is written; STRICT needs the slots' states on the host, so it
 * waits for the commits in flight as a host output does.
 * Host outputs: waits first for the commits in flight that may write
 * `slots` (eager commits to those slots, every commit recorded in a graph),
 * or with MOECAP_READ_NONBLOCKING returns NOT_READY while one is; filled
 * before the call returns. Outputs on the capturer's GPU (both, or neither):
 * a kernel enqueued on `stream`, ordered there after those commits (the
 * host does not wait for it, only for moecap's own copies of its error
 * counters and guard bytes and, when the ring of slot snapshots is busy,
 * for an earlier call's entry: a request of more than 2 * device_rows
 * slots is read in pieces, one entry each; ready in stream order); later
 * eager commits and
 * invalidations of those slots, and moecap_graph_launch, are ordered after
 * it, whatever their stream (an engine replaying its own graph that commits
 * to those slots orders the replay after `stream` itself). The waits
 * release the capturer's lock: other calls proceed meanwhile, and a
 * commit of these slots made then lands between two pieces (after the
 * pieces queued before it, before the rest), never during one; a graph
 * recording begun on `stream` then makes the read return
 * MOECAP_ERROR_CAPTURE_ILLEGAL, nothing of it recorded (pieces queued
 * before the recording began still run, tracked as a read's). ids_out and
 * weights_out share no byte with `slots`, each other, the host cache (an
 * exported host view) or the device buffer (a device, layer or histogram
 * view, whose rows a later commit would take): INVALID_ARGUMENT otherwise. */
MOECAP_API moecap_status moecap_read(moecap_capturer* capturer, const DLTensor* slots, DLTensor* ids_out,
                                     DLTensor* weights_out, uint32_t flags, void* stream);

/* The inverse of moecap_read: stores rows captured elsewhere (a prefill
 * instance under prefill/decode disaggregation) at `slots` (host memory).
 * ids: [T, layers, top_k], any integer dtype moecap_read accepts, values in
 * [0, num_experts) or -1 (all ones in uint8 / uint16 when that is no expert
 * id, as moecap_read writes it); weights required iff the capturer keeps weights.
 * A token whose ids are all -1 makes its slot EMPTY; one with some -1 ids
 * VALID | INVALID_IDS; any other VALID. A slot listed twice keeps the last.
 * ids and weights may be host memory or on the capturer's GPU; device inputs
 * are read after `stream` finished writing them (the call synchronizes it).
 * Every value is checked before anything is stored; slots, ids and weights
 * share no byte with the host cache (INVALID_ARGUMENT otherwise). Waits
 * first for the commits in flight to `slots` and for earlier reads of them
 * into GPU tensors. */
MOECAP_API moecap_status moecap_write(moecap_capturer* capturer, const DLTensor* slots, const DLTensor* ids,
                                      const DLTensor* weights, void* stream);

/* Marks `slots` EMPTY (the engine freed their KV), so a later read returns
 * -1 for them until a commit or write fills them again. slots: [n]
 * int32/int64, host memory or on the capturer's GPU; -1 entries are
 * ignored. Stream-ordered on `stream` after earlier commits; legal in a graph
 * (recorded like a commit: device slots are read at each replay; host slots
 * are refused there on CUDA, as for moecap_commit). Host-visible
 * slots outside [-1, host_slots) fail with OUT_OF_RANGE, nothing changed;
 * device slots out of range are skipped and counted as skipped_rows. (1.1) */
MOECAP_API moecap_status moecap_invalidate(moecap_capturer* capturer, const DLTensor* slots, void* stream);

/* Joins moecap's side stream back into `stream` (MOECAP_FLAG_SIDE_STREAM):
 * work enqueued on `stream` after this call runs after every capture,
 * commit, invalidate and histogram_reset forked so far (on the CUDA backend,
 * a wait on an event recorded on the side stream; inside a capture, a join
 * edge of the engine's graph). Call it before the engine next writes, frees
 * or reuses a tensor a forked call read, e.g. once per forward after
 * moecap_commit, and before ending a capture that contains forked calls.
 * Legal in graphs (an edge from moecap's branch back to `stream`); a no-op
 * (MOECAP_OK) without the flag, and inside a capture that forked nothing
 * since its last join. While this capturer records a graph, `stream` must
 * be the recording stream, as for every call (INVALID_ARGUMENT otherwise,
 * flag or not). (1.1) */
MOECAP_API moecap_status moecap_join(moecap_capturer* capturer, void* stream);

/* Waits until every enqueued commit has landed in the host cache (on CUDA,
 * and every capture and histogram reset enqueued outside a graph has run). */
MOECAP_API moecap_status moecap_synchronize(moecap_capturer* capturer);

/* Counters of problems found where no status could be returned (inside
 * kernels and graph replays). Owner: the caller, who sets struct_size;
 * moecap_get_errors fills the rest and keeps no reference. */
typedef struct moecap_error_counts {
  size_t struct_size;     /* sizeof(moecap_error_counts), set by the caller */
  uint64_t skipped_rows;  /* committed rows (or invalidated slots) whose slot was outside
                             [-1, host_slots), or whose source row was outside
                             [0, device_rows) */
  uint64_t invalid_ids;   /* ids outside [0, num_experts) given to capture, or
                             written so into a layer view (counted at commit);
                             -1 is not counted: it is the "no expert" code
                             engines give padded rows */
} moecap_error_counts;

#define MOECAP_ERROR_COUNTS_SIZE_1_0 MOECAP_STRUCT_SIZE(moecap_error_counts, invalid_ids)

#define MOECAP_ERRORS_CLEAR 0x1u /* reset both counters after reading them */

/* Waits for in-flight commits, then reports (and optionally clears) the
 * counters; clearing reads and zeroes each counter in one atomic step, so
 * replays running meanwhile lose no count. */
MOECAP_API moecap_status moecap_get_errors(moecap_capturer* capturer, moecap_error_counts* out,
                                           uint32_t flags);

/* Zeroes the histogram, enqueued on `stream` (legal in a graph). Fails with
 * INVALID_ARGUMENT without MOECAP_FLAG_HISTOGRAM. */
MOECAP_API moecap_status moecap_histogram_reset(moecap_capturer* capturer, void* stream);

/* ------------------------------------------------------------------------ */
/* DLPack export                                                            */
/* ------------------------------------------------------------------------ */

/* Every view is compact row-major. The device buffer is layer-major, so one
 * layer's rows are contiguous; the host cache is slot-major, so one
 * request's rows are. */
typedef enum {
  MOECAP_BUFFER_DEVICE_IDS = 1,     /* [num_layers, device_rows, top_k], device id dtype */
  MOECAP_BUFFER_DEVICE_WEIGHTS = 2, /* [num_layers, device_rows, top_k], stored weight dtype */
  MOECAP_BUFFER_HOST_IDS = 3,       /* [host_slots, num_layers, top_k], host id dtype */
  MOECAP_BUFFER_HOST_WEIGHTS = 4,   /* [host_slots, num_layers, top_k] */
  MOECAP_BUFFER_HISTOGRAM = 5,      /* [num_layers, num_experts] int64 */
  MOECAP_BUFFER_LAYER_IDS = 6,      /* [device_rows, top_k]: one layer of the device ids,
                                       for a top-k kernel's out= (rows [0, n) of a batch) */
  MOECAP_BUFFER_LAYER_WEIGHTS = 7,  /* the same for weights */
  MOECAP_BUFFER_HOST_STATES = 8     /* [host_slots] uint8 MOECAP_SLOT_* (1.1) */
} moecap_buffer;

/* Zero-copy view of a buffer. `layer` selects the layer for LAYER_* and is
 * ignored otherwise. The view has byte_offset 0 and non-NULL shape and
 * strides; the device buffers report the capturer's device (kDLCUDA or
 * kDLCPU), the host cache kDLCPU (pinned on CUDA). Every buffer starts at
 * least 64-byte aligned; a LAYER_* view starts layer * device_rows * top_k
 * elements into its buffer, so it is as aligned as that offset makes it (a
 * kernel storing 16 bytes at a time checks the view's address, or the plan
 * makes device_rows * top_k * element bytes a multiple of 16). The view keeps the
 * capturer's memory alive: call its deleter exactly once, from any thread,
 * before or after moecap_destroy. Legal during graph capture (no device work). */
MOECAP_API moecap_status moecap_export(moecap_capturer* capturer, int32_t which, int32_t layer,
                                       DLManagedTensorVersioned** out);

/* The same view as a legacy (pre-1.0) DLManagedTensor. */
MOECAP_API moecap_status moecap_export_legacy(moecap_capturer* capturer, int32_t which, int32_t layer,
                                              DLManagedTensor** out);

/* ------------------------------------------------------------------------ */
/* Plugin-owned graphs                                                      */
/* ------------------------------------------------------------------------ */

/* Starts recording moecap operations issued on this capturer. CUDA: begins a
 * stream capture on `stream` (relaxed mode: moecap_graph_end may come from
 * another thread, and other threads' calls never break it; NULL refused); the capture, commit, invalidate,
 * join and histogram_reset calls that follow are recorded there (export and
 * local_rows stay legal and record nothing). Host: the same calls are
 * recorded with every argument baked (pointers, shapes, row offsets,
 * slot-tensor addresses) and not run. While recording, destroy, read,
 * write, synchronize, get_errors, a second graph_begin and the launch of
 * this capturer's graphs return CAPTURE_ILLEGAL. */
MOECAP_API moecap_status moecap_graph_begin(moecap_capturer* capturer, void* stream);

/* Ends recording into a new graph (*out, owned by the caller). A failed call
 * during recording records nothing. The graph keeps the capturer alive. */
MOECAP_API moecap_status moecap_graph_end(moecap_capturer* capturer, moecap_graph** out);

/* Replays the graph on `stream` (any stream of the capturer's GPU, NULL,
 * the legacy default stream, too): every recorded operation runs against
 * what memory holds now, with the arguments baked at record time. With
 * MOECAP_FLAG_SIDE_STREAM, `stream` first joins the eager forked work. */
MOECAP_API moecap_status moecap_graph_launch(moecap_graph* graph, void* stream);

/* The recorded CUgraph (CUDA backend), owned by the moecap_graph, to embed as
 * a child graph node. MOECAP_ERROR_INVALID_ARGUMENT on the host backend. */
MOECAP_API moecap_status moecap_graph_native(moecap_graph* graph, void** cu_graph);

/* Frees the graph. NULL is a no-op. Legal while another thread captures a
 * graph (the frees run in relaxed capture mode). */
MOECAP_API moecap_status moecap_graph_destroy(moecap_graph* graph);

/* ------------------------------------------------------------------------ */
/* Single-symbol table                                                      */
/* ------------------------------------------------------------------------ */

/* Every function above, for hosts that dlsym one symbol. Fields appended
 * only. Owner: the caller; the function pointers stay valid while the
 * library stays loaded. */
typedef struct moecap_api {
  size_t struct_size;   /* set by the caller; the library fills what fits */
  uint32_t abi_version; /* written by the library: its MOECAP_ABI_VERSION */
  uint32_t reserved;    /* written by the library: 0 */
  uint32_t (*abi_version_fn)(void);
  const char* (*last_error)(void);
  const char* (*status_name)(moecap_status);
  moecap_status (*plan)(const moecap_config*, moecap_plan_info*);
  moecap_status (*create)(const moecap_config*, moecap_capturer**);
  moecap_status (*destroy)(moecap_capturer*);
  moecap_status (*get_plan)(const moecap_capturer*, moecap_plan_info*);
  moecap_status (*capture)(moecap_capturer*, int32_t, const DLTensor*, const DLTensor*, void*);
  moecap_status (*local_rows)(const moecap_capturer*, const moecap_batch*, moecap_rows*);
  moecap_status (*commit)(moecap_capturer*, const moecap_commit_args*, void*);
  moecap_status (*read)(moecap_capturer*, const DLTensor*, DLTensor*, DLTensor*, uint32_t, void*);
  moecap_status (*write)(moecap_capturer*, const DLTensor*, const DLTensor*, const DLTensor*, void*);
  moecap_status (*synchronize)(moecap_capturer*);
  moecap_status (*get_errors)(moecap_capturer*, moecap_error_counts*, uint32_t);
  moecap_status (*histogram_reset)(moecap_capturer*, void*);
  moecap_status (*export_versioned)(moecap_capturer*, int32_t, int32_t, DLManagedTensorVersioned**);
  moecap_status (*export_legacy)(moecap_capturer*, int32_t, int32_t, DLManagedTensor**);
  moecap_status (*graph_begin)(moecap_capturer*, void*);
  moecap_status (*graph_end)(moecap_capturer*, moecap_graph**);
  moecap_status (*graph_launch)(moecap_graph*, void*);
  moecap_status (*graph_native)(moecap_graph*, void**);
  moecap_status (*graph_destroy)(moecap_graph*);
  /* ---- 1.1 ---- */
  moecap_status (*config_init)(moecap_config*);
  moecap_status (*invalidate)(moecap_capturer*, const DLTensor*, void*);
  moecap_status (*join)(moecap_capturer*, void*);
} moecap_api;

#define MOECAP_API_SIZE_1_0 MOECAP_STRUCT_SIZE(moecap_api, graph_destroy)

/* Fills *out (out->struct_size set by the caller, at least up to `destroy`);
 * out->struct_size becomes the bytes filled. */
MOECAP_API moecap_status moecap_get_api(moecap_api* out);

#ifdef __cplusplus
}
#endif

#endif /* MOECAP_H_ */
