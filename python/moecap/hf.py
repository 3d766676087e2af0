# SPDX-License-Identifier: Apache-2.0
"""Attach a Capturer to a Hugging Face transformers MoE model.

    handle = moecap.hf.attach(model, capturer)   # every MoE layer captures its routing
    ...                                          # serve: forwards, commit_batch, RequestTable
    handle.detach()

transformers >= 5 gives every MoE block a router module that returns
``(router_logits, top_k_weights, top_k_index)``: the experts the model itself
picked, whatever its rule (softmax then top-k as Mixtral and the Qwen MoEs;
top-k then softmax as GraniteMoE and GPT-OSS; DeepSeek-V3's grouped top-k
over biased sigmoid scores and its kin; biases held by the block, per-expert
scales, PhiMoE's sparsemixer; `KNOWN` lists the model types checked, each
with its rule). attach hooks those modules' outputs, so nothing is
re-derived (Inkling's router returns a fourth output, its shared experts'
per-token weights, read by its class; where a block picks the experts from
its router's bare logits, DBRX's and Jamba's in transformers 5.19, they are read where
its experts module receives them), numbers the MoE layers in order (dense
layers in between are skipped, and each MoE layer's decoder layer is kept in
the handle's and the capturer's ``layer_map``, so a request read back knows
which model layers it covers), and captures each layer's ids (and weights,
if the capturer keeps them) inside the forward. A model's shared expert can
ride along as an extra column (id num_experts), the fused-shared-expert
layout engines use; the capturer accepts and drops it.

An architecture not verified here is refused with an error that says what to
pass: ``selector=fn(router, inputs, output) -> (ids [n, k], weights [n, k] or
None)`` and, where the model declares no router class, ``routers=[modules]``.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, Union, cast

from ._errors import MoecapError, Status
from .integrations import _model

if TYPE_CHECKING:
    import torch

    from . import Capturer
    from .record import LayerMap, RoutedExperts

#: (router, inputs, output) -> (ids [n, k], weights [n, k] or None): the experts a router picked.
Selector = Callable[[Any, Any, Any], "tuple[torch.Tensor, Optional[torch.Tensor]]"]
#: The router modules: a list of them, or their class.
Routers = Union[type, Sequence["torch.nn.Module"]]
#: (layer, ids, weights) -> (ids, weights) of every attention-DP rank, gathered as the MoE layer sees them.
Gather = Callable[[int, "torch.Tensor", "Optional[torch.Tensor]"], "tuple[torch.Tensor, Optional[torch.Tensor]]"]

# model_type -> how its router is found; each was checked against the model's own
# output_router_logits top-k (tests/python/test_hf_models.py).
KNOWN = {
    "mixtral": "MixtralTopKRouter: softmax, top-k, renormalized",
    "qwen2_moe": "Qwen2MoeTopKRouter: softmax, top-k; shared expert with a sigmoid gate; dense layers in between",
    "qwen3_moe": "Qwen3MoeTopKRouter: softmax, top-k",
    "olmoe": "OlmoeTopKRouter: softmax, top-k",
    "granitemoe": "GraniteMoeTopKRouter: top-k of logits, then softmax",
    "phimoe": "PhimoeTopKRouter: sparsemixer",
    "deepseek_v3": ("DeepseekV3TopkRouter: grouped top-k of sigmoid + correction bias; shared experts; "
                    "dense first layers"),
    "glm4_moe": "Glm4MoeTopkRouter: DeepSeek-V3's grouped top-k of sigmoid + correction bias; shared experts",
    "dots1": "Dots1TopkRouter: DeepSeek-V3's grouped top-k of sigmoid + correction bias; shared experts",
    "deepseek_v2": "DeepseekV2TopkRouter: softmax, group-limited greedy top-k (group max), no renormalization",
    "qwen3_next": "Qwen3NextTopKRouter: softmax, top-k; gated shared expert; linear-attention layers",
    "flex_olmo": "FlexOlmoTopKRouter: softmax, top-k",
    "hunyuan_v1_moe": "HunYuanMoEV1TopKRouter: softmax, top-k, renormalized; shared MLP",
    "gpt_oss": "GptOssTopKRouter: top-k of logits, then softmax",
    "granitemoeshared": "GraniteMoeSharedTopKRouter: top-k of logits, then softmax; shared MLP",
    "ernie4_5_moe": "Ernie4_5_MoeTopKRouter: softmax, top-k of softmax + moe_statics bias, renormalized",
    "minimax_m2": "MiniMaxM2TopKRouter: top-k of sigmoid + the block's correction bias, renormalized",
    "solar_open": "SolarOpenTopkRouter: DeepSeek-V3's grouped top-k of sigmoid + correction bias; shared experts",
    "cohere2_moe": ("Cohere2MoeTopKRouter: top-k of logits, then softmax (or sigmoid, optionally renormalized); "
                    "shared experts, averaged with the routed sum by default (the router's weights are captured)"),
    "granitemoehybrid": "GraniteMoeHybridTopKRouter: top-k of logits, then softmax; Mamba layers",
    "granitemoe_swa": "GraniteMoeSWATopKRouter: top-k of logits, then softmax; sliding-window attention",
    "gemma4_text": ("Gemma4TextRouter: top-k of its softmax (returned as the logits), renormalized, times a "
                    "per-expert scale; a dense MLP beside it"),
    "gemma4": "Gemma4ForConditionalGeneration: gemma4_text's router in its language model",
    "aria_text": "AriaTextTopKRouter: top-k of logits, then softmax; shared experts",
    "llama4_text": ("Llama4Router: top-k of logits, sigmoid of those, returned as dense scores beside the logits "
                    "(its own form, read by attach); the block scales each expert's input by its score; "
                    "shared expert; dense layers between MoE ones"),
    "llama4": "Llama4ForConditionalGeneration: llama4_text's router in its language model",
    "deepseek_v4": ("DeepseekV4TopKRouter: top-k of sqrt-softplus scores + correction bias, renormalized, scaled; "
                    "its first MoE layers' DeepseekV4HashRouter: fixed experts per token id (tid2eid), weighed "
                    "the same way; shared experts"),
    "nemotron_h": ("NemotronHTopkRouter: DeepSeek-V3's grouped top-k of sigmoid + correction bias; shared expert; "
                   "MoE, Mamba and attention layers"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTopKRouter: softmax, top-k, renormalized; gated shared expert; "
                         "linear-attention layers"),
    "qwen3_5_moe": "Qwen3.5-MoE's multimodal wrapper: its language model's Qwen3_5MoeTopKRouter",
    "deepseek_v32": ("DeepseekV32TopkRouter: DeepSeek-V3's grouped top-k of sigmoid + correction bias; shared "
                     "experts; dense first layers"),
    "glm4_moe_lite": ("Glm4MoeLiteTopkRouter: DeepSeek-V3's grouped top-k of sigmoid + correction bias; shared "
                      "experts; dense first layer"),
    "glm_moe_dsa": ("GlmMoeDsaTopkRouter: DeepSeek-V3's grouped top-k of sigmoid + correction bias; shared "
                    "experts; dense first layers"),
    "kimi_linear": ("KimiLinearTopkRouter: DeepSeek-V3's grouped top-k of sigmoid + correction bias; shared "
                    "experts; dense first layer; linear-attention layers"),
    "mistral4": "Mistral4TopkRouter: DeepSeek-V3's grouped top-k, of softmax, no correction bias; shared experts",
    "glm5_next": ("Glm5NextTextTopkRouter (multimodal wrapper): DeepSeek-V3's grouped top-k of sigmoid + correction "
                  "bias; shared experts; dense first layers"),
    "qwen3_omni_moe_thinker": ("Qwen3OmniMoeThinkerTextTopKRouter (Qwen3-Omni's thinker): softmax, top-k; "
                               "dense layers in between"),
    "qwen4_exp_text": ("Qwen4ExpTextTopKRouter: softmax, top-k; gated shared expert; linear-attention layers, "
                       "hyper-connections"),
    "qwen4_exp": "Qwen4-Exp's multimodal wrapper: its language model's Qwen4ExpTextTopKRouter",
    "deepseek_ocr2": ("DeepseekOcr2TextTopkRouter (multimodal wrapper): DeepSeek-V2's softmax, greedy or "
                      "group-limited greedy top-k, no renormalization; shared experts; dense first layers"),
    "glm4v_moe": ("Glm4vMoeTextTopkRouter (multimodal wrapper): DeepSeek-V3's grouped top-k of sigmoid + correction "
                  "bias; shared experts; dense first layer"),
    "qwen3_vl_moe": ("Qwen3VLMoeTextTopKRouter (multimodal wrapper): softmax, top-k, renormalized; "
                     "dense layers in between"),
    "minimax": "MiniMaxTopKRouter: softmax, top-k, renormalized; lightning-attention layers",
    "lfm2_moe": ("Lfm2MoeTopKRouter: top-k of sigmoid + the block's expert bias, renormalized, scaled; "
                 "dense first layers; short-convolution layers"),
    "exaone_moe": ("ExaoneMoeTopkRouter: DeepSeek-V3's grouped top-k of sigmoid + correction bias; shared experts; "
                   "dense first layers"),
    "afmoe": ("AfmoeTokenChoiceRouter: top-k of sigmoid + the block's expert bias, renormalized, scaled; "
              "shared experts; dense first layers"),
    "mimo_v2_flash": ("MiMoV2FlashTopkRouter: DeepSeek-V3's grouped top-k of sigmoid + correction bias; "
                      "dense first layer; sliding-window layers"),
    "step3p7": ("Step3p7TopKRouter: top-k of sigmoid + correction bias, renormalized (the block scales the routed "
                "sum by moe_router_scaling_factor); shared expert; dense first layers; multimodal wrapper"),
    "hy_v3": ("HYV3TopKRouter: top-k of sigmoid + the block's correction bias, renormalized, scaled; shared expert; "
              "dense first layers"),
    "hy_v4": ("HYV4TopkRouter: DeepSeek-V3's grouped top-k of sigmoid + correction bias; shared experts; "
              "dense first layers; indexed MLA, hyper-connections"),
    "minimax_m3_vl_text": ("MiniMaxM3VLTopKRouter: top-k of sigmoid + correction bias, renormalized (the block "
                           "scales the routed sum by routed_scaling_factor); shared experts; block-sparse attention"),
    "minimax_m3_vl": "MiniMaxM3VLTopKRouter: minimax_m3_vl_text's, in its multimodal wrapper",
    "laguna": ("LagunaTopKRouter: top-k of sigmoid (of soft-capped logits) + correction bias, renormalized (the block "
               "scales the routed sum by moe_routed_scaling_factor); shared experts; dense first layers"),
    "mellum": "MellumTopKRouter: softmax, top-k (renormalized if norm_topk_prob); dense layers in between",
    "axk1": ("AXK1TopkRouter: DeepSeek-V3's grouped top-k of sigmoid + correction bias; shared experts; "
             "dense first layers"),
    "axk2": ("AXK2TopkRouter: DeepSeek-V3's grouped top-k of sigmoid + correction bias, dropped groups masked to 0 "
             "(or no groups); shared experts; dense first layers; indexed MLA"),
    "bailing_hybrid": ("BailingHybridTopkRouter: DeepSeek-V3's grouped top-k of sigmoid + correction bias; shared "
                       "experts; dense first layers; linear-attention (Kimi delta) and MLA layers"),
    "beam": ("BeamTopKRouter: DeepSeek-V3's grouped top-k of sigmoid + correction bias, sorted, unscaled (the block "
             "scales the routed sum by routed_scaling_factor); dense first layers"),
    "dots3_note_text": ("Dots3NoteTextTopkRouter: DeepSeek-V3's grouped top-k of sigmoid + correction bias; shared "
                        "experts; dense first layers; indexed MLA and sliding-window layers"),
    "dots3_note": ("Dots3NoteTextTopkRouter: dots3_note_text's, in its multimodal wrapper (the vision tower's MoE "
                   "routers are not captured)"),
    "ergo": ("ErgoTopkRouter: top-k of sigmoid + correction bias, renormalized, scaled; shared expert; "
             "dense first layers"),
    "flint": "FlintTopKRouter: top-k of sigmoid (renormalized if norm_topk_prob); shared expert; dense first layers",
    "hy_v4_vl": ("HYV4VLTopkRouter (multimodal wrapper): DeepSeek-V3's grouped top-k of sigmoid + correction bias; "
                 "shared experts; dense first layers; indexed MLA, hyper-connections"),
    "inkling2_text": ("Inkling2TopKRouter: top-k of score_fn (sigmoid) + correction bias, renormalized, scaled; "
                      "hybrid sliding-window layers"),
    "inkling2": "Inkling2TopKRouter: inkling2_text's, in its multimodal wrapper",
    "inkling2_loop_text": ("Inkling2LoopTopKRouter: Inkling 2's top-k of score_fn (sigmoid) + correction bias, "
                           "renormalized, scaled; looped layers (refused where the loop holds MoE layers and "
                           "runs more than once)"),
    "inkling2_loop": "Inkling2LoopTopKRouter: inkling2_loop_text's, in its multimodal wrapper",
    "kolibri1": ("Kolibri1TopKRouter: top-k of logits + correction bias, sigmoid of those logits (renormalized if "
                 "norm_topk_prob); shared expert; sliding-window layers"),
    "kolibri1_1": ("Kolibri1_1TopKRouter: Kolibri 1's top-k of logits + correction bias, sigmoid of those logits; "
                   "shared expert; dense first layers; layers sharing keys and values"),
    "lara_mini": ("LaraMiniTopKRouter: softmax of float32 logits, top-k (renormalized if norm_topk_prob); shared "
                  "expert; linear-attention and sliding-window layers"),
    "minicpm5_moe": ("MiniCPM5MoeTopkRouter: DeepSeek-V3's grouped top-k of sigmoid + correction bias; shared experts; "
                     "dense first layers"),
    "mistral_large4": ("MistralLarge4TextTopkRouter (multimodal wrapper): Mistral 4's grouped top-k of softmax of "
                       "float32 logits, always renormalized; shared experts; dense first layers; indexed MLA"),
    "muse_spark": ("MuseSparkTopkRouter (multimodal wrapper): top-k of sigmoid (of logits times output_multiplier) + "
                   "correction bias, renormalized, scaled"),
    "unlimited_ocr": ("UnlimitedOcrTextTopkRouter (multimodal wrapper): DeepSeek-V2's softmax, greedy or "
                      "group-limited greedy top-k, no renormalization; shared experts; dense first layers"),
    "inkling_text": ("InklingTopkRouter: top-k of sigmoid + correction bias; the picked and the shared experts' "
                     "sigmoids normalized together, scaled (its own 4-tuple, the shared experts' weights, "
                     "gammas, last); shared experts; dense first layers (dense_mlp_idx); hybrid sliding layers"),
    "inkling_mm_model": "InklingTopkRouter: inkling_text's, in its multimodal wrapper",
    "dbrx": ("DbrxRouter: bare logits; its block (DbrxFFN) takes softmax, top-k, divided by their p-norm "
             "(moe_normalize_expert_weights), read where its experts receive them"),
    "jamba": ("JambaTopKRouter: softmax, top-k (transformers 5.25); in 5.19 a bare nn.Linear router whose block "
              "(JambaSparseMoeBlock) picks the same way, read where its experts receive them; Mamba layers"),
    "longcat_flash": ("LongcatFlashTopkRouter: softmax, top-k of it + correction bias, scaled, over the routed "
                      "experts and after them the zero (identity) experts, ids config.n_routed_experts and up "
                      "(counted in the capturer's num_experts); one MoE a decoder layer of two attention sublayers"),
    "zaya": ("ZayaRouter: softmax over the experts and a skip expert, top-k of it + balancing biases; the skip "
             "expert, id config.num_experts (the last of num_experts + 1), weighs 0; router states carried from "
             "layer to layer; top-1"),
}

# Where a block keeps its shared expert (and the gate that scales it, if any).
_SHARED = (("shared_expert", "shared_expert_gate"), ("shared_experts", None), ("shared_mlp", None))


class UncommittedCaptureWarning(UserWarning):
    """A MoE layer captured again before any commit: the earlier forward's rows are overwritten."""


