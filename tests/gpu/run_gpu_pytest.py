# SPDX-License-Identifier: Apache-2.0
"""Runs the CUDA-only Python tests (marked `cuda`); exit 77 where torch sees no GPU."""
import sys

import pytest
import torch

if not torch.cuda.is_available():
    print("torch sees no CUDA device: GPU Python tests skipped")
    sys.exit(77)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-m", "cuda", *sys.argv[1:]]))
