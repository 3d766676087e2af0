# SPDX-License-Identifier: Apache-2.0
"""moecap's step-path calls as torch.library custom ops (torch >= 2.4).

``torch.ops.moecap.capture``, ``.commit`` and ``.invalidate`` have fake
implementations (no output, nothing to infer) and declare what they write
(``.snapshot`` copies a buffer where it stands, see below):
capture mutates the capturer's device buffers (and its expert-load histogram,
where it keeps one), commit its host cache and slot
states and the device rows it consumes (so the two are never reordered),
invalidate the slot states. Dynamo then traces
them as single nodes: a model that calls them compiles with
``torch.compile(fullgraph=True)`` and records into ``torch.cuda.graph``.

The buffers are the capturer's own memory, exported once as torch tensors
(``torch.from_dlpack``). A capturer travels through the graph as its int id
(``Capturer.id``). Use it through ``Capturer.ops``::

    ops = cap.ops                      # once, outside the compiled region
    ops.capture(layer, topk_ids, topk_weights)
    ops.commit(dst_slots)
    ops.invalidate(freed_slots)
    ops.layer_ids(layer)[:n].copy_(ids)  # plain writes: through this view of device_ids

The ops consume the tensors they are handed: a functionalized copy of a
device buffer is copied into moecap's memory before the C call (and back out
after capture and commit, which consumes its rows). A copy of the host cache
is refused (MoecapError INVALID_ARGUMENT): backends that functionalize without re-inplacing
(aot_eager) would copy the whole cache per step. Inductor hands the real
buffers and pays nothing, as long as the compiled code leaves the host
buffers (host_ids, host_weights, host_states) to the ops: a write to one, or a
clone of one taken before a commit, makes Inductor hand the op a copy too.

Inductor (torch 2.14) also orders a read of a slice of a buffer after a
later op in the same compiled code that writes the buffer (any custom op that
declares the write): a read of device_ids or of a layer view ahead of a commit
sees the consumed rows (-1), one of a layer view, the weights or the histogram
ahead of a capture sees what the capture wrote, and so does a plain
``clone()`` once a capture precedes it in the same code (Inductor folds the
clone into the buffer itself). Read the routing after the commit from the
host cache (or read() it), or take ``ops.snapshot(...)`` of the buffer where
the code needs it as it stands: a copy as an op of its own, which no compiler
pass folds away or moves past the op.
"""
from __future__ import annotations

import operator
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from . import BUFFERS, MoecapError, Status, _integer, _registry

if TYPE_CHECKING:
    from . import Capturer

if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 4):
    raise ImportError(f"moecap.ops needs torch >= 2.4 (torch.library.custom_op); this is {torch.__version__}")


def _capturer(capturer_id: int) -> Capturer:
    cap = _registry.get(capturer_id)
    if cap is None:
        raise MoecapError(Status.INVALID_ARGUMENT, f"no live capturer has id {capturer_id}")
    return cap


# capturer id -> a live CapturerOps of it (every one exports the same memory).
# The ops compare what they are handed with these buffers; asking the capturer
# for its own (Capturer.ops) would make one that holds the capturer from the
# capturer, and a capturer used only through another holder's ops (moecap.hf's)
# would then wait for the garbage collector.
_issuers: "weakref.WeakValueDictionary[int, CapturerOps]" = weakref.WeakValueDictionary()


def _buffers(cap: Capturer) -> CapturerOps:
    ops = _issuers.get(cap.id)
    return ops if ops is not None else cap.ops


#: How often an op was handed a copy of a device buffer and moved it in or out (0 under Inductor, unless
#: the compiled code reads a device buffer that a later op writes); each such op also saves and restores
#: moecap's own buffer, two more copies of it that this does not count.
buffer_copies = 0


def _is_copy(handed: Optional[torch.Tensor], real: Optional[torch.Tensor]) -> bool:
    # A backend that functionalizes without re-inplacing (aot_eager) hands an
    # op the functional value of a buffer: a tensor of its own, not moecap's
    # memory, which the C library is the only one to read and write.
    return handed is not None and real is not None and handed.data_ptr() != real.data_ptr()


def _check_host_buffer(op: str, name: str, handed: Optional[torch.Tensor], real: Optional[torch.Tensor]) -> None:
    # As a device buffer (_check_handed), and never a copy: keeping a copy of
    # the host cache in step would cost the whole cache (GBs) per call, and on
    # CUDA the host-side copy would race the commit kernel still writing that
    # pinned memory: refuse instead.
    _check_handed(op, name, handed, real)
    if handed is not None and real is not None and _is_copy(handed, real):
        raise MoecapError(Status.INVALID_ARGUMENT,
                          f"moecap::{op} was handed a copy of the capturer's {name} ({handed.numel()} elements), "
                          "not its memory: the torch.compile backend functionalizes without re-inplacing "
                          "(aot_eager does, and Inductor too where the compiled code also writes or keeps a "
                          f"clone of {name}); compile with backend='inductor' and leave the host buffers to the "
                          f"ops there, or call the capturer's {op} outside the compiled code")


