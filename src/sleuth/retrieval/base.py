"""The retrieval protocol every component speaks: `retriever.search(queries, k)`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

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


def default_max_body_bytes(max_queries: int = DEFAULT_MAX_QUERIES, max_query_chars: int = DEFAULT_MAX_QUERY_CHARS) -> int:
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
