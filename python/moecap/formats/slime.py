# SPDX-License-Identifier: Apache-2.0
"""slime (THUDM/slime, Megatron backend): Sample.rollout_routed_experts.

slime reads SGLang's meta_info["routed_experts"]: base64 of raw int32, which
``decode_int32_meta_array`` turns into a flat int32 tensor. Sample then
asserts exactly ``(len(tokens) - 1 - routed_experts_start_len) * num_layers *
moe_router_topk`` values and reshapes them to ``[rows, num_layers, topk]``,
the layer axis being every model layer (Megatron's num_layers = the model's
num_hidden_layers; slime skips the dense ones, which read 0). Before replay
``prepare_routed_experts_for_routing_replay`` asserts T-1 rows again and
appends one pad row per sample for its last token,
``arange(L * K).reshape(1, L, K) % num_experts``: distinct, valid ids.

Rows: T-1-start for a sequence of T tokens (start is SGLang's
routed_experts_start_len: slime concatenates a continuation onto its prefix).
Tokens without routing: refused (slime has no value for them, and its
validator refuses nothing but all-zero MoE layers).
"""
import base64

import numpy as np

from .. import _integer
from ._common import b64_bytes, fitted_rows, from_layer_axis, require_routing, row_shape, sequence_length

CONSUMER = "slime"
DTYPE = np.int32


def encode(routed, num_tokens=None):
    """int32 [T-1-start, num_hidden_layers, top_k], dense layers 0: what slime
    reshapes rollout_routed_experts to."""
    require_routing(routed, CONSUMER)
    sequence_length(routed, num_tokens, CONSUMER, whole=False)
    return fitted_rows(routed, DTYPE, CONSUMER)


def meta_info(routed, num_tokens=None):
    """The meta_info fields slime reads: routed_experts as base64 of the raw
    little-endian int32 bytes, and routed_experts_start_len where the routing
    starts past position 0."""
    out = {"routed_experts": base64.b64encode(encode(routed, num_tokens).tobytes()).decode("ascii")}
    if routed.start:
        out["routed_experts_start_len"] = routed.start
    return out


def padded(routed, num_tokens=None):
    """int32 [T, num_hidden_layers, top_k]: the T-1 rows and slime's pad row for
    the last token, ``arange(L * K) % num_experts`` (what
    prepare_routed_experts_for_routing_replay appends), from position 0."""
    rows = encode(routed, num_tokens)
    sequence_length(routed, num_tokens, CONSUMER)
    _, layers, top_k = rows.shape
    pad = (np.arange(layers * top_k, dtype=DTYPE).reshape(1, layers, top_k) % routed.num_experts).astype(DTYPE)
    return np.concatenate([rows, pad])


def decode(payload, num_experts, num_hidden_layers, top_k, num_tokens, start=0, layers=None):
    """A RoutedExperts from what slime holds: the base64 string, raw bytes, or
    an int32 array of T-1-start rows (flat or shaped). layers: the MoE layers'
    model indices (dense layers must read 0)."""
    num_hidden_layers, top_k = row_shape(num_hidden_layers, top_k)
    if isinstance(payload, str):
        payload = b64_bytes(payload, "the slime payload has")
    if isinstance(payload, (bytes, bytearray, memoryview)):
        raw = bytes(payload)
        if len(raw) % 4:
            raise ValueError(f"the slime payload has {len(raw)} bytes; int32 routing takes a multiple of 4")
        flat = np.frombuffer(raw, dtype="<i4")
    else:
        flat = np.asarray(payload).reshape(-1)
    num_tokens, start = _integer("num_tokens", num_tokens), _integer("start", start)
    rows = num_tokens - 1 - start
    expected = rows * num_hidden_layers * top_k
    if rows < 0 or flat.size != expected:
        raise ValueError(f"the slime payload has {flat.size} values; a {num_tokens}-token sequence from position "
                         f"{start} takes {max(expected, 0)} ({max(rows, 0)} rows x {num_hidden_layers} layers x "
                         f"top-{top_k})")
    return from_layer_axis(flat.reshape(rows, num_hidden_layers, top_k), num_experts, layers,
                           num_hidden_layers, CONSUMER, start=start, axis="every")
