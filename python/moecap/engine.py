# SPDX-License-Identifier: Apache-2.0
"""Engine-step helpers: what every integration writes around a Capturer.

``commit_batch`` commits this rank's rows of a gathered (eager or padded)
batch in one call; ``RequestTable`` keeps each running request's KV slots and,
when the request finishes, reads its routing and frees the slots' routing so
a reused slot can never hand the next request stale experts;
``write_routed`` stores routing that arrived as a record (prefill/decode
disaggregation: the prefill instance sends the prompt's record along with
its KV).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import numpy as np

from ._errors import MoecapError, Status
from . import _integer
from .record import RoutedExperts

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

    from . import Capturer, DLPackArray

#: Slots or token positions: a tensor (any DLPack producer, kept on its device) or a sequence of ints.
Slots = Union["DLPackArray", Sequence[int], np.ndarray]


def _ints(values: Any, name: str) -> np.ndarray:
    """values (a sequence, or one int) as a 1-D int64 array; floats, bools,
    strings and 2-D arrays are refused, as the capturer refuses them, never
    truncated (3.9 is not slot 3) or flattened (a [ranks, rows] array is not
    one rank's slots)."""
    array = np.asarray(values)
    if array.ndim > 1:
        raise MoecapError(Status.INVALID_ARGUMENT, f"{name} has ndim {array.ndim}; expected 1")
    array = array.reshape(-1)
    if array.size == 0:
        return np.empty(0, dtype=np.int64)
    if isinstance(values, (list, tuple)):
        # NumPy makes [5, True] int64 and [-1, 2**63] float64: an element's own type says what was meant,
        # looked at only where a bool could be among the ints (a short list's types are quicker to see than
        # a long one's 0s and 1s), or the ints became floats.
        if array.dtype.kind in "iu" and (not set(map(type, values)) <= {int} if len(values) <= 128 else
                                         ((array == 0) | (array == 1)).any()):
            bad = next((i for i, v in enumerate(values) if _is_bool(v)), None)
            if bad is not None:
                raise MoecapError(Status.INVALID_ARGUMENT, f"{name}[{bad}] is a bool; expected an int")
        elif array.dtype.kind in "fO" and all(isinstance(v, (int, np.integer)) for v in values):
            past = next(((i, int(v)) for i, v in enumerate(values) if not -2**63 <= int(v) < 2**63), None)
            if past is not None:
                raise MoecapError(Status.OUT_OF_RANGE, f"{name}[{past[0]}] is {past[1]}, past int64")
    if array.dtype.kind not in "iu":
        raise MoecapError(Status.INVALID_ARGUMENT, f"{name} has dtype {array.dtype}; expected integers")
    if array.dtype == np.uint64 and array.max() > np.iinfo(np.int64).max:  # as int64 it would wrap to a slot
        raise MoecapError(Status.OUT_OF_RANGE, f"{name} holds {int(array.max())}, past int64")
    return np.ascontiguousarray(array.astype(np.int64, copy=False))


def _is_bool(value: Any) -> bool:
    """A bool of any library: Python's, NumPy's, or a 0-d bool array or tensor."""
    return isinstance(value, (bool, np.bool_)) or (getattr(value, "ndim", None) == 0 and
                                                    str(getattr(value, "dtype", "")) in ("bool", "torch.bool"))


def _index_array(slots: Any) -> Any:
    if hasattr(slots, "__dlpack__") and not isinstance(slots, np.ndarray):
        return slots  # a tensor: handed to the capturer as is (device slots stay on device)
    return _ints(slots, "slots")


def _length(slots: Any) -> int:
    """Entries of slots as _index_array hands them on (a tensor, or _ints' 1-D array); a DLPack producer
    without a shape is asked its len()."""
    shape = getattr(slots, "shape", None)
    if shape is None:
        try:
            return len(slots)
        except TypeError:
            raise TypeError(f"slots is a {type(slots).__name__} with neither a shape nor a length") from None
    if len(shape) != 1:
        raise MoecapError(Status.INVALID_ARGUMENT, f"slots has ndim {len(shape)}; expected 1")
    return int(shape[0])


def commit_batch(capturer: Capturer, slots: Slots, dp_rank: int = 0, tokens_per_rank: Optional[Sequence[int]] = None,
                 padded_tokens_per_rank: Optional[int] = None, stream: Any = None) -> tuple[int, int, int]:
    """Commits this rank's rows of the batch the MoE layers just saw.

    slots: one KV slot per real row this rank put into the batch, as many as
    tokens_per_rank[dp_rank] (a row given -1 is dropped; a graph's padding
    rows past them are not listed). tokens_per_rank: every attention-DP
    rank's real row count (default: this rank alone). padded_tokens_per_rank:
    the graph's per-rank row count for a padded (CUDA-graph) batch; None for
    eager batches packed back to back. A rank with no rows commits an empty list, which
    moves nothing but ends the step (see moecap_capture, "Steps"). Returns
    (start, count, total) of this rank's rows.
    """
    index = _index_array(slots)
    n = _length(index)
    if tokens_per_rank is None:
        tokens_per_rank = [n]
    tokens_per_rank = [_integer(f"tokens_per_rank[{i}]", t) for i, t in enumerate(tokens_per_rank)]
    dp_rank = _integer("dp_rank", dp_rank)
    if not 0 <= dp_rank < len(tokens_per_rank):
        raise ValueError(f"dp_rank is {dp_rank}; tokens_per_rank has {len(tokens_per_rank)} ranks")
    if tokens_per_rank[dp_rank] != n:
        raise ValueError(f"slots has {n} entries; tokens_per_rank[{dp_rank}] says this rank has "
                         f"{tokens_per_rank[dp_rank]} rows")
    start, count, total = capturer.local_rows(dp_rank, tokens_per_rank, padded_tokens_per_rank)
    capturer.commit(index, src_start=start, stream=stream)
    return start, count, total


def batch_slots(attention_mask: ArrayLike, slots_per_row: Sequence[ArrayLike]) -> np.ndarray:
    """dst slots for a [batch, seq] forward flattened row-major, as the MoE
    layers see it: row b's real tokens (mask 1) take slots_per_row[b] in
    order, padding (mask 0) takes -1."""
    mask = np.asarray(attention_mask.cpu() if hasattr(attention_mask, "cpu") else attention_mask).astype(bool)
    if mask.ndim != 2 or len(slots_per_row) != mask.shape[0]:
        raise ValueError(f"slots_per_row has {len(slots_per_row)} rows; attention_mask is {list(mask.shape)} "
                         "([batch, seq]): one slot list per row")
    out = np.full(mask.shape, -1, dtype=np.int64)
    real = mask.sum(axis=1).tolist()
    if _cpu_int_tensors(slots_per_row):  # what _ints takes as is: one torch.cat, no NumPy conversion per row
        tensors: list[Any] = list(slots_per_row)
        for b, given in enumerate(tensors):
            if given.shape[0] != real[b]:
                raise ValueError(f"row {b} has {real[b]} real tokens but {given.shape[0]} slots")
        if tensors:
            import torch  # present: the rows are its tensors
            out[mask] = torch.cat(tensors).to(torch.int64).numpy()
        return out.reshape(-1)
    rows = []
    for b, given in enumerate(slots_per_row):  # each row checked in turn: the first bad one is the one named
        row_slots = _ints(given, f"slots_per_row[{b}]")
        if row_slots.shape[0] != real[b]:
            raise ValueError(f"row {b} has {real[b]} real tokens but {row_slots.shape[0]} slots")
        rows.append(row_slots)
    if rows:  # one masked assign (row-major, as the rows' real tokens are in order), not one per row
        out[mask] = np.concatenate(rows)
    return out.reshape(-1)


# torch dtypes _ints converts to int64 unchanged, and torch.cat promotes among without loss.
_TORCH_INTS = frozenset(("torch.int8", "torch.int16", "torch.int32", "torch.int64", "torch.uint8"))


def _cpu_int_tensors(rows: Sequence[Any]) -> bool:
    """Every row a plain 1-D integer CPU torch tensor (of _TORCH_INTS)."""
    return all(type(r).__module__ == "torch" and type(r).__name__ == "Tensor" and r.ndim == 1
               and r.device.type == "cpu" and str(r.dtype) in _TORCH_INTS for r in rows)


class RequestTable:
    """Which KV slots hold each running request's tokens, in token order.

    finish(rid) reads the request's routing (a RoutedExperts) and invalidates
    its slots where the capturer can (moecap_invalidate), so the engine may
    hand them to the next request; abort(rid) only invalidates. With a prefix
    (radix) cache, whose slots outlive the request and are shared with later
    ones, pass ``free=``: only the slots the engine frees now are invalidated,
    and the cache invalidates the rest when it evicts them.
    """

    def __init__(self, capturer: Capturer, num_experts: Optional[int] = None) -> None:
        self.capturer = capturer
        config = getattr(capturer, "config", {})
        self.num_experts = _integer("num_experts", num_experts if num_experts is not None else config["num_experts"])
        if not 1 <= self.num_experts < 2**31:  # refused now: every finish() would refuse it
            raise ValueError(f"num_experts is {self.num_experts}; must be in [1, 2^31)")
        self.num_layers = int(config["num_layers"])
        self.top_k = int(config["top_k"])
        self.weights = config.get("weight_dtype") is not None
        self.host_slots = config.get("host_slots")
        self._slots: dict[Any, list[np.ndarray]] = {}
        self._start: dict[Any, int] = {}
        self._late: set[Any] = set()  # requests started past 2^62, whose end append checks against 2^63

    def __contains__(self, rid: object) -> bool:
        return rid in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def start(self, rid: Any, position: int = 0) -> None:
        """A new request whose first captured token sits at `position`."""
        if rid in self._slots:
            raise KeyError(f"request {rid!r} is already running")
        position = _integer("position", position)
        # Refused now: finish() would refuse it at every call, and the request never end.
        if not 0 <= position < 2**63:
            raise ValueError(f"position is {position}; a position in a sequence is in [0, 2^63)")
        self._slots[rid] = []
        self._start[rid] = position
        if position >= 2**62:
            self._late.add(rid)

    def _running(self, rid: Any) -> list[np.ndarray]:
        parts = self._slots.get(rid)
        if parts is None:
            raise KeyError(f"request {rid!r} is not running (start() it first)")
        return parts

    def append(self, rid: Any, slots: ArrayLike) -> None:
        """The slots of the request's next tokens (in order), each in [0, host_slots)."""
        parts = self._running(rid)
        slots = self._checked_slots(slots)
        self._check_end(rid, len(slots))
        # A copy: engines reuse their slot buffers from step to step.
        parts.append(np.array(slots))

    def append_step(self, rids: Sequence[Any], slots: ArrayLike, counts: Optional[ArrayLike] = None) -> None:
        """One step's slots for several running requests, in the order the step lists them: rids[i]
        takes the next counts[i] entries of `slots` (one each when counts is None: a decode step).
        The same as append(rid, its entries) for each in turn, checked in full first: a refused step
        appends nothing."""
        slots = np.array(self._checked_slots(slots))  # one copy for the step: engines reuse their buffers
        rids = list(rids)
        if not self._slots.keys() >= set(rids):
            self._running(next(rid for rid in rids if rid not in self._slots))  # raises, naming it
        if counts is None:
            if len(slots) != len(rids):
                raise ValueError(f"slots has {len(slots)} entries for {len(rids)} requests; a step where a request "
                                 "has more or fewer than one token passes counts=")
            parts: Union[np.ndarray, list[np.ndarray]] = slots.reshape(len(rids), 1)  # its rows
        else:
            counts = _ints(counts, "counts")
            if len(counts) != len(rids):
                raise ValueError(f"counts has {len(counts)} entries for {len(rids)} requests")
            if len(counts) and counts.min() < 0:
                i = int(np.argmin(counts))
                raise ValueError(f"counts[{i}] is {counts[i]}; a request's token count is >= 0")
            if int(counts.sum()) != len(slots):
                raise ValueError(f"counts add up to {int(counts.sum())}; slots has {len(slots)} entries")
            ends = np.cumsum(counts).tolist()  # slices, not np.split: a tenth of its time at 256 requests
            parts = [slots[end - count:end] for end, count in zip(ends, counts.tolist())]
        if self._late and not self._late.isdisjoint(rids):  # append's rare check, with this step's earlier parts
            adding: dict[Any, int] = {}
            for rid, part in zip(rids, parts):
                adding[rid] = adding.get(rid, 0) + len(part)
                self._check_end(rid, adding[rid])
        for rid, part in zip(rids, parts):
            self._slots[rid].append(part)

    def _checked_slots(self, slots: ArrayLike) -> np.ndarray:
        slots = _ints(slots, "slots")
        outside: Union[np.ndarray, tuple[int, ...]] = (
            np.flatnonzero((slots < 0) | (slots >= self.host_slots)) if self.host_slots is not None else ())
        if len(outside):  # refused now: finish() and abort() would refuse it at every call, and the request never end
            i = int(outside[0])
            raise MoecapError(Status.OUT_OF_RANGE, f"slots[{i}] is {slots[i]}; a token's KV slot is in "
                              f"[0, host_slots = {self.host_slots})")
        return slots

    def _check_end(self, rid: Any, adding: int) -> None:
        # The record's positions are int64 (finish would refuse it at every call); only a start past 2^62
        # can get there, so the count of tokens so far is summed only then.
        if rid in self._late:
            last = self._start[rid] + sum(len(p) for p in self._slots[rid]) + adding - 1
            if last >= 2**63:
                raise ValueError(f"request {rid!r} would end at position {last}; a position in a sequence is in "
                                 "[0, 2^63)")

    def slots(self, rid: Any) -> np.ndarray:
        parts = self._running(rid)
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def finish(self, rid: Any, free: Optional[ArrayLike] = None) -> RoutedExperts:
        """Reads the request's routing, invalidates its slots (or only `free`: see abort), forgets it."""
        slots = self.slots(rid)
        shape = (slots.shape[0], self.num_layers, self.top_k)
        ids = np.empty(shape, dtype=np.int32)
        weights = np.empty(shape, dtype=np.float32) if self.weights else None
        if weights is None:
            self.capturer.read(slots, out=ids)
        else:
            self.capturer.read(slots, out=ids, weights_out=weights)
        # The model layer of each captured layer, where attach (or the engine) said it.
        layer_map = getattr(self.capturer, "layer_map", None) or (None, None)
        slot_states = getattr(self.capturer, "slot_states", None)
        if slot_states is None:  # a library before 1.1: a token whose ids all read -1 had no routing
            routed = RoutedExperts.from_read(ids, self.num_experts, weights=weights, start=self._start[rid],
                                             layers=layer_map[0], num_hidden_layers=layer_map[1])
        else:  # which slots held committed routing, also where every id of a token was out of range
            from . import SLOT_VALID
            valid = (np.asarray(slot_states(slots)) & SLOT_VALID) != 0
            routed = RoutedExperts(ids, self.num_experts, weights=weights, valid=valid, start=self._start[rid],
                                   layers=layer_map[0], num_hidden_layers=layer_map[1])
        self.abort(rid, free)
        return routed

    def abort(self, rid: Any, free: Optional[ArrayLike] = None) -> None:
        """Forgets the request and invalidates the routing of its slots, without reading it.

        free: the slots the engine frees with the request (default: all of
        them); those a prefix cache keeps for later requests (a shared prefix)
        keep their routing. Each must be one of the request's slots."""
        if getattr(self.capturer, "recording", False):
            # The invalidate would go into the graph, not run: the slots would be handed on with their
            # routing, and a launch of the graph would empty them under their next owner.
            raise MoecapError(Status.CAPTURE_ILLEGAL, f"abort({rid!r}): the capturer is recording a graph "
                              "(graph_begin); free a request's slots after graph_end")
        slots = self.slots(rid)
        if free is not None:
            free = _ints(free, "free")
            foreign = free[~np.isin(free, slots)]
            if foreign.size:
                raise ValueError(f"free holds slot {int(foreign[0])}, which is not one of request {rid!r}'s slots")
            slots = free
        invalidate = getattr(self.capturer, "invalidate", None)
        if invalidate is not None and slots.shape[0]:
            invalidate(slots)
        del self._slots[rid], self._start[rid]
        self._late.discard(rid)


def write_routed(capturer: Capturer, slots: Slots, routed: RoutedExperts) -> None:
    """Stores a RoutedExperts (e.g. RoutedExperts.from_bytes of a prefill
    instance's record) at `slots`, one per token; its invalid tokens leave
    their slots empty. Weights go along iff the capturer keeps them. A routing
    of other model layers (the capturer's layer map, or every layer without
    one), of a model of another layer count, or of another expert count is
    refused."""
    if not isinstance(routed, RoutedExperts):
        raise TypeError(f"routed must be a RoutedExperts (RoutedExperts.from_bytes of a record), not "
                        f"{type(routed).__name__}")
    index = _index_array(slots)
    if _length(index) != routed.shape[0]:
        raise ValueError(f"slots has {_length(index)} entries; the routing has {routed.shape[0]} tokens")
    config = getattr(capturer, "config", {})
    # Without a map the capturer's layers are the model's, every one MoE (what a read of it reports).
    layers, hidden = getattr(capturer, "layer_map", None) or (None, None)
    source = "its layer map"
    if layers is None and config.get("num_layers") is not None:
        layers, hidden = range(config["num_layers"]), config["num_layers"]
        source = "every model layer: it has no layer map"
    if layers is not None and tuple(layers) != tuple(routed.layers):
        raise ValueError(f"the routing holds model layers {list(routed.layers)}; the capturer captures "
                         f"{list(layers)} ({source})")
    if hidden is not None and hidden != routed.num_hidden_layers:
        raise ValueError(f"the routing is of a model of {routed.num_hidden_layers} layers; the capturer's is of "
                         f"{hidden} ({source})")
    if config.get("num_experts") is not None and routed.num_experts != config["num_experts"]:
        raise ValueError(f"the routing's num_experts is {routed.num_experts}; the capturer's is "
                         f"{config['num_experts']} (another model's routing)")
    ids = np.where(routed.valid[:, None, None], routed.ids, -1).astype(np.int32)
    weights = None
    if config.get("weight_dtype") is not None:
        if routed.weights is None:
            raise ValueError("the capturer keeps weights but the routing has none")
        weights = np.ascontiguousarray(routed.weights, dtype=np.float32)
    capturer.write(index, ids, weights)
