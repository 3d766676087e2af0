# SPDX-License-Identifier: Apache-2.0
"""What each consumer of routed experts takes, byte for byte, from a RoutedExperts.

One module per consumer, each with ``encode`` (and a ``decode`` back to a
RoutedExperts): the RL trainers ``verl``, ``slime``, ``megatron`` (megatron-
core's RouterReplay), ``nemo_rl``, ``skyrl`` and ``prime_rl``, beside the
engines' ``sglang`` and ``vllm``. RoutedExperts has a thin method for each
(``to_verl``, ``to_slime``, ``to_megatron``, ``to_nemo_rl``, ``to_skyrl``,
``to_prime_rl``); docs/CONSUMERS.md has the table (dtype, shape, rows,
padding, what each was tested against).

What they share:

- Rows: a sequence of T tokens has routing for T-1 of them (the last sampled
  token never goes through a forward), from its start position; RoutedExperts
  holds exactly those. A format that takes a whole sequence refuses a routing
  that starts past 0; ``num_tokens=T``, where accepted, is checked against it.
- Layers: every all-layer payload covers the model's num_hidden_layers with
  dense layers 0 (RoutedExperts.all_layers); Megatron's per-layer list holds
  the MoE layers only. Decoders take ``layers`` (the MoE layers' model indices)
  and check that the dense layers read 0.
- Tokens without routing: only NeMo-RL has a value for them (-1 across the
  row, routed natively by its trainer); every other format refuses them with
  an error naming the first one (Megatron can instead fill them with a
  distinct valid route on request), because any value it could carry would be
  replayed as real experts.

``decode(payload, num_experts, ...)`` reads any payload that says what it is
(NeMo-RL's envelope, prime-rl's and SkyRL's dicts).
"""
import importlib

TRAINERS = ("verl", "slime", "megatron", "nemo_rl", "skyrl", "prime_rl")


def __getattr__(name):
    # Each consumer's module on first use: megatron needs torch, the others only NumPy.
    if name in TRAINERS or name in ("sglang", "vllm"):
        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'moecap.formats' has no attribute {name!r}")


def decode(payload, num_experts, layers=None, num_hidden_layers=None, num_tokens=None):
    """A RoutedExperts from a payload that carries its own shape: a NeMo-RL
    envelope (str ``nrlre1:...``), a prime-rl dict (has ``start``) or a SkyRL
    dict (``data``, ``shape``, ``dtype``). layers: the MoE layers' model
    indices; num_tokens: the sequence's T, as each consumer's decode takes it."""
    if isinstance(payload, str) and payload.startswith("nrlre1:"):
        return __getattr__("nemo_rl").decode(payload, num_experts, num_tokens, layers, num_hidden_layers)
    if isinstance(payload, dict) and {"data", "shape"} <= set(payload):
        module = __getattr__("prime_rl" if "start" in payload else "skyrl")
        return module.decode(payload, num_experts, layers, num_hidden_layers, num_tokens)
    raise ValueError(f"cannot tell which consumer's payload this {type(payload).__name__} is; call that "
                     "consumer's decode (moecap.formats.<consumer>.decode)")
