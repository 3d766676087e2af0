"""NumPy and PyTorch read moecap's buffers zero-copy through DLPack, and the
ctypes binding passes their arrays in without copies."""
import numpy as np
import pytest
import torch

import moecap

CONFIG = dict(num_layers=3, top_k=2, num_experts=16, host_slots=32, max_running_requests=8,
              chunked_prefill_size=8)


def test_numpy_view_sees_commits_zero_copy():
    with moecap.Capturer(**CONFIG) as cap:
        host = np.from_dlpack(cap.export("host_ids"))
        assert host.shape == (32, 3, 2)
        assert host.dtype == np.uint8
        ids = np.array([[1, 2], [3, 4]], dtype=np.int64)
        for layer in range(3):
            cap.capture(layer, ids + layer)
        cap.commit(np.array([5, 9], dtype=np.int32))
        # The view taken before the commit sees it: same memory.
        assert host[5].tolist() == [[1, 2], [2, 3], [3, 4]]
        assert host[9, 2].tolist() == [5, 6]
        # And moecap sees a write through a view (NumPy's are read-only, so torch's).
        torch.from_dlpack(cap.export("host_ids"))[7] = 11
        assert host[7, 0, 0] == 11
        assert cap.read(np.array([7]))[0].tolist() == [[11, 11]] * 3


def test_torch_view_and_torch_inputs():
    with moecap.Capturer(weight_dtype="bf16", **CONFIG) as cap:
        dev = torch.from_dlpack(cap.export("device_ids"))
        assert dev.shape == (8, 3, 2)
        assert dev.dtype == torch.uint8
        layer1 = torch.from_dlpack(cap.export("layer_ids", layer=1))
        assert layer1.shape == (8, 2)
        assert layer1.stride() == (6, 1)
        ids = torch.tensor([[7, 8], [9, 10], [11, 12]], dtype=torch.int32)
        weights = torch.tensor([[0.5, 0.25], [0.125, 0.75], [1.0, 0.0]], dtype=torch.float32)
        cap.capture(1, ids, weights)
        assert layer1[:3].tolist() == ids.tolist()
        assert dev[2, 1].tolist() == [11, 12]
        w = torch.from_dlpack(cap.export("device_weights"))
        assert w.dtype == torch.bfloat16
        assert w[1, 1].float().tolist() == [0.125, 0.75]
        cap.commit(torch.tensor([3, -1, 4]))
        out, wout = cap.read(torch.tensor([3, 4]), dtype=torch.int64,
                             weights_out=torch.zeros(2, 3, 2, dtype=torch.float32))
        assert out[:, 1].tolist() == [[7, 8], [11, 12]]
        assert wout[0, 1].tolist() == [0.5, 0.25]


def test_view_outlives_close():
    cap = moecap.Capturer(**CONFIG)
    cap.capture(0, np.array([[3, 4]], dtype=np.int32))
    view = torch.from_dlpack(cap.export("device_ids"))
    cap.close()
    assert view[0, 0].tolist() == [3, 4]  # memory held by the view's deleter


def test_errors_raise_with_the_message():
    with moecap.Capturer(**CONFIG) as cap:
        with pytest.raises(moecap.MoecapError) as e:
            cap.capture(3, np.zeros((1, 2), dtype=np.int32))
        assert e.value.status == moecap.Status.OUT_OF_RANGE
        assert "num_layers = 3" in str(e.value)
        with pytest.raises(moecap.MoecapError) as e:
            cap.capture(0, np.zeros((9, 2), dtype=np.int32))
        assert e.value.status == moecap.Status.CAPACITY
        with pytest.raises(moecap.MoecapError) as e:
            cap.capture(0, np.zeros((2, 2), dtype=np.float32))
        assert "dtype float32" in str(e.value)
        with pytest.raises(moecap.MoecapError) as e:
            cap.capture(0, np.zeros((2, 4), dtype=np.int32)[:, ::2])  # a strided view
        assert "not compact" in str(e.value)
    with pytest.raises(moecap.MoecapError) as e:
        moecap.Capturer(**dict(CONFIG, top_k=0))
    assert "top_k" in str(e.value)


def test_plan_without_allocating():
    p = moecap.plan(**dict(CONFIG, dp_size=4, verify_tokens=4, max_graph_batch=8))
    assert p["rows_per_rank"] == 32
    assert p["device_rows"] == 128
    assert p["id_bytes"] == 1


class OnlyDLPack:
    """A producer known only through the DLPack protocol (as CuPy or JAX arrays are)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_any_dlpack_producer_is_borrowed_without_copies():
    with moecap.Capturer(**CONFIG) as cap:
        ids = np.array([[9, 8], [7, 6]], dtype=np.int32)
        cap.capture(0, OnlyDLPack(ids))
        cap.commit(OnlyDLPack(np.array([3, 4], dtype=np.int64)))
        out = np.zeros((2, 3, 2), dtype=np.int16)
        cap.read(OnlyDLPack(np.array([4, 3], dtype=np.int64)), out=OnlyDLPack(out))
        assert out[:, 0].tolist() == [[7, 6], [9, 8]]  # written in place through the borrowed DLTensor
