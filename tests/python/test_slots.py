# SPDX-License-Identifier: Apache-2.0
"""ABI 1.1 from Python: slots that fail closed (never committed or
invalidated slots read -1, strict reads refuse them), the library's config
defaults, and a top-k "kernel" writing straight into the exported layer views."""
import numpy as np
import pytest
import torch

import moecap

CONFIG = dict(num_layers=3, top_k=2, num_experts=16, host_slots=32, max_running_requests=8,
              chunked_prefill_size=8)


def fill(cap, rows):
    for layer in range(3):
        cap.capture(layer, np.arange(rows * 2, dtype=np.int32).reshape(rows, 2) % 16)


def test_slots_never_committed_or_invalidated_read_minus_one():
    with moecap.Capturer(weight_dtype="f32", **CONFIG) as cap:
        for layer in range(3):
            cap.capture(layer, np.array([[1, 2], [3, 4]], dtype=np.int32), np.full((2, 2), 0.5, dtype=np.float32))
        cap.commit(np.array([4, 6]))
        ids, weights = cap.read(np.array([4, 5, 6]), weights_out=np.ones((3, 3, 2), dtype=np.float32))
        assert ids[0, 0].tolist() == [1, 2] and ids[2, 0].tolist() == [3, 4]
        assert (ids[1] == -1).all() and (weights[1] == 0).all()  # slot 5: never committed
        states = cap.slot_states(np.array([4, 5, 6]))
        assert states.tolist() == [moecap.SLOT_VALID, moecap.SLOT_EMPTY, moecap.SLOT_VALID]
        assert int(((states & moecap.SLOT_VALID) == 0).sum()) == 1  # how many of the tokens read were empty

        cap.invalidate(np.array([6, -1]))  # the engine freed slot 6's KV; -1 is ignored
        assert (cap.read(np.array([6])) == -1).all()
        assert cap.slot_states(torch.tensor([6])).tolist() == [moecap.SLOT_EMPTY]
        with pytest.raises(moecap.MoecapError) as e:
            cap.invalidate(np.array([32]))
        assert e.value.status == moecap.Status.OUT_OF_RANGE

        for layer in range(3):  # commit consumed the rows: the next step captures again
            cap.capture(layer, np.array([[1, 2], [3, 4]], dtype=np.int32), np.full((2, 2), 0.5, dtype=np.float32))
        cap.commit(np.array([6]), src_start=1)  # reused and committed again
        assert cap.read(np.array([6]))[0, 2].tolist() == [3, 4]


def test_strict_read_refuses_a_slot_without_routing_and_writes_nothing():
    with moecap.Capturer(**CONFIG) as cap:
        fill(cap, 1)
        cap.commit(np.array([3]))
        out = np.full((2, 3, 2), 7, dtype=np.int32)
        with pytest.raises(moecap.MoecapError) as e:
            cap.read(np.array([3, 9]), out=out, strict=True)
        assert e.value.status == moecap.Status.NO_ROUTING
        assert "(strict=True)" in str(e.value) and "MOECAP_READ" not in str(e.value)  # the method's terms
        assert (out == 7).all()
        assert cap.read(np.array([3]), strict=True)[0, 0].tolist() == [0, 1]
    with moecap.Capturer(**{**CONFIG, "num_experts": 256}) as cap:
        with pytest.raises(moecap.MoecapError, match="use a signed dtype, or strict=True$"):
            cap.read(np.array([0]), dtype=np.uint8)


def test_a_read_takes_moecaps_dtype_names_as_config_does():
    """"u8" is uint8 in Config; NumPy reads it as uint64, which a read would
    have allocated."""
    with moecap.Capturer(**CONFIG) as cap:
        fill(cap, 1)
        cap.commit(np.array([3]))
        for name, dtype in (("u8", np.uint8), ("u16", np.uint16), ("i16", np.int16), ("i32", np.int32),
                            ("uint8", np.uint8), ("int64", np.int64)):
            got = cap.read(np.array([3, 4]), dtype=name)
            assert got.dtype == dtype and got[0, 0].tolist() == [0, 1]
            assert (got[1] == np.array(-1).astype(dtype)).all()  # slot 4 holds nothing: all ones
        torch = pytest.importorskip("torch")
        assert cap.read(torch.tensor([3]), dtype="u8").dtype == torch.uint8


