# SPDX-License-Identifier: Apache-2.0
"""Every trainer format decoded the way its consumer decodes it.

The consumer-side functions here restate, line for line in meaning, what each
project does with the payload (verl's agent loop and R3 alignment, slime's
meta-array decoding and pad rows, NeMo-RL's alignment and envelope codec,
SkyRL's pack/unpack with its canonical dtype, prime-rl's serializer and
orchestrator padding): none of these trainers installs on this CPU-only test
venv, so their decoding is restated, and the engine rows they start from are
what SGLang and vLLM send (every layer, dense ones 0, T-1 rows). Megatron's
own RouterReplay runs for real in test_formats_megatron.py.
"""
import base64

import numpy as np
import pytest

from moecap import formats
from moecap.formats import nemo_rl, prime_rl, skyrl, slime, verl
from moecap.record import RoutedExperts

torch = pytest.importorskip("torch", reason="the trainers' decoding runs on torch tensors (the test venv)")

LAYERS, HIDDEN, TOP_K = (1, 2, 4), 5, 2  # model layers 0 and 3 are dense


def routing(rng, tokens=7, num_experts=8, start=0, valid=None, layers=LAYERS, hidden=HIDDEN, top_k=TOP_K):
    """T-1 = `tokens` rows of distinct experts per (token, MoE layer), as routers pick them."""
    ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens * len(layers))])
    return RoutedExperts(ids.reshape(tokens, len(layers), top_k), num_experts, valid=valid, start=start,
                         layers=layers, num_hidden_layers=hidden)


def engine_rows(routed, dtype):
    """What SGLang (int32) and vLLM (uint8/uint16) send: T-1 rows over every layer, dense 0."""
    return routed.all_layers(dense=0).astype(dtype)


def moe_ids(routed):
    return routed.ids.astype(np.int64)


# --- verl ---------------------------------------------------------------------

def verl_agent_loop(experts_tensor, prompt_len, prompt_width, response_width):
    """verl's _postprocess: the routes into zeros(1, total_length, L, K) at the
    left-padded prompt's first token, in the int16 verl stores."""
    experts_tensor = experts_tensor.to(torch.int16)
    total_length = prompt_width + response_width
    length, layer_num, topk_num = experts_tensor.shape
    routed_experts = torch.zeros(1, total_length, layer_num, topk_num, dtype=experts_tensor.dtype)
    start_pos = prompt_width - prompt_len
    end_pos = min(start_pos + length, total_length)
    assert start_pos >= 0 and end_pos <= total_length
    routed_experts[:, start_pos:end_pos] = experts_tensor.unsqueeze(0)
    return routed_experts


def verl_replay_targets(routed_experts, attention_mask, response_mask, num_layers):
    """verl's replay side for one sample: padding removed by the attention mask,
    routes aligned to the input (a placeholder row if one short), the replay
    mask leaving the last row native, one int64 [tokens, K] per layer."""
    routes = routed_experts[0][attention_mask[0].bool()]
    input_len = int(attention_mask.sum())
    if routes.shape[0] == input_len - 1:
        routes = torch.cat([routes, torch.zeros((1, *routes.shape[1:]), dtype=routes.dtype)])
    assert routes.shape[0] == input_len
    replay_len = input_len - 1 if int(response_mask.sum()) > 0 else 0
    replay = torch.arange(input_len) < replay_len
    per_layer = routes.permute(1, 0, 2)
    assert per_layer.shape[0] == num_layers  # index_by_layer: the full-layer layout
    return [per_layer[i].to(torch.int64) for i in range(num_layers)], replay


def test_verl_batch_row_is_byte_identical_and_replays_the_routing():
    rng = np.random.default_rng(1)
    r = routing(rng, tokens=9, num_experts=200)  # a 10-token sequence: 4-token prompt, 6 response tokens
    prompt_len, prompt_width, response_width = 4, 6, 8
    ours = r.to_verl(prompt_len, prompt_width, response_width)
    theirs = verl_agent_loop(torch.from_numpy(engine_rows(r, np.int32)), prompt_len, prompt_width, response_width)
    assert ours.dtype == np.int16 and ours.shape == (1, 14, HIDDEN, TOP_K)
    assert ours.tobytes() == theirs.numpy().tobytes()
    attention_mask = torch.zeros(1, 14, dtype=torch.long)
    attention_mask[0, 2:12] = 1  # 2 left-pad, 10 tokens, 2 right-pad
    response_mask = torch.zeros(1, 8, dtype=torch.long)
    response_mask[0, :6] = 1
    targets, replay = verl_replay_targets(torch.from_numpy(ours), attention_mask, response_mask, HIDDEN)
    assert replay[:-1].all() and not replay[-1]
    for i, layer in enumerate(LAYERS):
        assert torch.equal(targets[layer][:-1], torch.from_numpy(moe_ids(r)[:, i]))
    assert all((targets[d] == 0).all() for d in (0, 3))
    assert verl.decode(ours, 200, prompt_len, 10, prompt_width=prompt_width, layers=LAYERS) == r


