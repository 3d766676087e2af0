# SPDX-License-Identifier: Apache-2.0
"""The binding's CUDA paths on the stand-in driver (tests/cuda_standin), in a
child process: MOECAP_LIBCUDA names the driver, which moecap loads once per
process. ctest sets MOECAP_TEST_STANDIN_LIBCUDA where the stand-in is built
(CUDA kernels need nvcc)."""
import os
import subprocess
import sys
import textwrap

import pytest

STANDIN = os.environ.get("MOECAP_TEST_STANDIN_LIBCUDA")
pytestmark = pytest.mark.skipif(not STANDIN, reason="no stand-in CUDA driver built (nvcc absent)")

# Shared by the scripts: a stream from the stand-in, two CUDA capturers (the
# second's int32 layer view is the "GPU" memory a producer hands out; the
# stand-in's device memory is host memory, so the script writes it directly).
PRELUDE = """
import ctypes, os
import numpy as np
import moecap

lib = ctypes.CDLL(os.environ["MOECAP_LIBCUDA"])
lib.standin_entry.restype = ctypes.c_void_p
create_stream = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)(
    lib.standin_entry(b"cuStreamCreate"))
stream = ctypes.c_void_p()
assert create_stream(ctypes.byref(stream), 0) == 0

config = dict(num_layers=2, top_k=2, num_experts=8, host_slots=16, max_running_requests=4,
              chunked_prefill_size=4, device="cuda:0")
cap = moecap.Capturer(**config)
owner = moecap.Capturer(**config, device_id_dtype="i32")

get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
rows = owner.plan.device_rows
routing = np.array([[k + 2 * (t % 3) for k in range(2)] for t in range(rows)], dtype=np.int32)
capsule = owner.export("layer_ids", layer=1).__dlpack__()
data = ctypes.c_void_p.from_address(get_pointer(capsule, b"dltensor")).value  # DLTensor.data, its first field
ctypes.memmove(data, routing.ctypes.data, routing.nbytes)
del capsule
"""


def run(script):
    env = dict(os.environ, MOECAP_LIBCUDA=STANDIN)
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(script)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_cuda_array_without_torchs_exchange_api_is_exported_for_the_calls_stream():
    # The array API: __dlpack__(stream=None) means the legacy default stream,
    # which is not where moecap enqueues (and which an engine's capture may
    # not touch); the producer is asked for the call's stream, 1 for legacy.
    out = run("""
        class Producer:
            '''A CUDA array of a library without torch's DLPack exchange API (CuPy, JAX).'''
            def __init__(self):
                self.asked = []
            def __dlpack_device__(self):
                return (2, 0)  # kDLCUDA
            def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
                self.asked.append(stream)
                return owner.export("layer_ids", layer=1).__dlpack__(max_version=max_version)

        producer = Producer()
        for s in (stream.value, 0):
            for layer in range(2):
                cap.capture(layer, producer, stream=s)
            cap.commit(np.arange(rows), stream=s)
            got = cap.read(np.arange(rows), stream=s)
            assert (got == routing[:, None, :]).all(), got
        assert producer.asked == [stream.value, stream.value, 1, 1], producer.asked
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_producer_refusing_the_stream_is_imported_as_before():
    # One that takes no stream= (or refuses it) is asked as nanobind asks.
    out = run("""
        class Producer:
            def __dlpack_device__(self):
                return (2, 0)
            def __dlpack__(self, max_version=None):
                return owner.export("layer_ids", layer=1).__dlpack__(max_version=max_version)

        cap.capture(0, Producer(), stream=stream.value)
        cap.capture(1, Producer(), stream=stream.value)
        cap.commit(np.arange(rows), stream=stream.value)
        assert (cap.read(np.arange(rows), stream=stream.value) == routing[:, None, :]).all()
        print("ok")
    """)
    assert out.strip() == "ok"


def test_ctrl_c_while_close_waits_for_a_stalled_synchronize_leaves_the_capturer_open():
    # synchronize waits on the GPU with the GIL released; close() waits for it.
    # The stand-in's host-wait hook stalls that wait until the test lets it go.
    out = run("""
        import signal, threading, time

        entered, release = threading.Event(), threading.Event()

        @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        def stall(_):
            if not release.is_set():
                entered.set()
                release.wait()

        cap.capture(0, owner.export("layer_ids", layer=1), stream=stream.value)
        cap.capture(1, owner.export("layer_ids", layer=1), stream=stream.value)
        cap.commit(np.arange(rows), stream=stream.value)
        lib.standin_set_wait_hook(stall, None)
        waiter = threading.Thread(target=cap.synchronize)
        waiter.start()
        assert entered.wait(30)
        main = threading.get_ident()
        threading.Timer(0.2, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
        deaf = threading.Timer(10, release.set)  # a close() deaf to the signal returns, and fails below
        deaf.start()
        try:
            cap.close()
            raise AssertionError("close() returned while synchronize was stalled")
        except KeyboardInterrupt:
            pass
        assert not cap.closed
        deaf.cancel()
        release.set()
        waiter.join()
        assert (cap.read(np.arange(rows), stream=stream.value) == routing[:, None, :]).all()
        cap.close()
        assert cap.closed
        lib.standin_set_wait_hook(None, None)
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_nonblocking_read_of_slots_still_being_committed_is_not_ready_in_pythons_terms():
    # The stand-in runs a stream only when the host waits: the commit stays in flight.
    out = run("""
        cap.capture(0, owner.export("layer_ids", layer=1), stream=stream.value)
        cap.capture(1, owner.export("layer_ids", layer=1), stream=stream.value)
        cap.commit(np.arange(rows), stream=stream.value)
        try:
            cap.read(np.arange(rows), nonblocking=True, stream=stream.value)
            raise AssertionError("a read of slots still being committed returned")
        except moecap.MoecapError as e:
            assert e.status == moecap.Status.NOT_READY, e
            assert "(nonblocking=True)" in str(e) and "MOECAP_READ" not in str(e), e
        assert (cap.read(np.arange(rows), stream=stream.value) == routing[:, None, :]).all()
        print("ok")
    """)
    assert out.strip() == "ok"
