# SPDX-License-Identifier: Apache-2.0
"""moecap.hf on real transformers MoE architectures (random weights, no
downloads), served by the small engine in hf_serving: every request's routing
read back from the capturer equals the model's own output_router_logits top-k
(ids exactly, weights within float32 precision), at dp 1 and at dp 2 with
ranks that are idle for some steps and one that serves nothing at all."""
import contextlib
import copy
import gc
import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", minversion="2.4", reason="moecap.hf needs torch >= 2.4 (the test venv)")
transformers = pytest.importorskip("transformers", reason="moecap.hf needs transformers (the test venv)")

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import moecap  # noqa: E402
from moecap import hf  # noqa: E402
from moecap.integrations import _model  # noqa: E402

import hf_serving  # noqa: E402

ARCHITECTURES = sorted(hf.KNOWN)
# hf_serving's tiny configs have 3 decoder layers. Layer 1 is dense in Qwen2-MoE, Qwen3-Next, Qwen3-VL-MoE and
# the Qwen3-Omni thinker (mlp_only_layers), in Mellum (mlp_layer_types) and Llama 4 (moe_layers), and an
# attention layer in Nemotron-H;
# layer 0 is dense in the DeepSeek family, Cohere2-MoE and the others whose mlp_layer_types start "dense"
# (first_k_dense_replace=1 or mlp_layer_types; Solar Open has no such rule), in Ernie 4.5
# (moe_layer_start_index=1), in LFM2-MoE and AFMoE (num_dense_layers=1), in Flint and Kolibri 1.1
# (mlp_only_layers=[0]) and in Inkling (dense_mlp_idx=1); the others are MoE throughout.
LAYER_MAPS = {t: ((0, 1, 2), 3) for t in ARCHITECTURES}
LAYER_MAPS.update({t: ((0, 2), 3) for t in ("qwen2_moe", "qwen3_next", "nemotron_h", "qwen3_vl_moe",
                                            "qwen3_omni_moe_thinker", "mellum", "llama4_text", "llama4")})
LAYER_MAPS.update({t: ((1, 2), 3) for t in ("deepseek_v3", "deepseek_v2", "glm4_moe", "dots1", "ernie4_5_moe",
                                            "deepseek_v32", "glm_moe_dsa", "kimi_linear", "mistral4", "glm4v_moe",
                                            "cohere2_moe", "glm4_moe_lite", "glm5_next", "deepseek_ocr2",
                                            "lfm2_moe", "exaone_moe", "afmoe", "mimo_v2_flash", "step3p7", "hy_v3",
                                            "hy_v4", "minimax_m3_vl_text", "minimax_m3_vl", "laguna", "axk1", "axk2",
                                            "bailing_hybrid", "beam", "dots3_note_text", "dots3_note", "ergo",
                                            "flint", "hy_v4_vl", "kolibri1_1", "minicpm5_moe", "mistral_large4",
                                            "unlimited_ocr", "inkling_text", "inkling_mm_model")})


def config_or_skip(model_type):
    class_name, config = hf_serving.tiny_config(model_type)
    if config is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}: {model_type} not tested")
    return config


def requests(rng, rid0, count, waves):
    out, rid = [], rid0
    for _ in range(waves):
        wave = []
        for _ in range(count):
            prompt = rng.integers(3, hf_serving.VOCAB, size=int(rng.integers(2, 9)))
            wave.append(hf_serving.Request(rid, prompt, int(rng.integers(1, 5))))
            rid += 1
        out.append(wave)
    return out


def check(ranks, rtol=1.3e-6):
    """Every finished request's routing equals what the model computed: ids
    exactly, weights within `rtol` (float32's, or one ulp of a 16-bit dtype)."""
    checked = 0
    for rank in ranks:
        for req in rank.finished:
            routed = req.routed
            assert routed.shape[0] == req.forwarded == len(req.expected_ids)
            assert routed.valid.all(), f"request {req.rid}: a committed token reads as an empty slot"
            assert routed.layer_map == rank.handle.layer_map == LAYER_MAPS[rank.model.config.model_type]
            want = torch.stack(req.expected_ids).numpy()
            got = routed.ids.astype(np.int64)
            assert np.array_equal(got, want), f"request {req.rid} of rank {rank.rank}: ids differ"
            torch.testing.assert_close(torch.from_numpy(routed.weights), torch.stack(req.expected_weights),
                                       rtol=rtol, atol=1e-6)
            checked += routed.shape[0]
        assert len(rank.table) == 0
    return checked


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_dp1_chunked_prefill_left_padded_decode(model_type):
    config = config_or_skip(model_type)
    rng = np.random.default_rng(1)
    waves = requests(rng, 0, count=3, waves=2)  # wave 2 reuses wave 1's freed slots
    ranks = hf_serving.serve(config, 1, [waves], [lambda step: True], chunk=3)
    assert ranks[0].steps["prefill"] >= 4 and ranks[0].steps["decode"] >= 2
    assert check(ranks) == sum(r.forwarded for w in waves for r in w) > 0


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_dp2_with_idle_steps(model_type):
    config = config_or_skip(model_type)
    rng = np.random.default_rng(2)
    waves = [requests(rng, 0, count=2, waves=2), requests(rng, 100, count=3, waves=1)]
    # both ranks sit out some steps while they still have work (rank 0 every 4th, rank 1 every 3rd)
    ranks = hf_serving.serve(config, 2, waves, [lambda step: step % 4 != 2, lambda step: step % 3 != 1], chunk=2)
    assert ranks[1].steps["idle"] > 0 and ranks[0].steps["idle"] > 0
    assert check(ranks) == sum(r.forwarded for rank_waves in waves for w in rank_waves for r in w)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "granitemoe", "jamba", "dbrx", "zaya"])
def test_bfloat16_model_keeps_bf16_weights(model_type):
    """A bf16 model whose routers (or blocks: DBRX, Jamba in transformers 5.19) give
    bf16 weights, kept as bf16."""
    config = config_or_skip(model_type)
    waves = requests(np.random.default_rng(4), 0, count=2, waves=1)
    ranks = hf_serving.serve(config, 1, [waves], [lambda step: True], chunk=4, dtype=torch.bfloat16)
    assert check(ranks, rtol=2 ** -7) > 0  # GraniteMoE rounds its float32 softmax to bf16, the reference does not


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3"])
def test_dp2_one_rank_serves_nothing(model_type):
    config = config_or_skip(model_type)
    rng = np.random.default_rng(3)
    waves = [requests(rng, 0, count=2, waves=1), []]
    ranks = hf_serving.serve(config, 2, waves, [lambda step: True, lambda step: True], chunk=4)
    assert ranks[1].steps["prefill"] == ranks[1].steps["decode"] == 0 and ranks[1].steps["idle"] > 0
    assert check(ranks) > 0


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3", "llama4_text", "laguna", "granitemoeshared",
                                        "granitemoehybrid", "granitemoe_swa", "inkling_text"])
