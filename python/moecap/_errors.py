"""Status codes and the exception every failed moecap call raises."""
import enum


class Status(enum.IntEnum):
    """moecap_status (abi/moecap.h)."""

    __module__ = "moecap"

    OK = 0
    INVALID_ARGUMENT = 1
    OUT_OF_RANGE = 2
    CAPACITY = 3
    NO_DEVICE = 4
    DRIVER = 5
    OUT_OF_MEMORY = 6
    ABI_MISMATCH = 7
    NOT_READY = 8
    CAPTURE_ILLEGAL = 9
    INTERNAL = 10
    ROWS_SKIPPED = 11
    STUB_DRIVER = 12
    DRIVER_TOO_OLD = 13
    CORRUPTION = 14
    NO_ROUTING = 15


class MoecapError(RuntimeError):
    """A moecap call failed: ``status`` is the Status, the message says which argument and what limit."""

    __module__ = "moecap"

    def __init__(self, status: int, message: str):
        try:
            self.status = Status(status)
            name = self.status.name
        except ValueError:  # a status from a newer library
            self.status = status
            name = f"status {status}"
        super().__init__(f"{name}: {message}")
