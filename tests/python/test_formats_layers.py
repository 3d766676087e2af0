# SPDX-License-Identifier: Apache-2.0
"""The layer map of RoutedExperts: which model layer each MoE entry of ids
is, and the all-layer view every all-layer payload is built from (dense
layers filled, MoE layers the ids, -1 throughout a token without routing)."""
import numpy as np
import pytest

from moecap.record import RoutedExperts


def test_default_map_is_every_layer_moe():
    r = RoutedExperts(np.zeros((2, 3, 2), dtype=np.int32), 8)
    assert r.layers == (0, 1, 2) and r.num_hidden_layers == 3
    assert np.array_equal(r.all_layers(), r.ids)


def test_all_layers_fills_dense_layers_and_keeps_invalid_tokens_at_minus_one():
    ids = np.array([[[1, 2], [3, 4]], [[5, 6], [7, 0]], [[2, 3], [4, 5]]])
    r = RoutedExperts(ids, 8, valid=[True, False, True], layers=[1, 3], num_hidden_layers=5)
    assert r.layers == (1, 3) and r.num_hidden_layers == 5
    full = r.all_layers()
    assert full.shape == (3, 5, 2) and full.dtype == np.int8
    assert (full[:, [0, 2, 4]] == 0).all()
    assert np.array_equal(full[[0, 2]][:, [1, 3]], ids[[0, 2]])
    assert (full[1, [1, 3]] == -1).all()  # no routing: not mistakable for experts 0
    assert (r.all_layers(dense=-1)[:, [0, 2, 4]] == -1).all()
    with pytest.raises(ValueError, match="dense is 300; the ids dtype int8"):
        r.all_layers(dense=300)


def test_map_is_checked():
    ids = np.zeros((1, 2, 1), dtype=np.int32)
    with pytest.raises(ValueError, match="layers has 3 entries; ids has 2 layers"):
        RoutedExperts(ids, 4, layers=[0, 1, 2])
    with pytest.raises(ValueError, match=r"layers\[1\] is 1 after 1; layers must be strictly increasing"):
        RoutedExperts(ids, 4, layers=[1, 1])
    with pytest.raises(ValueError, match=r"layers\[0\] is -1"):
        RoutedExperts(ids, 4, layers=[-1, 0])
    with pytest.raises(ValueError, match="num_hidden_layers is 3; layers names model layer 4"):
        RoutedExperts(ids, 4, layers=[1, 4], num_hidden_layers=3)
    with pytest.raises(ValueError, match="layers must be a sequence of ints"):
        RoutedExperts(ids, 4, layers=[0.5, 1.5])
    r = RoutedExperts(ids, 4, layers=np.array([2, 5]))
    assert r.layers == (2, 5) and r.num_hidden_layers == 6


def test_map_takes_part_in_equality_and_survives_with_layer_map():
    ids = np.arange(6).reshape(3, 2, 1)
    plain = RoutedExperts(ids, 8)
    placed = plain.with_layer_map([1, 2], 4)
    assert placed != plain and placed == RoutedExperts(ids, 8, layers=(1, 2), num_hidden_layers=4)
    assert "layers=[1, 2], num_hidden_layers=4" in repr(placed)
    # The record bytes do not carry the map: decoding gives the default, with_layer_map restores it.
    back = RoutedExperts.from_bytes(placed.to_bytes())
    assert back.layers == (0, 1) and back.with_layer_map([1, 2], 4) == placed


def test_concat_joins_a_prefix_and_its_continuation():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 8, size=(9, 2, 2))
    weights = rng.random((9, 2, 2)).astype(np.float32)
    kw = dict(layers=[1, 3], num_hidden_layers=4)
    prefix = RoutedExperts(ids[:5], 8, weights=weights[:5], **kw)
    turn = RoutedExperts(ids[5:], 8, weights=weights[5:], valid=[True, False, True, True], start=5, **kw)
    whole = RoutedExperts.concat([prefix, turn])
    assert whole == RoutedExperts(ids, 8, weights=weights, valid=[True] * 6 + [False] + [True] * 2, **kw)
    assert whole.to_nemo_rl().startswith("nrlre1:int8:10x4x2:")  # a whole-sequence format takes it now
    with pytest.raises(ValueError, match="from position 0; this routing starts at position 5.*RoutedExperts.concat"):
        turn.to_nemo_rl()
    with pytest.raises(ValueError, match=r"parts\[1\] starts at position 5; the pieces before it end at 4"):
        RoutedExperts.concat([RoutedExperts(ids[:4], 8, **kw), turn])
    with pytest.raises(ValueError, match=r"parts\[1\] has num_experts 8, LayerMap\(layers=\(0, 1\)"):
        RoutedExperts.concat([prefix, RoutedExperts(ids[5:], 8, start=5)])
    assert RoutedExperts.concat([prefix, RoutedExperts(ids[5:], 8, start=5, **kw)]).weights is None