def test_shared_expert_rides_as_extra_column(model_type):
    """The fused-shared-expert layout: column top_k is expert num_experts with
    the shared expert's gate (Qwen2-MoE: sigmoid of shared_expert_gate;
    DeepSeek-V3: 1.0; Laguna, whose block scales the routed sum by 2.5
    before adding the shared expert: 1 / 2.5; GraniteMoE-Shared, whose
    decoder layer (and -Hybrid's, -SWA's) adds its shared_mlp beside the
    block: 1.0; Inkling, whose router weighs its shared expert per token:
    that gamma)."""
    model = hf_serving.build(config_or_skip(model_type))
    layers = hf.find_moe_layers(model)
    router = layers[0].router
    seen = {}

    def spy(layer, ids, weights):
        seen[layer] = (ids.clone(), weights.clone())
        return ids, weights

    cap = moecap.Capturer(num_layers=len(layers), top_k=router.top_k, num_experts=router.num_experts, host_slots=16,
                          max_running_requests=1, chunked_prefill_size=16, weight_dtype="f32", extra_columns=1)
    tokens = torch.randint(3, hf_serving.VOCAB, (1, 6))
    gates = {}
    if layers[0].shared_gate is not None:
        for layer in layers:
            layer.shared_gate.register_forward_hook(
                lambda m, i, o, idx=layer.index: gates.__setitem__(idx, torch.sigmoid(o.reshape(-1).float())))
    unrecorded = hf_serving.Unrecorded(model, layers)  # Inkling's reference takes its router's inputs
    with hf.attach(model, cap, gather=spy) as handle, torch.no_grad():
        assert handle.shared_column == 1
        out = model(tokens, output_router_logits=True)
    unrecorded.close()
    for layer, logits in zip(layers, out.router_logits):
        ids, weights = seen[layer.index]
        if layer.index in unrecorded.shared:  # Inkling: its shared expert's gamma, per token
            want_ids, want_w, gamma = hf_serving.inkling(layer.router, logits, unrecorded.shared[layer.index])
            gates[layer.index] = gamma.reshape(-1)
            assert not torch.allclose(gamma, gamma[:1])  # a per-token weight, not a constant
        else:
            want_ids, want_w = hf_serving.reference(layer, logits)
        assert ids.shape == (6, router.top_k + 1)
        assert torch.equal(ids[:, :-1], want_ids) and (ids[:, -1] == router.num_experts).all()
        torch.testing.assert_close(weights[:, :-1], want_w.float())
        scale = getattr(layer.block, "routed_scaling_factor", 1.0)
        assert model_type != "laguna" or scale == 2.5
        torch.testing.assert_close(weights[:, -1], gates.get(layer.index, torch.full((6,), 1 / scale)))
    # Captured and committed, the extra column is dropped: routed ids only.
    commit_slots = np.arange(6)
    cap.commit(commit_slots)
    routed = torch.stack([seen[layer.index][0][:, :-1] for layer in layers], dim=1)
    assert np.array_equal(cap.read(commit_slots), routed.numpy())


def test_unknown_architecture_is_refused_naming_the_selector(monkeypatch):
    _, config = hf_serving.tiny_config("mixtral")
    if config is None:
        pytest.skip(f"transformers {transformers.__version__} has no MixtralConfig")
    model = hf_serving.build(config)
    model.config.model_type = "my_moe"
    monkeypatch.delitem(hf.KNOWN, "mixtral")  # so that neither its type nor its model class's is known
    cap = moecap.Capturer(num_layers=3, top_k=2, num_experts=8, host_slots=8, max_running_requests=1,
                          chunked_prefill_size=8)
    with pytest.raises(hf.UnknownArchitecture, match="model_type 'my_moe'.*selector="):
        hf.attach(model, cap)

    # With a selector it runs, and captures what the selector says.
    def selector(router, inputs, output):
        logits = output[0]
        return torch.topk(logits, 2, dim=-1)[1], None

    with hf.attach(model, cap, selector=selector), torch.no_grad():
        out = model(torch.randint(3, hf_serving.VOCAB, (1, 4)), output_router_logits=True)
    cap.commit(np.arange(4))
    got = cap.read(np.arange(4))
    want = torch.stack([torch.topk(l, 2, dim=-1)[1] for l in out.router_logits], 1).numpy()
    assert np.array_equal(got, want)

    # A model that declares no router class at all: routers= is named.
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(hf.UnknownArchitecture, match="routers="):
        hf.attach(plain, cap, selector=selector)


def test_a_config_type_that_builds_a_known_model_is_known():
    """Sarvam's config types build GLM-4.5's and DeepSeek-V3's models: their
    model_type is not in KNOWN, the model class that records their routers
    is, and attach captures what it captures under the known type."""
    _, config = hf_serving.tiny_config("glm4_moe")
    if config is None:
        pytest.skip(f"transformers {transformers.__version__} has no Glm4MoeConfig")
    model = hf_serving.build(config)
    tokens = torch.randint(3, hf_serving.VOCAB, (1, 5))
    reads = []
    for model_type in ("glm4_moe", "sarvam_moe"):
        model.config.model_type = model_type
        cap = moecap.Capturer(num_layers=2, top_k=2, num_experts=8, host_slots=8, max_running_requests=1,
                              chunked_prefill_size=8)
        with hf.attach(model, cap), torch.no_grad():
            model(tokens)
        cap.commit(np.arange(5))
        reads.append(cap.read(np.arange(5)))
    assert (reads[0] >= 0).all() and np.array_equal(reads[0], reads[1])
    assert "sarvam_moe" not in hf.KNOWN


def test_a_selectors_model_whose_router_and_config_name_no_top_k_takes_it_from_the_capturer():
    """Switch Transformers' top-1 routers return a one-hot mask and keep no
    top_k, and its config names none: with a selector, attach takes the
    capturer's, and captures what the selector says in every sparse layer."""
    switch = getattr(transformers, "SwitchTransformersConfig", None)
    if switch is None:
        pytest.skip("no Switch Transformers in this transformers")
    config = switch(vocab_size=hf_serving.VOCAB, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
                    num_heads=2, num_experts=8, encoder_sparse_step=1, decoder_sparse_step=1)
    torch.manual_seed(0)
    model = transformers.SwitchTransformersForConditionalGeneration(config).eval()
    picked = {}

    def selector(router, inputs, output):
        ids = output[0].argmax(-1).reshape(-1, 1)
        picked[id(router)] = ids
        return ids, None

    cap = moecap.Capturer(num_layers=4, top_k=1, num_experts=8, host_slots=8, max_running_requests=1,
                          chunked_prefill_size=8)
    tokens = torch.randint(3, hf_serving.VOCAB, (1, 4))
    with hf.attach(model, cap, selector=selector) as handle, torch.no_grad():
        model(input_ids=tokens, decoder_input_ids=tokens)
    cap.commit(np.arange(4))
    want = torch.stack([picked[id(layer.router)].reshape(-1) for layer in handle.layers], 1).numpy()
    assert np.array_equal(cap.read(np.arange(4), strict=True)[:, :, 0], want)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "dbrx"])
def test_a_deepcopy_of_an_attached_model_writes_nothing_into_its_capturer(model_type):
    """copy.deepcopy copies an attached model's hooks (an RL reference model
    made from the policy): the copy's forward must not write its routing into
    the policy's rows, while attached or after detach. Qwen2-MoE's gated shared
    expert has router, gate and block hooks; DBRX's experts a pre-hook."""
    import copy
    model = hf_serving.build(config_or_skip(model_type))
    layers = len(hf.find_moe_layers(model))
    cap = moecap.Capturer(num_layers=layers, top_k=2, num_experts=8, host_slots=8, max_running_requests=1,
                          chunked_prefill_size=4, weight_dtype="f32", extra_columns=int(model_type == "qwen2_moe"))
    tokens = torch.randint(3, hf_serving.VOCAB, (1, 4))
    handle = hf.attach(model, cap)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        model(tokens)
        cap.commit(np.arange(4))
        want = cap.read(np.arange(4), strict=True)
        model(tokens)
        reference(torch.randint(3, hf_serving.VOCAB, (1, 5)))  # 5 rows: more than the capturer holds
        cap.commit(np.arange(4, 8))
        assert np.array_equal(cap.read(np.arange(4, 8), strict=True), want)
        handle.detach()
        reference(torch.randint(3, hf_serving.VOCAB, (1, 5)))


def test_capturer_shape_mismatch_is_refused():
    model = hf_serving.build(config_or_skip("qwen2_moe"))  # 3 decoder layers, 2 of them MoE
    cap = moecap.Capturer(num_layers=3, top_k=2, num_experts=8, host_slots=8, max_running_requests=1,
                          chunked_prefill_size=8)
    with pytest.raises(ValueError, match="num_layers=3; the model has 2"):
        hf.attach(model, cap)


