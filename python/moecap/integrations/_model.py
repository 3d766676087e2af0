# SPDX-License-Identifier: Apache-2.0
"""What an adapter reads from a model's Hugging Face config: the routed
expert count, and which model layers are MoE layers (the layer map); and
the device id dtype that count calls for."""

_EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts", "num_routed_experts")


def num_experts(config):
    """Routed experts of the model (DeepSeek's n_routed_experts, Qwen's
    num_experts, Mixtral's num_local_experts, ...)."""
    for key in _EXPERT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"the model config names no routed expert count (looked for {', '.join(_EXPERT_KEYS)}); "
                     "pass num_experts")


def device_id_dtype(num_experts):
    """The device buffer's id dtype for an adapter, whose routing reaches the
    buffer only through moecap's capture: u8 up to 255 experts (0xff is
    "none"; a commit and a snapshot read half the bytes of int16), else AUTO."""
    return "u8" if num_experts <= 255 else "auto"


def moe_layers_from_config(config):
    """The model layers (0-based) that route to experts, from the config's own
    rules: DeepSeek's first_k_dense_replace and moe_layer_freq, Qwen-MoE's
    mlp_only_layers and decoder_sparse_step; every layer otherwise."""
    n = int(config.num_hidden_layers)
    first_dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
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
    if not layers:
        raise ValueError(f"the model config leaves none of its {n} layers MoE; pass moe_layers")
    return tuple(layers)


def check_layers(layers, num_hidden_layers):
    layers = tuple(int(x) for x in layers)
    if not layers or any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 0 \
            or layers[-1] >= num_hidden_layers:
        raise ValueError(f"moe_layers must be strictly increasing model layers in [0, {num_hidden_layers}), "
                         f"not {list(layers)}")
    return layers
