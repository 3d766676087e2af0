# SPDX-License-Identifier: Apache-2.0
"""The routing record from Python (moecap.record, which calls the library's
codec through the extension) and from C (moecap_record_encode, called here
through ctypes): the same bytes, round trips, sizes, refusals, and the shapes
each RL consumer takes."""
import base64
import ctypes
import os

import numpy as np
import pytest

import moecap
import moecap.record
from moecap.record import RecordError, RoutedExperts, id_bits, signed_dtype


# --- the C encoder, through ctypes ---------------------------------------------

class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class Source(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("flags", ctypes.c_uint32), ("num_experts", ctypes.c_int32),
                ("start_position", ctypes.c_int64), ("ids", ctypes.POINTER(DLTensor)),
                ("weights", ctypes.POINTER(DLTensor)), ("valid", ctypes.POINTER(DLTensor))]


def _library():
    """The libmoecap.so the moecap package itself loaded (MOECAP_LIBRARY overrides)."""
    path = os.environ.get("MOECAP_LIBRARY")
    if not path:
        import moecap._moecap  # noqa: F401  (maps the library into this process)
        with open("/proc/self/maps") as maps:
            loaded = {line.split()[-1] for line in maps if "/libmoecap.so" in line}
        assert len(loaded) == 1, f"expected one libmoecap.so mapped by the moecap package, found {loaded}"
        path = loaded.pop()
    lib = ctypes.CDLL(path)
    lib.moecap_record_size.argtypes = [ctypes.POINTER(Source), ctypes.POINTER(ctypes.c_uint64)]
    lib.moecap_record_encode.argtypes = [ctypes.POINTER(Source), ctypes.c_void_p, ctypes.c_uint64,
                                         ctypes.POINTER(ctypes.c_uint64)]
    lib.moecap_record_decode.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.POINTER(DLTensor),
                                         ctypes.POINTER(DLTensor), ctypes.POINTER(DLTensor)]
    lib.moecap_last_error.restype = ctypes.c_char_p
    return lib


LIB = _library()
_CODES = {"i": 0, "u": 1, "f": 2}


KDL_BFLOAT = 4


def _dl(arr, keep, code=None):
    shape = (ctypes.c_int64 * arr.ndim)(*arr.shape)
    keep.extend([arr, shape])
    code = _CODES[arr.dtype.kind] if code is None else code
    t = DLTensor(arr.ctypes.data if arr.size else None, DLDevice(1, 0), arr.ndim,
                 DLDataType(code, arr.dtype.itemsize * 8, 1), shape, None, 0)
    keep.append(t)
    return ctypes.pointer(t)


def c_encode(ids, num_experts, weights=None, valid=None, start=0, packed=True, bf16_bits=False):
    """bf16_bits: weights is a uint16 array of bfloat16 bit patterns."""
    keep = []
    src = Source(ctypes.sizeof(Source), 1 if packed else 0, num_experts, start,
                 _dl(np.ascontiguousarray(ids), keep),
                 None if weights is None else _dl(np.ascontiguousarray(weights), keep,
                                                  KDL_BFLOAT if bf16_bits else None),
                 None if valid is None else _dl(np.ascontiguousarray(valid, dtype=np.uint8), keep))
    size = ctypes.c_uint64()
    status = LIB.moecap_record_size(ctypes.byref(src), ctypes.byref(size))
    if status:
        raise ValueError(LIB.moecap_last_error().decode())
    out = ctypes.create_string_buffer(size.value)
    assert LIB.moecap_record_encode(ctypes.byref(src), out, size.value, None) == 0
    return out.raw


def c_decode(data, shape):
    keep = []
    ids = np.full(shape, 99, dtype=np.int32)
    valid = np.zeros(shape[0], dtype=np.uint8)
    status = LIB.moecap_record_decode(data, len(data), _dl(ids, keep), None, _dl(valid, keep))
    if status:
        raise ValueError(LIB.moecap_last_error().decode())
    return ids, valid.astype(bool)


def bf16_bits(w):
    """Reference float32 -> bfloat16 rounding (nearest even, NaN kept quiet), the test's own oracle."""
    u = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return np.where(nan, (u >> 16) | 0x40, rounded).astype("<u2")


