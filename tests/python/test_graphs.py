# SPDX-License-Identifier: Apache-2.0
"""moecap-owned graphs from Python: a replay reads what the recorded tensors
hold now, and the graph keeps those tensors alive after the caller drops them."""
import gc

import numpy as np
import pytest

import moecap

CONFIG = dict(num_layers=2, top_k=2, num_experts=16, host_slots=32, max_running_requests=8,
              chunked_prefill_size=8)


def test_replay_reads_the_recorded_tensors_now():
    with moecap.Capturer(**CONFIG) as cap:
        ids = np.zeros((3, 2), dtype=np.int32)
        slots = np.full(3, -1, dtype=np.int64)
        cap.graph_begin()
        for layer in range(2):
            cap.capture(layer, ids)
        cap.commit(slots)
        graph = cap.graph_end()
        with pytest.raises(moecap.MoecapError, match="no moecap_graph_begin"):
            cap.graph_end()
        ids[:] = [[1, 2], [3, 4], [5, 6]]
        slots[:] = [7, -1, 9]
        del ids, slots  # the graph holds them: their addresses are baked into it
        gc.collect()
        graph.launch()
        assert cap.read(np.array([7, 9]))[:, 1].tolist() == [[1, 2], [5, 6]]
        graph.close()
        with pytest.raises(ValueError, match="closed"):
            graph.launch()


def test_calls_that_cannot_be_recorded_are_refused_while_recording():
    with moecap.Capturer(**CONFIG) as cap:
        cap.graph_begin()
        with pytest.raises(moecap.MoecapError) as e:
            cap.read(np.array([0]))
        assert e.value.status == moecap.Status.CAPTURE_ILLEGAL
        cap.graph_end().close()


def test_graph_begin_and_end_go_on_while_other_threads_commit_and_invalidate_without_pause():
    # They wait for commits and invalidations in flight (a recorded call must
    # hand its tensors to the graph's list); calls starting meanwhile wait for
    # them instead, so the wait ends however busy the other threads are.
    import threading
    import time

    with moecap.Capturer(**CONFIG) as cap:
        stop = threading.Event()
        calls, errors = [0, 0], []

        def busy(i, call):
            try:
                while not stop.is_set():
                    call()
                    calls[i] += 1
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        workers = [threading.Thread(target=busy, args=(0, lambda: cap.invalidate(np.array([-1]))), daemon=True),
                   threading.Thread(target=busy, args=(1, lambda: cap.commit(np.full(1, -1))), daemon=True)]
        for w in workers:
            w.start()
        recorded = []

        def record():
            for _ in range(20):
                cap.graph_begin()
                cap.graph_end().close()
                recorded.append(True)

        recorder = threading.Thread(target=record, daemon=True)
        started = time.monotonic()
        recorder.start()
        recorder.join(timeout=30)
        done = len(recorded)  # before the other threads stop
        stop.set()
        for w in workers:
            w.join(timeout=60)
        assert done == 20, f"{done} of 20 graphs in {time.monotonic() - started:.0f} s while the others ran"
        assert not errors and min(calls) > 0, (errors, calls)


def test_the_commits_a_capturer_counts_include_each_launch_of_a_recorded_commit():
    """moecap.hf tells a forward whose rows nobody committed by this count."""
    cap = moecap.Capturer(num_layers=1, top_k=1, num_experts=4, host_slots=8, max_running_requests=2)
    slots = np.array([1])
    cap.commit(slots)
    assert cap._commits == 1
    cap.graph_begin()
    cap.commit(slots)
    graph = cap.graph_end()
    assert cap._commits == 1  # recorded, not run
    graph.launch()
    graph.launch()
    assert cap._commits == 3
    cap.graph_begin()
    cap.invalidate(slots)
    no_commit = cap.graph_end()
    no_commit.launch()
    assert cap._commits == 3
