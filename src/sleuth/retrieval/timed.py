"""A retriever that keeps the seconds and queries of its searches, so a training step can report how much
of its rollout time went to retrieval (`time/retrieval`), whatever the retriever is (in process, a
/retrieve server, a tool)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from sleuth.retrieval.base import Hit, RetrievalContext, Retriever
from sleuth.retrieval.cache import cache_stats


class TimedRetriever:
    """`inner` with running totals: `seconds` spent in `search` and `queries` asked."""

    def __init__(self, inner: Retriever):
        self.inner = inner
        self.seconds = 0.0
        self.queries = 0
        self._lock = threading.Lock()

    def search(
        self, queries: list[str], k: int, contexts: Sequence[RetrievalContext] | None = None
    ) -> list[list[Hit]]:
        started = time.perf_counter()
        try:
            # contexts only for a retriever that asked for them (RetrievalContext): the others keep (queries, k)
            return (
                self.inner.search(queries, k)
                if contexts is None
                else self.inner.search(queries, k, contexts=contexts)
            )
        finally:
            elapsed = time.perf_counter() - started
            with self._lock:
                self.seconds += elapsed
                self.queries += len(queries)

    def totals(self) -> tuple[float, int]:
        """(seconds, queries) so far; a step reports the difference since the last step logged."""
        with self._lock:
            return self.seconds, self.queries

    def cache_stats(self) -> dict[str, float]:
        return cache_stats(self.inner)

    def __getattr__(self, name: str) -> Any:
        # everything else (fetch by id, close, ...) is the retriever's own
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"TimedRetriever({self.inner!r})"
