"""The retrieval protocol every component speaks: `retriever.search(queries, k)`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Hit:
    """One retrieved passage."""

    doc_id: str
    title: str
    text: str
    score: float

    @property
    def contents(self) -> str:
        """The corpus `contents` field: quoted title on the first line, then the text."""
        return f'"{self.title}"\n{self.text}'

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Hit:
        return cls(doc_id=str(d["doc_id"]), title=d["title"], text=d["text"], score=float(d["score"]))


@runtime_checkable
class Retriever(Protocol):
    """Batched retrieval: one list of hits per query, best first."""

    def search(self, queries: list[str], k: int) -> list[list[Hit]]: ...


def format_docs(hits: list[Hit], start: int = 1) -> str:
    """Search-R1 document format shown to a model: `Doc {i}(Title: {title}) {text}`, one per line."""
    return "\n".join(f"Doc {i}(Title: {h.title}) {h.text}" for i, h in enumerate(hits, start=start))
