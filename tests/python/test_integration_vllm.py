# SPDX-License-Identifier: Apache-2.0
"""moecap behind vLLM's RoutedExpertsCapturer interface, side by side with
vLLM 0.33's own capturer on the same batches.

vLLM's own code runs: VllmConfig / ModelConfig (from a generated Qwen3-MoE
config.json with two dense layers), RoutedExpertsCapturer (capture with its
DP row restore under set_forward_context, snapshot_routing_data),
AuxOutputSchedulerConnector.take_output (the T-1 cut), CompletionOutput and
numpy2base64 (the OpenAI form). No vLLM code is patched; vLLM runs on its CPU
platform (VLLM_TARGET_DEVICE=cpu). What vLLM does between the snapshot and
take_output (staging rows per request, its block store) consumes the
snapshot as it is, so equal snapshots give equal CompletionOutputs.

The format tests at the end need no vLLM.
"""
import base64
import io
import os
import types

import numpy as np
import pytest

from moecap.formats import vllm as vllm_format
from moecap.record import RoutedExperts

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM resolves its platform
os.environ.setdefault("HF_HUB_OFFLINE", "1")

NUM_LAYERS, TOP_K, NUM_EXPERTS = 5, 2, 8
MOE_LAYERS = (1, 2, 4)  # mlp_only_layers [0, 3]
MAX_TOKENS = 64

CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "num_experts": NUM_EXPERTS,
    "num_experts_per_tok": TOP_K, "mlp_only_layers": [0, 3], "decoder_sparse_step": 1, "vocab_size": 128,
    "max_position_embeddings": 256, "torch_dtype": "float32", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
}


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm.model_executor.layers.fused_moe.routed_experts_capturer")
    import json
    from vllm.config import ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.distributed.aux_output_connector import worker
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector, AuxRequestOutput
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe import routed_experts_capturer as vre
    from vllm.outputs import CompletionOutput
    from vllm.utils.serial_utils import numpy2base64
    from moecap.integrations import vllm as adapter

    model_configs = {}

    def model_config(num_experts):
        if num_experts not in model_configs:
            path = tmp_path_factory.mktemp(f"qwen3_moe_{num_experts}")
            (path / "config.json").write_text(json.dumps(dict(CONFIG, num_experts=num_experts)))
            model_configs[num_experts] = ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="float32",
                                                     max_model_len=256)
        return model_configs[num_experts]

    def config(dp_size=1, dp_rank=0, num_experts=NUM_EXPERTS):
        return VllmConfig(model_config=model_config(num_experts),
                          scheduler_config=SchedulerConfig(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=8,
                                                           max_model_len=256, is_encoder_decoder=False),
                          parallel_config=ParallelConfig(data_parallel_size=dp_size, data_parallel_rank=dp_rank))
    yield types.SimpleNamespace(torch=torch, config=config, re=vre, worker=worker, adapter=adapter,
                                set_forward_context=set_forward_context, take_output=AuxOutputSchedulerConnector.take_output,
                                AuxRequestOutput=AuxRequestOutput, CompletionOutput=CompletionOutput,
                                numpy2base64=numpy2base64)
    adapter.uninstall()


def pair(vl, cfg, **options):
    """vLLM's capturer and moecap's, both built by vLLM's aux-output worker's names (install() swaps them)."""
    vl.adapter.uninstall()
    theirs = vl.worker.RoutedExpertsCapturer(max_num_batched_tokens=MAX_TOKENS, vllm_config=cfg)
    vl.adapter.install(**options)
    try:
        ours = vl.worker.RoutedExpertsCapturer(max_num_batched_tokens=MAX_TOKENS, vllm_config=cfg)
    finally:
        vl.adapter.uninstall()
    assert type(theirs) is vl.re.RoutedExpertsCapturer
    assert isinstance(ours, vl.adapter.MoecapRoutedExpertsCapturer)
    assert ours.shape_per_token == theirs.shape_per_token and ours.output_dtype_name == theirs.output_dtype_name
    return theirs, ours