def test_verl_aligned_sequence_has_the_zero_placeholder_row():
    r = routing(np.random.default_rng(2), tokens=5)
    a = verl.aligned(r, num_tokens=6)
    assert a.dtype == np.int16 and a.shape == (6, HIDDEN, TOP_K)
    assert (a[-1] == 0).all() and np.array_equal(a[:-1], engine_rows(r, np.int16))


def test_verl_refuses_what_it_cannot_carry():
    rng = np.random.default_rng(3)
    with pytest.raises(ValueError, match="verl has no value for 'no routing'.*position 2"):
        routing(rng, valid=[True, True, False, True, True, True, True]).to_verl(3, 4, 8)
    with pytest.raises(ValueError, match="from position 0; this routing starts at position 3"):
        routing(rng, start=3).to_verl(3, 4, 8)
    with pytest.raises(ValueError, match="expected 1 to response_width=3"):
        routing(rng, tokens=7).to_verl(2, 4, 3)  # 8 tokens: 6 response tokens > 3
    with pytest.raises(ValueError, match="prompt_len is 5; it must be in \\[1, prompt_width=4\\]"):
        routing(rng).to_verl(5, 4, 8)
    with pytest.raises(ValueError, match="verl's int16 cannot hold expert"):
        routing(rng, num_experts=40000).to_verl(3, 4, 8)


# --- slime --------------------------------------------------------------------

def slime_decode(meta_info, tokens, num_layers, topk):
    """slime: decode_int32_meta_array, then Sample's exact T-1-start check and reshape."""
    value = meta_info["routed_experts"]
    flat = torch.frombuffer(bytearray(base64.b64decode(value.encode("ascii"))), dtype=torch.int32)
    start_len = meta_info.get("routed_experts_start_len", 0)
    expected_rows = len(tokens) - 1 - start_len
    assert flat.numel() == expected_rows * num_layers * topk
    return flat.reshape(expected_rows, num_layers, topk)


def slime_pad(experts, pad, num_experts):
    """slime's pad rows: arange(pad * L * K) % num_experts, distinct and valid."""
    _, num_layers, topk = experts.shape
    pad_rows = torch.arange(pad * num_layers * topk, dtype=experts.dtype).reshape(pad, num_layers, topk) % num_experts
    return torch.cat([experts, pad_rows])


@pytest.mark.parametrize("num_experts", [5, 300])
def test_slime_rows_are_exactly_t_minus_one_and_pad_like_slime(num_experts):
    r = routing(np.random.default_rng(4), tokens=6, num_experts=num_experts)
    tokens = list(range(7))
    experts = slime_decode(slime.meta_info(r), tokens, HIDDEN, TOP_K)
    assert experts.dtype == torch.int32
    assert experts.numpy().tobytes() == r.to_slime(num_tokens=7).tobytes() == engine_rows(r, "<i4").tobytes()
    padded = slime_pad(experts, 1, num_experts)
    assert np.array_equal(padded.numpy(), slime.padded(r, 7))
    assert len(set(padded[-1, 0].tolist())) == TOP_K  # the pad row routes to distinct experts
    for i, layer in enumerate(LAYERS):  # slime records [:, layer_id] per local MoE layer, replays it as int32
        assert torch.equal(padded[:-1, layer].to(torch.int32), torch.from_numpy(moe_ids(r)[:, i]).to(torch.int32))
        assert (padded[:-1, layer] != 0).any()  # slime's validator refuses an all-zero MoE layer
    assert slime.decode(slime.meta_info(r)["routed_experts"], num_experts, HIDDEN, TOP_K, 7, layers=LAYERS) == r


def test_slime_continuation_carries_its_start_len():
    r = routing(np.random.default_rng(5), tokens=4, start=3)  # positions 3..6 of an 8-token sequence
    meta = slime.meta_info(r, num_tokens=8)
    assert meta["routed_experts_start_len"] == 3
    assert slime_decode(meta, list(range(8)), HIDDEN, TOP_K).shape == (4, HIDDEN, TOP_K)
    with pytest.raises(ValueError, match="num_tokens is 9; the routing has 4 rows from position 3, which is a "
                                         "sequence of 8 tokens"):
        r.to_slime(num_tokens=9)
    with pytest.raises(ValueError, match="slime has no value for 'no routing'"):
        routing(np.random.default_rng(6), tokens=2, valid=[False, True]).to_slime()
    with pytest.raises(ValueError, match="the slime payload has 20 values"):
        slime.decode(np.zeros(20, dtype=np.int32), 8, HIDDEN, TOP_K, num_tokens=4)


# --- NeMo-RL ------------------------------------------------------------------

