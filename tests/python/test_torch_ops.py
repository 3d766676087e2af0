# SPDX-License-Identifier: Apache-2.0
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


def make(device="cpu", device_id_dtype="auto"):
    return moecap.Capturer(num_layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS, host_slots=64,
                           max_running_requests=16, chunked_prefill_size=TOKENS, weight_dtype="f32", device=device,
                           device_id_dtype=device_id_dtype)


def step_fn(model, ops):
    def step(tokens, positions, slots):
        out = model(tokens, positions, lambda layer, ids, weights: ops.capture(layer, ids, weights))
        ops.commit(slots)
        return out
    return step


def run_eager_and_compiled(backend, device_id_dtype="auto"):
    from torch._dynamo.utils import counters

    model = TinyMoE(layers=LAYERS, experts=EXPERTS, top_k=TOP_K)
    tokens = torch.randint(0, 97, (TOKENS,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(TOKENS)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(2))[:TOKENS]

    eager_cap, compiled_cap = make(device_id_dtype=device_id_dtype), make(device_id_dtype=device_id_dtype)
    eager_out = step_fn(model, eager_cap.ops)(tokens, positions, slots)
    torch._dynamo.reset()
    counters.clear()
    before = ops_module.buffer_copies
    compiled = torch.compile(step_fn(model, compiled_cap.ops), fullgraph=True, backend=backend)
    compiled_out = compiled(tokens, positions, slots)
    breaks = sum(counters["graph_break"].values())
    mirrored = ops_module.buffer_copies - before

    results = []
    for cap in (eager_cap, compiled_cap):
        ids, weights = cap.read(slots, weights_out=torch.zeros(TOKENS, LAYERS, TOP_K))
        results.append((ids, weights))
    assert torch.equal(eager_out, compiled_out)
    return breaks, mirrored, results


@pytest.mark.parametrize("device_id_dtype", ["auto", "u8"])  # int16 (the views' dtype), or u8 as SGLang's adapter
def test_compiled_model_has_no_graph_breaks_and_captures_what_eager_does(device_id_dtype):
    breaks, mirrored, ((eager_ids, eager_w), (compiled_ids, compiled_w)) = run_eager_and_compiled(
        "inductor", device_id_dtype)
    assert breaks == 0
    assert torch.equal(compiled_ids, eager_ids)
    assert torch.allclose(compiled_w, eager_w, rtol=1e-6, atol=1e-6)
    assert (eager_ids >= 0).all() and eager_ids.max() < EXPERTS and eager_ids.unique().numel() > TOP_K
    assert mirrored == 0  # Inductor wrote moecap's buffers in place: no functionalization copies


@pytest.mark.parametrize("layers_written", [1, 2])
def test_layer_view_writes_in_compiled_code_reach_the_commit(layers_written):
    # A model writes top-k ids into layer views with plain torch ops (no
    # capture call): the commit in the same compiled step must store them,
    # step after step.
    cap = make()
    ops = cap.ops

    def step(ids, slots):
        ops.layer_ids(0)[:ids.shape[0]].copy_(ids)
        if layers_written == 2:
            ops.device_ids[1][:ids.shape[0]].copy_(ids + 2)
        ops.commit(slots)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    before = ops_module.buffer_copies
    for k in range(2):
        ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int16) + k
        compiled(ids, torch.tensor([2 * k, 2 * k + 1]))
        got = cap.read(torch.tensor([2 * k, 2 * k + 1]))
        assert torch.equal(got[:, 0], ids.int()), k
        if layers_written == 2:
            assert torch.equal(got[:, 1], ids.int() + 2), k
    # Commit consumes the rows it read (a declared mutation of device_ids), so
    # Inductor hands it the graph's own copy of the buffer: values are right,
    # at one copy in and out per step. The capture op path stays copy-free.
    assert ops_module.buffer_copies >= before