def step(vl, cfg, capturers, gathered, local_n, tokens_across_dp=None):
    """One forward: every MoE layer's top-k (the gathered batch the router
    saw) to each capturer's capture, under vLLM's forward context; then each
    capturer's snapshot of this rank's rows."""
    torch = vl.torch
    across = None if tokens_across_dp is None else torch.tensor(tokens_across_dp)
    with vl.set_forward_context(None, cfg, num_tokens=local_n, num_tokens_across_dp=across):
        for cap in capturers:
            for i, layer in enumerate(MOE_LAYERS):
                cap.capture(layer, torch.from_numpy(np.ascontiguousarray(gathered[:, i, :])).to(torch.int64))
    return [cap.snapshot_routing_data(local_n) for cap in capturers]


def test_snapshots_equal_vllms_at_dp1_with_verify_rows(vl):
    cfg = vl.config()
    theirs, ours = pair(vl, cfg)
    assert ours.capturer is None  # built once the MoE layers are known (at bind, or from the config here)
    rng = np.random.default_rng(0)
    # A prefill, decodes, verify batches (4 requests x (1 + 3 drafts) rows)
    for n in (17, 4, 4, 16, 16, 1, MAX_TOKENS):
        rows = rng.integers(0, NUM_EXPERTS, size=(n, len(MOE_LAYERS), TOP_K))
        a, b = step(vl, cfg, (theirs, ours), rows, n)
        assert a.dtype == b.dtype == vl.torch.uint8 and a.shape == b.shape == (n, NUM_LAYERS, TOP_K)
        assert vl.torch.equal(a, b)
        assert not b[:, [0, 3]].any()  # dense layers 0, as vLLM's
    assert ours.moe_layers == MOE_LAYERS and ours.capturer.config["num_layers"] == len(MOE_LAYERS)


def test_capture_compiles_into_one_graph_as_vllms_does(vl):
    """vLLM compiles its models with torch.compile(fullgraph=True); the
    capture hook inside them traces into the graph through moecap's custom
    ops, and the snapshot equals vLLM's."""
    torch = vl.torch
    cfg = vl.config()
    theirs, ours = pair(vl, cfg)
    ours._ensure()
    rows = np.random.default_rng(3).integers(0, NUM_EXPERTS, size=(5, len(MOE_LAYERS), TOP_K))
    snapshots = []
    for cap in (theirs, ours):
        def body(x, cap=cap):
            for i, layer in enumerate(MOE_LAYERS):
                cap.capture(layer, x[:, i, :])
            return x.sum()
        torch._dynamo.reset()
        compiled = torch.compile(body, fullgraph=True, backend="eager")
        with vl.set_forward_context(None, cfg, num_tokens=5):
            compiled(torch.from_numpy(rows).to(torch.int64))
        snapshots.append(cap.snapshot_routing_data(5))
    assert torch.equal(snapshots[0], snapshots[1])
    assert snapshots[1][:, list(MOE_LAYERS)].tolist() == rows.tolist()


@pytest.mark.parametrize("experts, dtype", [(256, "uint8"), (257, "uint16"), (384, "uint16")])
def test_snapshots_equal_vllms_past_256_experts_in_uint16(vl, experts, dtype):
    cfg = vl.config(num_experts=experts)
    theirs, ours = pair(vl, cfg)
    rows = np.random.default_rng(1).integers(0, experts, size=(9, len(MOE_LAYERS), TOP_K))
    rows[0, :, 0] = experts - 1
    a, b = step(vl, cfg, (theirs, ours), rows, 9)
    assert a.dtype == b.dtype == getattr(vl.torch, dtype) and vl.torch.equal(a, b)
    assert b[0, list(MOE_LAYERS), 0].tolist() == [experts - 1] * len(MOE_LAYERS)


