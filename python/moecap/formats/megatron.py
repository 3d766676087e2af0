# SPDX-License-Identifier: Apache-2.0
"""Megatron-core router replay (megatron.core.transformer.moe.router_replay).

``RouterReplay.set_replay_data(list)`` takes one tensor per MoE layer, in the
order the routers were built (the model's MoE layers, dense layers skipped),
each ``[tokens, top_k]`` of int32 or int64 (``scores.gather`` refuses int16
and uint8), tokens being everything the router sees. In REPLAY_FORWARD
``topk_routing_with_score_function`` routes every token to exactly those
experts. It has no value meaning "no routing": -1 fails in gather. Megatron
consults the replay only on that path: with ``moe_router_fusion`` (the fused
top-k returns first), quantile balancing (``precomputed_indices``) or sinkhorn
routing its routers route by their own scores (Megatron-LM ``d98e8a64``).

Rows: the routing's own rows, or with num_tokens=T (the trainer forwards the
whole sequence, the last token included) the T-1 rows plus one row for the
last token, which rollout never forwarded: experts ``arange(top_k)``, distinct
and valid, as NeMo-RL and SkyRL pad. That token's output predicts nothing and
causal attention keeps it from every earlier token, so its route changes no
log-probability (it does count in an auxiliary load-balancing loss).

Tokens without routing: refused (invalid="raise"), or with invalid="arange"
routed to ``arange(top_k)`` like the last token; then keep them out of the
loss (``missing(routed)`` says which they are).
"""
import numpy as np

from .. import _integer
from ._common import from_layer_axis, routed_tokens, sequence_length

CONSUMER = "Megatron's RouterReplay"
_DTYPES = ("int32", "int64")


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - the test venv has torch
        raise ImportError("moecap.formats.megatron hands Megatron torch tensors; install torch") from None
    return torch


def missing(routed):
    """bool [tokens]: the tokens invalid="arange" fills (no routing at capture, in some MoE layer or all)."""
    return ~routed_tokens(routed)


def encode(routed, dtype="int64", num_tokens=None, invalid="raise"):
    """One torch tensor [tokens, top_k] of `dtype` (int32 or int64) per MoE layer,
    in model order: what RouterReplay.set_replay_data takes. num_tokens: T, to
    add the last token's row (see the module's text)."""
    torch = _torch()
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"dtype is {dtype}; Megatron's gather takes int32 or int64 indices")
    if invalid not in ("raise", "arange"):
        raise ValueError(f"invalid must be 'raise' or 'arange', not {invalid!r}")
    top_k = routed.shape[2]
    if top_k > routed.num_experts:
        raise ValueError(f"top_k {top_k} exceeds num_experts {routed.num_experts}: no distinct filler route")
    holes = missing(routed)
    if holes.any() and invalid == "raise":
        raise ValueError(f"{CONSUMER} has no value for 'no routing', and {int(holes.sum())} token(s) have none (the "
                         f"first at position {routed.start + int(np.argmax(holes))}); pass invalid='arange' to route "
                         "them to experts arange(top_k) and keep them out of the loss")
    if num_tokens is not None:
        sequence_length(routed, num_tokens, CONSUMER)
    # Each layer's [rows, top_k] tensor its own allocation (a pickle or a pipeline stage's slice of the list
    # carries that layer only), cast from a layer-major copy of the ids in their narrow dtype: one transpose
    # of the small ids, then one contiguous cast per layer (no int64 copy of the whole routing cast again).
    tokens, layers, _ = routed.shape
    filler = torch.arange(top_k, dtype=getattr(torch, name))
    ids = torch.from_numpy(routed.ids).permute(1, 0, 2).contiguous()
    hole_rows = torch.from_numpy(np.flatnonzero(holes)) if holes.any() else None
    per_layer = []
    for layer in range(layers):
        out = torch.empty((tokens + (num_tokens is not None), top_k), dtype=filler.dtype)
        out[:tokens] = ids[layer]
        out[tokens:] = filler  # the last token's row, where num_tokens adds it
        if hole_rows is not None:
            out[hole_rows] = filler
        per_layer.append(out)
    return per_layer


def decode(per_layer, num_experts, num_tokens=None, layers=None, num_hidden_layers=None, start=0):
    """A RoutedExperts from one [tokens, top_k] tensor per MoE layer (as
    set_replay_data takes, or get_recorded_data returns). num_tokens=T drops
    the last token's row. layers: the MoE layers' model indices."""
    if per_layer is None or isinstance(per_layer, (str, bytes)) or not hasattr(per_layer, "__iter__"):
        raise ValueError(f"per_layer is a {type(per_layer).__name__}; Megatron replays a list of one [tokens, top_k] "
                         "tensor per MoE layer")
    parts = [np.asarray(p.detach().cpu() if hasattr(p, "detach") else p) for p in per_layer]
    if not parts:
        raise ValueError("per_layer is empty; Megatron replays one tensor per MoE layer")
    shapes = {p.shape for p in parts}
    if len(shapes) != 1 or len(parts[0].shape) != 2:
        raise ValueError(f"per_layer tensors have shapes {sorted(shapes)}; expected one [tokens, top_k] for all")
    ids = np.stack(parts, axis=1)
    if num_tokens is not None:
        num_tokens = _integer("num_tokens", num_tokens)
        if ids.shape[0] != num_tokens:
            raise ValueError(f"per_layer has {ids.shape[0]} rows; num_tokens is {num_tokens}")
        ids = ids[:-1]
    layers = range(ids.shape[1]) if layers is None else layers
    return from_layer_axis(ids, num_experts, layers, num_hidden_layers, CONSUMER, start=_integer("start", start),
                           axis="moe")
