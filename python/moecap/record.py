"""RoutedExperts: one request's routing as a read returns it, its bytes, and
the shapes RL trainers take.

``to_bytes()`` and ``from_bytes()`` are the library's own codec for the routing
record of ``abi/moecap_record.h`` (specified in ``docs/RECORD_FORMAT.md``):
``moecap_record_encode`` / ``moecap_record_decode`` called through the
extension, so a record from Python and one from C are the same bytes by
construction, and bf16 weights are rounded by the same code. NumPy is all it
needs (no torch). The converters give what each consumer takes: SGLang's
base64 fields, Megatron-LM's per-layer router-replay indices, verl's
left-padded batch, NeMo-RL's narrow signed ids.
"""
from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from . import _checked_dtype, _moecap, WEIGHT_DTYPES
from ._errors import MoecapError
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
        raise RecordError(e.status, str(e).split(": ", 1)[-1]) from None


def id_bits(num_experts: int, packed: bool) -> int:
    """Width of one id code: the narrowest whose all-ones value is no expert."""
    if packed:
        return int(num_experts).bit_length()  # 2**bits - 1 >= num_experts
    return 8 if num_experts <= 0xFF else 16 if num_experts <= 0xFFFF else 32


def signed_dtype(num_experts: int) -> np.dtype:
    """The narrowest signed dtype that holds every expert id and -1 (NeMo-RL's convention)."""
    return np.dtype(np.int8 if num_experts <= 128 else np.int16 if num_experts <= 32768 else np.int32)


def _to_numpy(x: Any) -> Any:
    if x is None or isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


