"""Appending a batch's pieces to a file without joining them: `write_all`, over ``writev``."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["write_all"]

# The most pieces one writev takes (the system's limit, and never more than 1024).
_IOV_MAX = max(16, min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024))


def write_all(fd: int, parts: Sequence[bytes]) -> None:
    """Write `parts` in order, in as few `writev` calls as the system allows: no joined copy of
    the batch is made, and the GIL is released for the whole of each call."""
    pending: list[bytes | memoryview] = list(parts)
    i = 0
    while i < len(pending):
        written = os.writev(fd, pending[i : i + _IOV_MAX])
        while written and i < len(pending):
            size = len(pending[i])
            if written < size:  # a short write: on from where it stopped
                pending[i] = memoryview(pending[i])[written:]
                break
            written -= size
            i += 1
