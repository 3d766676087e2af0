"""Python binding of libmoecap.so through ctypes: no build step.

A ``Capturer`` takes NumPy arrays or PyTorch tensors (CPU or CUDA) and hands
them to the C ABI as borrowed DLTensors, with no copies. Buffers come back as
zero-copy DLPack views that ``numpy.from_dlpack`` and ``torch.from_dlpack``
consume. Errors raise ``MoecapError`` carrying the library's message.

The library is found through ``MOECAP_LIBRARY`` (a path), else as
``libmoecap.so`` on the loader's path.
"""
from ._binding import (  # noqa: F401
    BUFFERS,
    Capturer,
    DLPackView,
    Graph,
    MoecapError,
    Status,
    abi_version,
    library,
    plan,
)
