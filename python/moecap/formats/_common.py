# SPDX-License-Identifier: Apache-2.0
"""What the trainer formats share: the T-1 row check, the refusal of tokens
without routing where a format has no value for them, and the way back from
an all-layer array to a RoutedExperts."""
import base64
import binascii
import math

import numpy as np

from .. import _integer
from ..record import MAX_LAYERS, RoutedExperts, layer_list, layer_runs


def sequence_length(routed, num_tokens, consumer, whole=True):
    """T, the sequence's token count, from the routing's rows: moecap reads the
    tokens that went through a forward, positions [start, T - 1) (the last
    sampled token never does). num_tokens, when given, must agree. whole: the
    consumer takes a sequence's routing from position 0 only."""
    rows = routed.shape[0]
    if whole and routed.start != 0:
        raise ValueError(f"{consumer} takes a sequence's routing from position 0; this routing starts at position "
                         f"{routed.start} (join it after the routing of positions [0, {routed.start}) first: "
                         "RoutedExperts.concat)")
    implied = routed.start + rows + 1
    if num_tokens is not None and _integer("num_tokens", num_tokens) != implied:
        raise ValueError(f"num_tokens is {num_tokens}; the routing has {rows} rows from position {routed.start}, "
                         f"which is a sequence of {implied} tokens ({consumer} takes T-1 rows: the last token is "
                         "never forwarded)")
    return implied


def routed_tokens(routed):
    """bool [tokens]: tokens with an expert id in every MoE layer. A valid slot
    can still hold -1 in some layer (a layer not captured in the row's step, an
    id out of range at capture: VALID | INVALID_IDS); no format has a value for
    one missing expert inside a routed token, so such a token has no routing."""
    ids = routed.ids
    if ids.size == 0 or ids.min() >= 0:  # nearly every routing: no bool temporary of the ids' size to reduce
        return routed.valid.copy()
    return routed.valid & ~(ids < 0).any(axis=(1, 2))


def require_routing(routed, consumer, instead=""):
    """Refuses tokens without routing for a format that has no value meaning
    'none' (any value it could carry would be replayed as real experts)."""
    missing = np.flatnonzero(~routed_tokens(routed))
    if missing.size:
        raise ValueError(f"{consumer} has no value for 'no routing', and {missing.size} token(s) have none (the first "
                         f"at position {routed.start + int(missing[0])}); {instead or 'nothing was encoded'}")


def moe_rows(routed, layout):
    """[tokens, layers, top_k] ids in the routing's signed dtype: every model
    layer with dense ones 0 ("full", what engines send), or the MoE layers only
    ("moe"); -1 throughout a token without routing (routed_tokens)."""
    missing = np.flatnonzero(~routed_tokens(routed))
    if layout == "full":
        return full_rows(routed, routed.ids.dtype, missing=missing)
    if layout == "moe":
        rows = routed.ids.copy()
        rows[missing] = -1
        return rows
    raise ValueError(f"layout must be 'full' or 'moe', not {layout!r}")


def full_rows(routed, dtype, fill=-1, missing=None, out=None):
    """moe_rows(routed, "full") written straight into an array of `dtype`
    (values cast as astype casts them), with `fill` in the MoE layers of the
    tokens without routing (`missing`: their indices, default from
    routed_tokens): one pass, where building the rows in the ids' dtype and
    casting them after would copy everything twice. out: a zeroed array of
    that shape to write into instead."""
    if missing is None:
        missing = np.flatnonzero(~routed_tokens(routed))
    if out is None:
        out = np.zeros((routed.shape[0], routed.num_hidden_layers, routed.shape[2]), dtype=dtype)
    return routed._place(out, missing, fill)


def fitted_rows(routed, dtype, consumer):
    """fits(moe_rows(routed, "full"), dtype, consumer), in one pass where every
    id (and the -1 of a token without routing) fits dtype, so fits has nothing
    to refuse."""
    target = np.dtype(dtype).newbyteorder("<")  # the dtype fits casts to
    if np.can_cast(routed.ids.dtype, target):
        return full_rows(routed, target)
    return fits(moe_rows(routed, "full"), dtype, consumer)


def fits(ids, dtype, consumer):
    info = np.iinfo(dtype)
    if ids.size and (int(ids.max()) > info.max or int(ids.min()) < info.min):
        raise ValueError(f"{consumer}'s {np.dtype(dtype).name} cannot hold expert {int(ids.max())}")
    return ids.astype(np.dtype(dtype).newbyteorder("<"))


def row_shape(num_hidden_layers, top_k):
    """A flat payload's row, [num_hidden_layers, top_k], as the caller names it: both ints >= 1."""
    layers, k = _integer("num_hidden_layers", num_hidden_layers), _integer("top_k", top_k)
    if layers < 1 or k < 1:
        raise ValueError(f"num_hidden_layers is {layers} and top_k {k}; a payload's rows need both >= 1")
    return layers, k


def dimensions(shape, consumer):
    """A payload's [S, L, K] shape as three ints, S >= 0 and L, K >= 1 (a bool
    or a float is not one, as the consumers' JSON readers would refuse it; a
    row of no layers or no ids holds no routing, and would let a tiny payload
    name billions of rows)."""
    dims = tuple(shape)
    try:
        ints = tuple(_integer("a dimension", d) for d in dims)
    except TypeError:
        ints = ()
    if len(ints) != 3 or ints[0] < 0 or min(ints[1:]) < 1:
        raise ValueError(f"the {consumer} payload's shape {list(dims)} is not [S, L, K] with S >= 0 and L, K >= 1")
    return ints