def _check_handed(op: str, name: str, handed: Optional[torch.Tensor], real: Optional[torch.Tensor]) -> None:
    # What the C call writes must be what the op declares it writes, and a copy
    # goes in whole: a missing buffer would be written undeclared (a compiled
    # read of it could move past the op), and a tensor of another shape would
    # broadcast into moecap's memory, or fail halfway through the copies.
    if handed is real:
        return
    if handed is None or real is None:
        raise MoecapError(Status.INVALID_ARGUMENT,
                          f"moecap::{op}: {name} is {'None' if handed is None else 'given'}, but the capturer "
                          f"{'keeps' if real is not None else 'keeps no'} {name}; pass the capturer's ops.{name}"
                          + ("" if real is not None else " (None)"))
    if handed.shape != real.shape or handed.dtype != real.dtype or handed.device != real.device:
        raise MoecapError(Status.INVALID_ARGUMENT,
                          f"moecap::{op}: {name} is {handed.dtype} {tuple(handed.shape)} on {handed.device}; the "
                          f"capturer's is {real.dtype} {tuple(real.shape)} on {real.device}: pass ops.{name}")


def _through_device_buffers(cap: Capturer, op: str, device_ids: torch.Tensor, device_weights: Optional[torch.Tensor],
                            call: Callable[[], None], histogram: Optional[torch.Tensor] = None,
                            with_histogram: bool = False) -> None:
    # The op reads and writes moecap's device buffers: a copy the backend handed
    # it goes in before the C call and takes the call's effect back out.
    global buffer_copies
    real = _buffers(cap)
    handed = [("device_ids", device_ids, real.device_ids), ("device_weights", device_weights, real.device_weights)]
    if with_histogram:
        handed.append(("histogram", histogram, real.histogram))
    for name, given, own in handed:
        _check_handed(op, name, given, own)
    copies = [(given, own) for _, given, own in handed
              if given is not None and own is not None and _is_copy(given, own)]
    if not copies:
        call()
        return
    # The backend believes moecap's memory untouched by this op until it writes
    # its copies back at the end of the graph, and may read that memory before
    # then (Inductor hands commit a copy where the graph still reads the rows
    # it consumes). The C call works on moecap's memory only: what the graph
    # wrote goes in first (a top-k kernel or plain torch ops into a layer view
    # live only in the copy), the call's effect goes back out into the copy,
    # and the memory gets back what it held. All on torch's current stream,
    # so in order with the C call's kernels.
    held = [own.clone() for _, own in copies]
    try:
        for given, own in copies:
            own.copy_(given)
        call()
        if cap.config.side_stream:
            cap.join()  # the call's kernels ran forked: the copies below come after them
        for given, own in copies:
            given.copy_(own)
    finally:
        for (_, own), kept in zip(copies, held):
            own.copy_(kept)
    buffer_copies += 2 * len(copies)


@torch.library.custom_op("moecap::capture", mutates_args=("device_ids", "device_weights", "histogram"))
def capture(device_ids: torch.Tensor, device_weights: Optional[torch.Tensor], capturer: int, layer: int,
            topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor],
            histogram: Optional[torch.Tensor]) -> None:
    """Capturer.capture on torch's current stream; device_ids/device_weights (and histogram, which
    capture counts into) are the capturer's buffers. No mutated argument has a default: the
    dispatcher drops trailing arguments equal to their default, and torch 2.11's custom_op indexes
    every mutated argument by position (IndexError; torch 2.14 checks the length first)."""
    cap = _capturer(capturer)
    _through_device_buffers(cap, "capture", device_ids, device_weights,
                            lambda: cap.capture(layer, topk_ids, topk_weights), histogram, with_histogram=True)


@capture.register_fake
def _(device_ids, device_weights, capturer, layer, topk_ids, topk_weights, histogram):
    return None


@torch.library.custom_op("moecap::commit",
                         mutates_args=("host_ids", "host_weights", "host_states", "device_ids", "device_weights"))
