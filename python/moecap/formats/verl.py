# SPDX-License-Identifier: Apache-2.0
"""verl (router replay R3, Megatron backend): the batch field routed_experts.

verl's agent loop puts a rollout's routes into ``torch.zeros(1, total_length,
L, K)`` of int16, where total_length = prompt_width + response_width (the
batch's left-padded prompt, then its right-padded response), at
``start_pos = prompt_width - len(prompt_ids)``. Everything else stays 0: the
left padding, the response padding, and the row of the sequence's last token,
which rollout never forwards: verl's replay mask leaves that row to the
native router (align_r3_router_replay_data adds the same zero placeholder row
to a per-sequence route list that is one row short). The layer axis is every
model layer (the rollout engine's layout), dense layers 0, and verl indexes
it by layer when it has num_layers entries.

Rows: T-1 for a sequence of T tokens, from position 0 (verl keeps a whole
sequence; join a continued request to its prefix first). Tokens without
routing: refused, since verl replays every row but the last and a 0 row would
be replayed as expert 0.
"""
import numpy as np

from .. import _integer
from ._common import fitted_rows, from_layer_axis, require_routing, sequence_length

CONSUMER = "verl"
DTYPE = np.int16


def _placement(routed, prompt_len, prompt_width, response_width):
    prompt_len, prompt_width = _integer("prompt_len", prompt_len), _integer("prompt_width", prompt_width)
    response_width = _integer("response_width", response_width)
    tokens = sequence_length(routed, None, CONSUMER)
    if not 0 < prompt_len <= prompt_width:
        raise ValueError(f"prompt_len is {prompt_len}; it must be in [1, prompt_width={prompt_width}]")
    response_len = tokens - prompt_len
    if not 1 <= response_len <= response_width:
        raise ValueError(f"the routing has {routed.shape[0]} rows, a sequence of {tokens} tokens: {response_len} "
                         f"response tokens after a {prompt_len}-token prompt; expected 1 to response_width="
                         f"{response_width}")
    return prompt_width - prompt_len, prompt_width + response_width


def encode(routed, prompt_len, prompt_width, response_width):
    """int16 [1, prompt_width + response_width, num_hidden_layers, top_k]: one
    sample of verl's batch field routed_experts (torch.from_numpy gives verl's
    tensor)."""
    require_routing(routed, CONSUMER)
    start_pos, total = _placement(routed, prompt_len, prompt_width, response_width)
    rows = fitted_rows(routed, DTYPE, CONSUMER)
    out = np.zeros((1, total, routed.num_hidden_layers, routed.shape[2]), dtype=DTYPE)
    out[0, start_pos:start_pos + rows.shape[0]] = rows
    return out


def aligned(routed, num_tokens=None):
    """int16 [T, num_hidden_layers, top_k]: one sequence's routes as verl's
    align_r3_router_replay_data leaves them, the T-1 rows and a zero
    placeholder row for the last token (which verl's replay mask keeps native)."""
    require_routing(routed, CONSUMER)
    tokens = sequence_length(routed, num_tokens, CONSUMER)
    out = np.zeros((tokens, routed.num_hidden_layers, routed.shape[2]), dtype=DTYPE)
    out[:tokens - 1] = fitted_rows(routed, DTYPE, CONSUMER)
    return out


def decode(batch_row, num_experts, prompt_len, num_tokens, prompt_width=None, layers=None, num_hidden_layers=None):
    """A RoutedExperts from one sample of the batch field ([1, total, L, K] or
    [total, L, K]) holding a num_tokens-token sequence whose prompt_len-token
    prompt is left-padded to prompt_width (default prompt_len: no left
    padding). layers: the MoE layers' model indices (dense layers must read 0).
    The padding and the last token's row must be 0, as verl writes them."""
    row = np.asarray(batch_row)
    if row.ndim == 4:
        if row.shape[0] != 1:
            raise ValueError(f"batch_row has {row.shape[0]} samples; pass one ([1, total, L, K])")
        row = row[0]
    if row.ndim != 3:
        raise ValueError(f"batch_row has shape {row.shape}; expected [1, total, L, K] or [total, L, K]")
    prompt_len, num_tokens = _integer("prompt_len", prompt_len), _integer("num_tokens", num_tokens)
    prompt_width = prompt_len if prompt_width is None else _integer("prompt_width", prompt_width)
    if num_tokens < 1 or not 0 <= prompt_len <= num_tokens:
        raise ValueError(f"num_tokens is {num_tokens} and prompt_len {prompt_len}; a sequence has at least 1 token "
                         "and its prompt at most all of them")
    start_pos = prompt_width - prompt_len
    if start_pos < 0 or start_pos + num_tokens > row.shape[0]:
        raise ValueError(f"a {num_tokens}-token sequence with a {prompt_len}-token prompt left-padded to "
                         f"{prompt_width} does not fit {row.shape[0]} rows")
    outside = np.ones(row.shape[0], dtype=bool)
    outside[start_pos:start_pos + num_tokens - 1] = False
    if (row[outside] != 0).any():
        raise ValueError("verl's padding and last-token rows must be 0; this row holds ids there")
    return from_layer_axis(row[start_pos:start_pos + num_tokens - 1], num_experts, layers, num_hidden_layers,
                           CONSUMER, axis="every")
