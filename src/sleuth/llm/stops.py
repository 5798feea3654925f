"""Stop-string helpers shared by the backends (no torch import)."""

from __future__ import annotations

from collections.abc import Sequence

from sleuth.errors import ConfigError


def stop_window(stops: Sequence[str]) -> int:
    """How many trailing tokens to decode so any stop string fits in the decoded tail.

    Every byte-level token carries at least one byte, so a stop string of n bytes spans at most n
    tokens; 2 extra tokens absorb decoders that drop a leading space or print a partial character
    at the start of the window.
    """
    return max((len(s.encode("utf-8")) for s in stops), default=0) + 2


def first_stop_in(text: str, stops: Sequence[str]) -> str | None:
    """The stop string that occurs earliest-ending in `text` (ties: the longer one), or None."""
    best: tuple[int, int] | None = None
    found: str | None = None
    for stop in stops:
        at = text.find(stop)
        if at < 0:
            continue
        key = (at + len(stop), -len(stop))
        if best is None or key < best:
            best, found = key, stop
    return found


def normalise_stops(stop: list[str] | list[list[str]] | None, batch_size: int) -> list[list[str]]:
    """One stop list per prompt, from either a shared list or a per-prompt list of lists."""
    if not stop:
        return [[] for _ in range(batch_size)]
    if all(isinstance(s, str) for s in stop):
        shared = [s for s in stop if s]
        return [list(shared) for _ in range(batch_size)]
    if all(isinstance(s, (list, tuple)) for s in stop):
        if len(stop) != batch_size:
            raise ConfigError(
                f"per-prompt stop lists: got {len(stop)} lists for {batch_size} prompts; pass one list per "
                "prompt or a single list of strings shared by all prompts"
            )
        return [[s for s in per if s] for per in stop]
    raise ConfigError("stop must be a list of strings or a list of lists of strings, not a mix")
