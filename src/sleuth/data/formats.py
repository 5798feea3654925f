"""Dataset and corpus formats: FlashRAG jsonl, Search-R1 parquet, corpus jsonl.

Readers raise `DataFormatError(path, line, message)` for a bad record, so a user
can open the file at the line that is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class QAExample:
    """One question (FlashRAG fields)."""

    id: str
    question: str
    golden_answers: list[str]
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "question": self.question,
            "golden_answers": list(self.golden_answers),
            "metadata": self.metadata,
        }


@dataclass
class Passage:
    """One corpus passage; `contents` on disk is `"Title"\\ntext`."""

    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        return f'"{self.title}"\n{self.text}'


def split_contents(contents: str) -> tuple[str, str]:
    """Split a corpus `contents` field into (title, text); the title line's quotes are stripped."""
    title, sep, text = contents.partition("\n")
    title = title.strip()
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1]
    if not sep:
        return title, ""
    return title, text.strip()