def test_a_top_k_per_layer_is_one_top_k_where_the_layers_agree_and_refused_at_attach_where_not():
    """HunYuan's config may list moe_topk per layer. Where every layer has the same, it is the model's top_k,
    for attach and for the engine adapters' config reading; where they differ, attach refuses the model naming
    each layer's, rather than the first capture of a wider layer failing mid-forward."""
    for widths in ([2, 2, 2], [2, 3, 2]):
        config = copy.deepcopy(config_or_skip("hunyuan_v1_moe"))
        config.moe_topk = widths
        model = hf_serving.build(config)
        cap = moecap.Capturer(num_layers=3, top_k=2, num_experts=8, host_slots=8, max_running_requests=1,
                              chunked_prefill_size=8)
        raw = {"moe_topk": widths}  # as config.json holds it, with no num_experts_per_tok beside it
        if len(set(widths)) == 1:
            assert _model.config_int(raw, _model.TOP_K_KEYS, "experts per token") == 2
            handle = hf.attach(model, cap)
            with torch.no_grad():
                model(torch.randint(3, hf_serving.VOCAB, (1, 4)))
            cap.commit(np.arange(4))
            assert cap.read(np.arange(4), strict=True).shape == (4, 3, 2)
            handle.detach()
        else:
            with pytest.raises(ValueError, match=r"moe_topk differs between layers \(\[2, 3, 2\]\); moecap captures "
                               "one experts per token for every layer"):
                _model.config_int(raw, _model.TOP_K_KEYS, "experts per token")
            with pytest.raises(ValueError, match="MoE layers pick different numbers of experts per token "
                               r"\(layer 0: 2, layer 1: 3, layer 2: 2\)"):
                hf.attach(model, cap)
            # A selector of the caller's may hand every layer the capturer's width (here each layer's first
            # two picks): its choice, not refused.
            def first_two(router, inputs, output):
                ids, weights = hf.default_selector(router, inputs, output)
                return ids[:, :2], None if weights is None else weights[:, :2]
            handle = hf.attach(model, cap, selector=first_two)
            with torch.no_grad():
                model(torch.randint(3, hf_serving.VOCAB, (1, 4)))
            cap.commit(np.arange(4))
            assert cap.read(np.arange(4), strict=True).shape == (4, 3, 2)
            handle.detach()


def test_detach_removes_every_hook():
    model = hf_serving.build(config_or_skip("olmoe"))
    cap = moecap.Capturer(num_layers=3, top_k=2, num_experts=8, host_slots=8, max_running_requests=1,
                          chunked_prefill_size=8)
    handle = hf.attach(model, cap)
    handle.detach()
    with torch.no_grad():
        model(torch.randint(3, hf_serving.VOCAB, (1, 20)))  # 20 rows > 8 device rows: would fail if captured


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_layer_map_places_moe_layers_among_dense_ones(model_type):
    """attach finds each MoE layer's decoder layer (dense ones have no router),
    and a request read back carries it: all_layers() puts its routing at those
    layers and 0 at the dense ones, as SGLang and vLLM lay out their payloads."""
    model = hf_serving.build(config_or_skip(model_type))
    layers = hf.find_moe_layers(model)
    want = LAYER_MAPS[model_type]
    assert tuple(layer.model_layer for layer in layers) == want[0] and hf.layer_map(model) == want
    top_k, num_experts = hf._routing_dims(model, layers[0].router)
    cap = moecap.Capturer(num_layers=len(layers), top_k=top_k, num_experts=num_experts, host_slots=16,
                          max_running_requests=1, chunked_prefill_size=16)
    table = moecap.RequestTable(cap)  # made before attach: it reads the map at finish
    tokens = torch.randint(3, hf_serving.VOCAB, (1, 5))
    unrecorded = hf_serving.Unrecorded(model, layers)
    with hf.attach(model, cap) as handle, torch.no_grad():
        assert handle.layer_map == cap.layer_map == want
        # use_cache=False here and below: a training forward's (and Nemotron-H in transformers 5.25 cannot
        # start a cache without position_ids)
        out = model(tokens, output_router_logits=True, use_cache=False)
    unrecorded.close()
    table.start("r")
    table.append("r", np.arange(5))
    moecap.commit_batch(cap, np.arange(5))
    routed = table.finish("r")
    assert routed.layers == want[0] and routed.num_hidden_layers == want[1]
    full = routed.all_layers()
    assert full.shape == (5, 3, top_k)
    for layer, (want_ids, _) in zip(layers, hf_serving.references(layers, out, unrecorded)):
        assert np.array_equal(np.sort(full[:, layer.model_layer], -1), np.sort(want_ids.numpy(), -1))
    dense = sorted(set(range(3)) - set(want[0]))
    assert (full[:, dense] == 0).all()


def test_a_wrapped_model_keeps_its_layer_map():
    """A value-head wrapper (TRL's shape) or nn.DataParallel has no config of
    its own: the layer count is the wrapped model's, so dense layers stay
    where they are (here layer 0) rather than every layer taken for MoE."""
    model = hf_serving.build(config_or_skip("deepseek_v3"))

    class WithValueHead(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.pretrained_model, self.v_head = lm, torch.nn.Linear(8, 1)

    for wrapped in (WithValueHead(model), torch.nn.DataParallel(model)):
        assert hf.layer_map(wrapped) == LAYER_MAPS["deepseek_v3"]


def test_looped_moe_layers_are_refused():
    """Inkling 2-Loop runs its looped layers several times per forward, each
    pass routing anew: one row per token and layer cannot hold them."""
    model = hf_serving.build(config_or_skip("inkling2_loop_text"))
    config = model.config  # the loop set after the build, which looks at the routers
    config.loop_layer_index_start, config.loop_layer_index_end, config.loop_num_passes = 0, 3, 2
    cap = moecap.Capturer(num_layers=3, top_k=2, num_experts=8, host_slots=16, max_running_requests=1)
    with pytest.raises(ValueError, match=r"runs decoder layers \[0, 3\) loop_num_passes = 2 times per forward"):
        hf.attach(model, cap)
    with pytest.raises(ValueError, match="loop_num_passes = 2"), hf.replay(model, [torch.zeros(1, 2).long()] * 3):
        pass
    config.loop_num_passes = 1  # a loop run once is a plain stack of layers
    hf.attach(model, cap).detach()


def test_layer_map_is_none_where_routers_sit_outside_decoder_layers():
    """Routers passed by hand that no decoder ModuleList holds: attach still
    captures, and says it cannot place them (RequestTable keeps the default map)."""
    model = hf_serving.build(config_or_skip("olmoe"))
    routers = [layer.router for layer in hf.find_moe_layers(model)]
    model.config.num_hidden_layers = 5  # no ModuleList of 5 decoder layers holds the routers now
    assert all(layer.model_layer is None for layer in hf.find_moe_layers(model, routers))
    assert hf.layer_map(model, hf.find_moe_layers(model, routers)) is None


def test_router_output_order_is_found_not_assumed():
    """transformers 5.19's GraniteMoE router returns (indices, weights, logits),
    the others (logits, weights, indices): the selector takes each by its kind."""
    ids, weights, logits = torch.tensor([[3, 1]]), torch.tensor([[0.7, 0.3]]), torch.randn(1, 8)
    for output in ((logits, weights, ids), (ids, weights, logits)):
        got_ids, got_weights = hf.default_selector(None, None, output)
        assert got_ids is ids and got_weights is weights
    with pytest.raises(hf.UnknownArchitecture, match="not \\(logits, weights, indices\\); pass selector="):
        hf.default_selector(None, None, (logits, weights, weights))
    # Switch Transformers' (one-hot mask [b, s, E], max probability [b, s, 1], logits [b, s, E]) is refused,
    # not read as indices (the mask) and weights (the logits)
    mask = torch.nn.functional.one_hot(torch.tensor([[3, 1]]), 8)
    with pytest.raises(hf.UnknownArchitecture, match="pass selector="):
        hf.default_selector(None, None, (mask, torch.rand(1, 2, 1), torch.randn(1, 2, 8)))
    # top_k == num_experts: every column, weights in the middle in either order
    ids, weights, logits = torch.tensor([[1, 0]]), torch.tensor([[0.6, 0.4]]), torch.randn(1, 2)
    for output in ((logits, weights, ids), (ids, weights, logits)):
        assert hf.default_selector(None, None, output)[0] is ids


def test_moe_layers_are_found_in_a_model_whose_shared_expert_has_no_gate_and_in_a_multimodal_wrapper():
    """Llama 4 keeps a shared_expert with no gate (finding its layers raised
    AttributeError); Glm4vMoe records router_logits on its language model, two
    modules down (no router class was found)."""
    llama4 = getattr(transformers, "Llama4TextConfig", None)
    if llama4 is None:
        pytest.skip(f"transformers {transformers.__version__} has no Llama4TextConfig")
    config = llama4(vocab_size=hf_serving.VOCAB, hidden_size=32, intermediate_size=32, intermediate_size_mlp=32,
                    num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    layers = hf.find_moe_layers(model)
    assert [layer.model_layer for layer in layers] == [1]
    assert layers[0].shared is not None and layers[0].shared_gate is None

    glm4v = getattr(transformers, "Glm4vMoeConfig", None)
    if glm4v is None:
        pytest.skip(f"transformers {transformers.__version__} has no Glm4vMoeConfig")
    text = dict(vocab_size=hf_serving.VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, n_routed_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, n_group=2, topk_group=1,
                first_k_dense_replace=1, max_position_embeddings=128, pad_token_id=0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                  spatial_merge_size=1, temporal_patch_size=1)
    model = transformers.Glm4vMoeForConditionalGeneration(glm4v(text_config=text, vision_config=vision))
    assert [layer.model_layer for layer in hf.find_moe_layers(model)] == [1, 2]


def random_routing(model, tokens):
    """The model's MoE layers, and for each `tokens` rows of top_k distinct
    random experts: routing for replay to force."""
    layers = hf.find_moe_layers(model)
    top_k, num_experts = hf._routing_dims(model, layers[0].router)
    return layers, [torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)]) for _ in layers]