def test_commit_reads_the_device_ids_it_is_handed():
    # What a functionalizing backend hands commit: the graph's value of the
    # device buffer, a tensor of its own. commit stores that value, not stale memory.
    cap = make()
    ops = cap.ops
    ops.layer_ids(2)[1] = torch.tensor([1, 2, 3, 4])  # moecap's memory, which the backend's copy does not hold
    handed = ops.device_ids.clone()
    handed[2, 0] = torch.tensor([9, 10, 11, 12], dtype=handed.dtype)
    handed[2, 1] = torch.tensor([5, 6, 7, 8], dtype=handed.dtype)
    weights = ops.device_weights.clone()
    weights[2, 0] = 0.5
    before = ops_module.buffer_copies
    torch.ops.moecap.commit(ops.host_ids, ops.host_weights, ops.host_states, handed, weights, cap.id,
                            torch.tensor([7]), 0, None)
    ids, w = cap.read(torch.tensor([7]), weights_out=torch.zeros(1, LAYERS, TOP_K))
    assert ids[0, 2].tolist() == [9, 10, 11, 12]
    assert w[0, 2].tolist() == [0.5] * TOP_K
    # Two copies in (ids, weights) and two out: commit consumed the rows, and the
    # copy the backend writes back must say so.
    assert ops_module.buffer_copies == before + 4
    assert (handed[2, 0] == -1).all() and (weights[2, 0] == 0).all()
    # The backend writes that copy back itself; until then moecap's memory holds what it held.
    assert (ops.device_ids[2, 0] == -1).all() and ops.device_ids[2, 1].tolist() == [1, 2, 3, 4]


def test_a_snapshot_before_the_commit_keeps_the_rows_the_captures_wrote():
    # In one compiled step the captures write device_ids, a snapshot reads it and the commit consumes it:
    # the snapshot holds the captured rows (Inductor folds a plain clone() into the buffer itself, which then
    # shows the consumed rows, and hands the commit a copy of a buffer the graph still reads).
    cap = moecap.Capturer(num_layers=2, top_k=4, num_experts=16, host_slots=64, max_running_requests=8,
                          chunked_prefill_size=8, histogram=True)
    ops = cap.ops
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)

    def step(ids, slots):
        ops.capture(0, ids)
        load = ops.snapshot(ops.histogram)
        ops.capture(1, ids + 1)
        rows = ops.snapshot(ops.device_ids)
        layer = ops.snapshot(ops.layer_ids(1))
        ops.commit(slots)
        return rows[:, :2], load, layer[:2]

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    for k, slots in enumerate(([3, 4], [5, 6])):
        cap.histogram_reset()
        rows, load, layer = compiled(ids + k, torch.tensor(slots))
        assert rows[0].tolist() == (ids + k).tolist() and rows[1].tolist() == (ids + k + 1).tolist(), k  # [layer, row]
        assert layer.tolist() == (ids + k + 1).tolist(), k
        assert load[0].tolist() == np.bincount((ids + k).flatten().numpy(), minlength=16).tolist(), k
        assert load[1].tolist() == [0] * 16, k
        assert torch.equal(cap.read(torch.tensor(slots))[:, 1], (ids + k + 1).int()), k  # and the commit stored them
    assert torch.equal(ops.snapshot(ops.device_ids), ops.device_ids)  # eager: a copy
    assert ops.snapshot(ops.device_ids).data_ptr() != ops.device_ids.data_ptr()
    with pytest.raises(TypeError, match="tensor is a ndarray"):
        ops.snapshot(np.zeros(3))


def test_a_snapshot_before_a_capture_keeps_what_the_buffers_held():
    # The previous step's rows, weights and counts, read in compiled code ahead of the capture that overwrites
    # them: a snapshot holds them, where Inductor (torch 2.14) moves a plain read of a slice after the capture.
    cap = moecap.Capturer(num_layers=1, top_k=2, num_experts=8, host_slots=16, max_running_requests=4,
                          chunked_prefill_size=4, weight_dtype="f32", histogram=True)
    ops = cap.ops
    cap.capture(0, np.array([[7, 6]], np.int32), np.array([[0.25, 0.75]], np.float32))

    def step(ids, w):
        ids_before = ops.snapshot(ops.layer_ids(0))[:1] * 1
        weights_before = ops.snapshot(ops.layer_weights(0))[:1] * 1
        load_before = ops.snapshot(ops.histogram)[0] * 1
        ops.capture(0, ids, w)
        return ids_before, weights_before, load_before

    torch._dynamo.reset()
    ids_before, weights_before, load_before = torch.compile(step, fullgraph=True)(
        torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([[0.5, 0.5]]))
    assert ids_before.tolist() == [[7, 6]]
    assert weights_before.tolist() == [[0.25, 0.75]]
    assert load_before.tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    assert ops.layer_ids(0)[:1].tolist() == [[1, 2]]  # and the capture wrote its rows


