# SPDX-License-Identifier: Apache-2.0
"""The exception every failed moecap call raises, and the statuses it carries.

``Status`` is moecap_status as the extension exports it from abi/moecap.h (an
IntEnum), so a status the library adds is known here without an edit.
"""
from __future__ import annotations

from typing import Union

from ._moecap import Status

__all__ = ["MoecapError", "Status"]


class MoecapError(RuntimeError):
    """A moecap call failed: ``status`` is the Status, the message says which argument and what limit."""

    __module__ = "moecap"

    status: Union[Status, int]

    def __init__(self, status: int, message: str) -> None:
        try:
            self.status = Status(status)
            name = self.status.name
        except ValueError:  # a status from a newer library
            self.status = status
            name = f"status {status}"
        self._message = message
        super().__init__(f"{name}: {message}")

    def __reduce__(self) -> tuple:
        # Rebuilt from (status, message), not from the formatted text in args,
        # so pickling (a worker process's error reaching its pool) and copy work.
        return (type(self), (int(self.status), self._message), self.__dict__.copy())
