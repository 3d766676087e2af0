# SPDX-License-Identifier: Apache-2.0
"""DLPack both ways: moecap's buffers go out to NumPy 2, PyTorch and JAX
(versioned capsules when asked, copies on copy=True, refused capsules
released), and every tensor argument takes any DLPack producer in place."""
import ctypes
import gc

import numpy as np
import pytest
import torch

import moecap
from moecap import _moecap

CONFIG = dict(num_layers=3, top_k=2, num_experts=16, host_slots=32, max_running_requests=8,
              chunked_prefill_size=8)

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype = ctypes.c_char_p
_get_name.argtypes = [ctypes.py_object]
READ_ONLY, IS_COPIED = 1, 2
# NumPy 1 asks for legacy capsules only (read-only views, no copy=): the GPU
# machine's own NumPy may be 1.x (tests/gpu/device_check.sh).
needs_numpy_2 = pytest.mark.skipif(int(np.__version__.split(".")[0]) < 2,
                                   reason=f"NumPy {np.__version__}: versioned DLPack capsules need NumPy 2")


def capsule_flags(capsule):
    """DLManagedTensorVersioned.flags (offset 24) of an unconsumed versioned capsule."""
    return ctypes.c_uint64.from_address(_get_pointer(capsule, b"dltensor_versioned") + 24).value


class Forged:
    """A producer of `array` whose legacy capsule (a DLTensor first) says
    another byte_offset (at byte 40) or first extent (shape, a pointer at 24)."""

    def __init__(self, array, byte_offset=None, first_extent=None):
        self.array, self.byte_offset, self.first_extent = array, byte_offset, first_extent

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, **_):
        capsule = self.array.__dlpack__()
        tensor = _get_pointer(capsule, b"dltensor")
        if self.byte_offset is not None:
            ctypes.c_uint64.from_address(tensor + 40).value = self.byte_offset
        if self.first_extent is not None:
            ctypes.c_int64.from_address(ctypes.c_void_p.from_address(tensor + 24).value).value = self.first_extent
        return capsule


def test_a_byte_offset_wrapping_around_the_address_space_is_refused():
    """2^64 - 8 wraps data + byte_offset around to 8 bytes before the view,
    memory the capsule does not describe (here the buffer's own first two)."""
    with moecap.Capturer(**CONFIG) as cap:
        cap.write(np.array([0]), np.ones((1, 3, 2), dtype=np.int32))
        buffer = np.full(8, 77, dtype=np.int32)
        with pytest.raises(moecap.MoecapError, match="out's DLPack byte_offset is 18446744073709551608; data \\+ "
                                                     "byte_offset wraps around the address space"):
            cap.read(np.array([0]), out=Forged(buffer[2:8].reshape(1, 3, 2), byte_offset=2**64 - 8))
        assert (buffer == 77).all()
        source = np.array([5, 5, 1, 2], dtype=np.int32)
        with pytest.raises(moecap.MoecapError, match="topk_ids's DLPack byte_offset"):
            cap.capture(0, Forged(source[2:].reshape(1, 2), byte_offset=2**64 - 8))
        assert (np.from_dlpack(cap.export("layer_ids", layer=0)) == -1).all()


def test_slots_of_a_negative_length_are_refused_before_an_output_is_allocated():
    with moecap.Capturer(**CONFIG) as cap:
        with pytest.raises(moecap.MoecapError, match="slots.shape\\[0\\] is -5; must be >= 0"):
            cap.read(Forged(np.array([0, 1]), first_extent=-5))


@needs_numpy_2
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
        # NumPy 2 asked for a versioned capsule, so the view is writable, and moecap sees the write.
        assert host.flags.writeable
        host[5] = 11
        assert cap.read(np.array([5]))[0].tolist() == [[11, 11]] * 3


