# SPDX-License-Identifier: Apache-2.0
"""examples/python/rl_replay.py runs as a test: the replayed forward
reproduces the rollout's outputs and holds its routing after a policy update
(the example asserts both and fails otherwise)."""
import os
import runpy

import pytest

pytest.importorskip("torch", minversion="2.4", reason="the example needs torch >= 2.4 (the test venv)")
pytest.importorskip("transformers", reason="the example needs transformers (the test venv)")
pytest.importorskip("megatron.core", reason="the example replays through megatron-core's RouterReplay (the test venv)")

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python", "rl_replay.py")


def test_rl_replay_example(capsys):
    runpy.run_path(EXAMPLE, run_name="__main__")
    out = capsys.readouterr().out
    assert "replayed outputs equal the recorded ones" in out
    assert ", 0 with replay" in out