@pytest.mark.parametrize("tokens", [[3, 5], [4, 0], [0, 2]])
def test_snapshots_equal_vllms_at_dp2(vl, tokens):
    """Two DP ranks: the router sees both ranks' tokens back to back; each
    rank's capturer keeps its own (vLLM's restore rule, in both)."""
    rng = np.random.default_rng(sum(tokens))
    gathered = rng.integers(0, NUM_EXPERTS, size=(sum(tokens), len(MOE_LAYERS), TOP_K))
    for rank in range(2):
        cfg = vl.config(dp_size=2, dp_rank=rank)
        theirs, ours = pair(vl, cfg)
        a, b = step(vl, cfg, (theirs, ours), gathered, tokens[rank], tokens)
        assert vl.torch.equal(a, b)
        first = sum(tokens[:rank])
        assert np.array_equal(b.numpy()[:, list(MOE_LAYERS)], gathered[first:first + tokens[rank]])


def test_completion_output_and_openai_form_equal_vllms(vl):
    """A request's steps through take_output (the T-1 cut) and the output
    processor's concatenation: vLLM's capturer and moecap's give the same
    CompletionOutput.routed_experts and the same OpenAI string, which is also
    what RoutedExperts.to_vllm / to_vllm_openai write for that routing."""
    cfg = vl.config()
    theirs, ours = pair(vl, cfg)
    rng = np.random.default_rng(1)
    prompt, outputs = 9, 4
    chunks = {0: [], 1: []}
    truth = []
    forwarded = 0
    for n in (prompt, 1, 1, 1, 1):  # the prefill, then each decode forwards the token sampled before it
        rows = rng.integers(0, NUM_EXPERTS, size=(n, len(MOE_LAYERS), TOP_K))
        snaps = step(vl, cfg, (theirs, ours), rows, n)
        start, forwarded = forwarded, forwarded + n
        num_tokens = forwarded + 1  # and the token this step sampled
        truth.append(rows)
        request = types.SimpleNamespace(request_id="r", num_tokens=num_tokens, is_finished=lambda: False)
        for i, snap in enumerate(snaps):
            taken = vl.take_output(None, request, {"r": vl.AuxRequestOutput(start, snap.numpy())})
            assert len(taken) == n
            chunks[i].append(taken)
    assert num_tokens == prompt + outputs + 1
    final = [np.concatenate(chunks[i], axis=0) for i in (0, 1)]  # the output processor's concatenation
    completions = [vl.CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                                       routed_experts=f) for f in final]
    a, b = (c.routed_experts for c in completions)
    assert a.dtype == b.dtype == np.uint8 and a.shape == b.shape == (num_tokens - 1, NUM_LAYERS, TOP_K)
    assert a.tobytes() == b.tobytes()
    assert vl.numpy2base64(a) == vl.numpy2base64(b)
    routed = RoutedExperts(np.concatenate(truth)[:num_tokens - 1], NUM_EXPERTS, layers=MOE_LAYERS,
                           num_hidden_layers=NUM_LAYERS)
    assert routed.to_vllm(num_tokens=num_tokens).tobytes() == b.tobytes()
    assert routed.to_vllm_openai(num_tokens=num_tokens) == vl.numpy2base64(b)