def nemo_align(routed, valid_length, padded_length, dtype):
    """NeMo-RL's pad_and_align_routed_expert_indices: the default route
    arange(K) everywhere, the T-1 routes copied in, missing routes -1."""
    routed = torch.as_tensor(routed).to(dtype)
    expected_routes = min(max(valid_length - 1, 0), padded_length)
    missing = max(expected_routes - int(routed.shape[0]), 0)
    default_route = torch.arange(routed.shape[2], dtype=dtype)
    full = default_route.view(1, 1, -1).expand(padded_length, routed.shape[1], routed.shape[2]).clone()
    copy = min(expected_routes, routed.shape[0])
    full[:copy] = routed[:copy]
    if missing:
        full[copy:expected_routes] = -1
    return full


def nemo_encode(t):
    name = {torch.int8: "int8", torch.int16: "int16", torch.int32: "int32"}[t.dtype]
    s, layers, k = t.shape
    return f"nrlre1:{name}:{s}x{layers}x{k}:{base64.b64encode(t.contiguous().numpy().tobytes()).decode('ascii')}"


def nemo_decode(payload, dtype):
    """NeMo-RL's decode_routed_experts: the envelope's four fields, frombuffer, reshape, .to(dtype)."""
    magic, name, shape_text, data = payload.split(":", 3)
    assert magic == "nrlre1"
    shape = tuple(int(d) for d in shape_text.split("x"))
    arr = np.frombuffer(base64.b64decode(data), dtype={"int8": np.int8, "int16": np.int16, "int32": np.int32}[name])
    assert arr.size == shape[0] * shape[1] * shape[2]
    return torch.from_numpy(arr.reshape(shape).copy()).to(dtype)


def nemo_dtype(num_experts):
    """resolve_routed_experts_dtype: the narrowest signed dtype holding num_experts - 1 and -1."""
    for dtype in (torch.int8, torch.int16):
        if num_experts - 1 <= torch.iinfo(dtype).max:
            return dtype
    return torch.int32


@pytest.mark.parametrize("num_experts, name", [(128, "int8"), (129, "int16"), (32768, "int16"), (32769, "int32")])
def test_nemo_rl_envelope_is_what_nemo_rl_writes(num_experts, name):
    r = routing(np.random.default_rng(7), tokens=6, num_experts=num_experts)
    vllm_rows = engine_rows(r, np.uint8 if num_experts <= 256 else np.uint16 if num_experts <= 65536 else np.int32)
    for padded_length in (None, 10):
        ours = r.to_nemo_rl(num_tokens=7, padded_length=padded_length)
        assert ours.startswith(f"nrlre1:{name}:{padded_length or 7}x{HIDDEN}x{TOP_K}:")
        assert ours == nemo_encode(nemo_align(vllm_rows, 7, padded_length or 7, nemo_dtype(num_experts)))
        decoded = nemo_decode(ours, torch.long)
        for i, layer in enumerate(LAYERS):  # NeMo-RL's Megatron side, full-layer layout: [:, layer, :].to(long)
            assert torch.equal(decoded[:6, layer, :], torch.from_numpy(moe_ids(r)[:, i]))
        assert (decoded[6:] == torch.arange(TOP_K)).all()
        assert nemo_rl.decode(ours, num_experts, num_tokens=7, layers=LAYERS) == r


def test_nemo_rl_marks_tokens_without_routing_minus_one_and_takes_the_moe_layout():
    r = routing(np.random.default_rng(8), tokens=5, valid=[True, False, True, True, False])
    env = r.to_nemo_rl(layout="moe")
    decoded = nemo_decode(env, torch.long)
    assert decoded.shape == (6, len(LAYERS), TOP_K)  # the compressed MoE-only layout NeMo-RL also accepts
    fallback = decoded.eq(-1).all(dim=-1)  # NeMo-RL's patched replay routes these rows natively
    assert fallback[:, 0].tolist() == [False, True, False, False, True, False]
    assert not (decoded.lt(0).any(-1) & ~fallback).any()  # never a partly -1 row
    back = formats.decode(env, 8, layers=LAYERS, num_hidden_layers=HIDDEN)
    assert back == r and back.valid.tolist() == [True, False, True, True, False]
    full = nemo_decode(r.to_nemo_rl(), torch.long)
    assert (full[1] == -1).all() and (full[4] == -1).all()  # the whole row, as NeMo-RL marks a missing route


def test_nemo_rl_refuses_bad_envelopes():
    r = routing(np.random.default_rng(9), tokens=3)
    env = r.to_nemo_rl()
    with pytest.raises(ValueError, match="not a NeMo-RL routed_experts envelope"):
        nemo_rl.decode("nrlre2" + env[6:], 8)
    with pytest.raises(ValueError, match="envelope holds"):
        nemo_rl.decode(env.replace(f"4x{HIDDEN}", f"5x{HIDDEN}"), 8)
    bad = nemo_rl.array(r).copy()
    bad[1, 1, 0] = -1
    partial = f"nrlre1:int8:4x{HIDDEN}x{TOP_K}:" + base64.b64encode(bad.tobytes()).decode()
    with pytest.raises(ValueError, match="row 1 mixes -1 with expert ids"):
        nemo_rl.decode(partial, 8, layers=LAYERS)
    with pytest.raises(ValueError, match="padded_length is 3; the sequence has 4 tokens"):
        r.to_nemo_rl(padded_length=3)


