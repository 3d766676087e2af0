# SPDX-License-Identifier: Apache-2.0
"""A tiny MoE language model: real routers (softmax, top-k) and experts, no
attention, so a token's routing depends on its token and position only."""
import torch
from torch import nn


class TinyMoE(nn.Module):
    def __init__(self, layers=4, hidden=32, experts=16, top_k=4, vocab=97, max_positions=256, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.top_k = top_k
        self.embed = nn.Parameter(torch.randn(vocab, hidden, generator=gen))
        self.position = nn.Parameter(torch.randn(max_positions, hidden, generator=gen) * 0.1)
        self.routers = nn.ParameterList(
            [nn.Parameter(torch.randn(hidden, experts, generator=gen)) for _ in range(layers)])
        self.experts = nn.ParameterList(
            [nn.Parameter(torch.randn(experts, hidden, hidden, generator=gen) / hidden ** 0.5)
             for _ in range(layers)])
        self.head = nn.Parameter(torch.randn(hidden, vocab, generator=gen))

    @torch.no_grad()
    def forward(self, tokens, positions, on_route):
        """tokens, positions: [n]. on_route(layer, topk_ids int32 [n, k], topk_weights f32 [n, k])."""
        h = self.embed[tokens] + self.position[positions]
        for layer, (router, experts) in enumerate(zip(self.routers, self.experts)):
            probs = torch.softmax(h @ router, dim=-1)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            ids = ids.to(torch.int32)
            on_route(layer, ids, weights)
            picked = experts[ids.long()]                      # [n, k, hidden, hidden]
            out = torch.einsum("nh,nkhd->nkd", h, picked)     # each expert's output
            h = h + torch.tanh((weights.unsqueeze(-1) * out).sum(dim=1))
        return (h @ self.head).argmax(dim=-1)
