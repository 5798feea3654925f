"""Paired comparisons of evaluated methods: the difference on the same questions, with its interval.

Two prediction files (`OUT/<method>/predictions.jsonl` of `sleuth eval`) are matched by
(dataset, question id); the difference of a metric is the mean over the matched questions of
a_i - b_i, with a paired percentile bootstrap interval (sleuth.eval.stats). `sleuth eval` uses
this to compare every method with naive RAG; `sleuth compare A B` compares any two runs
(an SFT-only checkpoint and the same checkpoint after RL, evaluated into different directories).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sleuth.errors import ConfigError
from sleuth.eval.records import load_predictions
from sleuth.eval.stats import DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES, bootstrap_cis, paired_bootstrap

BASELINE = "naive-rag"
# The headline accuracies compared against the baseline (GenAcc = span_check without a judge).
PAIRED_METRICS = ("genacc", "span_check", "cover_em", "em", "f1")
CONSOLE_PAIRED_METRICS = ("genacc", "cover_em", "em", "f1")
PAIRED_LABELS = {"genacc": "GenAcc", "span_check": "Span", "cover_em": "CEM", "em": "EM", "f1": "F1"}

Key = tuple[str, str]


def _by_question(records: Iterable[Mapping[str, Any]], what: str) -> dict[Key, Mapping[str, Any]]:
    out: dict[Key, Mapping[str, Any]] = {}
    for i, rec in enumerate(records):
        if "id" not in rec or "dataset" not in rec:
            raise ConfigError(
                f"{what}: record {i + 1} has no 'id' or 'dataset'; is it a sleuth eval prediction file?"
            )
        out[(str(rec["dataset"]), str(rec["id"]))] = rec
    return out


def _metric(rec: Mapping[str, Any], metric: str) -> float | None:
    metrics = rec.get("metrics")
    value = metrics.get(metric) if isinstance(metrics, Mapping) else None
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def _matched(records_a: Iterable[Mapping[str, Any]], records_b: Iterable[Mapping[str, Any]],
             keys: Iterable[Key] | None) -> tuple[dict, dict, list[Key]]:  # fmt: skip
    """Both sides by question (only `keys`, when given) and the questions both have, in A's order."""
    a = _by_question(records_a, "A")
    b = _by_question(records_b, "B")
    if keys is not None:
        wanted = set(keys)
        a = {k: v for k, v in a.items() if k in wanted}
        b = {k: v for k, v in b.items() if k in wanted}
    return a, b, [k for k in a if k in b]


def _scored_pairs(a: dict, b: dict, shared: list[Key], metric: str) -> tuple[list[float], list[float]]:
    pairs = [(_metric(a[k], metric), _metric(b[k], metric)) for k in shared]
    kept = [(x, y) for x, y in pairs if x is not None and y is not None]
    if not kept:
        reason = "no question is in both" if not shared else f"no shared question has a {metric!r} score"
        raise ConfigError(f"cannot compare {metric}: {reason} ({len(a)} questions in A, {len(b)} in B)")
    return [x for x, _ in kept], [y for _, y in kept]


def _result(metric: str, xs: list[float], ys: list[float], ci: Sequence[float], a: dict, b: dict,
            shared: list[Key]) -> dict[str, Any]:  # fmt: skip
    return {
        "metric": metric,
        "n": len(xs),
        "mean_a": sum(xs) / len(xs),
        "mean_b": sum(ys) / len(ys),
        "diff": sum(x - y for x, y in zip(xs, ys, strict=True)) / len(xs),
        "ci": [float(ci[0]), float(ci[1])],
        "only_a": len(a) - len(shared),
        "only_b": len(b) - len(shared),
    }


def paired_difference(
    records_a: Iterable[Mapping[str, Any]],
    records_b: Iterable[Mapping[str, Any]],
    metric: str,
    *,
    keys: Iterable[Key] | None = None,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
) -> dict[str, Any]:
    """A minus B on the questions both answered (and, given `keys`, only those), with a bootstrap interval.

    Returns {metric, n, mean_a, mean_b, diff, ci: [lo, hi], only_a, only_b}: only_a/only_b count the
    questions one side has and the other lacks (left out). Questions where either side has no value of
    `metric` (no judge) are left out too; none left is an error."""
    a, b, shared = _matched(records_a, records_b, keys)
    xs, ys = _scored_pairs(a, b, shared, metric)
    _, lo, hi = paired_bootstrap(xs, ys, resamples, confidence, seed)
    return _result(metric, xs, ys, (lo, hi), a, b, shared)