def weight_section(record, count, itemsize):
    return record[len(record) - count * itemsize:]


def random_routing(rng, tokens, layers, top_k, experts, holes=True):
    ids = rng.integers(0, experts, size=(tokens, layers, top_k)).astype(np.int32)
    if holes:
        ids[rng.random(ids.shape) < 0.05] = -1  # ids out of range at capture
    weights = rng.random((tokens, layers, top_k)).astype(np.float32)
    valid = rng.random(tokens) > 0.2
    return ids, weights, valid


# --- tests ----------------------------------------------------------------------

@pytest.mark.parametrize("experts", [1, 5, 8, 60, 128, 255, 256, 257, 384, 65535, 65536, 70000])
@pytest.mark.parametrize("packed", [True, False])
def test_python_and_c_write_identical_bytes(experts, packed):
    rng = np.random.default_rng(experts)
    ids, weights, valid = random_routing(rng, 23, 4, 3, experts)
    r = RoutedExperts(ids, experts, weights=weights, valid=valid, start=5)
    py = r.to_bytes(packed=packed)
    assert py == c_encode(ids, experts, weights, valid, start=5, packed=packed)
    # ids only, every token valid: no bitmap, no weights
    assert RoutedExperts(ids, experts).to_bytes(packed=packed) == c_encode(ids, experts, packed=packed)
    # f16 weights kept as f16 on both sides
    r16 = RoutedExperts(ids, experts, weights=weights.astype(np.float16), valid=valid)
    assert r16.to_bytes(packed=packed) == c_encode(ids, experts, weights.astype(np.float16), valid, packed=packed)
    # bf16: float32 weights rounded by the library, as a C caller's own bf16 bits would be stored
    bits = bf16_bits(weights)
    assert r.to_bytes(packed=packed, weights="bf16") == c_encode(ids, experts, bits, valid, start=5, packed=packed,
                                                                 bf16_bits=True)
    # and each side reads the other's
    back = RoutedExperts.from_bytes(c_encode(ids, experts, weights, valid, start=5, packed=packed))
    assert back == r and back.start == 5
    got, got_valid = c_decode(py, ids.shape)
    assert np.array_equal(got_valid, valid)
    assert np.array_equal(got[valid], ids[valid]) and (got[~valid] == -1).all()


def test_round_trip_keeps_everything():
    rng = np.random.default_rng(0)
    ids, weights, valid = random_routing(rng, 40, 61, 8, 256)
    r = RoutedExperts(ids, 256, weights=weights, valid=valid, start=1234)
    for packed in (True, False):
        back = RoutedExperts.from_bytes(r.to_bytes(packed=packed))
        assert back == r
        assert back.ids.dtype == np.int16  # 256 experts and -1: int16
        routed = valid[:, None, None] & (ids >= 0)  # an invalid token's and a -1's weights are stored as 0
        assert np.array_equal(back.weights[routed], weights[routed]) and (back.weights[~routed] == 0).all()
    bf = RoutedExperts.from_bytes(r.to_bytes(weights="bf16"))
    np.testing.assert_allclose(bf.weights[routed], weights[routed], rtol=2 ** -8)
    assert RoutedExperts.from_bytes(r.to_bytes(weights=None)).weights is None


