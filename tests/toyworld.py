"""Six hand-written passages and a word-overlap retriever over them, shared by the agent and eval tests."""

from __future__ import annotations

import re

from sleuth.retrieval.base import Hit

PASSAGES = [
    Hit("p1", "Varonia", "Varonia is a country. Its capital is Quellstad.", 0.0),
    Hit("p2", "Quellstad", "Quellstad is a river port on the Vell.", 0.0),
    Hit("p3", "Blue Harbor", "Blue Harbor is a 1998 film directed by Mara Ilves.", 0.0),
    Hit("p4", "Mara Ilves", "Mara Ilves was born in Tarsk in 1950.", 0.0),
    Hit("p5", "Tarsk", "Tarsk is a town on the coast of Varonia.", 0.0),
    Hit("p6", "Vell", "The Vell is a river that flows through Quellstad.", 0.0),
]


class ToyRetriever:
    """Word-overlap ranking over PASSAGES (ties by passage order); records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], int]] = []

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        self.calls.append((list(queries), k))
        out = []
        for q in queries:
            words = set(re.findall(r"\w+", q.lower()))
            scored = sorted(
                (-len(words & set(re.findall(r"\w+", (h.title + " " + h.text).lower()))), i, h)
                for i, h in enumerate(PASSAGES)
            )
            out.append([Hit(h.doc_id, h.title, h.text, float(-s)) for s, _, h in scored[:k]])
        return out

    def get_by_ids(self, doc_ids: list[str]) -> list[Hit | None]:
        """Passages by id (None for an unknown id), as an index's docstore returns them (score 0)."""
        by_id = {h.doc_id: Hit(h.doc_id, h.title, h.text, 0.0) for h in PASSAGES}
        return [by_id.get(d) for d in doc_ids]
