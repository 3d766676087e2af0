# SPDX-License-Identifier: Apache-2.0
"""MOECAP_FLAG_SIDE_STREAM from Python: capture and commit fork off the
engine's stream until join(); the binding holds the tensors they read until
then (the caching allocator would otherwise hand a dropped topk_ids to the
next op), and the host backend runs forked work only at the join or a host
call, so a join after the engine's next write shows."""
import gc
import weakref

import numpy as np
import pytest
import torch

import moecap

CONFIG = dict(num_layers=3, top_k=2, num_experts=16, host_slots=32, max_running_requests=8,
              chunked_prefill_size=8)


def test_forked_inputs_are_held_until_join():
    with moecap.Capturer(side_stream=True, **CONFIG) as cap:
        ids = torch.tensor([[1, 2]], dtype=torch.int64)
        refs = []
        for layer in range(3):
            t = ids + layer  # a temporary only moecap holds once the loop moves on
            refs.append(weakref.ref(t))
            cap.capture(layer, t)
            del t
        cap.commit(np.array([4], dtype=np.int64))
        gc.collect()
        assert all(r() is not None for r in refs)  # forked work has not read them yet
        cap.join()
        gc.collect()
        assert all(r() is None for r in refs)
        assert cap.read(np.array([4]))[0].tolist() == [[1, 2], [2, 3], [3, 4]]


def test_a_jax_array_taken_through_the_buffer_protocol_stays_pinned_until_join_and_in_a_graph():
    # JAX pins a CPU array's memory for as long as a buffer-protocol export of it lives, not the object: a
    # forked or recorded capture holding only the object read the buffer after a donating step reused it.
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    donate = jax.jit(lambda x: x * 0 + 9, donate_argnums=0)
    rows = np.tile([[1, 2]], (8, 1))
    with moecap.Capturer(side_stream=True, **CONFIG) as cap:
        ids = jnp.array(rows, jnp.int32)
        cap.capture(0, ids)
        donate(ids).block_until_ready()
        assert not ids.is_deleted()  # the held export made JAX decline the donation
        cap.join()
        assert np.from_dlpack(cap.export("layer_ids"))[:8].tolist() == rows.tolist()
        ids = jnp.array(rows + 2, jnp.int32)
        cap.capture(1, ids)
        ids.delete()
        [(jnp.full((8, 2), 13, jnp.int32) + i).block_until_ready() for i in range(20)]
        cap.join()
        assert cap.errors().invalid_ids == 0
        assert np.from_dlpack(cap.export("device_ids"))[1, :8].tolist() == (rows + 2).tolist()
    with moecap.Capturer(**CONFIG) as cap:
        ids = jnp.array(rows + 4, jnp.int32)
        cap.graph_begin()
        cap.capture(2, ids)
        graph = cap.graph_end()
        donate(ids).block_until_ready()
        graph.launch()
        assert np.from_dlpack(cap.export("device_ids"))[2, :8].tolist() == (rows + 4).tolist()
        graph.close()


def test_without_the_flag_nothing_is_held_and_join_is_a_no_op():
    with moecap.Capturer(**CONFIG) as cap:
        t = torch.tensor([[5, 6]], dtype=torch.int64)
        ref = weakref.ref(t)
        cap.capture(0, t)
        del t
        gc.collect()
        assert ref() is None
        cap.join()


def test_a_join_after_the_next_write_commits_that_write():
    for late in (False, True):
        with moecap.Capturer(side_stream=True, **CONFIG) as cap:
            ids = np.array([[1, 2]], dtype=np.int64)
            for layer in range(3):
                cap.capture(layer, ids)
            cap.commit(np.array([4], dtype=np.int64))
            if not late:
                cap.join()
            ids[:] = [[7, 8]]  # the engine's next forward reuses the tensor
            cap.join()
            assert cap.read(np.array([4]))[0].tolist() == ([[7, 8]] if late else [[1, 2]]) * 3


def test_close_runs_the_forked_work_before_it_lets_go_of_its_inputs():
    # A view keeps the memory past close(); the forked capture must not wait
    # for that view to go, when the tensor it reads may be long gone.
    cap = moecap.Capturer(**CONFIG, side_stream=True)
    view = np.from_dlpack(cap.export("layer_ids", 0))
    ids = np.array([[5, 6], [7, 8]], np.int64)
    cap.capture(0, ids)
    cap.close()
    assert view[:2].tolist() == [[5, 6], [7, 8]]  # the capture ran at close
    probe = weakref.ref(cap)
    del cap
    gc.collect()
    assert probe() is None
