"""Over- and under-retrieval on a world with a knowledge boundary (the staged-reward paper's terms).

A question of a `sleuth synth --known-fraction` world is all-known (every hop is a fact the model
was taught), all-unknown or mixed. Following "learning when to search":
- **over-retrieval**: the agent searched (one retrieval or more) on an all-known question, whose
  answer it knew;
- **under-retrieval**: the agent answered without searching a question with an unknown hop
  (mixed or all-unknown), whose answer it could not know.
Each is the share of the questions it applies to, with a 95% percentile bootstrap interval
(`sleuth.eval.stats.bootstrap_ci`, seeded), beside the retrievals per question and EM of each type.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sleuth.data.synth import KNOWLEDGE_TYPES
from sleuth.eval.stats import bootstrap_ci

UNKNOWN = "any-unknown"  # the mixed and all-unknown questions together: where under-retrieval applies


def _mean_ci(values: list[float], seed: int) -> tuple[float | None, list[float] | None]:
    if not values:
        return None, None
    return sum(values) / len(values), list(bootstrap_ci(values, seed=seed))


def _row(records: Sequence[Mapping[str, Any]], known: bool, seed: int) -> dict[str, Any]:
    counts = [float(r["retrieval_count"]) for r in records]
    row: dict[str, Any] = {"n": len(records)}
    row["retrieval_count"], row["retrieval_count_ci"] = _mean_ci(counts, seed)
    row["em"], row["em_ci"] = _mean_ci([float(r["metrics"]["em"]) for r in records], seed)
    missed = [float(c > 0) if known else float(c == 0) for c in counts]
    share, ci = _mean_ci(missed, seed)
    row["over_retrieval"], row["over_retrieval_ci"] = (share, ci) if known else (None, None)
    row["under_retrieval"], row["under_retrieval_ci"] = (None, None) if known else (share, ci)
    return row


def retrieval_boundary(
    records: Sequence[Mapping[str, Any]], seed: int = 0
) -> dict[str, dict[str, Any]] | None:
    """Per knowledge type (all-known, mixed, all-unknown, and any-unknown = mixed + all-unknown):
    n, retrieval_count, em, over_retrieval (all-known only) and under_retrieval (the others), each
    with its `_ci`. None when no record carries a knowledge label."""
    labelled = [r for r in records if r.get("knowledge") in KNOWLEDGE_TYPES]
    if not labelled:
        return None
    out: dict[str, dict[str, Any]] = {}
    for kind in KNOWLEDGE_TYPES:
        members = [r for r in labelled if r["knowledge"] == kind]
        if members:
            out[kind] = _row(members, kind == "all-known", seed)
    unknown = [r for r in labelled if r["knowledge"] != "all-known"]
    if unknown:
        out[UNKNOWN] = _row(unknown, False, seed)
    return out


def _cell(row: Mapping[str, Any], key: str, pct: bool) -> str:
    value, ci = row.get(key), row.get(f"{key}_ci")
    if value is None:
        return "-"
    scale, form = (100.0, "{:.1f}") if pct else (1.0, "{:.2f}")
    text = form.format(scale * value)
    return text + (f" [{form.format(scale * ci[0])}, {form.format(scale * ci[1])}]" if ci else "")


def boundary_markdown(boundary: Mapping[str, Mapping[str, Any]]) -> str:
    """The table of `retrieval_boundary` results per method (summary.md)."""
    lines = [
        "| method | questions | n | over-retrieval % [95% CI] | under-retrieval % [95% CI] | RC [95% CI] | "
        "EM % [95% CI] |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, rows in boundary.items():
        for kind, row in rows.items():
            lines.append(
                f"| {method} | {kind} | {row['n']} | {_cell(row, 'over_retrieval', True)} | "
                f"{_cell(row, 'under_retrieval', True)} | {_cell(row, 'retrieval_count', False)} | "
                f"{_cell(row, 'em', True)} |"
            )
    return (
        "\nRetrieval against the knowledge boundary: over-retrieval = searched on an all-known question; "
        "under-retrieval = answered without searching a question with an unknown hop.\n\n"
        + "\n".join(lines)
        + "\n"
    )
