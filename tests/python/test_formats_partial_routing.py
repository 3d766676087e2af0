# SPDX-License-Identifier: Apache-2.0
"""Tokens whose slot is valid but whose row holds a -1 in some MoE layer (a
layer not captured in the row's step, or an id out of range at capture: a
VALID | INVALID_IDS slot, which RequestTable.finish reads as valid). No
format has a value for a missing expert inside a routed token, so every
encoder treats such a token as one without routing: refused by default,
or filled the way the format fills a token without routing. Never -1 sent
where the consumer takes an expert id (uint8 255 is expert 255 at 256
experts)."""
import base64

import numpy as np
import pytest

from moecap.formats import nemo_rl, sglang, vllm
from moecap.record import RoutedExperts

EXPERTS = 256


def partial():
    """Three tokens, two layers, top-2; token 1 lacks one id of layer 1."""
    ids = np.array([[[1, 2], [3, 4]], [[5, 6], [-1, 7]], [[8, 9], [10, 11]]])
    r = RoutedExperts(ids, EXPERTS, valid=[True, True, True])
    assert r.valid.all()  # what a VALID | INVALID_IDS slot reads as
    return r


@pytest.mark.parametrize("encode", [
    lambda r: r.to_sglang(), lambda r: r.to_vllm(), lambda r: r.to_vllm_openai(), lambda r: r.to_slime(),
    lambda r: r.to_skyrl(), lambda r: r.to_prime_rl(), lambda r: r.to_verl(1, 2, 4),
    lambda r: r.to_megatron(),
], ids=["sglang", "vllm", "vllm_openai", "slime", "skyrl", "prime_rl", "verl", "megatron"])
def test_a_token_with_a_missing_id_is_refused_by_default(encode):
    with pytest.raises(ValueError, match="no value for 'no routing'.*position 1"):
        encode(partial())


def test_engines_send_zero_for_the_whole_token_with_invalid_zero():
    r = partial()
    for rows in (vllm.encode(r, invalid="zero"), sglang.encode(r, invalid="zero")):
        assert (rows[1] == 0).all()
        assert np.array_equal(rows[[0, 2]], r.ids[[0, 2]])


def test_megatron_routes_the_whole_token_to_the_filler_with_invalid_arange():
    per_layer = partial().to_megatron(invalid="arange")
    for layer in per_layer:
        assert layer[1].tolist() == [0, 1]


def test_nemo_rl_marks_the_whole_row_missing():
    a = nemo_rl.array(partial())
    assert (a[1] == -1).all()
    assert (a[0] >= 0).all() and (a[2] >= 0).all()


def test_nemo_rl_decode_reads_a_row_missing_in_every_moe_layer_as_missing_whatever_its_dense_layers_hold():
    """NeMo-RL's trainer reads the MoE layers only: a full-layout row that is -1 there and 0 in a dense layer
    is its fallback row, not a malformed one; -1 in part of the MoE layers still is."""
    moe_missing = np.array([[[0, 0], [1, 2]], [[0, 0], [-1, -1]], [[0, 0], [3, 4]]], np.int8)  # layer 0 dense
    text = lambda a: f"nrlre1:int8:{a.shape[0]}x2x2:" + base64.b64encode(a.tobytes()).decode()
    r = nemo_rl.decode(text(moe_missing), EXPERTS, layers=[1])
    assert r.valid.tolist() == [True, False]
    assert r.ids[:, 0].tolist() == [[1, 2], [-1, -1]]
    part = moe_missing.copy()
    part[1, 1, 0] = 5
    with pytest.raises(ValueError, match="row 1 mixes -1 with expert ids"):
        nemo_rl.decode(text(part), EXPERTS, layers=[1])
    dense_expert = moe_missing.copy()
    dense_expert[0, 0, 0] = 5
    with pytest.raises(ValueError, match="layer 0 is dense \\(not in layers\\) but holds expert ids"):
        nemo_rl.decode(text(dense_expert), EXPERTS, layers=[1])
