# SPDX-License-Identifier: Apache-2.0
"""Reading a running request's routing from a position onward.

A streaming response (SGLang's routed_experts_start_len turn by turn, an
OpenAI stream's chunks) sends each token's routing once. ``RoutingStream``
keeps the position sent so far and reads only the positions after it: each
``next(forwarded)`` reads positions [sent, forwarded) (the tokens that went
through a forward since the last call), so nothing already sent is read or
copied again. A chunk is a RoutedExperts whose ``start`` is its first
position: ``chunk.to_sglang()`` is what SGLang sends for a request with
``routed_experts_start_len = chunk.start`` (once the sequence has
``chunk.start + len(chunk) + 1`` tokens), ``chunk.to_vllm()`` vLLM's rows
from ``routed_experts_prompt_start = chunk.start``, and
``RoutedExperts.concat`` of the chunks is the whole routing.
"""
from .. import _integer


class RoutingStream:
    """read_rows(begin, end) -> RoutedExperts of positions [begin, end) (an
    adapter's read of those tokens' KV slots); start: the first position to send."""

    def __init__(self, read_rows, start=0):
        start = _integer("start", start)  # a position: 2.7 is no token, True no count
        if start < 0:
            raise ValueError(f"start is {start}; positions start at 0")
        self._read_rows = read_rows
        self.start = start
        self.sent = start

    def next(self, forwarded):
        """The routing of positions [sent, forwarded), then sent = forwarded.
        forwarded: how many of the request's tokens went through a forward
        (T - 1 for a sequence of T tokens: the last sampled one has not).
        Before the forwarded tokens reach start the chunk is empty, as SGLang
        clamps a routed_experts_start_len past the sequence and sends none."""
        forwarded = _integer("forwarded", forwarded)
        if forwarded < 0:
            raise ValueError(f"forwarded is {forwarded}; it counts tokens, >= 0")
        if forwarded < self.sent:
            if self.sent == self.start:
                forwarded = self.start  # nothing sent yet: the stream starts past the forwarded tokens
            else:
                raise ValueError(f"forwarded is {forwarded}; positions up to {self.sent} were already sent")
        chunk = self._read_rows(self.sent, forwarded)
        if len(chunk) != forwarded - self.sent:
            raise ValueError(f"read_rows({self.sent}, {forwarded}) returned {len(chunk)} tokens")
        if getattr(chunk, "start", self.sent) != self.sent:  # a chunk placed elsewhere would concat and encode there
            raise ValueError(f"read_rows({self.sent}, {forwarded}) returned a chunk starting at position "
                             f"{chunk.start}; its first position is {self.sent}")
        self.sent = forwarded
        return chunk
