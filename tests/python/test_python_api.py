# SPDX-License-Identifier: Apache-2.0
"""The typed Python face: keywords checked by name, dtypes given as names or as
NumPy / torch dtypes, named results, and constants that come from the C header
through the extension (no copy in Python to drift)."""
import dataclasses

import numpy as np
import pytest
import torch

import moecap
from moecap import _moecap

CONFIG = dict(num_layers=2, top_k=2, num_experts=8, host_slots=16, max_running_requests=4)


@pytest.mark.parametrize("call", [moecap.Capturer, moecap.plan])
def test_a_misspelt_keyword_names_itself_the_closest_keyword_and_every_keyword(call):
    with pytest.raises(TypeError) as e:
        call(num_layer=2)
    message = str(e.value)
    assert "'num_layer'" in message and "did you mean 'num_layers'?" in message
    assert all(f.name in message for f in dataclasses.fields(moecap.Config))
    with pytest.raises(TypeError, match="unexpected keyword argument 'zzz'; its keywords are: num_layers"):
        call(**CONFIG, zzz=1)  # nothing close: no guess, the list


def test_a_missing_keyword_is_named():
    with pytest.raises(TypeError, match=r"missing the keyword argument 'host_slots' \(required: num_layers"):
        moecap.Capturer(**{k: v for k, v in CONFIG.items() if k != "host_slots"})


def test_ints_and_devices_are_checked_before_the_library_sees_them():
    with pytest.raises(TypeError, match="top_k must be an int, not str"):
        moecap.plan(**dict(CONFIG, top_k="2"))
    with pytest.raises(TypeError, match="top_k must be an int, not bool"):
        moecap.plan(**dict(CONFIG, top_k=True))
    assert moecap.plan(**dict(CONFIG, top_k=np.int64(2))).row_elements == 4
    # Flags are bools: "no" is not False, and 2 is not True.
    for name in ("histogram", "side_stream", "guards"):
        for bad in ("no", 0.0, 2):
            with pytest.raises(TypeError, match=f"{name} must be a bool"):
                moecap.Config(**CONFIG, **{name: bad})
        assert getattr(moecap.Config(**CONFIG, **{name: np.bool_(True)}), name) is True
        assert getattr(moecap.Config(**CONFIG, **{name: 0}), name) is False
    # So are a call's: read's strict and nonblocking, errors' clear.
    cap = moecap.Capturer(**CONFIG)
    assert cap.read(np.array([1]), strict=np.bool_(False), nonblocking=0).shape == (1, 2, 2)
    assert cap.errors(clear=np.True_).invalid_ids == 0
    for bad in ("no", 0.0, 2, None):
        with pytest.raises(TypeError, match="strict must be a bool"):
            cap.read(np.array([1]), strict=bad)
        with pytest.raises(TypeError, match="clear must be a bool"):
            cap.errors(clear=bad)
    cap.close()
    with pytest.raises(TypeError, match="histogram must be a bool, not NoneType"):
        moecap.Config(**CONFIG, histogram=None)
    assert moecap.Config(**CONFIG, guards=None).guards is None  # the build's default
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda"):
        moecap.Config(**CONFIG, device="tpu")
    assert moecap.Config(**CONFIG, device="cuda").device == "cuda:0"
    assert moecap.Config(**CONFIG, device=torch.device("cuda", 1)).device == "cuda:1"
    assert moecap.Config(**CONFIG, device=torch.device("cpu", 0)).device == "cpu"
    assert moecap.Config(**CONFIG, device="cuda:01") == moecap.Config(**CONFIG, device="cuda:1")
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda"):
        moecap.Config(**CONFIG, device="cuda:\u0661")  # a digit, but not an ASCII one


