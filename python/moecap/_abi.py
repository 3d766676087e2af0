"""ctypes mirror of abi/moecap.h and the DLPack structs it uses."""
import ctypes
import enum

c_int32, c_int64, c_uint32, c_uint64, c_size_t, c_void_p = (
    ctypes.c_int32, ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)

ABI_VERSION_MAJOR = 1
ABI_VERSION_MINOR = 0
ABI_VERSION = (ABI_VERSION_MAJOR << 16) | ABI_VERSION_MINOR

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST = 1, 2, 3
KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT = 0, 1, 2, 4

FLAG_HISTOGRAM, FLAG_GUARDS, FLAG_NO_GUARDS = 0x1, 0x2, 0x4
READ_NONBLOCKING = 0x1
ERRORS_CLEAR = 0x1
BATCH_EAGER, BATCH_GRAPH = 0, 1
DEVICE_HOST, DEVICE_CUDA = 1, 2
ID_DTYPES = {"auto": 0, "u8": 1, "u16": 2, "i32": 3}
WEIGHT_DTYPES = {None: 0, "f32": 1, "bf16": 2, "f16": 3}


class Status(enum.IntEnum):
    OK = 0
    INVALID_ARGUMENT = 1
    OUT_OF_RANGE = 2
    CAPACITY = 3
    NO_DEVICE = 4
    DRIVER = 5
    OUT_OF_MEMORY = 6
    ABI_MISMATCH = 7
    NOT_READY = 8
    CAPTURE_ILLEGAL = 9
    INTERNAL = 10
    ROWS_SKIPPED = 11
    STUB_DRIVER = 12
    DRIVER_TOO_OLD = 13
    CORRUPTION = 14


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(c_int64)),
        ("strides", ctypes.POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))),
]


class Config(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t), ("abi_version", c_uint32), ("flags", c_uint32),
        ("num_layers", c_int32), ("top_k", c_int32), ("extra_columns", c_int32), ("num_experts", c_int32),
        ("dp_size", c_int32), ("verify_tokens", c_int32),
        ("max_running_requests", c_int64), ("chunked_prefill_size", c_int64), ("max_graph_batch", c_int64),
        ("max_batch_tokens", c_int64), ("host_slots", c_int64),
        ("id_dtype", c_int32), ("weight_dtype", c_int32), ("device_type", c_int32), ("device_id", c_int32),
    ]


class PlanInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t), ("rows_per_rank", c_int64), ("device_rows", c_int64),
        ("row_elements", c_int64), ("id_dtype", c_int32), ("id_bytes", c_int32), ("weight_bytes", c_int32),
        ("reserved", c_int32), ("device_bytes", c_uint64), ("host_bytes", c_uint64),
    ]


class Batch(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t), ("mode", c_int32), ("dp_rank", c_int32), ("num_ranks", c_int32),
        ("reserved", c_int32), ("tokens_per_rank", ctypes.POINTER(c_int64)), ("padded_tokens_per_rank", c_int64),
    ]


class Rows(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("start", c_int64), ("count", c_int64), ("total", c_int64)]


class CommitArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t), ("src_start", c_int64),
        ("src_rows", ctypes.POINTER(DLTensor)), ("dst_slots", ctypes.POINTER(DLTensor)),
    ]


class ErrorCounts(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("skipped_rows", c_uint64), ("invalid_ids", c_uint64)]


def declare(lib):
    """Sets argtypes/restype of every function used."""
    P = ctypes.POINTER
    status = ctypes.c_int
    table = {
        "moecap_abi_version": (c_uint32, []),
        "moecap_last_error": (ctypes.c_char_p, []),
        "moecap_status_name": (ctypes.c_char_p, [status]),
        "moecap_plan": (status, [P(Config), P(PlanInfo)]),
        "moecap_create": (status, [P(Config), P(c_void_p)]),
        "moecap_destroy": (status, [c_void_p]),
        "moecap_get_plan": (status, [c_void_p, P(PlanInfo)]),
        "moecap_capture": (status, [c_void_p, c_int32, P(DLTensor), P(DLTensor), c_void_p]),
        "moecap_local_rows": (status, [c_void_p, P(Batch), P(Rows)]),
        "moecap_commit": (status, [c_void_p, P(CommitArgs), c_void_p]),
        "moecap_read": (status, [c_void_p, P(DLTensor), P(DLTensor), P(DLTensor), c_uint32, c_void_p]),
        "moecap_write": (status, [c_void_p, P(DLTensor), P(DLTensor), P(DLTensor), c_void_p]),
        "moecap_synchronize": (status, [c_void_p]),
        "moecap_get_errors": (status, [c_void_p, P(ErrorCounts), c_uint32]),
        "moecap_histogram_reset": (status, [c_void_p, c_void_p]),
        "moecap_export_legacy": (status, [c_void_p, c_int32, c_int32, P(P(DLManagedTensor))]),
        "moecap_graph_begin": (status, [c_void_p, c_void_p]),
        "moecap_graph_end": (status, [c_void_p, P(c_void_p)]),
        "moecap_graph_launch": (status, [c_void_p, c_void_p]),
        "moecap_graph_native": (status, [c_void_p, P(c_void_p)]),
        "moecap_graph_destroy": (status, [c_void_p]),
    }
    for name, (restype, argtypes) in table.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib
