# SPDX-License-Identifier: Apache-2.0
"""moecap from Python: capture the routed experts of MoE models.

A ``Capturer`` takes NumPy arrays, PyTorch tensors (CPU or CUDA), JAX or CuPy
arrays, or any other DLPack producer, and hands them to libmoecap.so in place,
without copies, through a native extension (``moecap._moecap``). Buffers come
back as zero-copy ``DLPackView`` objects that ``numpy.from_dlpack``,
``torch.from_dlpack`` and ``jax.dlpack.from_dlpack`` consume. A failed call
raises ``MoecapError`` (``.status``, and a message naming the argument and the
limit). For CUDA capturers ``stream=None`` means the current stream of the
tensor's producer (through its DLPack exchange API), else torch's current stream.

In code that ``torch.compile`` traces, call ``capturer.ops.capture(...)`` /
``.commit(...)``: torch.library custom ops (``moecap.ops``) with fake
implementations and declared mutations, so the compiled graph does not break.
"""
from __future__ import annotations

import dataclasses
import difflib
import itertools
import operator
import sys
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Iterator, Optional, Protocol, SupportsIndex, Union, cast

try:
    from . import _moecap
except ImportError as _error:
    if "undefined symbol: moecap_" not in str(_error):
        raise
    # The extension's DT_RPATH finds the libmoecap.so.1 beside it, unless one of that SONAME is in the process
    # already (an engine that dlopened its own first): the loader takes that one, which lacks newer symbols.
    with open("/proc/self/maps") as _maps:
        _loaded = sorted({line.split()[-1] for line in _maps if "libmoecap" in line})
    if not _loaded:  # the failed load unloaded what it found: the one beside the extension is the older
        raise ImportError(f"{_error}: the libmoecap.so.1 moecap's extension found beside it (or on its RPATH) is "
                          "older than the extension (a stale build directory, or files of two installs mixed): "
                          "reinstall moecap") from _error
    raise ImportError(f"{_error}: the process loaded another libmoecap.so.1 first ({', '.join(_loaded)}), "
                      "older than the one moecap's extension is built for. Import moecap before loading it, or "
                      "load the one beside moecap's extension") from _error
from ._errors import MoecapError, Status
from ._moecap import Buffer, ConfigFlag, DeviceType, DLPackView, Graph, IdDtype, ReadFlag, SlotState, WeightDtype

if TYPE_CHECKING:
    # What __getattr__ below imports on first use, named for type checkers.
    from . import engine, formats, hf, integrations, record
    from .engine import RequestTable, batch_slots, commit_batch, write_routed
    from .ops import CapturerOps
    from .record import LayerMap, RecordError, RoutedExperts

__all__ = ["BUFFERS", "Buffer", "Capturer", "Config", "ConfigFlag", "DLPackArray", "DLPackView", "DeviceType",
           "ErrorCounts", "Graph", "IdDtype", "MoecapError", "Plan", "ReadFlag", "RecordError", "RequestTable",
           "RoutedExperts", "SLOT_EMPTY", "SLOT_INVALID_IDS", "SLOT_VALID", "SlotState", "Status", "WeightDtype",
           "abi_version", "batch_slots", "commit_batch", "engine", "formats", "hf", "integrations", "plan", "record",
           "write_routed"]

# Every constant below is the extension's (abi/moecap.h's values, exported by
# python/src/module.cpp); this module only names them the way keywords do.

#: moecap_buffer by the name Capturer.export takes ('device_ids', 'host_states', ...).
BUFFERS: dict[str, Buffer] = {b.name.lower(): b for b in Buffer}
#: moecap_id_dtype by the name id_dtype / device_id_dtype take ('auto', 'u8', 'u16', 'i16', 'i32').
ID_DTYPES: dict[str, IdDtype] = {d.name.lower(): d for d in IdDtype}
#: moecap_weight_dtype by the name weight_dtype takes (None, 'f32', 'bf16', 'f16').
WEIGHT_DTYPES: dict[Optional[str], WeightDtype] = {
    (None if d == WeightDtype.NONE else d.name.lower()): d for d in WeightDtype}