def commit(host_ids: torch.Tensor, host_weights: Optional[torch.Tensor], host_states: torch.Tensor,
           device_ids: torch.Tensor, device_weights: Optional[torch.Tensor], capturer: int,
           dst_slots: torch.Tensor, src_start: int, src_rows: Optional[torch.Tensor]) -> None:
    """Capturer.commit on torch's current stream: reads device_ids/device_weights (what the graph
    wrote into them, layer views included), writes the host cache and slot states, and consumes the
    rows it read (they read "no routing", -1 or all ones, and weight 0 afterwards, so a row nobody writes
    again is never committed twice)."""
    cap = _capturer(capturer)
    real = _buffers(cap)
    for name, handed in (("host_ids", host_ids), ("host_weights", host_weights), ("host_states", host_states)):
        _check_host_buffer("commit", name, handed, getattr(real, name))
    _through_device_buffers(cap, "commit", device_ids, device_weights, lambda: cap.commit(dst_slots, src_start, src_rows))


@commit.register_fake
def _(host_ids, host_weights, host_states, device_ids, device_weights, capturer, dst_slots, src_start, src_rows):
    return None


@torch.library.custom_op("moecap::invalidate", mutates_args=("host_states",))
def invalidate(host_states: torch.Tensor, capturer: int, slots: torch.Tensor) -> None:
    """Capturer.invalidate on torch's current stream: the slots read -1 until committed again."""
    cap = _capturer(capturer)
    _check_host_buffer("invalidate", "host_states", host_states, _buffers(cap).host_states)
    cap.invalidate(slots)


@invalidate.register_fake
def _(host_states, capturer, slots):
    return None


