"""Small shared helpers: atomic writes, seeding, retries."""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypeVar

T = TypeVar("T")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temp path next to `path` to write to: renamed over `path` when the block succeeds,
    removed when it raises, so `path` is never half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", **kwargs: Any) -> Iterator[IO[Any]]:
    """`open()` a temp file next to `path` for streaming writes; flushed, fsynced and renamed over
    `path` when the block succeeds (see `atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, mode, **kwargs) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, then rename over `path`."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:
        pass
    try:
        import torch

        torch.manual_seed(seed)
    except ImportError:
        pass


def retry(
    fn: Callable[[], T],
    *,
    attempts: int = 4,
    base_delay: float = 0.5,
    max_delay: float = 8.0,
    retry_on: tuple[type[BaseException], ...] = (Exception,),
    what: str = "call",
) -> T:
    """Call `fn` with exponential backoff; after the last attempt raise ServiceError naming `what`."""
    from sleuth.errors import ServiceError

    last: BaseException | None = None
    for attempt in range(attempts):
        try:
            return fn()
        except retry_on as err:  # noqa: PERF203 - retry loop
            last = err
            if attempt + 1 < attempts:
                time.sleep(min(max_delay, base_delay * (2**attempt)) * (0.5 + random.random() / 2))
    raise ServiceError(f"{what} failed after {attempts} attempts: {type(last).__name__}: {last}") from last
