# SPDX-License-Identifier: Apache-2.0
"""Capturer.slot_states checks its slots as moecap_read does: no NumPy
negative indexing, no bare IndexError, and no sticky error from elsewhere."""
import numpy as np
import pytest

import moecap

SLOTS = 8


def make():
    cap = moecap.Capturer(num_layers=2, top_k=2, num_experts=8, host_slots=SLOTS, max_running_requests=4)
    cap.capture(0, np.array([[1, 2]], dtype=np.int32))
    cap.capture(1, np.array([[3, 4]], dtype=np.int32))
    cap.commit(np.array([SLOTS - 1]))
    return cap


@pytest.mark.parametrize("slots, index, value", [(np.array([-1]), 0, -1), (np.array([0, SLOTS]), 1, SLOTS),
                                                 ([3, 100], 1, 100)])
def test_a_slot_outside_the_cache_is_out_of_range_like_read(slots, index, value):
    cap = make()
    with pytest.raises(moecap.MoecapError) as e:
        cap.slot_states(slots)
    assert e.value.status == moecap.Status.OUT_OF_RANGE
    assert f"slots[{index}] is {value}; it must be in [0, {SLOTS})" in str(e.value)
    with pytest.raises(moecap.MoecapError) as read_error:  # the library says the same of read
        cap.read(np.asarray(slots, dtype=np.int64))
    assert read_error.value.status == e.value.status


def misaligned():
    raw = np.zeros(17, dtype=np.uint8)
    return raw[1:].view(np.int64)  # slots 0 and 0, one byte past an 8-byte boundary


@pytest.mark.parametrize("slots, what", [(np.array([[0]]), "ndim 2"), (np.array([0.5]), "dtype float64"),
                                         (np.array([1], dtype=np.uint8), "dtype uint8"),
                                         (np.array([1, 0, 2])[::-2], "not compact"),
                                         (misaligned(), "not aligned to its 8-byte elements")])
def test_malformed_slots_are_invalid_arguments(slots, what):
    cap = make()
    with pytest.raises(moecap.MoecapError, match=what) as e:
        cap.slot_states(slots)
    assert e.value.status == moecap.Status.INVALID_ARGUMENT
    with pytest.raises(moecap.MoecapError) as read_error:  # as read refuses them
        cap.read(slots)
    assert read_error.value.status == moecap.Status.INVALID_ARGUMENT


@pytest.mark.parametrize("slots, status, what", [
    ([1.7], moecap.Status.INVALID_ARGUMENT, "slots must hold ints"), (["1"], moecap.Status.INVALID_ARGUMENT, "ints"),
    ([True], moecap.Status.INVALID_ARGUMENT, "not bool"), ([[1]], moecap.Status.INVALID_ARGUMENT, "ints"),
    ([0, 2**70], moecap.Status.OUT_OF_RANGE, rf"slots\[1\] is {2**70}; it must be in \[0, {SLOTS}\)")])
def test_a_list_holds_ints_and_nothing_is_truncated_or_cast(slots, status, what):
    cap = make()
    with pytest.raises(moecap.MoecapError, match=what) as e:
        cap.slot_states(slots)
    assert e.value.status == status
    assert cap.slot_states([np.int32(SLOTS - 1)]).tolist() == [moecap.SLOT_VALID]


def test_lists_and_arrays_give_the_states():
    cap = make()
    assert cap.slot_states([SLOTS - 1, 0]).tolist() == [moecap.SLOT_VALID, moecap.SLOT_EMPTY]
    assert cap.slot_states(np.array([SLOTS - 1], dtype=np.int32)).tolist() == [moecap.SLOT_VALID]


def test_skipped_rows_do_not_make_slot_states_raise():
    cap = make()
    slots = np.full(1, -1, dtype=np.int64)
    cap.graph_begin()  # a recorded commit reads its slots at replay: one out of range is skipped
    cap.commit(slots)
    graph = cap.graph_end()
    slots[0] = SLOTS + 5
    graph.launch()
    skipped = "rows of commits or invalidations were skipped .*; errors\\(clear=True\\) acknowledges them"
    with pytest.raises(moecap.MoecapError, match=skipped) as e:
        cap.synchronize()  # the remedy in the method's terms, not the C function's
    assert e.value.status == moecap.Status.ROWS_SKIPPED
    assert cap.slot_states([SLOTS - 1, 0]).tolist() == [moecap.SLOT_VALID, moecap.SLOT_EMPTY]
    assert cap.errors()["skipped_rows"] == 1  # still reported where errors are read
    graph.close()


@pytest.mark.parametrize("slots", [None, range(3), {1}, 3])
def test_what_is_neither_an_array_nor_a_list_is_an_invalid_argument_naming_slots(slots):
    with pytest.raises(moecap.MoecapError, match=f"slots must be host memory .* not {type(slots).__name__}") as e:
        make().slot_states(slots)
    assert e.value.status == moecap.Status.INVALID_ARGUMENT


def test_errors_name_slot_states_not_the_call_it_waits_with():
    cap = make()
    cap.graph_begin()
    with pytest.raises(moecap.MoecapError, match="^CAPTURE_ILLEGAL: slot_states: not allowed") as e:
        cap.slot_states([1])
    assert e.value.status == moecap.Status.CAPTURE_ILLEGAL
    cap.graph_end().close()