def test_rows_a_layer_did_not_write_are_refused_not_sent_as_expert_0(vl):
    """A MoE layer whose router never called capture this step (a kernel that
    bypasses the hook): vLLM snapshots last step's rows, or zeros, as real
    routing; moecap refuses the step (or sends 0 with invalid='zero')."""
    cfg = vl.config()
    theirs, ours = pair(vl, cfg)
    zero = vl.adapter.MoecapRoutedExpertsCapturer(MAX_TOKENS, cfg, invalid="zero")
    rng = np.random.default_rng(2)
    rows = rng.integers(0, NUM_EXPERTS, size=(3, len(MOE_LAYERS), TOP_K))
    step(vl, cfg, (theirs, ours, zero), rows, 3)
    torch = vl.torch
    with vl.set_forward_context(None, cfg, num_tokens=3):
        for cap in (theirs, ours, zero):
            for i, layer in enumerate(MOE_LAYERS[:-1]):  # the last MoE layer writes nothing this step
                cap.capture(layer, torch.from_numpy(rows[:, i, :]).to(torch.int64))
    stale = theirs.snapshot_routing_data(3)
    assert torch.equal(stale[:, MOE_LAYERS[-1]], torch.from_numpy(rows[:, -1, :]).to(torch.uint8))  # last step's
    with pytest.raises(RuntimeError, match="3 of 3 rows of this step have no routing"):
        ours.snapshot_routing_data(3)
    assert not zero.snapshot_routing_data(3).any()


def test_a_snapshot_of_a_count_that_is_not_a_row_count_is_refused_and_consumes_nothing(vl):
    cfg = vl.config()
    theirs, ours = pair(vl, cfg)
    rows = np.random.default_rng(3).integers(0, NUM_EXPERTS, size=(3, len(MOE_LAYERS), TOP_K))
    torch = vl.torch
    with vl.set_forward_context(None, cfg, num_tokens=3):
        for cap in (theirs, ours):
            for i, layer in enumerate(MOE_LAYERS):
                cap.capture(layer, torch.from_numpy(rows[:, i, :]).to(torch.int64))
    for wrong, error, message in ((2.9, TypeError, "num_tokens must be an int"), (True, TypeError, "num_tokens"),
                                  (-1, ValueError, "num_tokens is -1"), (MAX_TOKENS + 1, ValueError, "num_tokens is")):
        with pytest.raises(error, match=message):
            ours.snapshot_routing_data(wrong)
    assert torch.equal(ours.snapshot_routing_data(np.int64(3)), theirs.snapshot_routing_data(3))  # nothing was consumed


def test_a_graph_batchs_padding_rows_are_never_sent_by_a_later_step(vl):
    """A CUDA-graph step captures its padded batch (8 rows) and vLLM snapshots
    the 5 real ones; the next step's 7 rows include two of that padding, and
    a MoE layer that skips the capture there must not send it as routing."""
    cfg = vl.config()
    _, ours = pair(vl, cfg)
    zero = vl.adapter.MoecapRoutedExpertsCapturer(MAX_TOKENS, cfg, invalid="zero")
    rng = np.random.default_rng(3)
    torch = vl.torch

    def forward(rows, layers):
        with vl.set_forward_context(None, cfg, num_tokens=rows.shape[0]):
            for cap in (ours, zero):
                for i, layer in enumerate(MOE_LAYERS):
                    if layer in layers:
                        cap.capture(layer, torch.from_numpy(np.ascontiguousarray(rows[:, i, :])).to(torch.int64))

    forward(rng.integers(1, NUM_EXPERTS, size=(8, len(MOE_LAYERS), TOP_K)), MOE_LAYERS)
    for cap in (ours, zero):
        cap.snapshot_routing_data(5)
    forward(rng.integers(1, NUM_EXPERTS, size=(7, len(MOE_LAYERS), TOP_K)), MOE_LAYERS[:-1])
    with pytest.raises(RuntimeError, match="7 of 7 rows of this step have no routing"):
        ours.snapshot_routing_data(7)
    assert not zero.snapshot_routing_data(7)[:, MOE_LAYERS[-1]].any()


