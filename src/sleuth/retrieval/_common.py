"""Argument checks and hit assembly shared by the retrievers."""

from __future__ import annotations

import numpy as np

from sleuth.retrieval.base import Hit
from sleuth.retrieval.docstore import DocStore


def validate_queries(queries: list[str], k: int) -> None:
    """Shared argument checks for every retriever's `search`."""
    if isinstance(queries, str):
        raise TypeError("search() takes a list of query strings, not a single string; wrap it: [query]")
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if len(queries) == 0:
        raise ValueError("search() got an empty list of queries; pass at least one query string")
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise TypeError(f"query {i} is {type(q).__name__}, expected str")


def hits_from_rows(docstore: DocStore, rows: list[np.ndarray], scores: list[np.ndarray]) -> list[list[Hit]]:
    """Look up all queries' passages in one docstore gather and split them back per query."""
    flat = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    records = docstore.get(flat)
    out: list[list[Hit]] = []
    pos = 0
    for r, s in zip(rows, scores, strict=True):
        out.append(
            [
                Hit(doc_id=d, title=t, text=x, score=float(v))
                for (d, t, x), v in zip(records[pos : pos + len(r)], s, strict=True)
            ]
        )
        pos += len(r)
    return out