def test_a_bare_cuda_device_is_torchs_current_one(monkeypatch):
    """A multi-GPU engine sets each rank's device and allocates on "cuda": rank 3's is GPU 3, not GPU 0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert moecap.Config(**CONFIG, device="cuda").device == "cuda:3"
    assert moecap.Config(**CONFIG, device=torch.device("cuda")).device == "cuda:3"
    assert moecap.Config(**CONFIG, device="cuda:1").device == "cuda:1"


@pytest.mark.parametrize("field, value, bits", [
    ("num_layers", 2**31, 32), ("top_k", -2**31 - 1, 32), ("host_slots", 2**63, 64), ("max_graph_batch", -2**64, 64)])
def test_an_int_its_c_field_cannot_hold_is_refused_naming_the_field_and_the_range(field, value, bits):
    for call in (moecap.plan, moecap.Capturer):
        with pytest.raises(moecap.MoecapError, match=rf"config: {field} is {value}; it must fit in int{bits} \[") as e:
            call(**dict(CONFIG, **{field: value}))
        assert e.value.status == moecap.Status.INVALID_ARGUMENT
    with pytest.raises(moecap.MoecapError, match=r"config: device's ordinal is 4294967296; it must fit in int32"):
        moecap.Config(**CONFIG, device="cuda:4294967296")


def test_an_int_argument_beyond_int32_is_out_of_range_not_a_binding_type_error():
    with moecap.Capturer(**CONFIG) as cap:
        ids = np.array([[1, 2]], dtype=np.int32)
        for call, name in ((lambda: cap.capture(2**31, ids), "moecap_capture: layer"),
                           (lambda: cap.capture(-2**40, ids), "moecap_capture: layer"),
                           (lambda: cap.export("layer_ids", 2**32), "moecap_export: layer"),
                           (lambda: cap.local_rows(2**31, [1]), r"moecap_local_rows: dp_rank")):
            with pytest.raises(moecap.MoecapError, match=rf"{name} is -?\d+; it must fit in int32") as e:
                call()
            assert e.value.status == moecap.Status.OUT_OF_RANGE
        cap.capture(1, ids)  # and the capturer goes on


def test_an_int_argument_that_may_be_none_is_checked_like_the_others():
    with moecap.Capturer(**CONFIG) as cap:
        for value in (4.0, "4", np.float64(4)):
            with pytest.raises(TypeError, match="moecap_local_rows: padded_tokens_per_rank must be an int, not"):
                cap.local_rows(0, [3], value)
        with pytest.raises(moecap.MoecapError, match="padded_tokens_per_rank is 1180591620717411303424; it must fit "
                                                     "in int64") as e:
            cap.local_rows(0, [3], 2**70)
        assert e.value.status == moecap.Status.OUT_OF_RANGE
        assert cap.local_rows(0, [3], np.int64(4)) == cap.local_rows(0, [3], torch.tensor(4)) == (0, 3, 4)


def test_an_int_argument_of_the_extension_refuses_bools_and_floats_naming_itself():
    # nanobind's own int caster takes True as 1 and a list of bools as counts; a layer, a row or a count is an int.
    with moecap.Capturer(**CONFIG) as cap:
        ids = np.array([[1, 2]], dtype=np.int32)
        refused = [
            (lambda v: cap.capture(v, ids), "moecap_capture: layer"),
            (lambda v: cap.commit(np.array([3]), v), "moecap_commit: src_start"),
            (lambda v: cap.local_rows(v, [1]), "moecap_local_rows: dp_rank"),
            (lambda v: cap.local_rows(0, [v]), r"moecap_local_rows: tokens_per_rank\[0\]"),
            (lambda v: cap.export("layer_ids", v), "moecap_export: layer"),
        ]
        for call, name in refused:
            for value, kind in ((True, "bool"), (torch.tensor(True), "a bool tensor"), (1.0, "float"),
                                (np.float32(1), "numpy.float32"), ("1", "str")):
                with pytest.raises(TypeError, match=rf"^{name} must be an int, not {kind}$"):
                    call(value)
        for value in ("1", 1, {1}, {1: 2}, (t for t in [1])):  # a set, a dict or a generator has no order to trust
            with pytest.raises(TypeError, match="moecap_local_rows: tokens_per_rank must be a sequence of ints"):
                cap.local_rows(0, value)
        assert cap.read(np.array([3]))[0, 0, 0] == -1  # the refused commit wrote nothing
        # Integers of NumPy and torch are ints, as anywhere in Python.
        cap.capture(np.int64(0), ids)
        cap.capture(torch.tensor(1), ids)
        assert cap.local_rows(np.int32(0), np.array([1]), torch.tensor(4)) == (0, 1, 4)
        assert cap.local_rows(0, torch.tensor([1])) == (0, 1, 1)
        cap.commit(np.array([3]), np.int64(0))
        assert cap.read(np.array([3]))[0].tolist() == [[1, 2], [1, 2]]


def test_the_engine_helpers_refuse_a_float_count_instead_of_truncating_it():
    from moecap import engine
    with moecap.Capturer(**CONFIG) as cap:
        cap.capture(0, np.array([[1, 2]], dtype=np.int32))
        with pytest.raises(TypeError, match=r"tokens_per_rank\[0\] must be an int, not float"):
            engine.commit_batch(cap, np.array([3]), tokens_per_rank=[1.7])
        with pytest.raises(TypeError, match="dp_rank must be an int, not bool"):
            engine.commit_batch(cap, np.array([3]), dp_rank=False)
        with pytest.raises(TypeError, match="num_experts must be an int, not float"):
            engine.RequestTable(cap, num_experts=8.5)
        assert cap.read(np.array([3]))[0, 0, 0] == -1


def test_the_pure_python_modules_annotate_their_public_functions():
    """As docs/PYTHON.md says: every public function, method and property of
    moecap, engine, hf, ops and record has its parameters and result typed."""
    import inspect

    from moecap import engine, hf, ops, record
    missing = []
    for module in (moecap, engine, hf, ops, record):
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            members = [(name, obj)]
            if inspect.isclass(obj):
                members = [(f"{name}.{m}", v) for m, v in vars(obj).items() if not m.startswith("_") or m == "__init__"]
            for qualified, f in members:
                f = f.fget if isinstance(f, property) else getattr(f, "__func__", f)
                if not inspect.isfunction(f) or not f.__module__.startswith("moecap"):
                    continue
                signature = inspect.signature(f)
                untyped = [p.name for p in signature.parameters.values() if p.name not in ("self", "cls")
                           and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.annotation is p.empty]
                if signature.return_annotation is signature.empty or untyped:
                    missing.append(f"{module.__name__}.{qualified}")
    assert missing == []


def test_errors_cross_process_boundaries_and_copy_whole():
    """A worker's MoecapError reaches its pool (pickle) with its status and message."""
    import copy
    import pickle
    from moecap.record import RecordError
    with moecap.Capturer(**CONFIG) as cap:
        with pytest.raises(moecap.MoecapError) as caught:
            cap.capture(5, np.zeros((1, 2), np.int32))
    for error in (caught.value, RecordError(moecap.Status.INVALID_ARGUMENT, "a record's header"),
                  moecap.MoecapError(1234, "a status from a newer library")):
        for again in (pickle.loads(pickle.dumps(error)), copy.copy(error), copy.deepcopy(error)):
            assert type(again) is type(error)
            assert again.status == error.status and str(again) == str(error)