FLAG_HISTOGRAM, FLAG_GUARDS, FLAG_NO_GUARDS, FLAG_SIDE_STREAM = (
    ConfigFlag.HISTOGRAM, ConfigFlag.GUARDS, ConfigFlag.NO_GUARDS, ConfigFlag.SIDE_STREAM)
DEVICE_HOST, DEVICE_CUDA = DeviceType.HOST, DeviceType.CUDA
#: What a host-cache slot holds (Capturer.slot_states): bits of MOECAP_SLOT_*.
SLOT_EMPTY, SLOT_VALID, SLOT_INVALID_IDS = SlotState.EMPTY, SlotState.VALID, SlotState.INVALID_IDS

#: This package's version ("MAJOR.MINOR.PATCH"), as pip reports it; abi_version() is the loaded library's.
__version__: str = _moecap.VERSION

if _moecap.abi_version() >> 16 != _moecap.ABI_VERSION >> 16:  # pragma: no cover - a mismatched install
    raise ImportError(f"libmoecap.so implements ABI {_moecap.abi_version() >> 16}.x; "
                      f"moecap._moecap was built for {_moecap.ABI_VERSION >> 16}.x")


class DLPackArray(Protocol):
    """What every tensor argument takes: an array that exports itself through DLPack
    (``__dlpack__`` and ``__dlpack_device__``): a NumPy array, a PyTorch tensor (CPU or
    CUDA), a JAX or CuPy array, ... It is borrowed in place for the call, never copied."""

    def __dlpack__(self, *, stream: Any = ...) -> Any: ...

    def __dlpack_device__(self) -> Any: ...


#: A dtype for ids: 'auto', 'u8', 'u16', 'i16', 'i32', an IdDtype, or the NumPy / torch dtype
#: (np.uint8, torch.int16, ...).
IdDtypeLike = Union[str, IdDtype, Any]
#: A dtype for weights: None, 'f32', 'bf16', 'f16', a WeightDtype, or the NumPy / torch dtype.
WeightDtypeLike = Union[None, str, WeightDtype, Any]