def test_the_raw_ops_refuse_buffers_that_are_not_the_capturers_and_change_nothing():
    cap = moecap.Capturer(num_layers=3, top_k=2, num_experts=8, host_slots=16, max_running_requests=4,
                          chunked_prefill_size=4, histogram=True, weight_dtype="f32")
    ops = cap.ops
    ids, w = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), torch.full((2, 2), 0.5)
    cap.capture(0, ids, w)
    before = (ops.device_ids.clone(), ops.device_weights.clone(), ops.histogram.clone())
    calls = {
        "histogram is None": lambda: torch.ops.moecap.capture(ops.device_ids, ops.device_weights, cap.id, 1, ids, w,
                                                              None),
        "device_weights is None": lambda: torch.ops.moecap.capture(ops.device_ids, None, cap.id, 1, ids, w,
                                                                   ops.histogram),
        r"device_ids is torch.int16 \(4, 2\)": lambda: torch.ops.moecap.capture(
            torch.zeros_like(ops.layer_ids(1)), ops.device_weights, cap.id, 1, ids, w, ops.histogram),
        r"device_ids is torch.int32 \(3, 4, 2\)": lambda: torch.ops.moecap.commit(
            ops.host_ids, ops.host_weights, ops.host_states, ops.device_ids.int(), ops.device_weights, cap.id,
            torch.tensor([5]), 0, None),
        # The host buffers as well: the commit writes them, and compiled code reads them after it.
        "host_weights is None": lambda: torch.ops.moecap.commit(
            ops.host_ids, None, ops.host_states, ops.device_ids, ops.device_weights, cap.id, torch.tensor([5]), 0, None),
        r"host_ids is torch.uint8 \(15, 3, 2\)": lambda: torch.ops.moecap.commit(
            ops.host_ids[1:], ops.host_weights, ops.host_states, ops.device_ids, ops.device_weights, cap.id,
            torch.tensor([5]), 0, None),
        r"host_states is torch.int32": lambda: torch.ops.moecap.invalidate(ops.host_states.int(), cap.id,
                                                                          torch.tensor([5])),
    }
    for message, call in calls.items():
        with pytest.raises(moecap.MoecapError, match=message) as e:
            call()
        assert e.value.status == moecap.Status.INVALID_ARGUMENT
        assert all(torch.equal(a, b) for a, b in zip(before, (ops.device_ids, ops.device_weights, ops.histogram)))
    assert cap.slot_states([5]).tolist() == [moecap.SlotState.EMPTY]
    assert not ops.host_weights.any()
    # And weights given to a capturer that keeps none.
    plain = moecap.Capturer(num_layers=3, top_k=2, num_experts=8, host_slots=16, max_running_requests=4,
                            chunked_prefill_size=4)
    plain.capture(0, ids)
    with pytest.raises(moecap.MoecapError, match="host_weights is given, but the capturer keeps no host_weights"):
        torch.ops.moecap.commit(plain.ops.host_ids, ops.host_weights, plain.ops.host_states, plain.ops.device_ids,
                                None, plain.id, torch.tensor([5]), 0, None)
    assert plain.slot_states([5]).tolist() == [moecap.SlotState.EMPTY]


def test_capture_keeps_plain_writes_under_a_backend_that_does_not_reinplace():
    # aot_eager hands capture copies of the device buffers: a layer written with
    # plain torch ops before the capture call must survive it and the copy-back.
    cap, eager = make(), make()
    ops = cap.ops
    ids0 = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    ids1 = torch.tensor([[5, 6, 7, 8]], dtype=torch.int32)
    w = torch.full((1, TOP_K), 0.25)

    def step(ids0, ids1, w):
        ops.layer_ids(0)[:1].copy_(ids0)
        ops.layer_weights(0)[:1].copy_(w)
        ops.capture(1, ids1, w)

    torch._dynamo.reset()
    before = ops_module.buffer_copies
    torch.compile(step, fullgraph=True, backend="aot_eager")(ids0, ids1, w)
    assert ops_module.buffer_copies > before  # it did get copies
    cap.commit(torch.tensor([3]))
    eager.capture(0, ids0, w)
    eager.capture(1, ids1, w)
    eager.commit(torch.tensor([3]))
    assert torch.equal(cap.read(torch.tensor([3])), eager.read(torch.tensor([3])))
    assert cap.read(torch.tensor([3]))[0, :2].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]