def test_a_second_micro_batch_lands_past_the_first_and_an_id_outside_it_is_refused(vl, monkeypatch):
    """Dual-batch overlap: the second micro-batch's rows go at its token offset (written straight into
    moecap's buffer, as vLLM writes its own), byte for byte as vLLM's. An id outside [0, num_experts)
    there is refused (or sent as 0), where vLLM's uint8 output wraps 259 into expert 3."""
    import vllm.v1.worker.ubatching as ubatching
    torch = vl.torch
    cfg = vl.config()
    theirs, ours = pair(vl, cfg)
    zero = vl.adapter.MoecapRoutedExpertsCapturer(MAX_TOKENS, cfg, invalid="zero")
    offset = {"rows": 0}
    for module in (ubatching, vl.re):
        monkeypatch.setattr(module, "dbo_current_ubatch_token_offset", lambda: offset["rows"])

    def forward(rows):
        with vl.set_forward_context(None, cfg, num_tokens=3):
            for first in (0, 3):
                offset["rows"] = first
                for cap in (theirs, ours, zero):
                    for i, layer in enumerate(MOE_LAYERS):
                        ids = np.ascontiguousarray(rows[first:first + 3, i, :])
                        cap.capture(layer, torch.from_numpy(ids).to(torch.int64))
        offset["rows"] = 0

    rows = np.random.default_rng(5).integers(0, NUM_EXPERTS, size=(6, len(MOE_LAYERS), TOP_K))
    forward(rows)
    snapshots = [cap.snapshot_routing_data(6) for cap in (theirs, ours, zero)]
    assert torch.equal(snapshots[0], snapshots[1]) and torch.equal(snapshots[0], snapshots[2])
    assert ours.capturer.plan.device_id_dtype == "u8"  # up to 255 experts

    rows[4, 1, 0] = 256 + 3  # row 4: the second micro-batch's
    forward(rows)
    assert int(theirs.snapshot_routing_data(6)[4, MOE_LAYERS[1], 0]) == 3
    with pytest.raises(RuntimeError, match="1 of 6 rows of this step have no routing"):
        ours.snapshot_routing_data(6)
    sent = zero.snapshot_routing_data(6)
    assert not sent[4].any() and torch.equal(sent[:4], snapshots[0][:4].to(sent.dtype))


def test_a_models_row_restore_replaces_vllms_rule(vl):
    """vLLM 0.34's binding sets capturer.restore_rows to the first bound
    module's restore_routed_experts_rows (a model whose router sees its rows
    in another order or layout); capture then keeps what that hook returns.
    Set here as the binding sets it, so the test runs on 0.33 as well."""
    cfg = vl.config()
    theirs, ours = pair(vl, cfg)
    seen = []

    def restore_routed_experts_rows(topk_ids, ctx):  # this model's rule: its rows arrive reversed
        seen.append(ctx)
        return topk_ids.flip(0)

    ours.restore_rows = restore_routed_experts_rows
    rows = np.random.default_rng(4).integers(0, NUM_EXPERTS, size=(6, len(MOE_LAYERS), TOP_K))
    a, b = step(vl, cfg, (theirs, ours), rows, 6)
    assert len(seen) == len(MOE_LAYERS) and all(ctx is not None for ctx in seen)
    assert np.array_equal(b.numpy()[:, list(MOE_LAYERS)], rows[::-1])
    assert vl.torch.equal(a.flip(0), b)  # vLLM's default rule, on the same rows, kept them in order


def test_install_routes_binding_through_the_adapter(vl):
    """install() swaps the aux-output worker's capturer class and binder; the
    binder learns the MoE layers from the model's modules before vLLM's own
    binding runs (which, with no router in this stand-in model, refuses)."""
    cfg = vl.config()
    vl.adapter.install()
    try:
        cap = vl.worker.RoutedExpertsCapturer(max_num_batched_tokens=MAX_TOKENS, vllm_config=cfg)
        assert isinstance(cap, vl.adapter.MoecapRoutedExpertsCapturer) and cap.capturer is None
        model = vl.torch.nn.Sequential()
        for layer in (1, 2, 4):
            module = vl.torch.nn.Module()
            module.layer_id, module.capture_fn = layer, None  # vLLM's RoutedExpertsCaptureSource protocol
            model.append(module)
        vl.worker.bind_routed_experts_capturer(model, cap)
        assert cap.moe_layers == (1, 2, 4)
        assert all(m.capture_fn.func == cap.capture for m in model)
    finally:
        vl.adapter.uninstall()
    assert vl.worker.RoutedExpertsCapturer is vl.re.RoutedExpertsCapturer
    # Options the worker's capturer would refuse are refused here, installing nothing.
    with pytest.raises(ValueError, match=r"invalid must be one of \('raise', 'zero'\), not 'omit'"):
        vl.adapter.install(invalid="omit")
    with pytest.raises(TypeError, match="unexpected option 'layers'; MoecapRoutedExpertsCapturer takes moe_layers"):
        vl.adapter.install(layers=(1, 2))
    assert vl.worker.RoutedExpertsCapturer is vl.re.RoutedExpertsCapturer