def test_versioned_capsule_only_when_asked():
    with moecap.Capturer(**CONFIG) as cap:
        legacy = cap.export("host_ids").__dlpack__()
        assert _get_name(legacy) == b"dltensor"
        versioned = cap.export("host_ids").__dlpack__(max_version=(1, 0))
        assert _get_name(versioned) == b"dltensor_versioned"
        assert capsule_flags(versioned) & READ_ONLY == 0  # moecap's buffers are writable
        assert _get_name(cap.export("host_ids").__dlpack__(max_version=(0, 8))) == b"dltensor"
        view = cap.export("device_ids")
        view.__dlpack__()
        assert view.consumed
        with pytest.raises(BufferError, match="already consumed"):
            view.__dlpack__()
        # Unconsumed capsules (legacy, versioned) are released by their destructors.
        del legacy, versioned
        gc.collect()


@needs_numpy_2
def test_copy_true_copies():
    with moecap.Capturer(**CONFIG) as cap:
        cap.capture(1, np.array([[3, 4]], dtype=np.int32))
        capsule = cap.export("layer_ids", layer=1).__dlpack__(max_version=(1, 0), copy=True)
        assert capsule_flags(capsule) & IS_COPIED
        copy = np.from_dlpack(cap.export("layer_ids", layer=1), copy=True)
        alias = np.from_dlpack(cap.export("layer_ids", layer=1))
        assert copy.shape == (8, 2) and copy.flags.c_contiguous  # the strided layer view, compacted
        assert copy[0].tolist() == [3, 4]
        assert not np.shares_memory(copy, alias)
        assert copy.ctypes.data % 64 == 0
        copy[0] = 9
        assert alias[0].tolist() == [3, 4]
        with pytest.raises(BufferError, match="dl_device"):
            cap.export("host_ids").__dlpack__(dl_device=(2, 0))


