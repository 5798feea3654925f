"""The summary of an evaluation: per-dataset means with bootstrap intervals, the console and markdown
tables, summary.json / summary.md."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sleuth.eval.boundary import boundary_markdown
from sleuth.eval.compare import paired_markdown
from sleuth.eval.config import ANSWER_METRICS, COST_METRICS, METRIC_KEYS
from sleuth.eval.stats import DEFAULT_RESAMPLES, bootstrap_ci, bootstrap_cis
from sleuth.rewards.metrics import aggregate
from sleuth.utils import atomic_write_json, atomic_write_text


def summarise_records(records: Sequence[Mapping[str, Any]], seed: int = 0) -> dict[str, dict[str, Any]]:
    """Per dataset and "overall": the mean of every metric (None when never computed), "n", and next to
    each accuracy `<metric>_ci`: its 95% percentile bootstrap interval [lo, hi] (None when not computed)."""
    rows = [
        {
            "dataset": r["dataset"],
            **{k: r["metrics"].get(k) for k in ANSWER_METRICS},
            **{k: r.get(k) for k in COST_METRICS},
        }
        for r in records
    ]
    means = aggregate(rows, METRIC_KEYS, by="dataset")
    out: dict[str, dict[str, Any]] = {}
    for group, stats in means.items():
        members = rows if group == "overall" else [r for r in rows if str(r["dataset"]) == group]
        intervals = _intervals(members, seed)
        with_ci: dict[str, Any] = {}
        for key, value in stats.items():
            with_ci[key] = value
            if key in ANSWER_METRICS:
                with_ci[f"{key}_ci"] = intervals.get(key)
        out[group] = with_ci
    return out


def _intervals(rows: Sequence[Mapping[str, Any]], seed: int) -> dict[str, list[float]]:
    """The bootstrap interval of each accuracy the rows score: the ones every row scores share
    resamples; one scored on some rows only (a judge that skipped some) is resampled on those."""
    complete = {k: [float(r[k]) for r in rows] for k in ANSWER_METRICS if all(r[k] is not None for r in rows)}
    out = {k: list(ci) for k, ci in bootstrap_cis(complete, seed=seed).items()} if rows else {}
    for key in ANSWER_METRICS:
        values = [float(r[key]) for r in rows if r[key] is not None]
        if key not in out and values:
            out[key] = list(bootstrap_ci(values, seed=seed))
    return out


HEADLINE_METRIC = "genacc"  # the console shows this accuracy's interval; summary.md shows every one


COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("em", "EM", "pct"),
    ("cover_em", "CEM", "pct"),
    ("f1", "F1", "pct"),
    ("span_check", "Span", "pct"),
    ("genacc", "GenAcc", "pct"),
    ("judge", "Judge", "pct"),
    ("retrieval_count", "RC", "{:.2f}"),
    ("input_tokens", "In tok", "{:.0f}"),
    ("output_tokens", "Out tok", "{:.0f}"),
    ("latency_s", "s/q", "{:.2f}"),
)


def _fmt(value: Any, how: str) -> str:
    if value is None:
        return "-"
    if how == "pct":
        return f"{100 * float(value):.1f}"
    return how.format(float(value))


def _cell(stats: Mapping[str, Any], key: str, how: str, with_interval: bool) -> str:
    """A value; with `with_interval` and a stored interval, '45.0 [40.1, 49.9]'."""
    text = _fmt(stats.get(key), how)
    interval = stats.get(f"{key}_ci")
    if with_interval and isinstance(interval, (list, tuple)) and len(interval) == 2:
        text += f" [{_fmt(interval[0], how)}, {_fmt(interval[1], how)}]"
    return text


def summary_rows(
    summary: Mapping[str, Any], intervals: str = "headline"
) -> tuple[list[str], list[list[str]]]:
    """Header and rows (method x dataset; "overall" only when there are several datasets).

    `intervals`: "headline" puts the 95% interval beside the headline accuracy only (GenAcc; the
    console table stays narrow), "all" beside every accuracy (summary.md), "none" nowhere."""
    if intervals not in ("headline", "all", "none"):
        raise ValueError(f"intervals must be 'headline', 'all' or 'none', got {intervals!r}")
    shown = {
        key: how == "pct" and (intervals == "all" or (intervals == "headline" and key == HEADLINE_METRIC))
        for key, _, how in COLUMNS
    }
    header = ["method", "dataset", "n"] + [
        c[1] + (" %" if c[2] == "pct" else "") + (" [95% CI]" if shown[c[0]] else "") for c in COLUMNS
    ]
    rows = []
    for method, per_dataset in summary["methods"].items():
        names = sorted(d for d in per_dataset if d != "overall")
        if len(names) != 1:
            names.append("overall")
        for name in names:
            stats = per_dataset[name]
            rows.append(
                [method, name, str(stats["n"])]
                + [_cell(stats, key, how, shown[key]) for key, _, how in COLUMNS]
            )
    return header, rows


def summary_markdown(summary: Mapping[str, Any]) -> str:
    header, rows = summary_rows(summary, intervals="all")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    cfg = summary.get("config", {})
    notes = (
        f"\nAccuracy columns are percentages with a 95% percentile bootstrap interval over questions ({DEFAULT_RESAMPLES} "
        f"resamples). RC = retrievals per question; tokens per question; "
        f"s/q = batch wall time / batch size. Model: {cfg.get('model')}; generator: {cfg.get('generator')}; "
        f"judge: {cfg.get('judge')}. naive-rag, ircot's reader, oracle and direct-generator answer with the "
        f"generator; direct with the model.\n"
    )
    paired = summary.get("paired")
    boundary = summary.get("retrieval_boundary")
    return (
        "\n".join(lines)
        + "\n"
        + notes
        + ("\n" + paired_markdown(paired) if paired else "")
        + (boundary_markdown(boundary) if boundary else "")
    )


def write_summary(out_dir: Path, summary: Mapping[str, Any]) -> None:
    atomic_write_json(out_dir / "summary.json", summary)
    atomic_write_text(out_dir / "summary.md", summary_markdown(summary))


def previous_summary(out_dir: Path) -> dict[str, Any]:
    path = out_dir / "summary.json"
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