# NumPy's and torch's names of the dtypes moecap stores, and the keyword's name for each.
_DTYPE_NAMES = {"uint8": "u8", "int8": "i8", "uint16": "u16", "int16": "i16", "int32": "i32", "int64": "i64",
                "float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def abi_version() -> tuple[int, int]:
    """(major, minor) of the loaded libmoecap.so."""
    v = _moecap.abi_version()
    return (v >> 16, v & 0xFFFF)


def _dtype_name(value: Any) -> Any:
    """The keyword name ('u8', 'bf16', ...) of a dtype given as a name, an enum, or a
    NumPy / torch dtype; anything else comes back as it is (and is refused by the caller)."""
    # By type, not value: IdDtype.AUTO and WeightDtype.NONE are both 0, and IntEnums compare as ints.
    if isinstance(value, WeightDtype):
        return None if value is WeightDtype.NONE else value.name.lower()
    if isinstance(value, IdDtype):
        return value.name.lower()
    if isinstance(value, str):
        return _DTYPE_NAMES.get(value, value)
    text = str(value)
    if text.startswith("torch."):  # torch.uint8, torch.bfloat16: torch need not be imported to name one
        return _DTYPE_NAMES.get(text[len("torch."):], value)
    np = sys.modules.get("numpy")
    if np is not None and value is not None:
        try:
            return _DTYPE_NAMES.get(np.dtype(value).name, value)
        except TypeError:
            pass
    return value


def _current_cuda_device() -> str:
    """What a bare 'cuda' names: torch's current CUDA device where torch is imported and sees a GPU (a
    multi-GPU engine sets each rank's before it builds anything, and torch allocates 'cuda' there), else GPU 0."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return "cuda:0"


def _checked_dtype(keyword: str, value: Any, names: Mapping[Any, Any]) -> Any:
    name = _dtype_name(value)
    if name not in names:
        shown = ", ".join(repr(n) for n in names)
        numeric = ", ".join(k for k, v in _DTYPE_NAMES.items() if v in names)
        raise ValueError(f"{keyword} must be one of {shown} (or the NumPy / torch dtype: {numeric}), not {value!r}")
    return name


class _Fields(Mapping):
    """A frozen dataclass that also reads as a mapping of its fields (``plan["id_bytes"]``,
    ``dict(capturer.config)``), as the dicts these results were before."""

    __slots__ = ()

    def __getitem__(self, key: str) -> Any:
        if not isinstance(key, str) or key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    # Equal to a mapping of the same items, as the dicts were (``cap.errors() == {...}``); to another of
    # these, only of the same class. (The subclasses leave eq to this.)
    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Fields):
            return type(self) is type(other) and tuple(self.values()) == tuple(other.values())
        if isinstance(other, Mapping):
            return dict(self) == dict(other)
        return NotImplemented

    def __hash__(self) -> int:  # by items, as a hashable mapping equal to this one hashes (frozendict's rule)
        return hash(frozenset(self.items()))

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]  # subclasses are dataclasses


def _library_defaults() -> dict[str, int]:
    c = _moecap.Config()  # moecap_config_init; read and dropped (nanobind reports instances alive at exit)
    return {name: getattr(c, name) for name in ("extra_columns", "dp_size", "verify_tokens", "chunked_prefill_size",
                                                 "max_graph_batch", "max_batch_tokens")}


# moecap_config_init's defaults: the dataclass below takes them from the library.
_C_DEFAULTS = _library_defaults()


# The integer fields of moecap_config and their C types' widths (all signed).
_INT_FIELD_BITS = {"num_layers": 32, "top_k": 32, "num_experts": 32, "host_slots": 64, "max_running_requests": 64,
                   "extra_columns": 32, "dp_size": 32, "verify_tokens": 32, "chunked_prefill_size": 64,
                   "max_graph_batch": 64, "max_batch_tokens": 64}


def _integer(name: str, value: Any) -> int:
    """value as an int as Python means one (operator.index: NumPy ints and 0-d integer tensors too); a
    bool (a 0-d bool tensor too), a float or a str is refused with a TypeError naming it, never truncated
    (2.7 is not position 2)."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        raise TypeError(f"{name} must be an int, not bool")
    if str(getattr(value, "dtype", "")) == "torch.bool":  # a 0-d torch bool has __index__
        raise TypeError(f"{name} must be an int, not a bool tensor")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(value).__name__}") from None


def _check_fits(what: str, value: int, bits: int) -> None:
    """Refuses, as the library refuses a bad value (MoecapError INVALID_ARGUMENT naming it), an int that its
    C field (int32 or int64) cannot hold, so that the library's own limits decide the rest."""
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if not low <= value <= high:
        raise MoecapError(Status.INVALID_ARGUMENT, f"{what} is {value}; it must fit in int{bits} [{low}, {high}]")