def test_sizes_for_a_deepseek_v3_request():
    """61 layers, top-8 of 256 experts: bytes per token against SGLang's
    int32 base64 (docs/CONSUMERS.md's table)."""
    tokens = 4096
    ids = np.zeros((tokens, 61, 8), dtype=np.int16)
    r = RoutedExperts(ids, 256)
    packed, plain = len(r.to_bytes(packed=True)), len(r.to_bytes(packed=False))
    assert packed == 40 + tokens * 61 * 8 * 9 // 8       # 549 bytes a token
    assert plain == 40 + tokens * 61 * 8 * 2             # 976 bytes a token (u16: 255 is an expert)
    sglang = len(r.to_sglang())
    assert sglang == 4 * -(-tokens * 61 * 8 * 4 // 3)   # 2602.7 bytes a token
    assert sglang / packed > 4.7


def test_packing_width():
    assert [id_bits(e, True) for e in (1, 2, 3, 7, 8, 255, 256, 511, 512)] == [1, 2, 2, 3, 4, 8, 9, 9, 10]
    assert [id_bits(e, False) for e in (8, 255, 256, 65535, 65536)] == [8, 8, 16, 16, 32]
    assert [signed_dtype(e) for e in (128, 129, 32768, 32769)] == [np.int8, np.int16, np.int16, np.int32]


def test_bad_records_are_refused():
    r = RoutedExperts(np.array([[[0, 4]], [[1, 2]]]), 5, valid=[True, False])
    good = r.to_bytes()
    with pytest.raises(RecordError, match="magic"):
        RoutedExperts.from_bytes(b"XXXX" + good[4:])
    with pytest.raises(RecordError, match="version is 7"):
        RoutedExperts.from_bytes(good[:4] + b"\x07\x00" + good[6:])
    with pytest.raises(RecordError, match="header says"):
        RoutedExperts.from_bytes(good[:-1])
    with pytest.raises(RecordError, match="at least 40"):
        RoutedExperts.from_bytes(good[:10])
    bad = bytearray(good)
    bad[41] = (bad[41] & 0xF8) | 6  # code 6: neither an expert (< 5) nor the sentinel (7)
    with pytest.raises(RecordError, match="id 0 is 6"):
        RoutedExperts.from_bytes(bytes(bad))
    with pytest.raises(ValueError, match=r"ids\[0, 0, 1\] is 5"):
        RoutedExperts(np.array([[[0, 5]]]), 5)
    with pytest.raises(ValueError, match="valid has shape"):
        RoutedExperts(np.zeros((2, 1, 1), dtype=np.int32), 5, valid=[True])


def test_consumer_shapes():
    rng = np.random.default_rng(1)
    ids, _, valid = random_routing(rng, 6, 3, 2, 300, holes=False)
    valid[2] = False
    r = RoutedExperts(ids, 300, valid=valid)
    # SGLang: base64 of int32 [tokens, layers, top_k], decoded the way its clients do; no value for "none"
    with pytest.raises(ValueError, match="SGLang has no value for 'no routing'"):
        r.to_sglang()
    raw = np.frombuffer(base64.b64decode(r.to_sglang(invalid="zero")), dtype=np.int32).reshape(-1, 3, 2)
    assert np.array_equal(raw, np.where(valid[:, None, None], ids, 0))
    # Each consumer's format is tested against that consumer in test_formats_*.py / test_integration_*.py.


def test_from_read_marks_empty_slots_invalid():
    ids = np.array([[[1, 2]], [[-1, -1]], [[3, -1]]], dtype=np.int32)
    r = RoutedExperts.from_read(ids, 4)
    assert r.valid.tolist() == [True, False, True]
    assert r.ids[2].tolist() == [[3, -1]]


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_from_read_takes_an_unsigned_reads_all_ones_as_minus_one_where_it_is_no_expert(dtype):
    top = np.iinfo(dtype).max
    r = RoutedExperts.from_read(np.array([[[1, 2]], [[top, top]], [[3, top]]], dtype=dtype), 4)
    assert r.valid.tolist() == [True, False, True]
    assert r.ids.tolist() == [[[1, 2]], [[-1, -1]], [[3, -1]]]
    if dtype == np.uint8:  # with 256 experts 255 is an expert, in uint8 as in every other dtype
        assert RoutedExperts.from_read(np.array([[[255, 0]]], dtype=dtype), 256).ids.tolist() == [[[255, 0]]]


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_unsigned_ids_past_the_experts_are_refused_even_where_int64_would_make_them_minus_one(dtype):
    top = np.iinfo(dtype).max
    with pytest.raises(ValueError, match=rf"ids\[0, 0, 1\] is {top}; expected \[0, 8\) or -1"):
        RoutedExperts(np.array([[[1, top]]], dtype=dtype), 8)
    assert RoutedExperts(np.array([[[1, 7]]], dtype=dtype), 8).ids.tolist() == [[[1, 7]]]


def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    w = np.random.default_rng(5).standard_normal((10000, 1, 1)).astype(np.float32)
    w[:4, 0, 0] = [1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, np.inf, -0.0]  # ties to even, infinity, signed zero
    want = torch.from_numpy(w).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    record = RoutedExperts(np.zeros(w.shape, dtype=np.int32), 4, weights=w).to_bytes(weights="bf16")
    assert weight_section(record, w.size, 2) == want.astype("<u2").tobytes()
    assert np.array_equal(bf16_bits(w), want)  # the reference the byte comparison above uses


def test_weights_convert_to_the_stored_dtype_as_numpy_and_torch_do():
    w = np.random.default_rng(6).standard_normal((50, 2, 3)).astype(np.float32) * 1000
    ids = np.zeros(w.shape, dtype=np.int32)
    r = RoutedExperts(ids, 4, weights=w)
    assert weight_section(r.to_bytes(weights="f16"), w.size, 2) == w.astype("<f2").tobytes()
    assert r.to_bytes(weights=np.float16) == r.to_bytes(weights="f16")
    torch = pytest.importorskip("torch")
    assert r.to_bytes(weights=torch.bfloat16) == r.to_bytes(weights="bf16")
    half = RoutedExperts(ids, 4, weights=w.astype(np.float16))
    assert weight_section(half.to_bytes(weights="f32"), w.size, 4) == w.astype(np.float16).astype("<f4").tobytes()
    with pytest.raises(ValueError, match="weights must be 'keep', None"):
        r.to_bytes(weights="f64")


def test_the_record_works_without_torch():
    """to_bytes / from_bytes need NumPy and the extension only: run in a process where
    importing torch fails."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['torch'] = None\n"
            "import numpy as np, moecap\n"
            "from moecap.record import RoutedExperts\n"
            "r = RoutedExperts(np.array([[[1, 2]], [[3, -1]]]), 4, weights=np.ones((2, 1, 2), np.float32),"
            " valid=[True, False])\n"
            "back = RoutedExperts.from_bytes(r.to_bytes(weights='bf16'))\n"
            "assert back == r and 'torch' not in {m for m in sys.modules if sys.modules[m] is not None}\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_bad_input_to_the_codec_is_a_record_error_with_a_status():
    good = RoutedExperts(np.array([[[0, 4]]]), 5).to_bytes()
    with pytest.raises(RecordError, match="layers 0") as e:
        RoutedExperts.from_bytes(good[:12] + bytes(4) + good[16:])
    assert isinstance(e.value, ValueError) and isinstance(e.value, moecap.MoecapError)
    assert e.value.status == moecap.Status.INVALID_ARGUMENT
    with pytest.raises(RecordError) as e:
        RoutedExperts.from_bytes(b"MCRT" + bytes(36))  # version 0: a version this library does not read
    assert e.value.status == moecap.Status.ABI_MISMATCH
    with pytest.raises(TypeError, match="bytes-like"):
        RoutedExperts.from_bytes("MCRT")


def test_a_header_naming_more_layers_than_any_model_is_refused_before_its_layer_map_is_built():
    """40 bytes, 0 tokens, 2^31 - 1 layers: a well-formed record whose layer
    map alone would take GBs. from_bytes refuses it as a RecordError, and
    RoutedExperts the same counts as ids or num_hidden_layers."""
    from moecap.record import MAX_LAYERS
    empty = RoutedExperts(np.zeros((0, 1, 1), dtype=np.int32), 5).to_bytes()
    assert len(empty) == 40
    huge = empty[:12] + (2**31 - 1).to_bytes(4, "little") + empty[16:]
    assert moecap._moecap.record_parse(huge)["num_layers"] == 2**31 - 1  # the C reader takes it
    with pytest.raises(RecordError, match=f"num_layers is {2**31 - 1}; a RoutedExperts holds at most {MAX_LAYERS}"):
        RoutedExperts.from_bytes(huge)
    at_limit = empty[:12] + MAX_LAYERS.to_bytes(4, "little") + empty[16:]
    assert RoutedExperts.from_bytes(at_limit).shape == (0, MAX_LAYERS, 1)
    with pytest.raises(ValueError, match=f"ids has {MAX_LAYERS + 1} layers; a RoutedExperts holds at most"):
        RoutedExperts(np.zeros((0, MAX_LAYERS + 1, 1), dtype=np.int8), 5)
    with pytest.raises(ValueError, match=f"num_hidden_layers is {MAX_LAYERS + 1}; a RoutedExperts holds at most"):
        RoutedExperts(np.zeros((1, 2, 1), dtype=np.int8), 5, num_hidden_layers=MAX_LAYERS + 1)
    with pytest.raises(ValueError, match=r"layers\[2\] is 2 after 5; layers must be strictly increasing"):
        RoutedExperts(np.zeros((1, 3, 1), dtype=np.int8), 5, layers=[0, 5, 2])


def test_routing_no_sequence_or_record_can_hold_is_refused():
    """A negative start (encoded, it made payloads their own decoders refuse,
    and a 0-token sequence with rows), num_experts past the record's 2^31 - 1
    (the int32 ids wrapped expert 2^31 to "no expert"), and empty axes."""
    ids = np.array([[[1, 2]], [[3, 0]]])
    with pytest.raises(ValueError, match=r"start is -3; a position in a sequence is in \[0, 2\^63\)"):
        RoutedExperts(ids, 4, start=-3)
    with pytest.raises(ValueError, match=r"num_experts is 4294967296; must be in \[1, 2\^31\)"):
        RoutedExperts(np.array([[[2**31, 5]]]), 2**32)
    for shape in ((1, 0, 2), (1, 2, 0)):
        with pytest.raises(ValueError, match="layers and top_k must be >= 1"):
            RoutedExperts(np.zeros(shape, dtype=np.int32), 4)
    good = RoutedExperts(ids, 4, start=3).to_bytes()
    negative = good[:32] + (-1).to_bytes(8, "little", signed=True) + good[40:]
    with pytest.raises(RecordError, match="start_position is -1; must be >= 0"):
        RoutedExperts.from_bytes(negative)
    with pytest.raises(moecap.MoecapError, match=r"source\.start_position is -2; must be >= 0"):
        moecap._moecap.record_encode(np.ascontiguousarray(ids, dtype=np.int32), 4, None, None, -2, True, None)


def test_counts_and_positions_are_ints_never_truncated():
    ids = np.array([[[1, 2]]])
    for keyword, bad in (("num_experts", 8.9), ("num_experts", "8"), ("start", 2.7), ("start", True),
                         ("num_hidden_layers", 3.0)):
        with pytest.raises(TypeError, match=f"{keyword} must be an int, not {type(bad).__name__}"):
            RoutedExperts(ids, **dict(dict(num_experts=8), **{keyword: bad}))
    with pytest.raises(ValueError, match=r"start is 18446744073709551616; a position in a sequence is in \[0, 2\^63\)"):
        RoutedExperts(ids, 8, start=2**64)  # the record's start_position is signed 64-bit
    assert RoutedExperts(ids, np.int64(8), start=np.int32(3)).start == 3
    torch = pytest.importorskip("torch")
    assert RoutedExperts(ids, torch.tensor(8), start=torch.tensor(3)).num_experts == 8  # as Config takes them


def test_a_header_naming_a_top_k_no_token_could_hold_is_refused_before_any_row_is_built():
    """40 bytes, 0 tokens, 8 layers of top-2^28: every all-layer converter
    (NeMo-RL's padding, verl's aligned rows) would build a row of 2^31 ids."""
    from moecap.record import MAX_IDS_PER_TOKEN
    empty = RoutedExperts(np.zeros((0, 8, 1), dtype=np.int32), 2**29).to_bytes()
    huge = empty[:16] + (2**28).to_bytes(4, "little") + empty[20:]
    assert moecap._moecap.record_parse(huge)["top_k"] == 2**28
    with pytest.raises(RecordError, match=f"num_layers x top_k is 8 x {2**28}; a token of a RoutedExperts holds at "
                                          f"most {MAX_IDS_PER_TOKEN} ids"):
        RoutedExperts.from_bytes(huge)
    with pytest.raises(ValueError, match=f"top_k {2**18} over num_hidden_layers 8; a token holds at most"):
        RoutedExperts(np.zeros((0, 2, 2**18), dtype=np.int32), 2**29, num_hidden_layers=8)
    assert RoutedExperts(np.zeros((0, 4, 2**18), dtype=np.int32), 2**29).shape == (0, 4, 2**18)  # at the limit


def test_concat_keeps_float16_weights():
    half = [RoutedExperts(np.array([[[1, 2]]]), 8, weights=np.full((1, 1, 2), 0.5, np.float16), start=s)
            for s in (0, 1)]
    assert RoutedExperts.concat(half).weights.dtype == np.float16
    mixed = [half[0], RoutedExperts(np.array([[[1, 2]]]), 8, weights=np.full((1, 1, 2), 0.5, np.float32), start=1)]
    assert RoutedExperts.concat(mixed).weights.dtype == np.float32


def test_routing_keeps_its_own_copy_of_what_it_was_given():
    """An engine reads request after request into the same buffers: a
    RoutedExperts made from them must not change when they are reused."""
    for make in (np.asarray, torch_or_skip_tensor):
        ids = make(np.array([[[1, 2]]], dtype=np.int32))
        weights = make(np.array([[[0.75, 0.25]]], dtype=np.float32))
        valid = make(np.array([True]))
        routed = RoutedExperts(ids, 4, weights=weights, valid=valid)
        record = routed.to_bytes()
        ids[...] = 3
        weights[...] = 0.5
        valid[...] = False
        assert routed.ids.tolist() == [[[1, 2]]] and routed.weights.tolist() == [[[0.75, 0.25]]]
        assert routed.valid.tolist() == [True] and routed.to_bytes() == record


def torch_or_skip_tensor(array):
    torch = pytest.importorskip("torch")
    return torch.from_numpy(array)


def test_a_weights_choice_is_checked_whether_or_not_the_routing_holds_weights():
    r = RoutedExperts(np.zeros((1, 1, 1), dtype=np.int64), 3)
    for bad in ("garbage", "i32", np.int32):
        with pytest.raises(ValueError, match="weights must be 'keep', None, 'f32', 'bf16' or 'f16'"):
            r.to_bytes(weights=bad)
    assert r.to_bytes(weights="bf16") == r.to_bytes() == r.to_bytes(weights=None)  # nothing to store


def test_every_tokens_position_must_fit_in_the_records_int64():
    ids = np.zeros((3, 1, 1), dtype=np.int32)
    last = 2**63 - 3  # tokens at 2^63 - 3, - 2, - 1
    assert RoutedExperts(ids, 4, start=last).start == last
    with pytest.raises(ValueError, match=r"start is 9223372036854775806 with 3 tokens; the last token's position"):
        RoutedExperts(ids, 4, start=last + 1)
    with pytest.raises(moecap.MoecapError, match=r"source\.start_position is 9223372036854775806 with 3 tokens"):
        moecap._moecap.record_encode(ids, 4, None, None, last + 1, True, None)
    good = RoutedExperts(ids, 4, start=last).to_bytes()
    past = good[:32] + (last + 1).to_bytes(8, "little") + good[40:]
    with pytest.raises(RecordError, match="record start_position is 9223372036854775806 with 3 tokens"):
        RoutedExperts.from_bytes(past)
    empty = RoutedExperts(np.zeros((0, 1, 1), dtype=np.int32), 4, start=2**63 - 1)  # no token, no position past it
    assert RoutedExperts.from_bytes(empty.to_bytes()).start == 2**63 - 1


def test_an_invalid_token_with_weight_bytes_is_refused_naming_its_weights():
    r = RoutedExperts(np.array([[[1]], [[2]]]), 4, weights=np.ones((2, 1, 1), np.float32), valid=[True, False])
    negative_zero = bytearray(r.to_bytes(weights="f32"))
    negative_zero[-4:] = np.array([-0.0], dtype="<f4").tobytes()  # encoders write +0.0's bytes
    with pytest.raises(RecordError, match="record token 1 is invalid but its weight bytes are not all 0"):
        RoutedExperts.from_bytes(bytes(negative_zero))


def test_a_record_read_and_written_again_is_the_same_bytes_bfloat16_weights_too():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 64, size=(5, 2, 4))
    weights = rng.random((5, 2, 4), dtype=np.float32)
    r = RoutedExperts(ids, 64, weights=weights)
    for stored in ("f32", "bf16", "f16", None):
        record = r.to_bytes(weights=stored)
        back = RoutedExperts.from_bytes(record)
        assert back.to_bytes() == record, stored
        assert back.with_layer_map([1, 3], num_hidden_layers=4).to_bytes() == record, stored
    halves = [RoutedExperts.from_bytes(RoutedExperts(ids[a:b], 64, weights=weights[a:b], start=a).to_bytes(
        weights="bf16")) for a, b in ((0, 2), (2, 5))]
    assert RoutedExperts.concat(halves).to_bytes() == r.to_bytes(weights="bf16")  # the pieces' dtype kept
    assert len(RoutedExperts.from_bytes(r.to_bytes(weights="bf16")).to_bytes(weights="f32")) > \
        len(r.to_bytes(weights="bf16"))  # asked for float32, written as float32


def test_flags_layers_and_fill_values_are_taken_as_what_they_say_never_cast():
    ids = np.zeros((2, 2, 1), dtype=np.int32)
    with pytest.raises(TypeError, match="layers must be a sequence of ints, not of bools"):
        RoutedExperts(ids, 4, layers=[True, 2])
    with pytest.raises(TypeError, match="valid must be bools"):
        RoutedExperts(ids, 4, valid=["no", "no"])
    with pytest.raises(TypeError, match="valid must be bools"):
        RoutedExperts(ids, 4, valid=[0.5, 1.0])
    assert RoutedExperts(ids, 4, valid=[1, 0]).valid.tolist() == [True, False]
    with pytest.raises(ValueError, match="valid holds 2; expected bools"):  # an int dtype, a value no bool has
        RoutedExperts(ids, 4, valid=[1, 2])
    for weights, kind in ((np.array([[[None]], [[None]]]), "object"), (np.array([[["a"]], [["b"]]]), "<U1"),
                          (np.ones((2, 2, 1), dtype=np.complex64), "complex64"), (np.ones((2, 2, 1), bool), "bool")):
        with pytest.raises(TypeError, match=f"weights must be real numbers, not {kind}"):
            RoutedExperts(np.zeros((2, 1, 1), dtype=np.int32), 4, weights=weights)  # None would be NaN
    with pytest.raises(ValueError, match="ids must be an integer \\[tokens, layers, top_k\\] array, not shape"):
        RoutedExperts.from_read(np.zeros((2, 2), dtype=np.int32), 4)
    with pytest.raises(TypeError, match="parts\\[1\\] is a int; concat joins RoutedExperts"):
        RoutedExperts.concat([RoutedExperts(ids, 4), 5])
    routed = RoutedExperts(ids, 4, valid=np.array([True, False]))
    with pytest.raises(TypeError, match="packed must be a bool, not str"):
        routed.to_bytes(packed="no")
    assert routed.to_bytes(packed=np.True_) == routed.to_bytes()
    with pytest.raises(TypeError, match="dense must be an int, not float"):
        routed.all_layers(dense=1.5)


def test_routed_experts_take_an_array_that_only_speaks_dlpack():
    # np.asarray made a 0-d object array of such a producer (a moecap export is one) and refused it as
    # "not an integer array".
    from test_interop import OnlyDLPack
    ids = np.array([[[1, 2], [3, -1]]], dtype=np.int32)
    routed = RoutedExperts(OnlyDLPack(ids), 4)
    assert np.array_equal(routed.ids, ids) and routed.shape == (1, 2, 2)


def test_bfloat16_weights_are_taken_from_jax_and_from_a_moecap_export_as_from_torch():
    ids = np.zeros((4, 1, 2), dtype=np.int32)
    halves = np.array([0.5, 0.25], dtype=np.float32)
    cap = moecap.Capturer(num_layers=1, top_k=2, num_experts=8, host_slots=4, max_running_requests=2,
                          chunked_prefill_size=4, weight_dtype="bf16")
    cap.capture(0, ids[:, 0] + 1, np.tile(halves, (4, 1)))
    cap.commit(np.arange(4))
    exported = RoutedExperts(ids, 8, weights=cap.export("host_weights"))  # NumPy cannot import bfloat16
    assert exported.weights.dtype == np.float32 and (exported.weights == halves).all()
    jnp = pytest.importorskip("jax.numpy")
    from_jax = RoutedExperts(ids, 8, weights=jnp.asarray(np.broadcast_to(halves, ids.shape), dtype=jnp.bfloat16))
    assert from_jax.weights.dtype == np.float32 and (from_jax.weights == halves).all()