def test_commit_and_invalidate_refuse_a_backend_that_would_copy_the_host_cache():
    cap = make()
    ops = cap.ops
    cap.capture(0, torch.tensor([[1, 2, 3, 4]], dtype=torch.int32), torch.full((1, TOP_K), 0.25))

    def step(slots):
        ops.commit(slots)

    def free(slots):
        ops.invalidate(slots)

    for fn in (step, free):
        torch._dynamo.reset()
        with pytest.raises(moecap.MoecapError, match="handed a copy of the capturer's host_.*backend='inductor'") as e:
            torch.compile(fn, fullgraph=True, backend="aot_eager")(torch.tensor([4]))
        assert e.value.status == moecap.Status.INVALID_ARGUMENT
    assert moecap.SLOT_VALID & int(cap.slot_states(np.array([4]))[0]) == 0  # nothing committed


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


def test_capture_declares_the_histogram_it_counts_into():
    """With histogram=True, capture counts into ops.histogram: a declared
    mutation, so compiled code that reads it after capture sees the counts
    (undeclared, Inductor read it before the capture ran)."""
    cap = moecap.Capturer(num_layers=1, top_k=2, num_experts=8, host_slots=16, max_running_requests=4,
                          chunked_prefill_size=4, histogram=True)
    ops = cap.ops
    schema = torch.ops.moecap.capture.default._schema
    assert {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write} == {
        "device_ids", "device_weights", "histogram"}

    def step(ids):
        before = ops.histogram.clone()
        ops.capture(0, ids)
        return before, ops.histogram.clone()

    torch.library.opcheck(torch.ops.moecap.capture.default,
                          (ops.device_ids, None, cap.id, 0, torch.tensor([[5, 6]], dtype=torch.int32), None,
                           ops.histogram))
    cap.histogram_reset()
    torch._dynamo.reset()
    before, after = torch.compile(step, fullgraph=True)(torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
    assert before[0].tolist() == [0] * 8
    assert after[0].tolist() == [0, 1, 1, 1, 1, 0, 0, 0] == ops.histogram[0].tolist()
    assert make().ops.histogram is None  # a capturer without one passes none


def test_a_capturer_is_freed_without_the_garbage_collector_and_its_ops_then_say_so():
    """The capturer holds its ops, which name it by id and do not hold it
    back: no cycle keeps a dropped capturer's buffers until gc runs (an
    engine rebuilt in one process would hold two sets). Ops kept past it
    raise, and the memory they export stays readable."""
    import gc
    import weakref

    gc.disable()
    try:
        cap = make()
        ops = cap.ops
        assert cap.ops is ops
        ops.capture(0, torch.tensor([[1, 2, 3, 4]], dtype=torch.int32), torch.full((1, TOP_K), 0.25))
        alive = weakref.ref(cap)
        del cap
        assert alive() is None
        with pytest.raises(moecap.MoecapError, match="no live capturer has id"):
            ops.capture(0, torch.tensor([[1, 2, 3, 4]], dtype=torch.int32), torch.full((1, TOP_K), 0.25))
        assert ops.layer_ids(0)[0].tolist() == [1, 2, 3, 4]
    finally:
        gc.enable()


def test_ops_first_asked_for_in_inference_mode_work_outside_it_too():
    """An engine's first forward runs under torch.inference_mode(); a trainer
    replays outside it: the buffers cap.ops exports are normal tensors."""
    cap = make()
    with torch.inference_mode():
        ops = cap.ops
        assert not ops.device_ids.is_inference() and not ops.host_ids.is_inference()
        ops.capture(0, torch.tensor([[1, 2, 3, 4]], dtype=torch.int32), torch.full((1, TOP_K), 0.25))
    with torch.no_grad():
        for layer in range(1, LAYERS):
            ops.layer_ids(layer)[:1].copy_(torch.tensor([[5, 6, 7, 8]]))
            ops.layer_weights(layer)[:1].fill_(0.5)
        ops.commit(torch.tensor([2]))
    with torch.inference_mode():
        ops.invalidate(torch.tensor([3]))
    got = cap.read(torch.tensor([2]))
    assert got[0, 0].tolist() == [1, 2, 3, 4] and got[0, 3].tolist() == [5, 6, 7, 8]


def test_opcheck_schema_fake_and_mutations():
    cap = make()
    ops = cap.ops
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)
    weights = torch.full((2, TOP_K), 0.25)
    torch.library.opcheck(torch.ops.moecap.capture.default,
                          (ops.device_ids, ops.device_weights, cap.id, 1, ids, weights, None))
    # opcheck hands every check copies of the arguments, and commit/invalidate refuse a copy
    # of the host cache (test_commit_and_invalidate_refuse_...): check their fake impls directly.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        def fake(t):
            return None if t is None else mode.from_tensor(t)
        assert torch.ops.moecap.commit(fake(ops.host_ids), fake(ops.host_weights), fake(ops.host_states),
                                       fake(ops.device_ids), fake(ops.device_weights), cap.id,
                                       fake(torch.tensor([3, 9])), 0, None) is None
        assert torch.ops.moecap.invalidate(fake(ops.host_states), cap.id, fake(torch.tensor([3]))) is None
    assert moecap.SLOT_VALID & int(cap.slot_states([9])[0]) == 0  # fake calls ran no C call
    # opcheck's calls worked on its copies: moecap's memory is as they found it.
    assert (ops.device_ids[1, :2] == -1).all()
    cap.capture(1, ids, weights)
    cap.commit(torch.tensor([3, 9]))
    assert cap.read(np.array([9]))[0, 1].tolist() == [5, 6, 7, 8]


