"""The retrieval protocol every component speaks: `retriever.search(queries, k)`."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol, runtime_checkable

# Limits of the `/retrieve` API as sleuth serves it (sleuth.retrieval.server, `sleuth serve-retriever`);
# here so the CLI can show them without importing the web stack.
DEFAULT_MAX_QUERIES = 4096  # per request; Search-R1's default rollout batch sends up to 2,560 queries
DEFAULT_MAX_QUERY_CHARS = 2000  # longer queries are truncated to this many characters
DEFAULT_SEARCH_CHUNK = 512  # queries per retriever.search call (Search-R1: retrieval_batch_size 512)
# Request bodies: each query may take max_query_chars bytes (1 a character: ASCII JSON; longer
# non-ASCII queries are cut to max_query_chars anyway) plus its quotes and comma, and the object
# around the list 64 KiB. The budget is the body bytes held at once over all concurrent requests.
QUERY_JSON_OVERHEAD_BYTES = 4
REQUEST_JSON_OVERHEAD_BYTES = 64 * 1024
BODY_BUDGET_REQUESTS = 4  # default budget: this many bodies at the per-request limit
BODY_BUDGET_WAIT_S = 1.0  # a request waits this long for budget before its 503


def default_max_body_bytes(
    max_queries: int = DEFAULT_MAX_QUERIES, max_query_chars: int = DEFAULT_MAX_QUERY_CHARS
) -> int:
    """The per-request body limit that fits `max_queries` ASCII queries of `max_query_chars`
    (4096 x (2000 + 4) + 65536 = 8,273,920 bytes with the defaults)."""
    return max_queries * (max_query_chars + QUERY_JSON_OVERHEAD_BYTES) + REQUEST_JSON_OVERHEAD_BYTES


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


@dataclass(frozen=True)
class RetrievalContext:
    """Who asks a query, for a retriever that declares `wants_context = True` (a simulated search engine
    writes documents for the question and its answer; ZeroSearch's noise grows with the training step).

    question_id, question, golden_answers: the example being rolled out; turn: the action round (0 = the
    first generation, -1 = the loop's initial searches before it); step: the trainer's step (None outside
    training, e.g. evaluation or serving)."""

    question_id: str
    question: str
    golden_answers: tuple[str, ...]
    turn: int
    step: int | None = None


@runtime_checkable
class ContextRetriever(Protocol):
    """A retriever that wants to know who asks: `wants_context = True` and `search(queries, k, contexts)`
    with one `RetrievalContext` per query. The rollout engine then sends each trajectory's queries with its
    context (identical queries of different questions are not merged)."""

    wants_context: bool

    def search(
        self, queries: list[str], k: int, contexts: Sequence[RetrievalContext] | None = None
    ) -> list[list[Hit]]: ...


def wants_context(retriever: Any) -> bool:
    """True for a retriever that declares `wants_context = True` (wrappers forward the attribute)."""
    return bool(getattr(retriever, "wants_context", False))


class StepStamped:
    """A context-wanting retriever told the trainer's step (`set_step`, called from `Reward.set_step` by
    the trainer's setup): every context without a step gets the current one. The engine does not know the
    step; the trainer tells the reward it before each batch, and this is how the retriever hears of it."""

    wants_context = True

    def __init__(self, inner: Any):
        if not wants_context(inner):
            raise TypeError(f"{inner!r} does not declare wants_context = True")
        self.inner = inner
        self.step: int | None = None
        self._lock = threading.Lock()

    def set_step(self, step: int) -> None:
        with self._lock:
            self.step = step

    def search(
        self, queries: list[str], k: int, contexts: Sequence[RetrievalContext] | None = None
    ) -> list[list[Hit]]:
        with self._lock:
            step = self.step
        if contexts is not None:
            contexts = [c if c.step is not None else replace(c, step=step) for c in contexts]
        return self.inner.search(queries, k, contexts=contexts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"StepStamped({self.inner!r})"


def passages_to_string(hits: list[Hit], numbered: bool = True) -> str:
    """Search-R1's `_passages2string` (FlashRAG's `format_reference`), character for character.

    Each passage's stored `contents` is split at its first newline: the first line is the title *as
    stored* (quotes kept: `"Title"`), the rest is the text. Each passage becomes
    `Doc {i}(Title: {title line}) {text}` plus a newline, i from 1. `numbered=False` gives R-Search's
    variant, `(Title: {title line}) {text}` per line.
    """
    lines = []
    for i, hit in enumerate(hits, start=1):
        title_line, _, text = hit.contents.partition("\n")
        prefix = f"Doc {i}" if numbered else ""
        lines.append(f"{prefix}(Title: {title_line}) {text}\n")
    return "".join(lines)


def format_docs(hits: list[Hit]) -> str:
    """The Search-R1 document block shown to a model: `passages_to_string(hits).strip()`, which is
    what Search-R1 puts between `<information>` and `</information>`."""
    return passages_to_string(hits).strip()


def s3_generator_context(hits: list[Hit]) -> str:
    """s3's frozen-generator context (`rag_2.py`): `Doc {i} (Title: {title})\\n{text}\\n\\n` per document,
    the title without its stored quotes (s3 parses them off the `<information>` text)."""
    return "".join(f"Doc {i} (Title: {h.title})\n{h.text}\n\n" for i, h in enumerate(hits, start=1))