# --- the payload contract (no vLLM needed) ----------------------------------------------------

def routing(tokens=6, start=0, valid=None, experts=NUM_EXPERTS):
    ids = np.random.default_rng(3).integers(0, experts, size=(tokens, len(MOE_LAYERS), TOP_K))
    return RoutedExperts(ids, experts, valid=valid, start=start, layers=MOE_LAYERS, num_hidden_layers=NUM_LAYERS)


@pytest.mark.parametrize("experts,dtype", [(8, np.uint8), (256, np.uint8), (257, np.uint16), (65536, np.uint16)])
def test_vllm_array_dtype_follows_the_expert_count(experts, dtype):
    r = routing(experts=experts)
    a = r.to_vllm(num_tokens=7)
    assert a.dtype == dtype and a.shape == (6, NUM_LAYERS, TOP_K) and not a[:, [0, 3]].any()
    assert RoutedExperts.from_vllm(a, experts, layers=MOE_LAYERS, num_tokens=7) == r


def test_vllm_openai_form_decodes_with_numpys_npy_reader():
    r = routing(start=2)
    s = r.to_vllm_openai()
    raw = base64.b64decode(s)
    assert raw.startswith(b"\x93NUMPY")
    array = np.load(io.BytesIO(raw), allow_pickle=False)  # what vLLM's protocol tells clients to do
    assert array.dtype == np.uint8 and array.shape == (6, NUM_LAYERS, TOP_K)
    assert np.array_equal(array[:, list(MOE_LAYERS)], r.ids)
    assert RoutedExperts.from_vllm(s, NUM_EXPERTS, start=2, layers=MOE_LAYERS) == r
    empty = routing(tokens=0)
    assert np.load(io.BytesIO(base64.b64decode(empty.to_vllm_openai()))).shape == (0, NUM_LAYERS, TOP_K)


def test_vllm_payload_refuses_tokens_without_routing_unless_told():
    r = routing(valid=[True, False, True, True, True, True])
    with pytest.raises(ValueError, match="vLLM has no value for 'no routing'.*first at position 1"):
        r.to_vllm()
    a = r.to_vllm(invalid="zero")
    assert not a[1].any() and a[2].any()
    with pytest.raises(ValueError, match="uint16 past 256 experts"):
        routing(experts=70000).to_vllm()


def test_vllm_decoder_checks_dtype_rows_and_dense_layers():
    a = routing().to_vllm()
    with pytest.raises(ValueError, match="vLLM sends uint16 for 300 experts"):
        RoutedExperts.from_vllm(a, 300)
    with pytest.raises(ValueError, match="has 6 rows"):
        RoutedExperts.from_vllm(a, NUM_EXPERTS, num_tokens=9)
    bad = a.copy()
    bad[:, 0] = 1
    with pytest.raises(ValueError, match="layer 0 is dense"):
        RoutedExperts.from_vllm(bad, NUM_EXPERTS, layers=MOE_LAYERS)
    with pytest.raises(ValueError, match="not a .npy file"):
        RoutedExperts.from_vllm(base64.b64encode(b"nope").decode(), NUM_EXPERTS)
    assert vllm_format.npy_b64(a) == routing().to_vllm_openai()