def _checked_flag(name: str, value: Any) -> bool:
    """A bool (NumPy's, or an int 0 or 1, too); "no" is not False, so a str, a float or None is refused."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a bool, not {type(value).__name__}") from None
    if number not in (0, 1):
        raise TypeError(f"{name} must be a bool, not {value!r}")
    return bool(number)


@dataclasses.dataclass(frozen=True, eq=False)
class Config(_Fields):
    """Everything a Capturer is sized by (``moecap_config``, abi/moecap.h documents every
    field). ``moecap.Capturer(config)`` and ``moecap.plan(config)`` take one; both also take
    these fields as keywords. Dtypes and the device come back normalized: ``id_dtype``
    'u8' whether given as 'u8', ``np.uint8`` or ``torch.uint8``; ``device`` 'cpu' or 'cuda:N'."""

    num_layers: int
    """MoE layers captured; layer ids are [0, num_layers)."""
    top_k: int
    """Routed experts kept per token."""
    num_experts: int
    """Routed experts of the model; stored ids are [0, num_experts)."""
    host_slots: int
    """Rows of the host cache: the engine's KV slots, padding slot included."""
    max_running_requests: int
    """The scheduler's bound on requests per rank."""
    extra_columns: int = _C_DEFAULTS["extra_columns"]
    """Columns after top_k the router emits (fused shared experts): accepted at capture, dropped."""
    dp_size: int = _C_DEFAULTS["dp_size"]
    """Attention data-parallel ranks whose tokens the MoE layers see gathered."""
    verify_tokens: int = _C_DEFAULTS["verify_tokens"]
    """Tokens per request in a speculative verify pass; 1 without."""
    chunked_prefill_size: int = _C_DEFAULTS["chunked_prefill_size"]
    """Tokens per prefill chunk per rank."""
    max_graph_batch: int = _C_DEFAULTS["max_graph_batch"]
    """Largest captured CUDA-graph batch, in requests."""
    max_batch_tokens: int = _C_DEFAULTS["max_batch_tokens"]
    """The engine's own bound on tokens per forward per rank where its scheduler exceeds the others; 0 if none."""
    id_dtype: IdDtypeLike = "auto"
    """The host cache's ids: 'auto' (the narrowest that holds num_experts + extra_columns), 'u8', 'u16', 'i16', 'i32'."""
    device_id_dtype: IdDtypeLike = "auto"
    """The device buffer's ids, what a top-k kernel writes into a 'layer_ids' view: 'auto' is i16 up to 32768 experts."""
    weight_dtype: WeightDtypeLike = None
    """Stored routing weights: None (no weights), 'f32', 'bf16', 'f16'."""
    device: Any = "cpu"
    """'cpu' (the host backend) or 'cuda[:N]' (a str or a torch.device)."""
    histogram: bool = False
    """Keep a [num_layers, num_experts] int64 expert-load histogram."""
    guards: Optional[bool] = None
    """Canary rows after every buffer (True), none (False), or the build's default (None)."""
    side_stream: bool = False
    """MOECAP_FLAG_SIDE_STREAM: capture, commit, invalidate and histogram_reset fork off the engine's
    stream until join()."""

    def __post_init__(self) -> None:
        set_field = object.__setattr__  # frozen: normalizing happens once, here
        for name, bits in _INT_FIELD_BITS.items():
            value = _integer(name, getattr(self, name))
            _check_fits(f"config: {name}", value, bits)
            set_field(self, name, value)
        set_field(self, "id_dtype", _checked_dtype("id_dtype", self.id_dtype, ID_DTYPES))
        set_field(self, "device_id_dtype", _checked_dtype("device_id_dtype", self.device_id_dtype, ID_DTYPES))
        set_field(self, "weight_dtype", _checked_dtype("weight_dtype", self.weight_dtype, WEIGHT_DTYPES))
        device = str(self.device)
        if device == "cuda":
            device = _current_cuda_device()
        if device == "cpu:0":  # torch.device("cpu", 0)
            device = "cpu"
        ordinal = device[len("cuda:"):]
        if device != "cpu" and not (device.startswith("cuda:") and ordinal.isascii() and ordinal.isdigit()):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', not {self.device!r}")
        if device != "cpu":
            _check_fits("config: device's ordinal", int(ordinal), 32)
            device = f"cuda:{int(ordinal)}"  # 'cuda:01' is 'cuda:1', so equal configs compare equal
        set_field(self, "device", device)
        if self.guards is not None:
            set_field(self, "guards", _checked_flag("guards", self.guards))
        set_field(self, "histogram", _checked_flag("histogram", self.histogram))
        set_field(self, "side_stream", _checked_flag("side_stream", self.side_stream))

    def _c_config(self) -> _moecap.Config:
        c = _moecap.Config()  # moecap_config_init, then every field of ours
        flags = ConfigFlag(0)
        if self.histogram:
            flags |= ConfigFlag.HISTOGRAM
        if self.guards is not None:
            flags |= ConfigFlag.GUARDS if self.guards else ConfigFlag.NO_GUARDS
        if self.side_stream:
            flags |= ConfigFlag.SIDE_STREAM
        c.flags = int(flags)
        for name in ("num_layers", "top_k", "extra_columns", "num_experts", "dp_size", "verify_tokens",
                     "max_running_requests", "chunked_prefill_size", "max_graph_batch", "max_batch_tokens",
                     "host_slots"):
            setattr(c, name, getattr(self, name))
        # __post_init__ normalized the dtypes to the names these tables hold
        c.id_dtype = int(ID_DTYPES[cast(str, self.id_dtype)])
        c.device_id_dtype = int(ID_DTYPES[cast(str, self.device_id_dtype)])
        c.weight_dtype = int(WEIGHT_DTYPES[cast(Optional[str], self.weight_dtype)])
        if self.device == "cpu":
            c.device_type, c.device_id = int(DeviceType.HOST), 0
        else:
            c.device_type, c.device_id = int(DeviceType.CUDA), int(self.device[len("cuda:"):])
        return c


