"""The predictions file of one method (OUT/<method>/predictions.jsonl): read it, append to it.

One JSON record per question, appended batch by batch and fsynced; evaluation, `sleuth compare`, the
report and bench/ read it back with `load_predictions`."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sleuth.appendlog import read_appended
from sleuth.errors import DataFormatError


def load_predictions(path: str | Path) -> dict[tuple[str, str], dict]:
    """Finished records by (dataset, id). A torn last line (a crash mid-write) is dropped with a warning
    naming the byte offset and cut from the file (`sleuth.appendlog`), so the next append starts on a
    clean line; a bad line elsewhere is an error."""
    path = Path(path)
    records: dict[tuple[str, str], dict] = {}
    for lineno, rec in enumerate(read_appended(path, repair=True).records, start=1):
        try:
            records[(str(rec["dataset"]), str(rec["id"]))] = rec
        except KeyError as err:
            raise DataFormatError(
                str(path),
                None,
                f"record {lineno} is not a prediction record (no {err}); delete it or rerun with --fresh",
            ) from err
    return records


def append_records(path: str | Path, records: Sequence[Mapping[str, Any]]) -> None:
    """Append whole lines and fsync, so a finished batch survives a crash."""
    if not records:
        return
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    with open(path, "a", encoding="utf-8") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