def test_a_zero_dimensional_slots_is_a_moecap_error_whether_read_allocates_or_not():
    with moecap.Capturer(**CONFIG) as cap:
        out = np.zeros((1, 2, 2), np.int32)
        for call in (lambda: cap.read(np.array(2)), lambda: cap.read(np.array(2), out=out)):
            with pytest.raises(moecap.MoecapError, match="moecap_read: slots has ndim 0; expected 1") as e:
                call()
            assert e.value.status == moecap.Status.INVALID_ARGUMENT


def test_errors_name_the_python_arguments_not_the_c_ones():
    """The library's message in the method's terms: its arguments' Python
    names and fields written with a dot."""
    with moecap.Capturer(**CONFIG) as cap:
        cases = ((lambda: cap.read(np.arange(4), out=np.zeros((3, 2, 2), np.int32)),
                  r"moecap_read: out\.shape\[0\] is 3; expected 4"),
                 (lambda: cap.capture(0, np.zeros((4, 3), np.int32)), r"moecap_capture: topk_ids\.shape\[1\] is 3"),
                 (lambda: cap.commit(np.arange(40)), r"moecap_commit: dst_slots has 40 entries"),
                 (lambda: cap.local_rows(3, [1]), r"moecap_local_rows: dp_rank is 3"),
                 (lambda: cap.local_rows(0, [1, 2]), r"moecap_local_rows: len\(tokens_per_rank\) is 2"),
                 (lambda: cap.local_rows(0, [-1]), r"moecap_local_rows: tokens_per_rank\[0\] is -1"))
        for call, message in cases:
            with pytest.raises(moecap.MoecapError, match=message) as e:
                call()
            assert "->" not in str(e.value) and "ids_out" not in str(e.value) and "batch" not in str(e.value)


@pytest.mark.parametrize("given, name", [
    ("u8", "u8"), (np.uint8, "u8"), (np.dtype("uint16"), "u16"), (torch.int16, "i16"), (torch.int32, "i32"),
    ("int16", "i16"), (moecap.IdDtype.U16, "u16")])
def test_id_dtypes_are_names_numpy_or_torch_dtypes(given, name):
    config = moecap.Config(**CONFIG, id_dtype=given, device_id_dtype=given)
    assert config.id_dtype == name and config.device_id_dtype == name
    p = moecap.plan(config)
    assert p.id_dtype == name and p.device_id_dtype == name


@pytest.mark.parametrize("given, name, weight_bytes", [
    (None, None, 0), ("bf16", "bf16", 2), (torch.bfloat16, "bf16", 2), (np.float16, "f16", 2),
    (torch.float32, "f32", 4), (moecap.WeightDtype.F32, "f32", 4)])
def test_weight_dtypes_are_names_numpy_or_torch_dtypes(given, name, weight_bytes):
    with moecap.Capturer(**CONFIG, weight_dtype=given) as cap:
        assert cap.config.weight_dtype == name and cap.plan.weight_bytes == weight_bytes


def test_a_dtype_moecap_does_not_store_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"id_dtype must be one of 'auto', 'u8'.*NumPy / torch dtype.*not torch.int8"):
        moecap.plan(**CONFIG, id_dtype=torch.int8)
    with pytest.raises(ValueError, match="weight_dtype must be one of None, 'f32'"):
        moecap.plan(**CONFIG, weight_dtype=np.float64)


def test_plan_is_named_and_typed_and_its_dtypes_go_back_into_a_config():
    p = moecap.plan(**CONFIG, chunked_prefill_size=6)
    assert isinstance(p, moecap.Plan)
    assert (p.rows_per_rank, p.device_rows, p.row_elements) == (6, 6, 4)
    assert p.id_dtype == "u8" and p.device_id_dtype == "i16"  # resolved from 'auto', as the keywords name them
    assert p["id_bytes"] == p.id_bytes == 1 and dict(p)["host_bytes"] == p.host_bytes  # still reads as the dict it was
    assert moecap.plan(**CONFIG, chunked_prefill_size=6, id_dtype=p.id_dtype, device_id_dtype=p.device_id_dtype) == p
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.id_bytes = 2


def test_a_config_object_and_keywords_build_the_same_capturer():
    config = moecap.Config(**CONFIG)
    with moecap.Capturer(config) as a, moecap.Capturer(**CONFIG) as b, moecap.Capturer(config, top_k=1) as c:
        assert a.config == b.config == config and a.plan == b.plan
        assert c.config.top_k == 1 and c.plan.row_elements == 2
        assert a.config["num_layers"] == 2 and a.config.get("weight_dtype") is None and "dp_size" in a.config
    with moecap.Capturer(config=config) as d:
        assert d.config == config
    assert moecap.plan(config=config) == moecap.plan(config)
    with pytest.raises(TypeError, match="takes a moecap.Config or keywords, not dict"):
        moecap.Capturer(CONFIG)


