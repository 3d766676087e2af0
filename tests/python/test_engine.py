# SPDX-License-Identifier: Apache-2.0
"""moecap.engine: one-call commits of a rank's rows (eager and padded
batches, -1 padding, idle ranks) and per-request bookkeeping."""
import numpy as np
import pytest

import moecap
from moecap.engine import RequestTable, batch_slots, commit_batch, write_routed
from moecap.record import RoutedExperts

LAYERS, TOP_K, EXPERTS = 2, 3, 16


def capturer(dp_size=1, **kw):
    return moecap.Capturer(num_layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS, host_slots=64,
                           max_running_requests=8, chunked_prefill_size=8, dp_size=dp_size, **kw)


def capture_rows(cap, rows):
    """Row r of every layer routes to experts (r + layer + j) % EXPERTS."""
    for layer in range(LAYERS):
        ids = (np.arange(rows)[:, None] + layer + np.arange(TOP_K)[None, :]) % EXPERTS
        cap.capture(layer, ids.astype(np.int32))


def expected(rows):
    return np.stack([(np.asarray(rows)[:, None] + layer + np.arange(TOP_K)) % EXPERTS for layer in range(LAYERS)], 1)


def test_eager_gathered_batch_commits_this_ranks_rows():
    cap = capturer(dp_size=3)
    capture_rows(cap, 2 + 4 + 1)  # ranks hold 2, 4, 1 rows back to back
    slots = [10, -1, 30, 7]        # rank 1's rows; its second is padding
    assert commit_batch(cap, slots, dp_rank=1, tokens_per_rank=[2, 4, 1]) == (2, 4, 7)
    assert np.array_equal(cap.read(np.array([10, 30, 7])), expected([2, 4, 5]))


def test_padded_graph_batch():
    cap = capturer(dp_size=2)
    capture_rows(cap, 2 * 4)  # each rank padded to 4 rows
    assert commit_batch(cap, [5, 6, 9], dp_rank=1, tokens_per_rank=[2, 3], padded_tokens_per_rank=4) == (4, 3, 8)
    assert np.array_equal(cap.read(np.array([5, 6, 9])), expected([4, 5, 6]))


def test_idle_rank_commits_nothing():
    cap = capturer(dp_size=2)
    capture_rows(cap, 3)
    cap.commit(np.arange(3, dtype=np.int64) + 20)
    before = cap.read(np.arange(64))
    assert commit_batch(cap, np.empty(0, dtype=np.int64), dp_rank=1, tokens_per_rank=[3, 0]) == (3, 0, 3)
    assert np.array_equal(cap.read(np.arange(64)), before)


def test_an_idle_ranks_empty_commit_ends_the_step():
    cap = capturer(dp_size=2)
    capture_rows(cap, 4)  # step 1: rank 1's four rows; rank 0 has none
    commit_batch(cap, np.empty(0, dtype=np.int64), dp_rank=0, tokens_per_rank=[0, 4])
    # step 2: rank 0's two rows at 0-1, layer 1 not captured: -1 there, not rank 1's rows of step 1
    cap.capture(0, ((np.arange(2)[:, None] + 5 + np.arange(TOP_K)[None, :]) % EXPERTS).astype(np.int32))
    commit_batch(cap, [40, 41], dp_rank=0, tokens_per_rank=[2, 0])
    ids = cap.read(np.array([40, 41]))
    assert (ids[:, 1] == -1).all()
    assert np.array_equal(ids[:, 0], (np.arange(2)[:, None] + 5 + np.arange(TOP_K)[None, :]) % EXPERTS)


def test_slot_count_must_match_the_ranks_rows():
    cap = capturer(dp_size=2)
    with pytest.raises(ValueError, match=r"slots has 3 entries; tokens_per_rank\[0\] says this rank has 2 rows"):
        commit_batch(cap, [1, 2, 3], dp_rank=0, tokens_per_rank=[2, 2])
    with pytest.raises(ValueError, match="dp_rank is 2"):
        commit_batch(cap, [1], dp_rank=2, tokens_per_rank=[1, 1])


