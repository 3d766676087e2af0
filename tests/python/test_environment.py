# SPDX-License-Identifier: Apache-2.0
"""The suite runs where it means something: torch >= 2.4 (the torch.compile
test would otherwise skip) and NumPy 2 (versioned DLPack capsules)."""
import numpy as np
import torch


def version(text):
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2])


def test_interpreter_has_what_the_python_tests_need():
    assert version(torch.__version__) >= (2, 4), f"torch {torch.__version__}: run scripts/venv.sh's venv"
    assert version(np.__version__) >= (2, 0), f"numpy {np.__version__}: run scripts/venv.sh's venv"
    import jax  # noqa: F401  (the JAX consumer test)
