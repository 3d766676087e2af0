# SPDX-License-Identifier: Apache-2.0
"""Routing replay for RL, end to end, on a transformers MoE model.

Rollout side (the inference engine): serve a few requests with greedy decode
and a KV cache; moecap.hf captures every MoE layer's routing inside the
forward, commit_batch moves each step's rows to the tokens' KV slots, and
RequestTable reads a finished request's routing. Each request's routing
leaves as a routing record (bytes).

Trainer side: decode the record and hand it to megatron-core's own router
replay: RoutedExperts.to_megatron(num_tokens=T) gives one [T, top_k] tensor
per MoE layer (the T-1 forwarded tokens' experts, and a filler route for the
last token, which rollout never forwarded), RouterReplay.set_replay_data
takes them, and every router of the trainer's model routes through
Megatron's topk_routing_with_score_function in REPLAY_FORWARD. The replayed
forward over the whole sequence reproduces the rollout's outputs. Then a
policy update moves the routers: the free-running forward now routes
differently, the replayed one does not.

    python examples/python/rl_replay.py  # needs torch >= 2.4, transformers, megatron-core
"""
import inspect
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function  # noqa: E402
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction  # noqa: E402

import moecap  # noqa: E402
from moecap import hf  # noqa: E402
from moecap.engine import RequestTable, commit_batch  # noqa: E402
from moecap.record import RoutedExperts  # noqa: E402


def tiny_model():
    """A random-weight Qwen3-MoE (Mixtral where this transformers lacks it)."""
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, num_experts_per_tok=2, pad_token_id=0,
                  eos_token_id=1, bos_token_id=2)
    if hasattr(transformers, "Qwen3MoeConfig"):
        config = transformers.Qwen3MoeConfig(num_experts=16, moe_intermediate_size=32, head_dim=16, **common)
    else:
        config = transformers.MixtralConfig(num_local_experts=16, **common)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def rollout(model, capturer, prompts, new_tokens, rng):
    """Serves each prompt: prefill, then greedy decode with the cache. Returns
    per request (token ids forwarded, logits at each, routing record bytes)."""
    table = RequestTable(capturer)
    free = list(rng.permutation(capturer.config["host_slots"]))
    results = []
    # newer transformers (5.25) name past_key_values cache
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with hf.attach(model, capturer), torch.no_grad():
        for rid, prompt in enumerate(prompts):
            table.start(rid)
            cache = transformers.DynamicCache(config=model.config)
            tokens, logits = list(prompt), []
            step_input = torch.tensor([prompt])
            for _ in range(new_tokens):
                out = model(input_ids=step_input, use_cache=True, **{cache_arg: cache})
                slots = [int(free.pop()) for _ in range(step_input.shape[1])]
                commit_batch(capturer, slots)        # this step's rows -> the tokens' KV slots
                table.append(rid, slots)
                logits.append(out.logits[0])
                tokens.append(int(out.logits[0, -1].argmax()))
                step_input = torch.tensor([[tokens[-1]]])
            slots = table.slots(rid)
            routed = table.finish(rid)               # read the request's routing, free its slots
            free.extend(int(s) for s in slots)       # the KV pool reuses them
            forwarded = tokens[:-1]                  # the last token is never forwarded
            results.append((forwarded, tokens[-1], torch.cat(logits), routed.to_bytes()))
    return results


class MegatronRouting:
    """The trainer's routers, routed by megatron-core: one RouterReplay per MoE
    layer (as Megatron's TopKRouter builds them), and a hook on each router of
    the transformers model that takes its logits through Megatron's
    topk_routing_with_score_function. With REPLAY_FORWARD set, Megatron picks
    the replayed experts; without, it computes its own top-k of the softmax
    (Qwen3-MoE's rule)."""

    def __init__(self, layers):
        RouterReplay.clear_global_router_replay_instances()
        self.layers = layers
        self.replays = [RouterReplay() for _ in layers]

    def _hook(self, layer):
        def hook(module, inputs, output):
            logits = output[0].reshape(-1, output[0].shape[-1])
            probs, routing_map = topk_routing_with_score_function(
                logits.float(), module.top_k, use_pre_softmax=True, score_function="softmax",
                router_replay=self.replays[layer.index])
            ids = routing_map.nonzero()[:, 1].reshape(-1, module.top_k)  # each token's experts, ascending
            weights = probs.gather(1, ids)
            if module.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return output[0], weights.to(output[1].dtype), ids
        return hook

    def forward(self, model, ids, per_layer=None):
        """logits of `ids` [1, T]; per_layer: the replayed routing, or None to route freely.
        Also returns each MoE layer's experts per token, [T, layers, top_k] sorted."""
        if per_layer is not None:
            RouterReplay.set_replay_data(per_layer)
            RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        seen = []
        hooks = [layer.router.register_forward_hook(self._hook(layer)) for layer in self.layers]
        hooks += [layer.router.register_forward_hook(lambda m, i, o: seen.append(o[2])) for layer in self.layers]
        try:
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0]
        finally:
            for h in hooks:
                h.remove()
            RouterReplay.clear_global_router_replay_action()
            RouterReplay.clear_global_indices()
        return logits, torch.stack(seen, 1).sort(-1)[0]


