"""A per-question score cache persisted as jsonl.

Used for values that are expensive and computed once per question: s3's naive-RAG
baseline accuracy (the Gain-Beyond-RAG baseline term, and the hard-example filter).
On disk: one `{"id": str, "score": float}` per line. A later line for the same id
overrides an earlier one, so appending to the file is a valid way to update it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path

from sleuth.errors import DataFormatError
from sleuth.utils import atomic_write_text


def _check_score(qid: str, score: object) -> float:
    # bool is an int subclass; a True score is almost certainly a bug upstream.
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise ValueError(f"score for {qid!r} must be a number, got {type(score).__name__} ({score!r})")
    value = float(score)
    if not math.isfinite(value):
        raise ValueError(f"score for {qid!r} must be finite, got {value}")
    return value


class ScoreCache:
    """Mapping question id -> float, loaded from `path` if it exists; `save()` writes it atomically."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._scores: dict[str, float] = {}
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        with open(self.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataFormatError(str(self.path), lineno, f"invalid JSON ({err.msg})") from err
                if not isinstance(rec, dict) or "id" not in rec or "score" not in rec:
                    raise DataFormatError(
                        str(self.path), lineno, 'expected an object {"id": ..., "score": <number>}'
                    )
                qid = rec["id"]
                if isinstance(qid, bool) or not isinstance(qid, (str, int)):
                    raise DataFormatError(str(self.path), lineno, "'id' must be a string or integer")
                try:
                    self._scores[str(qid)] = _check_score(str(qid), rec["score"])
                except ValueError as err:
                    raise DataFormatError(str(self.path), lineno, str(err)) from err

    def get(self, qid: str) -> float | None:
        return self._scores.get(str(qid))

    def __contains__(self, qid: object) -> bool:
        return str(qid) in self._scores

    def __len__(self) -> int:
        return len(self._scores)

    def __iter__(self) -> Iterator[str]:
        return iter(self._scores)

    def items(self) -> Iterator[tuple[str, float]]:
        return iter(self._scores.items())

    def set(self, qid: str, score: float) -> None:
        self._scores[str(qid)] = _check_score(str(qid), score)

    def update(self, scores: Mapping[str, float]) -> None:
        checked = {str(k): _check_score(str(k), v) for k, v in scores.items()}
        self._scores.update(checked)

    def missing(self, qids: list[str]) -> list[str]:
        """The ids among `qids` that have no cached score (in the given order)."""
        return [q for q in qids if str(q) not in self._scores]

    def save(self) -> None:
        """Rewrite the whole file atomically, ids in insertion order."""
        lines = [json.dumps({"id": k, "score": v}, ensure_ascii=False) for k, v in self._scores.items()]
        atomic_write_text(self.path, "".join(line + "\n" for line in lines))

    def __repr__(self) -> str:
        return f"ScoreCache({str(self.path)!r}, {len(self)} scores)"