def _sparse_layers(model):
    """The decoder layers of a transformers model whose MLP holds routed experts (the model's own modules)."""
    return tuple(i for i, layer in enumerate(model.model.layers)
                 if any(hasattr(getattr(layer, name, None), "experts") for name in ("mlp", "feed_forward")))


@pytest.mark.parametrize("arch", ["llama4_list", "llama4_interleave", "ernie", "qwen3", "deepseek_v3"])
def test_the_adapters_layer_map_from_a_config_is_the_models_own(arch):
    # The engine adapters fall back to the config's rules when the engine shows them no MoE modules.
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from moecap.integrations._model import moe_layers_from_config

    small = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, vocab_size=32)
    configs = {
        "llama4_list": lambda: transformers.Llama4TextConfig(
            **small, intermediate_size_mlp=32, head_dim=8, num_hidden_layers=6, num_local_experts=4,
            moe_layers=[0, 4]),
        "llama4_interleave": lambda: transformers.Llama4TextConfig(
            **small, intermediate_size_mlp=32, head_dim=8, num_hidden_layers=6, num_local_experts=4,
            interleave_moe_layer_step=2),
        "ernie": lambda: transformers.Ernie4_5_MoeConfig(
            **small, moe_intermediate_size=16, num_hidden_layers=7, moe_num_experts=4, moe_k=2,
            moe_layer_start_index=2, moe_layer_end_index=5, moe_layer_interval=2),
        "qwen3": lambda: transformers.Qwen3MoeConfig(
            **small, moe_intermediate_size=16, num_hidden_layers=5, num_experts=4, num_experts_per_tok=2,
            mlp_only_layers=[0, 3]),
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **small, moe_intermediate_size=16, num_hidden_layers=4, n_routed_experts=4, num_experts_per_tok=2,
            first_k_dense_replace=2, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=4, n_group=1, topk_group=1),
    }
    config = configs[arch]()
    model = transformers.AutoModelForCausalLM.from_config(config)
    expected = _sparse_layers(model)
    assert 0 < len(expected) < config.num_hidden_layers  # each config leaves some layers dense
    assert moe_layers_from_config(config) == expected


def test_the_adapters_layer_map_from_a_hub_config_without_transformers_lists():
    # What an engine loading a model's own (remote-code) config sees: the hub's keys, no mlp_layer_types.
    from types import SimpleNamespace

    from moecap.integrations._model import moe_layers_from_config
    assert moe_layers_from_config(SimpleNamespace(num_hidden_layers=6, moe_layers_enum="2,3,4,5")) == (2, 3, 4, 5)
    assert moe_layers_from_config(SimpleNamespace(num_hidden_layers=4, moe_layers_enum=[1, 3, 7])) == (1, 3)
    assert moe_layers_from_config(SimpleNamespace(num_hidden_layers=4, num_dense_layers=2)) == (2, 3)
    assert moe_layers_from_config(SimpleNamespace(num_hidden_layers=4, dense_mlp_idx=1)) == (1, 2, 3)  # Inkling
    assert moe_layers_from_config(SimpleNamespace(num_hidden_layers=4, mlp_layer_types=["dense", "hash_moe", "moe",
                                                                                          "sparse"])) == (1, 2, 3)
    assert moe_layers_from_config(SimpleNamespace(num_hidden_layers=3, layers_block_type=["mamba", "moe",
                                                                                           "attention"])) == (1,)
    # A mixer list without MoE entries (Jamba's, Granite-Hybrid's) says nothing about the MLPs: every layer.
    assert moe_layers_from_config(SimpleNamespace(num_hidden_layers=2, layers_block_type=["mamba", "attention"])) \
        == (0, 1)
    with pytest.raises(ValueError, match="none of the model's 2 layers is a MoE layer; pass moe_layers"):
        moe_layers_from_config(SimpleNamespace(num_hidden_layers=2, mlp_layer_types=["dense", "dense"]))
    with pytest.raises(ValueError, match="none of the model's 2 layers is a MoE layer"):
        moe_layers_from_config(SimpleNamespace(num_hidden_layers=2, first_k_dense_replace=2))