def test_unset_fields_take_the_library_defaults():
    c_defaults = _moecap.Config()  # moecap_config_init
    config = moecap.Config(**CONFIG)
    for name in ("extra_columns", "dp_size", "verify_tokens", "chunked_prefill_size", "max_graph_batch",
                 "max_batch_tokens"):
        assert getattr(config, name) == getattr(c_defaults, name), name


def test_errors_are_named_counts():
    with moecap.Capturer(**CONFIG) as cap:
        # 99 >= num_experts: counted, not stored; -1 (a padded row's "no expert") is not counted
        cap.capture(0, np.array([[1, 99], [-1, -1]], dtype=np.int32))
        e = cap.errors(clear=True)
        assert isinstance(e, moecap.ErrorCounts) and (e.skipped_rows, e.invalid_ids) == (0, 1)
        assert e["invalid_ids"] == 1 and dict(e) == {"skipped_rows": 0, "invalid_ids": 1}
        assert e == {"skipped_rows": 0, "invalid_ids": 1} and e != {"skipped_rows": 0, "invalid_ids": 0}  # as the dict was
        assert cap.errors().invalid_ids == 0  # cleared
        assert cap.errors() == moecap.ErrorCounts(0, 0) and hash(cap.errors()) == hash(moecap.ErrorCounts(0, 0))
        assert cap.plan == dict(cap.plan) and cap.plan != dict(cap.plan, host_bytes=0)
        assert cap.config == moecap.Config(**CONFIG) and cap.config != cap.plan


def test_statuses_are_the_libraries_own():
    for status in moecap.Status:
        prefix = "MOECAP_" if status == moecap.Status.OK else "MOECAP_ERROR_"
        assert _moecap.status_name(status) == prefix + status.name
    named = [code for code in range(256) if _moecap.status_name(code) != "MOECAP_STATUS_UNKNOWN"]
    assert named == sorted(int(s) for s in moecap.Status)  # a status the library adds is one the extension exports
    assert moecap.Status is _moecap.Status and moecap.MoecapError(15, "x").status is moecap.Status.NO_ROUTING


def test_the_version_is_the_libraries_major_and_minor_and_the_headers_patch():
    import pathlib
    import re

    header = (pathlib.Path(__file__).resolve().parents[2] / "abi" / "moecap.h").read_text()
    patch = re.search(r"#define MOECAP_VERSION_PATCH +([0-9]+)", header).group(1)
    assert moecap.__version__ == "{}.{}.{}".format(*moecap.abi_version(), patch)


def test_close_waits_for_calls_in_progress_on_other_threads():
    # read, commit, write and synchronize release the GIL inside the library:
    # a close() on another thread must not free the capturer under them.
    import threading
    import time

    outcomes = []
    for trial in range(200):
        cap = moecap.Capturer(**CONFIG)
        cap.capture(0, np.array([[1, 2]], dtype=np.int32))
        cap.capture(1, np.array([[3, 4]], dtype=np.int32))
        cap.commit(np.array([5]))
        started = threading.Barrier(4)
        slots = np.array([5])

        def reader():
            out = np.empty((1, 2, 2), np.int32)
            started.wait()
            try:
                for _ in range(200):
                    cap.read(slots, out=out)
                    cap.synchronize()
                assert out.tolist() == [[[1, 2], [3, 4]]]
                outcomes.append("finished")
            except ValueError as e:
                assert "closed" in str(e)
                outcomes.append("closed")

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        started.wait()
        time.sleep(0.0002 * (trial % 10))  # close at different points of the readers' loops
        cap.close()
        for t in threads:
            t.join()
        with pytest.raises(ValueError, match="closed"):
            cap.read(np.array([5]))
    assert len(outcomes) == 600 and "closed" in outcomes


@pytest.mark.parametrize("call", ["capture", "join", "graph launch"])
def test_a_call_waiting_for_a_long_read_on_another_thread_lets_other_python_threads_run(call):
    # The read releases the GIL and holds the capturer's lock while it fills its output; a capture (a join, a
    # graph's launch) on a second thread waits for that lock. It used to wait with the GIL held: no Python
    # thread ran until the read ended (the main thread's ticks below stopped for the whole wait).
    import sys
    import threading
    import time

    cap = moecap.Capturer(num_layers=64, top_k=8, num_experts=128, host_slots=32768, max_running_requests=8,
                          side_stream=call == "join")
    graph = None
    if call == "graph launch":
        cap.graph_begin()
        cap.capture(0, np.zeros((1, 8), np.int32))
        graph = cap.graph_end()
    second = {"capture": lambda: cap.capture(0, np.zeros((1, 8), np.int32)), "join": lambda: cap.join(),
              "graph launch": lambda: graph.launch()}[call]
    slots = np.arange(32768)
    waits = []
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # a thread waiting for a free GIL gets it within 0.5 ms
    try:
        for attempt in range(8):
            out = np.empty((32768, 64, 8), np.int64)  # 128 MB: its pages are first touched inside the read
            reading = threading.Event()
            window = []

            def reader():
                reading.set()
                cap.read(slots, out=out)

            def capturer():
                reading.wait()
                time.sleep(0.002)  # the reader is inside the library by now
                start = time.perf_counter()
                second()
                window.extend((start, time.perf_counter()))

            threads = [threading.Thread(target=reader), threading.Thread(target=capturer)]
            for t in threads:
                t.start()
            ticks = []
            while threads[1].is_alive():
                ticks.append(time.perf_counter())
            for t in threads:
                t.join()
            start, end = window
            inside = [t for t in ticks if start <= t <= end]
            longest_pause = max(b - a for a, b in zip([start] + inside, inside + [end]))
            waits.append((round(end - start, 4), round(longest_pause, 4)))
            # The capture did wait for the read, and the main thread ran meanwhile (a busy machine may
            # pause it a while anyway, hence a few attempts).
            if end - start > 0.01 and longest_pause < 0.5 * (end - start):
                break
        else:
            pytest.fail(f"in no attempt did the main thread run while the {call} waited for a read "
                        f"(each attempt's wait and longest pause, in s): {waits}")
    finally:
        sys.setswitchinterval(switch_interval)
    assert out[0, 0, 0] == -1  # the read itself ran: slot 0 holds no routing
    if graph is not None:
        graph.close()
    cap.close()


