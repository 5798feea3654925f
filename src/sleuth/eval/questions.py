"""The questions an evaluation reads: data files, their datasets, per-dataset limits, gold-passage checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from sleuth.data.formats import QAExample, load_qa
from sleuth.errors import ConfigError, DataFormatError


def dataset_of(ex: QAExample, default: str) -> str:
    name = ex.metadata.get("dataset") if isinstance(ex.metadata, Mapping) else None
    return str(name) if name not in (None, "") else default


def load_eval_data(paths: Sequence[str | Path], limit: int | None = None) -> list[QAExample]:
    """Examples of each file; a file's examples without a dataset name get its stem. `limit`: the first
    `limit` questions of each data source (dataset) of each file, so a merged file (Search-R1's
    nq + triviaqa + ... test parquet) keeps every data source, not only its first."""
    if not paths:
        raise ConfigError("no data file given; pass --data FILE (.jsonl, .json or .parquet)")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    out: list[QAExample] = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ConfigError(f"data file {str(path)!r} does not exist; pass a .jsonl/.json/.parquet QA file")
        examples = load_qa(path)
        if not examples:
            raise DataFormatError(str(path), None, "holds no questions")
        taken: dict[str, int] = {}
        for ex in examples:
            meta = dict(ex.metadata or {})
            meta.setdefault("source_file", str(path))  # named in errors about a question
            meta.setdefault("dataset", path.stem)
            if meta["dataset"] in (None, ""):
                meta["dataset"] = path.stem
            source = str(meta["dataset"])
            if limit and taken.get(source, 0) >= limit:
                continue
            taken[source] = taken.get(source, 0) + 1
            out.append(replace(ex, metadata=meta))
    return out


def count_by_dataset(examples: Sequence[QAExample]) -> dict[str, int]:
    """Questions per data source, in first-seen order (what `--limit` kept of each)."""
    counts: dict[str, int] = {}
    for ex in examples:
        name = str((ex.metadata or {}).get("dataset", ""))
        counts[name] = counts.get(name, 0) + 1
    return counts


@dataclass
class EvalItem:
    key: tuple[str, str]
    dataset: str
    example: QAExample


def eval_items(examples: Sequence[QAExample], default_dataset: str) -> list[EvalItem]:
    items: list[EvalItem] = []
    seen: set[tuple[str, str]] = set()
    for ex in examples:
        dataset = dataset_of(ex, default_dataset)
        if dataset == "overall":
            raise ConfigError(
                f"question {ex.id!r}: dataset name 'overall' collides with the overall row; rename it"
            )
        key = (dataset, str(ex.id))
        if key in seen:
            raise ConfigError(
                f"question id {ex.id!r} appears twice in dataset {dataset!r}; ids must be unique"
            )
        seen.add(key)
        items.append(EvalItem(key, dataset, ex))
    return items


def check_oracle_examples(items: Sequence[EvalItem]) -> None:
    """The oracle needs every question's gold passages; say which file lacks them before anything runs."""
    for it in items:
        ids = it.example.metadata.get("supporting_ids") if isinstance(it.example.metadata, Mapping) else None
        if not isinstance(ids, list) or not ids:
            source = (
                it.example.metadata.get("source_file") if isinstance(it.example.metadata, Mapping) else None
            )
            where = f"data file {source}" if source else f"dataset {it.dataset!r}"
            raise ConfigError(
                f"method oracle needs each question's gold passages (metadata.supporting_ids, as a synthetic "
                f"world from `sleuth synth` writes them), but question {it.example.id!r} of {where} has none; "
                "drop oracle from --method for this data"
            )