def compare_records(
    records_a: Sequence[Mapping[str, Any]],
    records_b: Sequence[Mapping[str, Any]],
    metrics: Sequence[str] = PAIRED_METRICS,
    *,
    keys: Iterable[Key] | None = None,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """`paired_difference` of each metric both sides scored (one neither scored, e.g. judge, is skipped).
    Metrics scored on every shared question share their resamples (the intervals are the same)."""
    a, b, shared = _matched(records_a, records_b, keys)
    pairs = {}
    for metric in metrics:
        if any(_metric(r, metric) is not None for r in a.values()) and any(
            _metric(r, metric) is not None for r in b.values()
        ):
            pairs[metric] = _scored_pairs(a, b, shared, metric)
    complete = {
        m: [x - y for x, y in zip(*p, strict=True)] for m, p in pairs.items() if len(p[0]) == len(shared)
    }
    intervals = bootstrap_cis(complete, seed=seed)
    out = {}
    for metric, (xs, ys) in pairs.items():
        ci = intervals[metric] if metric in intervals else paired_bootstrap(xs, ys, seed=seed)[1:]
        out[metric] = _result(metric, xs, ys, ci, a, b, shared)
    return out


def compare_with_baseline(
    predictions: Mapping[str, Sequence[Mapping[str, Any]]],
    keys: Iterable[Key],
    seed: int = 0,
    baseline: str = BASELINE,
) -> dict[str, Any] | None:
    """Every method minus `baseline` on `keys` (the questions of this evaluation); None without a baseline.

    `predictions`: method -> its records. The result goes into summary.json as "paired"."""
    if baseline not in predictions:
        return None
    wanted = set(keys)
    baseline_keys = {k for k in _by_question(predictions[baseline], baseline) if k in wanted}
    methods = {}
    for method, records in predictions.items():
        shared = baseline_keys & set(_by_question(records, method))
        if method == baseline or not shared:  # a method of an earlier call on other questions
            continue
        compared = compare_records(records, predictions[baseline], keys=shared, seed=seed)
        if compared:
            methods[method] = compared
    return {
        "baseline": baseline,
        "confidence": DEFAULT_CONFIDENCE,
        "resamples": DEFAULT_RESAMPLES,
        "seed": seed,
        "methods": methods,
    }


def load_method_records(spec: str | Path) -> tuple[str, list[dict]]:
    """(label, records) of `OUT/<method>` or a predictions.jsonl file, for `sleuth compare`."""
    path = Path(spec)
    file = path / "predictions.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(
            f"{spec}: no predictions file; pass an eval method directory (OUT/<method>, holding "
            "predictions.jsonl) or the predictions.jsonl file itself"
        )
    records = list(load_predictions(file).values())
    if not records:
        raise ConfigError(f"{file} holds no predictions")
    label = f"{file.parent.parent.name}/{file.parent.name}"
    return label, records


def signed_points(value: float) -> str:
    """A difference of fractions as signed percentage points: 0.187 -> '+18.7'."""
    return f"{100 * value:+.1f}"


def format_difference(result: Mapping[str, Any]) -> str:
    """'+18.7 [+13.0, +24.0]' (percentage points)."""
    lo, hi = result["ci"]
    return f"{signed_points(result['diff'])} [{signed_points(lo)}, {signed_points(hi)}]"


def paired_rows(
    paired: Mapping[str, Any], metrics: Sequence[str] = PAIRED_METRICS
) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the comparison with the baseline: method, n, then one difference per metric."""
    shown = [m for m in metrics if any(m in per for per in paired["methods"].values())]
    header = ["method", "n"] + [f"{PAIRED_LABELS.get(m, m)} Δ" for m in shown]
    rows = []
    for method, per in paired["methods"].items():
        n = max((r["n"] for r in per.values()), default=0)
        rows.append([method, str(n)] + [format_difference(per[m]) if m in per else "-" for m in shown])
    return header, rows


def paired_markdown(paired: Mapping[str, Any]) -> str:
    header, rows = paired_rows(paired)
    pct = round(100 * paired["confidence"])
    lines = [
        f"Paired difference with {paired['baseline']} on the same questions, percentage points, "
        f"{pct}% paired bootstrap interval ({paired['resamples']} resamples):",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# The accuracy a one-line comparison quotes: s3's GenAcc (span check, or a judge when one was given), then
# cover-EM, then EM; the first one both sides were scored on.
HEADLINE_METRICS = ("genacc", "cover_em", "em")


def headline(summary: Mapping[str, Any], method: str) -> str | None:
    """One line: `method` vs the paired baseline, each accuracy with its 95% interval over questions and
    the paired difference with its interval; None when the summary has no such comparison."""
    paired = summary.get("paired") or {}
    per = (paired.get("methods") or {}).get(method)
    baseline = paired.get("baseline")
    if not per or not baseline:
        return None
    metric = next((m for m in HEADLINE_METRICS if m in per), None)
    if metric is None:
        return None
    result = per[metric]

    def accuracy(name: str, mean: float) -> str:
        ci = (summary.get("methods", {}).get(name, {}).get("overall") or {}).get(f"{metric}_ci")
        interval = f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else ""
        return f"{name} {100 * mean:.1f}%{interval}"

    pct = round(100 * float(paired.get("confidence", 0.95)))
    return (
        f"{PAIRED_LABELS.get(metric, metric)} on {result['n']} questions: "
        f"{accuracy(method, result['mean_a'])} vs {accuracy(baseline, result['mean_b'])}; "
        f"difference {format_difference(result)} points ({pct}% bootstrap intervals, the difference paired "
        "over the same questions)"
    )
