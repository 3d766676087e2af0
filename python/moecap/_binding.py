"""The Capturer class and its helpers over the ctypes declarations in _abi."""
import ctypes
import os

from . import _abi
from ._abi import Status

BUFFERS = {
    "device_ids": 1, "device_weights": 2, "host_ids": 3, "host_weights": 4,
    "histogram": 5, "layer_ids": 6, "layer_weights": 7,
}

_lib = None


def library():
    """The loaded libmoecap.so (MOECAP_LIBRARY, else the loader's path)."""
    global _lib
    if _lib is None:
        path = os.environ.get("MOECAP_LIBRARY", "libmoecap.so")
        _lib = _abi.declare(ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL))
        if _lib.moecap_abi_version() >> 16 != _abi.ABI_VERSION_MAJOR:
            raise MoecapError(Status.ABI_MISMATCH, f"{path} implements ABI {_lib.moecap_abi_version() >> 16}.x; "
                              f"this binding speaks {_abi.ABI_VERSION_MAJOR}.x")
    return _lib


def abi_version():
    v = library().moecap_abi_version()
    return (v >> 16, v & 0xFFFF)


class MoecapError(RuntimeError):
    """A moecap call failed: ``status`` is the Status, the message says why."""

    def __init__(self, status, message):
        self.status = Status(status)
        super().__init__(f"{self.status.name}: {message}")


def _check(status):
    if status != 0:
        raise MoecapError(status, library().moecap_last_error().decode("utf-8", "replace"))


# --- Borrowing NumPy arrays and PyTorch tensors as DLTensors ---------------

_NUMPY_CODES = {"i": _abi.KDL_INT, "u": _abi.KDL_UINT, "f": _abi.KDL_FLOAT}


def _torch():
    try:
        import torch
        return torch
    except ImportError:  # pragma: no cover - torch is optional
        return None


class _Borrowed:
    """A DLTensor that describes `obj` in place; keeps `obj` alive."""

    def __init__(self, obj):
        self.obj = obj
        torch = _torch()
        import numpy as np
        if not isinstance(obj, np.ndarray) and not (torch is not None and isinstance(obj, torch.Tensor)) \
                and hasattr(obj, "__dlpack__"):
            # Any other DLPack producer (CuPy, JAX, ...): borrow its DLTensor without
            # consuming the capsule, whose own destructor frees it with this object.
            self._capsule = obj.__dlpack__()
            managed = ctypes.cast(_capsule_pointer(ctypes.c_void_p(id(self._capsule)), _DLTENSOR),
                                  ctypes.POINTER(_abi.DLManagedTensor))
            self.dl = managed.contents.dl_tensor
            return
        if torch is not None and isinstance(obj, torch.Tensor):
            data, shape, strides = obj.data_ptr(), tuple(obj.shape), tuple(obj.stride())
            dtype = _torch_dtype(obj.dtype)
            device = (_abi.KDL_CUDA, obj.device.index or 0) if obj.is_cuda else (_abi.KDL_CPU, 0)
        else:
            arr = obj if isinstance(obj, np.ndarray) else np.asarray(obj)
            self.obj = arr
            item = arr.dtype.itemsize
            data, shape = arr.ctypes.data, arr.shape
            strides = tuple(s // item for s in arr.strides)
            if arr.dtype.kind not in _NUMPY_CODES:
                raise TypeError(f"unsupported dtype {arr.dtype}")
            dtype = (_NUMPY_CODES[arr.dtype.kind], item * 8)
            device = (_abi.KDL_CPU, 0)
        ndim = len(shape)
        self._shape = (ctypes.c_int64 * max(ndim, 1))(*shape)
        self._strides = (ctypes.c_int64 * max(ndim, 1))(*strides)
        self.dl = _abi.DLTensor(
            data or None, _abi.DLDevice(*device), ndim, _abi.DLDataType(dtype[0], dtype[1], 1),
            self._shape, self._strides, 0)

    def ref(self):
        return ctypes.pointer(self.dl)


def _torch_dtype(dt):
    torch = _torch()
    table = {
        torch.int8: (_abi.KDL_INT, 8), torch.uint8: (_abi.KDL_UINT, 8), torch.int16: (_abi.KDL_INT, 16),
        torch.int32: (_abi.KDL_INT, 32), torch.int64: (_abi.KDL_INT, 64), torch.float16: (_abi.KDL_FLOAT, 16),
        torch.float32: (_abi.KDL_FLOAT, 32), torch.bfloat16: (_abi.KDL_BFLOAT, 16),
    }
    if dt not in table:
        raise TypeError(f"unsupported dtype {dt}")
    return table[dt]


def _borrow(obj):
    return None if obj is None else _Borrowed(obj)


def _ref(b):
    return None if b is None else b.ref()


def _stream(stream):
    """None, an int handle, or anything with .cuda_stream (torch.cuda.Stream)."""
    if stream is None:
        return None
    return ctypes.c_void_p(int(getattr(stream, "cuda_stream", stream)))


# --- DLPack views going out --------------------------------------------------

_DLTENSOR = b"dltensor"
_Destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _Destructor]
_capsule_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_valid.restype = ctypes.c_int
_capsule_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]


