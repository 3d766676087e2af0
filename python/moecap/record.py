# SPDX-License-Identifier: Apache-2.0
"""RoutedExperts: one request's routing as a read returns it, its bytes, and
the shapes RL trainers take.

``to_bytes()`` and ``from_bytes()`` are the library's own codec for the routing
record of ``abi/moecap_record.h`` (specified in ``docs/RECORD_FORMAT.md``):
``moecap_record_encode`` / ``moecap_record_decode`` called through the
extension, so a record from Python and one from C are the same bytes by
construction, and bf16 weights are rounded by the same code. NumPy is all it
needs (no torch). The converters give what each consumer takes (moecap.formats
has one module per consumer, with its rules and a decoder; docs/CONSUMERS.md
has the table).
"""
from __future__ import annotations

import collections
import functools
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence, overload

import numpy as np

from . import _checked_dtype, _integer, _moecap, WEIGHT_DTYPES
from ._errors import MoecapError, Status
from ._moecap import RecordFlag, WeightDtype

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

MAGIC = b"MCRT"
VERSION: int = _moecap.RECORD_VERSION
HEADER_BYTES: int = _moecap.RECORD_HEADER_BYTES
PACKED, HAS_WEIGHTS, HAS_VALIDITY = RecordFlag.PACKED, RecordFlag.HAS_WEIGHTS, RecordFlag.HAS_VALIDITY


class RecordError(MoecapError, ValueError):
    """Bytes that are not a well-formed routing record of a version this code reads, or
    routing that cannot be written as one (``status`` and the library's message)."""


