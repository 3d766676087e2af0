# SPDX-License-Identifier: Apache-2.0
"""megatron-core's own router replay, on CPU, fed moecap's Megatron payload.

RouterReplay + topk_routing_with_score_function (pure torch) replay it as
is; a whole TopKRouter needs two patches on CPU: its gating moves the weight
to torch.cuda.current_device(), and megatron-core 0.16.1 without Transformer
Engine never defines te_general_gemm (later versions set it to None)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="megatron-core runs on torch (the test venv)")
megatron_core = pytest.importorskip("megatron.core", reason="megatron-core is pinned in the test venv")

import moecap  # noqa: E402
from moecap.formats import megatron  # noqa: E402
from moecap.record import LayerMap, RoutedExperts  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function  # noqa: E402
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction  # noqa: E402

LAYERS, HIDDEN, TOP_K, EXPERTS = (1, 2, 4), 5, 2, 8


@pytest.fixture(autouse=True)
def fresh_replay_instances():
    # RouterReplay keeps every instance in a class-level list, in construction order.
    RouterReplay.clear_global_router_replay_instances()
    yield
    RouterReplay.clear_global_router_replay_instances()


def routing(rng, tokens, valid=None):
    ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens * len(LAYERS))])
    return RoutedExperts(ids.reshape(tokens, len(LAYERS), TOP_K), EXPERTS, valid=valid, layers=LAYERS,
                         num_hidden_layers=HIDDEN)


def routed_to(routing_map):
    """The experts a routing map [tokens, experts] selects, per token, sorted."""
    assert (routing_map.sum(-1) == TOP_K).all()
    return routing_map.nonzero()[:, 1].reshape(-1, TOP_K)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_router_replay_routes_every_token_to_the_payload(dtype):
    rng = np.random.default_rng(1)
    r = routing(rng, tokens=9)  # a 10-token sequence
    per_layer = r.to_megatron(dtype=dtype, num_tokens=10)
    assert len(per_layer) == len(LAYERS)  # the MoE layers only, in model order
    assert all(t.dtype == getattr(torch, dtype) and tuple(t.shape) == (10, TOP_K) for t in per_layer)
    replays = [RouterReplay() for _ in LAYERS]  # one per MoE layer, as TopKRouter builds them
    RouterReplay.set_replay_data(per_layer)
    torch.manual_seed(0)
    logits = [torch.randn(10, EXPERTS, requires_grad=True) for _ in LAYERS]
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    free_differs = 0
    for i, (replay, x) in enumerate(zip(replays, logits)):
        probs, routing_map = topk_routing_with_score_function(x, TOP_K, use_pre_softmax=True,
                                                              score_function="softmax", router_replay=replay)
        want = np.sort(r.ids[:, i].astype(np.int64), -1)
        assert np.array_equal(routed_to(routing_map)[:9].numpy(), want)
        assert routed_to(routing_map)[9].tolist() == list(range(TOP_K))  # the last token's filler route
        ids = torch.from_numpy(want)
        torch.testing.assert_close(probs[:9].gather(1, ids), torch.softmax(x[:9], -1).gather(1, ids))
        _, free_map = topk_routing_with_score_function(x, TOP_K, use_pre_softmax=True, score_function="softmax")
        free_differs += int((free_map[:9] != routing_map[:9]).any(-1).sum())
    assert free_differs > 0  # the replay decided, not the logits
    # The recompute in backward pops the same routes.
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    for i, (replay, x) in enumerate(zip(replays, logits)):
        _, routing_map = topk_routing_with_score_function(x, TOP_K, use_pre_softmax=True,
                                                          score_function="softmax", router_replay=replay)
        assert np.array_equal(routed_to(routing_map)[:9].numpy(), np.sort(r.ids[:, i], -1))
    assert megatron.decode(per_layer, EXPERTS, num_tokens=10, layers=LAYERS, num_hidden_layers=HIDDEN) == r


def test_megatron_has_no_value_for_no_routing():
    r = routing(np.random.default_rng(2), tokens=4, valid=[True, False, True, True])
    with pytest.raises(ValueError, match="Megatron's RouterReplay has no value for 'no routing'.*position 1.*"
                                         "invalid='arange'"):
        r.to_megatron()
    # What Megatron itself does with the values it cannot take: why the encoder refuses them.
    replay = RouterReplay()
    logits = torch.randn(4, EXPERTS)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    for bad in (torch.full((4, TOP_K), -1, dtype=torch.int64), torch.zeros((4, TOP_K), dtype=torch.int16)):
        replay.set_target_indices(bad)
        with pytest.raises((RuntimeError, IndexError)):
            topk_routing_with_score_function(logits, TOP_K, use_pre_softmax=True, router_replay=replay)
    with pytest.raises(ValueError, match="Megatron's gather takes int32 or int64"):
        r.to_megatron(dtype="int16", invalid="arange")
    # On request, the tokens without routing take the distinct route arange(top_k); `missing` names them.
    filled = r.to_megatron(invalid="arange")
    assert megatron.missing(r).tolist() == [False, True, False, False]
    # Each layer's tensor is its own allocation: a pipeline stage's slice of the list, or a pickle of one
    # layer, carries that layer only.
    assert len({t.untyped_storage().data_ptr() for t in filled}) == len(filled)
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in filled)
    assert all(t[1].tolist() == list(range(TOP_K)) for t in filled)
    replay.set_target_indices(filled[0])
    _, routing_map = topk_routing_with_score_function(logits, TOP_K, use_pre_softmax=True, router_replay=replay)
    assert routed_to(routing_map)[1].tolist() == list(range(TOP_K))
    with pytest.raises(ValueError, match="num_tokens is 4; the routing has 4 rows from position 0, which is a "
                                         "sequence of 5 tokens"):
        routing(np.random.default_rng(3), tokens=4).to_megatron(num_tokens=4)


@pytest.fixture
def megatron_cpu(tmp_path, monkeypatch):
    """A one-process gloo group and megatron's parallel state, torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import router as router_module
    from megatron.core.transformer.moe.router import TopKRouter

    def cpu_gating(self, input):  # Router.gating, minus its move of the weight to CUDA
        return router_module.router_gating_linear(input, self.weight, self.bias, torch.float32)

    monkeypatch.setattr(TopKRouter, "gating", cpu_gating)
    monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield TopKRouter
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_whole_topk_routers_replay_what_moecap_captured_of_their_own_routing(megatron_cpu):
    """Rollout: Megatron's routers (RECORD) route a sequence and moecap captures
    and commits each MoE layer's choice; the request read back is moecap's
    payload. Training: the routers' weights have moved, and REPLAY_FORWARD
    still routes every token as rollout did, with gradients through the router."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=HIDDEN, hidden_size=16, num_attention_heads=2, num_moe_experts=EXPERTS,
                               moe_router_topk=TOP_K, moe_enable_routing_replay=True, use_cpu_initialization=True,
                               moe_router_load_balancing_type="none", add_bias_linear=False,
                               moe_ffn_hidden_size=16)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(0)
    routers = [megatron_cpu(config, pg_collection=groups) for _ in LAYERS]
    assert len(RouterReplay.global_router_replay_instances) == len(LAYERS)
    tokens = 12
    hidden = [torch.randn(tokens, 1, 16) for _ in LAYERS]  # [seq, batch, hidden] per MoE layer

    cap = moecap.Capturer(num_layers=len(LAYERS), top_k=TOP_K, num_experts=EXPERTS, host_slots=32,
                          max_running_requests=1, chunked_prefill_size=16)
    cap.layer_map = LayerMap(LAYERS, HIDDEN)  # what hf.attach sets for a transformers model
    table = moecap.RequestTable(cap)
    table.start("r")
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        for layer, (router, x) in enumerate(zip(routers, hidden)):
            router(x[:tokens - 1])  # rollout forwards T-1 tokens
            cap.capture(layer, router.router_replay.get_recorded_indices().contiguous())
    slots = np.random.default_rng(4).permutation(32)[:tokens - 1]
    moecap.commit_batch(cap, slots)
    table.append("r", slots)
    routed = table.finish("r")
    assert routed.layers == LAYERS and routed.num_hidden_layers == HIDDEN
    recorded = [t.sort(-1)[0] for t in RouterReplay.get_recorded_data()]
    assert all(torch.equal(recorded[i], torch.from_numpy(routed.ids[:, i].astype(np.int64)).sort(-1)[0])
               for i in range(len(LAYERS)))

    with torch.no_grad():  # a policy update moves every router
        for router in routers:
            router.weight.add_(torch.randn_like(router.weight))
    RouterReplay.clear_global_indices()
    RouterReplay.set_replay_data(routed.to_megatron(num_tokens=tokens))
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    drifted = 0
    for i, (router, x) in enumerate(zip(routers, hidden)):
        probs, routing_map = router(x)
        assert torch.equal(routed_to(routing_map)[:tokens - 1], recorded[i])
        (probs * torch.arange(EXPERTS)).sum().backward()
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
        router.router_replay.clear_router_replay_action()
        with torch.no_grad():
            _, free_map = router(x[:tokens - 1])
        drifted += int((routed_to(free_map) != recorded[i]).any(-1).sum())
    assert drifted > 0  # without replay the moved routers pick other experts
    cap.close()


def test_hf_replay_takes_the_megatron_payload():
    """moecap.hf.replay forces a transformers model's routers to the per-layer
    list to_megatron gives (what a trainer without Megatron uses)."""
    transformers = pytest.importorskip("transformers", reason="moecap.hf needs transformers (the test venv)")
    import hf_serving
    from moecap import hf

    _, config = hf_serving.tiny_config("qwen2_moe")  # dense layer 1 between MoE layers 0 and 2
    if config is None:
        pytest.skip(f"transformers {transformers.__version__} has no Qwen2MoeConfig")
    model = hf_serving.build(config)
    layers = hf.find_moe_layers(model)
    cap = moecap.Capturer(num_layers=len(layers), top_k=2, num_experts=8, host_slots=16, max_running_requests=1,
                          chunked_prefill_size=16, extra_columns=1)
    ids = torch.randint(3, hf_serving.VOCAB, (1, 6))
    with hf.attach(model, cap), torch.no_grad():
        model(ids)
    moecap.commit_batch(cap, np.arange(6))
    routed = RoutedExperts(cap.read(np.arange(6)), 8, layers=cap.layer_map.layers,
                           num_hidden_layers=cap.layer_map.num_hidden_layers)
    assert routed.layers == (0, 2) and len(routed.to_megatron()) == 2  # MoE layers only
    with torch.no_grad():
        for layer in layers:
            layer.router.weight.add_(torch.randn_like(layer.router.weight))
    seen = []
    with torch.no_grad(), hf.replay(model, routed.to_megatron()):
        hooks = [layer.router.register_forward_hook(lambda m, i, o: seen.append(o[2].sort(-1)[0])) for layer in layers]
        model(ids)
        for h in hooks:
            h.remove()
    assert torch.equal(torch.stack(seen, 1), torch.from_numpy(routed.ids.astype(np.int64)).sort(-1)[0])
    cap.close()