def replay_own_routing(model, tokens, context=contextlib.nullcontext):
    """Each router's (ids, weights) in a free forward, and in one replaying
    those ids with weights=None; forwards inside context()."""
    layers = hf.find_moe_layers(model)
    seen = {}

    def keep(layer, ids, weights):
        seen[layer.index] = (ids.reshape(-1, ids.shape[-1]).clone(), weights.reshape(-1, ids.shape[-1]).clone())

    def remember(layer):
        if hf._picked_by_block(layer):  # the experts the block picked, as its experts module receives them
            return layer.block.experts.register_forward_pre_hook(lambda module, args: keep(layer, *args[1:3]))
        return layer.router.register_forward_hook(
            lambda module, inputs, output: keep(layer, *hf.default_selector(module, inputs, output)))

    def forward(replay):
        with torch.no_grad(), context(), replay:
            hooks = [remember(layer) for layer in layers]
            model(tokens, use_cache=False)
            for h in hooks:
                h.remove()
        return dict(seen)

    free = forward(contextlib.nullcontext())
    return free, forward(hf.replay(model, [free[layer.index][0] for layer in layers]))


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_replay_of_the_models_own_routing_recomputes_its_own_weights(model_type):
    """replay(weights=None) recomputes each router's weights for the forced
    experts from its logits, as router replay trains through: forced to the
    experts it picked itself, every router gives back the weights it gave."""
    model = hf_serving.build(config_or_skip(model_type))
    tokens = torch.randint(3, hf_serving.VOCAB, (2, 5))
    if model_type == "phimoe":  # sparsemixer's weights depend on the order it picked in: not recomputed
        with pytest.raises(hf.UnknownArchitecture, match="pass weights="):
            replay_own_routing(model, tokens)
        return
    free, own = replay_own_routing(model, tokens)
    for index, (ids, weights) in free.items():
        assert torch.equal(own[index][0], ids)
        torch.testing.assert_close(own[index][1].float(), weights.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type, precision, settings", [
    ("ergo", "bf16", {}), ("qwen3_moe", "bf16", {}), ("jamba", "bf16", {}), ("dbrx", "bf16", {}),
    ("zaya", "bf16", {}), ("inkling_text", "bf16", {}), ("flint", "bf16", {}),
    ("cohere2_moe", "bf16", {"expert_selection_fn": "sigmoid", "norm_topk_prob": True}),
    ("cohere2_moe", "bf16", {"expert_selection_fn": "softmax"}),
    ("inkling_text", "autocast", {}), ("qwen3_moe", "autocast", {}), ("longcat_flash", "autocast", {}),
    ("hy_v3", "autocast", {}), ("kolibri1", "autocast", {}), ("lara_mini", "autocast", {}),
    ("muse_spark", "autocast", {})])
def test_replay_recomputes_weights_as_the_router_rounds_them(model_type, precision, settings):
    """Ergo's router rounds its float32 weights through its bf16 input, as
    Jamba's does (its block's, in 5.19), DBRX's block and Zaya's router weigh
    in the logits' bf16, as LongCat's does under CPU autocast, which keeps its
    softmax in bf16, and Cohere2-MoE's sigmoid rule in a bf16 model; Flint's
    float32 sigmoid of all its logits rounds by position; Inkling's
    weighs in its logits' dtype (transformers 5.25 turns autocast off for them),
    as HY-V3's, Kolibri 1's, Lara-Mini's and Muse Spark's do, whose float32
    linear autocast runs in bf16:
    replayed, the recomputed weights are rounded as the router rounds them,
    bit for bit."""
    config = config_or_skip(model_type)
    for key, value in settings.items():
        setattr(config, key, value)
    torch.manual_seed(0)  # a rounding difference shows for some inputs only: the same ones every run
    tokens = torch.randint(3, hf_serving.VOCAB, (2, 5))
    if precision == "bf16":
        free, own = replay_own_routing(hf_serving.build(config, dtype=torch.bfloat16), tokens)
    else:
        free, own = replay_own_routing(hf_serving.build(config), tokens,
                                       lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    for index, (ids, weights) in free.items():
        assert torch.equal(own[index][0], ids)
        assert own[index][1].dtype == weights.dtype
        assert torch.equal(own[index][1], weights)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "dbrx", "longcat_flash", "zaya"])