def test_config_takes_the_library_defaults_and_the_device_dtype():
    config = moecap._moecap.Config()  # moecap_config_init
    assert (config.dp_size, config.verify_tokens, config.device_type, config.id_dtype) == (1, 1, 1, 0)
    assert moecap.plan(**CONFIG)["device_id_dtype"] == "i16"
    assert moecap.plan(**CONFIG, device_id_dtype="i32")["device_id_bytes"] == 4
    with pytest.raises(ValueError, match="device_id_dtype must be one of"):
        moecap.plan(**CONFIG, device_id_dtype="i8")


def test_a_kernel_writes_the_layer_views_and_commit_reads_them():
    # What a fused top-k kernel does with out=: write int32 ids into each layer's compact view.
    with moecap.Capturer(device_id_dtype="i32", **CONFIG) as cap:
        views = [torch.from_dlpack(cap.export("layer_ids", layer=layer)) for layer in range(3)]
        assert all(v.shape == (8, 2) and v.is_contiguous() and v.dtype == torch.int32 for v in views)
        routing = torch.randint(0, 16, (3, 4, 2), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        for layer, view in enumerate(views):
            view[:4].copy_(routing[layer])  # the kernel's write; no moecap_capture
        cap.commit(torch.tensor([10, 11, 12, 13]))
        assert torch.equal(cap.read(torch.tensor([10, 11, 12, 13])), routing.transpose(0, 1))


@pytest.mark.parametrize("top_k", [8, 6, 4, 2, 1, 3, 10, 5])
@pytest.mark.parametrize("device_id_dtype, experts",
                         [("auto", 256), ("u8", 255), ("u8", 9), ("auto", 384), ("auto", 512)])
def test_a_decode_commit_reads_back_what_was_captured(device_id_dtype, experts, top_k):
    # The common commit (a row range, no weights) at the top-k of DeepSeek-V3, DeepSeek-V2, gpt-oss, Mixtral,
    # Llama 4 and Step-3 (the one-pass kernels), of Qwen3-Next and a width fixed only at run time (the staged path),
    # into u8 host ids and (384 and 512 experts: Kimi K2's, Qwen3-Next's) u16 ones, with rows and layers
    # enough for the host kernel's passes and blocks and what is left after them.
    layers, rows = 9, 43
    config = dict(num_layers=layers, top_k=top_k, num_experts=experts, host_slots=256, max_running_requests=64,
                  device_id_dtype=device_id_dtype)
    if top_k > experts:  # top-10 of 9 experts
        with pytest.raises(moecap.MoecapError, match="top_k is 10; it must be <= num_experts"):
            moecap.Capturer(**config)
        return
    gen = torch.Generator().manual_seed(3)
    routing = torch.randint(0, experts, (layers, rows, top_k), dtype=torch.int32, generator=gen)
    with moecap.Capturer(**config) as cap:
        assert cap.plan.device_id_dtype == ("i16" if device_id_dtype == "auto" else "u8")
        for layer in range(layers):
            cap.capture(layer, routing[layer])
        slots = torch.randperm(256, generator=gen)[:rows - 3]
        cap.commit(slots, src_start=3)
        assert torch.equal(cap.read(slots, strict=True), routing[:, 3:].transpose(0, 1))
        device = torch.from_dlpack(cap.export("device_ids"))
        none = -1 if device.dtype == torch.int16 else 255
        assert (device[:, 3:rows].to(torch.int32) == none).all()  # consumed
        assert (device[:, :3].to(torch.int32) != none).all()  # not named by the commit


def test_invalidate_recorded_in_a_graph_runs_at_each_replay():
    with moecap.Capturer(**CONFIG) as cap:
        fill(cap, 2)
        cap.commit(np.array([1, 2]))
        freed = np.full(2, -1, dtype=np.int64)
        cap.graph_begin()
        cap.invalidate(freed)
        graph = cap.graph_end()
        assert cap.slot_states(np.array([1, 2])).tolist() == [moecap.SLOT_VALID] * 2  # recorded, not run
        freed[:] = [2, -1]
        graph.launch()
        assert cap.slot_states(np.array([1, 2])).tolist() == [moecap.SLOT_VALID, moecap.SLOT_EMPTY]
