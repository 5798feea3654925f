"""Dataset and corpus formats: FlashRAG jsonl, Search-R1 parquet, corpus jsonl.

Readers raise `DataFormatError(path, line, message)` for a bad record, so a user
can open the file at the line that is wrong.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
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


def iter_corpus(path: str | Path) -> Iterator[Passage]:
    """Stream a corpus jsonl (`{"id", "contents"}` per line) without loading it into memory.

    Records may also carry `title` and `text` instead of `contents` (some corpora do).
    """
    from sleuth.errors import DataFormatError

    path = Path(path)
    if not path.exists():
        raise DataFormatError(str(path), None, "corpus file does not exist")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataFormatError(str(path), lineno, f"invalid JSON ({err.msg}); each line must be one JSON object") from err
            if not isinstance(rec, dict):
                raise DataFormatError(str(path), lineno, "expected a JSON object with 'id' and 'contents'")
            if "id" not in rec:
                raise DataFormatError(str(path), lineno, "missing field 'id'")
            if "contents" in rec:
                if not isinstance(rec["contents"], str):
                    raise DataFormatError(str(path), lineno, "'contents' must be a string")
                title, text = split_contents(rec["contents"])
            elif "text" in rec:
                title, text = str(rec.get("title", "")), str(rec["text"])
            else:
                raise DataFormatError(str(path), lineno, "missing field 'contents' (or 'title'/'text')")
            yield Passage(id=str(rec["id"]), title=title, text=text)


def corpus_fingerprint(path: str | Path, chunk_size: int = 1 << 22) -> str:
    """sha256 of the corpus file's bytes, streamed; identifies the corpus an index was built from."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            h.update(chunk)
    return "sha256:" + h.hexdigest()
