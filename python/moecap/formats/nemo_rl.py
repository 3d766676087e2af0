# SPDX-License-Identifier: Apache-2.0
"""NeMo-RL (vLLM rollout, Megatron training): routed_experts as its envelope.

NeMo-RL's ``pad_and_align_routed_expert_indices`` turns vLLM's T-1 rows into
a full ``[padded_length, L, K]`` tensor of the narrowest signed dtype that
holds num_experts - 1 and -1 (``resolve_routed_experts_dtype``: int8 up to 128
experts, int16, int32): the routes in rows [0, T-1), the default route
``arange(K)`` in every later row (the last token's and the padding), and -1
across the whole row of a token whose route is missing.
``encode_routed_experts`` wraps it as ``"nrlre1:<dtype>:<S>x<L>x<K>:<base64 of
the C-contiguous bytes>"``. Its Megatron side accepts the layer axis as every
model layer (vLLM's layout, dense layers 0) or the MoE layers only, hands
``[:, layer, :].to(torch.long)`` to each router's RouterReplay, and patches
get_replay_topk so an all -1 row takes the native router's experts.

Rows: T-1 from position 0, then the default route up to padded_length
(default T). Tokens without routing: -1 across the row, NeMo-RL's own "missing
route" (the trainer routes them natively); the only trainer format with such a
value.
"""
import base64

import numpy as np

from ..record import layer_list, signed_dtype
from .. import _integer
from ._common import array_from_base64, dimensions, from_layer_axis, moe_rows, routed_tokens, sequence_length

CONSUMER = "NeMo-RL"
MAGIC = "nrlre1"
_DTYPES = {"int8": np.dtype("<i1"), "int16": np.dtype("<i2"), "int32": np.dtype("<i4")}


def array(routed, num_tokens=None, padded_length=None, layout="full"):
    """The [padded_length, L, K] array NeMo-RL aligns (numpy, its signed dtype).
    layout: "full" (every model layer, dense 0: vLLM's) or "moe" (MoE layers only)."""
    tokens = sequence_length(routed, num_tokens, CONSUMER)
    padded_length = tokens if padded_length is None else _integer("padded_length", padded_length)
    if padded_length < tokens:
        raise ValueError(f"padded_length is {padded_length}; the sequence has {tokens} tokens")
    rows = moe_rows(routed, layout)
    dtype = _DTYPES[signed_dtype(routed.num_experts).name]
    out = np.empty((padded_length, rows.shape[1], rows.shape[2]), dtype=dtype)
    out[...] = np.arange(rows.shape[2], dtype=dtype)
    out[:rows.shape[0]] = rows
    out[:rows.shape[0]][~routed_tokens(routed)] = -1  # the whole row, dense layers too, as NeMo-RL marks a missing route
    return out


def encode(routed, num_tokens=None, padded_length=None, layout="full"):
    """The envelope string ``nrlre1:<dtype>:<S>x<L>x<K>:<base64>``."""
    a = array(routed, num_tokens, padded_length, layout)
    s, layers, top_k = a.shape
    return f"{MAGIC}:{a.dtype.name}:{s}x{layers}x{top_k}:{base64.b64encode(a.tobytes()).decode('ascii')}"


def decode(payload, num_experts, num_tokens=None, layers=None, num_hidden_layers=None):
    """A RoutedExperts from an envelope: rows [0, num_tokens - 1) (default: the
    envelope's S is T), an all -1 row a token without routing. layers: the MoE
    layers' model indices, for either layout (dense layers must read 0)."""
    parts = payload.split(":", 3) if isinstance(payload, str) else []
    if len(parts) != 4 or parts[0] != MAGIC:
        raise ValueError(f"not a NeMo-RL routed_experts envelope ('{MAGIC}:<dtype>:<SxLxK>:<base64>')")
    _, name, shape_text, data = parts
    if name not in _DTYPES:
        raise ValueError(f"envelope dtype {name!r}; NeMo-RL's are {sorted(_DTYPES)}")
    texts = shape_text.split("x")
    # ASCII digits only: int() would take " 6", "+6", "0_6" and other scripts' digits too.
    if len(texts) != 3 or not all(t.isascii() and t.isdigit() for t in texts):
        raise ValueError(f"envelope shape {shape_text!r} is not SxLxK")
    shape = dimensions([int(t) for t in texts], CONSUMER)
    a = array_from_base64(data, _DTYPES[name], shape, "envelope holds")
    tokens = shape[0] if num_tokens is None else _integer("num_tokens", num_tokens)
    if not 1 <= tokens <= shape[0]:
        raise ValueError(f"num_tokens is {tokens}; the envelope has {shape[0]} rows")
    rows = a[:tokens - 1]
    # A missing route is -1 in every MoE layer; NeMo-RL's trainer reads no other layer, so a full-layout row's dense
    # layers may hold 0 or -1 there.
    moe = rows
    if layers is not None:
        layers = layer_list(layers)
        if shape[1] != len(layers) and layers and layers[-1] < shape[1]:
            moe = rows[:, list(layers)]
    none = (moe == -1).all(axis=(1, 2))
    partial = (moe < 0).any(axis=(1, 2)) & ~none
    if partial.any():
        raise ValueError(f"row {int(np.argmax(partial))} mixes -1 with expert ids; NeMo-RL marks a missing route "
                         "with -1 in every MoE layer of the row")
    return from_layer_axis(np.where(none[:, None, None], 0, rows), num_experts, layers, num_hidden_layers,
                           CONSUMER, valid=~none)