@torch.library.custom_op("moecap::snapshot", mutates_args=())
def snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor`` taken where the call stands: in compiled code an op of its own,
    which Inductor keeps before a later commit or capture that writes ``tensor`` (it folds a plain
    ``clone()`` of a buffer the code writes into the buffer itself, which then shows the later write)."""
    return tensor.clone(memory_format=torch.contiguous_format)


@snapshot.register_fake
def _(tensor):
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


class CapturerOps:
    """A capturer's buffers as torch tensors and its calls as custom ops (pure Python, so Dynamo
    inlines these methods and sees only the op nodes)."""

    def __init__(self, cap: Capturer) -> None:
        # The capturer holds these ops; they name it by id (the registry holds it weakly) and do not hold
        # it back: a cycle would keep a dropped capturer's buffers until the garbage collector ran.
        self.id = cap.id
        # Normal tensors even when first asked for inside torch.inference_mode() (an engine's first
        # forward): inference tensors could not be written, nor handed to the ops, outside it later.
        with torch.inference_mode(False):
            self.device_ids = torch.from_dlpack(cap.export("device_ids"))
            self.host_ids = torch.from_dlpack(cap.export("host_ids"))
            self.host_states = torch.from_dlpack(cap.export("host_states"))
            weights = cap.plan.weight_bytes > 0
            self.device_weights = torch.from_dlpack(cap.export("device_weights")) if weights else None
            self.host_weights = torch.from_dlpack(cap.export("host_weights")) if weights else None
            # [num_layers, num_experts] int64 expert loads, which capture counts into (histogram=True):
            # read this tensor in compiled code, whose compiler then orders the read after the captures.
            self.histogram = torch.from_dlpack(cap.export("histogram")) if cap.config.histogram else None
        _issuers[cap.id] = self

    # A copy would hold copies of the buffer tensors, which its ops would copy
    # over the capturer's real buffers; a pickle would name whichever capturer
    # has this id in the loading process. Shallow copies share the tensors.
    def __copy__(self) -> "CapturerOps":
        return self

    def __deepcopy__(self, memo: Any) -> "CapturerOps":
        raise TypeError("CapturerOps cannot be deep-copied: it holds one capturer's buffers; keep cap.ops outside "
                        "the model (or give a copied model its own capturer's ops)")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("CapturerOps cannot be pickled: it holds one capturer's buffers, in this process")

    def layer_ids(self, layer: int) -> torch.Tensor:
        """Layer ``layer`` of device_ids (``[device_rows, top_k]``), for a top-k kernel's out= or
        plain torch writes in compiled code: a view of device_ids, so the compiler orders a
        commit after those writes (a separate ``torch.from_dlpack(cap.export("layer_ids"))``
        tensor shares no storage with it, so nothing would)."""
        return self.device_ids[self._layer("layer_ids", layer)]

    def layer_weights(self, layer: int) -> torch.Tensor:
        """Layer ``layer`` of device_weights, as layer_ids (needs weight_dtype)."""
        if self.device_weights is None:
            raise MoecapError(Status.INVALID_ARGUMENT, "layer_weights: the capturer keeps no weights (weight_dtype=None)")
        return self.device_weights[self._layer("layer_weights", layer)]

    def _layer(self, caller: str, layer: int) -> int:
        """layer as capture checks it: Python's negative indexing would hand out another layer's rows."""
        layers, index = self.device_ids.shape[0], _integer("layer", layer)
        if not 0 <= index < layers:
            raise MoecapError(Status.OUT_OF_RANGE, f"{caller}: layer is {index}; it must be in [0, num_layers = "
                              f"{layers})")
        return index

    def capture(self, layer: int, topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor] = None) -> None:
        layer = _op_int("capture", "layer", layer, 32)
        _refuse_meta("capture", "topk_ids", topk_ids, "topk_weights", topk_weights)
        torch.ops.moecap.capture(self.device_ids, self.device_weights, self.id, layer, topk_ids, topk_weights,
                                 self.histogram)

    def commit(self, dst_slots: torch.Tensor, src_start: int = 0, src_rows: Optional[torch.Tensor] = None) -> None:
        src_start = _op_int("commit", "src_start", src_start, 64)
        _refuse_meta("commit", "dst_slots", dst_slots, "src_rows", src_rows)
        torch.ops.moecap.commit(self.host_ids, self.host_weights, self.host_states, self.device_ids,
                                self.device_weights, self.id, dst_slots, src_start, src_rows)

    def invalidate(self, slots: torch.Tensor) -> None:
        _refuse_meta("invalidate", "slots", slots, "", None)
        torch.ops.moecap.invalidate(self.host_states, self.id, slots)

    @staticmethod
    def snapshot(tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` (``ops.device_ids``, a layer view, ``ops.histogram``) as it is here, which
        compiled code keeps ahead of the ops that write it afterwards (``moecap::snapshot``)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"snapshot: tensor is a {type(tensor).__name__}; expected a torch.Tensor")
        return torch.ops.moecap.snapshot(tensor)


# Checks the methods above make before the op, in terms Dynamo folds to constants (a traced int may be a
# SymInt, which _integer would specialize; a fake tensor reports the device it stands for).
def _op_int(caller: str, name: str, value: Any, bits: int) -> Any:
    """value for the op's int schema, refused as the capturer's calls refuse it: a TypeError naming the
    argument for anything without __index__, bools of any library and non-integer tensors (the schema
    would take True, and NumPy's floats and bools, as 1), MoecapError OUT_OF_RANGE past int64, the
    schema's width, where the dispatcher's own error names neither (within it, the capturer's call inside
    the op checks the C argument's width, `bits`, and says the same). An integer tensor is read as the
    capturer's calls read it, but not in compiled code, where its value is a read of device memory that
    a graph cannot hold."""
    if type(value) is int and -(1 << 63) <= value < (1 << 63):  # the common case, first: once per layer per step
        return value
    if isinstance(value, torch.SymInt):
        return value
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an int, not a {value.dtype} tensor")
        if torch.compiler.is_compiling():
            raise TypeError(f"{name} must be an int in compiled code, not a tensor (its value is a read of the "
                            "tensor's memory, which a graph cannot hold): pass a Python int")
        return _integer(name, value)
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_") or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if type(value) is not int:
        value = operator.index(value)
    if not -(1 << 63) <= value < (1 << 63):
        low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        says = f"moecap_{caller}: {name} is {value}; it must fit in int{bits} [{low}, {high}]"
        if torch.compiler.is_compiling():  # Dynamo traces a builtin exception, not MoecapError's constructor
            raise OverflowError(says)
        raise MoecapError(Status.OUT_OF_RANGE, says)
    return value


def _refuse_meta(caller: str, name: str, tensor: Optional[torch.Tensor], other: str,
                 other_tensor: Optional[torch.Tensor]) -> None:
    """A torch tensor with memory: the ops' schema takes torch tensors only (the capturer's own calls take
    any DLPack producer), and a meta tensor has no memory: the dispatcher would send it to the fake
    implementation, and the call would do nothing; the capturer's own calls refuse it as on the wrong
    device. (is_meta, not .device: it costs a tenth, on every layer's capture.)"""
    for label, t in ((name, tensor), (other, other_tensor)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"moecap_{caller}: {label} must be a torch.Tensor for the torch ops, not "
                            f"{type(t).__module__}.{type(t).__name__} (the capturer's own {caller}() takes any "
                            "DLPack producer)")
        if t.is_meta:
            raise MoecapError(Status.INVALID_ARGUMENT, f"moecap_{caller}: {label} is a meta tensor; it has no "
                              "memory to read")


__all__ = ["BUFFERS", "CapturerOps", "capture", "commit", "invalidate", "snapshot"]
