# SPDX-License-Identifier: Apache-2.0
"""SkyRL (vLLM rollout, Megatron's RouterReplay): the packed routed_experts.

SkyRL's inference server sends vLLM's T-1 rows as ``{"data": base64, "shape":
[T-1, L, K], "dtype": name}`` (``pack_routed_experts``, keys in that order;
its client parses the JSON), with the dtype made canonical
from the largest id present (``compact_routed_expert_indices``: uint8 below
256, int16 below 2**15, else int32), and its client refuses any other dtype
for the same values and any negative id. The layer axis is every model layer,
dense layers 0; SkyRL maps it to MoE routers by each router's layer number.
Its preprocessing left-pads each sequence to the batch width with the default
route ``arange(K)``.

Rows: T-1 from position 0 (the dict carries no start). Tokens without
routing: refused (SkyRL rejects negative ids and has no other "none").
"""
import base64

import numpy as np

from ._common import (array_from_base64, dimensions, from_layer_axis, full_rows, require_expert_ids, require_routing,
                      sequence_length)

CONSUMER = "SkyRL"
_DTYPES = {"uint8": np.dtype("u1"), "int16": np.dtype("<i2"), "int32": np.dtype("<i4")}


def canonical_dtype(ids):
    """SkyRL's dtype for these ids: from the largest present, not num_experts."""
    top = int(ids.max()) if ids.size else 0
    return _DTYPES["uint8" if top < 2 ** 8 else "int16" if top < 2 ** 15 else "int32"]


def encode(routed, num_tokens=None):
    """``{"data", "shape", "dtype"}``, keys in that order, shape [T-1, L, K]."""
    require_routing(routed, CONSUMER)
    sequence_length(routed, num_tokens, CONSUMER)
    # Every token is routed (ids >= 0), so the rows' largest id is the ids' own (or 0 with no rows): the rows
    # are written in that dtype at once.
    rows = full_rows(routed, canonical_dtype(routed.ids))
    return {"data": base64.b64encode(rows.tobytes()).decode("ascii"), "shape": list(rows.shape),
            "dtype": rows.dtype.name}


def decode(payload, num_experts, layers=None, num_hidden_layers=None, num_tokens=None):
    """A RoutedExperts from the dict, checked as SkyRL's client checks it
    (dtype name, canonical dtype, byte count). layers: the MoE layers' model
    indices (dense layers must read 0). num_tokens: the sequence's T, when
    given checked against the rows (T-1 of them)."""
    try:
        name, shape, data = payload["dtype"], tuple(payload["shape"]), payload["data"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a SkyRL routed_experts dict ({{data, shape, dtype}}): {e}") from None
    if not isinstance(name, str) or name not in _DTYPES:
        raise ValueError(f"dtype {name!r}; SkyRL's are {sorted(_DTYPES)}")
    ids = array_from_base64(data, _DTYPES[name], dimensions(shape, CONSUMER), "data has")
    require_expert_ids(ids, num_experts, CONSUMER)  # before the dtype's check, which reads the largest id
    if canonical_dtype(ids) != _DTYPES[name]:
        raise ValueError(f"dtype {name} is not canonical for these ids; SkyRL expects {canonical_dtype(ids).name}")
    routed = from_layer_axis(ids, num_experts, layers, num_hidden_layers, CONSUMER, axis="every")
    sequence_length(routed, num_tokens, CONSUMER, whole=False)
    return routed