class UnknownArchitecture(TypeError):
    """attach cannot tell how this model picks its experts: pass a selector."""


def _routing_dims(model, router, given: Any = None) -> tuple[int, int]:
    """(top_k, num_experts): the router's, or the config's where the router
    keeps neither (Gemma 4, DBRX, Jamba in transformers 5.19), or else `given`'s (the
    capturer's config: a selector's model whose config names neither, Switch
    Transformers')."""
    def dim(attribute, keys, what):
        if attribute == "num_experts":  # every id it picks: the routed experts and any zero or skip ones
            attribute = next((a for kind, a in _EXPERTS_PAST_ROUTED if type(router).__name__.startswith(kind)),
                             attribute)
        value = getattr(router, attribute, 0)
        if value:
            return int(value)
        try:
            return _model.config_int(getattr(model, "config", None), keys, what)
        except ValueError as e:
            if "differs between layers" in str(e):  # named, not found: the config's own words say more
                raise
            if given is not None and attribute in given:
                return int(given[attribute])
            raise UnknownArchitecture(
                f"{type(model).__name__}: neither its router ({type(router).__name__}.{attribute}) nor its config "
                f"({', '.join(keys)}) names its {what}") from None
    return dim("top_k", _model.TOP_K_KEYS, "experts per token"), dim("num_experts", _model.EXPERT_KEYS,
                                                                        "routed expert count")


# Routers whose ids run past the routed experts, and the attribute that
# counts them all (their num_experts counts the routed ones only):
# LongCat-Flash's zero (identity) experts follow the routed ones, ids
# n_routed_experts and up; Zaya's skip expert (no compute) is id num_experts.
_EXPERTS_PAST_ROUTED = (("LongcatFlashTopkRouter", "n_routed_experts"), ("ZayaRouter", "num_router_classes"))


def _past_routed(router: Any, num_experts: int) -> str:
    """How many of a router's `num_experts` ids are zero or skip experts,
    for an error message: ": 8 routed, 4 past them (zero or skip experts)"."""
    routed = getattr(router, "num_experts", None)
    if not (isinstance(routed, int) and 0 < routed < num_experts):
        return ""
    return f": {routed} routed, {num_experts - routed} past them (zero or skip experts)"


def _router_recorder(model):
    # The model, its decoder, or the language model inside a multimodal
    # wrapper (Glm4vMoe, Llama 4): the first module that records router_logits.
    for candidate in model.modules():
        recorders = getattr(candidate, "_can_record_outputs", None) or {}
        if "router_logits" in recorders:
            return recorders["router_logits"]
    return None


def _router_class(model):
    return getattr(_router_recorder(model), "target_class", None)


def _model_type(model):
    return getattr(getattr(model, "config", None), "model_type", type(model).__name__)


def _known_type(model) -> Optional[str]:
    """The KNOWN model type whose routers `model` runs: its own, or else that
    of the model class that records its routers (a config type that builds
    another's model, as Sarvam's build GLM-4.5's and DeepSeek-V3's; a
    multimodal wrapper whose language model is known, as Aria's)."""
    model_type = _model_type(model)
    if model_type in KNOWN:
        return model_type
    router = _router_class(model)
    for candidate in model.modules():
        recorder = (getattr(candidate, "_can_record_outputs", None) or {}).get("router_logits")
        kind = getattr(getattr(type(candidate), "config_class", None), "model_type", None)
        if router is not None and getattr(recorder, "target_class", None) is router and kind in KNOWN:
            return kind
    return None


