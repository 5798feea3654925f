"""Stop-string helpers shared by the backends (no torch import)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from sleuth.errors import ConfigError


def stop_window(stops: Sequence[str]) -> int:
    """How many trailing tokens to decode so any stop string fits in the decoded tail.

    Every byte-level token carries at least one byte, so a stop string of n bytes spans at most n
    tokens; 2 extra tokens absorb decoders that drop a leading space or print a partial character
    at the start of the window.
    """
    return max((len(s.encode("utf-8")) for s in stops), default=0) + 2


# SLEUTH_STOP_FILTER=0 searches after every token again (the comparison row of bench/gpu_paper.sh's r_short_every)
FILTER = os.environ.get("SLEUTH_STOP_FILTER", "1") != "0"


class StopEndTokens:
    """Which token ids can complete a stop string, per tokenizer: checking stops only after those tokens finds
    the same stops as checking after every token, at a fraction of the decoding (the decode loop's host work).

    A stop string not in the text decoded up to token n-1 but in the text up to token n ends inside token n's
    text, so token n's text holds the stop's last character. That character is looked for in each token's
    text decoded alone: for byte-level BPE an ASCII byte decodes to itself whatever surrounds it, and a token
    whose bytes are not whole characters decodes to U+FFFD, which counts as "may end a stop" (as does an id the
    tokenizer does not know). Stops ending in whitespace are always checked: decoders add and strip spaces
    around a token decoded alone."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._texts: list[str] | None = None
        self._by_ends: dict[frozenset[str], list[bool]] = {}

    def _token_texts(self) -> list[str]:
        if self._texts is None:
            ids = [[i] for i in range(len(self._tokenizer))]
            backend = getattr(
                self._tokenizer, "backend_tokenizer", None
            )  # one Rust call for the whole vocabulary
            self._texts = (
                backend.decode_batch(ids, skip_special_tokens=False)
                if backend is not None
                else self._tokenizer.batch_decode(ids, skip_special_tokens=False)
            )
        return self._texts

    def for_stops(self, stops: Sequence[str]) -> list[bool] | None:
        """Per token id (up to the tokenizer's size): whether it may complete one of `stops`; None: check
        after every token."""
        ends = frozenset(s[-1] for s in stops if s)
        if not ends or any(c.isspace() for c in ends) or not FILTER:
            return None
        if ends not in self._by_ends:
            self._by_ends[ends] = [("\ufffd" in t) or any(c in t for c in ends) for t in self._token_texts()]
        return self._by_ends[ends]

    def checks(self, stops: Sequence[str], tokens: Sequence[int]) -> list[bool]:
        """Per token of `tokens`: whether the text ending with it must be searched for `stops`."""
        may_end = self.for_stops(stops)
        if may_end is None:
            return [True] * len(tokens)
        size = len(may_end)
        return [not 0 <= t < size or may_end[t] for t in tokens]


def stop_tails(
    generated: Sequence[int], new: Sequence[int], window: int, checks: Sequence[bool]
) -> list[list[int]]:
    """For each token of `new` whose check is on: the last `window` tokens of generated + new ending with it."""
    if not any(checks):
        return []
    seq = list(generated[-window:]) + list(
        new
    )  # a tail reaches back at most `window` tokens: copy only those
    base = len(seq) - len(new)
    return [seq[max(0, base + k + 1 - window) : base + k + 1] for k, c in enumerate(checks) if c]


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