def test_slots_that_are_not_integers_are_refused_never_truncated():
    # 3.9 is not slot 3 and True is not slot 1: each helper refuses them, as Capturer.commit does, and
    # nothing is committed, recorded or invalidated.
    cap = capturer()
    capture_rows(cap, 2)
    for bad in (np.array([3.9, 4.1]), [True, False], ["3", "4"]):
        with pytest.raises(moecap.MoecapError, match="slots has dtype .*; expected integers"):
            commit_batch(cap, bad)
    assert (cap.slot_states(np.arange(64)) == moecap.SLOT_EMPTY).all()
    with pytest.raises(moecap.MoecapError, match=r"slots_per_row\[0\] has dtype float64"):
        batch_slots(np.ones((1, 2)), [[1.5, 2.5]])
    table = RequestTable(cap)
    table.start("r")
    with pytest.raises(moecap.MoecapError, match="slots has dtype float64"):
        table.append("r", [7.9])
    table.append("r", [7, 8])
    with pytest.raises(moecap.MoecapError, match="free has dtype bool"):
        table.abort("r", free=[True])
    assert table.slots("r").tolist() == [7, 8] and "r" in table
    with pytest.raises(moecap.MoecapError, match="slots has dtype float64"):
        write_routed(cap, [0.5], RoutedExperts(np.zeros((1, LAYERS, TOP_K), dtype=np.int32), EXPERTS))
    with pytest.raises(moecap.MoecapError, match="slots holds 18446744073709551615, past int64"):
        commit_batch(cap, np.array([2 ** 64 - 1], dtype=np.uint64))  # not slot -1
    # A start no sequence has is refused at start(), where finish() would refuse it forever.
    with pytest.raises(ValueError, match=r"position is -3; a position in a sequence is in \[0, 2\^63\)"):
        table.start("s", -3)
    with pytest.raises(ValueError, match=r"position is 9223372036854775808; a position in a sequence is in"):
        table.start("s", 2**63)
    table.start("late", 2**63 - 2)  # room for two tokens, not three
    table.append("late", [3, 4])
    with pytest.raises(ValueError, match="request 'late' would end at position 9223372036854775808"):
        table.append("late", [5])
    assert table.slots("late").tolist() == [3, 4]
    table.abort("late")
    with pytest.raises(TypeError, match="position must be an int, not float"):
        table.start("s", 2.5)
    assert "s" not in table
    table.start("s", 2)
    # An empty list is no slots, whatever NumPy's default dtype for it.
    assert commit_batch(cap, []) == (0, 0, 0)


