"""Search results you can replay: `retriever.cache: DIR` (recipes) / `--retriever-cache DIR` (eval).

Any retriever (an index, a /retrieve server, an MCP tool, a web search API) is wrapped: a query's top-k
hits are looked up in DIR first and only a miss reaches the retriever, whose answer is recorded. A run
repeated over the same questions then sends nothing to the retriever (web APIs bill per call) and reads
the same documents in the same order, whatever the retriever returns today.

One JSON file per (retriever, query, k), named by the SHA-256 of the three and written atomically, so
concurrent writers (ranks of a training run, parallel evaluations) never leave a torn entry and a crash
loses at most the searches in flight. The retriever's identity (its index path, server URLs or tool
config) is part of the key: one DIR can hold several retrievers' results without mixing them.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any

from sleuth.errors import ConfigError
from sleuth.retrieval.base import Hit, Retriever
from sleuth.utils import atomic_write_json

CACHE_VERSION = 1


class CachingRetriever:
    """`inner` behind a record-and-replay cache in `directory`; `source` names the retriever."""

    def __init__(self, inner: Retriever, directory: str | Path, source: str):
        self.inner = inner
        self.directory = Path(directory).expanduser()
        if self.directory.exists() and not self.directory.is_dir():
            raise ConfigError(f"retriever.cache {str(self.directory)!r} is a file; pass a directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.source = source
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    def _path(self, query: str, k: int) -> Path:
        key = hashlib.sha256(json.dumps([CACHE_VERSION, self.source, query, k]).encode("utf-8")).hexdigest()
        return self.directory / key[:2] / f"{key}.json"

    def _read(self, path: Path) -> list[Hit] | None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"retriever cache entry {path} is unreadable ({err}); delete it to search again"
            ) from None
        return [Hit.from_dict(h) for h in data["hits"]]

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        """Top-k hits per query: recorded ones replayed, the rest searched (in one batch) and recorded."""
        paths = [self._path(q, k) for q in queries]
        found = [self._read(p) for p in paths]
        todo = [i for i, hits in enumerate(found) if hits is None]
        if todo:
            # a query repeated within the batch is searched once
            unique = list(dict.fromkeys(queries[i] for i in todo))
            searched = dict(zip(unique, self.inner.search(unique, k), strict=True))
            for i in todo:
                found[i] = searched[queries[i]]
            for query in unique:
                atomic_write_json(
                    self._path(query, k),
                    {
                        "source": self.source,
                        "query": query,
                        "k": k,
                        "hits": [h.to_dict() for h in searched[query]],
                    },
                )
        with self._lock:
            self.hits += len(queries) - len(todo)
            self.misses += len(todo)
        return [hits for hits in found if hits is not None]

    def cache_stats(self) -> dict[str, float]:
        """Replayed and searched queries so far (`retriever/cache_hits`, `retriever/cache_misses`)."""
        with self._lock:
            return {"retriever/cache_hits": float(self.hits), "retriever/cache_misses": float(self.misses)}

    def __getattr__(self, name: str) -> Any:
        # everything else (fetch by id, close, ...) is the retriever's own
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"CachingRetriever({self.inner!r}, {str(self.directory)!r})"


def cache_stats(retriever: Any) -> dict[str, float]:
    """A retriever's cache counts, or {} when it has no cache."""
    stats = getattr(type(retriever), "cache_stats", None)
    return stats(retriever) if stats is not None else {}