def _router_output_order(router: Any, output: Any) -> tuple[int, int, int]:
    """Positions (logits, weights, indices) in a transformers >= 5 router's
    output: three tensors, the indices the one integer tensor, the weights the
    floating one of the indices' shape. Most routers return (logits, weights,
    indices); GraniteMoE's and Aria's, in transformers 5.19, (indices,
    weights, logits). Inkling's returns a fourth, its shared experts' weights
    (_shared_gammas), and Zaya's its router states (_router_states): their
    first three are read so. No other 4-tuple is."""
    if _shared_gammas(router, output) is not None or _router_states(router, output):
        output = output[:3]
    if isinstance(output, tuple) and len(output) == 3 and all(hasattr(o, "dtype") for o in output):
        integer = [i for i, o in enumerate(output) if not o.dtype.is_floating_point]
        if len(integer) == 1:
            ids = integer[0]
            same = [i for i, o in enumerate(output) if i != ids and tuple(o.shape) == tuple(output[ids].shape)]
            order = None
            if len(same) == 1:
                order = 3 - ids - same[0], same[0], ids
            elif len(same) == 2 and ids in (0, 2):  # top_k == num_experts: the weights sit in the middle either way
                order = 2 - ids, 1, ids
            # The logits score every expert of every token: at least top_k columns, the indices' rows. Switch
            # Transformers' (one-hot mask, max probability, logits) fails here rather than read as indices.
            if order is not None and _scores_every_expert(output[order[0]], output[ids]):
                return order
    raise UnknownArchitecture(
        f"{type(router).__name__} returned {type(output).__name__}, not (logits, weights, indices); "
        "pass selector=fn(router, inputs, output) -> (ids, weights)")


# Routers that return (routed logits [n, num_experts], weights [n, top_k],
# indices [n, top_k], shared gammas [n, n_shared_experts]): Inkling's, whose
# shared experts are weighed per token by the gammas, normalized together with
# the picked experts' weights.
_WITH_SHARED_GAMMAS = ("InklingTopkRouter",)


def _shared_gammas(router: Any, output: Any) -> Any:
    """The shared experts' gammas, the last of `router`'s outputs, or None:
    only a _WITH_SHARED_GAMMAS router's 4-tuple of that exact form, its logits
    one column per routed expert and its gammas one per shared one."""
    if not (type(router).__name__.startswith(_WITH_SHARED_GAMMAS) and isinstance(output, tuple)
            and len(output) == 4 and all(hasattr(o, "dtype") and hasattr(o, "shape") for o in output)):
        return None
    logits, weights, ids, gammas = output
    shared, experts = getattr(router, "n_shared_experts", None), getattr(router, "num_experts", None)
    if (not ids.dtype.is_floating_point and all(o.dtype.is_floating_point for o in (logits, weights, gammas))
            and ids.dim() >= 1 and tuple(weights.shape) == tuple(ids.shape) and logits.shape[-1] == experts
            and gammas.dim() == ids.dim() and tuple(gammas.shape[:-1]) == tuple(ids.shape[:-1])
            and isinstance(shared, int) and shared >= 1 and gammas.shape[-1] == shared):
        return gammas
    return None


def _router_states(router: Any, output: Any) -> bool:
    """Whether `output` is a _WITH_SKIP_EXPERT router's 4-tuple, its logits
    one column per expert and one for the skip expert, its last output the
    router states the next layer's router reads."""
    return (type(router).__name__.startswith(_WITH_SKIP_EXPERT) and isinstance(output, tuple) and len(output) == 4
            and all(hasattr(o, "dtype") and hasattr(o, "shape") for o in output)
            and output[0].shape[-1] == getattr(router, "num_experts", -1) + 1)


def _scores_every_expert(logits: Any, ids: Any) -> bool:
    if logits.dim() == 0 or ids.dim() == 0:
        return False
    rows = ids.numel() // max(ids.shape[-1], 1)
    return logits.shape[-1] >= ids.shape[-1] and logits.numel() == rows * logits.shape[-1]


