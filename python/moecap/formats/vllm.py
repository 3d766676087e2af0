# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.33: CompletionOutput.routed_experts and the OpenAI choice field.

``CompletionOutput.routed_experts`` is a NumPy array of shape
``(T - 1 - routed_experts_prompt_start, num_hidden_layers, top_k)``, dtype
uint8 when the model has at most 256 routed experts, else uint16 (the
capturer's ``output_dtype_name``, chosen from the model's expert count, not
from the ids present). The layer axis is every model layer
(``get_total_num_hidden_layers``); dense layers read 0 (vLLM's device buffer
starts zeroed and only MoE layers write it). The OpenAI endpoints put
``numpy2base64`` of that array in ``choices[i].routed_experts``: base64 of
the ``.npy`` file ``np.save(..., allow_pickle=False)`` writes, so dtype and
shape travel with it (``np.load(io.BytesIO(base64.b64decode(s)))``).

Rows: T-1-start for a sequence of T tokens (the scheduler's take_output stops
at ``request.num_tokens - 1``); start is routed_experts_prompt_start. An empty
``(0, L, K)`` array is still sent.

Tokens without routing: uint8/uint16 have no value for them (vLLM's buffer
hands out 0, or a row an earlier step left there). ``encode`` refuses them
(invalid="raise", the default) with an error naming the first;
invalid="zero" writes 0 in every layer of such a row, what vLLM would have
sent for a row never written.
"""
import base64
import io
import math

import numpy as np

from .. import _integer
from ._common import b64_bytes, from_layer_axis, full_rows, require_routing, sequence_length

CONSUMER = "vLLM"
INVALID = ("raise", "zero")


def output_dtype(num_experts):
    """vLLM's output dtype for a model with num_experts routed experts."""
    if int(num_experts) > 0x10000:
        raise ValueError(f"vLLM's routed_experts is uint16 past 256 experts; {num_experts} experts do not fit")
    return np.dtype(np.uint8 if int(num_experts) <= 256 else np.uint16)


def encode(routed, num_tokens=None, invalid="raise"):
    """The array CompletionOutput.routed_experts holds: [T-1-start,
    num_hidden_layers, top_k], uint8 up to 256 experts else uint16, dense
    layers 0. num_tokens=T, when given, is checked against the rows. invalid:
    "raise" or "zero" (see the module)."""
    if invalid not in INVALID:
        raise ValueError(f"invalid must be one of {INVALID}, not {invalid!r}")
    if invalid == "raise":
        require_routing(routed, CONSUMER, "pass invalid='zero' to send 0 for them as vLLM does")
    sequence_length(routed, num_tokens, CONSUMER, whole=False)
    dtype = output_dtype(routed.num_experts)
    # 0 in every layer of a token without routing; the ids are in [0, num_experts), which dtype holds.
    return full_rows(routed, dtype, fill=0)


def npy_b64(array):
    """vLLM's numpy2base64: base64 (ASCII) of the .npy file np.save writes."""
    with io.BytesIO() as buffer:
        np.save(buffer, np.asarray(array), allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def openai(routed, num_tokens=None, invalid="raise"):
    """choices[i].routed_experts of the OpenAI endpoints: npy_b64(encode(...))."""
    return npy_b64(encode(routed, num_tokens, invalid))


def decode(payload, num_experts, start=0, layers=None, num_hidden_layers=None, num_tokens=None):
    """A RoutedExperts from CompletionOutput.routed_experts (an array) or its
    OpenAI form (a base64 string of a .npy). start is the request's
    routed_experts_prompt_start; num_tokens=T, when given, is checked against
    the rows; layers: the MoE layers' model indices (dense layers must read 0)."""
    if isinstance(payload, (str, bytes)):
        payload = _npy_array(b64_bytes(payload, "the vLLM payload has"))
    ids = np.asarray(payload)
    expected = output_dtype(num_experts)
    if ids.dtype not in (np.uint8, np.uint16, np.int16, np.int32):
        raise ValueError(f"the vLLM payload is {ids.dtype}; vLLM sends uint8 or uint16 (older versions int16/int32)")
    if ids.dtype.kind == "u" and ids.dtype != expected:
        raise ValueError(f"the vLLM payload is {ids.dtype}; vLLM sends {expected} for {num_experts} experts")
    if ids.ndim != 3:
        raise ValueError(f"the vLLM payload has shape {ids.shape}; expected (tokens, layers, top_k)")
    start = _integer("start", start)
    if start < 0:
        raise ValueError(f"start is {start}; a position in a sequence is >= 0")
    if num_tokens is not None:
        num_tokens = _integer("num_tokens", num_tokens)
        if not 0 <= start < num_tokens:
            raise ValueError(f"start is {start}; a {num_tokens}-token sequence's positions are [0, {num_tokens})")
        if ids.shape[0] != num_tokens - 1 - start:
            raise ValueError(f"the vLLM payload has {ids.shape[0]} rows; a {num_tokens}-token sequence from position "
                             f"{start} has {num_tokens - 1 - start} (T-1-prompt_start)")
    return from_layer_axis(ids, num_experts, layers, num_hidden_layers, CONSUMER, start=start, axis="every")


def _npy_array(raw):
    """The array of a .npy file's bytes, its size checked against its header before anything is allocated
    (np.load allocates what the header names, for a payload that may hold nothing, and ignores bytes after
    the array); no pickled objects."""
    buffer = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(buffer)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(buffer)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(buffer)
        else:
            raise ValueError(f".npy version {version[0]}.{version[1]}; numpy2base64 writes 1.0")
    except ValueError as e:
        raise ValueError(f"the vLLM payload is not a .npy file: {e}") from None
    if dtype.hasobject:
        raise ValueError(f"the vLLM payload is {dtype}; objects are never read (vLLM sends uint8 or uint16)")
    data = raw[buffer.tell():]
    expected = math.prod(shape) * dtype.itemsize  # Python ints: a huge shape cannot wrap to a small size
    if len(data) != expected:
        raise ValueError(f"the vLLM payload's .npy holds {len(data)} bytes of data; its header's {dtype} "
                         f"{list(shape)} takes {expected}")
    return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C")
