"""Hybrid retrieval by weighted reciprocal rank fusion (Cormack et al., 2009)."""

from __future__ import annotations

from collections.abc import Sequence

from sleuth.retrieval._common import validate_queries
from sleuth.retrieval.base import Hit, Retriever


def rrf_fuse(
    ranked_lists: Sequence[Sequence[Hit]], weights: Sequence[float], rrf_k: float, k: int
) -> list[Hit]:
    """Fuse ranked lists: score(d) = sum_i w_i / (rrf_k + rank_i(d)), rank 1-based; top `k` by that score.

    Passages are matched by `doc_id`; a passage's title/text come from the first list that has it.
    Ties keep the order in which passages were first seen (list 0 first, then list 1, ...).
    """
    fused: dict[str, float] = {}
    first_hit: dict[str, Hit] = {}
    for hits, w in zip(ranked_lists, weights, strict=True):
        for rank, hit in enumerate(hits, start=1):
            fused[hit.doc_id] = fused.get(hit.doc_id, 0.0) + w / (rrf_k + rank)
            first_hit.setdefault(hit.doc_id, hit)
    # sorted() is stable, so equal scores stay in first-seen order.
    order = sorted(fused, key=lambda d: -fused[d])[:k]
    return [Hit(doc_id=d, title=first_hit[d].title, text=first_hit[d].text, score=fused[d]) for d in order]


class HybridRetriever:
    """Runs every retriever on the batch and fuses their rankings with RRF.

    `depth` is how many hits each retriever contributes (default: max(k, 20)), since a passage
    ranked just below k by both retrievers can outscore one ranked high by only one.
    """

    def __init__(
        self,
        retrievers: Sequence[Retriever],
        weights: Sequence[float] | None = None,
        rrf_k: float = 60.0,
        depth: int | None = None,
    ):
        if not retrievers:
            raise ValueError("HybridRetriever needs at least one retriever")
        if weights is None:
            weights = [1.0] * len(retrievers)
        if len(weights) != len(retrievers):
            raise ValueError(
                f"got {len(weights)} weights for {len(retrievers)} retrievers; give one weight each"
            )
        if any(w < 0 for w in weights):
            raise ValueError(f"RRF weights must be non-negative, got {list(weights)}")
        if rrf_k < 0:
            raise ValueError(f"rrf_k must be >= 0, got {rrf_k}")
        if depth is not None and depth <= 0:
            raise ValueError(f"depth must be positive, got {depth}")
        self.retrievers = list(retrievers)
        self.weights = [float(w) for w in weights]
        self.rrf_k = float(rrf_k)
        self.depth = depth

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        validate_queries(queries, k)
        depth = max(k, self.depth if self.depth is not None else 20)
        per_retriever = [r.search(queries, depth) for r in self.retrievers]
        return [
            rrf_fuse([results[q] for results in per_retriever], self.weights, self.rrf_k, k)
            for q in range(len(queries))
        ]
