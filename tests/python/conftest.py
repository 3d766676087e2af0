# SPDX-License-Identifier: Apache-2.0
def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (run by tests/gpu on the device machine)")
    config.addinivalue_line("markers", "slow: builds a wheel into a fresh venv")