class RoutedExperts:
    """One request's routed experts.

    ids      [tokens, layers, top_k], signed; -1 where a token has no expert
             (an empty slot, or an id out of range at capture)
    weights  None, or the same shape, float32 (float16 kept as is)
    valid    [tokens] bool: False where the token's slot held no committed routing
    num_experts  routed experts of the model; ids are [0, num_experts)
    start    position in its sequence of the first token (a prefix-cache hit or
             a continued request starts past 0)
    """

    def __init__(self, ids: ArrayLike, num_experts: int, weights: Optional[ArrayLike] = None,
                 valid: Optional[ArrayLike] = None, start: int = 0) -> None:
        ids = _to_numpy(ids)
        if ids.ndim != 3 or ids.dtype.kind not in "iu":
            raise ValueError(f"ids must be an integer [tokens, layers, top_k] array, not {ids.dtype} {ids.shape}")
        num_experts = int(num_experts)
        if num_experts < 1:
            raise ValueError(f"num_experts is {num_experts}; must be >= 1")
        ids = ids.astype(np.int64)
        out_of_range = (ids < -1) | (ids >= num_experts)
        if out_of_range.any():
            bad = tuple(int(i) for i in np.argwhere(out_of_range)[0])
            raise ValueError(f"ids[{', '.join(map(str, bad))}] is {ids[bad]}; expected [0, {num_experts}) or -1")
        self.ids = ids.astype(signed_dtype(num_experts))
        self.num_experts = num_experts
        w = _to_numpy(weights)
        if w is not None:
            if w.shape != ids.shape:
                raise ValueError(f"weights has shape {w.shape}; ids has {ids.shape}")
            w = w if w.dtype in (np.float32, np.float16) else w.astype(np.float32)
        self.weights = w
        v = np.ones(ids.shape[0], dtype=bool) if valid is None else np.asarray(_to_numpy(valid)).astype(bool)
        if v.shape != (ids.shape[0],):
            raise ValueError(f"valid has shape {v.shape}; expected ({ids.shape[0]},)")
        self.valid = v
        self.start = int(start)

    @classmethod
    def from_read(cls, ids: ArrayLike, num_experts: int, weights: Optional[ArrayLike] = None,
                  start: int = 0) -> RoutedExperts:
        """A read's output: a token whose every id is -1 was an empty slot (never
        committed, or invalidated), which moecap_read reports as -1 ids."""
        ids = _to_numpy(ids)
        valid = ~(ids < 0).all(axis=(1, 2)) if ids.size else np.ones(ids.shape[0], dtype=bool)
        return cls(ids, num_experts, weights=weights, valid=valid, start=start)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.ids.shape

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutedExperts):
            return NotImplemented
        same_w = (self.weights is None) == (other.weights is None) and (
            self.weights is None or np.array_equal(self.weights[self.valid], other.weights[other.valid]))
        return (self.num_experts == other.num_experts and self.start == other.start
                and np.array_equal(self.valid, other.valid) and same_w
                and np.array_equal(self.ids[self.valid], other.ids[other.valid]))

    def __repr__(self) -> str:
        return (f"RoutedExperts(tokens={self.shape[0]}, layers={self.shape[1]}, top_k={self.shape[2]}, "
                f"num_experts={self.num_experts}, start={self.start}, weights={self.weights is not None}, "
                f"invalid={int((~self.valid).sum())})")

    # --- the record ---------------------------------------------------------

    def to_bytes(self, packed: bool = True, weights: Any = "keep") -> bytes:
        """The routing record (moecap_record_encode). packed: ids at
        ceil(log2(num_experts + 1)) bits (else 8/16/32). weights: "keep" (as
        held), None (leave out), or the dtype to store them in ("f32", "bf16",
        "f16", or the NumPy / torch dtype), converted by the library."""
        stored: Optional[WeightDtype] = None
        w = None
        if self.weights is not None and weights is not None:
            w = np.ascontiguousarray(self.weights)
            if not (isinstance(weights, str) and weights == "keep"):
                names = {k: v for k, v in WEIGHT_DTYPES.items() if k is not None}
                try:
                    stored = WEIGHT_DTYPES[_checked_dtype("weights", weights, names)]
                except ValueError:
                    raise ValueError(f"weights must be 'keep', None, 'f32', 'bf16' or 'f16', not {weights!r}") from None
        valid = None if self.valid.all() else self.valid.view(np.uint8)
        return _codec(_moecap.record_encode, np.ascontiguousarray(self.ids), self.num_experts, w, valid, self.start,
                      bool(packed), stored)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> RoutedExperts:
        """Reads a record (from to_bytes or moecap_record_encode), checking all of it
        (moecap_record_decode); a malformed one raises RecordError."""
        info = _codec(_moecap.record_parse, data)
        shape = (info["num_tokens"], info["num_layers"], info["top_k"])
        ids = np.empty(shape, dtype=signed_dtype(info["num_experts"]))
        weights = None
        if info["weight_dtype"] != WeightDtype.NONE:  # f16 kept as is; f32 and bf16 read as float32
            weights = np.empty(shape, dtype=np.float16 if info["weight_dtype"] == WeightDtype.F16 else np.float32)
        valid = np.empty(shape[0], dtype=np.uint8)
        _codec(_moecap.record_decode, data, ids, weights, valid)
        return cls(ids, info["num_experts"], weights=weights, valid=valid.astype(bool), start=info["start_position"])

    # --- what consumers take ----------------------------------------------------

    def to_sglang(self, dtype="int32"):
        """SGLang's response fields: base64 of the ids as `dtype` (int32 in SGLang's
        first versions, which consumers decode as np.int32 reshaped to
        (-1, layers, top_k); newer ones send uint8/uint16 and name the dtype).
        SGLang leaves out the last token (never forwarded); so does the record."""
        dt = np.dtype(dtype)
        if dt.kind == "u" and not self.valid.all():
            raise ValueError(f"{dtype} cannot say 'no expert' and some tokens are invalid; use a signed dtype")
        if self.num_experts - 1 > np.iinfo(dt).max:
            raise ValueError(f"{dtype} cannot hold expert {self.num_experts - 1}")
        ids = np.where(self.valid[:, None, None], self.ids, -1)
        return {"routed_experts": base64.b64encode(ids.astype(dt).tobytes()).decode("ascii"),
                "routed_experts_dtype": dt.name, "routed_experts_shape": list(self.shape)}

    def to_megatron(self):
        """Megatron-LM router replay: one int64 [tokens, top_k] tensor per layer
        (torch if installed, else numpy), the indices each layer's router is forced to."""
        per_layer = [np.ascontiguousarray(self.ids[:, layer, :]).astype(np.int64) for layer in range(self.shape[1])]
        try:
            import torch
        except ImportError:
            return per_layer
        return [torch.from_numpy(x) for x in per_layer]

    def to_verl(self, total_len, pad_value=0):
        """verl's routed_experts: (1, total_len, layers, top_k) int64, the request's
        tokens at the right end (left padding, as verl pads its prompts), pad_value
        elsewhere; invalid tokens also pad_value (verl masks by attention_mask)."""
        tokens, layers, top_k = self.shape
        if total_len < tokens:
            raise ValueError(f"total_len is {total_len}; the request has {tokens} tokens")
        out = np.full((1, total_len, layers, top_k), pad_value, dtype=np.int64)
        out[0, total_len - tokens:] = np.where(self.valid[:, None, None], self.ids, pad_value)
        return out

    def to_nemo_rl(self):
        """NeMo-RL: the narrowest signed dtype holding every id, -1 for 'none'."""
        return np.where(self.valid[:, None, None], self.ids, -1).astype(signed_dtype(self.num_experts))


def sglang_base64_bytes_per_token(layers, top_k, dtype_bytes=4):
    """Bytes of SGLang's base64 field per token (int32 unless said otherwise)."""
    return layers * top_k * dtype_bytes * 4 / 3