# --- SkyRL --------------------------------------------------------------------

def skyrl_compact(routed_experts):
    """compact_routed_expert_indices: the dtype from the largest id present."""
    assert routed_experts.min(initial=0) >= 0
    top = int(routed_experts.max(initial=0))
    dtype = np.uint8 if top < 2 ** 8 else np.int16 if top < 2 ** 15 else np.int32
    return routed_experts.astype(dtype)


def skyrl_unpack(payload):
    """unpack_ndarray + decode_packed_routed_experts: allowed dtype, byte count, canonical dtype."""
    allowed = {"uint8": np.dtype(np.uint8), "int16": np.dtype(np.int16), "int32": np.dtype(np.int32)}
    dtype = allowed[payload["dtype"]]
    shape = tuple(payload["shape"])
    data = base64.b64decode(payload["data"], validate=True)
    assert len(shape) == 3 and len(data) == int(np.prod(shape)) * dtype.itemsize
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    assert skyrl_compact(array).dtype == array.dtype
    return array


@pytest.mark.parametrize("num_experts", [8, 300, 40000])
def test_skyrl_dict_is_what_its_server_packs_and_its_client_reads(num_experts):
    r = routing(np.random.default_rng(10), tokens=6, num_experts=num_experts)
    compact = skyrl_compact(engine_rows(r, np.int64))
    want = {"data": base64.b64encode(compact.tobytes()).decode("ascii"), "shape": list(compact.shape),
            "dtype": compact.dtype.name}
    ours = r.to_skyrl(num_tokens=7)
    assert ours == want and list(ours) == ["data", "shape", "dtype"]  # data first: SkyRL's client splices it
    array = skyrl_unpack(ours)
    # SkyRL's preprocessing: left-pad to the batch width with the default route arange(K).
    width = 10
    batch = np.empty((1, width, HIDDEN, TOP_K), dtype=array.dtype)
    batch[...] = np.arange(TOP_K, dtype=array.dtype)
    batch[0, width - 7:width - 1] = array
    for i, layer in enumerate(LAYERS):  # per MoE router (by layer number): int32 [B*S, K]
        per_layer = torch.from_numpy(batch[:, :, layer].reshape(-1, TOP_K).astype(np.int32))
        assert torch.equal(per_layer[3:9].long(), torch.from_numpy(moe_ids(r)[:, i]))
    assert skyrl.decode(ours, num_experts, layers=LAYERS) == r


def test_skyrl_dtype_follows_the_largest_id_not_num_experts():
    ids = np.array([[[0, 1]], [[2, 3]]])
    payload = RoutedExperts(ids, 1000).to_skyrl()
    assert payload["dtype"] == "uint8"  # 1000 experts, but no id above 255
    bloated = dict(payload, dtype="int16",
                   data=base64.b64encode(ids.astype("<i2").tobytes()).decode())
    with pytest.raises(ValueError, match="dtype int16 is not canonical for these ids; SkyRL expects uint8"):
        skyrl.decode(bloated, 1000)
    with pytest.raises(ValueError, match="SkyRL has no value for 'no routing'"):
        RoutedExperts(ids, 8, valid=[True, False]).to_skyrl()
    with pytest.raises(ValueError, match="from position 0"):
        RoutedExperts(ids, 8, start=1).to_skyrl()


# --- prime-rl -----------------------------------------------------------------

def prime_rl_serialize(routed_experts, start):
    """prime-rl's serialize_routed_experts: uint8 unless an id is over 255, then uint16."""
    array = np.asarray(routed_experts)
    dtype = np.uint8
    if array.size:
        assert array.min() >= 0
        if array.max() > np.iinfo(np.uint8).max:
            assert array.max() <= np.iinfo(np.uint16).max
            dtype = np.uint16
    compact = np.ascontiguousarray(array.astype(dtype, copy=False))
    return {"data": base64.b64encode(memoryview(compact)).decode("ascii"), "shape": list(compact.shape),
            "start": start, "dtype": np.dtype(dtype).name}


def verifiers_node_rows(payload, path_len, node_tokens):
    """verifiers' _attribute_routed_experts for a turn's one new node of
    node_tokens tokens after path_len attributed ones: its slice of the rows,
    or, where the engine omitted the final position (no forward follows it),
    the slice and a copy of the last row; None where the slice falls outside."""
    arr = np.frombuffer(base64.b64decode(payload["data"]), dtype=np.dtype(payload.get("dtype", "uint8")))
    arr = arr.reshape(payload["shape"])
    off = path_len - int(payload.get("start", 0) or 0)
    end = needed = off + node_tokens
    if node_tokens and 0 <= off and end <= arr.shape[0]:
        return arr[off:end].copy()
    if node_tokens and arr.shape[0] and 0 <= off and end == needed == arr.shape[0] + 1:
        return np.concatenate([arr[off:], arr[-1:]], axis=0)
    return None


