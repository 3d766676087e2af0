# SPDX-License-Identifier: Apache-2.0
"""The package type-checks: its own modules under mypy, and a user's code
written to the docs against its annotations and the extension's stub
(py.typed ships both)."""
import pathlib
import subprocess
import sys
import textwrap

import pytest

import moecap

pytest.importorskip("mypy")

PACKAGE_PARENT = pathlib.Path(moecap.__file__).resolve().parents[1]


def mypy(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), *args],
                          cwd=PACKAGE_PARENT, capture_output=True, text=True, timeout=600)


def test_the_package_passes_mypy(tmp_path):
    done = mypy(tmp_path, "-p", "moecap")
    assert done.returncode == 0, done.stdout + done.stderr


def test_user_code_written_to_the_docs_passes_mypy_and_a_wrong_call_does_not(tmp_path):
    user = tmp_path / "engine.py"
    user.write_text(textwrap.dedent("""
        import numpy as np
        import torch
        import moecap

        cap = moecap.Capturer(num_layers=2, top_k=2, num_experts=8, host_slots=16, max_running_requests=4)
        cap.capture(0, torch.zeros(3, 2, dtype=torch.int32))
        cap.capture(np.int64(1), np.zeros((3, 2), np.int32))
        cap.commit(torch.arange(3))
        ids: np.ndarray = cap.read(np.arange(3))
        routed = moecap.RoutedExperts(ids, num_experts=8)
        payload: bytes = routed.to_bytes()
        plan: moecap.Plan = cap.plan
        rows: int = plan.device_rows
        view = cap.export(moecap.Buffer.HOST_IDS)
        host = torch.from_dlpack(view)
        cap.close()
    """))
    done = mypy(tmp_path, str(user))
    assert done.returncode == 0, done.stdout + done.stderr
    user.write_text("import moecap\nmoecap.Capturer(num_layers=2).capture('layer 0', None)\n")
    done = mypy(tmp_path, str(user))
    assert done.returncode == 1 and 'Argument 1 to "capture" of "Capturer"' in done.stdout, done.stdout