def _codec(call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except MoecapError as e:
        raise RecordError(e.status, e._message) from None


def id_bits(num_experts: int, packed: bool) -> int:
    """Width of one id code: the narrowest whose all-ones value is no expert."""
    if packed:
        return int(num_experts).bit_length()  # 2**bits - 1 >= num_experts
    return 8 if num_experts <= 0xFF else 16 if num_experts <= 0xFFFF else 32


def signed_dtype(num_experts: int) -> np.dtype:
    """The narrowest signed dtype that holds every expert id and -1 (NeMo-RL's convention)."""
    return np.dtype(np.int8 if num_experts <= 128 else np.int16 if num_experts <= 32768 else np.int32)


@overload
def _to_numpy(x: None) -> None: ...
@overload
def _to_numpy(x: ArrayLike) -> np.ndarray: ...
@overload
def _to_numpy(x: Optional[ArrayLike]) -> Optional[np.ndarray]: ...
def _to_numpy(x: Any) -> Any:
    if x is None or isinstance(x, np.ndarray):
        return x
    dlpack_only = hasattr(x, "__dlpack__") and not hasattr(x, "__array__")  # a moecap export
    if dlpack_only and getattr(x, "dtype", None) == (4, 16, 1):  # bfloat16 (kDLBfloat), which NumPy refuses
        try:
            import torch
        except ImportError:
            raise TypeError("a bfloat16 DLPack array is read through torch, which is not installed; pass it "
                            "as float32") from None
        x = torch.from_dlpack(x)  # and on as a torch tensor
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    if dlpack_only:
        return np.from_dlpack(x)
    x = np.asarray(x)
    if x.dtype.name == "bfloat16":  # ml_dtypes' (a JAX array's), which NumPy's own routines do not know
        x = x.astype(np.float32)
    return x


#: Which model layers a capturer's layers are: `layers`, the model layer (0-based) of
#: each captured (MoE) layer, strictly increasing; `num_hidden_layers`, the model's.
#: moecap.hf.attach sets one as `capturer.layer_map`; RequestTable.finish reads it.
LayerMap = collections.namedtuple("LayerMap", "layers num_hidden_layers")


#: The most layers a RoutedExperts holds, and its largest num_hidden_layers: far past any model's, so that
#: a header or payload naming more, with no routing behind it (0 tokens), is refused before a layer map or
#: an all-layer payload the size of that number is built.
MAX_LAYERS = 1 << 16
#: The most ids a token holds over its layers (layers x top_k, and num_hidden_layers x top_k for the
#: all-layer payloads): DeepSeek-V3's 61 x 8 is 488. A header naming a top_k past it with 0 tokens would
#: otherwise have the converters allocate an all-layer row of that width.
MAX_IDS_PER_TOKEN = 1 << 20


def layer_list(layers: Any) -> tuple[int, ...]:
    """A `layers` argument as a tuple of Python ints: a sequence of ints (not bools or floats), the first >= 0,
    strictly increasing. Errors name the entry."""
    # NumPy would take True as 1. (A set of the entries' types: no per-entry Python loop on every construction.)
    if isinstance(layers, (list, tuple)) and not {bool, np.bool_}.isdisjoint(map(type, layers)):
        raise TypeError("layers must be a sequence of ints, not of bools")
    array = np.asarray(_to_numpy(layers))
    if array.ndim == 0 and array.dtype == object and isinstance(layers, Iterable):
        return layer_list(list(layers))  # dict keys, a generator, a map object: NumPy takes them for one object
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(f"layers must be a sequence of ints, not {array.dtype} of shape {array.shape}")
    if array.size and array[0] < 0:
        raise ValueError(f"layers[0] is {array[0]}; model layers start at 0")
    falls = np.flatnonzero(array[1:] <= array[:-1])
    if falls.size:
        i = int(falls[0]) + 1
        raise ValueError(f"layers[{i}] is {array[i]} after {array[i - 1]}; layers must be strictly increasing")
    return tuple(array.tolist())


def _layer_map(moe_layers, layers, num_hidden_layers):
    """Checks a layer map against ids with `moe_layers` layers: (layers tuple, num_hidden_layers)."""
    if moe_layers > MAX_LAYERS:
        raise ValueError(f"ids has {moe_layers} layers; a RoutedExperts holds at most {MAX_LAYERS}")
    if layers is None:
        layers = tuple(range(moe_layers))
    else:
        layers = layer_list(layers)
        if len(layers) != moe_layers:
            raise ValueError(f"layers has {len(layers)} entries; ids has {moe_layers} layers")
    least = layers[-1] + 1 if layers else 0
    if num_hidden_layers is None:
        num_hidden_layers = least
    num_hidden_layers = _integer("num_hidden_layers", num_hidden_layers)
    if num_hidden_layers < least:
        raise ValueError(f"num_hidden_layers is {num_hidden_layers}; layers names model layer {least - 1}")
    if num_hidden_layers > MAX_LAYERS:
        raise ValueError(f"num_hidden_layers is {num_hidden_layers}; a RoutedExperts holds at most {MAX_LAYERS}")
    return layers, num_hidden_layers


@functools.lru_cache(maxsize=64)
def layer_runs(layers: tuple[int, ...]) -> tuple[tuple[slice, slice], ...]:
    """The MoE layers as contiguous runs: (model-layer slice, ids-layer slice) pairs. MoE layers are one or a few
    contiguous runs (dense layers first, or every n-th), and a slice on the middle axis copies ~25x faster than
    the list index `[:, list(layers)]` (a gather element by element)."""
    runs = []
    first = 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or layers[i] != layers[i - 1] + 1:
            runs.append((slice(layers[first], layers[i - 1] + 1), slice(first, i)))
            first = i
    return tuple(runs)


class RoutedExperts:
    """One request's routed experts.

    ids      [tokens, layers, top_k], signed; -1 where a token has no expert
             (an empty slot, or an id out of range at capture)
    weights  None, or the same shape, float32 (float16 kept as is); meaningless
             where the id is -1 (a record stores 0 there, as a read returns)
    valid    [tokens] bool: False where the token's slot held no committed routing
    num_experts  routed experts of the model; ids are [0, num_experts)
    start    position in its sequence of the first token (a prefix-cache hit or
             a continued request starts past 0)
    layers   the model layer (0-based) of each entry of ids' layer axis, strictly
             increasing: ids holds the MoE layers only, in model order, and the
             layers missing from this tuple are dense (DeepSeek's first layers,
             Qwen2-MoE's mlp_only_layers). Default range(layers of ids).
    num_hidden_layers  the model's num_hidden_layers (default layers[-1] + 1):
             the layer axis of every all-layer payload (SGLang, vLLM, verl, ...)
    """

    # WeightDtype.BF16 where from_bytes read bfloat16 weights (held as float32): the dtype to_bytes keeps.
    _kept_weight_dtype: Optional[WeightDtype] = None

    def __init__(self, ids: ArrayLike, num_experts: int, weights: Optional[ArrayLike] = None,
                 valid: Optional[ArrayLike] = None, start: int = 0, *, layers: Optional[Sequence[int]] = None,
                 num_hidden_layers: Optional[int] = None) -> None:
        ids = _to_numpy(ids)
        if ids.ndim != 3 or ids.dtype.kind not in "iu":
            raise ValueError(f"ids must be an integer [tokens, layers, top_k] array, not {ids.dtype} {ids.shape}")
        if ids.shape[1] < 1 or ids.shape[2] < 1:
            raise ValueError(f"ids has shape {ids.shape}; layers and top_k must be >= 1")
        num_experts = _integer("num_experts", num_experts)
        if not 1 <= num_experts < 2**31:  # the record's limit; the ids' int32 holds no more
            raise ValueError(f"num_experts is {num_experts}; must be in [1, 2^31)")
        start = _integer("start", start)
        if not 0 <= start < 2**63:  # the record's signed 64-bit start_position
            raise ValueError(f"start is {start}; a position in a sequence is in [0, 2^63)")
        if start + ids.shape[0] - 1 >= 2**63:  # and every token's position after it
            raise ValueError(f"start is {start} with {ids.shape[0]} tokens; the last token's position must be "
                             "below 2^63")
        # Checked in their own dtype (NumPy 2 compares with any Python int exactly): no int64 copy, and a uint64
        # 2**64 - 1 does not pass for -1. An invalid token's ids are checked too: they are kept (a token whose
        # slot lacks one layer still shows the others), though a record stores such a token as no expert.
        # ids.min() and ids.max() first (two fast reductions, no bool temporaries of the ids' size); the element-wise
        # search only where they are out of range, to name the first offending id.
        unsigned = ids.dtype.kind == "u"
        if ids.size and (ids.max() >= num_experts or (not unsigned and ids.min() < -1)):
            out_of_range = ids >= num_experts if unsigned else (ids < -1) | (ids >= num_experts)
            bad = tuple(int(i) for i in np.argwhere(out_of_range)[0])
            raise ValueError(f"ids[{', '.join(map(str, bad))}] is {ids[bad]}; expected [0, {num_experts}) or -1")
        self.ids = ids.astype(signed_dtype(num_experts))
        self.num_experts = num_experts
        w = _to_numpy(weights)
        if w is not None:
            if w.dtype.kind not in "fiu":  # None objects would become NaN, strings fail deep in NumPy
                raise TypeError(f"weights must be real numbers, not {w.dtype}")
            if w.shape != ids.shape:
                raise ValueError(f"weights has shape {w.shape}; ids has {ids.shape}")
            # A copy: the caller's read buffers are the next request's.
            w = np.array(w, dtype=w.dtype if w.dtype in (np.float32, np.float16) else np.float32)
        self.weights = w
        v = np.ones(ids.shape[0], dtype=bool) if valid is None else np.asarray(_to_numpy(valid))
        if v.dtype != bool:  # a cast would make any string or float True
            if v.size and v.dtype.kind not in "iu":
                raise TypeError(f"valid must be bools (or 0 and 1), not {v.dtype}")
            if v.size and not np.isin(v, (0, 1)).all():
                raise ValueError(f"valid holds {v[~np.isin(v, (0, 1))][0]}; expected bools (or 0 and 1)")
        v = np.array(v, dtype=bool)  # a copy: the caller's read buffers are the next request's
        if v.shape != (ids.shape[0],):
            raise ValueError(f"valid has shape {v.shape}; expected ({ids.shape[0]},)")
        self.valid = v
        self.start = start
        self.layers, self.num_hidden_layers = _layer_map(ids.shape[1], layers, num_hidden_layers)
        if self.num_hidden_layers * ids.shape[2] > MAX_IDS_PER_TOKEN:  # num_hidden_layers >= the ids' layers
            raise ValueError(f"ids has top_k {ids.shape[2]} over num_hidden_layers {self.num_hidden_layers}; a token "
                             f"holds at most {MAX_IDS_PER_TOKEN} ids over its layers")

    @classmethod
    def from_read(cls, ids: ArrayLike, num_experts: int, weights: Optional[ArrayLike] = None, start: int = 0, *,
                  layers: Optional[Sequence[int]] = None, num_hidden_layers: Optional[int] = None) -> RoutedExperts:
        """A read's output: a token whose every id is -1 was an empty slot (never
        committed, or invalidated), which moecap_read reports as -1 ids (all
        ones in a uint8 or uint16 output)."""
        ids = _to_numpy(ids)
        if getattr(ids, "ndim", None) != 3:  # as the constructor names it, before the axes below are asked for
            raise ValueError(f"ids must be an integer [tokens, layers, top_k] array, not shape "
                             f"{getattr(ids, 'shape', None)}")
        if ids.dtype in (np.uint8, np.uint16) and np.iinfo(ids.dtype).max >= int(num_experts):
            ids = np.where(ids == np.iinfo(ids.dtype).max, -1, ids.astype(np.int32))
        valid = ~(ids < 0).all(axis=(1, 2)) if ids.size else np.ones(ids.shape[0], dtype=bool)
        return cls(ids, num_experts, weights=weights, valid=valid, start=start, layers=layers,
                   num_hidden_layers=num_hidden_layers)

    @property
    def layer_map(self) -> LayerMap:
        return LayerMap(self.layers, self.num_hidden_layers)

    def with_layer_map(self, layers: Sequence[int], num_hidden_layers: Optional[int] = None) -> RoutedExperts:
        """The same routing placed at model layers `layers` (e.g. a record read
        back with from_bytes, which does not carry the map)."""
        placed = type(self)(self.ids, self.num_experts, weights=self.weights, valid=self.valid, start=self.start,
                            layers=layers, num_hidden_layers=num_hidden_layers)
        placed._kept_weight_dtype = self._kept_weight_dtype
        return placed

    @classmethod
    def concat(cls, parts: Iterable[RoutedExperts]) -> RoutedExperts:
        """One routing from consecutive pieces of a sequence (a prefix, then the
        routing of each continuation, as multi-turn serving reads them): each
        piece starts where the one before it ends, with the same num_experts,
        layer map and top_k. Weights are kept where every piece has them."""
        parts = list(parts)
        if not parts:
            raise ValueError("parts is empty; concat needs at least one routing")
        stranger = next((i for i, p in enumerate(parts) if not isinstance(p, RoutedExperts)), None)
        if stranger is not None:
            raise TypeError(f"parts[{stranger}] is a {type(parts[stranger]).__name__}; concat joins RoutedExperts")
        first = parts[0]
        at = first.start + len(first)
        for i, p in enumerate(parts[1:], 1):
            if p.start != at:
                raise ValueError(f"parts[{i}] starts at position {p.start}; the pieces before it end at {at}")
            if (p.num_experts, p.layer_map, p.shape[2]) != (first.num_experts, first.layer_map, first.shape[2]):
                raise ValueError(f"parts[{i}] has num_experts {p.num_experts}, {p.layer_map}, top_k {p.shape[2]}; "
                                 f"parts[0] has {first.num_experts}, {first.layer_map}, top_k {first.shape[2]}")
            at += len(p)
        weight_parts = [p.weights for p in parts if p.weights is not None]
        keep_weights = len(weight_parts) == len(parts)
        # float16 kept where every piece holds it (as the constructor keeps it), else float32.
        half = keep_weights and all(w.dtype == np.float16 for w in weight_parts)
        weights = np.concatenate([w.astype(np.float16 if half else np.float32) for w in weight_parts]) \
            if keep_weights else None
        whole = cls(np.concatenate([p.ids for p in parts]), first.num_experts, weights=weights,
                    valid=np.concatenate([p.valid for p in parts]), start=first.start, layers=first.layers,
                    num_hidden_layers=first.num_hidden_layers)
        if keep_weights and all(p._kept_weight_dtype == WeightDtype.BF16 for p in parts):
            whole._kept_weight_dtype = WeightDtype.BF16  # pieces read from bfloat16 records stay bfloat16
        return whole

    def all_layers(self, dense: int = 0) -> np.ndarray:
        """ids over every model layer: [tokens, num_hidden_layers, top_k] in the
        signed ids dtype, dense layers filled with `dense`, MoE layers the ids
        (-1 in every MoE layer of a token that has no routing)."""
        info = np.iinfo(self.ids.dtype)
        dense = _integer("dense", dense)
        if not info.min <= dense <= info.max:
            raise ValueError(f"dense is {dense}; the ids dtype {self.ids.dtype} holds [{info.min}, {info.max}]")
        tokens, _, top_k = self.shape
        out = np.full((tokens, self.num_hidden_layers, top_k), dense, dtype=self.ids.dtype)
        return self._place(out, np.flatnonzero(~self.valid))

    def _place(self, out: np.ndarray, missing: np.ndarray, fill: int = -1) -> np.ndarray:
        """Writes the ids into out's MoE layers (out: [tokens, num_hidden_layers, top_k], any dtype; the dense
        layers are left as they are), and `fill` in the MoE layers of the tokens `missing` (indices). A slice
        per contiguous run of MoE layers (layer_runs), and no np.where copy of the ids; returns out."""
        for model, held in layer_runs(self.layers):
            out[:, model] = self.ids[:, held]
            if missing.size:
                out[missing, model] = fill
        return out

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.ids.shape

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutedExperts):
            return NotImplemented
        same_ids = (self.ids.shape == other.ids.shape and np.array_equal(self.valid, other.valid)
                    and np.array_equal(self.ids[self.valid], other.ids[other.valid]))
        # Weights where a token has an expert: an invalid token's, or a -1's, are no routing.
        routed = self.valid[:, None, None] & (self.ids >= 0)
        same_w = same_ids and ((self.weights is None and other.weights is None) or (
            self.weights is not None and other.weights is not None
            and np.array_equal(self.weights[routed], other.weights[routed])))
        return (self.num_experts == other.num_experts and self.start == other.start
                and self.layers == other.layers and self.num_hidden_layers == other.num_hidden_layers
                and same_ids and same_w)

    def __repr__(self) -> str:
        return (f"RoutedExperts(tokens={self.shape[0]}, layers={self.shape[1]}, top_k={self.shape[2]}, "
                f"num_experts={self.num_experts}, start={self.start}, weights={self.weights is not None}, "
                f"invalid={int((~self.valid).sum())}{self._layer_repr()})")

    def _layer_repr(self):
        if self.layers == tuple(range(self.num_hidden_layers)):
            return ""
        return f", layers={list(self.layers)}, num_hidden_layers={self.num_hidden_layers}"

    # --- the record ---------------------------------------------------------

    def to_bytes(self, packed: bool = True, weights: Any = "keep") -> bytes:
        """The routing record (moecap_record_encode). packed: ids at
        ceil(log2(num_experts + 1)) bits (else 8/16/32). weights: "keep" (as
        held: float32 or float16, or bfloat16 where from_bytes read a bfloat16
        record, so a record read and written again is the same bytes), None
        (leave out), or the dtype to store them in ("f32", "bf16", "f16", or the
        NumPy / torch dtype), converted by the library."""
        if not isinstance(packed, (bool, np.bool_)):  # "no" would be truthy
            raise TypeError(f"packed must be a bool, not {type(packed).__name__}")
        stored: Optional[WeightDtype] = None
        keep = isinstance(weights, str) and weights == "keep"
        if weights is not None and not keep:  # checked whether or not this routing holds weights
            names = {k: v for k, v in WEIGHT_DTYPES.items() if k is not None}
            try:
                stored = WEIGHT_DTYPES[_checked_dtype("weights", weights, names)]
            except ValueError:
                raise ValueError(f"weights must be 'keep', None, 'f32', 'bf16' or 'f16', not {weights!r}") from None
        elif keep:
            stored = self._kept_weight_dtype
        w = None
        if self.weights is not None and weights is not None:
            w = np.ascontiguousarray(self.weights)
        valid = None if self.valid.all() else self.valid.view(np.uint8)
        return _codec(_moecap.record_encode, np.ascontiguousarray(self.ids), self.num_experts, w, valid, self.start,
                      bool(packed), stored)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> RoutedExperts:
        """Reads a record (from to_bytes or moecap_record_encode), checking all of it
        (moecap_record_decode); a malformed one raises RecordError."""
        info = _codec(_moecap.record_parse, data)
        if info["num_layers"] > MAX_LAYERS:
            raise RecordError(Status.INVALID_ARGUMENT, f"record num_layers is {info['num_layers']}; a RoutedExperts "
                              f"holds at most {MAX_LAYERS}")
        if info["num_layers"] * info["top_k"] > MAX_IDS_PER_TOKEN:
            raise RecordError(Status.INVALID_ARGUMENT, f"record num_layers x top_k is {info['num_layers']} x "
                              f"{info['top_k']}; a token of a RoutedExperts holds at most {MAX_IDS_PER_TOKEN} ids")
        shape = (info["num_tokens"], info["num_layers"], info["top_k"])
        ids = np.empty(shape, dtype=signed_dtype(info["num_experts"]))
        weights = None
        if info["weight_dtype"] != WeightDtype.NONE:  # f16 kept as is; f32 and bf16 read as float32
            weights = np.empty(shape, dtype=np.float16 if info["weight_dtype"] == WeightDtype.F16 else np.float32)
        valid = np.empty(shape[0], dtype=np.uint8)
        _codec(_moecap.record_decode, data, ids, weights, valid)
        routed = cls(ids, info["num_experts"], weights=weights, valid=valid.astype(bool), start=info["start_position"])
        if info["weight_dtype"] == WeightDtype.BF16:  # NumPy has no bfloat16: held as float32, written back as read
            routed._kept_weight_dtype = WeightDtype.BF16
        return routed

    # --- what consumers take ----------------------------------------------------

    # The engines (moecap.formats.sglang / .vllm: what each engine's clients receive).

    def to_sglang(self, num_tokens: Optional[int] = None, invalid: str = "raise") -> str:
        """SGLang's meta_info["routed_experts"] (and OpenAI sglext.routed_experts):
        base64 of raw little-endian int32 [T-1-start, num_hidden_layers, top_k],
        dense layers 0, byte for byte what SGLang 0.5.23 sends. Tokens without
        routing are refused, or sent as 0 with invalid="zero" (SGLang has no
        value for them)."""
        from .formats import sglang
        return sglang.b64(sglang.encode(self, num_tokens, invalid))

    @classmethod
    def from_sglang(cls, payload: str | bytes | np.ndarray, num_experts: int, num_hidden_layers: int, top_k: int,
                    start: int = 0, layers: Optional[Sequence[int]] = None,
                    num_tokens: Optional[int] = None) -> RoutedExperts:
        """The inverse of to_sglang: SGLang's string (or bytes, or int32 array)
        reshaped with the model's num_hidden_layers and top_k, from start
        (routed_experts_start_len); layers: the MoE layers' model indices."""
        from .formats import sglang
        return sglang.decode(payload, num_experts, num_hidden_layers, top_k, start, layers, num_tokens)

    def to_vllm(self, num_tokens: Optional[int] = None, invalid: str = "raise") -> np.ndarray:
        """vLLM's CompletionOutput.routed_experts: an ndarray [T-1-start,
        num_hidden_layers, top_k], uint8 up to 256 experts else uint16, dense
        layers 0. Tokens without routing are refused, or sent as 0 with
        invalid="zero" (vLLM has no value for them)."""
        from .formats import vllm
        return vllm.encode(self, num_tokens, invalid)

    def to_vllm_openai(self, num_tokens: Optional[int] = None, invalid: str = "raise") -> str:
        """vLLM's OpenAI choices[i].routed_experts: base64 of the .npy of to_vllm()."""
        from .formats import vllm
        return vllm.openai(self, num_tokens, invalid)

    @classmethod
    def from_vllm(cls, payload: str | np.ndarray, num_experts: int, start: int = 0,
                  layers: Optional[Sequence[int]] = None, num_hidden_layers: Optional[int] = None,
                  num_tokens: Optional[int] = None) -> RoutedExperts:
        """The inverse of to_vllm / to_vllm_openai (an array, or the base64 .npy
        string), from start (routed_experts_prompt_start); layers: the MoE
        layers' model indices."""
        from .formats import vllm
        return vllm.decode(payload, num_experts, start, layers, num_hidden_layers, num_tokens)

    # The trainers (moecap.formats.<consumer> has each format's rules and decoder).

    def to_megatron(self, dtype: str = "int64", num_tokens: Optional[int] = None, invalid: str = "raise") -> list[Any]:
        """Megatron-core RouterReplay.set_replay_data: one torch [tokens, top_k]
        int64 (or int32) per MoE layer. num_tokens=T adds the last token's row
        (experts arange(top_k)); tokens without routing are refused, or routed
        to arange(top_k) with invalid="arange"."""
        from .formats import megatron
        return megatron.encode(self, dtype, num_tokens, invalid)

    def to_verl(self, prompt_len: int, prompt_width: int, response_width: int) -> np.ndarray:
        """verl's batch field routed_experts for this sequence: int16 [1,
        prompt_width + response_width, num_hidden_layers, top_k], the prompt
        left-padded, 0 elsewhere (the last token's row too)."""
        from .formats import verl
        return verl.encode(self, prompt_len, prompt_width, response_width)

    def to_slime(self, num_tokens: Optional[int] = None) -> np.ndarray:
        """slime's rollout_routed_experts: int32 [T-1-start, num_hidden_layers, top_k]."""
        from .formats import slime
        return slime.encode(self, num_tokens)

    def to_nemo_rl(self, num_tokens: Optional[int] = None, padded_length: Optional[int] = None,
                   layout: str = "full") -> str:
        """NeMo-RL's envelope ``nrlre1:<dtype>:<S>x<L>x<K>:<base64>``: narrowest
        signed dtype, default route arange(top_k) past T-1, -1 rows for tokens
        without routing."""
        from .formats import nemo_rl
        return nemo_rl.encode(self, num_tokens, padded_length, layout)

    def to_skyrl(self, num_tokens: Optional[int] = None) -> dict[str, Any]:
        """SkyRL's {"data", "shape", "dtype"}: T-1 rows, canonical dtype."""
        from .formats import skyrl
        return skyrl.encode(self, num_tokens)

    def to_prime_rl(self, num_tokens: Optional[int] = None) -> dict[str, Any]:
        """prime-rl's {"data", "shape", "start", "dtype"}: uint8, or uint16 past id 255."""
        from .formats import prime_rl
        return prime_rl.encode(self, num_tokens)


def sglang_base64_bytes_per_token(layers: int, top_k: int, dtype_bytes: int = 4) -> float:
    """Bytes of SGLang's base64 field per token (int32 unless said otherwise)."""
    return layers * top_k * dtype_bytes * 4 / 3