def _config(caller: str, config: Optional[Config], keywords: dict[str, Any]) -> Config:
    """The Config of a call that takes one or its fields as keywords (or both: the
    keywords replace those fields). A keyword that is no field is a TypeError naming
    it, the closest field, and every field."""
    names = Config._names()
    for key in keywords:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"{caller} got an unexpected keyword argument {key!r}{hint}; "
                            f"its keywords are: {', '.join(names)}")
    if config is not None:
        if not isinstance(config, Config):
            raise TypeError(f"{caller} takes a moecap.Config or keywords, not {type(config).__name__}")
        return dataclasses.replace(config, **keywords) if keywords else config
    required = [f.name for f in dataclasses.fields(Config) if f.default is dataclasses.MISSING]
    missing = [name for name in required if name not in keywords]
    if missing:
        raise TypeError(f"{caller} is missing the keyword argument{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(repr(m) for m in missing)} (required: {', '.join(required)})")
    return Config(**keywords)


@dataclasses.dataclass(frozen=True, eq=False)
class Plan(_Fields):
    """What a configuration costs (``moecap_plan_info``), from ``moecap.plan`` or ``Capturer.plan``.
    Reads as a mapping too (``plan["id_bytes"]``)."""

    rows_per_rank: int
    """max(chunked_prefill_size, max_running_requests * verify_tokens, max_graph_batch * verify_tokens,
    max_batch_tokens)."""
    device_rows: int
    """dp_size * rows_per_rank: rows of the device buffer."""
    row_elements: int
    """num_layers * top_k: ids per row."""
    id_dtype: str
    """The host cache's ids as resolved (never 'auto'): 'u8', 'u16', 'i16' or 'i32'."""
    id_bytes: int
    """1, 2 or 4."""
    weight_bytes: int
    """0 (no weights), 2 or 4."""
    device_bytes: int
    """Device ids + weights + histogram, guard canaries excluded."""
    host_bytes: int
    """Host-cache ids + weights + one state byte per slot."""
    device_id_dtype: str
    """The device buffer's ids as resolved (never 'auto')."""
    device_id_bytes: int
    """1, 2 or 4."""

    @classmethod
    def _of(cls, info: dict[str, Any]) -> Plan:
        fields = dict(info)
        for name in ("id_dtype", "device_id_dtype"):
            fields[name] = IdDtype(fields[name]).name.lower()
        return cls(**fields)


@dataclasses.dataclass(frozen=True, eq=False)
class ErrorCounts(_Fields):
    """Problems found where no status could be returned (``moecap_error_counts``), from
    ``Capturer.errors``. Reads as a mapping too (``errors["skipped_rows"]``)."""

    skipped_rows: int
    """Committed rows (or invalidated slots) whose slot was outside [-1, host_slots), or whose source row
    was outside [0, device_rows)."""
    invalid_ids: int
    """Ids outside [0, num_experts) given to capture or written into a layer view; -1, the "no expert"
    code engines give padded rows, is not counted."""