def default_selector(router: Any, inputs: Any, output: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The transformers >= 5 router contract: logits, weights and indices
    (or a router's own form, _SCORES_AND_LOGITS)."""
    if _scores_and_logits(router, output):
        import torch
        scores, logits = output
        # The router's own picks, where its scores hold them; inside replay,
        # which forces the scores only, the experts the scores hold (by weight).
        own = logits.topk(router.top_k, dim=1).indices
        held = (scores.gather(1, own) != 0).all(dim=1, keepdim=True)
        picked = torch.where(held, own, scores.topk(router.top_k, dim=1).indices)
        return picked, scores.gather(1, picked)
    _, weights, ids = _router_output_order(router, output)
    if type(router).__name__.startswith(_WITH_SKIP_EXPERT):
        return _skip_picks_restored(router, output[ids], output[weights]), output[weights]
    return output[ids], output[weights]


# Routers that pick a skip expert (the router's id num_experts: no compute)
# and hand the pick on as expert 0 with weight 0, with their router states as
# a fourth output (logits [n, num_experts + 1], weights, indices, states):
# Zaya's. A pick handed on as expert 0 with weight 0 is recorded as the skip,
# so that a token that skipped is not recorded as routed to expert 0. A real
# pick of expert 0 has the softmax's weight, above 0; were it to underflow to
# 0, expert 0 would add nothing, exactly as the skip does. Read from the ids
# and weights, not the logits: inside replay, whose forced ids these are.
_WITH_SKIP_EXPERT = ("ZayaRouter",)


def _skip_picks_restored(router: Any, ids: Any, weights: Any) -> Any:
    return ids.masked_fill((ids == 0) & (weights == 0), router.num_experts)


def _skip_picks_masked(router: Any, ids: Any, weights: Any) -> tuple[Any, Any]:
    """Forced ids and weights as a _WITH_SKIP_EXPERT router hands them on: a
    skip pick as expert 0 with weight 0."""
    skip = ids == router.num_experts
    return ids.masked_fill(skip, 0), weights.masked_fill(skip, 0)


# Routers that return (scores [n, num_experts], logits [n, num_experts]), the
# scores the sigmoid of the top-k logits and 0 elsewhere: Llama 4's. The ids
# are the top-k of the logits, taken again as the router took them (the same
# tensor, the same call, so the same experts in the same order), where the
# scores are non-zero there; replay forces only the scores (the logits stay
# the model's, for its auxiliary loss), so a row whose scores hold other
# experts records those, in the order of their weights.
_SCORES_AND_LOGITS = ("Llama4Router",)


def _scores_and_logits(router: Any, output: Any) -> bool:
    return (type(router).__name__.startswith(_SCORES_AND_LOGITS) and isinstance(output, tuple) and len(output) == 2
            and all(hasattr(o, "shape") for o in output) and output[0].shape == output[1].shape)


# Blocks whose router returns bare logits [n, num_experts] and which pick the
# experts themselves (route_tokens_to_experts), then hand them to their experts
# module through transformers' experts interface, experts(hidden_states,
# top_k_index, top_k_weights): DBRX's, and Jamba's in transformers 5.19
# (its router an nn.Linear, or a subclass). attach reads the experts and
# weights where the experts module receives them: what the model computes
# with, not re-derived.
_PICKED_BY_BLOCK = ("DbrxFFN", "JambaSparseMoeBlock")


def _picked_by_block(layer: MoELayer) -> bool:
    import torch
    bare_logits = type(layer.router).__name__.startswith("DbrxRouter") or isinstance(layer.router, torch.nn.Linear)
    return (type(layer.block).__name__.startswith(_PICKED_BY_BLOCK) and bare_logits
            and getattr(layer.block, "experts", None) is not None)


def _experts_call(block: Any, args: tuple, kwargs: dict, remedy: str) -> tuple[Union[int, str], Union[int, str]]:
    """Where top_k_index and top_k_weights sit in a call of `block`'s experts
    module (an argument position, or a keyword): (ids key, weights key),
    checked to be an integer tensor and a floating one of its shape; else
    UnknownArchitecture, ending with `remedy`."""
    ids_key, weights_key = (position if len(args) > position else name
                            for position, name in ((1, "top_k_index"), (2, "top_k_weights")))
    ids, weights = _call_value(args, kwargs, ids_key), _call_value(args, kwargs, weights_key)
    if not (hasattr(ids, "dtype") and hasattr(weights, "dtype") and not ids.dtype.is_floating_point
            and weights.dtype.is_floating_point and tuple(ids.shape) == tuple(weights.shape)):
        raise UnknownArchitecture(
            f"{type(block).__name__}.experts was not called as experts(hidden_states, top_k_index [n, k] int, "
            f"top_k_weights [n, k] float); {remedy}")
    return ids_key, weights_key


def _call_value(args: tuple, kwargs: dict, key: Union[int, str]) -> Any:
    return args[key] if isinstance(key, int) else kwargs.get(key)


def _with_values(args: tuple, kwargs: dict, values: dict) -> tuple[tuple, dict]:
    """(args, kwargs) with the entries at `values`' keys replaced."""
    new_args, kwargs = list(args), dict(kwargs)
    for key, value in values.items():
        if isinstance(key, int):
            new_args[key] = value
        else:
            kwargs[key] = value
    return tuple(new_args), kwargs


class MoELayer:
    """One MoE layer as attach found it."""

    def __init__(self, index: int, name: str, router: torch.nn.Module, block: torch.nn.Module,
                 model_layer: Optional[int] = None, outer: Optional[torch.nn.Module] = None) -> None:
        self.index = index      # the capturer's layer number
        self.model_layer = model_layer  # its decoder layer in the model (None where attach cannot tell)
        self.model_layers: Optional[int] = None  # that decoder's num_hidden_layers, where model_layer is known
        self.name = name        # qualified name of the router module
        self.router = router
        self.block = block      # the module that owns the router (the sparse MoE block)
        self.shared = self.shared_gate = None
        # The block's shared expert, or else one beside the block in the module
        # that owns it (`outer`: GraniteMoE-Shared's decoder layer adds its
        # shared_mlp to the block's output).
        for owner in (block, outer):
            found = next(((e, g) for e, g in _SHARED if getattr(owner, e, None) is not None), None)
            if found is not None:
                self.shared = getattr(owner, found[0])
                self.shared_gate = getattr(owner, found[1], None) if found[1] else None
                break

    def __repr__(self) -> str:
        return (f"MoELayer({self.index}, {self.name!r}, model_layer={self.model_layer}, "
                f"shared={self.shared is not None})")


def _routers_of_blocks(model: torch.nn.Module, recorder: Any) -> list[torch.nn.Module]:
    """The modules the model records router_logits from (its recorder's class,
    under its layer_name where it names one, as transformers matches it:
    Jamba's is any nn.Linear named "router"), and every module a block of the
    same class keeps under the same name: DeepSeek-V4's first MoE blocks hold a
    hash router where the others hold the recorded top-k router, and the
    recorder names only that one."""
    recorded, layer_name = recorder.target_class, getattr(recorder, "layer_name", None)
    wanted = None if layer_name is None else "." + layer_name.strip(".") + "."
    slots = set()
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            qualified = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, recorded) and (wanted is None or wanted in "." + qualified + "."):
                slots.add((type(parent), name))
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if (type(parent), name) in slots:
                found.append(child)
    return found


def find_moe_layers(model: torch.nn.Module, routers: Optional[Routers] = None) -> list[MoELayer]:
    """The model's MoE layers in forward order. routers: the router modules
    (or their class) where the model does not declare one."""
    names = dict((id(m), n) for n, m in model.named_modules())
    if routers is None:
        recorder = _router_recorder(model)
        if getattr(recorder, "target_class", None) is None:
            raise UnknownArchitecture(
                f"{type(model).__name__} ({_model_type(model)!r}) declares no router module "
                "(no 'router_logits' output recorder); pass routers=[the router modules] and selector=")
        routers = _routers_of_blocks(model, recorder)
    if isinstance(routers, type):
        routers = [m for m in model.modules() if isinstance(m, routers)]
    parents: dict[int, Any] = {}
    for parent_name, parent in model.named_modules():
        for child in parent.children():
            parents.setdefault(id(child), parent)
    layers = []
    for i, r in enumerate(routers):
        if id(r) not in names:
            raise ValueError(f"routers[{i}] ({type(r).__name__}) is not a module of this model")
        block = parents.get(id(r), r)
        layers.append(MoELayer(i, names[id(r)], r, block, outer=parents.get(id(block))))
    if not layers:
        raise UnknownArchitecture(f"{type(model).__name__} has no router modules to capture")
    located = _decoder_layers(model, [layer.name for layer in layers])
    if located is not None:
        found, hidden = located
        for layer, model_layer in zip(layers, found):
            layer.model_layer, layer.model_layers = model_layer, hidden
    _refuse_looped_moe_layers(model, layers)
    return layers


def _refuse_looped_moe_layers(model: torch.nn.Module, layers: Sequence[MoELayer]) -> None:
    """Inkling 2-Loop runs decoder layers [loop_layer_index_start,
    loop_layer_index_end) loop_num_passes times in each forward. A capturer
    (and every engine's payload) holds one row per token and layer, so each
    pass of a looped MoE layer would overwrite the one before it and a replay
    force one pass's experts onto all: refused unless the loop runs once or
    holds no MoE layer."""
    config = getattr(model, "config", None)
    for c in (config, getattr(config, "text_config", None)):
        passes = getattr(c, "loop_num_passes", None)
        start, end = getattr(c, "loop_layer_index_start", None), getattr(c, "loop_layer_index_end", None)
        if not isinstance(passes, int) or passes <= 1 or not isinstance(start, int) or not isinstance(end, int):
            continue
        looped = [layer.model_layer for layer in layers
                  if layer.model_layer is None or start <= layer.model_layer < end]
        if looped:
            raise ValueError(
                f"{type(model).__name__} runs decoder layers [{start}, {end}) loop_num_passes = {passes} times per "
                f"forward, and its MoE layers there ({'unplaced' if None in looped else looped}) route anew in each "
                "pass: a capturer holds one row per token and layer, so moecap can neither record nor replay them")


def num_hidden_layers(model: torch.nn.Module) -> Optional[int]:
    """The model's decoder layer count (its config's num_hidden_layers, or the
    text config's for a multimodal wrapper; LongCat-Flash's num_layers, as
    _model.decoder_layers reads it); None if it declares none."""
    config = getattr(model, "config", None)
    for c in (config, getattr(config, "text_config", None)):
        if isinstance(getattr(c, "num_hidden_layers", None), int):
            return _model.decoder_layers(c)
    return None


def _decoder_layers(model: torch.nn.Module, router_names: Sequence[str]) -> Optional[tuple[list[int], int]]:
    """The decoder layer index of each router and the decoder's layer count:
    each router's position in a decoder ModuleList (one with num_hidden_layers
    entries that holds every router), which is how DeepSeek's first dense
    layers and Qwen2-MoE's mlp_only_layers show up (no router there). The
    count is the model's config's, or, for a module without one (a value-head
    or DataParallel wrapper, Qwen3-Omni's thinker inside its model), that of
    the first module under it whose config declares one and whose list holds
    the routers. None if no such list holds them."""
    owners = ((name, module, num_hidden_layers(module)) for name, module in model.named_modules())
    for owner_name, owner, hidden in owners:
        if hidden is None:
            continue
        for list_name, module in owner.named_modules(prefix=owner_name):
            if type(module).__name__ != "ModuleList" or len(module) != hidden:
                continue
            prefix = f"{list_name}." if list_name else ""
            found = []
            for name in router_names:
                head = name[len(prefix):].split(".", 1)[0] if name.startswith(prefix) else ""
                if not head.isdigit():
                    break
                found.append(int(head))
            if len(found) == len(router_names) and all(b > a for a, b in zip(found, found[1:])):
                return found, hidden
    return None


def layer_map(model: torch.nn.Module, layers: Optional[Sequence[MoELayer]] = None) -> Optional[LayerMap]:
    """The LayerMap (moecap.record) of a model's MoE layers: each one's decoder
    layer and the model's num_hidden_layers. None where attach cannot place the
    routers in the model's decoder layers (routers outside a decoder ModuleList)."""
    from .record import LayerMap
    layers = find_moe_layers(model) if layers is None else layers
    if any(layer.model_layer is None for layer in layers):
        return None
    return LayerMap(tuple(layer.model_layer for layer in layers), layers[0].model_layers)


class Attached:
    """What attach returns: the layers it hooks; detach() removes every hook.
    layer_map: each MoE layer's model layer and the model's num_hidden_layers
    (a moecap.record.LayerMap, also set as the capturer's `layer_map`), or None."""

    def __init__(self, layers: list[MoELayer], hooks: list[Any], runner: _Runner,
                 layer_map: Optional[LayerMap] = None) -> None:
        self.layers = layers
        self._hooks = hooks
        self._runner = runner
        self.layer_map = layer_map

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_experts(self) -> int:
        return self._runner.num_experts

    @property
    def top_k(self) -> int:
        return self._runner.top_k

    @property
    def shared_column(self) -> int:
        """1 if the shared expert rides as column top_k."""
        return self._runner.shared_column

    def idle_step(self) -> None:
        """For an attention-DP rank with no tokens this step: joins each MoE
        layer's gather with zero rows and captures the gathered batch, as
        the rank's dummy forward would."""
        for layer in self.layers:
            self._runner.deliver(layer, None, None)

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self) -> Attached:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()


def _compile_ops(capturer):
    """The capturer's custom ops for the hooks to call under torch.compile,
    taken at attach (inside traced code, exporting the buffers would break the
    graph) and held by the runner; None for a capturer other than moecap's or
    a torch without torch.library custom ops."""
    from . import Capturer
    if not isinstance(capturer, Capturer):
        return None
    try:
        return capturer.ops
    except ImportError:
        return None