def array_from_base64(data, dtype, shape, holds):
    """The [S, L, K] array a payload's base64 field holds, its size checked
    against the shape it names; `holds` begins the error ("data has")."""
    dtype = np.dtype(dtype)
    if not isinstance(data, (str, bytes)):
        raise ValueError(f"{holds} a {type(data).__name__}; expected base64 text")
    raw = b64_bytes(data, holds)
    expected = math.prod(shape) * dtype.itemsize  # Python ints: a huge shape cannot wrap to a small size
    if len(raw) != expected:
        raise ValueError(f"{holds} {len(raw)} bytes; {dtype.name} {list(shape)} takes {expected}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def b64_bytes(data, holds):
    """The bytes of base64 text (str or bytes), strictly: ValueError beginning
    with `holds` ("data has") for anything else, non-ASCII text included."""
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:  # non-ASCII str: ValueError; not text: TypeError
        raise ValueError(f"{holds} no valid base64 ({e})") from None


def require_expert_ids(ids, num_experts, consumer):
    """Integer ids in [0, num_experts), checked before any cast (a float would
    truncate to an expert; a uint64 past int64 would wrap to -1). The payloads
    have no value for 'no routing' in a row (NeMo-RL's all -1 rows are taken
    out before), so a negative id is refused, not read as one."""
    if ids.dtype.kind not in "iu":
        raise ValueError(f"the {consumer} payload is {ids.dtype}; expert ids are integers")
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0:
        raise ValueError(f"the {consumer} payload holds id {low}; {consumer} has no value for 'no routing', "
                         "and expert ids are >= 0")
    if high >= int(num_experts):
        raise ValueError(f"the {consumer} payload holds id {high}; expected ids in [0, num_experts = {num_experts})")


def from_layer_axis(ids, num_experts, layers, num_hidden_layers, consumer, start=0, valid=None, axis="either"):
    """A RoutedExperts from a payload's [tokens, L, top_k] ids, whose layer axis
    is every model layer (dense ones must read 0) or the MoE layers only.
    layers: the MoE layers' model indices (default: every layer of the payload
    is MoE). axis: what the format's layer axis can be: "every" (the engines'
    payloads: a payload short of num_hidden_layers is refused, not read as
    MoE layers only), "moe" (Megatron's tensors: one per MoE layer) or
    "either" (NeMo-RL's two layouts)."""
    ids = np.asarray(ids)
    if ids.ndim != 3:
        raise ValueError(f"{consumer} payload has shape {ids.shape}; expected [tokens, layers, top_k]")
    if 0 in ids.shape[1:]:
        raise ValueError(f"{consumer} payload has shape {ids.shape}; layers and top_k must be >= 1")
    require_expert_ids(ids, num_experts, consumer)  # dense layers' 0 included
    width = ids.shape[1]
    if width > MAX_LAYERS:  # before a layer list that long is built for a payload that may hold no routing
        raise ValueError(f"the {consumer} payload has {width} layers; a RoutedExperts holds at most {MAX_LAYERS}")
    if layers is None:
        layers = range(width)
    layers = list(layer_list(layers))
    if not layers:
        raise ValueError(f"layers is empty; a {consumer} payload's routing names at least one MoE layer")
    if num_hidden_layers is None:
        num_hidden_layers = width if width != len(layers) or axis == "every" else layers[-1] + 1
    if axis == "moe" and width != len(layers):
        raise ValueError(f"the {consumer} payload has {width} layers; layers names {len(layers)} (one per MoE layer)")
    if axis == "every" and width != num_hidden_layers:
        raise ValueError(f"the {consumer} payload has {width} layers; {consumer} sends every model layer "
                         f"(num_hidden_layers = {num_hidden_layers})")
    if width == len(layers) and width != num_hidden_layers:
        moe = ids  # the MoE layers only
    elif width == num_hidden_layers:
        if layers[-1] >= width:
            raise ValueError(f"layers names model layer {layers[-1]}; the {consumer} payload has {width} layers")
        moe = _moe_layers(ids, layers, valid, consumer)
    else:
        raise ValueError(f"the {consumer} payload has {width} layers; expected {len(layers)} (MoE layers only) or "
                         f"{num_hidden_layers} (every model layer)")
    if valid is not None:
        moe = np.where(np.asarray(valid)[:, None, None], moe.astype(np.int64), -1)
    # Otherwise the ids as the payload holds them (checked in [0, num_experts)): the constructor's one cast to
    # its signed dtype is the only copy of a MoE-only payload.
    return RoutedExperts(moe, num_experts, valid=valid, start=start, layers=layers,
                         num_hidden_layers=num_hidden_layers)


def _moe_layers(ids, layers, valid, consumer):
    """ids[:, layers] of an every-layer payload (ids >= 0; layers strictly increasing, in [0, width)), its dense
    layers checked to read 0 in the rows `valid` (default all). A slice per contiguous run of layers (layer_runs):
    no list index on the middle axis, no copy of the payload to check its dense layers; one run is a view."""
    runs = layer_runs(tuple(layers))
    dense_from = 0
    for model, _ in runs + ((slice(ids.shape[1], None), None),):  # the dense layers: between the runs, and after
        if model.start > dense_from:
            part = ids[:, dense_from:model.start] if valid is None else ids[np.asarray(valid), dense_from:model.start]
            if part.any():  # ids >= 0: any nonzero is an expert id
                bad = dense_from + int(np.flatnonzero(part.any(axis=(0, 2)))[0])
                raise ValueError(f"{consumer} payload: layer {bad} is dense (not in layers) but holds expert ids")
        dense_from = model.stop
    if len(runs) == 1:
        return ids[:, runs[0][0]]
    return np.concatenate([ids[:, model] for model, _ in runs], axis=1)