def test_replay_under_gradient_checkpointing_trains_as_without_it(model_type):
    """A model trained with gradient checkpointing recomputes each layer in
    the backward: with the backward inside replay's block, the recomputation
    routes to the recorded experts too, and the gradients equal those of the
    same replayed step without checkpointing."""
    model = hf_serving.build(config_or_skip(model_type)).train()
    layers, forced = random_routing(model, 5)
    tokens = torch.randint(3, hf_serving.VOCAB, (1, 5))
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
        model.zero_grad()
        with hf.replay(model, forced):
            model(tokens, use_cache=False).logits.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("experts" in n for n in grads[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


@pytest.mark.parametrize("model_type", ["mixtral", "llama4_text", "dbrx", "longcat_flash", "zaya"])
def test_replay_refuses_ids_outside_the_experts_naming_the_layer(model_type):
    """An id past the experts would index them out of bounds (or silently
    mix memory in a grouped kernel); -1 is a token without routing."""
    model = hf_serving.build(config_or_skip(model_type))
    layers = hf.find_moe_layers(model)
    top_k, num_experts = hf._routing_dims(model, layers[0].router)
    tokens = torch.randint(3, hf_serving.VOCAB, (1, 3))
    for bad in (num_experts, -1):
        ids = [torch.arange(top_k).repeat(3, 1) for _ in layers]
        ids[-1][2, top_k - 1] = bad
        weights = [torch.full((3, top_k), 1.0 / top_k) for _ in layers]
        for w in (None, weights):
            with pytest.raises(ValueError, match=rf"layer {len(layers) - 1}: recorded ids\[2, {top_k - 1}\] is "
                                                 rf"{bad}; expected \[0, {num_experts}\)"):
                with torch.no_grad(), hf.replay(model, ids, w):
                    model(tokens, use_cache=False)
    # Checked when the block is entered: a compiled forward never runs unchecked ids, and an int64 id is
    # compared as given, not after a cast to the router's dtype (2**32 + 1 would be 1 in int32).
    ids = [torch.arange(top_k).repeat(3, 1) for _ in layers]
    ids[0][0, 0] = 2**32 + 1
    with pytest.raises(ValueError, match=rf"layer 0: recorded ids\[0, 0\] is {2**32 + 1}"):
        with hf.replay(model, ids):
            pass


@pytest.mark.parametrize("model_type", ["deepseek_v3", "dbrx", "llama4_text"])
def test_replay_refuses_weights_and_ids_a_cast_or_reshape_would_take(model_type):
    """Weights laid over every decoder layer, transposed weights of the same
    size, and float ids (the weights passed as ids) would each route or weigh
    silently wrong after a reshape or cast: each is refused naming the layer."""
    model = hf_serving.build(config_or_skip(model_type))
    layers = hf.find_moe_layers(model)
    top_k, num_experts = hf._routing_dims(model, layers[0].router)
    n = top_k + 1  # tokens: transposed weights never have the right shape
    tokens = torch.randint(3, hf_serving.VOCAB, (1, n))
    ids = [torch.arange(top_k).repeat(n, 1) for _ in layers]
    weights = [torch.full((n, top_k), 1.0 / top_k) for _ in layers]

    def forward(i, w):
        with torch.no_grad(), hf.replay(model, i, w):
            return model(tokens, use_cache=False).logits

    reference = forward(ids, weights)
    with pytest.raises(ValueError, match=rf"weights has {len(layers) + 1} layers; the model has {len(layers)} MoE"):
        forward(ids, [torch.zeros(n, top_k)] + weights)
    with pytest.raises(ValueError, match=rf"layer 0: recorded weights \({top_k}, {n}\), the forward routes "
                                         rf"\({n}, {top_k}\)"):
        forward(ids, [w.t().contiguous() for w in weights])
    with pytest.raises(ValueError, match="layer 0: recorded weights are torch.int64; expected a floating tensor"):
        forward(ids, [torch.ones(n, top_k, dtype=torch.long) for _ in layers])
    with pytest.raises(ValueError, match="layer 0: recorded ids are torch.float32; expected an integer tensor"):
        forward([w.float() for w in ids], None)
    torch.testing.assert_close(forward(ids, weights), reference, rtol=0, atol=0)  # nothing stayed behind


def calls_under_replay(model, modules, forced, weights=None):
    """Each of `modules`' (inputs, output), in call order, in one forward of
    four tokens replaying `forced` (and `weights`)."""
    seen = []
    hooks = [m.register_forward_hook(lambda module, inputs, output: seen.append((inputs, output))) for m in modules]
    try:
        with torch.no_grad(), hf.replay(model, forced, weights):
            model(torch.randint(3, hf_serving.VOCAB, (1, 4)), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_longcat_zero_experts_are_captured_and_replayed_as_the_ids_its_router_picks():
    """LongCat-Flash's router picks among its routed experts and, after them,
    its zero (identity) experts, ids n_routed_experts and up, as SGLang's own
    capturer records them: served, those ids come back as picked, not as "no
    expert"; replay forces them, each adding its token's input times its weight."""
    config = config_or_skip("longcat_flash")
    assert (_model.num_experts(config), _model.decoder_layers(config), config.num_hidden_layers) == (12, 3, 6)
    ranks = hf_serving.serve(config, 1, [requests(np.random.default_rng(5), 0, count=3, waves=1)],
                             [lambda step: True], chunk=3)
    assert check(ranks) > 0
    ids = np.concatenate([req.routed.ids for req in ranks[0].finished])
    assert (ids >= 8).any() and (ids < 8).any() and ids.max() < 12
    model = hf_serving.build(config)
    layers = hf.find_moe_layers(model)
    forced = [torch.tensor([[8, 11], [9, 10], [11, 8], [10, 10]]) for _ in layers]
    weights = [torch.rand(4, 2) for _ in layers]
    seen = calls_under_replay(model, [layer.block for layer in layers], forced, weights)
    assert len(seen) == len(layers)
    for ((x,), out), w in zip(seen, weights):
        torch.testing.assert_close(out.reshape(4, -1), x.reshape(4, -1) * w.sum(dim=-1, keepdim=True))


@pytest.mark.parametrize("attached_first", [False, True])
@pytest.mark.parametrize("model_type", ["mixtral", "zaya", "longcat_flash", "dbrx", "llama4_text"])
def test_a_capture_inside_replay_records_the_forced_experts(model_type, attached_first):
    """A replayed forward, captured, records the forced ids whatever the
    router itself would pick, whether the capturer was attached before replay
    began (at load, as a trainer keeps it) or inside it; DBRX's experts
    module, not its router, receives what replay forces; Llama 4's router
    keeps its own logits and returns the forced scores. Zaya's forced skip (id 8) as the skip and its
    forced expert 0 as expert 0, LongCat's zero experts as themselves."""
    model = hf_serving.build(config_or_skip(model_type))
    layers = hf.find_moe_layers(model)
    top_k, num_experts = hf._routing_dims(model, layers[0].router)
    rows = 6
    generator = torch.Generator().manual_seed(3)
    forced = [torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(rows)])
              for _ in layers]
    for ids in forced:  # the last expert (Zaya's skip) and expert 0 in every layer
        ids[0, 0], ids[1, 0] = num_experts - 1, 0
        ids[0, 1:], ids[1, 1:] = torch.arange(1, top_k), torch.arange(1, top_k)
    cap = moecap.Capturer(num_layers=len(layers), top_k=top_k, num_experts=num_experts, host_slots=16,
                          max_running_requests=1, chunked_prefill_size=16)
    first, then = (lambda: hf.attach(model, cap)), (lambda: hf.replay(model, forced))  # attach hooks at its call
    if not attached_first:
        first, then = then, first
    with torch.no_grad(), first(), then():
        model(torch.randint(3, hf_serving.VOCAB, (1, rows)), use_cache=False)
    cap.commit(np.arange(rows))
    assert np.array_equal(cap.read(np.arange(rows), strict=True), torch.stack(forced, 1).numpy())


def test_zaya_skip_expert_is_captured_as_its_own_id_and_replayed_as_its_router_hands_it_on():
    """Zaya's router hands a pick of its skip expert (id num_experts, no
    compute) on as expert 0 with weight 0: served, the skip is recorded as id
    8 with weight 0, never as expert 0; replayed, a forced skip reaches the
    experts as expert 0 with weight 0, so the token's MoE output is zero."""
    config = config_or_skip("zaya")
    assert _model.num_experts(config) == 9
    ranks = hf_serving.serve(config, 1, [requests(np.random.default_rng(5), 0, count=3, waves=1)],
                             [lambda step: True], chunk=3)
    assert check(ranks) > 0
    routed = [req.routed for req in ranks[0].finished]
    ids = np.concatenate([r.ids for r in routed])
    weights = np.concatenate([r.weights for r in routed])
    assert (ids == 8).any() and (ids < 8).any() and ids.max() == 8
    assert (weights[ids == 8] == 0).all() and (weights[ids < 8] > 0).all()
    model = hf_serving.build(config)
    layers = hf.find_moe_layers(model)
    forced = [torch.tensor([[8], [3], [8], [0]]) for _ in layers]
    seen = calls_under_replay(model, [layer.block.experts for layer in layers], forced)
    assert len(seen) == len(layers)
    for (_, experts_ids, experts_weights), out in seen:
        assert experts_ids.reshape(-1).tolist() == [0, 3, 0, 0]
        assert (experts_weights.reshape(-1)[[0, 2]] == 0).all() and (experts_weights.reshape(-1)[[1, 3]] > 0).all()
        assert (out.reshape(4, -1)[[0, 2]] == 0).all() and (out.reshape(4, -1)[[1, 3]] != 0).any()


@pytest.mark.parametrize("model_type, norm", [("dbrx", 1.0), ("dbrx", 2.0), ("dbrx", None), ("jamba", None)])
def test_replay_forces_the_experts_a_block_picks_and_weighs_them_by_its_rule(model_type, norm):
    """DBRX's block (and Jamba's in transformers 5.19) picks from its
    router's bare logits: replay hands its experts the recorded ids, and with
    weights=None the weights the block's rule gives those ids from this
    forward's logits (DBRX's divided by their p-norm, or not); given weights
    go to the experts as they are. Experts called without their router are
    refused, naming the layer."""
    model = hf_serving.build(config_or_skip(model_type))
    layers, forced = random_routing(model, 4)
    for layer in layers:
        if model_type == "dbrx":
            layer.block.moe_normalize_expert_weights = norm
    tokens = torch.randint(3, hf_serving.VOCAB, (1, 4))
    given = [torch.rand(f.shape) for f in forced]
    seen, logits = {}, {}

    def watch():  # after replay's hooks, so that the experts' inputs are seen as replay leaves them
        return [hook for layer in layers for hook in (
            layer.block.experts.register_forward_pre_hook(
                lambda module, args, index=layer.index: seen.__setitem__(index, (args[1].clone(), args[2].clone()))),
            layer.router.register_forward_hook(
                lambda module, inputs, output, index=layer.index: logits.__setitem__(
                    index, output if torch.is_tensor(output) else output[0])))]

    with torch.no_grad():
        free = model(tokens, use_cache=False).logits
        for weights in (None, given):
            with hf.replay(model, forced, weights):
                hooks = watch()
                replayed = model(tokens, use_cache=False).logits
                for hook in hooks:
                    hook.remove()
            assert not torch.allclose(replayed, free)
            for layer in layers:
                ids, w = seen[layer.index]
                assert torch.equal(ids, forced[layer.index])
                if weights is None:  # the block's rule for the forced ids
                    own = torch.softmax(logits[layer.index], dim=-1, dtype=torch.float).gather(1, ids)
                    if norm is not None:
                        own = own / torch.norm(own, p=norm, dim=-1, keepdim=True)
                    torch.testing.assert_close(w.float(), own, rtol=1e-5, atol=1e-6)
                else:
                    torch.testing.assert_close(w.float(), given[layer.index])
        if hf._picked_by_block(layers[0]):  # Jamba 5.25's router picks: nothing is forced at its experts
            with hf.replay(model, forced), pytest.raises(hf.UnknownArchitecture, match="layer 0: .*no logits"):
                layers[0].block.experts(torch.zeros(4, 32), forced[0], given[0])


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_the_engine_adapters_read_the_models_layers_and_experts_from_its_config(model_type):
    """The SGLang and vLLM adapters see a config, not the model: its rules
    must give the MoE layers, expert count and top-k that attach finds."""
    from moecap.integrations import _model
    config = config_or_skip(model_type)
    text = getattr(config, "text_config", None) or config
    model = hf_serving.build(config)
    layers = hf.find_moe_layers(model)
    assert _model.moe_layers_from_config(text) == LAYER_MAPS[model_type][0] == hf.layer_map(model).layers
    top_k, num_experts = hf._routing_dims(model, layers[0].router)
    assert _model.num_experts(text) == num_experts
    assert _model.config_int(text, _model.TOP_K_KEYS, "experts per token") == top_k


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "deepseek_v3", "llama4_text", "jamba", "zaya",
                                        "longcat_flash"])