class _Runner:
    """Turns one layer's routing into a capture call (after the DP gather)."""

    def __init__(self, capturer, gather, keep_weights, shared_column, num_experts, top_k, stream):
        self.capturer = capturer
        self.gather = gather
        self.keep_weights = keep_weights
        self.shared_column = shared_column
        self.num_experts = num_experts
        self.top_k = top_k
        self.stream = stream
        self.pending = {}  # block id -> (ids, weights) waiting for the shared gate
        self.ops = _compile_ops(capturer) if stream is None else None
        # layer -> the capturer's commit count at its last eager capture, shared by every attach to the
        # capturer: two models capturing one layer before a commit overwrite each other's rows too.
        try:
            self.captured_at = _CAPTURED_AT.setdefault(capturer, {})
        except TypeError:  # a capturer of another library's that cannot be weakly referenced or hashed: its own
            self.captured_at = {}
        self.warned = False
        import torch
        # Traced code calls the extension through this: a graph break, then the call runs eagerly (Dynamo
        # would call the extension's method itself, and miss its self).
        self.capture_outside_graph = torch.compiler.disable(self.capture)

    def deliver(self, layer, ids, weights):
        import torch
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
            return  # gradient checkpointing recomputes the forward in the backward: its routing was captured
        if ids is None:  # an idle rank: zero rows, on the device the layer's routing lives on
            device = next(layer.router.parameters(), torch.empty(0)).device
            ids = torch.empty((0, self.top_k + self.shared_column), dtype=torch.int64, device=device)
            weights = torch.empty(ids.shape, dtype=torch.float32, device=device) if self.keep_weights else None
        if self.gather is not None:
            ids, weights = self.gather(layer.index, ids, weights)
        ids = ids.contiguous()
        weights = weights.contiguous() if self.keep_weights else None
        # Under torch.compile, the custom op (capturing on torch's current stream) is
        # what Dynamo traces; a capture on a stream of attach's, or into a capturer
        # without ops, stays the extension's call, where Dynamo breaks the graph.
        if self.ops is not None and torch.compiler.is_compiling():
            self.ops.capture(layer.index, ids, weights)
        elif torch.compiler.is_compiling():
            self.capture_outside_graph(layer.index, ids, weights)
        else:
            self.capture(layer.index, ids, weights)

    def capture(self, index, ids, weights):
        self._warn_if_uncommitted(index)
        self.capturer.capture(index, ids, weights, stream=self.stream)

    def _warn_if_uncommitted(self, index):
        """A layer captured twice with no commit between overwrites the first
        forward's rows (generate() without GenerationRecorder). Once per attach."""
        commits = getattr(self.capturer, "_commits", None)
        if commits is None:
            return
        if self.captured_at.get(index) == commits and not self.warned:
            self.warned = True
            warnings.warn(f"moecap.hf: MoE layer {index} captured again with no commit since its last capture, so "
                          "this forward's rows overwrite the last one's: commit each forward's rows (with "
                          "model.generate(), pass logits_processor=[moecap.hf.GenerationRecorder(...)])",
                          UncommittedCaptureWarning, stacklevel=_caller_outside_frameworks())
        self.captured_at[index] = commits


_CAPTURED_AT: weakref.WeakKeyDictionary[Any, dict[int, int]] = weakref.WeakKeyDictionary()


def _caller_outside_frameworks() -> int:
    """The stacklevel, for a warning issued by this function's caller, of the
    first frame outside moecap, torch and transformers: the line of the
    user's code that ran the forward (a hook sits under torch's module call
    and the model's own forward)."""
    import os
    import sys

    packages = (__name__.split(".")[0], "torch", "transformers")
    files = (getattr(sys.modules.get(name), "__file__", None) for name in packages)
    folders = tuple(os.path.dirname(file) + os.sep for file in files if file)
    frame: Optional[Any] = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(folders):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def attach(model: torch.nn.Module, capturer: Capturer, *, selector: Optional[Selector] = None,
           routers: Optional[Routers] = None, shared_expert: Optional[bool] = None,
           gather: Optional[Gather] = None, stream: Any = None) -> Attached:
    """Hooks every MoE layer of `model` to capture its routing into `capturer`.

    The capturer's num_layers, top_k and num_experts must match the model;
    weights are captured iff the capturer keeps them (weight_dtype).
    shared_expert: append the shared expert as column top_k (id num_experts,
    weight its gate, or without one 1.0, or 1 / the factor a block scales
    its routed sum by; Inkling's: the gamma its router gives it per token,
    refused where it has several shared experts); default: iff the capturer has
    extra_columns and the model has a shared expert. gather: for attention
    data parallelism, fn(layer, ids, weights) -> (ids, weights) that
    all-gathers every rank's rows back to back (the engine's DP gather).
    selector: fn(router, inputs, output) -> (ids, weights) for a model whose
    routers do not return (logits, weights, indices); required unless the
    model's type, or that of the model class recording its routers, is in
    KNOWN. stream: where every capture is enqueued (None:
    the capturer's default).

    The model compiles with torch.compile(fullgraph=True): traced, the hooks
    capture through the capturer's custom ops (moecap.ops) on torch's current
    stream; with a stream they call the extension, which Dynamo cannot trace.
    """
    if selector is None and _known_type(model) is None:
        raise UnknownArchitecture(
            f"moecap.hf does not know how {type(model).__name__} (model_type {_model_type(model)!r}) picks its "
            "experts; "
            f"it knows {', '.join(sorted(KNOWN))}. Pass selector=fn(router, inputs, output) -> "
            "(ids [tokens, top_k] int, weights [tokens, top_k] float or None) returning the experts the "
            "router picked (and routers=[router modules] if the model declares no router class)")
    layers = find_moe_layers(model, routers)
    config = getattr(capturer, "config", {})
    # A selector's model may keep its dims where attach cannot read them: the capturer's then.
    top_k, num_experts = _routing_dims(model, layers[0].router, config if selector is not None else None)
    # HunYuan's config may give each layer its own top_k; a capturer holds one width (a selector of its own
    # may widen the narrower layers' picks).
    widths = [getattr(layer.router, "top_k", None) for layer in layers]
    if selector is None and any(isinstance(k, int) and not isinstance(k, bool) and k != top_k for k in widths):
        raise ValueError(f"{type(model).__name__}'s MoE layers pick different numbers of experts per token "
                         f"({', '.join(f'layer {layer.index}: {k}' for layer, k in zip(layers, widths))}); a "
                         "capturer holds one top_k for every layer")
    own_selector, selector = selector, selector or default_selector
    extra = int(config.get("extra_columns", 0))
    has_shared = any(layer.shared is not None for layer in layers)
    if shared_expert is None:
        shared_expert = extra >= 1 and has_shared
    if shared_expert and not has_shared:
        raise ValueError(f"shared_expert=True but {type(model).__name__} has no shared expert")
    for name, want in (("num_layers", len(layers)), ("top_k", top_k), ("num_experts", num_experts)):
        if name in config and int(config[name]) != want:
            raise ValueError(f"capturer has {name}={config[name]}; the model has {want} "
                             f"({len(layers)} MoE layers, top-{top_k} of {num_experts} experts"
                             f"{_past_routed(layers[0].router, num_experts)})")
    if shared_expert and extra < 1:
        raise ValueError("shared_expert=True needs a capturer with extra_columns >= 1")
    router = layers[0].router
    if shared_expert and type(router).__name__.startswith(_WITH_SHARED_GAMMAS) and router.n_shared_experts != 1:
        # Each of Inkling's shared experts has its own per-token gamma: one column cannot carry them.
        raise ValueError(f"shared_expert=True: {type(model).__name__} has {router.n_shared_experts} shared experts, "
                         "each weighed per token by its own gamma, and the shared column carries one expert's "
                         "weight; pass shared_expert=False (or a capturer without extra_columns)")
    keep_weights = config.get("weight_dtype") is not None
    mapped = layer_map(model, layers)
    if mapped is not None:
        # RequestTable reads it at finish: what a request read from this capturer comes back as.
        try:
            capturer.layer_map = mapped
        except AttributeError:  # a capturer that takes no attributes: the handle still says it
            pass
    runner = _Runner(capturer, gather, keep_weights, int(bool(shared_expert)), num_experts, top_k, stream)
    hooks = []
    for layer in layers:
        if own_selector is None and _picked_by_block(layer):  # none of these blocks has a shared expert
            hooks.append(_pre_hook_own(layer.block.experts, _experts_hook(layer, runner)))
            continue
        hooks.append(_hook_own(layer.router, _router_hook(layer, runner, selector, shared_expert)))
        if shared_expert:
            hooks.append(_hook_own(layer.block, _block_hook(layer, runner)))
            if layer.shared_gate is not None:
                hooks.append(_hook_own(layer.shared_gate, _gate_hook(layer, runner)))
    return Attached(layers, hooks, runner, mapped)


_PACKED = ("GenerationRecorder: the model ran continuous batching (generate_batch, or generate with "
           "cache_implementation='paged'), which packs every request's tokens into one row and calls no logits "
           "processor; the recorder records generate()'s batches of one row per sequence")

# Recorders that have recorded and whose table still holds rows not read (they share the capturer's slots).
_RECORDERS_HOLDING_ROWS: weakref.WeakSet[GenerationRecorder] = weakref.WeakSet()


