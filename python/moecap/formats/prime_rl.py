# SPDX-License-Identifier: Apache-2.0
"""prime-rl (its own vLLM wrapper and trainer): routed_experts as a dict.

prime-rl's inference side sends vLLM's rows as ``{"data": base64 of the raw
bytes, "shape": [rows, L, K], "start": prompt start, "dtype": name}``
(``serialize_routed_experts``): uint8 unless the largest id present is over
255, then uint16 (it asserts ids are in [0, 65535]). vLLM's rows run from
routed_experts_prompt_start (``start``) to T-1; the layer axis is every model
layer, dense layers 0, which prime-rl's trainer models index with the global
layer number. verifiers (its rollout graph, ``_attribute_routed_experts``)
gives the turn's last node a copy of the last forwarded row for the final
position, which no forward reached, so a sequence has len(token_ids) rows (with
no row to copy it attaches none, and the sample has no routing); the
orchestrator aligns to that length (its zero padding of a shorter tail is a
backstop that then never runs) and hands ``[batch, seq, layers, top_k]`` to
the trainer, whose MoE router gathers its scores at those ids.

Rows: T-1-start (the dict carries start). Tokens without routing: refused
(prime-rl asserts ids are non-negative and has no other "none").
"""
import base64

import numpy as np

from .. import _integer
from ._common import array_from_base64, dimensions, from_layer_axis, full_rows, require_routing, sequence_length

CONSUMER = "prime-rl"
_DTYPES = {"uint8": np.dtype("u1"), "uint16": np.dtype("<u2")}


def _rows(routed, num_tokens, extra=0):
    """The payload's [T-1-start, L, K] rows in its dtype, as the first rows of an array with `extra` rows more."""
    require_routing(routed, CONSUMER)
    sequence_length(routed, num_tokens, CONSUMER, whole=False)
    # Every token is routed (ids >= 0), so the rows' largest id is the ids' own (or 0 with no rows).
    top = int(routed.ids.max()) if routed.ids.size else 0
    if top > 0xFFFF:
        raise ValueError(f"prime-rl's payload holds ids up to 65535; expert {top} does not fit")
    tokens, _, top_k = routed.shape
    dtype = _DTYPES["uint8" if top <= 0xFF else "uint16"]
    out = np.zeros((tokens + extra, routed.num_hidden_layers, top_k), dtype=dtype)
    full_rows(routed, out.dtype, out=out[:tokens])
    return out


def encode(routed, num_tokens=None):
    """``{"data", "shape", "start", "dtype"}``, keys in that order."""
    rows = _rows(routed, num_tokens)
    return {"data": base64.b64encode(rows.tobytes()).decode("ascii"), "shape": list(rows.shape),
            "start": routed.start, "dtype": rows.dtype.name}


def trainer_array(routed, num_tokens=None):
    """[T-start, L, K] of the payload's dtype, what prime-rl's trainer receives
    for a single-turn sample: the rows, and for the last token verifiers' copy
    of the last row. None where there is no row to copy (no token from start
    was forwarded): verifiers then leaves the node without routing, so the
    sample has none, and no zero row is replayed as experts 0. (Across turns
    verifiers keeps its copied row at each turn's last position over the next
    turn's real one; a joined routing here keeps the real one.)"""
    rows = _rows(routed, num_tokens, extra=1)  # the payload's rows, not encoded and decoded back
    if rows.shape[0] == 1:
        return None
    rows[-1] = rows[-2]
    return rows


def decode(payload, num_experts, layers=None, num_hidden_layers=None, num_tokens=None):
    """A RoutedExperts from the dict (its start included). layers: the MoE
    layers' model indices (dense layers must read 0). num_tokens: the
    sequence's T, when given checked against the rows (T-1-start of them)."""
    try:
        name, shape, data = payload.get("dtype", "uint8"), tuple(payload["shape"]), payload["data"]
        start = _integer("start", payload.get("start", 0))
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"not a prime-rl routed_experts dict ({{data, shape, start, dtype}}): {e}") from None
    if not isinstance(name, str) or name not in _DTYPES:
        raise ValueError(f"dtype {name!r}; prime-rl's are {sorted(_DTYPES)}")
    ids = array_from_base64(data, _DTYPES[name], dimensions(shape, CONSUMER), "data has")
    routed = from_layer_axis(ids, num_experts, layers, num_hidden_layers, CONSUMER, start=start, axis="every")
    sequence_length(routed, num_tokens, CONSUMER, whole=False)
    return routed