def plan(config: Optional[Config] = None, **keywords: Any) -> Plan:
    """The layout for a configuration (a Config, or its fields as keywords, as Capturer takes), without
    allocating."""
    return Plan._of(_moecap.plan(_config("moecap.plan()", config, keywords)._c_config()))


# Capturers by id, for the torch ops (an int is what a traced graph can carry).
_registry: "weakref.WeakValueDictionary[int, Capturer]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)


class Capturer(_moecap.Capturer):
    """One routed-experts capturer (abi/moecap.h documents every operation).

    ``Capturer(config)`` takes a ``moecap.Config``; ``Capturer(num_layers=..., top_k=...,
    num_experts=..., host_slots=..., max_running_requests=..., **more)`` takes its fields as
    keywords (the ones not given take moecap_config_init's defaults); a misspelt keyword is a
    TypeError naming the closest one. ``config`` and ``plan`` hold what was asked for and what
    it costs.

    Step-path calls (native, no Python in between): ``capture(layer, topk_ids,
    topk_weights=None, stream=None)``, ``commit(dst_slots, src_start=0,
    src_rows=None, stream=None)``, ``local_rows(dp_rank, tokens_per_rank,
    padded_tokens_per_rank=None)``, ``invalidate(slots, stream=None)``; then
    ``read``, ``write``, ``slot_states``, ``synchronize``,
    ``errors``, ``export``, ``graph_begin``/``graph_end``, ``close``.
    Every tensor argument is a ``DLPackArray`` (NumPy, PyTorch, JAX, CuPy, ...), borrowed in place.
    """

    config: Config
    plan: Plan
    id: int
    #: Which model layer each captured layer is (set by moecap.hf.attach; RequestTable.finish passes it on).
    layer_map: Optional[LayerMap]

    def __init__(self, config: Optional[Config] = None, **keywords: Any) -> None:
        config = _config("moecap.Capturer()", config, keywords)
        super().__init__(config._c_config())
        self.config = config
        self.plan = Plan._of(self.get_plan())
        self.id = next(_ids)
        self.layer_map = None
        _registry[self.id] = self
        self._ops: Optional[CapturerOps] = None
        self._states: Any = None

    def __enter__(self) -> Capturer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def errors(self, clear: bool = False) -> ErrorCounts:  # type: ignore[override]
        """Counters of problems found where no status could be returned (inside kernels and
        graph replays); waits for the commits in flight. ``clear`` resets them in the same step."""
        return ErrorCounts(**super().errors(_checked_flag("clear", clear)))

    def read(self, slots: DLPackArray, dtype: Any = None, out: Optional[DLPackArray] = None,
             weights_out: Optional[DLPackArray] = None, nonblocking: bool = False, strict: bool = False,
             stream: Any = None) -> Any:
        """The rows of ``slots`` (host memory, any DLPack producer) as ``[T, num_layers, top_k]``.

        Without ``out``, allocates one like ``slots`` (a torch tensor for torch
        slots, else NumPy) of ``dtype`` (default int32; uint8, int8, uint16, int16,
        int32 or int64, also by moecap's names ``"u8"``, ``"i8"``, ``"u16"``,
        ``"i16"``, ``"i32"``, ``"i64"``: ``"i8"`` is int8). ``out`` may be a CUDA
        tensor on the capturer's GPU: it is filled on ``stream``. Returns out,
        or (out, weights_out) when weights_out is given.

        A slot with no committed routing (never committed, or invalidated)
        reads -1 for every id and 0 weights, as does an id that was out of range
        at capture; ``strict=True`` raises MoecapError(NO_ROUTING) instead and
        writes nothing. ``slot_states`` says which slots hold routing."""
        torch = _torch_if_imported()
        caller_outputs = out is not None or weights_out is not None
        if out is None:
            name = _read_dtype_name(dtype)
            length, once = _moecap.slots_for_read(slots)  # a producer's capsule is asked for once
            shape = (length, self.config.num_layers, self.config.top_k)
            if torch is not None and isinstance(slots, torch.Tensor):
                out = torch.empty(shape, dtype=getattr(torch, name))
            else:
                import numpy as np
                out = np.empty(shape, dtype=name)
            slots = cast(DLPackArray, once)  # nanobind's array of the producer's capsule: it exports DLPack too
        elif dtype is not None:
            wanted, have = _read_dtype_name(dtype), _dtype_name(getattr(out, "dtype", None))
            if have in _READ_ID_DTYPES and _NUMPY_NAMES[have] != wanted:  # a dtype we cannot name is out's to judge
                raise ValueError(f"dtype is {dtype!r} but out is {_NUMPY_NAMES[have]}; dtype is the dtype of an "
                                 "output read allocates (out= brings its own)")
        self.read_into(slots, out, weights_out, _checked_flag("nonblocking", nonblocking),
                       _checked_flag("strict", strict), stream)
        if caller_outputs:
            # Written outside torch's ops: its version counter tells autograd, as an in-place op would, so a
            # backward that saved the tensor raises instead of using the new values.
            # One tensor a call (torch < 2.5 takes no list); an inference tensor has no counter (torch < 2.6
            # raised for one).
            for t in (out, weights_out):
                if torch is not None and isinstance(t, torch.Tensor) and not t.is_inference():
                    torch.autograd.graph.increment_version(t)
        return out if weights_out is None else (out, weights_out)

    def slot_states(self, slots: Union[DLPackArray, list[int], tuple[int, ...]]) -> Any:
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
                raise MoecapError(e.status, e._message.replace("moecap_synchronize", "slot_states")) from None
        return self._states[index]

    def export(self, which: Union[str, Buffer, SupportsIndex], layer: SupportsIndex = 0) -> DLPackView:
        """A zero-copy DLPackView of a buffer: 'device_ids', 'host_ids', 'layer_ids', 'histogram', ...
        (a name of BUFFERS, or a Buffer, or its int value)."""
        if isinstance(which, str):
            if which not in BUFFERS:
                raise ValueError(f"which must be one of {sorted(BUFFERS)} or a moecap.Buffer, not {which!r}")
            which = BUFFERS[which]
        elif not isinstance(which, Buffer):
            try:
                value = _integer("which", which)
            except TypeError:
                raise TypeError(f"which must be a moecap.Buffer, one of BUFFERS' names or a Buffer's int value, "
                                f"not {type(which).__name__}") from None
            if value not in {b.value for b in Buffer}:
                raise ValueError(f"which must be a moecap.Buffer ({', '.join(f'{b.name} = {b.value}' for b in Buffer)}) "
                                 f"or one of their names, not {value}")
            which = Buffer(value)
        if layer is None:  # the extension's own check names the argument; nanobind refuses None before it runs
            raise TypeError("moecap_export: layer must be an int, not NoneType")
        return cast(DLPackView, self.export_view(which, layer))

    @property
    def ops(self) -> CapturerOps:
        """torch.library custom ops bound to this capturer (``moecap.ops.CapturerOps``): what
        code under torch.compile calls instead of capture/commit. Needs torch >= 2.4. Made once
        and held by the capturer; they name it by id and do not hold it (no cycle for the garbage
        collector to find), so keep the capturer while code calls them."""
        if self._ops is None:
            from . import ops
            self._ops = ops.CapturerOps(self)
        return self._ops