class GenerationRecorder:
    """A logits processor that commits every forward of one ``model.generate()``
    call and reads each sequence's routing back::

        handle = moecap.hf.attach(model, capturer)
        with moecap.hf.GenerationRecorder(model, capturer, attention_mask) as recorder:
            out = model.generate(input_ids, attention_mask=attention_mask, logits_processor=[recorder])
        routed = recorder.routed(0)   # row 0's real tokens but the last

    generate() runs one forward per new token, and a capturer keeps one step's
    rows until a commit: the next forward's captures would overwrite them.
    generate calls this after each forward (outside a compiled forward, too),
    and it commits that forward's rows: row b's position p to slot
    ``b * (host_slots // batch) + p``, padding to -1 (a forward pre-hook on
    `model` counts the tokens each forward takes). `attention_mask` is the
    ``[batch, prompt_len]`` mask of the input_ids (or inputs_embeds) given to
    generate, left or right padded.

    For greedy decoding and sampling, with a dynamic or static cache or none,
    and from a cache that already holds the sequence's start (a conversation's
    next turn: the routing then starts at the first position forwarded). One
    recorder per generate() call. Refused with a ValueError: more than one
    sequence per prompt row (beam search, num_return_sequences > 1: repeat the
    prompt rows instead), decoding that runs other than one forward between
    two calls (assisted generation, chunked prefill), a second generate()
    call, an attention_mask narrower or wider than generate's input_ids, an
    encoder-decoder model, and continuous batching (generate_batch, or
    cache_implementation="paged": it packs every request into one row and
    calls no logits processor). Recorders on one capturer share its slots: a
    second one refuses to record while another still holds rows routed() has
    not read. One process: no attention-DP gather.
    """

    def __init__(self, model: torch.nn.Module, capturer: Capturer, attention_mask: Any) -> None:
        import numpy as np

        from .engine import RequestTable
        mask = attention_mask.detach().cpu().numpy() if hasattr(attention_mask, "detach") else np.asarray(attention_mask)
        if mask.ndim != 2:
            raise ValueError(f"attention_mask has shape {mask.shape}; expected the prompt's [batch, prompt_len]")
        if int(capturer.config["dp_size"]) != 1:
            raise ValueError(f"GenerationRecorder: the capturer has dp_size {capturer.config['dp_size']}; it "
                             "commits a generate() batch of one process (rows [0, batch * tokens)), dp_size 1")
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            raise ValueError(f"GenerationRecorder: {type(model).__name__} is an encoder-decoder model; the recorder "
                             "records a decoder-only generate() (an encoder's layers run outside the forwards it "
                             "counts)")
        self._mask = mask.astype(bool)
        self._batch = mask.shape[0]
        host_slots = int(capturer.config["host_slots"])
        self._per_row = host_slots // max(self._batch, 1)
        self.capturer = capturer
        self._table = RequestTable(capturer)  # a row enters it when routed() reads it
        self._unread: set[int] = set()  # rows recorded and not yet read by routed()
        # Each forward's [batch, tokens] slots (-1: padding, or a position recorded before), kept per forward
        # and joined per row in routed(): no Python loop over the rows at each token.
        self._recorded_slots: list[Any] = []
        self._recorded: Optional[int] = None  # positions forwarded so far; None before the first call
        self._starts: list[int] = []  # each row's first position forwarded (its real tokens before it)
        self._offset = 0  # prompt positions input_ids leaves out (a prompt given as inputs_embeds)
        self._forwards: list[int] = []  # tokens per row of each forward since the last call
        self._packed = False  # the model ran a continuous-batching forward
        # The hook holds the recorder weakly: a recorder dropped unclosed holds no slots (_RECORDERS_HOLDING_ROWS).
        # Counted for `model` only: copy.deepcopy of the model (an RL reference model) copies this hook too.
        recorder, counted = weakref.ref(self), weakref.ref(model)

        def count_tokens(module: Any, args: tuple, kwargs: dict) -> None:
            alive = recorder()
            if alive is not None and module is counted():
                alive._count_tokens(module, args, kwargs)

        self._hook = model.register_forward_pre_hook(count_tokens, with_kwargs=True)
        weakref.finalize(self, self._hook.remove)

    def _count_tokens(self, module: Any, args: tuple, kwargs: dict) -> None:
        if "logits_indices" in kwargs or "cu_seq_lens_q" in kwargs:  # transformers' continuous batching
            self._packed = True
            return
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None:
            raise ValueError("GenerationRecorder: the forward got neither input_ids nor inputs_embeds")
        self._forwards.append(int(tokens.shape[1]))

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import numpy as np
        forwards, self._forwards = self._forwards, []
        batch, length = int(input_ids.shape[0]), int(input_ids.shape[1]) + self._offset
        first_call = self._recorded is None
        if first_call and len(forwards) == 1 and length == 0:
            # input_ids hold only the tokens generated so far: the prompt went in as inputs_embeds.
            self._offset = self._mask.shape[1]
            length = self._offset
        refused: Optional[Exception] = None
        holder = next((r for r in _RECORDERS_HOLDING_ROWS if r.capturer is self.capturer and r._unread), None) \
            if first_call else None
        if self._packed:
            refused = ValueError(_PACKED)
        elif holder is not None:
            refused = ValueError(f"GenerationRecorder: another recorder on this capturer still holds the rows of "
                                 f"{len(holder._unread)} sequence{'s' if len(holder._unread) > 1 else ''} in the "
                                 "slots this one writes: read them with its routed() (or drop it) first")
        elif first_call and self._offset == 0 and length != self._mask.shape[1]:
            refused = ValueError(f"GenerationRecorder: attention_mask has {self._mask.shape[1]} positions; "
                                 f"generate's input_ids have {length}: give the recorder generate's attention_mask")
        elif not first_call and len(self._unread) < self._batch:  # routed() read a row
            refused = ValueError("GenerationRecorder: routed() was called; a recorder records one generate() call")
        elif batch != self._batch:
            refused = ValueError(f"GenerationRecorder: generate runs {batch} sequences for {self._batch} prompt "
                                 "rows; it records one sequence per row (no beam search, num_return_sequences=1: "
                                 "repeat the prompt rows instead)")
        elif len(forwards) != 1:
            refused = ValueError(f"GenerationRecorder: {len(forwards)} forwards since the last call; it records "
                                 "generate's one forward per new token (not assisted generation or chunked prefill)")
        elif forwards[0] > length or (self._recorded is not None and length != self._recorded + 1):
            refused = ValueError(f"GenerationRecorder: a forward of {forwards[0]} tokens up to position {length - 1} "
                                 f"after {self._recorded} positions; a recorder records one generate() call: make "
                                 "a new one for each")
        elif length > self._per_row:
            refused = MoecapError(Status.CAPACITY, f"GenerationRecorder: position {length - 1} of {self._batch} "
                                  f"rows needs host_slots >= {self._batch * length}; host_slots is "
                                  f"{self.capturer.config['host_slots']}")
        if refused is not None:
            if forwards:  # the rows the forward captured go nowhere, so the next forward starts a step
                self.capturer.commit(np.full(batch * max(forwards), -1))
            raise refused
        positions = np.arange(length - forwards[0], length)
        prompt = self._mask.shape[1]
        real = np.ones((batch, positions.size), dtype=bool)
        in_prompt = positions < prompt
        real[:, in_prompt] = self._mask[:, positions[in_prompt]]
        if self._recorded is None:  # the first call: a cache may hold the start, so each row's routing starts
            # at its first position forwarded
            self._starts = [int(self._mask[row, :positions[0]].sum()) for row in range(batch)]
            self._recorded = int(positions[0])
            self._unread = set(range(batch))
            _RECORDERS_HOLDING_ROWS.add(self)
        slots = np.where(real, np.arange(batch)[:, None] * self._per_row + positions[None, :], -1)
        self.capturer.commit(slots.reshape(-1))
        new = positions >= self._recorded  # a forward without the cache takes every position again
        self._recorded_slots.append(np.where(new[None, :], slots, -1))
        self._recorded = length
        return scores

    def routed(self, row: int, num_tokens: Optional[int] = None) -> RoutedExperts:
        """Row `row`'s routing: its real tokens (left padding left out) from
        its first position forwarded (0, but past a cache generate was given),
        the last sampled one excepted (it never went through a forward).
        num_tokens: the sequence's length where it ended before the batch did
        (at its EOS), so the pad tokens generate forwarded after it are left
        out. Its slots are invalidated: one call per row."""
        import numpy as np

        from . import _integer
        from .record import RoutedExperts
        row = _integer("row", row)
        if self._recorded is None and self._packed:
            raise ValueError(_PACKED)
        if self._recorded is None or not 0 <= row < self._batch:
            raise ValueError(f"row {row} has no routing: generate() has not called the recorder, or row is not in "
                             f"[0, {self._batch})")
        if row not in self._unread:
            raise ValueError(f"routed({row}) was called already; its slots were invalidated then")
        start = self._starts[row]
        slots = np.concatenate([forward[row] for forward in self._recorded_slots])
        slots = slots[slots >= 0]
        total = start + slots.size + 1
        if num_tokens is not None:  # checked before the read, which frees the row's slots
            num_tokens = _integer("num_tokens", num_tokens)
            if not start + 1 <= num_tokens <= total:
                raise ValueError(f"num_tokens is {num_tokens}; row {row} has {total} tokens and its routing starts "
                                 f"at position {start}")
        if row not in self._table:  # (there already where a read failed)
            self._table.start(row, start)
            self._table.append(row, slots)
        routed = self._table.finish(row)
        self._unread.discard(row)
        if num_tokens is None:
            return routed
        n = num_tokens - 1 - start
        return RoutedExperts(routed.ids[:n], routed.num_experts,
                             weights=None if routed.weights is None else routed.weights[:n],
                             valid=routed.valid[:n], start=routed.start, layers=routed.layers,
                             num_hidden_layers=routed.num_hidden_layers)

    def close(self) -> None:
        """Removes the forward pre-hook."""
        self._hook.remove()

    def __enter__(self) -> GenerationRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _hook_own(module, hook):
    """Registers `hook` on `module`, to run for that module only: copy.deepcopy
    of an attached model copies its hooks (an RL reference model made from the
    policy), and the copy's layers must not write into this capturer's rows."""
    def own(m, inputs, output):
        if m is module:
            hook(m, inputs, output)
    return module.register_forward_hook(own)


def _pre_hook_own(module, hook):
    """_hook_own for a hook that reads (and may replace) `module`'s inputs."""
    def own(m, args, kwargs):
        return hook(m, args, kwargs) if m is module else None
    return module.register_forward_pre_hook(own, with_kwargs=True)


def _experts_hook(layer, runner):
    def hook(module, args, kwargs):
        keys = _experts_call(layer.block, args, kwargs, "pass selector=fn(router, inputs, output) -> (ids, weights)")
        ids, weights = (_call_value(args, kwargs, key) for key in keys)
        ids = ids.reshape(-1, ids.shape[-1])
        runner.deliver(layer, ids, weights.reshape(ids.shape))
    return hook


def _router_hook(layer, runner, selector, shared_expert):
    def hook(module, inputs, output):
        ids, weights = selector(module, inputs, output)
        ids = ids.reshape(-1, ids.shape[-1])
        weights = None if weights is None else weights.reshape(ids.shape)
        if runner.keep_weights and weights is None:
            raise ValueError(f"the capturer keeps weights but the selector gave none for layer {layer.index}")
        if shared_expert:  # completed by the block hook, once the shared gate ran
            # Inkling's router weighs its shared expert itself, per token: its gamma is the column's weight
            gammas = _shared_gammas(module, output)
            gate = None if gammas is None else gammas.reshape(-1, 1).float()
            runner.pending[id(layer.block)] = [ids, weights, gate]
        else:
            runner.deliver(layer, ids, weights)
    return hook