def test_no_mutated_argument_of_the_ops_has_a_default():
    """The dispatcher drops trailing arguments equal to their default before the ADInplaceOrView
    kernel, and torch 2.11's custom_op indexes every mutated argument by position there: a
    defaulted histogram=None raised IndexError on every capture without a histogram."""
    for op in (torch.ops.moecap.capture, torch.ops.moecap.commit, torch.ops.moecap.invalidate):
        mutated = [a for a in op.default._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert mutated
        assert [a.name for a in mutated if a.has_default_value()] == []


def test_dead_capturer_is_a_clear_error():
    cap = make()
    ops = cap.ops
    with pytest.raises(moecap.MoecapError, match="no live capturer has id"):
        torch.ops.moecap.capture(ops.device_ids, ops.device_weights, 10**9, 0,
                                 torch.zeros(1, TOP_K, dtype=torch.int32), torch.zeros(1, TOP_K), None)


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


def test_the_ops_refuse_what_the_capturers_calls_refuse_before_the_dispatcher_sees_it():
    cap = make()
    ops = cap.ops
    ids = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    with pytest.raises(TypeError, match="layer must be an int, not bool"):
        ops.capture(True, ids, torch.ones(1, TOP_K))  # the op's int schema would take it as layer 1
    with pytest.raises(TypeError, match="src_start must be an int, not bool"):
        ops.commit(torch.tensor([5]), True)
    with pytest.raises(TypeError, match="layer must be an int, not float"):
        ops.capture(1.0, ids, torch.ones(1, TOP_K))  # the dispatcher's own refusal is a RuntimeError
    with pytest.raises(TypeError, match="src_start must be an int, not str"):
        ops.commit(torch.tensor([5]), "0")
    for bad, kind in ((np.float32(1.7), "float32"), (np.True_, "bool"), (torch.tensor(1.0), "torch.float32 tensor"),
                      (torch.tensor(True), "torch.bool tensor")):
        with pytest.raises(TypeError, match=f"layer must be an int, not (a )?{kind}"):
            ops.capture(bad, ids, torch.ones(1, TOP_K))  # the schema took np.float32(1.7) as layer 1
    meta = torch.empty(1, TOP_K, dtype=torch.int32, device="meta")
    for call, name in ((lambda: ops.capture(0, meta, torch.ones(1, TOP_K)), "moecap_capture: topk_ids"),
                       (lambda: ops.commit(torch.tensor([5], device="meta")), "moecap_commit: dst_slots"),
                       (lambda: ops.invalidate(torch.tensor([5], device="meta")), "moecap_invalidate: slots")):
        with pytest.raises(moecap.MoecapError, match=f"{name} is a meta tensor"):
            call()  # the dispatcher would run the fake implementation: nothing done, no error
    for call, name, kind in ((lambda: ops.capture(0, ids.numpy(), torch.ones(1, TOP_K)), "moecap_capture: topk_ids",
                              "numpy.ndarray"),
                             (lambda: ops.capture(0, ids, [[1.0] * TOP_K]), "moecap_capture: topk_weights",
                              "builtins.list"),
                             (lambda: ops.commit(np.array([5])), "moecap_commit: dst_slots", "numpy.ndarray"),
                             (lambda: ops.invalidate([5]), "moecap_invalidate: slots", "builtins.list")):
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor for the torch ops, not {kind}"):
            call()  # not the AttributeError of a missing is_meta
    # Past int64 the dispatcher's own error names no range; the capturer's calls give OUT_OF_RANGE.
    with pytest.raises(moecap.MoecapError, match="moecap_capture: layer is 1180591620717411303424; it must fit in "
                       "int32"):
        ops.capture(2**70, ids, torch.ones(1, TOP_K))
    with pytest.raises(moecap.MoecapError, match="moecap_commit: src_start is -1180591620717411303424; it must fit "
                       "in int64"):
        ops.commit(torch.tensor([5]), -(2**70))
    assert cap.read(torch.tensor([5]))[0, 0, 0] == -1
    ops.capture(0, ids, torch.ones(1, TOP_K))
    ops.commit(torch.tensor([5]))
    assert cap.read(torch.tensor([5]))[0, 0].tolist() == [1, 2, 3, 4]


def test_the_ops_read_an_integer_tensor_layer_eagerly_and_refuse_it_in_compiled_code():
    """Eagerly an integer 0-d tensor is a layer, as for the capturer's calls; compiled, its value would be
    a read of its memory the graph cannot hold, so the ops name the argument instead of failing inside the
    backend."""
    cap = make()
    ops = cap.ops
    ids = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    ops.capture(torch.tensor(1), ids, torch.ones(1, TOP_K))
    ops.commit(torch.tensor([5]), torch.tensor(0))
    assert cap.read(torch.tensor([5]))[0, 1].tolist() == [1, 2, 3, 4]
    compiled = torch.compile(lambda layer, ids: ops.capture(layer, ids, torch.ones(1, TOP_K)), fullgraph=True,
                             backend="eager")
    with pytest.raises(Exception, match="layer must be an int in compiled code, not a tensor"):
        compiled(torch.tensor(1), ids)
    with pytest.raises(Exception, match="layer is 1180591620717411303424; it must fit in int32"):
        compiled(2**70, ids)  # past the schema's int64: named, not the dispatcher's bare RuntimeError
    compiled(1, ids)
    ops.commit(torch.tensor([6]))
    assert cap.read(torch.tensor([6]))[0, 1].tolist() == [1, 2, 3, 4]


def test_the_ops_are_one_capturers_handle_shared_by_copies_and_refused_by_deep_copies_and_pickles():
    """A deep copy would hold copies of the buffers and write its stale copy of
    the device rows over the capturer's own at its next capture."""
    import copy
    import pickle

    cap = make()
    ops = cap.ops
    model = torch.nn.Module()
    model.ops = ops
    assert copy.copy(ops) is ops
    with pytest.raises(TypeError, match="cannot be deep-copied"):
        copy.deepcopy(model)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(ops)
    ops.capture(0, torch.tensor([[1, 2, 3, 4]], dtype=torch.int32), torch.ones(1, TOP_K))
    assert ops.device_ids[0, 0].tolist() == [1, 2, 3, 4]


def test_an_op_handed_a_copy_on_a_side_stream_copies_the_forked_calls_effect_back():
    # The call runs forked (on the host backend, at the join): the copy back into what the backend
    # handed waits for it, or the copy would miss the rows the call wrote.
    cap = moecap.Capturer(num_layers=2, top_k=2, num_experts=8, host_slots=16, max_running_requests=4,
                          chunked_prefill_size=4, side_stream=True)
    ops = cap.ops
    handed = ops.device_ids.clone()
    torch.ops.moecap.capture(handed, None, cap.id, 1, torch.tensor([[3, 4]], dtype=torch.int32), None, None)
    assert handed[1, 0].tolist() == [3, 4]
    assert (ops.device_ids[1, 0] == -1).all()  # and moecap's memory holds what it held
