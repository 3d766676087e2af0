# SPDX-License-Identifier: Apache-2.0
"""SGLang 0.5.23: meta_info["routed_experts"] and the OpenAI sglext field.

What a client receives when it asks for ``return_routed_experts``: the
detokenizer's ``pybase64.b64encode(tensor.numpy().tobytes()).decode()`` of
``RoutedExpertsCapturer.get_topk``'s int32 tensor, i.e. base64 of the raw
little-endian int32 bytes, C order, no header, of logical shape
``[seqlen - 1 - start_len, num_hidden_layers, top_k]``. The layer axis is
every model layer; dense layers read 0 (SGLang's host cache starts zeroed and
only MoE layers write it); fused shared-expert columns are not in it. The
OpenAI endpoints put the same string at response level in
``sglext.routed_experts`` (left out when the string is empty). The consumer
reshapes it with its own layer count and top-k (slime, verl): nothing in the
payload says its shape.

Rows: T-1-start for a sequence of T tokens (the last sampled token never goes
through a forward); start is the request's routed_experts_start_len, which
SGLang clamps to T-1, so a request can receive "" (zero rows).

Tokens without routing: SGLang has no value for them (its host cache hands
out 0, or whatever an earlier owner of the KV slot left there). ``encode``
refuses them (invalid="raise", the default) with an error naming the first;
invalid="zero" writes 0 in every layer of such a row, what SGLang itself
would have sent for a slot never written.
"""
import base64

import numpy as np

from .. import _integer
from ._common import (b64_bytes, fitted_rows, from_layer_axis, full_rows, require_routing, row_shape,
                      sequence_length)

CONSUMER = "SGLang"
DTYPE = np.dtype("<i4")
INVALID = ("raise", "zero")


def _check_invalid(invalid):
    if invalid not in INVALID:
        raise ValueError(f"invalid must be one of {INVALID}, not {invalid!r}")


def encode(routed, num_tokens=None, invalid="raise"):
    """int32 [T-1-start, num_hidden_layers, top_k], dense layers 0: the tensor
    get_topk returns (and the detokenizer encodes). num_tokens=T, when given,
    is checked against the rows. invalid: "raise" or "zero" (see the module)."""
    _check_invalid(invalid)
    if invalid == "raise":
        require_routing(routed, CONSUMER, "pass invalid='zero' to send 0 for them as SGLang does")
    sequence_length(routed, num_tokens, CONSUMER, whole=False)
    if invalid == "zero":  # int32 holds every id of a RoutedExperts, and 0
        return full_rows(routed, DTYPE.newbyteorder("<"), fill=0)  # the dtype fits casts to
    return fitted_rows(routed, DTYPE, CONSUMER)


def b64(array):
    """The detokenizer's encoding of a get_topk tensor (torch or NumPy): base64
    of its raw little-endian int32 bytes."""
    if hasattr(array, "detach"):
        array = array.detach().cpu().numpy()
    array = np.asarray(array)
    if array.dtype != np.int32:
        raise ValueError(f"SGLang sends int32 routing; this array is {array.dtype}")
    return base64.b64encode(np.ascontiguousarray(array, dtype=DTYPE).tobytes()).decode("ascii")


def meta_info(routed, num_tokens=None, invalid="raise"):
    """meta_info["routed_experts"] of /generate: the base64 string (possibly "")."""
    return {"routed_experts": b64(encode(routed, num_tokens, invalid))}


def sglext(routed, num_tokens=None, invalid="raise", other_fields=False):
    """The OpenAI endpoints' response-level ``sglext`` dict: routed_experts, or
    nothing when the string is empty, where SGLang then leaves the field out;
    other_fields: the response's sglext carries another field (cached-token or
    speculative details, input or output ids), so SGLang builds it and sends
    the empty string."""
    s = b64(encode(routed, num_tokens, invalid))
    return {"routed_experts": s} if s or other_fields else {}


def decode(payload, num_experts, num_hidden_layers, top_k, start=0, layers=None, num_tokens=None):
    """A RoutedExperts from meta_info["routed_experts"] (the base64 string, its
    raw bytes, or the int32 array / tensor itself). num_hidden_layers and top_k
    reshape it, as every SGLang client must; start is the request's
    routed_experts_start_len; num_tokens=T, when given, clamps start to T-1 as
    SGLang does and is checked against the rows; layers: the MoE layers' model indices (dense layers must read 0)."""
    num_hidden_layers, top_k = row_shape(num_hidden_layers, top_k)
    if hasattr(payload, "detach"):
        payload = payload.detach().cpu().numpy()
    if isinstance(payload, str):
        payload = b64_bytes(payload, "the SGLang payload has")
    if isinstance(payload, (bytes, bytearray, memoryview)):
        raw = bytes(payload)
        if len(raw) % DTYPE.itemsize:
            raise ValueError(f"the SGLang payload has {len(raw)} bytes; int32 routing takes a multiple of 4")
        flat = np.frombuffer(raw, dtype=DTYPE)
    else:
        flat = np.asarray(payload)
        if flat.dtype.kind not in "iu":
            raise ValueError(f"the SGLang payload is {flat.dtype}; expected int32 ids")
        flat = flat.reshape(-1)
    per_row = num_hidden_layers * top_k
    if flat.size % per_row:
        raise ValueError(f"the SGLang payload has {flat.size} values, not a whole number of rows of "
                         f"{num_hidden_layers} layers x top-{top_k}")
    rows = flat.size // per_row
    start = _integer("start", start)
    if num_tokens is not None:
        num_tokens = _integer("num_tokens", num_tokens)
        if num_tokens < 1:
            raise ValueError(f"num_tokens is {num_tokens}; a sequence has at least 1 token")
        start = min(start, num_tokens - 1)  # SGLang's clamp of routed_experts_start_len
        if rows != num_tokens - 1 - start:
            raise ValueError(f"the SGLang payload has {rows} rows; a {num_tokens}-token sequence from position "
                             f"{start} has {num_tokens - 1 - start} (T-1-start_len)")
    return from_layer_axis(flat.reshape(rows, num_hidden_layers, top_k), num_experts, layers,
                           num_hidden_layers, CONSUMER, start=start, axis="every")