def test_refused_capsule_is_released():
    # NumPy has no bfloat16: it refuses the view. The error must be NumPy's
    # (not a SystemError) and the capsule must free the view, which holds the
    # capturer's memory (64 MiB of host cache here) after close().
    def resident_bytes():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    config = dict(CONFIG, host_slots=(64 << 20) // (3 * 2 * 2), weight_dtype="bf16")
    cap = moecap.Capturer(**config)
    before = resident_bytes()
    view = cap.export("host_weights")
    with pytest.raises((BufferError, TypeError, RuntimeError)) as e:
        np.from_dlpack(view)
    assert not isinstance(e.value, SystemError)
    del view, e
    cap.close()
    gc.collect()
    assert resident_bytes() < before - (48 << 20)  # the host cache went back to the OS


def test_torch_view_and_torch_inputs():
    with moecap.Capturer(weight_dtype="bf16", **CONFIG) as cap:
        dev = torch.from_dlpack(cap.export("device_ids"))
        assert dev.shape == (3, 8, 2)  # layer-major: one layer's rows are contiguous
        assert dev.dtype == torch.int16  # the device buffer's own dtype (AUTO: int16)
        layer1 = torch.from_dlpack(cap.export("layer_ids", layer=1))
        assert layer1.shape == (8, 2)
        assert layer1.stride() == (2, 1)
        ids = torch.tensor([[7, 8], [9, 10], [11, 12]], dtype=torch.int32)
        weights = torch.tensor([[0.5, 0.25], [0.125, 0.75], [1.0, 0.0]], dtype=torch.float32)
        cap.capture(1, ids, weights)
        assert layer1[:3].tolist() == ids.tolist()
        assert dev[1, 2].tolist() == [11, 12]
        w = torch.from_dlpack(cap.export("device_weights"))
        assert w.dtype == torch.bfloat16
        assert w[1, 1].float().tolist() == [0.125, 0.75]
        cap.commit(torch.tensor([3, -1, 4]))
        out, wout = cap.read(torch.tensor([3, 4]), dtype=torch.int64,
                             weights_out=torch.zeros(2, 3, 2, dtype=torch.float32))
        assert out[:, 1].tolist() == [[7, 8], [11, 12]]
        assert wout[0, 1].tolist() == [0.5, 0.25]


@pytest.mark.parametrize("exchange_api,torch_attributes", [(True, True), (False, True), (False, False)])
def test_every_torch_path_describes_the_same_tensor(exchange_api, torch_attributes):
    # The C exchange API, the attribute reads and nanobind's __dlpack__ import
    # must agree, including on a strided view and a storage offset.
    try:
        _moecap._fast_paths(exchange_api, torch_attributes)
        with moecap.Capturer(**CONFIG) as cap:
            base = torch.arange(40, dtype=torch.int64).reshape(10, 4) % 16
            cap.capture(0, base[2:5, 1:3].contiguous())
            cap.capture(1, base[3:6, :2].contiguous())
            cap.commit(torch.tensor([0, 1, 2], dtype=torch.int32)[torch.tensor([2, 1, 0])])
            out = cap.read(torch.tensor([2, 1, 0]))
            assert out[:, 0].tolist() == base[2:5, 1:3].tolist()
            assert out[:, 1].tolist() == base[3:6, :2].tolist()
            with pytest.raises(moecap.MoecapError, match="not compact"):
                cap.capture(0, base[:3, ::2])
    finally:
        _moecap._fast_paths(True, True)


@pytest.mark.parametrize("exchange_api,torch_attributes", [(True, True), (False, True), (False, False)])
def test_a_tensor_on_a_device_moecap_does_not_take_is_refused_not_read_as_host_memory(exchange_api,
                                                                                     torch_attributes):
    try:
        _moecap._fast_paths(exchange_api, torch_attributes)
        with moecap.Capturer(**CONFIG) as cap:
            with pytest.raises(TypeError, match="argument 'topk_ids'"):
                cap.capture(0, torch.zeros((1, 2), dtype=torch.int32, device="meta"))
            assert cap.errors().invalid_ids == 0
    finally:
        _moecap._fast_paths(True, True)


def test_view_outlives_close():
    cap = moecap.Capturer(**CONFIG)
    cap.capture(0, np.array([[3, 4]], dtype=np.int32))
    view = torch.from_dlpack(cap.export("device_ids"))
    cap.close()
    assert cap.closed
    assert view[0, 0].tolist() == [3, 4]  # memory held by the view's deleter
    with pytest.raises(ValueError, match="closed"):
        cap.capture(0, np.array([[3, 4]], dtype=np.int32))


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
        with pytest.raises(TypeError, match="argument 'topk_ids' must be a tensor"):
            cap.capture(0, [[1, 2]])
        with pytest.raises(TypeError, match="argument 'slots' must be a tensor"):
            cap.read(None)  # the output's length is asked of the slots first
        with pytest.raises(TypeError, match="argument 'out' must be a writable tensor"):
            ro = np.zeros((1, 3, 2), dtype=np.int32)
            ro.flags.writeable = False
            cap.read(np.array([0]), out=ro)
        with pytest.raises(TypeError, match="argument 'stream' must be None, an int"):
            cap.capture(0, np.zeros((1, 2), dtype=np.int32), stream="the default one")
        for flag in (True, False):  # not the legacy stream's handle 1 or the NULL stream
            with pytest.raises(TypeError, match="argument 'stream' must be None, an int .*, not <class 'bool'>"):
                cap.capture(0, np.zeros((1, 2), dtype=np.int32), stream=flag)
            with pytest.raises(TypeError, match="argument 'stream' must be None, an int .*, not <class 'bool'>"):
                cap.commit(np.array([0]), stream=flag)
    with pytest.raises(moecap.MoecapError) as e:
        moecap.Capturer(**dict(CONFIG, top_k=0))
    assert "top_k" in str(e.value)


def test_plan_without_allocating():
    p = moecap.plan(**dict(CONFIG, dp_size=4, verify_tokens=4, max_graph_batch=8))
    assert p["rows_per_rank"] == 32
    assert p["device_rows"] == 128
    assert p["id_bytes"] == 1


def test_host_buffers_are_64_byte_aligned():
    with moecap.Capturer(weight_dtype="f16", histogram=True, **CONFIG) as cap:
        for which in ("device_ids", "device_weights", "host_ids", "host_weights", "histogram"):
            assert np.from_dlpack(cap.export(which)).ctypes.data % 64 == 0, which


class OnlyDLPack:
    """A producer known only through the DLPack protocol (as CuPy or tvm-ffi tensors are): no len()."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_every_argument_takes_any_dlpack_producer():
    with moecap.Capturer(weight_dtype="f32", **CONFIG) as cap:
        ids = np.array([[9, 8], [7, 6]], dtype=np.int32)
        weights = np.array([[0.5, 0.5], [0.25, 0.75]], dtype=np.float32)
        cap.capture(0, OnlyDLPack(ids), OnlyDLPack(weights))
        cap.commit(OnlyDLPack(np.array([3, 4], dtype=np.int64)), src_rows=OnlyDLPack(np.array([0, 1])))
        out = np.zeros((2, 3, 2), dtype=np.int16)
        wout = np.zeros((2, 3, 2), dtype=np.float32)
        cap.read(OnlyDLPack(np.array([4, 3], dtype=np.int64)), out=OnlyDLPack(out), weights_out=OnlyDLPack(wout))
        assert out[:, 0].tolist() == [[7, 6], [9, 8]]  # written in place through the borrowed DLTensor
        assert wout[1, 0].tolist() == [0.5, 0.5]
        allocated = cap.read(OnlyDLPack(np.array([3])))  # no len(): the length comes from the DLTensor
        assert allocated.shape == (1, 3, 2) and allocated[0, 0].tolist() == [9, 8]
        cap.write(OnlyDLPack(np.array([5])), OnlyDLPack(np.full((1, 3, 2), 2, dtype=np.int32)),
                  OnlyDLPack(np.ones((1, 3, 2), dtype=np.float32)))
        assert cap.read(np.array([5]))[0].tolist() == [[2, 2]] * 3


def test_buffers_exported_without_strides_are_read_and_written_in_c_order():
    """ctypes arrays export no strides (C order, as the buffer protocol allows); the strides were read
    through that NULL pointer."""
    with moecap.Capturer(**CONFIG) as cap:
        ids = ((ctypes.c_int32 * 2) * 3)((1, 2), (3, 4), (5, 6))
        cap.capture(1, ids)
        cap.commit((ctypes.c_int64 * 3)(7, 8, 9))
        out = (((ctypes.c_int32 * 2) * 3) * 2)()
        cap.read((ctypes.c_int64 * 2)(9, 7), out=out)
        assert list(out[0][1]) == [5, 6] and list(out[1][1]) == [1, 2] and list(out[1][0]) == [-1, -1]
        assert cap.read(np.array([8]))[0, 1].tolist() == [3, 4]


def test_jax_both_ways():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    with moecap.Capturer(**CONFIG) as cap:
        cap.capture(0, jnp.array([[1, 2], [3, 4]], dtype=jnp.int32))  # a JAX array in
        cap.commit(jnp.array([6, 7], dtype=jnp.int32))
        host = jax.dlpack.from_dlpack(cap.export("host_ids"))  # and the host cache out
        assert host.shape == (32, 3, 2)
        assert host[7, 0].tolist() == [3, 4]
        # Zero-copy: JAX took moecap's (64-byte aligned) memory instead of copying it.
        assert host.unsafe_buffer_pointer() == np.from_dlpack(cap.export("host_ids")).ctypes.data


def test_a_jax_array_is_refused_as_an_output_and_left_as_it_was():
    # JAX arrays are immutable and their capsules carry no read-only flag: jitted code holding one as a
    # constant would see moecap's write.
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    with moecap.Capturer(**CONFIG) as cap:
        cap.capture(0, np.array([[1, 2]], dtype=np.int32))
        cap.commit(np.array([6]))
        out = jnp.zeros((1, 3, 2), dtype=jnp.int32)
        with pytest.raises(TypeError, match="'out' must be a writable tensor, and JAX arrays are immutable"):
            cap.read(np.array([6]), out=out)
        assert out.tolist() == [[[0, 0], [0, 0], [0, 0]]]
        assert jnp.asarray(cap.read(np.array([6])))[0, 0].tolist() == [1, 2]  # the way to get it into JAX


class _MadeOnRequest:
    """A DLPack producer whose __dlpack__ hands out a new array each time (the
    protocol allows it): nothing but the capsule holds that memory."""

    def __init__(self, rows, made):
        self.rows, self.made = rows, made

    def __dlpack__(self, **kwargs):
        import weakref
        array = np.array(self.rows, dtype=np.int64)
        self.made.append(weakref.ref(array))
        return array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return (1, 0)


def test_work_that_runs_after_the_call_holds_what_a_producer_made_for_it():
    # The side stream's captures run at join(), a graph's at each launch(): the
    # memory the producer made for the capsule must live until then.
    made = []
    with moecap.Capturer(**CONFIG, side_stream=True) as cap:
        cap.capture(0, _MadeOnRequest([[1, 2], [3, 4]], made))
        assert made[-1]() is not None, "the producer's array was freed before the forked capture ran"
        filler = [np.full((2, 2), 9, np.int64) for _ in range(50)]  # would take the freed memory
        cap.join()
        assert np.from_dlpack(cap.export("layer_ids", 0))[:2].tolist() == [[1, 2], [3, 4]]
        gc.collect()
        assert made[-1]() is None, "join() releases what the forked work read"
    with moecap.Capturer(**CONFIG) as cap:
        cap.graph_begin()
        cap.capture(0, _MadeOnRequest([[5, 6], [7, 8]], made))
        graph = cap.graph_end()
        filler += [np.full((2, 2), 11, np.int64) for _ in range(50)]
        graph.launch()
        assert np.from_dlpack(cap.export("layer_ids", 0))[:2].tolist() == [[5, 6], [7, 8]]
        graph.close()
        gc.collect()
        assert made[-1]() is None, "closing the graph releases what it read"


def test_a_tensor_that_requires_grad_is_refused_as_an_output():
    # moecap writes outside autograd (the version counter stays): a backward
    # through the tensor would use the old values. torch's own export refuses it.
    with moecap.Capturer(**CONFIG, weight_dtype="f32") as cap:
        cap.capture(0, np.array([[1, 2]], np.int32), np.array([[0.5, 0.25]], np.float32))
        cap.commit(np.array([3]))
        x = torch.ones(1, 3, 2, requires_grad=True)
        weights = x * 3
        before = weights.detach().clone()
        with pytest.raises(TypeError, match="argument 'weights_out' requires grad"):
            cap.read(np.array([3]), weights_out=weights)
        assert torch.equal(weights.detach(), before)
        ids, got = cap.read(np.array([3]), weights_out=weights.detach().clone())
        assert ids[0, 0].tolist() == [1, 2] and got[0, 0].tolist() == [0.5, 0.25]


@pytest.mark.parametrize("exchange_api,torch_attributes", [(True, True), (False, True), (False, False)])
def test_a_tensor_exported_read_only_is_refused_as_an_output_and_read_as_an_input(exchange_api, torch_attributes):
    # torch.utils.dlpack.ReadOnlyTensorWrapper: its exchange API's exports say READ_ONLY, and every torch
    # operation on it but DLPack raises. moecap writes into an output, so it must not take one.
    wrapper = getattr(torch.utils.dlpack, "ReadOnlyTensorWrapper", None)
    if wrapper is None:
        pytest.skip(f"torch {torch.__version__} has no ReadOnlyTensorWrapper")
    try:
        _moecap._fast_paths(exchange_api, torch_attributes)
        with moecap.Capturer(**CONFIG, weight_dtype="f32") as cap:
            cap.capture(0, np.array([[1, 2]], np.int32), np.array([[0.5, 0.25]], np.float32))
            cap.commit(np.array([3]))
            out, weights = torch.zeros(1, 3, 2, dtype=torch.int32), torch.zeros(1, 3, 2)
            # moecap's own refusal, naming the argument (on the attribute path: torch's refusal, named).
            expected = "is a .*ReadOnlyTensorWrapper.* exported read-only" if exchange_api else \
                "is a torch tensor moecap cannot write in place: RuntimeError: ReadOnlyTensorWrapper"
            with pytest.raises(TypeError, match=f"argument 'out' {expected}"):
                cap.read(torch.tensor([3]), out=wrapper(out))
            with pytest.raises(TypeError, match=f"argument 'weights_out' {expected}"):
                cap.read(torch.tensor([3]), out=out, weights_out=wrapper(weights))
            assert not out.any() and not weights.any()
            if exchange_api or not torch_attributes:  # read through DLPack, as the wrapper allows
                ids, got = cap.read(wrapper(torch.tensor([3])), weights_out=torch.zeros(1, 3, 2))
                assert ids[0, 0].tolist() == [1, 2] and got[0, 0].tolist() == [0.5, 0.25]
            else:
                with pytest.raises(TypeError, match="argument 'slots' is a torch tensor moecap cannot borrow"):
                    cap.read(wrapper(torch.tensor([3])))
    finally:
        _moecap._fast_paths(True, True)


def test_outputs_sharing_memory_with_the_slots_or_the_host_cache_are_refused():
    with moecap.Capturer(**CONFIG, weight_dtype="f32") as cap:
        cap.capture(0, np.array([[1, 2], [3, 4]], np.int32), np.full((2, 2), 0.5, np.float32))
        cap.commit(np.array([1, 2]))
        buffer = np.zeros(12, np.float32)
        slots = buffer.view(np.int32)[:2]
        slots[:] = [1, 2]
        with pytest.raises(moecap.MoecapError, match="weights_out shares memory with slots"):
            cap.read(slots, out=np.zeros((2, 3, 2), np.int32), weights_out=buffer.reshape(2, 3, 2))
        host_ids = np.from_dlpack(cap.export("host_ids"))
        before = host_ids.copy()
        with pytest.raises(moecap.MoecapError, match="slots lies in the capturer's host cache"):
            cap.write(host_ids.reshape(-1)[:4].view(np.int32)[:1], np.zeros((1, 3, 2), np.int32),
                      np.zeros((1, 3, 2), np.float32))
        assert np.array_equal(host_ids, before)


def test_a_view_converts_every_keyword_before_it_hands_itself_out():
    with moecap.Capturer(**CONFIG) as cap:
        for keywords in (dict(max_version=(1,)), dict(copy=1), dict(dl_device="cpu")):
            view = cap.export("host_ids")
            with pytest.raises(TypeError, match=next(iter(keywords))):
                view.__dlpack__(**keywords)
            assert not view.consumed  # refused: still whole
        with pytest.raises(ValueError, match=r"max_version is \(-1, 5\); a DLPack version has no negative part"):
            view.__dlpack__(max_version=(-1, 5))
        assert not view.consumed
        host_ids = np.from_dlpack(cap.export("host_ids"))
        copied = torch.utils.dlpack.from_dlpack(cap.export("host_ids").__dlpack__(copy=np.True_))  # as moecap's flags
        assert copied.shape == host_ids.shape and copied.data_ptr() != host_ids.ctypes.data
        view = cap.export("host_ids")
        taken = []

        class ConsumesTheViewWhileConverted:
            def __index__(self):
                taken.append(view.__dlpack__())
                return 0

        with pytest.raises(BufferError, match="already consumed"):
            view.__dlpack__(dl_device=(1, ConsumesTheViewWhileConverted()))
        assert len(taken) == 1 and view.consumed  # handed out once, by the inner call


def test_a_sparse_torch_tensor_is_refused_naming_the_argument():
    with moecap.Capturer(**CONFIG) as cap:
        sparse = torch.zeros((1, 2), dtype=torch.int32).to_sparse()
        with pytest.raises(TypeError, match="argument 'topk_ids'"):
            cap.capture(0, sparse)


def test_cycles_through_a_graph_or_the_side_stream_list_are_collected():
    import weakref

    class Ids(np.ndarray):  # a tensor that can refer back to what holds it
        pass

    cap = moecap.Capturer(**CONFIG)
    ids = np.array([[1, 2]], np.int64).view(Ids)
    cap.graph_begin()
    cap.capture(0, ids)
    ids.graph = cap.graph_end()  # tensor -> graph -> its held tensors -> tensor
    held = weakref.ref(ids)
    del ids
    gc.collect()
    assert held() is None
    cap.close()

    forking = moecap.Capturer(**CONFIG, side_stream=True)
    ids = np.array([[3, 4]], np.int64).view(Ids)
    ids.capturer = forking  # capturer -> forked list -> tensor -> capturer, no join yet
    forking.capture(0, ids)
    owner = weakref.ref(forking)
    del ids, forking
    gc.collect()
    assert owner() is None


@pytest.mark.parametrize("ids, message", [
    (np.array([[1, 2]], dtype=">i4"), "that DLPack cannot describe: BufferError: DLPack only supports native byte"),
    (np.zeros((1, 2), dtype=[("a", "i4")]), "that DLPack cannot describe"),
    (np.array([[1, 2]], np.uint32), "topk_ids has dtype uint32; expected one of int32, int64"),
    (np.array([[True, False]]), "topk_ids has dtype bool; expected one of int32, int64")])
def test_a_tensor_moecap_cannot_take_is_refused_with_the_reason(ids, message):
    with moecap.Capturer(**CONFIG) as cap:
        with pytest.raises((TypeError, moecap.MoecapError), match=message):
            cap.capture(0, ids)
        assert cap.errors().invalid_ids == 0


def test_a_producers_refusal_is_reported_and_an_interrupt_is_not_turned_into_one():
    class Refuses:
        def __init__(self, error):
            self.error = error

        def __dlpack__(self, **kwargs):
            raise self.error

        def __dlpack_device__(self):
            return (1, 0)

    with moecap.Capturer(**CONFIG) as cap:
        with pytest.raises(TypeError, match="argument 'topk_ids' .* cannot describe: ValueError: not today$"):
            cap.capture(0, Refuses(ValueError("not today")))
        with pytest.raises(KeyboardInterrupt):
            cap.capture(0, Refuses(KeyboardInterrupt()))


class _Exporting:
    """A producer that copies unless told copy=False (as the array API lets it), or
    whose versioned capsules claim another DLPack major version."""

    def __init__(self, array, copies=False, major=None, takes_copy=True):
        self.array, self.copies, self.major, self.takes_copy = array, copies, major, takes_copy
        self.asked = []

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if copy is not None and not self.takes_copy:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'copy'")
        self.asked.append(copy)
        if self.copies and copy is False:
            raise BufferError("this array is exported as a copy")
        capsule = self.array.__dlpack__(max_version=max_version, copy=True if self.copies else None)
        if self.major is not None:
            ctypes.c_uint32.from_address(_get_pointer(capsule, b"dltensor_versioned")).value = self.major
        return capsule


@needs_numpy_2
def test_an_output_is_asked_for_without_a_copy_and_a_copy_is_refused():
    with moecap.Capturer(**CONFIG) as cap:
        cap.capture(0, np.array([[1, 2], [3, 4]], dtype=np.int32))
        cap.commit(np.array([1, 2]))
        out = np.zeros((2, 3, 2), dtype=np.int32)
        refused = "'out' is a .*refused to export it in place, with copy=False.*moecap writes outputs in place"
        with pytest.raises(TypeError, match=refused):
            cap.read(np.array([1, 2]), out=_Exporting(out, copies=True))
        # A producer that predates copy= and hands out a copy says so in the capsule's flags.
        with pytest.raises(TypeError, match="'out' was exported as a copy \\(DLPack's IS_COPIED flag\\)"):
            cap.read(np.array([1, 2]), out=_Exporting(out, copies=True, takes_copy=False))
        assert not out.any()
        producer = _Exporting(out)
        cap.read(np.array([1, 2]), out=producer)
        assert producer.asked == [False] and out[:, 0].tolist() == [[1, 2], [3, 4]]
        # An input may be a copy: moecap only reads it, and asks without copy=.
        slots = _Exporting(np.array([2, 1]), copies=True)
        assert cap.read(slots)[:, 0].tolist() == [[3, 4], [1, 2]] and slots.asked == [None]


@needs_numpy_2
@pytest.mark.parametrize("major", [0, 2])
def test_a_capsule_of_another_dlpack_major_version_is_refused_unread(major):
    with moecap.Capturer(**CONFIG) as cap:
        out = np.zeros((1, 3, 2), dtype=np.int32)
        with pytest.raises(TypeError, match=f"'out' is a DLPack {major}.0 tensor; moecap reads DLPack 1.x"):
            cap.read(np.array([1]), out=_Exporting(out, major=major))
        with pytest.raises(TypeError, match=f"'slots' is a DLPack {major}.0 tensor"):
            cap.read(_Exporting(np.array([1]), major=major))
        with pytest.raises(TypeError, match=f"'topk_ids' is a DLPack {major}.0 tensor"):
            cap.capture(0, _Exporting(np.array([[1, 2]], dtype=np.int32), major=major))
        assert cap.read(np.array([1]))[0, 0].tolist() == [-1, -1]


def test_a_read_asks_a_producer_for_its_slots_once():
    class OneShot(OnlyDLPack):
        def __dlpack__(self, **kwargs):
            assert not getattr(self, "used", False), "asked twice"
            self.used = True
            return super().__dlpack__(**kwargs)

    with moecap.Capturer(**CONFIG) as cap:
        cap.capture(0, np.array([[5, 6]], dtype=np.int32))
        cap.commit(np.array([7]))
        assert cap.read(OneShot(np.array([7])))[0, 0].tolist() == [5, 6]


def test_a_host_view_takes_no_stream_as_the_array_api_says_and_stays_unconsumed():
    with moecap.Capturer(**CONFIG) as cap:
        view = cap.export("host_ids")
        for stream in (1, 0, -1, 12345):
            with pytest.raises(BufferError, match="has no streams; stream must be None"):
                view.__dlpack__(stream=stream)
        for stream in ("1", 1.0, True):
            with pytest.raises(TypeError, match="stream must be None or an int"):
                view.__dlpack__(stream=stream)
        assert not view.consumed
        assert torch.from_dlpack(view).shape == (32, 3, 2)  # torch asks a CPU producer without a stream


def test_a_torch_output_read_into_tells_autograd_it_was_written():
    with moecap.Capturer(**CONFIG) as cap:
        cap.capture(0, np.array([[1, 2]], dtype=np.int32))
        cap.commit(np.array([3]))
        index = torch.zeros(1, 3, 2, dtype=torch.int64)
        source = torch.arange(8.0, requires_grad=True)
        gathered = source[index.flatten()]  # saves index for backward
        before = index._version
        cap.read(np.array([3]), out=index)
        assert index._version > before
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            gathered.sum().backward()