def test_an_attached_model_compiles_without_graph_breaks_and_captures_what_eager_does(model_type):
    """Under torch.compile(fullgraph=True) the hooks capture through the
    capturer's custom ops (Dynamo cannot trace the extension's call), the
    shared column and its gate included, the pre-hooks on Jamba's experts
    (its block picks in transformers 5.19), Zaya's skip picks and LongCat's
    zero experts."""
    model = hf_serving.build(config_or_skip(model_type))
    if model_type == "longcat_flash" and hasattr(model.model.layers[0].mlp.experts, "total_experts"):
        pytest.skip("transformers 5.19's LongCat experts loop calls .item(): the model cannot compile fullgraph")
    layers = hf.find_moe_layers(model)
    top_k, num_experts = hf._routing_dims(model, layers[0].router)
    cap = moecap.Capturer(num_layers=len(layers), top_k=top_k, num_experts=num_experts, host_slots=16,
                          max_running_requests=1, chunked_prefill_size=16, weight_dtype="f32", extra_columns=1)
    tokens = torch.randint(3, hf_serving.VOCAB, (1, 6))
    eager, compiled = np.arange(6), np.arange(6, 12)
    with hf.attach(model, cap), torch.no_grad():
        model(tokens)
        cap.commit(eager)
        torch.compile(model, fullgraph=True, backend="eager")(tokens)
        cap.commit(compiled)
    shape = (6, len(layers), top_k)
    want = cap.read(eager, weights_out=np.zeros(shape, np.float32), strict=True)
    got = cap.read(compiled, weights_out=np.zeros(shape, np.float32), strict=True)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    skip = num_experts - 1 if model_type == "zaya" else -1  # Zaya's skip expert weighs 0 (LongCat's zero ones do not)
    assert (want[1][want[0] != skip] > 0).all()


def test_hooks_capturing_on_a_stream_of_their_own_break_a_compiled_graph_and_capture_what_eager_does():
    """attach(stream=...) keeps the extension's call, which Dynamo cannot trace:
    the hooks call it across a graph break (Dynamo called it without its self)."""
    model = hf_serving.build(config_or_skip("mixtral"))
    cap = generation_capturer(model)
    tokens = torch.randint(3, hf_serving.VOCAB, (1, 6))
    try:
        with hf.attach(model, cap, stream=0), torch.no_grad():
            model(tokens)
            cap.commit(np.arange(6))
            torch.compile(model, backend="eager")(tokens)
            cap.commit(np.arange(6, 12))
    finally:
        torch._dynamo.reset()  # each graph break compiled Mixtral's code for this model: later tests compile it too
    assert np.array_equal(cap.read(np.arange(6, 12), strict=True), cap.read(np.arange(6), strict=True))


def test_a_detached_capturer_is_freed_without_the_garbage_collector():
    """Neither attach's own custom ops nor a compiled forward through them
    leave the capturer holding itself."""
    import gc
    import weakref
    torch._dynamo.reset()  # fullgraph: Mixtral's code compiled by earlier tests must not reach the recompile limit
    model = hf_serving.build(config_or_skip("mixtral"))
    cap = moecap.Capturer(num_layers=3, top_k=2, num_experts=8, host_slots=16, max_running_requests=1,
                          chunked_prefill_size=16)
    alive = weakref.ref(cap)
    handle = hf.attach(model, cap)
    with torch.no_grad():
        torch.compile(model, fullgraph=True, backend="eager")(torch.randint(3, hf_serving.VOCAB, (1, 4)))
    handle.detach()
    del handle
    torch._dynamo.reset()  # the compiled code's guards hold the hooks
    gc.collect()
    gc.disable()
    try:
        del cap
        assert alive() is None
    finally:
        gc.enable()