def _gate_hook(layer, runner):
    def hook(module, inputs, output):
        runner.pending[id(layer.block)][2] = output.reshape(-1, 1).float().sigmoid()
    return hook


def _routed_sum_scale(block) -> float:
    """The factor a block multiplies its routed experts' sum by before adding
    the shared expert (Step 3.7's, Laguna's and MiniMax-M3-VL's
    routed_scaling_factor; DeepSeek-V3's family scales inside the router's
    weights instead), 1.0 for the others. The shared column's weight is its
    inverse, as a fused-shared-expert engine scales the whole fused sum."""
    scale = getattr(block, "routed_scaling_factor", None)
    return float(scale) if isinstance(scale, (int, float)) and scale > 0 else 1.0


def _block_hook(layer, runner):
    def hook(module, inputs, output):
        import torch
        ids, weights, gate = runner.pending.pop(id(layer.block))
        column = torch.full((ids.shape[0], 1), runner.num_experts, dtype=ids.dtype, device=ids.device)
        ids = torch.cat([ids, column], dim=1)
        if weights is not None:
            if gate is None:  # weight 1 beside the routed weights, whatever scale the block then gives their sum
                gate = torch.full((ids.shape[0], 1), 1.0 / _routed_sum_scale(layer.block), device=ids.device)
            weights = torch.cat([weights.float(), gate.to(weights.device)], dim=1)
        runner.deliver(layer, ids, weights)
    return hook


# --- replay: force routers to recorded experts ----------------------------------

def _recomputed_weights(router, logits, ids, hidden_dtype=None):
    """The weights `router` gives experts `ids` from its own logits: what
    Megatron-style router replay trains through. router: the module that
    weighs them (a _PICKED_BY_BLOCK block, for its bare-logits router).
    hidden_dtype: its input's dtype, where the router rounds its weights through it."""
    import torch
    kind = type(router).__name__
    logits = logits.reshape(-1, logits.shape[-1])
    if kind.startswith("DbrxFFN"):  # softmax in the logits' dtype, divided by the picked weights' p-norm
        w = torch.softmax(logits, dim=-1, dtype=logits.dtype).gather(1, ids)
        p = router.moe_normalize_expert_weights
        return w if p is None else w / torch.norm(w, p=p, dim=-1, keepdim=True)
    if kind.startswith(("JambaSparseMoeBlock", "JambaTopKRouter")):  # float32 softmax, rounded to the input's dtype
        w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
        return w if hidden_dtype is None else w.to(hidden_dtype)
    if kind.startswith(("Mixtral", "MiniMaxTopK")):
        w = torch.softmax(logits.float(), dim=-1).gather(1, ids)
        return w / w.sum(dim=-1, keepdim=True)
    if kind.startswith("LaraMini"):  # the softmax in the logits' dtype (bf16 under autocast), rounded to the input's
        w = torch.softmax(logits, dim=-1).gather(1, ids)
        w = w / w.sum(dim=-1, keepdim=True) if router.norm_topk_prob else w
        return w if hidden_dtype is None else w.to(hidden_dtype)
    if kind.startswith(("Qwen2Moe", "Qwen3Moe", "Olmoe", "Qwen3Next", "FlexOlmo", "HunYuan", "Qwen3_5Moe",
                        "Qwen3VLMoe", "Qwen3OmniMoeThinkerText", "Qwen4ExpText", "Mellum")):
        w = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, ids)
        if kind.startswith(("HunYuan", "Qwen3_5Moe", "Qwen3VLMoe")) or router.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(logits.dtype)
    if kind.startswith(("GraniteMoe", "GptOss", "AriaText", "Cohere2Moe")):
        if getattr(router, "expert_selection_fn", "softmax") == "sigmoid":  # Cohere2-MoE's other rule, in the
            w = logits.gather(1, ids).sigmoid()                              # logits' dtype
            return w / w.sum(dim=-1, keepdim=True) if router.norm_topk_prob else w
        return torch.softmax(logits.float().gather(1, ids), dim=-1)
    if kind.startswith("Llama4Router"):
        return torch.sigmoid(logits.gather(1, ids).float())
    if kind.startswith("Gemma4Text"):  # its "logits" are already the softmax
        w = logits.float().gather(1, ids)
        return w / w.sum(dim=-1, keepdim=True) * router.per_expert_scale[ids]
    if kind.startswith(("DeepseekV2", "DeepseekOcr2Text", "UnlimitedOcrText")):
        return logits.float().softmax(dim=-1).gather(1, ids) * router.routed_scaling_factor
    if kind.startswith("LongcatFlash"):  # the softmax in the logits' dtype (bf16 under CPU autocast)
        return logits.softmax(dim=-1).gather(1, ids) * router.routed_scaling_factor
    if kind.startswith("Ernie4_5_Moe"):
        w = torch.softmax(logits.float(), dim=1).gather(1, ids)
        return w / torch.clamp(w.sum(dim=-1, keepdim=True), min=router.norm_min)
    if kind.startswith("ZayaRouter"):  # the softmax over the experts and the skip expert, in the logits' dtype
        return torch.softmax(logits, dim=-1).gather(1, ids)
    if kind.startswith(("MiniMaxM2", "Step3p7", "MiniMaxM3VL", "Laguna")):
        w = logits.float().sigmoid().gather(1, ids)
        return w / w.sum(dim=-1, keepdim=True)
    if kind.startswith(("DeepseekV4", "Inkling2")):  # DeepSeek-V4's top-k and hash routers weigh alike: score_fn
        w = router.score_fn(logits).gather(1, ids)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * router.routed_scaling_factor
    if kind.startswith(("Ergo", "MuseSpark")):  # Muse Spark's logits come scaled by its output_multiplier
        # Muse Spark weighs in its logits' dtype: float32, or bf16 where autocast runs its float32 linear in bf16
        w = (logits.float() if kind.startswith("Ergo") else logits).sigmoid().gather(1, ids)
        eps = getattr(router, "norm_topk_prob_eps", 1e-20)
        w = w / (w.sum(dim=-1, keepdim=True) + eps) * router.routed_scaling_factor
        # Ergo's router rounds its float32 weights through its input's dtype
        return w.to(hidden_dtype).float() if kind.startswith("Ergo") and hidden_dtype is not None else w
    if kind.startswith(("Flint", "Kolibri1")):  # the sigmoid of the picked logits (Kolibri 1 picks them biased)
        if kind.startswith("Flint"):  # of all its logits, then picked: a vectorized sigmoid rounds by position
            w = logits.float().sigmoid().gather(1, ids)
        else:  # in the logits' dtype, as Kolibri 1 weighs (bf16 under autocast)
            w = logits.gather(1, ids).sigmoid()
        return w / w.sum(dim=-1, keepdim=True) if router.norm_topk_prob else w
    if kind.startswith("Lfm2Moe"):
        w = logits.sigmoid().gather(1, ids)
        if router.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-6)
        return w * router.routed_scaling_factor
    if kind.startswith(("Afmoe", "HYV3")):  # in the logits' dtype: HY-V3's are bf16 under autocast, AFMoE's float32
        w = logits.sigmoid().gather(1, ids)
        scale = router.route_scale if kind.startswith("Afmoe") else router.router_scaling_factor
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scale
    if kind.startswith(("DeepseekV3", "Glm4Moe", "Dots1", "SolarOpen", "NemotronH", "GlmMoeDsa", "KimiLinear",
                        "Mistral4", "Glm5NextText", "Glm4vMoeText", "ExaoneMoe", "MiMoV2Flash", "HYV4", "AXK1",
                        "AXK2", "MiniCPM5Moe", "BailingHybrid", "Dots3NoteText", "MistralLarge4Text", "Beam")):
        softmax = kind.startswith(("Mistral4", "MistralLarge4"))
        w = (logits.softmax(-1) if softmax else logits.sigmoid()).gather(1, ids)
        if kind.startswith("MistralLarge4") or router.norm_topk_prob:  # Mistral Large 4's always renormalizes
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w if kind.startswith("Beam") else w * router.routed_scaling_factor  # Beam's block scales its sum
    raise UnknownArchitecture(f"replay cannot recompute {kind}'s weights for forced experts; pass weights=")


def _weights_and_gammas(router, logits, ids):
    """Inkling's weights for experts `ids` and its shared experts' gammas, from
    its full logits [n, num_experts + n_shared_experts] (routed, then shared):
    the sigmoids of the picked and the shared experts' logits, normalized
    together, times route_scale and global_scale."""
    import torch
    shared = router.n_shared_experts
    if logits.shape[-1] != router.num_experts + shared:
        raise UnknownArchitecture(f"{type(router).__name__}'s weights need its shared experts' logits too: "
                                  f"[tokens, {router.num_experts + shared}] logits, not {tuple(logits.shape)}")
    # In the logits' dtype, as the router weighs: float32 in transformers 5.25, the model's (or autocast's)
    # dtype before, where its (1,)-shaped global_scale promotes the product as it does there.
    logits = logits.reshape(-1, logits.shape[-1])
    picked = torch.cat([logits[:, :router.num_experts].gather(1, ids), logits[:, router.num_experts:]], dim=-1)
    log_probs = torch.nn.functional.logsigmoid(picked)
    w = torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True))
    w = w * router.route_scale * router.global_scale
    return w[:, :ids.shape[-1]], w[:, ids.shape[-1]:]


