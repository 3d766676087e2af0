import os
import sys

# The binding needs no build step: import it from the source tree.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "abi", "python"))


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (run by tests/gpu on the device machine)")