def test_a_recorder_that_names_its_layer_finds_only_those_modules():
    """Jamba records router_logits from any nn.Linear named "router": the
    layers are those, not every linear layer of the model, and the engine
    adapters read the same layers from its config (expert_layer_period and
    _offset). attach captures those layers only, at their model layers."""
    jamba = getattr(transformers, "JambaConfig", None)
    if jamba is None:
        pytest.skip("no Jamba in this transformers")
    config = jamba(vocab_size=hf_serving.VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
                   num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                   expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=0,
                   mamba_d_state=4, mamba_expand=1, use_mamba_kernels=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    layers = hf.find_moe_layers(model)
    assert [(layer.name, layer.model_layer) for layer in layers] == [
        ("model.layers.1.feed_forward.router", 1), ("model.layers.3.feed_forward.router", 3)]
    assert _model.moe_layers_from_config(config) == (1, 3)
    cap = moecap.Capturer(num_layers=2, top_k=2, num_experts=4, host_slots=16, max_running_requests=1,
                          chunked_prefill_size=16)
    picked = {}
    for layer in layers:
        layer.block.experts.register_forward_pre_hook(
            lambda module, args, index=layer.index: picked.__setitem__(index, args[1].clone()))
    with hf.attach(model, cap) as handle, torch.no_grad():
        model(torch.randint(3, hf_serving.VOCAB, (1, 4)), use_cache=False)
    assert handle.layer_map.layers == (1, 3)
    cap.commit(np.arange(4))
    assert np.array_equal(cap.read(np.arange(4), strict=True), torch.stack([picked[0], picked[1]], 1).numpy())


def test_only_inklings_and_zayas_four_tuples_are_read_as_routing():
    """Inkling's router returns (routed logits [n, E], weights [n, k], ids
    [n, k], shared gammas [n, n_shared]), Zaya's (logits [n, E + 1] with its
    skip expert, weights, ids with a skip handed on as expert 0 with weight
    0, router states [b, s, h]): each read by its class and its form, Zaya's
    skips as id E. Any other 4-tuple is refused, not
    read as routing: either form from the other's router or from an unknown
    one, Inkling's with a wrong logits width, gammas or order."""
    class InklingTopkRouter:
        num_experts, n_shared_experts, top_k = 8, 1, 2

    class ZayaRouter:
        num_experts, num_router_classes, top_k = 8, 9, 2

    ids, weights, gammas = torch.tensor([[3, 1], [0, 7]]), torch.rand(2, 2), torch.rand(2, 1)
    got_ids, got_weights = hf.default_selector(InklingTopkRouter(), None, (torch.randn(2, 8), weights, ids, gammas))
    assert got_ids is ids and got_weights is weights
    # Row 0 picks the skip expert and expert 1, handed on as expert 0 with weight 0 and expert 1; row 1 picks
    # experts 0 and 7, expert 0 with its weight.
    zaya_weights = torch.tensor([[0.0, 0.3], [0.5, 0.2]])
    zaya = (torch.randn(2, 9), zaya_weights, torch.tensor([[0, 1], [0, 7]]), torch.randn(1, 2, 4))
    got_ids, got_weights = hf.default_selector(ZayaRouter(), None, zaya)
    assert got_ids.tolist() == [[8, 1], [0, 7]] and got_weights is zaya_weights
    for router, output in ((InklingTopkRouter(), zaya), (None, zaya),
                           (ZayaRouter(), (torch.randn(2, 8), weights, ids, gammas)),
                           (None, (torch.randn(2, 8), weights, ids, gammas)),
                           # Inkling's form but for its logits [n, E + 1], or gammas for 2 shared experts, or ids last
                           (InklingTopkRouter(), (torch.randn(2, 9), weights, ids, gammas)),
                           (InklingTopkRouter(), (torch.randn(2, 8), weights, ids, torch.rand(2, 2))),
                           (InklingTopkRouter(), (torch.randn(2, 8), weights, gammas, ids))):
        with pytest.raises(hf.UnknownArchitecture, match="pass selector="):
            hf.default_selector(router, None, output)


def test_inkling_replay_recomputes_weights_and_gammas_for_forced_experts():
    """Forced to experts other than its own, Inkling's router gives back a
    4-tuple: its logits, the forced ids, and the weights and shared gammas its
    rule gives them (normalized together, so both change); with weights given,
    its gammas as it gave them."""
    model = hf_serving.build(config_or_skip("inkling_text"))
    layers = hf.find_moe_layers(model)
    tokens = torch.randint(3, hf_serving.VOCAB, (2, 5))
    seen = {}

    def remember(layer):
        def hook(module, inputs, output):
            assert isinstance(output, tuple) and len(output) == 4
            seen[layer.index] = (tuple(o.clone() for o in output), inputs)
        return hook

    def run(*replayed):
        with torch.no_grad(), (hf.replay(model, *replayed) if replayed else contextlib.nullcontext()):
            hooks = [layer.router.register_forward_hook(remember(layer)) for layer in layers]
            model(tokens, use_cache=False)
            for h in hooks:
                h.remove()
        return dict(seen)

    free = run()
    own = run([free[layer.index][0][2].reshape(-1, 2) for layer in layers])
    for layer in layers:  # forced to its own experts, the router gives back its own 4-tuple
        for got, want in zip(own[layer.index][0], free[layer.index][0]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # other experts: each token's picks shifted by one (still distinct)
    forced = [(free[layer.index][0][2].reshape(-1, 2) + 1) % 8 for layer in layers]
    replayed = run(forced)
    for layer in layers:
        (logits, w, ids, gammas), inputs = replayed[layer.index]
        assert torch.equal(ids, forced[layer.index])
        shared = inputs[0].reshape(-1, layer.router.hidden_dim).float() @ layer.router.weight[8:].float().T
        picked = torch.cat([logits.float().gather(1, ids), shared], dim=-1).sigmoid()
        want = picked / picked.sum(dim=-1, keepdim=True) * layer.router.route_scale
        torch.testing.assert_close(w.float(), want[:, :2])
        torch.testing.assert_close(gammas.float(), want[:, 2:])
        assert not torch.allclose(gammas, free[layer.index][0][3])  # the forced picks change the shared weight too
    given = [torch.full((10, 2), 0.5) for _ in layers]
    replayed = run(forced, given)
    for layer in layers:
        _, w, ids, gammas = replayed[layer.index][0]
        assert torch.equal(ids, forced[layer.index]) and (w == 0.5).all()
        # the gammas the router gave for its own picks on this input
        logits, inputs = replayed[layer.index][0][0], replayed[layer.index][1]
        torch.testing.assert_close(gammas, hf_serving.inkling(layer.router, logits, inputs)[2])


def test_inkling_with_several_shared_experts_refuses_the_shared_column():
    """Inkling's shared experts are weighed per token each by its own gamma:
    one shared column cannot carry them, and attach says so (without the
    column it captures the routed experts)."""
    config = config_or_skip("inkling_text")
    config.n_shared_experts = 2
    model = hf_serving.build(config)
    assert hf.find_moe_layers(model)[0].router.n_shared_experts == 2
    cap = moecap.Capturer(num_layers=2, top_k=2, num_experts=8, host_slots=8, max_running_requests=1,
                          chunked_prefill_size=8, weight_dtype="f32", extra_columns=1)
    for shared_expert in (None, True):  # the default asks for the column too, the capturer having one
        with pytest.raises(ValueError, match="2 shared experts, each weighed per token by its own gamma"):
            hf.attach(model, cap, shared_expert=shared_expert)
    with hf.attach(model, cap, shared_expert=False), torch.no_grad():
        model(torch.randint(3, hf_serving.VOCAB, (1, 4)))
    cap.commit(np.arange(4))
    assert (cap.read(np.arange(4), strict=True) >= 0).all()


def generation_capturer(model, host_slots=256):
    layers = hf.find_moe_layers(model)
    top_k, num_experts = hf._routing_dims(model, layers[0].router)
    return moecap.Capturer(num_layers=len(layers), top_k=top_k, num_experts=num_experts, host_slots=host_slots,
                           max_running_requests=8, chunked_prefill_size=64)


@pytest.mark.parametrize("cache", ["dynamic", "static", "none"])
@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_generate_records_every_forward_of_a_left_padded_batch(model_type, cache):
    """Each row's routing equals one forward of its real tokens without the
    cache: every forward committed before the next one captured, padding left out."""
    model = hf_serving.build(config_or_skip(model_type))
    cap = generation_capturer(model)
    handle = hf.attach(model, cap)
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    options = {"use_cache": False} if cache == "none" else {"cache_implementation": "static"} if cache == "static" else {}
    with hf.GenerationRecorder(model, cap, mask) as recorder:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                             logits_processor=[recorder], **options)
    routed = [recorder.routed(0), recorder.routed(1, num_tokens=5)]  # row 1 as if it ended at its 5th token
    handle.detach()
    for row, got in enumerate(routed):
        sequence = out[row, 2 if row == 0 else 0:][:got.shape[0]]
        truth = generation_capturer(model)
        with hf.attach(model, truth), torch.no_grad():
            model(sequence[None], use_cache=False)
        truth.commit(np.arange(len(sequence)))
        assert got.shape[0] == (6 if row == 0 else 4) and got.valid.all() and got.start == 0
        assert np.array_equal(got.ids, truth.read(np.arange(len(sequence)))), f"row {row} with cache {cache}"
    assert (cap.slot_states(np.arange(cap.config.host_slots)) == moecap.SLOT_EMPTY).all()  # routed() frees them


def test_generate_refuses_what_the_recorder_cannot_map_to_one_sequence_per_row():
    model = hf_serving.build(config_or_skip("mixtral"))
    cap = generation_capturer(model)
    ids, mask = torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long)
    with hf.attach(model, cap):
        for options, error in (({"num_beams": 2}, "1 prompt rows; it records one sequence per row"),
                               ({"do_sample": True, "num_return_sequences": 2}, "2 sequences for 1 prompt rows")):
            with hf.GenerationRecorder(model, cap, mask) as recorder, pytest.raises(ValueError, match=error):
                model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0,
                               logits_processor=[recorder], **options)
    dp2 = moecap.Capturer(generation_capturer(model).config, dp_size=2)
    with pytest.raises(ValueError, match="the capturer has dp_size 2; it commits a generate\\(\\) batch of one"):
        hf.GenerationRecorder(model, dp2, mask)
    small = generation_capturer(model, host_slots=4)
    with hf.attach(model, small), hf.GenerationRecorder(model, small, mask) as recorder:
        with pytest.raises(moecap.MoecapError, match="needs host_slots >= 5; host_slots is 4"):
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                           logits_processor=[recorder])
    padded = torch.tensor([[0, 0, 1, 2, 3]])
    with hf.attach(model, cap):
        for wrong in (mask, torch.ones(1, 7, dtype=torch.long)):  # the mask of the prompt before padding, a wider one
            with hf.GenerationRecorder(model, cap, wrong) as recorder, pytest.raises(
                    ValueError, match=f"attention_mask has {wrong.shape[1]} positions; generate's input_ids have 5"):
                model.generate(padded, attention_mask=torch.tensor([[0, 0, 1, 1, 1]]), max_new_tokens=2,
                               do_sample=False, pad_token_id=0, logits_processor=[recorder])
    switch = transformers.SwitchTransformersForConditionalGeneration(transformers.SwitchTransformersConfig(
        vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, num_experts=2))
    with pytest.raises(ValueError, match="SwitchTransformersForConditionalGeneration is an encoder-decoder model"):
        hf.GenerationRecorder(switch, cap, mask)