def test_batch_slots_flattens_a_left_padded_batch():
    mask = np.array([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert batch_slots(mask, [[7, 3], [1, 2, 9, 4]]).tolist() == [-1, -1, 7, 3, 1, 2, 9, 4]
    with pytest.raises(ValueError, match="row 0 has 2 real tokens but 3 slots"):
        batch_slots(mask, [[7, 3, 5], [1, 2, 9, 4]])
    for lists in ([[7, 3]], [[7, 3], [1, 2, 9, 4], [5]]):  # a row's tokens would be dropped, or slots left over
        with pytest.raises(ValueError, match=rf"slots_per_row has {len(lists)} rows; attention_mask is \[2, 4\]"):
            batch_slots(mask, lists)


def test_request_table_reads_a_finished_request_in_token_order():
    cap = capturer(weight_dtype="f32")
    table = RequestTable(cap)
    table.start("a", position=3)
    for step, slots in enumerate(([40, 2, 17], [5], [33])):
        rows = len(slots)
        for layer in range(LAYERS):
            ids = np.full((rows, TOP_K), step + layer, dtype=np.int32)
            cap.capture(layer, ids, np.full((rows, TOP_K), 0.5, dtype=np.float32))
        commit_batch(cap, slots)
        table.append("a", slots)
    routed = table.finish("a")
    assert routed.shape == (5, LAYERS, TOP_K) and routed.start == 3 and routed.valid.all()
    assert routed.ids[:, 0, 0].tolist() == [0, 0, 0, 1, 2]
    assert (routed.weights == 0.5).all()
    assert "a" not in table and len(table) == 0


@pytest.mark.parametrize("buffer", ["numpy int64", "torch int64", "numpy int32"])
def test_request_table_keeps_its_own_copy_of_slots_the_engine_reuses(buffer):
    """Engines fill one slot buffer step after step: a request's recorded
    slots must not follow the buffer to the next request's."""
    torch = pytest.importorskip("torch")
    cap = capturer()
    table = RequestTable(cap)
    kind, dtype = buffer.split()
    slots = np.empty(2, dtype=dtype) if kind == "numpy" else torch.empty(2, dtype=getattr(torch, dtype))
    for rid, (first, fill) in enumerate(((3, 1), (7, 9))):
        table.start(rid)
        slots[0], slots[1] = first, first + 1
        for layer in range(LAYERS):
            cap.capture(layer, np.full((2, TOP_K), fill, dtype=np.int32))
        commit_batch(cap, slots)
        table.append(rid, slots)
    assert table.slots(0).tolist() == [3, 4]
    routed = table.finish(0)
    assert routed.valid.all() and routed.ids[:, 0, 0].tolist() == [1, 1]
    assert moecap.SLOT_VALID & int(cap.slot_states([7])[0])  # request 1's routing stays


def test_finished_slots_are_invalidated():
    cap = capturer()
    table = RequestTable(cap)
    table.start(1)
    capture_rows(cap, 2)
    commit_batch(cap, [8, 9])
    table.append(1, [8, 9])
    assert table.finish(1).valid.all()
    # A request that reuses slot 9 but whose commit went missing reads an empty slot, not stale routing.
    table.start(2)
    table.append(2, [9])
    routed = table.finish(2)
    assert routed.valid.tolist() == [False] and (routed.ids == -1).all()
    # Without the invalidation the same read returns request 1's routing: what the table prevents.
    stale = capturer()
    capture_rows(stale, 2)
    commit_batch(stale, [8, 9])
    assert (stale.read(np.array([9])) >= 0).all()


def test_slots_a_prefix_cache_keeps_keep_their_routing_for_the_requests_that_share_them():
    cap = capturer()
    table = RequestTable(cap)
    table.start("a")
    capture_rows(cap, 4)
    commit_batch(cap, [1, 2, 3, 4])
    table.append("a", [1, 2, 3, 4])
    table.start("b")  # a prefix-cache hit on a's first three slots, then its own token
    table.append("b", [1, 2, 3])
    capture_rows(cap, 1)
    commit_batch(cap, [7])
    table.append("b", [7])
    with pytest.raises(ValueError, match="free holds slot 7, which is not one of request 'a'"):
        table.finish("a", free=[4, 7])
    assert table.finish("a", free=[4]).valid.all()  # the cache keeps 1-3, the engine frees 4
    assert cap.slot_states([4]).tolist() == [moecap.SLOT_EMPTY]
    assert table.finish("b", free=[7]).valid.all()  # b still reads its shared prefix
    table.start("c")
    table.append("c", [1, 2])
    table.abort("c", free=[])
    assert cap.slot_states([1, 2, 3, 7]).tolist() == [moecap.SLOT_VALID] * 3 + [moecap.SLOT_EMPTY]
    cap.invalidate(np.array([1, 2, 3]))  # the cache evicts the prefix
    assert cap.slot_states([1, 2, 3]).tolist() == [moecap.SLOT_EMPTY] * 3


def test_a_record_from_a_prefill_instance_lands_in_the_decode_instances_slots():
    prefill, decode = capturer(weight_dtype="f32"), capturer(weight_dtype="f32")
    table = RequestTable(prefill)
    table.start("r", position=0)
    for layer in range(LAYERS):
        cap_ids = (np.arange(4)[:, None] + layer + np.arange(TOP_K)) % EXPERTS
        prefill.capture(layer, cap_ids.astype(np.int32), np.full((4, TOP_K), 0.25, dtype=np.float32))
    commit_batch(prefill, [3, 1, 4, 15])
    table.append("r", [3, 1, 4, 15])
    wire = table.finish("r").to_bytes()
    write_routed(decode, [50, 51, 52, 53], RoutedExperts.from_bytes(wire))
    ids, weights = decode.read(np.array([50, 51, 52, 53]), weights_out=np.empty((4, LAYERS, TOP_K), dtype=np.float32))
    assert np.array_equal(ids, expected([0, 1, 2, 3])) and (weights == 0.25).all()
    with pytest.raises(ValueError, match="slots has 3 entries; the routing has 4 tokens"):
        write_routed(decode, [1, 2, 3], RoutedExperts.from_bytes(wire))
    # A record of other model layers than the capturer's is refused, not stored layer for layer.
    decode.layer_map = moecap.record.LayerMap(tuple(range(1, LAYERS + 1)), LAYERS + 1)
    with pytest.raises(ValueError, match=r"the routing holds model layers \[0, 1.*the capturer captures \[1, 2"):
        write_routed(decode, [60, 61, 62, 63], RoutedExperts.from_bytes(wire))
    assert decode.slot_states([60]).tolist() == [moecap.SLOT_EMPTY]
    write_routed(decode, [60, 61, 62, 63], RoutedExperts.from_bytes(wire).with_layer_map(range(1, LAYERS + 1)))
    # So is another model's: ids of a 4-expert model are not these experts.
    other = RoutedExperts(np.zeros((1, LAYERS, TOP_K), dtype=np.int32), 4, layers=range(1, LAYERS + 1),
                          num_hidden_layers=LAYERS + 1)
    with pytest.raises(ValueError, match=f"the routing's num_experts is 4; the capturer's is {EXPERTS}"):
        write_routed(decode, [40], other)
    # The same layers of a model with more of them are other layers too.
    deeper = RoutedExperts.from_bytes(wire).with_layer_map(range(1, LAYERS + 1), num_hidden_layers=LAYERS + 3)
    with pytest.raises(ValueError, match=rf"a model of {LAYERS + 3} layers; the capturer's is of {LAYERS + 1} \(its layer map\)"):
        write_routed(decode, [40, 41, 42, 43], deeper)
    # A capturer without a map captures every model layer, each one MoE: a record of some layers of a
    # deeper model would read back at layers 0.. of this one.
    unmapped = capturer()
    with pytest.raises(ValueError, match=r"the routing holds model layers \[1, 2.*the capturer captures \[0, 1\] "
                                         r"\(every model layer: it has no layer map\)"):
        write_routed(unmapped, [40, 41, 42, 43], RoutedExperts.from_bytes(wire).with_layer_map(range(1, LAYERS + 1)))
    with pytest.raises(ValueError, match=f"a model of {LAYERS + 3} layers; the capturer's is of {LAYERS} "):
        write_routed(unmapped, [40, 41, 42, 43], RoutedExperts.from_bytes(wire).with_layer_map(range(LAYERS), LAYERS + 3))
    assert decode.slot_states([40, 41, 42, 43]).tolist() == [moecap.SLOT_EMPTY] * 4
    assert unmapped.slot_states([40, 41, 42, 43]).tolist() == [moecap.SLOT_EMPTY] * 4


def test_a_bool_among_ints_is_refused_where_numpy_would_make_it_slot_1():
    """np.asarray([5, True]) is int64 [5, 1]: the element's own type says it is no slot. Nothing is committed,
    appended, counted or invalidated."""
    cap = capturer()
    capture_rows(cap, 2)
    for flag in (True, np.True_, np.array(True)):
        with pytest.raises(moecap.MoecapError, match=r"slots\[1\] is a bool; expected an int"):
            commit_batch(cap, [5, flag])
    assert (cap.slot_states(np.arange(64)) == moecap.SLOT_EMPTY).all()
    with pytest.raises(moecap.MoecapError, match=r"slots_per_row\[0\]\[1\] is a bool"):
        batch_slots(np.ones((1, 2)), [[4, np.True_]])
    table = RequestTable(cap)
    table.start("a")
    table.start("b")
    with pytest.raises(moecap.MoecapError, match=r"slots\[1\] is a bool"):
        table.append("a", [5, True])
    with pytest.raises(moecap.MoecapError, match=r"counts\[1\] is a bool"):
        table.append_step(["a", "b"], [5, 6], counts=[1, True])
    assert table.slots("a").size == 0 and table.slots("b").size == 0
    table.append("a", [5, 6])
    cap.commit(np.array([5, 6]))
    with pytest.raises(moecap.MoecapError, match=r"free\[1\] is a bool"):
        table.abort("a", free=[5, True])
    assert (cap.slot_states(np.array([5, 6])) & moecap.SLOT_VALID).all() and "a" in table
    with pytest.raises(moecap.MoecapError, match=r"slots\[1\] is a bool"):
        write_routed(cap, [9, True], RoutedExperts(np.zeros((2, LAYERS, TOP_K), dtype=np.int32), EXPERTS))
    assert cap.slot_states(np.array([1, 9])).tolist() == [moecap.SLOT_EMPTY] * 2
    # [-1, 2**63] is float64 to NumPy: the int past int64 is named, not a float dtype.
    with pytest.raises(moecap.MoecapError, match=r"slots\[1\] is 9223372036854775808, past int64"):
        table.append("a", [-1, 2**63])


def test_the_helpers_name_what_they_cannot_use():
    cap = capturer()
    with pytest.raises(moecap.MoecapError, match="slots has dtype object; expected integers"):
        commit_batch(cap, None)  # not len()'s TypeError
    capture_rows(cap, 1)
    assert commit_batch(cap, np.array(5)) == (0, 1, 1)  # one slot, as append takes it
    assert cap.slot_states(np.array([5]))[0] & moecap.SLOT_VALID
    table = RequestTable(cap)
    for call in (lambda: table.append("zz", [1]), lambda: table.slots("zz"), lambda: table.finish("zz"),
                 lambda: table.abort("zz")):
        with pytest.raises(KeyError, match="request 'zz' is not running"):
            call()
    for experts in (0, -3, 2**31):  # every finish() would refuse them
        with pytest.raises(ValueError, match=f"num_experts is {experts}; must be in"):
            RequestTable(cap, num_experts=experts)
    with pytest.raises(TypeError, match="routed must be a RoutedExperts .*, not ndarray"):
        write_routed(cap, [1], np.zeros((1, LAYERS, TOP_K), dtype=np.int32))


def test_slots_of_another_shape_are_refused_never_flattened():
    # A [ranks, rows] array flattened would commit other ranks' rows to this rank's slots.
    cap = capturer(dp_size=2)
    capture_rows(cap, 4)
    with pytest.raises(moecap.MoecapError, match="slots has ndim 2; expected 1") as e:
        commit_batch(cap, np.array([[10, 11], [12, 13]]), dp_rank=0, tokens_per_rank=[2, 2])
    assert e.value.status == moecap.Status.INVALID_ARGUMENT
    assert (cap.slot_states([10, 11, 12, 13]) == 0).all()
    table = RequestTable(cap)
    table.start("r")
    with pytest.raises(moecap.MoecapError, match="slots has ndim 2"):
        table.append("r", [[1, 2]])
    table.append("r", 3)  # one int is one slot
    assert table.slots("r").tolist() == [3]


def test_a_request_takes_only_slots_it_could_finish_with():
    cap = capturer()
    table = RequestTable(cap)
    table.start("r")
    for bad, at in (([3, 64], "slots\\[1\\] is 64"), ([-1], "slots\\[0\\] is -1")):
        with pytest.raises(moecap.MoecapError, match=f"{at}; a token's KV slot is in \\[0, host_slots = 64\\)") as e:
            table.append("r", bad)
        assert e.value.status == moecap.Status.OUT_OF_RANGE
    table.append("r", [3, 63])
    capture_rows(cap, 2)
    cap.commit(np.array([3, 63]))
    assert table.finish("r").shape == (2, LAYERS, TOP_K)  # the refused appends left nothing behind
    assert "r" not in table


def test_append_step_gives_each_request_its_entries_of_the_step_as_append_would():
    cap = capturer()
    batched, one_by_one = RequestTable(cap), RequestTable(cap)
    for table in (batched, one_by_one):
        for rid in ("a", "b", "c"):
            table.start(rid)
    # A mixed step: a prefill chunk of 3 for "a", "b" idle, 2 verify tokens for "c"; then a decode step.
    step = np.array([10, 11, 12, 20, 21])
    batched.append_step(["a", "b", "c"], step, counts=[3, 0, 2])
    step[:] = -1  # the engine reuses its buffer
    batched.append_step(["c", "a", "b"], np.array([22, 13, 30]))
    for rid, part in (("a", [10, 11, 12]), ("b", []), ("c", [20, 21]), ("c", [22]), ("a", [13]), ("b", [30])):
        one_by_one.append(rid, np.array(part, dtype=np.int64))
    for rid in ("a", "b", "c"):
        assert batched.slots(rid).tolist() == one_by_one.slots(rid).tolist()
    assert batched.slots("a").tolist() == [10, 11, 12, 13]
    # The table finishes a request from batched steps like any other.
    capture_rows(cap, 4)
    cap.commit(np.array([10, 11, 12, 13]))
    routed = batched.finish("a")
    assert routed.valid.all() and routed.ids[:, 0, 0].tolist() == expected(range(4))[:, 0, 0].tolist()


def test_a_refused_step_appends_nothing_to_any_request():
    cap = capturer()
    table = RequestTable(cap)
    table.start("a")
    table.start("b", position=2**63 - 1)  # one token fits, two do not
    refusals = [
        ((["a", "x"], [1, 2], None), KeyError, "request 'x' is not running"),
        ((["a", "b"], [1, 2, 3], None), ValueError, "slots has 3 entries for 2 requests; a step where"),
        ((["a", "b"], [1, 2, 3], [1, 1]), ValueError, "counts add up to 2; slots has 3 entries"),
        ((["a", "b"], [1, 2], [1]), ValueError, "counts has 1 entries for 2 requests"),
        ((["a", "b"], [1, 2], [3, -1]), ValueError, r"counts\[1\] is -1; a request's token count is >= 0"),
        ((["a", "b"], [1, 2], [0.5, 1.5]), moecap.MoecapError, "counts has dtype float64"),
        ((["a", "b"], [1, 64], None), moecap.MoecapError, r"slots\[1\] is 64; a token's KV slot is in"),
        ((["a", "b"], [1, 2, 3], [1, 2]), ValueError, f"request 'b' would end at position {2**63}"),
        ((["b", "b"], [1, 2], None), ValueError, f"request 'b' would end at position {2**63}"),  # its two entries
    ]
    for (rids, slots, counts), error, message in refusals:
        with pytest.raises(error, match=message):
            table.append_step(rids, slots, counts=counts)
        assert table.slots("a").tolist() == [] and table.slots("b").tolist() == []
    table.append_step(["a", "b"], [1, 2])  # one token each fits
    assert table.slots("b").tolist() == [2]


def test_abort_while_a_graph_is_recorded_is_refused_and_keeps_the_request():
    """The invalidate would be recorded into the graph, not run: the freed slots would go to the next request
    with their routing, and a launch of the graph would empty them under it."""
    cap = capturer()
    capture_rows(cap, 2)
    table = RequestTable(cap)
    table.start("old")
    table.append("old", [12, 13])
    cap.commit(np.array([12, 13]))
    cap.graph_begin()
    assert cap.recording
    with pytest.raises(moecap.MoecapError, match=r"abort\('old'\): the capturer is recording a graph"):
        table.abort("old")
    cap.graph_end().close()
    assert not cap.recording and "old" in table
    table.abort("old")
    assert (cap.slot_states(np.array([12, 13])) == moecap.SLOT_EMPTY).all()


def test_a_routing_stream_refuses_a_chunk_placed_at_another_position():
    from moecap.integrations.stream import RoutingStream
    ids = np.zeros((2, LAYERS, TOP_K), dtype=np.int32)
    stream = RoutingStream(lambda begin, end: RoutedExperts(ids[:end - begin], EXPERTS, start=0), start=2)
    with pytest.raises(ValueError, match=r"read_rows\(2, 4\) returned a chunk starting at position 0; its first "
                       "position is 2"):
        stream.next(4)
    assert stream.sent == 2
    placed = RoutingStream(lambda begin, end: RoutedExperts(ids[:end - begin], EXPERTS, start=begin), start=2)
    assert placed.next(4).start == 2 and placed.sent == 4