def _host_slots(slots: Any, host_slots: int) -> Any:
    """slots as a NumPy int64 index, checked as moecap_read checks its slots (its messages)."""
    import numpy as np
    def outside(i: int, value: int) -> MoecapError:
        return MoecapError(Status.OUT_OF_RANGE, f"slot_states: slots[{i}] is {value}; it must be in [0, {host_slots})")

    if isinstance(slots, (list, tuple)):
        # Each entry an int as Python means it (operator.index): 1.7, "1" and
        # True are refused, not truncated or cast; ranged before NumPy, which
        # cannot hold 2**70.
        try:
            if any(isinstance(v, (bool, np.bool_)) for v in slots):
                raise TypeError("not bool")
            values = [operator.index(v) for v in slots]
        except TypeError as e:
            raise MoecapError(Status.INVALID_ARGUMENT, f"slot_states: slots must hold ints: {e}") from None
        for i, v in enumerate(values):
            if not 0 <= v < host_slots:
                raise outside(i, v)
        slots = np.asarray(values, dtype=np.int64)
    elif not isinstance(slots, np.ndarray):
        if not hasattr(slots, "__dlpack__"):
            raise MoecapError(Status.INVALID_ARGUMENT, "slot_states: slots must be host memory (a DLPack producer) "
                                                       f"or a list of ints, not {type(slots).__name__}")
        try:
            slots = np.from_dlpack(slots)
        except (TypeError, RuntimeError, BufferError) as e:
            raise MoecapError(Status.INVALID_ARGUMENT,
                              "slot_states: slots must be int32 or int64 host memory (a DLPack producer) or a list "
                              f"of ints; NumPy cannot take it: {e}") from None
    if slots.ndim != 1:
        raise MoecapError(Status.INVALID_ARGUMENT, f"slot_states: slots has ndim {slots.ndim}; expected 1")
    if slots.dtype not in (np.int32, np.int64):
        raise MoecapError(Status.INVALID_ARGUMENT,
                          f"slot_states: slots has dtype {slots.dtype}; expected one of int32, int64")
    if slots.size and slots.ctypes.data % slots.itemsize:  # as moecap_read refuses it
        raise MoecapError(Status.INVALID_ARGUMENT, f"slot_states: slots data + byte_offset is not aligned to its "
                                                   f"{slots.itemsize}-byte elements")
    if slots.size > 1 and slots.strides[0] != slots.itemsize:
        raise MoecapError(Status.INVALID_ARGUMENT,
                          f"slot_states: slots is not compact row-major: strides[0] is {slots.strides[0]} bytes; "
                          f"expected {slots.itemsize}")
    bad = np.flatnonzero((slots < 0) | (slots >= host_slots))
    if bad.size:
        raise outside(int(bad[0]), int(slots[bad[0]]))
    return slots