def prime_rl_orchestrator(arr, num_tokens):
    """_encode_routed_experts on a branch's rows: truncate or zero-pad the token
    axis to num_tokens (a backstop: verifiers already gave every token a row)."""
    if arr.shape[0] < num_tokens:
        arr = np.concatenate([arr, np.zeros((num_tokens - arr.shape[0], *arr.shape[1:]), dtype=arr.dtype)])
    return arr[:num_tokens]


@pytest.mark.parametrize("num_experts, dtype", [(256, "uint8"), (512, "uint16")])
def test_prime_rl_dict_is_what_its_wrapper_serializes(num_experts, dtype):
    rng = np.random.default_rng(11)
    r = routing(rng, tokens=6, num_experts=num_experts)
    if dtype == "uint16":  # the dtype follows the largest id present
        r.ids[0, 0, 0] = 300
    ours = r.to_prime_rl(num_tokens=7)
    assert ours == prime_rl_serialize(engine_rows(r, np.int64), 0) and ours["dtype"] == dtype
    assert list(ours) == ["data", "shape", "start", "dtype"]
    sample = prime_rl_orchestrator(verifiers_node_rows(ours, 0, 7), 7)
    assert np.array_equal(sample, prime_rl.trainer_array(r))
    assert np.array_equal(sample[-1], sample[-2]) and sample[-1].any()  # the last row again, not zeros
    batch = torch.from_numpy(sample.astype(np.int64))[None]  # (batch, seq, num_hidden_layers, top_k)
    scores = torch.rand(7, num_experts)
    for i, layer in enumerate(LAYERS):  # the trainer indexes the global layer, its router gathers there
        chosen = batch[:, :, layer, :].reshape(-1, TOP_K)
        assert torch.equal(chosen[:6], torch.from_numpy(moe_ids(r)[:, i]))
        assert torch.equal(scores.gather(1, chosen)[:6], scores[:6].gather(1, torch.from_numpy(moe_ids(r)[:, i])))
    assert formats.decode(ours, num_experts, layers=LAYERS) == r


def test_prime_rl_keeps_the_start_of_a_continuation():
    r = routing(np.random.default_rng(12), tokens=3, start=5)
    payload = r.to_prime_rl(num_tokens=9)
    assert payload["start"] == 5 and payload["shape"] == [3, HIDDEN, TOP_K]
    # verifiers gives the continuation's node (positions 5-8) its rows and the last one again
    assert np.array_equal(verifiers_node_rows(payload, 5, 4), prime_rl.trainer_array(r))
    back = prime_rl.decode(payload, 8, layers=LAYERS)
    assert back == r and back.start == 5
    with pytest.raises(ValueError, match="prime-rl has no value for 'no routing'"):
        routing(np.random.default_rng(13), tokens=2, valid=[True, False]).to_prime_rl()
    with pytest.raises(ValueError, match="ids up to 65535"):
        RoutedExperts(np.array([[[70000]]]), 70001).to_prime_rl()


# --- decoding in general --------------------------------------------------------

def test_decoders_check_dense_layers_and_name_unknown_payloads():
    r = routing(np.random.default_rng(14), tokens=3)
    payload = r.to_skyrl()
    with pytest.raises(ValueError, match="layer 4 is dense \\(not in layers\\) but holds expert ids"):
        skyrl.decode(payload, 8, layers=(1, 2))  # layer 4 taken for dense: a real MoE layer
    with pytest.raises(ValueError, match="the SkyRL payload has 5 layers; SkyRL sends every model layer "
                       "\\(num_hidden_layers = 7\\)"):
        skyrl.decode(payload, 8, layers=(1, 2), num_hidden_layers=7)
    plain = skyrl.decode(payload, 8)  # no map given: every layer taken for MoE, dense ones as expert 0
    assert plain.layers == tuple(range(HIDDEN))
    with pytest.raises(ValueError, match="cannot tell which consumer's payload"):
        formats.decode([1, 2, 3], 8)