def _full_logits(router, inputs, routed):
    """Inkling's logits over its routed and shared experts: the routed ones it
    returned, and the shared ones taken again from its input, as it took them."""
    import torch
    if not inputs:
        raise UnknownArchitecture(f"{type(router).__name__} was called without positional hidden states: replay "
                                  "cannot take its shared experts' logits; pass weights=")
    flat = inputs[0].reshape(-1, router.hidden_dim)
    # At the routed logits' dtype with autocast off: float32 where the router turns autocast off itself
    # (transformers 5.25), autocast's dtype where its product ran under autocast (5.19). The whole product,
    # as the router takes it: a product of the shared rows alone can sum in another order.
    with torch.autocast(flat.device.type, enabled=False):
        logits = torch.nn.functional.linear(flat.to(routed.dtype), router.weight.to(routed.dtype))
    shared = logits[:, router.num_experts:]
    return torch.cat([routed.reshape(-1, routed.shape[-1]), shared], dim=-1)


@contextlib.contextmanager
def replay(model: torch.nn.Module, ids: Sequence[Any], weights: Optional[Sequence[Any]] = None,
           routers: Optional[Routers] = None) -> Iterator[list[MoELayer]]:
    """Within the block, every MoE layer routes to the recorded experts.

    ids: per MoE layer an int [tokens, top_k] (RoutedExperts.to_megatron()),
    tokens in the order the forward flattens them. weights: None, to take the
    router's own weights for those experts from its logits (how router replay
    trains), or per layer [tokens, top_k] to force those too. Inkling's router
    returns its shared experts' gammas as a fourth output, normalized together
    with the picked experts' weights: recomputed for the forced experts with
    weights=None, left as the router gave them with weights given. Where a
    block picks from its router's bare logits (DBRX's, Jamba's in
    transformers 5.19) the ids and weights are forced where its experts module
    receives them, the weights by the block's rule. Recomputed weights are
    rounded as the router rounds its own. Given weights must be floating and
    shaped as the layer's ids; the ids an integer tensor. The ids are
    checked when the block is entered (for a selector's model, whose expert
    count attach cannot tell, on each layer's first eager forward): one
    outside [0, num_experts), -1 included, raises ValueError naming the layer
    and entry. Its hooks run ahead of those already there: a capturer
    attached before the block records the forced routing too.
    """
    import torch
    layers = find_moe_layers(model, routers)
    if len(ids) != len(layers):
        raise ValueError(f"ids has {len(ids)} layers; the model has {len(layers)} MoE layers")
    if weights is not None and len(weights) != len(layers):
        raise ValueError(f"weights has {len(weights)} layers; the model has {len(layers)} MoE layers")
    checked: set[int] = set()  # layers whose ids were range-checked: once each, not every forward
    try:
        _, num_experts = _routing_dims(model, layers[0].router)
    except UnknownArchitecture:  # a selector's model: each layer is checked on its first eager forward
        num_experts = None
    if num_experts is not None:  # here, eagerly, so that a compiled forward runs checked ids too
        for layer in layers:
            _check_replayed_ids(layer.index, torch.as_tensor(ids[layer.index]), num_experts, checked)

    def make(layer):
        def hook(module, inputs, output):
            if _scores_and_logits(module, output):
                return _forced_scores(module, output, layer.index, ids[layer.index],
                                      None if weights is None else weights[layer.index], checked)
            order = _router_output_order(module, output)
            own_gammas = _shared_gammas(module, output)
            logits, own_weights, own_ids = (output[i] for i in order)
            forced = _forced_ids(layer.index, ids[layer.index], own_ids, logits.shape[-1], checked)
            replaced = list(output)  # a fourth output (Inkling's gammas) stays in its place
            if weights is not None:
                w = _forced_weights(layer.index, weights[layer.index], forced, own_weights.device)
            elif own_gammas is not None:
                w, gammas = _weights_and_gammas(module, _full_logits(module, inputs, logits), forced.long())
                replaced[-1] = gammas.to(own_gammas.dtype).reshape(own_gammas.shape)
            else:
                w = _recomputed_weights(module, logits, forced, inputs[0].dtype if inputs else None)
            if type(module).__name__.startswith(_WITH_SKIP_EXPERT):
                forced, w = _skip_picks_masked(module, forced, w.reshape(forced.shape))
            replaced[order[0]], replaced[order[1]], replaced[order[2]] = (
                logits, w.to(own_weights.dtype).reshape(own_weights.shape), forced.reshape(own_ids.shape))
            return tuple(replaced)
        return hook

    def make_picked(layer):
        # The block picks from its router's logits: kept here, forced where its experts receive the picks.
        router_logits = None

        def keep(module, inputs, output):
            nonlocal router_logits
            router_logits = output

        def force(module, args, kwargs):
            nonlocal router_logits
            ids_key, weights_key = _experts_call(layer.block, args, kwargs,
                                                 "replay cannot force the experts this block picks")
            own_ids, own_weights = _call_value(args, kwargs, ids_key), _call_value(args, kwargs, weights_key)
            logits, router_logits = router_logits, None  # one router call weighs one experts call
            rows = own_ids.reshape(-1, own_ids.shape[-1]).shape[0]
            if logits is None or logits.reshape(-1, logits.shape[-1]).shape[0] != rows:
                raise UnknownArchitecture(
                    f"layer {layer.index}: {type(layer.block).__name__}'s experts route {rows} tokens, but its "
                    f"router gave {'no logits' if logits is None else 'logits of ' + str(tuple(logits.shape))} "
                    "just before: replay cannot weigh the forced experts")
            forced = _forced_ids(layer.index, ids[layer.index], own_ids, logits.shape[-1], checked)
            if weights is not None:
                w = _forced_weights(layer.index, weights[layer.index], forced, own_weights.device)
            else:
                w = _recomputed_weights(layer.block, logits, forced.long(), args[0].dtype if args else None)
            return _with_values(args, kwargs, {ids_key: forced.reshape(own_ids.shape),
                                               weights_key: w.to(own_weights.dtype).reshape(own_weights.shape)})
        return keep, force

    # Ahead of every hook already there: an attach made before replay began
    # (at load, as trainers keep it) must capture the forced routing.
    hooks = []
    for layer in layers:
        if _picked_by_block(layer):
            keep, force = make_picked(layer)
            hooks.append(layer.router.register_forward_hook(keep, prepend=True))
            experts = cast("torch.nn.Module", layer.block.experts)  # _picked_by_block: the block has experts
            hooks.append(experts.register_forward_pre_hook(force, with_kwargs=True, prepend=True))
        else:
            hooks.append(layer.router.register_forward_hook(make(layer), prepend=True))
    try:
        yield layers
    finally:
        for h in hooks:
            h.remove()


def _forced_ids(index, recorded, own_ids, num_experts, checked):
    """Layer `index`'s recorded ids as the forward's own: checked against its
    experts, at the own ids' dtype and device, [tokens, top_k] as many
    tokens as the forward routes."""
    import torch
    given = torch.as_tensor(recorded, device=own_ids.device)
    _check_replayed_ids(index, given, num_experts, checked)  # before a cast could wrap them
    forced = given.to(own_ids.dtype)
    if forced.shape != own_ids.reshape(-1, own_ids.shape[-1]).shape:
        raise ValueError(f"layer {index}: recorded ids {tuple(forced.shape)}, the forward routes "
                         f"{tuple(own_ids.shape)}")
    return forced


def _forced_weights(index, recorded, forced, device):
    """Layer `index`'s recorded weights: floating, shaped as its forced ids."""
    import torch
    given = torch.as_tensor(recorded, device=device)
    if not given.is_floating_point():
        raise ValueError(f"layer {index}: recorded weights are {given.dtype}; expected a floating tensor")
    if given.shape != forced.shape:
        raise ValueError(f"layer {index}: recorded weights {tuple(given.shape)}, the forward routes "
                         f"{tuple(forced.shape)} (tokens, top_k)")
    return given


def _check_replayed_ids(index, forced, num_experts, checked):
    """Every recorded id of layer `index` names one of the router's experts. An
    id past them would index the experts out of bounds (or, in grouped
    kernels, silently mix in memory), and -1 is a token without routing, which
    no forward can replay. Compared at the ids' own dtype: a cast first could
    wrap an int64 id into range."""
    import torch
    if forced.is_floating_point() or forced.is_complex() or forced.dtype == torch.bool:
        raise ValueError(f"layer {index}: recorded ids are {forced.dtype}; expected an integer tensor (a cast "
                         "would truncate them to experts)")
    if index in checked or torch.compiler.is_compiling():  # traced: a data-dependent check would break the graph
        return
    bad = ((forced < 0) | (forced >= num_experts)).nonzero()
    if bad.numel():
        at = tuple(int(i) for i in bad[0])
        raise ValueError(f"layer {index}: recorded ids[{at[0]}, {at[1]}] is {int(forced[at])}; expected [0, "
                         f"{num_experts}) (-1 is a token without routing: it has no experts to replay)")
    checked.add(index)


def _forced_scores(router, output, index, ids, weights, checked):
    """A scores-and-logits router's output for forced experts: the scores of
    `ids` (its own weights for them, or `weights`), 0 elsewhere."""
    import torch
    scores, logits = output
    given = torch.as_tensor(ids, device=scores.device)
    _check_replayed_ids(index, given, scores.shape[-1], checked)
    forced = given.long()
    if forced.shape != (scores.shape[0], router.top_k):
        raise ValueError(f"layer {index}: recorded ids {tuple(forced.shape)}, the forward routes "
                         f"{(scores.shape[0], router.top_k)}")
    if weights is None:
        w = _recomputed_weights(router, logits, forced)
    else:
        w = _forced_weights(index, weights, forced, scores.device)
    return torch.zeros_like(scores).scatter_(1, forced, w.to(scores.dtype).reshape(forced.shape)), logits