def test_continuous_batching_is_named_by_the_recorder_it_bypasses():
    """generate_batch packs every request into one row and calls no logits
    processor: the recorder says so instead of "not called" or "4 forwards"."""
    model = hf_serving.build(config_or_skip("mixtral"))
    cap = generation_capturer(model)
    config = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=0, eos_token_id=1)
    with hf.attach(model, cap), warnings.catch_warnings():
        warnings.simplefilter("ignore", hf.UncommittedCaptureWarning)  # its captures do overwrite each other
        with hf.GenerationRecorder(model, cap, torch.ones(2, 3, dtype=torch.long)) as recorder:
            model.generate_batch([[5, 6, 7], [1, 2, 3]], generation_config=config, warmup=False,
                                 logits_processor=[recorder])
            with pytest.raises(ValueError, match="the model ran continuous batching .* calls no logits processor"):
                recorder.routed(0)
            with pytest.raises(ValueError, match="the model ran continuous batching"):
                model.generate(torch.tensor([[5, 6, 7], [1, 2, 3]]), max_new_tokens=2, do_sample=False,
                               pad_token_id=0, logits_processor=[recorder])


def test_a_second_recorder_on_a_capturer_refuses_while_the_first_holds_rows_not_read():
    """Every recorder writes row b, position p to slot b * (host_slots // batch)
    + p: a second generate() overwrote the first one's rows, which routed()
    then returned as valid."""
    model = hf_serving.build(config_or_skip("mixtral"))
    cap = generation_capturer(model)
    mask = torch.ones(2, 3, dtype=torch.long)

    def generate(prompt, recorder):
        model.generate(prompt, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                       logits_processor=[recorder])

    with hf.attach(model, cap):
        first = hf.GenerationRecorder(model, cap, mask)
        generate(torch.tensor([[5, 6, 7], [1, 2, 3]]), first)
        before = first.routed(1)  # row 0's rows are still held
        second = hf.GenerationRecorder(model, cap, mask)
        with pytest.raises(ValueError, match="another recorder on this capturer still holds the rows of 1 sequence in the slots"):
            generate(torch.tensor([[9, 9, 9], [8, 8, 8]]), second)
        held = first.routed(0)
        assert held.valid.all() and held.shape[0] == 4
        generate(torch.tensor([[9, 9, 9], [8, 8, 8]]), second)  # nothing held now
        assert second.routed(1) != before
        third = hf.GenerationRecorder(model, cap, mask)
        del second  # a recorder dropped holds nothing
        gc.collect()
        copy.deepcopy(model)(torch.tensor([[1, 2, 3]]))  # a copy's forward is not one of this model's
        assert third._forwards == []
        generate(torch.tensor([[5, 6, 7], [1, 2, 3]]), third)
        assert third.routed(1) == before


def test_a_forward_whose_rows_were_never_committed_is_warned_of_at_the_next_capture():
    """generate() without GenerationRecorder: each forward overwrites the rows
    of the one before; not in a backward, where checkpointing recomputes."""
    model = hf_serving.build(config_or_skip("mixtral"))
    cap = generation_capturer(model)
    with hf.attach(model, cap):
        with pytest.warns(hf.UncommittedCaptureWarning, match="MoE layer [0-9] captured again with no commit") as got:
            model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert got[0].filename == __file__  # the line that called generate(), not moecap's or torch's
        cap.commit(np.full(3, -1))
        with warnings.catch_warnings():
            warnings.simplefilter("error", hf.UncommittedCaptureWarning)
            for _ in range(2):  # a forward, a commit: no warning
                with torch.no_grad():
                    model(torch.tensor([[1, 2, 3]]))
                cap.commit(np.arange(3))
            model.train()
            for reentrant in (False, True):  # the backward recomputes the forward and captures nothing
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
                for _ in range(2):
                    loss = model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss
                    cap.commit(np.arange(3))
                    before = cap.read(np.arange(3))
                    loss.backward()
                    cap.commit(np.arange(3, 6))  # nothing captured since the last commit: no routing
                    assert (cap.read(np.arange(3, 6)) == -1).all() and np.array_equal(cap.read(np.arange(3)), before)
    with hf.attach(model, cap), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.eval()
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert len([w for w in caught if w.category is hf.UncommittedCaptureWarning]) == 1  # once, not per layer


def test_two_models_capturing_into_one_capturer_with_no_commit_between_are_warned_of():
    # Each attach tracked only its own captures: the second model's rows replaced the first's unwarned.
    first, second = (hf_serving.build(config_or_skip("mixtral")) for _ in range(2))
    cap = generation_capturer(first)
    with hf.attach(first, cap), hf.attach(second, cap), torch.no_grad():
        first(torch.tensor([[1, 2, 3]]))
        with pytest.warns(hf.UncommittedCaptureWarning, match="MoE layer 0 captured again with no commit"):
            second(torch.tensor([[1, 2, 3]]))


def test_generate_from_a_cache_records_the_positions_it_forwards_and_a_recorder_records_one_call():
    model = hf_serving.build(config_or_skip("mixtral"))
    cap = generation_capturer(model)
    with hf.attach(model, cap):
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        with hf.GenerationRecorder(model, cap, torch.ones_like(ids)) as recorder:
            out = model.generate(ids, logits_processor=[recorder], pad_token_id=0, max_new_tokens=3,
                                 do_sample=False, return_dict_in_generate=True)
            for bad, error in ((0, "num_tokens is 0; row 0 has 8 tokens"), (9, "num_tokens is 9"),
                               (2.0, "num_tokens must be an int, not float"), (True, "must be an int, not bool")):
                with pytest.raises((ValueError, TypeError), match=error):
                    recorder.routed(0, num_tokens=bad)  # refused before the read that frees the row
            turn1 = recorder.routed(0)
            with pytest.raises(ValueError, match="routed\(0\) was called already"):
                recorder.routed(0)
            with pytest.raises(ValueError, match="routed\(\) was called; a recorder records one generate"):
                model.generate(ids, logits_processor=[recorder], pad_token_id=0, max_new_tokens=2, do_sample=False)
        # The next turn: 7 positions in the cache, the new tokens and the answer forwarded.
        ids2 = torch.cat([out.sequences, torch.tensor([[9, 10]])], 1)
        with hf.GenerationRecorder(model, cap, torch.ones_like(ids2)) as recorder:
            out2 = model.generate(ids2, logits_processor=[recorder], pad_token_id=0, max_new_tokens=3,
                                  do_sample=False, past_key_values=out.past_key_values)
            with pytest.raises(ValueError, match="a recorder records one generate\(\) call: make a new one"):
                model.generate(ids, logits_processor=[recorder], pad_token_id=0, max_new_tokens=2, do_sample=False)
            turn2 = recorder.routed(0, num_tokens=out2.shape[1] - 1)
        # Embeddings in, no input_ids: generate hands the recorder only the generated tokens.
        with hf.GenerationRecorder(model, cap, torch.ones_like(ids)) as recorder:
            model.generate(inputs_embeds=model.get_input_embeddings()(ids), logits_processor=[recorder],
                           pad_token_id=0, max_new_tokens=3, do_sample=False)
            embedded = recorder.routed(0)
    truth = generation_capturer(model)
    with hf.attach(model, truth), torch.no_grad():
        model(out2[:, :-1], use_cache=False)
    truth.commit(np.arange(out2.shape[1] - 1))
    whole = truth.read(np.arange(out2.shape[1] - 1))
    assert turn1.start == 0 and np.array_equal(turn1.ids, whole[:7])
    assert turn2.start == 7 and turn2.shape[0] == out2.shape[1] - 9 and np.array_equal(turn2.ids, whole[7:-1])
    assert embedded.start == 0 and np.array_equal(embedded.ids, whole[:7])
