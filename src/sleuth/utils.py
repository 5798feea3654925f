"""Small shared helpers: atomic writes, seeding, retries, config files, request overlap."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import yaml
from pydantic import ValidationError

from sleuth.errors import ConfigError, OutputError, ServiceError

T = TypeVar("T")
_log = logging.getLogger("sleuth.retry")


def _process_umask() -> int:
    # os.umask can only be read by setting it; done once at import, before any thread starts writing
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _process_umask()


def give_normal_permissions(path: str | Path) -> None:
    """chmod `path` (recursively for a directory) to what a plain `open`/`mkdir` would have made:
    0666 / 0777 minus the umask (0644 / 0755 under the usual 022). `tempfile.mkstemp` and `mkdtemp`
    create 0600 / 0700, so without this an output written atomically is readable by its owner only."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        for child in path.iterdir():
            give_normal_permissions(child)
        path.chmod(0o777 & ~_UMASK)
    elif path.is_file() and not path.is_symlink():
        path.chmod(0o666 & ~_UMASK)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temp path next to `path` to write to: renamed over `path` when the block succeeds,
    removed when it raises, so `path` is never half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    give_normal_permissions(tmp)
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


# what a full disk, a quota, a read-only mount or a missing permission raise on a write
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})


def is_write_failure(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in WRITE_ERRNOS


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the filesystem holding `path` (its nearest existing ancestor), or None."""
    path = Path(path).absolute()
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def tree_bytes(path: str | Path) -> int:
    """Bytes of the files under `path` (0 if it is gone)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def link_or_copy(src: str | Path, dest: str | Path) -> None:
    """A hard link to `src` at `dest` (for files never written after they are made), else a copy (another file
    system, or links not allowed)."""
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def output_error(
    what: str, path: str | Path, err: BaseException, needed: int | None, then: str, *, at_least: bool = False
) -> OutputError:
    """One line: what could not be written where, why, the bytes needed (an estimate, or a lower bound
    with `at_least`) and free, and what to do."""
    reason = getattr(err, "strerror", None) or (str(err).splitlines() or [type(err).__name__])[0][:200]
    free = free_bytes(path)
    sizes = (
        f"needs {'at least' if at_least else 'about'} {needed:,} bytes"
        if needed is not None
        else "needs more space"
    )
    sizes += f", {free:,} free there" if free is not None else ""
    return OutputError(f"cannot write {what} at {path}: {reason} ({sizes}); {then}")


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


@dataclass(frozen=True)
class RetryPolicy:
    """How a failing service call is retried: exponential backoff from `initial_delay_s`, doubled
    per attempt up to `max_delay_s`, each delay scaled by a random factor in [1 - jitter, 1] so
    clients that failed together do not retry together; given up after `max_attempts` attempts or
    once the next wait would pass `budget_s` seconds since the first attempt."""

    max_attempts: int = 1000
    initial_delay_s: float = 0.5
    max_delay_s: float = 8.0
    budget_s: float = 120.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"retry max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_delay_s < 0 or self.max_delay_s < 0 or self.budget_s < 0:
            raise ValueError("retry delays and budget must be >= 0")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"retry jitter must be in [0, 1], got {self.jitter}")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (0-based)."""
        base = min(self.max_delay_s, self.initial_delay_s * (2 ** min(attempt, 60)))
        return base * (1.0 - self.jitter * random.random())


def retry(
    fn: Callable[[], T],
    *,
    attempts: int = 4,
    base_delay: float = 0.5,
    max_delay: float = 8.0,
    retry_on: tuple[type[BaseException], ...] = (Exception,),
    what: str = "call",
    policy: RetryPolicy | None = None,
) -> T:
    """Call `fn`, retrying `retry_on` errors under `policy` (default: `attempts` attempts backing off
    from `base_delay`, no time budget). Each retry and each recovery is logged; past the policy a
    ServiceError names `what`, the attempts, the time spent and the last error."""
    if policy is None:
        policy = RetryPolicy(
            max_attempts=attempts, initial_delay_s=base_delay, max_delay_s=max_delay, budget_s=math.inf
        )
    started = time.monotonic()
    last: BaseException | None = None
    attempt = 0
    while True:
        try:
            result = fn()
        except retry_on as err:  # noqa: PERF203 - retry loop
            last = err
            wait = policy.delay(attempt)
            attempt += 1
            spent = time.monotonic() - started
            if attempt >= policy.max_attempts or spent + wait > policy.budget_s:
                break
            _log.warning(
                "%s failed (attempt %d, %.1fs so far): %s: %s; retrying in %.1fs",
                what,
                attempt,
                spent,
                type(err).__name__,
                err,
                wait,
            )
            time.sleep(wait)
            continue
        if attempt:
            _log.warning(
                "%s recovered after %d failed attempts (%.1fs)", what, attempt, time.monotonic() - started
            )
        return result
    raise ServiceError(
        f"{what} failed after {attempt} attempts over {time.monotonic() - started:.1f}s: "
        f"{type(last).__name__}: {last}"
    ) from last


# How long overlapping requests count as evidence that clients run concurrently (the batching servers
# hold a lone request for company only then). Long enough to span a few request round trips of lock-step
# clients, short enough that a server whose concurrent clients went away stops holding a remaining lone
# client within a couple of seconds.
CONCURRENCY_MEMORY_S = 1.0


class RecentPeak:
    """The largest value recorded over roughly the last `memory_s` seconds (two rotating buckets:
    the answer covers between one and two windows), for "how many requests overlapped lately"."""

    def __init__(self, memory_s: float):
        self.memory_s = memory_s
        self._bucket_start = -math.inf
        self._current = 0
        self._previous = 0

    def record(self, value: int, now: float) -> None:
        self._rotate(now)
        if value > self._current:
            self._current = value

    def peak(self, now: float) -> int:
        self._rotate(now)
        return max(self._current, self._previous)

    def _rotate(self, now: float) -> None:
        elapsed = now - self._bucket_start
        if elapsed >= self.memory_s:
            self._previous = self._current if elapsed < 2 * self.memory_s else 0
            self._current = 0
            self._bucket_start = now


def read_yaml(path: Path) -> Any:
    """`yaml.safe_load` of a config file (data, never code); bad YAML is a ConfigError naming the file."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None


def validation_message(source: str, what: str, err: ValidationError,
                       hint: Callable[[dict[str, Any]], str | None] | None = None) -> str:  # fmt: skip
    """`source: invalid <what>`, then one line per wrong field: its dotted path and what is wrong (`hint`'s
    text for an error where it returns one: "did you mean ...")."""
    lines = [f"{source}: invalid {what}"]
    for e in err.errors():
        said = hint(e) if hint is not None else None
        lines.append(f"  {'.'.join(str(p) for p in e['loc']) or '(top level)'}: {said or e['msg']}")
    return "\n".join(lines)
