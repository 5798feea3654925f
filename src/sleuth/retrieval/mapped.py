"""Read-only memory maps whose pages a long-running server can let go of.

A server re-ranking from 16 GB of vectors or returning passages from a 15 GB docstore touches pages all
over both files, and every page fault maps its neighbours too (the kernel's fault-around), so the files'
mapped pages grow with traffic and count in each worker's resident memory, though the page cache holds
them anyway. `MappedFile.release` unmaps this process's pages (MADV_DONTNEED): the page cache keeps the
data, a later read costs a minor fault, and the server's resident memory stays what it allocated itself.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np


class MappedFile:
    """A non-empty file mapped read-only: `buffer` (or `array(dtype, shape)`), and `release()`."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as handle:
            self.buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)

    def array(self, dtype: str | np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        return np.frombuffer(self.buffer, dtype=dtype).reshape(shape)

    def release(self) -> None:
        """Drop this process's mapping of every page read so far; safe while other threads read the map (their
        next access faults the page back in from the page cache)."""
        if hasattr(mmap, "MADV_DONTNEED"):  # Linux and most Unixes; elsewhere the pages simply stay mapped
            self.buffer.madvise(mmap.MADV_DONTNEED)