def _release_managed(address):
    m = ctypes.cast(address, ctypes.POINTER(_abi.DLManagedTensor))
    if m.contents.deleter:
        m.contents.deleter(m)


@_Destructor
def _capsule_destructor(capsule):
    # A consumer that took the tensor renamed the capsule "used_dltensor" and
    # owns the deleter call; an unconsumed capsule still owns it.
    if _capsule_valid(capsule, _DLTENSOR):
        _release_managed(_capsule_pointer(capsule, _DLTENSOR))


class DLPackView:
    """A zero-copy view of a moecap buffer, for numpy/torch ``from_dlpack``.

    It keeps the capturer's memory alive until consumed and released, even
    after ``Capturer.close()``. It can be consumed once.
    """

    def __init__(self, managed):
        self._managed = managed
        t = managed.contents.dl_tensor
        self.device = (t.device.device_type, t.device.device_id)
        self.shape = tuple(t.shape[i] for i in range(t.ndim))
        self.strides = tuple(t.strides[i] for i in range(t.ndim))

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        # A legacy capsule: consumers asking for a versioned one accept it (DLPack 1.0).
        if self._managed is None:
            raise BufferError("this DLPackView was already consumed")
        address = ctypes.cast(self._managed, ctypes.c_void_p).value
        self._managed = None
        return _capsule_new(address, _DLTENSOR, _capsule_destructor)

    def __del__(self):
        if getattr(self, "_managed", None) is not None:
            _release_managed(ctypes.cast(self._managed, ctypes.c_void_p).value)
            self._managed = None


# --- Capturer ------------------------------------------------------------------

def _config(num_layers, top_k, num_experts, host_slots, max_running_requests, extra_columns=0, dp_size=1,
            verify_tokens=1, chunked_prefill_size=0, max_graph_batch=0, max_batch_tokens=0, id_dtype="auto",
            weight_dtype=None, device="cpu", histogram=False, guards=None):
    c = _abi.Config()
    c.struct_size = ctypes.sizeof(_abi.Config)
    c.abi_version = _abi.ABI_VERSION
    c.flags = (_abi.FLAG_HISTOGRAM if histogram else 0) | (
        0 if guards is None else _abi.FLAG_GUARDS if guards else _abi.FLAG_NO_GUARDS)
    c.num_layers, c.top_k, c.extra_columns, c.num_experts = num_layers, top_k, extra_columns, num_experts
    c.dp_size, c.verify_tokens = dp_size, verify_tokens
    c.max_running_requests, c.chunked_prefill_size = max_running_requests, chunked_prefill_size
    c.max_graph_batch, c.max_batch_tokens, c.host_slots = max_graph_batch, max_batch_tokens, host_slots
    c.id_dtype = _abi.ID_DTYPES[id_dtype]
    c.weight_dtype = _abi.WEIGHT_DTYPES[weight_dtype]
    device = str(device)
    if device == "cpu":
        c.device_type, c.device_id = _abi.DEVICE_HOST, 0
    elif device.startswith("cuda"):
        c.device_type = _abi.DEVICE_CUDA
        c.device_id = int(device.split(":")[1]) if ":" in device else 0
    else:
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', not {device!r}")
    return c


def _plan_dict(info):
    return {name: getattr(info, name) for name, _ in _abi.PlanInfo._fields_ if name not in ("struct_size", "reserved")}


def plan(**config):
    """The layout for a configuration (same keywords as Capturer), without allocating."""
    info = _abi.PlanInfo(struct_size=ctypes.sizeof(_abi.PlanInfo))
    _check(library().moecap_plan(ctypes.byref(_config(**config)), ctypes.byref(info)))
    return _plan_dict(info)


class Graph:
    """A moecap-owned graph: replay with launch(); close() frees it."""

    def __init__(self, handle, keep):
        self._handle = handle
        self._keep = keep  # the tensors whose addresses the graph baked

    def launch(self, stream=None):
        _check(library().moecap_graph_launch(self._handle, _stream(stream)))

    def native(self):
        """The CUgraph (CUDA backend) to embed as a child graph node."""
        out = ctypes.c_void_p()
        _check(library().moecap_graph_native(self._handle, ctypes.byref(out)))
        return out.value

    def close(self):
        if self._handle:
            _check(library().moecap_graph_destroy(self._handle))
            self._handle = None
            self._keep = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass


class Capturer:
    """One routed-experts capturer (see abi/moecap.h for every operation).

    Keywords: num_layers, top_k, num_experts, host_slots, max_running_requests,
    extra_columns, dp_size, verify_tokens, chunked_prefill_size, max_graph_batch,
    max_batch_tokens, id_dtype ('auto', 'u8', 'u16', 'i32'), weight_dtype (None,
    'f32', 'bf16', 'f16'), device ('cpu' or 'cuda:N'), histogram, guards.
    """

    def __init__(self, **config):
        self.config = dict(config)
        self._handle = ctypes.c_void_p()
        _check(library().moecap_create(ctypes.byref(_config(**config)), ctypes.byref(self._handle)))
        info = _abi.PlanInfo(struct_size=ctypes.sizeof(_abi.PlanInfo))
        _check(library().moecap_get_plan(self._handle, ctypes.byref(info)))
        self.plan = _plan_dict(info)
        self._recording = None

    # lifetime
    def close(self):
        if self._handle:
            _check(library().moecap_destroy(self._handle))
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_handle", None):
            try:
                library().moecap_destroy(self._handle)
            except Exception:  # interpreter shutdown
                pass
            self._handle = None

    def _h(self):
        if not self._handle:
            raise MoecapError(Status.INVALID_ARGUMENT, "the capturer is closed")
        return self._handle

    # capture path
    def capture(self, layer, topk_ids, topk_weights=None, stream=None):
        ids, w = _borrow(topk_ids), _borrow(topk_weights)
        _check(library().moecap_capture(self._h(), layer, ids.ref(), _ref(w), _stream(stream)))
        self._keep(ids, w)

    def local_rows(self, dp_rank, tokens_per_rank, padded_tokens_per_rank=None):
        """(start, count, total) of this rank's rows; graph layout when padded is given."""
        tokens = (ctypes.c_int64 * len(tokens_per_rank))(*tokens_per_rank)
        graph = padded_tokens_per_rank is not None
        batch = _abi.Batch(ctypes.sizeof(_abi.Batch), _abi.BATCH_GRAPH if graph else _abi.BATCH_EAGER, dp_rank,
                           len(tokens_per_rank), 0, tokens, padded_tokens_per_rank or 0)
        rows = _abi.Rows(struct_size=ctypes.sizeof(_abi.Rows))
        _check(library().moecap_local_rows(self._h(), ctypes.byref(batch), ctypes.byref(rows)))
        return rows.start, rows.count, rows.total

    def commit(self, dst_slots, src_start=0, src_rows=None, stream=None):
        slots, rows = _borrow(dst_slots), _borrow(src_rows)
        args = _abi.CommitArgs(ctypes.sizeof(_abi.CommitArgs), src_start, _ref(rows), slots.ref())
        _check(library().moecap_commit(self._h(), ctypes.byref(args), _stream(stream)))
        self._keep(slots, rows)

    def histogram_reset(self, stream=None):
        _check(library().moecap_histogram_reset(self._h(), _stream(stream)))

    # host side
    def read(self, slots, dtype=None, out=None, weights_out=None, nonblocking=False, stream=None):
        """Rows of `slots` (host) as [T, num_layers, top_k]; returns out (and weights_out if given).

        `out` may be a CUDA tensor on the capturer's GPU: it is filled on `stream`."""
        import numpy as np
        torch = _torch()
        if out is None:
            n = len(slots)
            shape = (n, self.config["num_layers"], self.config["top_k"])
            if torch is not None and isinstance(slots, torch.Tensor):
                out = torch.empty(shape, dtype=dtype or torch.int32)
            else:
                out = np.empty(shape, dtype=dtype or np.int32)
        s, o, w = _borrow(slots), _borrow(out), _borrow(weights_out)
        flags = _abi.READ_NONBLOCKING if nonblocking else 0
        _check(library().moecap_read(self._h(), s.ref(), o.ref(), _ref(w), flags, _stream(stream)))
        return out if weights_out is None else (out, weights_out)

    def write(self, slots, ids, weights=None, stream=None):
        s, i, w = _borrow(slots), _borrow(ids), _borrow(weights)
        _check(library().moecap_write(self._h(), s.ref(), i.ref(), _ref(w), _stream(stream)))

    def synchronize(self):
        _check(library().moecap_synchronize(self._h()))

    def errors(self, clear=False):
        e = _abi.ErrorCounts(struct_size=ctypes.sizeof(_abi.ErrorCounts))
        _check(library().moecap_get_errors(self._h(), ctypes.byref(e), _abi.ERRORS_CLEAR if clear else 0))
        return {"skipped_rows": e.skipped_rows, "invalid_ids": e.invalid_ids}

    def export(self, which, layer=0):
        """A DLPackView of a buffer: 'device_ids', 'host_ids', 'layer_ids', 'histogram', ..."""
        managed = ctypes.POINTER(_abi.DLManagedTensor)()
        _check(library().moecap_export_legacy(self._h(), BUFFERS[which], layer, ctypes.byref(managed)))
        return DLPackView(managed)

    # graphs
    def graph_begin(self, stream=None):
        _check(library().moecap_graph_begin(self._h(), _stream(stream)))
        self._recording = []

    def graph_end(self):
        handle = ctypes.c_void_p()
        _check(library().moecap_graph_end(self._h(), ctypes.byref(handle)))
        keep, self._recording = self._recording, None
        return Graph(handle, keep)

    def _keep(self, *borrowed):
        # A graph bakes tensor addresses: hold the tensors while it lives.
        if self._recording is not None:
            self._recording.extend(b.obj for b in borrowed if b is not None)
