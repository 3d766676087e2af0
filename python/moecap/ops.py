"""moecap's step-path calls as torch.library custom ops (torch >= 2.4).

``torch.ops.moecap.capture``, ``.commit`` and ``.invalidate`` have fake
implementations (no output, nothing to infer) and declare what they write:
capture mutates the capturer's device buffers, commit its host cache and slot
states (and reads the device buffer, so the two are never reordered),
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
"""
from __future__ import annotations

from typing import Optional

import torch

from . import BUFFERS, MoecapError, Status, _registry

if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 4):
    raise ImportError(f"moecap.ops needs torch >= 2.4 (torch.library.custom_op); this is {torch.__version__}")


def _capturer(capturer_id: int):
    cap = _registry.get(capturer_id)
    if cap is None:
        raise MoecapError(Status.INVALID_ARGUMENT, f"no live capturer has id {capturer_id}")
    return cap


#: How often _mirror had to copy a buffer (0 under Inductor, which re-inplaces).
mirror_copies = 0


def _mirror(declared: Optional[torch.Tensor], actual: Optional[torch.Tensor]) -> None:
    # A backend that functionalizes without re-inplacing hands the op a clone
    # of the buffer it declared and copies that clone back afterwards. The C
    # call wrote the capturer's real memory, so the clone must carry the same
    # contents or the copy-back would undo it. Inductor re-inplaces: no copy.
    global mirror_copies
    if declared is not None and actual is not None and declared.data_ptr() != actual.data_ptr():
        declared.copy_(actual)
        mirror_copies += 1


def _call(capturer: int, call, **declared: Optional[torch.Tensor]) -> None:
    """call(the capturer), then mirror its buffers into the declared mutated arguments (by name)."""
    cap = _capturer(capturer)
    call(cap)
    ops = cap.ops
    for name, tensor in declared.items():
        _mirror(tensor, getattr(ops, name))


@torch.library.custom_op("moecap::capture", mutates_args=("device_ids", "device_weights"))
def capture(device_ids: torch.Tensor, device_weights: Optional[torch.Tensor], capturer: int, layer: int,
            topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor]) -> None:
    """Capturer.capture on torch's current stream; device_ids/device_weights are the capturer's buffers."""
    _call(capturer, lambda cap: cap.capture(layer, topk_ids, topk_weights), device_ids=device_ids,
          device_weights=device_weights)


@capture.register_fake
def _(device_ids, device_weights, capturer, layer, topk_ids, topk_weights):
    return None


@torch.library.custom_op("moecap::commit", mutates_args=("host_ids", "host_weights", "host_states"))
def commit(host_ids: torch.Tensor, host_weights: Optional[torch.Tensor], host_states: torch.Tensor,
           device_ids: torch.Tensor, capturer: int, dst_slots: torch.Tensor, src_start: int,
           src_rows: Optional[torch.Tensor]) -> None:
    """Capturer.commit on torch's current stream; host_* are the capturer's host cache and slot states."""
    _call(capturer, lambda cap: cap.commit(dst_slots, src_start, src_rows), host_ids=host_ids,
          host_weights=host_weights, host_states=host_states)


@commit.register_fake
def _(host_ids, host_weights, host_states, device_ids, capturer, dst_slots, src_start, src_rows):
    return None


@torch.library.custom_op("moecap::invalidate", mutates_args=("host_states",))
def invalidate(host_states: torch.Tensor, capturer: int, slots: torch.Tensor) -> None:
    """Capturer.invalidate on torch's current stream: the slots read -1 until committed again."""
    _call(capturer, lambda cap: cap.invalidate(slots), host_states=host_states)


@invalidate.register_fake
def _(host_states, capturer, slots):
    return None


class CapturerOps:
    """A capturer's buffers as torch tensors and its calls as custom ops (pure Python, so Dynamo
    inlines these methods and sees only the op nodes)."""

    def __init__(self, cap):
        self.id = cap.id
        self._capturer = cap  # the registry holds capturers weakly; these ops keep theirs alive
        self.device_ids = torch.from_dlpack(cap.export("device_ids"))
        self.host_ids = torch.from_dlpack(cap.export("host_ids"))
        self.host_states = torch.from_dlpack(cap.export("host_states"))
        weights = cap.plan["weight_bytes"] > 0
        self.device_weights = torch.from_dlpack(cap.export("device_weights")) if weights else None
        self.host_weights = torch.from_dlpack(cap.export("host_weights")) if weights else None

    def capture(self, layer: int, topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor] = None) -> None:
        torch.ops.moecap.capture(self.device_ids, self.device_weights, self.id, layer, topk_ids, topk_weights)

    def commit(self, dst_slots: torch.Tensor, src_start: int = 0, src_rows: Optional[torch.Tensor] = None) -> None:
        torch.ops.moecap.commit(self.host_ids, self.host_weights, self.host_states, self.device_ids, self.id,
                                dst_slots, src_start, src_rows)

    def invalidate(self, slots: torch.Tensor) -> None:
        torch.ops.moecap.invalidate(self.host_states, self.id, slots)


__all__ = ["BUFFERS", "CapturerOps", "capture", "commit", "invalidate"]