def train_side(model, megatron, forwarded, next_token, record):
    """Decodes the record and replays it through Megatron's RouterReplay over
    the whole sequence (T tokens: the forwarded ones and the last sampled one).
    Returns the replayed logits of the forwarded tokens and, per (token,
    layer), whether the replayed and the free-running forwards routed unlike
    the rollout."""
    routed = RoutedExperts.from_bytes(record)
    tokens = forwarded + [next_token]
    assert routed.valid.all() and routed.shape[0] == len(tokens) - 1  # T-1 rows: the last token never forwarded
    per_layer = routed.to_megatron(num_tokens=len(tokens))  # [T, top_k] int64 per MoE layer
    recorded = torch.from_numpy(routed.ids.astype(np.int64)).sort(-1)[0]
    ids = torch.tensor([tokens])
    replayed, routes = megatron.forward(model, ids, per_layer)
    replay_differs = (routes[:-1] != recorded).any(-1)
    _, free_routes = megatron.forward(model, ids)
    free_differs = (free_routes[:-1] != recorded).any(-1)
    return replayed[:-1], replay_differs, free_differs


def main():
    model = tiny_model()
    layers = hf.find_moe_layers(model)
    router = layers[0].router
    capturer = moecap.Capturer(num_layers=len(layers), top_k=router.top_k, num_experts=router.num_experts,
                               host_slots=512, max_running_requests=1, chunked_prefill_size=64, weight_dtype="f32")
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 128, size=n)) for n in (7, 12, 5)]
    results = rollout(model, capturer, prompts, new_tokens=6, rng=rng)
    print(f"rollout: {len(results)} requests on {type(model).__name__}, {len(layers)} MoE layers, "
          f"top-{router.top_k} of {router.num_experts} experts")

    megatron = MegatronRouting(layers)
    worst = 0.0
    for rid, (forwarded, last, served_logits, record) in enumerate(results):
        replayed, replay_differs, free_differs = train_side(model, megatron, forwarded, last, record)
        gap = (replayed - served_logits).abs().max().item()
        worst = max(worst, gap)
        same_tokens = torch.equal(replayed.argmax(-1), served_logits.argmax(-1))
        print(f"  request {rid}: {len(forwarded) + 1} tokens, record {len(record)} bytes; replayed through "
              f"Megatron's RouterReplay, logits within {gap:.1e} of the rollout's, greedy tokens equal: {same_tokens}")
        assert same_tokens and gap < 1e-4, "the replayed forward must reproduce the rollout"
        assert not replay_differs.any() and not free_differs.any(), "unchanged weights route as recorded"

    # A policy update moves the routers: free-running routing drifts, replay holds it.
    with torch.no_grad():
        for layer in layers:
            layer.router.weight.add_(torch.randn_like(layer.router.weight) * 0.01)
    drifted = held = 0
    for forwarded, last, _, record in results:
        _, replay_differs, free_differs = train_side(model, megatron, forwarded, last, record)
        drifted += int(free_differs.sum())
        held += int(replay_differs.sum())
    total = sum(len(f) * len(layers) for f, _, _, _ in results)
    print(f"after a policy update: {drifted} of {total} (token, layer) routings differ from the rollout's "
          f"without replay, {held} with replay (Megatron's RouterReplay)")
    assert drifted > 0 and held == 0
    print(f"replayed outputs equal the recorded ones (max |logit difference| {worst:.1e})")
    RouterReplay.clear_global_router_replay_instances()
    capturer.close()


if __name__ == "__main__":
    main()
