# SPDX-License-Identifier: Apache-2.0
"""A real PyTorch MoE model served for several requests (prefill, then
batched decode); moecap captures its real top-k ids and weights in every
layer, and what it returns per request equals what PyTorch computed. On CPU
in CI; on CUDA under torch.cuda.graph where a GPU exists."""
import numpy as np
import pytest
import torch

import moecap
from tiny_moe import TinyMoE

LAYERS, EXPERTS, TOP_K = 4, 16, 4
REQUESTS, DECODE_STEPS, GRAPH_BATCH = 5, 6, 8
PROMPTS = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43], [38], [32, 79, 50, 28]]


class Truth:
    """What PyTorch computed, per request, in token order."""

    def __init__(self):
        self.ids = [[] for _ in range(REQUESTS)]
        self.weights = [[] for _ in range(REQUESTS)]

    def add(self, owners, ids, weights):
        # ids/weights: [layers, n, k] for one forward; owners: request of each row (-1 = padding).
        for row, r in enumerate(owners):
            if r >= 0:
                self.ids[r].append(ids[:, row].cpu().numpy().copy())
                self.weights[r].append(weights[:, row].cpu().float().numpy().copy())


def check(cap, slots_of, truth, weight_dtype):
    tol = {"f32": 0.0, "bf16": 1 / 128, "f16": 1 / 1024}[weight_dtype]
    for r in range(REQUESTS):
        slots = np.array(slots_of[r], dtype=np.int64)
        ids, weights = cap.read(slots, dtype=np.int32,
                                weights_out=np.zeros((len(slots), LAYERS, TOP_K), dtype=np.float32))
        want_ids = np.stack(truth.ids[r])
        want_w = np.stack(truth.weights[r])
        assert ids.shape == want_ids.shape
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(weights, want_w, rtol=tol, atol=tol)


def serve(device, weight_dtype, use_graph):
    torch.manual_seed(0)
    model = TinyMoE(layers=LAYERS, experts=EXPERTS, top_k=TOP_K).to(device)
    cap = moecap.Capturer(num_layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS, host_slots=128,
                          max_running_requests=GRAPH_BATCH, chunked_prefill_size=32, max_graph_batch=GRAPH_BATCH,
                          weight_dtype=weight_dtype, device="cuda:0" if device == "cuda" else "cpu")
    stream = torch.cuda.current_stream() if device == "cuda" else None
    truth = Truth()
    next_slot = 1  # slot 0 is the engine's padding slot
    slots_of = [[] for _ in range(REQUESTS)]
    last_token = [0] * REQUESTS
    records = torch.zeros(LAYERS, 32, TOP_K, dtype=torch.int32, device=device)
    record_w = torch.zeros(LAYERS, 32, TOP_K, dtype=torch.float32, device=device)

    def on_route(layer, ids, weights):
        cap.capture(layer, ids, weights, stream=stream)
        records[layer, : ids.shape[0]].copy_(ids)
        record_w[layer, : ids.shape[0]].copy_(weights)

    # Prefill: all prompts packed in one eager batch.
    tokens, positions, owners = [], [], []
    for r, prompt in enumerate(PROMPTS):
        for pos, t in enumerate(prompt):
            tokens.append(t), positions.append(pos), owners.append(r)
            slots_of[r].append(next_slot)
            next_slot += 1
    n = len(tokens)
    out = model(torch.tensor(tokens, device=device), torch.tensor(positions, device=device), on_route)
    cap.commit(torch.tensor([s for r in range(REQUESTS) for s in slots_of[r]], device=device), stream=stream)
    truth.add(owners, records[:, :n], record_w[:, :n])
    ends = np.cumsum([len(p) for p in PROMPTS]) - 1
    for r in range(REQUESTS):
        last_token[r] = int(out[ends[r]])

    # Decode: one token per live request, padded to the graph batch.
    static_tokens = torch.zeros(GRAPH_BATCH, dtype=torch.long, device=device)
    static_positions = torch.zeros(GRAPH_BATCH, dtype=torch.long, device=device)
    static_slots = torch.full((GRAPH_BATCH,), -1, dtype=torch.int64, device=device)
    static_out = torch.zeros(GRAPH_BATCH, dtype=torch.long, device=device)

    def step():
        static_out.copy_(model(static_tokens, static_positions, on_route))
        cap.commit(static_slots, stream=torch.cuda.current_stream() if device == "cuda" else None)

    graph = None
    if use_graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            stream = side
            step()  # warm-up outside the graph, as torch.cuda.graph requires
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            stream = torch.cuda.current_stream()
            step()
        stream = torch.cuda.current_stream()
        cap.synchronize()
        cap.errors(clear=True)

    for s in range(DECODE_STEPS):
        live = [r for r in range(REQUESTS) if s < DECODE_STEPS - r]  # requests finish at different steps
        tok = [0] * GRAPH_BATCH
        pos = [0] * GRAPH_BATCH
        slot = [-1] * GRAPH_BATCH
        owners = [-1] * GRAPH_BATCH
        for i, r in enumerate(live):
            tok[i], pos[i], owners[i] = last_token[r], len(PROMPTS[r]) + s, r
            slot[i] = next_slot
            slots_of[r].append(next_slot)
            next_slot += 1
        static_tokens.copy_(torch.tensor(tok))
        static_positions.copy_(torch.tensor(pos))
        static_slots.copy_(torch.tensor(slot))
        if graph is not None:
            graph.replay()
        else:
            step()
        truth.add(owners, records[:, :GRAPH_BATCH], record_w[:, :GRAPH_BATCH])
        for i, r in enumerate(live):
            last_token[r] = int(static_out[i])
    cap.synchronize()
    assert cap.errors()["skipped_rows"] == 0
    check(cap, slots_of, truth, weight_dtype)
    if device == "cuda":  # the same rows gathered straight into GPU tensors
        for r in range(REQUESTS):
            slots = torch.tensor(slots_of[r], dtype=torch.int64)
            on_gpu = cap.read(slots, out=torch.empty(len(slots_of[r]), LAYERS, TOP_K, dtype=torch.int64, device="cuda"),
                              stream=torch.cuda.current_stream())
            assert torch.equal(on_gpu.cpu(), torch.from_numpy(np.stack(truth.ids[r])).long())
    cap.close()


@pytest.mark.parametrize("weight_dtype", ["f32", "bf16"])
def test_tiny_moe_on_cpu(weight_dtype):
    serve("cpu", weight_dtype, use_graph=False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("weight_dtype", ["f32", "bf16"])
def test_tiny_moe_under_cuda_graph(weight_dtype):
    serve("cuda", weight_dtype, use_graph=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_tiny_moe_cuda_eager():
    serve("cuda", "f16", use_graph=False)