def test_payloads_naming_more_layers_than_any_model_are_refused_before_a_layer_list_is_built():
    """A few bytes with 0 tokens (or top_k 0) can name 2^31 - 1 layers: each
    decoder refuses the count before building anything that long."""
    from moecap.record import MAX_LAYERS
    huge = 2**31 - 1
    for payload, consumer in (({"data": "", "shape": [0, huge, 1], "dtype": "uint8"}, "SkyRL"),
                              ({"data": "", "shape": [0, huge, 1], "start": 0, "dtype": "uint8"}, "prime-rl")):
        with pytest.raises(ValueError, match=f"the {consumer} payload has {huge} layers; a RoutedExperts holds "
                                             f"at most {MAX_LAYERS}"):
            formats.decode(payload, 8)
    # No layers or no experts per token: no routing, and a few bytes that name billions of rows (whose
    # bookkeeping a decoder would build before finding there is nothing to read) are refused by their shape.
    for payload, consumer in ((f"nrlre1:int8:1x{huge}x0:", "NeMo-RL"), ("nrlre1:int8:1x3x0:", "NeMo-RL"),
                              ("nrlre1:int8:3000000000x2x0:", "NeMo-RL"),
                              ({"data": "", "shape": [10**11, 0, 2], "dtype": "uint8"}, "SkyRL"),
                              ({"data": "", "shape": [10**11, 2, 0], "start": 0, "dtype": "uint8"}, "prime-rl")):
        with pytest.raises(ValueError, match=f"the {consumer} payload's shape .* is not \\[S, L, K\\] with S >= 0 "
                                             "and L, K >= 1"):
            formats.decode(payload, 8)


def test_decoders_refuse_ids_no_expert_could_have_and_non_integer_payloads():
    """No trainer format but NeMo-RL's whole -1 rows has a value for 'no
    routing': a -1 id would be replayed (Megatron's gather fails on it, verl
    and slime pad with real experts), and a float would truncate to an expert."""
    r = routing(np.random.default_rng(15), tokens=3)
    rows = engine_rows(r, np.int32)  # [3, HIDDEN, TOP_K], dense layers 0
    holed = rows.copy()
    holed[1, LAYERS[0], :] = -1
    per_layer = [torch.from_numpy(holed[:, layer].copy()) for layer in LAYERS]
    decoders = {
        "slime": lambda a: slime.decode(a, 8, HIDDEN, TOP_K, num_tokens=4, layers=LAYERS),
        "verl": lambda a: verl.decode(np.concatenate([a, np.zeros_like(a[:1])]), 8, prompt_len=2, num_tokens=4,
                                      layers=LAYERS),
        "Megatron's RouterReplay": lambda layers: formats.megatron.decode(layers, 8, layers=LAYERS,
                                                                          num_hidden_layers=HIDDEN),
    }
    for consumer, decode in decoders.items():
        megatron = consumer.startswith("Megatron")
        given = per_layer if megatron else holed
        with pytest.raises(ValueError, match=f"the {consumer} payload holds id -1; {consumer} has no value for"):
            decode(given)
        floats = [t.double() + 0.7 for t in per_layer] if megatron else rows + 0.7
        with pytest.raises(ValueError, match=f"the {consumer} payload is float64; expert ids are integers"):
            decode(floats)
    past = rows.astype(np.uint64)
    past[0, LAYERS[0], 0] = 2**64 - 1  # as int64 this would read -1
    with pytest.raises(ValueError, match=f"holds id {2**64 - 1}; expected ids in \\[0, num_experts = 8\\)"):
        slime.decode(past, 8, HIDDEN, TOP_K, num_tokens=4, layers=LAYERS)
    assert slime.decode(rows, 8, HIDDEN, TOP_K, num_tokens=4, layers=LAYERS) == r
    sky_holed = dict(r.to_skyrl(), dtype="int16", data=base64.b64encode(holed.astype(np.int16).tobytes()).decode())
    with pytest.raises(ValueError, match="the SkyRL payload holds id -1"):
        skyrl.decode(sky_holed, 8, layers=LAYERS)


def test_decoders_refuse_malformed_dicts_and_envelopes_with_value_errors():
    r = routing(np.random.default_rng(16), tokens=3)
    for encode, decode, consumer in ((r.to_prime_rl, prime_rl.decode, "prime-rl"), (r.to_skyrl, skyrl.decode, "SkyRL")):
        payload = encode()
        for shape in ([3.0, HIDDEN, TOP_K], [-1, -3, TOP_K], ["3", HIDDEN, TOP_K], [True, HIDDEN, TOP_K], [3, HIDDEN]):
            with pytest.raises(ValueError, match=f"the {consumer} payload's shape .* is not \\[S, L, K\\]"):
                decode(dict(payload, shape=shape), 8, layers=LAYERS)
        for data in (None, 12, ["AAAA"]):
            with pytest.raises(ValueError, match="data has a .*; expected base64 text"):
                decode(dict(payload, data=data), 8, layers=LAYERS)
        with pytest.raises(ValueError, match="data has no valid base64"):
            decode(dict(payload, data="A"), 8, layers=LAYERS)
        with pytest.raises(ValueError, match="dtype \\['uint8'\\]"):
            decode(dict(payload, dtype=["uint8"]), 8, layers=LAYERS)
        assert decode(payload, 8, layers=LAYERS) == r
    with pytest.raises(ValueError, match="start must be an int, not float"):
        prime_rl.decode(dict(r.to_prime_rl(), start=2.9), 8, layers=LAYERS)
    for decode in (lambda: RoutedExperts.from_sglang(b"", 8, -1, -2),
                   lambda: slime.decode(b"", 8, HIDDEN, 0, num_tokens=1)):
        with pytest.raises(ValueError, match="a payload's rows need both >= 1"):
            decode()
    with pytest.raises(TypeError, match="num_hidden_layers must be an int, not float"):
        RoutedExperts.from_sglang(b"", 8, 2.5, 2)  # never truncated to 2 layers
    # A shape whose element count overflows int64 is a size mismatch, not a wrapped-around 0.
    with pytest.raises(ValueError, match="envelope holds 0 bytes; int8 \\[4294967296, 4294967296, 1\\] takes "
                                         f"{2**64}"):
        nemo_rl.decode("nrlre1:int8:4294967296x4294967296x1:", 8)