def _torch_if_imported() -> Any:
    return sys.modules.get("torch")


# The ids dtypes a read writes (moecap_read's ids_out), by moecap's names: "u8" is uint8 and "i8" int8,
# where NumPy would read 8-byte integers.
_READ_ID_DTYPES = ("u8", "i8", "u16", "i16", "i32", "i64")
_NUMPY_NAMES = {short: full for full, short in _DTYPE_NAMES.items()}


def _read_dtype_name(dtype: Any) -> str:
    """A read's ``dtype`` (None: int32; moecap's name, an IdDtype, a NumPy or torch dtype or NumPy's name)
    as NumPy's name."""
    name = "i32" if dtype is None else _dtype_name(dtype)
    if name not in _READ_ID_DTYPES:
        numpy_names = ", ".join(_NUMPY_NAMES[n] for n in _READ_ID_DTYPES)
        raise TypeError(f"dtype {dtype!r} is not one read writes ids in: {numpy_names} "
                        f"(or {', '.join(map(repr, _READ_ID_DTYPES))})")
    return _NUMPY_NAMES[name]


# The consumers' layer (engine-step helpers, the routing record, transformers models) is
# imported on first use: it needs NumPy (and hf torch and transformers), while `import moecap`
# needs nothing but the extension.
_LAZY = {
    "engine": ("engine", None), "formats": ("formats", None), "hf": ("hf", None),
    "integrations": ("integrations", None), "record": ("record", None),
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