def test_a_capturer_closed_or_left_while_it_records_a_graph_is_released_and_keeps_the_callers_exception():
    # moecap_destroy is refused while recording; the capturer used to stay alive and unreachable.
    cap = moecap.Capturer(**CONFIG)
    cap.graph_begin()
    cap.capture(0, np.array([[1, 2]], dtype=np.int32))
    cap.close()
    assert cap.closed
    with pytest.raises(KeyError, match="engine failed mid-capture"):
        with moecap.Capturer(**CONFIG) as inside:
            inside.graph_begin()
            raise KeyError("engine failed mid-capture")
    assert inside.closed


def test_a_daemon_thread_inside_a_call_when_the_interpreter_exits_does_not_abort_it():
    # Python <= 3.13 ends such a thread with pthread_exit when it takes the GIL back; unwinding through the
    # binding's GIL release aborted the process (rc 134).
    import subprocess
    import sys

    script = """if True:
        import threading, time, numpy as np, moecap
        cap = moecap.Capturer(num_layers=2, top_k=2, num_experts=8, host_slots=64, max_running_requests=8)
        def monitor():
            slots = np.array([1, 2])
            while True:
                cap.errors()
                cap.read(slots)
        threading.Thread(target=monitor, daemon=True).start()
        time.sleep(0.05)
        print("exits")
    """
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout == "exits\n", done.stderr[-500:]
    # The thread that finalizes takes the GIL back as usual: a __del__ at exit that calls moecap returns.
    finalizer = """if True:
        import moecap
        class Flusher:
            def __init__(self):
                self.sync = moecap.Capturer(num_layers=2, top_k=2, num_experts=8, host_slots=16,
                                            max_running_requests=4).synchronize
            def __del__(self):
                self.sync()
                print("flushed")
        keep = Flusher()
    """
    done = subprocess.run([sys.executable, "-c", finalizer], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "flushed\n", done.stderr[-500:]


def test_close_from_a_del_at_exit_does_not_wait_for_a_daemon_thread_parked_in_a_call():
    """At exit Python parks for good a daemon thread that takes the GIL back after its C call; close() (an
    engine's teardown in a __del__) waited for that call to end, forever."""
    import subprocess
    import sys

    script = """if True:
        import os, threading, time, numpy as np, moecap
        ns = {}
        exec("def loop(cap, slots, out):\\n    while True:\\n        cap.read(slots, out=out)\\n", ns)
        class Engine:
            def __init__(self, cap): self.cap = cap
            def __del__(self, write=os.write):
                self.cap.close(); write(1, b"closed\\n")
        def main():
            cap = moecap.Capturer(num_layers=8, top_k=8, num_experts=64, host_slots=1 << 18, max_running_requests=8)
            slots = np.random.default_rng(0).integers(0, 1 << 18, 1 << 20)
            out = np.empty((len(slots), 8, 8), np.uint8)
            threading.Thread(target=ns["loop"], args=(cap, slots, out), daemon=True).start()
            time.sleep(0.2)
            return Engine(cap)
        engine = main()
    """
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout == "closed\n", (done.returncode, done.stderr[-500:])


def test_a_capturer_made_before_a_fork_is_refused_in_the_child_and_left_to_the_parent():
    """The child of a fork has a copy of the capturer but not the thread that may hold its lock (here one
    inside a long read): its first call, or close(), waited forever. It refuses every call there, and closing
    or dropping it leaks the handle; the parent goes on using it."""
    import os
    import threading
    import time

    cap = moecap.Capturer(num_layers=8, top_k=8, num_experts=64, host_slots=1 << 18, max_running_requests=8)
    cap.capture(0, np.ones((2, 8), np.int32))
    cap.commit(np.array([3, 4]))
    slots = np.random.default_rng(0).integers(0, 1 << 18, 1 << 20)
    out = np.empty((len(slots), 8, 8), np.uint8)
    stop = threading.Event()

    def monitor():
        while not stop.is_set():
            cap.read(slots, out=out)

    reader = threading.Thread(target=monitor)
    reader.start()
    time.sleep(0.1)
    parent = os.getpid()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's teardown
        report = []
        for call in (lambda: cap.read(np.array([3])), lambda: cap.capture(0, np.ones((1, 8), np.int32)),
                     lambda: cap.commit(np.array([5])), lambda: cap.graph_begin()):
            try:
                call()
                report.append("ran")
            except ValueError as e:
                report.append(str(e))
        cap.close()
        report.append(str(cap.closed))
        os.write(write, "\n".join(report).encode())
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG)[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the child hung")
        time.sleep(0.05)
    with os.fdopen(read) as f:
        report = f.read().split("\n")
    stop.set()
    reader.join()
    expected = (f"moecap: this capturer was made in process {parent} before a fork; it belongs to that process (the "
                "threads that may hold its lock, and on CUDA its context, do not cross a fork): make one in this process")
    assert report == [expected] * 4 + ["True"], report
    assert cap.read(np.array([3, 4]))[:, 0].tolist() == [[1] * 8, [1] * 8]  # the parent's, untouched


def test_a_capturer_dropped_while_it_records_a_graph_frees_its_memory():
    import gc

    def resident_mib():
        with open("/proc/self/status") as status:
            return int(next(line for line in status if line.startswith("VmRSS")).split()[1]) // 1024

    big = dict(num_layers=8, top_k=8, num_experts=64, host_slots=1 << 17, max_running_requests=64)  # 8 MB cache
    ids = np.zeros((4, 8), dtype=np.int32)
    every_page = np.arange(1 << 17, step=64)  # a slot on each 4 KB page of the 64-byte rows
    rows = np.ones((every_page.size, 8, 8), dtype=np.int32)
    before = resident_mib()
    for _ in range(40):
        cap = moecap.Capturer(**big)
        cap.write(every_page, rows)  # the cache's pages become resident
        cap.graph_begin()
        cap.capture(0, ids)
        del cap
        gc.collect()
    assert resident_mib() - before < 100  # each one kept (8 MB and more) grew it by over 320 MB


def test_every_enum_and_flag_set_of_the_extension_is_public():
    import enum

    kinds = {name: obj for name, obj in vars(_moecap).items() if isinstance(obj, type) and issubclass(obj, enum.Enum)}
    assert {"Status", "IdDtype", "ConfigFlag", "ReadFlag", "SlotState", "RecordFlag"} <= set(kinds)
    for name, kind in kinds.items():
        home = moecap.record if name == "RecordFlag" else moecap
        assert getattr(home, name) is kind, f"moecap{'.record' if home is not moecap else ''}.{name}"
        assert home is not moecap or name in moecap.__all__
    assert (moecap.ReadFlag.NONBLOCKING, moecap.ReadFlag.STRICT) == (1, 2)  # MOECAP_READ_*


def test_buffers_and_slot_states_are_the_extensions_constants():
    assert moecap.BUFFERS == {b.name.lower(): b for b in moecap.Buffer}
    assert (moecap.SLOT_EMPTY, moecap.SLOT_VALID, moecap.SLOT_INVALID_IDS) == (0, 1, 2)
    with moecap.Capturer(**CONFIG, histogram=True) as cap:
        assert np.from_dlpack(cap.export(moecap.Buffer.HISTOGRAM)).shape == (2, 8)
        assert np.from_dlpack(cap.export("host_states")).shape == (16,)
        cap.capture(0, np.array([[1, 2]], dtype=np.int32))
        cap.capture(1, np.array([[3, 4]], dtype=np.int32))
        cap.commit(np.array([5]))
        states = cap.slot_states([5, 6])
        assert states.tolist() == [moecap.SlotState.VALID, moecap.SlotState.EMPTY]
        assert ((states & moecap.SLOT_VALID) != 0).tolist() == [True, False]


def test_the_stubs_say_what_a_tensor_argument_takes():
    import pathlib
    stub = pathlib.Path(_moecap.__file__).with_name("_moecap.pyi")
    if not stub.exists():
        pytest.skip("no generated stub beside the extension (an install without it)")
    text = stub.read_text()
    # Integer arguments take anything with __index__ (NumPy ints, 0-d tensors), and tokens_per_rank arrays.
    assert ("def capture(self, layer: SupportsIndex, topk_ids: moecap.DLPackArray, "
            "topk_weights: moecap.DLPackArray | None = None") in text
    assert "tokens_per_rank: Sequence[SupportsIndex] | moecap.DLPackArray" in text
    for name in ("topk_ids", "topk_weights", "dst_slots", "src_rows", "slots", "out", "weights_out", "ids", "weights"):
        assert f" {name}: object" not in text, name
    assert "class Status(enum.IntEnum)" in text and "class SlotState(enum.IntFlag)" in text
    assert "__str__ = __repr__" not in text  # stubgen's IntFlag line that type checkers reject


def test_every_buffer_the_library_exports_is_a_buffer_member():
    with moecap.Capturer(**CONFIG, histogram=True, weight_dtype="f32") as cap:
        exported = []
        for which in range(0, 32):
            try:
                cap.export_view(which, 0)
                exported.append(which)
            except moecap.MoecapError as e:
                assert e.status == moecap.Status.INVALID_ARGUMENT
        assert exported == sorted(int(b) for b in moecap.Buffer)


def test_export_takes_a_buffer_its_name_or_its_int_value_and_names_all_three_when_refused():
    with moecap.Capturer(**CONFIG) as cap:
        for which in (moecap.Buffer.LAYER_IDS, "layer_ids", int(moecap.Buffer.LAYER_IDS), np.int64(6)):
            assert np.from_dlpack(cap.export(which, 1)).shape == np.from_dlpack(cap.export("layer_ids", 1)).shape
        with pytest.raises(ValueError, match="which must be a moecap.Buffer .*LAYER_IDS = 6.* not 99"):
            cap.export(99)
        with pytest.raises(ValueError, match="which must be one of .*'host_ids'.* or a moecap.Buffer, not 'ids'"):
            cap.export("ids")
        for wrong in (None, 6.0, True):
            with pytest.raises(TypeError, match=f"which must be a moecap.Buffer, .* not {type(wrong).__name__}"):
                cap.export(wrong)
            with pytest.raises(TypeError, match=f"^moecap_export: layer must be an int, not {type(wrong).__name__}$"):
                cap.export("layer_ids", wrong)  # None was nanobind's "export_view(): incompatible function arguments"
        assert np.from_dlpack(cap.export("layer_ids", np.int32(1))).shape == np.from_dlpack(cap.export("layer_ids", 1)).shape


def test_every_dtype_enum_member_names_its_own_dtype_and_never_the_other_kinds():
    # IdDtype.AUTO and WeightDtype.NONE are both 0: as IntEnums they compare equal, which
    # must neither refuse id_dtype=IdDtype.AUTO nor take weight_dtype=IdDtype.AUTO as "no weights".
    for member in moecap.IdDtype:
        config = moecap.Config(**CONFIG, id_dtype=member, device_id_dtype=member)
        assert config.id_dtype == member.name.lower() and config.device_id_dtype == member.name.lower()
        with pytest.raises(ValueError, match="weight_dtype must be one of"):
            moecap.Config(**CONFIG, weight_dtype=member)
    for member in moecap.WeightDtype:
        assert moecap.Config(**CONFIG, weight_dtype=member).weight_dtype == (
            None if member == moecap.WeightDtype.NONE else member.name.lower())
        with pytest.raises(ValueError, match="id_dtype must be one of"):
            moecap.Config(**CONFIG, id_dtype=member)


def test_the_readmes_python_example_runs_and_reads_what_it_says():
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    (example,) = re.findall(r"## From Python\n\n```python\n(.*?)```", readme, re.S)
    scope: dict = {}
    exec(compile(example, "README.md", "exec"), scope)
    assert scope["ids"].shape == (2, 2, 2) and scope["ids"].dtype == np.int32
    assert ((scope["ids"] >= 0) & (scope["ids"] < 8)).all()  # both tokens' routing, padding dropped


@pytest.mark.parametrize("slots, dtype, expected", [
    (np.array([5]), torch.int64, np.int64), (np.array([5]), "int16", np.int16),
    (torch.tensor([5]), np.int64, torch.int64), (torch.tensor([5]), np.dtype("int16"), torch.int16),
    (torch.tensor([5]), "int8", torch.int8)])
def test_a_read_takes_its_dtype_from_either_library_whichever_allocates(slots, dtype, expected):
    with moecap.Capturer(**CONFIG) as cap:
        cap.capture(0, np.array([[1, 2]], dtype=np.int32))
        cap.capture(1, np.array([[3, 4]], dtype=np.int32))
        cap.commit(np.array([5]))
        got = cap.read(slots, dtype=dtype)
        assert got.dtype == expected and got.tolist() == [[[1, 2], [3, 4]]]


def test_a_reads_dtype_names_are_moecaps_and_a_dtype_it_cannot_write_is_refused():
    with moecap.Capturer(**CONFIG) as cap:
        slots = np.array([5])
        # moecap's short names: "u8" is uint8, so "i8" is int8 (NumPy reads both as 8-byte integers).
        assert cap.read(slots, dtype="i8").dtype == np.int8 and cap.read(slots, dtype="u8").dtype == np.uint8
        assert cap.read(torch.tensor([5]), dtype="i64").dtype == torch.int64
        assert cap.read(slots, dtype=moecap.IdDtype.U16).dtype == np.uint16  # Config's names and enums alike
        for bad in ("bogus", "bf16", np.float32, object):
            with pytest.raises(TypeError, match="is not one read writes ids in: uint8, int8, uint16"):
                cap.read(slots, dtype=bad)
            with pytest.raises(TypeError, match="is not one read writes ids in"):
                cap.read(torch.tensor([5]), dtype=bad)
        out = np.zeros((1, cap.config.num_layers, cap.config.top_k), dtype=np.int32)
        with pytest.raises(ValueError, match="dtype is 'i64' but out is int32"):
            cap.read(slots, dtype="i64", out=out)
        assert cap.read(slots, dtype=torch.int32, out=out) is out
        with pytest.raises(moecap.MoecapError, match="stream is -1; a CUstream handle is in \\[0, 2\\^64\\)"):
            cap.capture(0, np.zeros((1, cap.config.top_k), dtype=np.int32), stream=-1)
        with pytest.raises(moecap.MoecapError, match="layer_ids: layer is -1; it must be in \\[0, num_layers = 2\\)"):
            cap.ops.layer_ids(-1)  # Python's indexing would hand out the last layer
        assert cap.ops.layer_ids(np.int64(1)).shape == (cap.plan.device_rows, cap.config.top_k)
        with pytest.raises(TypeError, match="layer must be an int, not float"):
            cap.ops.layer_ids(1.0)


@pytest.mark.parametrize("device_id_dtype", ["auto", "u8"])
def test_a_layer_view_passed_back_as_its_own_rows_commits_only_the_rows_this_step_wrote(device_id_dtype):
    """A top-k kernel writes a layer view (int16 by default, u8 here too) and
    the engine passes those rows to capture: rows past them, another DP rank's
    left from an earlier step, commit as no routing, not as routing."""
    with moecap.Capturer(num_layers=2, top_k=2, num_experts=8, host_slots=16, max_running_requests=4, dp_size=2,
                         device_id_dtype=device_id_dtype) as cap:
        view = torch.from_dlpack(cap.export("layer_ids", 1))
        assert view.dtype == (torch.int16 if device_id_dtype == "auto" else torch.uint8)

        def step(layer0, layer1, src_start, slots):
            cap.capture(0, np.array(layer0, dtype=np.int32))
            view[:len(layer1)] = torch.tensor(layer1, dtype=view.dtype)
            cap.capture(1, view[:len(layer1)])  # the layer's own rows, in place
            cap.commit(np.array(slots), src_start=src_start)

        # Step 1: a gathered batch of 4; this rank's are rows 0-1, rows 2-3 stay unconsumed.
        step([[1, 2]] * 4, [[3, 4], [5, 6], [7, 0], [1, 3]], 0, [0, 1])
        # Step 2: layer 1's kernel wrote 2 rows; this rank commits rows 2-3 of the batch.
        step([[2, 3]] * 4, [[4, 5], [6, 7]], 2, [2, 3])
        got = cap.read(np.array([0, 1, 2, 3]))
        assert got[:2].tolist() == [[[1, 2], [3, 4]], [[1, 2], [5, 6]]]
        assert got[2:].tolist() == [[[2, 3], [-1, -1]]] * 2  # not step 1's [7, 0] and [1, 3]
        with pytest.raises(moecap.MoecapError, match="has no routing in layer 1"):
            cap.read(np.array([2]), strict=True)
        assert cap.errors()["invalid_ids"] == 0
        with pytest.raises(moecap.MoecapError, match="topk_ids has dtype"):
            cap.capture(1, view[:2].clone())  # the device dtype anywhere else is no layer's own rows


def test_weights_left_out_where_the_capturer_keeps_them_are_named_as_python_passes_them():
    with moecap.Capturer(**CONFIG, weight_dtype="f32") as cap:
        ids = np.array([[1, 2]], dtype=np.int32)
        with pytest.raises(moecap.MoecapError, match=r"moecap_capture: topk_weights is None; the capturer keeps "
                                                     r"weights \(config.weight_dtype is float32\)"):
            cap.capture(0, ids)
        with pytest.raises(moecap.MoecapError, match="moecap_write: weights is None; the capturer keeps weights"):
            cap.write(np.array([3]), np.ones((1, 2, 2), dtype=np.int32))


def test_a_capturer_an_autograd_graph_holds_at_exit_is_not_reported_as_a_binding_leak():
    """torch never frees an autograd graph still alive at exit; one that saved a Capturer made nanobind
    report moecap's types as leaked by "a reference counting issue in the binding code"."""
    import os
    import subprocess
    import sys
    script = """if True:
        import moecap, torch
        cap = moecap.Capturer(num_layers=2, top_k=2, num_experts=8, host_slots=16, max_running_requests=4)
        class Keep(torch.autograd.Function):
            @staticmethod
            def forward(ctx, a):
                ctx.kept = cap
                return a * 2
            @staticmethod
            def backward(ctx, g):
                return g * 2
        y = Keep.apply(torch.ones(3, requires_grad=True))
        print("ran")
    """
    env = {k: v for k, v in os.environ.items() if k != "MOECAP_LEAK_WARNINGS"}
    quiet = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and "ran" in quiet.stdout
    assert "nanobind" not in quiet.stderr, quiet.stderr
    loud = subprocess.run([sys.executable, "-c", script], env=dict(env, MOECAP_LEAK_WARNINGS="1"),
                          capture_output=True, text=True, timeout=300)
    assert "leaked" in loud.stderr  # the report a search for real leaks turns back on


def test_an_older_libmoecap_the_process_loaded_first_is_named_by_the_import_error(tmp_path):
    """The loader reuses a library of the same SONAME already in the process (an engine that dlopened its own
    libmoecap.so.1): the extension's newer symbols are missing there, and the import says which library."""
    import os
    import shutil
    import subprocess
    import sys
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in library")
    older = tmp_path / "libmoecap.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-x", "c", "-", "-o", str(older), "-Wl,-soname,libmoecap.so.1"],
                   input="int moecap_stand_in;\n", text=True, check=True)
    script = f"import ctypes; ctypes.CDLL({str(older)!r})\nimport moecap"
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert f"the process loaded another libmoecap.so.1 first ({older})" in done.stderr, done.stderr
    assert "Import moecap before loading it" in done.stderr