def test_prime_rl_trainer_array_is_none_without_a_forwarded_row():
    """verifiers copies the last forwarded row for the final position; with no
    row (every position from start cached but the last) it attaches none, so
    the sample carries no routing rather than a zero row replayed as expert 0."""
    empty = RoutedExperts(np.zeros((0, len(LAYERS), TOP_K), dtype=np.int64), 8, start=8, layers=LAYERS,
                          num_hidden_layers=HIDDEN)
    payload = empty.to_prime_rl(num_tokens=9)
    assert payload["shape"] == [0, HIDDEN, TOP_K]
    assert verifiers_node_rows(payload, 8, 1) is None and prime_rl.trainer_array(empty, num_tokens=9) is None


def test_a_vllm_npy_is_read_as_its_bytes_say_never_as_its_header_alone_says():
    """np.load allocates what a .npy header names before it reads anything, and ignores bytes after the
    array: a 172-character payload named 64 TiB, and a concatenation passed as its first array."""
    from moecap.formats import vllm
    r = routing(np.random.default_rng(21), tokens=3)
    good = base64.b64decode(vllm.openai(r, num_tokens=4))
    header = good[:len(good) - 3 * HIDDEN * TOP_K]  # uint8 rows: the data is the last 30 bytes
    huge = header.replace(b"(3, 5, 2)", b"(1099511627776, 8, 8)")
    for raw, says in ((huge, "holds \\d+ bytes of data; its header's uint8 \\[1099511627776, 8, 8\\] takes 70368744177664"),
                      (good + b"\0" * 1000, "holds 1030 bytes of data"), (good + good, "bytes of data"),
                      (b"", "not a .npy file"), (b"\x93NUMPY\x03\x00", "not a .npy file|version 3.0")):
        with pytest.raises(ValueError, match=says):
            vllm.decode(base64.b64encode(raw).decode("ascii"), 8, layers=LAYERS)
    assert np.array_equal(vllm.decode(vllm.openai(r, num_tokens=4), 8, layers=LAYERS).ids, r.ids)


def test_an_engines_payload_short_of_the_models_layers_is_refused_not_read_as_moe_layers_only():
    """vLLM, SkyRL, prime-rl, verl, SGLang and slime send every model layer: a payload cut to as many layers
    as the model has MoE layers would otherwise read its first layers as the MoE ones (dense zeros as
    expert 0). Megatron's list has one tensor per MoE layer, never one per model layer."""
    from moecap.formats import megatron, vllm
    r = routing(np.random.default_rng(22), tokens=3)
    rows = engine_rows(r, np.uint8)[:, :len(LAYERS)]  # 3 of the model's 5 layers
    with pytest.raises(ValueError, match="the vLLM payload has 3 layers; vLLM sends every model layer"):
        vllm.decode(rows, 8, layers=LAYERS, num_hidden_layers=HIDDEN)
    with pytest.raises(ValueError, match="SkyRL payload has 3 layers; SkyRL sends every model layer"):
        skyrl.decode({"data": base64.b64encode(rows.tobytes()).decode(), "shape": list(rows.shape),
                      "dtype": "uint8"}, 8, layers=LAYERS, num_hidden_layers=HIDDEN)
    per_layer = r.to_megatron()
    with pytest.raises(ValueError, match="payload has 3 layers; layers names 2 \\(one per MoE layer\\)"):
        megatron.decode(per_layer, 8, layers=LAYERS[:2], num_hidden_layers=HIDDEN)
    assert megatron.decode(per_layer, 8, layers=LAYERS, num_hidden_layers=HIDDEN) == r


