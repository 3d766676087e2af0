"""moecap's step-path calls as torch.library custom ops: a real MoE model that
captures and commits through them compiles with torch.compile(fullgraph=True)
without graph breaks and stores the same routed experts as eager."""
import numpy as np
import pytest
import torch

import moecap

ops_module = pytest.importorskip("moecap.ops", reason="moecap.ops needs torch >= 2.4")
from tiny_moe import TinyMoE  # noqa: E402

LAYERS, EXPERTS, TOP_K, TOKENS = 4, 16, 4, 12


def make(device="cpu"):
    return moecap.Capturer(num_layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS, host_slots=64,
                           max_running_requests=16, chunked_prefill_size=TOKENS, weight_dtype="f32", device=device)


def step_fn(model, ops):
    def step(tokens, positions, slots):
        out = model(tokens, positions, lambda layer, ids, weights: ops.capture(layer, ids, weights))
        ops.commit(slots)
        return out
    return step


def run_eager_and_compiled(backend):
    from torch._dynamo.utils import counters

    model = TinyMoE(layers=LAYERS, experts=EXPERTS, top_k=TOP_K)
    tokens = torch.randint(0, 97, (TOKENS,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(TOKENS)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(2))[:TOKENS]

    eager_cap, compiled_cap = make(), make()
    eager_out = step_fn(model, eager_cap.ops)(tokens, positions, slots)
    torch._dynamo.reset()
    counters.clear()
    before = ops_module.mirror_copies
    compiled = torch.compile(step_fn(model, compiled_cap.ops), fullgraph=True, backend=backend)
    compiled_out = compiled(tokens, positions, slots)
    breaks = sum(counters["graph_break"].values())
    mirrored = ops_module.mirror_copies - before

    results = []
    for cap in (eager_cap, compiled_cap):
        ids, weights = cap.read(slots, weights_out=torch.zeros(TOKENS, LAYERS, TOP_K))
        results.append((ids, weights))
    assert torch.equal(eager_out, compiled_out)
    return breaks, mirrored, results


def test_compiled_model_has_no_graph_breaks_and_captures_what_eager_does():
    breaks, mirrored, ((eager_ids, eager_w), (compiled_ids, compiled_w)) = run_eager_and_compiled("inductor")
    assert breaks == 0
    assert torch.equal(compiled_ids, eager_ids)
    assert torch.allclose(compiled_w, eager_w, rtol=1e-6, atol=1e-6)
    assert (eager_ids >= 0).all() and eager_ids.max() < EXPERTS and eager_ids.unique().numel() > TOP_K
    assert mirrored == 0  # Inductor wrote moecap's buffers in place: no functionalization copies


def test_backends_that_do_not_reinplace_keep_the_buffers_right():
    # aot_eager functionalizes the declared mutations into clones it copies back;
    # the ops mirror moecap's memory into those clones, so the copy-back is a no-op.
    breaks, mirrored, ((eager_ids, eager_w), (compiled_ids, compiled_w)) = run_eager_and_compiled("aot_eager")
    assert breaks == 0
    assert mirrored > 0
    assert torch.equal(compiled_ids, eager_ids)
    assert torch.equal(compiled_w, eager_w)


def test_invalidate_compiles_and_empties_the_slots():
    from torch._dynamo.utils import counters

    cap = make()
    ops = cap.ops

    def finish(freed):
        ops.invalidate(freed)

    ids = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    for layer in range(LAYERS):
        cap.capture(layer, ids, torch.full((1, TOP_K), 0.25))
    cap.commit(torch.tensor([5]))
    cap.commit(torch.tensor([6]))
    torch._dynamo.reset()
    counters.clear()
    torch.compile(finish, fullgraph=True)(torch.tensor([6, -1]))
    assert sum(counters["graph_break"].values()) == 0
    got = cap.read(torch.tensor([5, 6]))
    assert got[0, 0].tolist() == [1, 2, 3, 4]
    assert (got[1] == -1).all()


def test_opcheck_schema_fake_and_mutations():
    cap = make()
    ops = cap.ops
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)
    weights = torch.full((2, TOP_K), 0.25)
    torch.library.opcheck(torch.ops.moecap.capture.default,
                          (ops.device_ids, ops.device_weights, cap.id, 1, ids, weights))
    torch.library.opcheck(torch.ops.moecap.commit.default,
                          (ops.host_ids, ops.host_weights, ops.host_states, ops.device_ids, cap.id,
                           torch.tensor([3, 9]), 0, None))
    torch.library.opcheck(torch.ops.moecap.invalidate.default, (ops.host_states, cap.id, torch.tensor([3])))
    assert cap.read(np.array([9]))[0, 1].tolist() == [5, 6, 7, 8]


def test_dead_capturer_is_a_clear_error():
    cap = make()
    ops = cap.ops
    with pytest.raises(moecap.MoecapError, match="no live capturer has id"):
        torch.ops.moecap.capture(ops.device_ids, ops.device_weights, 10**9, 0,
                                 torch.zeros(1, TOP_K, dtype=torch.int32), torch.zeros(1, TOP_K))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_ops_record_into_torch_cuda_graph_on_the_current_stream():
    cap = make("cuda:0")
    ops = cap.ops
    model = TinyMoE(layers=LAYERS, experts=EXPERTS, top_k=TOP_K).cuda()
    tokens = torch.zeros(TOKENS, dtype=torch.long, device="cuda")
    positions = torch.arange(TOKENS, device="cuda")
    slots = torch.full((TOKENS,), -1, dtype=torch.int64, device="cuda")
    step = step_fn(model, ops)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # stream=None resolves to this side stream
        step(tokens, positions, slots)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(tokens, positions, slots)
    tokens.copy_(torch.arange(TOKENS, device="cuda") % 97)
    slots.copy_(torch.arange(TOKENS, device="cuda") + 1)
    graph.replay()
    cap.synchronize()
    got = cap.read(torch.arange(1, TOKENS + 1))
    want = []
    model(tokens, positions, lambda layer, ids, weights: want.append(ids.cpu()))
    assert torch.equal(got, torch.stack(want, dim=1))
