"""moecap from Python: capture the routed experts of MoE models.

A ``Capturer`` takes NumPy arrays, PyTorch tensors (CPU or CUDA), JAX or CuPy
arrays, or any other DLPack producer, and hands them to libmoecap.so in place,
without copies, through a native extension (``moecap._moecap``). Buffers come
back as zero-copy ``DLPackView`` objects that ``numpy.from_dlpack``,
``torch.from_dlpack`` and ``jax.dlpack.from_dlpack`` consume. A failed call
raises ``MoecapError`` (``.status``, and a message naming the argument and the
limit). For CUDA capturers ``stream=None`` means torch's current stream.

In code that ``torch.compile`` traces, call ``capturer.ops.capture(...)`` /
``.commit(...)``: torch.library custom ops (``moecap.ops``) with fake
implementations and declared mutations, so the compiled graph does not break.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any, Optional

from . import _moecap
from ._errors import MoecapError, Status
from ._moecap import DLPackView, Graph

__all__ = ["BUFFERS", "Capturer", "DLPackView", "Graph", "MoecapError", "RecordError", "RequestTable",
           "RoutedExperts", "SLOT_EMPTY", "SLOT_INVALID_IDS", "SLOT_VALID", "Status", "abi_version", "batch_slots",
           "commit_batch", "engine", "hf", "plan", "record", "write_routed"]

#: moecap_buffer values by name, for Capturer.export.
BUFFERS = {
    "device_ids": 1, "device_weights": 2, "host_ids": 3, "host_weights": 4,
    "histogram": 5, "layer_ids": 6, "layer_weights": 7, "host_states": 8,
}
ID_DTYPES = {"auto": 0, "u8": 1, "u16": 2, "i32": 3, "i16": 4}
WEIGHT_DTYPES = {None: 0, "f32": 1, "bf16": 2, "f16": 3}
FLAG_HISTOGRAM, FLAG_GUARDS, FLAG_NO_GUARDS, FLAG_SIDE_STREAM = 0x1, 0x2, 0x4, 0x8
DEVICE_HOST, DEVICE_CUDA = 1, 2
#: What a host-cache slot holds (Capturer.slot_states): bits of MOECAP_SLOT_*.
SLOT_EMPTY, SLOT_VALID, SLOT_INVALID_IDS = 0x0, 0x1, 0x2

if _moecap.abi_version() >> 16 != _moecap.ABI_VERSION >> 16:  # pragma: no cover - a mismatched install
    raise ImportError(f"libmoecap.so implements ABI {_moecap.abi_version() >> 16}.x; "
                      f"moecap._moecap was built for {_moecap.ABI_VERSION >> 16}.x")


def abi_version() -> tuple[int, int]:
    """(major, minor) of the loaded libmoecap.so."""
    v = _moecap.abi_version()
    return (v >> 16, v & 0xFFFF)


def _config(num_layers: int, top_k: int, num_experts: int, host_slots: int, max_running_requests: int,
            extra_columns: int = 0, dp_size: int = 1, verify_tokens: int = 1, chunked_prefill_size: int = 0,
            max_graph_batch: int = 0, max_batch_tokens: int = 0, id_dtype: str = "auto",
            device_id_dtype: str = "auto", weight_dtype: Optional[str] = None, device: Any = "cpu",
            histogram: bool = False, guards: Optional[bool] = None, side_stream: bool = False) -> _moecap.Config:
    c = _moecap.Config()  # moecap_config_init: the library's defaults
    c.flags = (FLAG_HISTOGRAM if histogram else 0) | (
        0 if guards is None else FLAG_GUARDS if guards else FLAG_NO_GUARDS) | (
        FLAG_SIDE_STREAM if side_stream else 0)
    c.num_layers, c.top_k, c.extra_columns, c.num_experts = num_layers, top_k, extra_columns, num_experts
    c.dp_size, c.verify_tokens = dp_size, verify_tokens
    c.max_running_requests, c.chunked_prefill_size = max_running_requests, chunked_prefill_size
    c.max_graph_batch, c.max_batch_tokens, c.host_slots = max_graph_batch, max_batch_tokens, host_slots
    for name, value in (("id_dtype", id_dtype), ("device_id_dtype", device_id_dtype)):
        if value not in ID_DTYPES:
            raise ValueError(f"{name} must be one of {sorted(ID_DTYPES)}, not {value!r}")
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {list(WEIGHT_DTYPES)}, not {weight_dtype!r}")
    c.id_dtype, c.device_id_dtype = ID_DTYPES[id_dtype], ID_DTYPES[device_id_dtype]
    c.weight_dtype = WEIGHT_DTYPES[weight_dtype]
    device = str(device)
    if device == "cpu":
        c.device_type, c.device_id = DEVICE_HOST, 0
    elif device == "cuda" or device.startswith("cuda:"):
        c.device_type = DEVICE_CUDA
        c.device_id = int(device.split(":")[1]) if ":" in device else 0
    else:
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', not {device!r}")
    return c


def plan(**config: Any) -> dict:
    """The layout for a configuration (same keywords as Capturer), without allocating."""
    return _moecap.plan(_config(**config))


# Capturers by id, for the torch ops (an int is what a traced graph can carry).
_registry: "weakref.WeakValueDictionary[int, Capturer]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)


class Capturer(_moecap.Capturer):
    """One routed-experts capturer (abi/moecap.h documents every operation).

    Keywords: num_layers, top_k, num_experts, host_slots, max_running_requests,
    extra_columns, dp_size, verify_tokens, chunked_prefill_size, max_graph_batch,
    max_batch_tokens, id_dtype (the host cache's: 'auto', 'u8', 'u16', 'i16', 'i32'),
    device_id_dtype (the device buffer's, what a top-k kernel writes into a
    'layer_ids' view: 'auto' = i16 up to 32768 experts), weight_dtype (None,
    'f32', 'bf16', 'f16'), device ('cpu' or 'cuda:N'), histogram, guards,
    side_stream (MOECAP_FLAG_SIDE_STREAM: capture, commit and invalidate fork
    off the engine's stream until ``join(stream=None)``; the tensors they read
    are held until then). Unset keywords take moecap_config_init's defaults.

    Step-path calls (native, no Python in between): ``capture(layer, topk_ids,
    topk_weights=None, stream=None)``, ``commit(dst_slots, src_start=0,
    src_rows=None, stream=None)``, ``local_rows(dp_rank, tokens_per_rank,
    padded_tokens_per_rank=None)``, ``invalidate(slots, stream=None)``; then
    ``read``, ``write``, ``slot_states``, ``synchronize``,
    ``errors``, ``export``, ``graph_begin``/``graph_end``, ``close``.
    """

    def __init__(self, **config: Any):
        super().__init__(_config(**config))
        self.config = dict(config)
        self.plan = self.get_plan()
        self.id = next(_ids)
        _registry[self.id] = self
        self._ops = None
        self._states = None

    def __enter__(self) -> "Capturer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def read(self, slots: Any, dtype: Any = None, out: Any = None, weights_out: Any = None,
             nonblocking: bool = False, strict: bool = False, stream: Any = None) -> Any:
        """The rows of ``slots`` (host memory, any DLPack producer) as ``[T, num_layers, top_k]``.

        Without ``out``, allocates one like ``slots`` (a torch tensor for torch
        slots, else NumPy) of ``dtype`` (default int32). ``out`` may be a CUDA
        tensor on the capturer's GPU: it is filled on ``stream``. Returns out,
        or (out, weights_out) when weights_out is given.

        A slot with no committed routing (never committed, or invalidated)
        reads -1 for every id and 0 weights, as does an id that was out of range
        at capture; ``strict=True`` raises MoecapError(NO_ROUTING) instead and
        writes nothing. ``slot_states`` says which slots hold routing."""
        if out is None:
            shape = (_moecap.leading_dim(slots), self.config["num_layers"], self.config["top_k"])
            torch = _torch_if_imported()
            if torch is not None and isinstance(slots, torch.Tensor):
                out = torch.empty(shape, dtype=dtype or torch.int32)
            else:
                import numpy as np
                out = np.empty(shape, dtype=dtype or np.int32)
        self.read_into(slots, out, weights_out, nonblocking, strict, stream)
        return out if weights_out is None else (out, weights_out)

    def slot_states(self, slots: Any) -> Any:
        """SLOT_* bits of each slot (NumPy uint8 ``[T]``) once the commits in flight landed:
        ``states & SLOT_VALID == 0`` marks the tokens a read returns as -1.

        ``slots``: ``[T]`` int32/int64 in host memory (any DLPack producer, or a
        list), every value in ``[0, host_slots)``; anything else raises
        MoecapError (INVALID_ARGUMENT / OUT_OF_RANGE) as ``read`` does. Waits
        for commits like ``synchronize`` but does not raise its sticky
        ROWS_SKIPPED: ``errors()`` reports skipped rows."""
        import numpy as np
        if self._states is None:
            self._states = np.from_dlpack(self.export("host_states"))
        index = _host_slots(slots, self._states.shape[0])
        try:
            self.synchronize()
        except MoecapError as e:
            if e.status != Status.ROWS_SKIPPED:  # the commits have landed; the skipped rows stay counted
                raise
        return self._states[index]

    def export(self, which: str, layer: int = 0) -> DLPackView:
        """A zero-copy DLPackView of a buffer: 'device_ids', 'host_ids', 'layer_ids', 'histogram', ..."""
        if which not in BUFFERS:
            raise ValueError(f"which must be one of {sorted(BUFFERS)}, not {which!r}")
        return self.export_view(BUFFERS[which], layer)

    @property
    def ops(self) -> Any:
        """torch.library custom ops bound to this capturer (``moecap.ops.CapturerOps``): what
        code under torch.compile calls instead of capture/commit. Needs torch >= 2.4."""
        if self._ops is None:
            from . import ops
            self._ops = ops.CapturerOps(self)
        return self._ops


def _host_slots(slots: Any, host_slots: int) -> Any:
    """slots as a NumPy int64 index, checked as moecap_read checks its slots (its messages)."""
    import numpy as np
    if isinstance(slots, (list, tuple)):
        slots = np.asarray(slots, dtype=np.int64)
    elif not isinstance(slots, np.ndarray):
        try:
            slots = np.from_dlpack(slots)
        except (TypeError, RuntimeError, BufferError) as e:
            raise MoecapError(Status.INVALID_ARGUMENT,
                              f"slot_states: slots must be host memory (a DLPack producer or a list): {e}") from None
    if slots.ndim != 1:
        raise MoecapError(Status.INVALID_ARGUMENT, f"slot_states: slots has ndim {slots.ndim}; expected 1")
    if slots.dtype not in (np.int32, np.int64):
        raise MoecapError(Status.INVALID_ARGUMENT,
                          f"slot_states: slots has dtype {slots.dtype}; expected one of int32, int64")
    bad = np.flatnonzero((slots < 0) | (slots >= host_slots))
    if bad.size:
        i = int(bad[0])
        raise MoecapError(Status.OUT_OF_RANGE,
                          f"slot_states: slots[{i}] is {int(slots[i])}; it must be in [0, {host_slots})")
    return slots


def _torch_if_imported() -> Any:
    import sys
    return sys.modules.get("torch")


# The consumers' layer (engine-step helpers, the routing record, transformers models) is
# imported on first use: it needs NumPy (and hf torch and transformers), while `import moecap`
# needs nothing but the extension.
_LAZY = {
    "engine": ("engine", None), "hf": ("hf", None), "record": ("record", None),
    "RequestTable": ("engine", "RequestTable"), "batch_slots": ("engine", "batch_slots"),
    "commit_batch": ("engine", "commit_batch"), "write_routed": ("engine", "write_routed"),
    "RecordError": ("record", "RecordError"), "RoutedExperts": ("record", "RoutedExperts"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'moecap' has no attribute {name!r}")
    import importlib
    module_name, attr = _LAZY[name]
    module = importlib.import_module(f".{module_name}", __name__)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value