def test_decoders_take_positions_and_counts_as_ints_and_name_what_they_cannot_read():
    from moecap.formats import sglang, vllm
    r = routing(np.random.default_rng(23), tokens=3)
    verl_row = verl.encode(r, prompt_len=2, prompt_width=4, response_width=8)[0]  # 4 rows of sequence, 8 padding
    for num_tokens in (0, -3):  # a negative stop would wrap around the padding
        with pytest.raises(ValueError, match=f"num_tokens is {num_tokens} and prompt_len 2; a sequence has at least 1"):
            verl.decode(verl_row, 8, prompt_len=2, num_tokens=num_tokens, prompt_width=4, layers=LAYERS)
    for bad in (np.int16(0), None):
        with pytest.raises(ValueError, match="batch_row has shape \\(\\); expected"):
            verl.decode(bad, 8, prompt_len=2, num_tokens=4, layers=LAYERS)
    for call in (lambda: vllm.decode(engine_rows(r, np.uint8), 8, start=1.5, layers=LAYERS),
                 lambda: slime.decode(r.to_slime(), 8, HIDDEN, TOP_K, num_tokens=7.9, layers=LAYERS),
                 lambda: verl.decode(verl_row, 8, prompt_len=2, num_tokens=True, prompt_width=4, layers=LAYERS)):
        with pytest.raises(TypeError, match="must be an int, not (float|bool)"):
            call()  # 1.5 is not position 1, True not 1 token
    with pytest.raises(ValueError, match="start is 100; a 5-token sequence's positions are \\[0, 5\\)"):
        vllm.decode(np.zeros((0, HIDDEN, TOP_K), np.uint8), 8, start=100, num_tokens=5, layers=LAYERS)
    with pytest.raises(ValueError, match="num_tokens is -5; a sequence has at least 1 token"):
        sglang.decode(b"", 8, HIDDEN, TOP_K, num_tokens=-5, layers=LAYERS)
    for text in ("AAA", "routé"):  # bad padding; not ASCII
        with pytest.raises(ValueError, match="the SGLang payload has no valid base64"):
            sglang.decode(text, 8, HIDDEN, TOP_K, layers=LAYERS)
        with pytest.raises(ValueError, match="the slime payload has no valid base64"):
            slime.decode(text, 8, HIDDEN, TOP_K, num_tokens=4, layers=LAYERS)
    from moecap.formats import megatron
    with pytest.raises(ValueError, match="per_layer is a NoneType; Megatron replays a list"):
        megatron.decode(None, 8)


def test_decoders_refuse_layer_maps_that_are_not_increasing_model_indices():
    """A fractional, boolean or textual layer index is no model layer: int() would turn 1.9 into layer 1
    and replay one layer's routing at another."""
    from moecap.formats import megatron, sglang, vllm
    r = routing(np.random.default_rng(31), tokens=3)
    rows = engine_rows(r, np.uint8)
    for bad, error, message in (([1.9, 2, 4], ValueError, "layers must be a sequence of ints, not float64"),
                                ([True, 2, 4], TypeError, "layers must be a sequence of ints, not of bools"),
                                (["1", "2", "4"], ValueError, "layers must be a sequence of ints"),
                                ([-1, 2, 4], ValueError, "layers\\[0\\] is -1; model layers start at 0"),
                                ([2, 1, 4], ValueError, "layers\\[1\\] is 1 after 2; layers must be strictly"),
                                ([], ValueError, "layers is empty")):
        for call in (lambda: vllm.decode(rows, 8, layers=bad),
                     lambda: sglang.decode(rows.astype("<i4").tobytes(), 8, HIDDEN, TOP_K,
                                           layers=bad),
                     lambda: skyrl.decode(r.to_skyrl(), 8, layers=bad)):
            with pytest.raises(error, match=message):
                call()
    with pytest.raises(ValueError, match="layers must be a sequence of ints, not float64"):
        megatron.decode(r.to_megatron(), 8, layers=[1.0, 2.0, 4.7])
    for iterable in (iter(LAYERS), dict.fromkeys(LAYERS).keys(), map(int, LAYERS)):  # taken as the sequence they give
        assert vllm.decode(rows, 8, layers=iterable).layers == LAYERS
    with pytest.raises(ValueError, match="vLLM payload has shape \\(3, 0, 2\\); layers and top_k must be >= 1"):
        vllm.decode(rows[:, :0], 8)  # the payload's own width, not a layers argument it was never given


def test_formats_decode_checks_num_tokens_for_every_payload_that_carries_its_shape():
    r = routing(np.random.default_rng(32), tokens=3, start=0)  # T = 4
    for payload in (r.to_nemo_rl(), r.to_skyrl(), r.to_prime_rl()):
        assert len(formats.decode(payload, 8, layers=LAYERS, num_tokens=4)) == 3
        with pytest.raises(ValueError, match="num_tokens is 100"):
            formats.decode(payload, 8, layers=LAYERS, num_tokens=100)
    late = routing(np.random.default_rng(33), tokens=3, start=2)  # prime-rl carries start: T = 6
    assert formats.decode(late.to_prime_rl(), 8, layers=LAYERS, num_tokens=6).start == 2
    with pytest.raises(ValueError, match="num_tokens is 4; the routing has 3 rows from position 2"):
        formats.decode(late.to_prime_rl(), 8, layers=LAYERS, num_tokens=4)
