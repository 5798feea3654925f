"""The evaluation section: summary tables with intervals, the paired table, the comparison across
evaluations and the accuracy vs retrieval scatter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sleuth.errors import DataFormatError
from sleuth.eval.compare import paired_rows
from sleuth.eval.report.figures import COLORS, new_figure, png_data_uri
from sleuth.eval.report.format import (
    LOWER_IS_BETTER,
    best_indices,
    column_decimals,
    format_value,
    is_number,
    order_metrics,
)
from sleuth.eval.report.run_data import EvalRun

# The accuracy used on the accuracy-vs-retrieval scatter: the first one a summary has.
SCATTER_ACCURACY_PREFERENCE = ("em", "genacc", "cover_em", "f1", "span_check")


def _cell(v: Any, best: bool, decimals: int, interval: Any = None) -> dict:
    """A table cell; `interval` ([lo, hi] from summary.json) is shown beside the value, same decimals."""
    ci = ""
    if isinstance(interval, (list, tuple)) and len(interval) == 2 and all(is_number(x) for x in interval):
        ci = f"[{interval[0]:.{decimals}f}, {interval[1]:.{decimals}f}]"
    return {"text": f"{v:.{decimals}f}" if is_number(v) else format_value(v), "best": best, "ci": ci}


def _interval_ends(rows: list[tuple[str, dict[str, Any]]], metric: str) -> list[Any]:
    """The interval ends of a column: a 1.0 accuracy with a [0.85, 1.0] interval needs decimals too."""
    ends = [vals.get(f"{metric}_ci") for _, vals in rows]
    return [x for ci in ends if isinstance(ci, (list, tuple)) for x in ci]


def build_table(rows: list[tuple[str, dict[str, Any]]], caption: str) -> dict:
    """rows: (row label, {metric: value, "n": count}). Returns what the template renders."""
    metrics = order_metrics(k for _, vals in rows for k in vals)
    best = {m: best_indices([vals.get(m) for _, vals in rows], m in LOWER_IS_BETTER) for m in metrics}
    decimals = {
        m: column_decimals([vals.get(m) for _, vals in rows] + _interval_ends(rows, m)) for m in metrics
    }
    return {
        "caption": caption,
        "columns": [{"name": m, "lower": m in LOWER_IS_BETTER} for m in metrics],
        "rows": [
            {
                "label": label,
                "n": vals.get("n"),
                "cells": [
                    _cell(vals.get(m), i in best[m], decimals[m], vals.get(f"{m}_ci")) for m in metrics
                ],
            }
            for i, (label, vals) in enumerate(rows)
        ],
    }


def eval_tables(run: EvalRun) -> list[dict]:
    """One table per dataset ("overall" first), rows are methods."""
    datasets = sorted({d for per in run.methods.values() for d in per if isinstance(per[d], dict)})
    datasets = (["overall"] if "overall" in datasets else []) + [d for d in datasets if d != "overall"]
    tables = []
    for ds in datasets:
        rows = [(m, per[ds]) for m, per in run.methods.items() if isinstance(per.get(ds), dict)]
        tables.append(build_table(rows, ds))
    return tables


def paired_table(run: EvalRun) -> dict | None:
    """Each method minus the baseline on the same questions (summary.json "paired"), in points."""
    paired = run.paired
    if not paired or not isinstance(paired.get("methods"), dict) or not paired["methods"]:
        return None
    try:
        header, rows = paired_rows(paired)
    except (KeyError, TypeError, ValueError) as err:
        raise DataFormatError(
            str(run.path / "summary.json"), None, f"unreadable 'paired' section ({err!r})"
        ) from err
    pct = round(100 * float(paired.get("confidence", 0.95)))
    caption = (f"difference with {paired.get('baseline')} on the same questions, percentage points "
               f"[{pct}% paired bootstrap interval]")  # fmt: skip
    return {"caption": caption, "header": header, "rows": rows}


def comparison_table(evals: list[EvalRun]) -> dict | None:
    """Overall scores of every method of every eval dir in one table (before vs after...)."""
    if len(evals) < 2:
        return None
    rows = [
        (f"{e.label} · {m}", per["overall"])
        for e in evals
        for m, per in e.methods.items()
        if isinstance(per.get("overall"), dict)
    ]
    return build_table(rows, "overall, all eval directories") if rows else None


def _mean_retrieval(records: list[dict]) -> float | None:
    vals = [r["retrieval_count"] for r in records if is_number(r.get("retrieval_count"))]
    return sum(vals) / len(vals) if vals else None


def scatter_points(evals: list[EvalRun]) -> tuple[str | None, list[dict]]:
    """(accuracy metric name, points {eval, method, x retrieval count, y accuracy})."""
    overall_keys = {k for e in evals for per in e.methods.values() for k in (per.get("overall") or {})}
    metric = next((m for m in SCATTER_ACCURACY_PREFERENCE if m in overall_keys), None)
    if metric is None:
        return None, []
    points = []
    for e in evals:
        for method, per in e.methods.items():
            overall = per.get("overall") or {}
            y = overall.get(metric)
            x = overall.get("retrieval_count")
            if not is_number(x):
                x = _mean_retrieval(e.predictions.get(method, []))
            if is_number(x) and is_number(y):
                points.append({"eval": e.label, "method": method, "x": float(x), "y": float(y)})
    return metric, points


def dodge(xs: Sequence[float], ys: Sequence[float], step: float) -> list[float]:
    """x positions with coinciding points spread sideways, centred on the true x (display only:
    ten methods with the same score and retrieval count must not hide behind one marker)."""
    groups: dict[tuple[float, float], list[int]] = {}
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        groups.setdefault((round(x, 6), round(y, 6)), []).append(i)
    out = list(xs)
    for members in groups.values():
        for rank, i in enumerate(members):
            out[i] = xs[i] + (rank - (len(members) - 1) / 2) * step
    return out


def plot_scatter(metric: str, points: list[dict]) -> str:
    from matplotlib.lines import Line2D  # deferred: matplotlib is heavy; only reports with plots need it

    fig = new_figure(7.5, 4.5)
    ax = fig.add_subplot()
    methods = list(dict.fromkeys(p["method"] for p in points))
    evals = list(dict.fromkeys(p["eval"] for p in points))  # in eval-directory order (oldest first)
    markers = "osD^vP*X"
    color = {m: COLORS[i % len(COLORS)] for i, m in enumerate(methods)}
    marker = {e: markers[i % len(markers)] for i, e in enumerate(evals)}
    xs = [p["x"] for p in points]
    ys = [p["y"] for p in points]
    shown_x = dodge(xs, ys, step=0.03 * max(1.0, max(xs) - min(xs)))
    for p, x in zip(points, shown_x, strict=True):
        ax.scatter(x, p["y"], color=color[p["method"]], marker=marker[p["eval"]], s=70, zorder=3)
    # Arrows follow each method from one eval directory to the next (before -> after training).
    for m in methods:
        mine = [(x, p["y"]) for p, x in zip(points, shown_x, strict=True) if p["method"] == m]
        for a, b in zip(mine, mine[1:], strict=False):
            ax.annotate(
                "", xy=b, xytext=a,
                arrowprops={"arrowstyle": "->", "color": color[m], "alpha": 0.6, "shrinkA": 6, "shrinkB": 6},
            )  # fmt: skip
    # Labels next to points collide as soon as two methods score alike; a legend never does.
    handles = [Line2D([], [], color=color[m], marker="o", linestyle="", label=m) for m in methods]
    if len(evals) > 1:
        handles += [Line2D([], [], color="#555", marker=marker[e], linestyle="", label=e) for e in evals]
    ax.legend(handles=handles, fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.set_xlabel("mean retrieval calls per question")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs retrieval count (one point per method per eval directory)", fontsize=10)
    if shown_x != xs:
        ax.set_xlabel("mean retrieval calls per question (points at one spot spread sideways; see table)")
    ax.grid(alpha=0.3)
    pad_x = max(0.5, (max(shown_x) - min(shown_x)) * 0.15)
    pad_y = max(0.05, (max(ys) - min(ys)) * 0.15)
    ax.set_xlim(min(shown_x) - pad_x, max(shown_x) + pad_x)
    ax.set_ylim(min(ys) - pad_y, max(ys) + pad_y)
    return png_data_uri(fig)
