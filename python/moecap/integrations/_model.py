# SPDX-License-Identifier: Apache-2.0
"""What an adapter reads from a model's Hugging Face config: the expert
count, and which model layers are MoE layers (the layer map); and the device
id dtype that count calls for."""
from .. import _current_cuda_device, _integer

# What configs call the routed expert count (DeepSeek's n_routed_experts,
# Qwen's num_experts, Mixtral's num_local_experts, Ernie's moe_num_experts,
# ...) and the experts per token (Ernie's moe_k, HunYuan's moe_topk, Gemma's
# top_k_experts, DBRX's moe_top_k).
EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts", "num_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk", "top_k_experts", "moe_top_k")

def config_int(config, keys, what):
    """The first positive int under one of `keys` in the config or, for a
    multimodal wrapper, its text_config, or in DBRX's ffn_config (a config
    or, as a config.json holds it, a dict); a per-layer list (HunYuan's
    moe_topk) counts where every layer has the same. ValueError naming
    `what` if none, or if the layers' values differ: one capturer holds one
    width for every layer."""
    for c in (config, getattr(config, "text_config", None), getattr(config, "ffn_config", None)):
        for key in keys:
            value = c.get(key) if isinstance(c, dict) else getattr(c, key, None)
            if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and v > 0 for v in value):
                if len(set(value)) > 1:
                    raise ValueError(f"the model config's {key} differs between layers ({list(value)}); moecap "
                                     f"captures one {what} for every layer")
                value = value[0]
            if isinstance(value, int) and value > 0:
                return value
    raise ValueError(f"the model config names no {what} (looked for {', '.join(keys)})")


def num_experts(config):
    """The expert ids a router of the model picks from: its routed experts,
    and after them LongCat-Flash's zero (identity) experts (zero_expert_num),
    which its router picks as ids n_routed_experts and up and SGLang's
    capture site passes on as picked, or Zaya's skip expert (transformers'
    config always has one; SGLang's where zaya_use_mod, its default)."""
    past_routed = 0
    for c in (config, getattr(config, "text_config", None)):
        value = getattr(c, "zero_expert_num", None)
        if isinstance(value, int) and value > 0:
            past_routed = value
            break
        if getattr(c, "model_type", None) == "zaya" and getattr(c, "zaya_use_mod", True):
            past_routed = 1
            break
    try:
        return config_int(config, EXPERT_KEYS, "routed expert count") + past_routed
    except ValueError as e:
        raise ValueError(f"{e}; pass num_experts=") from None


def decoder_layers(config):
    """The model's decoder layers: num_hidden_layers, but LongCat-Flash's
    num_layers, where transformers' config counts two attention sublayers a
    decoder layer in num_hidden_layers (SGLang's config sets both alike)."""
    if getattr(config, "model_type", None) == "longcat_flash" and isinstance(getattr(config, "num_layers", None), int):
        return int(config.num_layers)
    return int(config.num_hidden_layers)


def device_id_dtype(num_experts):
    """The device buffer's id dtype for an adapter, whose routing reaches the
    buffer only through moecap's capture: u8 up to 255 experts (0xff is
    "none"; a commit and a snapshot read half the bytes of int16), else AUTO."""
    return "u8" if num_experts <= 255 else "auto"


def capturer_device(device):
    """The Capturer's device for an engine's `device`: "cpu", or "cuda:N". A
    bare "cuda" is the rank's current CUDA device, as torch allocates it (a
    multi-GPU engine sets each rank's before building its model; see
    moecap.Config). Any other kind is refused by name: moecap has no backend
    for it."""
    text = str(device)
    kind, _, index = text.partition(":")
    if kind == "cpu":
        return "cpu"
    if kind != "cuda":
        raise ValueError(f"device is {text!r}; moecap captures on 'cpu' or a CUDA device ('cuda', 'cuda:N')")
    return text if index else _current_cuda_device()


def device_ids_int32(device_ids, num_experts):
    """Ids read straight from a device buffer (a layer view, or the whole
    buffer), as int32 with "none" (-1, or 0xff in a u8 buffer) and any id
    outside [0, num_experts) as -1."""
    import torch
    ids = device_ids.to(torch.int32)
    return ids.masked_fill(ids >= num_experts, -1)


