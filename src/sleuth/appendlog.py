"""The one reader of append-only jsonl files (metrics.jsonl, validation.jsonl, predictions.jsonl).

These files grow by one appended line at a time while a run is live, so a kill or a full disk during an
append leaves a torn last line. Every reader goes through `read_appended`: a torn *last* line is dropped
with a warning naming the file and the byte offset where it starts (and, with `repair=True`, cut from the
file so the next append starts on a clean line); a bad line anywhere else is real damage and raises a
DataFormatError naming file:line.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sleuth.errors import DataFormatError

_log = logging.getLogger("sleuth.appendlog")


@dataclass
class Appended:
    """The records of an append-only jsonl file and the warnings reading it gave."""

    records: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    torn_at: int | None = None  # byte offset of a dropped torn last line


def _parse(raw: bytes) -> dict[str, Any]:
    """One line -> a JSON object; ValueError says why not."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"not valid UTF-8 ({err.reason} at byte {err.start} of the line)") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    return record


def read_appended(path: str | Path, *, repair: bool = False) -> Appended:
    """Every record of `path` (none if it does not exist). A torn last line is dropped with a warning
    (logged and returned); `repair=True` also truncates the file to its last complete line."""
    path = Path(path)
    out = Appended()
    if not path.exists():
        return out
    data = path.read_bytes()
    offset = 0
    lines: list[tuple[int, int, bytes]] = []  # (line number, byte offset, bytes)
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if raw.strip():
            lines.append((lineno, offset, raw))
        offset += len(raw) + 1
    for i, (lineno, start, raw) in enumerate(lines):
        try:
            out.records.append(_parse(raw))
        except ValueError as err:
            if i < len(lines) - 1:
                raise DataFormatError(str(path), lineno, f"{err}; fix or delete the line") from None
            out.torn_at = start
            message = (
                f"{path}: ignored an incomplete last line at byte {start} ({len(raw)} bytes; {err}), "
                "what a kill or a full disk during an append leaves"
            )
            out.warnings.append(message)
            _log.warning(message)
    if repair:
        _repair(path, data, out.torn_at)
    return out


def _repair(path: Path, data: bytes, torn_at: int | None) -> None:
    """Cut a torn last line and end the file with a newline, so the next append starts a clean line."""
    end = len(data) if torn_at is None else torn_at
    if end == len(data) and (not data or data.endswith(b"\n")):
        return
    with open(path, "r+b") as f:
        f.truncate(end)
        if end and data[end - 1 : end] != b"\n":
            f.seek(end)
            f.write(b"\n")