def moe_layers_from_config(config):
    """The model layers (0-based) that route to experts, from the config's own
    rules: a per-layer list (transformers' mlp_layer_types, "sparse" or "moe"
    where a layer routes; Nemotron-H's layers_block_type, "moe"), an
    explicit list (Llama 4's moe_layers, else its interleave_moe_layer_step;
    Step 3.5's moe_layers_enum), Jamba's expert_layer_period and
    expert_layer_offset, Ernie 4.5's moe_layer_start_index,
    moe_layer_end_index and moe_layer_interval, DeepSeek's
    first_k_dense_replace (LFM2-MoE's and AFMoE's num_dense_layers, Inkling's
    dense_mlp_idx) and
    moe_layer_freq, Qwen-MoE's mlp_only_layers and decoder_sparse_step; every
    layer otherwise."""
    n = decoder_layers(config)
    per_layer = getattr(config, "mlp_layer_types", None)
    if isinstance(per_layer, (list, tuple)):
        return check_layers([i for i, t in enumerate(per_layer[:n]) if t in ("sparse", "moe", "hash_moe")], n)
    blocks = getattr(config, "layers_block_type", None)  # also Jamba's and Granite's mixers: MoE only if it says
    if isinstance(blocks, (list, tuple)) and "moe" in blocks:
        return check_layers([i for i, t in enumerate(blocks[:n]) if t == "moe"], n)
    listed = getattr(config, "moe_layers", None)
    if isinstance(listed, (list, tuple)):
        return check_layers(sorted(int(i) for i in listed), n)
    enum = getattr(config, "moe_layers_enum", None)  # Step 3.5's hub config: "3,4,5,..." (or a list)
    if enum is not None:
        items = enum.split(",") if isinstance(enum, str) else enum
        return check_layers(sorted(i for i in {int(i) for i in items if str(i).strip()} if i < n), n)
    interleave = getattr(config, "interleave_moe_layer_step", None)
    if isinstance(interleave, int) and interleave > 1:  # Llama 4 without the list: its config's own rule
        return check_layers(range(interleave - 1, n, interleave), n)
    if getattr(config, "moe_layer_interval", None) is not None:  # Ernie 4.5: its decoder layer's own test
        interval = int(config.moe_layer_interval or 1)
        first = int(getattr(config, "moe_layer_start_index", 0) or 0)
        last = getattr(config, "moe_layer_end_index", -1)
        last = n - 1 if last is None or int(last) == -1 else int(last)
        return check_layers([i for i in range(n) if (i + 1) % interval == 0 and first <= i <= last], n)
    period = getattr(config, "expert_layer_period", None)  # Jamba's: layer i routes where i % period == offset
    if isinstance(period, int) and period >= 1:
        offset = int(getattr(config, "expert_layer_offset", 0) or 0)
        return check_layers([i for i in range(n) if i % period == offset], n)
    first_dense = int(getattr(config, "first_k_dense_replace", 0) or getattr(config, "num_dense_layers", 0)
                      or getattr(config, "dense_mlp_idx", 0) or 0)
    freq = getattr(config, "moe_layer_freq", 1)
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    mlp_only = set(getattr(config, "mlp_only_layers", None) or ())
    layers = []
    for i in range(n):
        if i < first_dense or i in mlp_only:
            continue
        if isinstance(freq, (list, tuple)):
            if not freq[i]:
                continue
        elif int(freq or 1) > 1 and i % int(freq):
            continue
        if step > 1 and (i + 1) % step:
            continue
        layers.append(i)
    return check_layers(layers, n)


def check_layers(layers, num_hidden_layers):
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise TypeError(f"moe_layers must be a sequence of model layers (ints), not {type(layers).__name__}")
    layers = tuple(_integer("moe_layers' entries", x) for x in layers)
    if not layers:
        raise ValueError(f"none of the model's {num_hidden_layers} layers is a MoE layer; pass moe_layers")
    if any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 0 \
            or layers[-1] >= num_hidden_layers:
        raise ValueError(f"moe_layers must be strictly increasing model layers in [0, {num_hidden_layers}), "
                         f"not {list(layers)}")
    return layers


def check_install_options(capturer_class, options, invalid_choices):
    """An adapter's install() options, checked where install() is called: the engine builds the capturer
    later, in a scheduler or worker process, where a misspelt option would fail far from its cause (or a
    wrong `invalid` only once a bad id arrived). Each must be a keyword-only parameter of the capturer."""
    import inspect

    known = [name for name, p in inspect.signature(capturer_class.__init__).parameters.items()
             if p.kind is p.KEYWORD_ONLY]
    for name in options:
        if name not in known:
            raise TypeError(f"install() got an unexpected option {name!r}; {capturer_class.__name__} takes "
                            f"{', '.join(known)}")
    if "invalid" in options and options["invalid"] not in invalid_choices:
        raise ValueError(f"invalid must be one of {invalid_choices}, not {options['invalid']!r}")
