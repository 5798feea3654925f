"""The report of `sleuth reproduce`: OUT/report.json and OUT/report.html, which opens with the claim table
(and, for s3, the curve of held-out EM against RL training questions)."""

from __future__ import annotations

import html
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sleuth.claim_stages import run_seed
from sleuth.utils import atomic_write_json, atomic_write_text


def _fmt(value: float | None, pct: bool) -> str:
    if value is None:
        return "-"
    return f"{100 * value:+.1f}" if pct else f"{value:+.2f}"


def write_report(out: Path, claim: Any, table: dict[str, Any], arms: tuple[str, str], details: dict,
                 figure: str = "") -> Path:  # fmt: skip
    """OUT/report.json and OUT/report.html for `claim` (a `sleuth.reproduce.Claim`); the page opens with the claim
    table (then `figure`, HTML)."""
    seed = run_seed(out)
    atomic_write_json(out / "report.json", {"claim": asdict(claim), "arms": list(arms), "table": table,
                                            "seed": seed, **details})
    cells = []
    for name, row in table["rows"].items():
        pct = not name.startswith("retrievals")  # accuracies in points, retrieval counts as they are
        ci = row["ci"]
        interval = f"[{_fmt(ci[0], pct)}, {_fmt(ci[1], pct)}]" if ci else "-"
        a, b = (("-" if v is None else (f"{100 * v:.1f}" if pct else f"{v:.2f}")) for v in (row["a"], row["b"]))
        cells.append(f"<tr><td>{html.escape(name)}</td><td>{row['n']}</td><td>{a}</td><td>{b}</td>"
                     f"<td>{_fmt(row['diff'], pct)}</td><td>{interval}</td></tr>")
    verdict = "holds" if table["holds"] else "does not hold"
    page = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>sleuth reproduce {html.escape(claim.method)}</title></head><body>\n"
        f"<table id='claim'><caption>Claim: {html.escape(claim.claim)} &mdash; {verdict}</caption>\n"
        f"<tr><th>measure</th><th>n</th><th>{html.escape(arms[0])}</th><th>{html.escape(arms[1])}</th>"
        "<th>difference</th><th>95% interval (paired bootstrap)</th></tr>\n" + "\n".join(cells) + "\n</table>\n"
        f"<p>{html.escape(table['rule'])}</p>\n<p>Training seed of the arms: {seed}.</p>\n{figure}"
        f"<h2>Plan</h2><ul>" + "".join(f"<li><b>{k}</b>: {html.escape(str(v))}</li>" for k, v in asdict(claim).items()
                                        ) + "</ul>\n"
        f"<h2>Stages</h2><pre>{html.escape(json.dumps(details, indent=2))}</pre>\n</body></html>\n"
    )
    atomic_write_text(out / "report.html", page)
    return out / "report.html"


def curve_figure(curve: dict[str, list[dict[str, Any]]]) -> str:
    """Held-out EM against RL training questions, one line per method with its 95% intervals (inline PNG)."""
    import base64
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for method, points in curve.items():
        xs = [p["questions"] for p in points]
        ys = [100 * p["em"] for p in points]
        errors = [[100 * (p["em"] - p["em_ci"][0]) for p in points], [100 * (p["em_ci"][1] - p["em"]) for p in points]]
        ax.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=method)
    ax.set_xscale("log")
    ax.set_xlabel("RL training questions")
    ax.set_ylabel("held-out EM (%)")
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
    return f"<figure id='curve'><img alt='EM against RL training questions' src='{uri}'></figure>\n"


KNOWLEDGE_ROWS = ("all-known", "mixed", "all-unknown")


def _cell(stats: dict[str, Any] | None, key: str, points: bool) -> str:
    """`key` of one question type's statistics with its 95% interval: points (x100, one decimal) or as it is."""
    value = None if stats is None else stats.get(key)
    if value is None:
        return "-"
    scale, digits = (100, 1) if points else (1, 2)
    ci = stats.get(f"{key}_ci")
    interval = f" [{scale * ci[0]:.{digits}f}, {scale * ci[1]:.{digits}f}]" if ci else ""
    return f"{scale * value:.{digits}f}{interval}"


def knowledge_table(boundary: dict[str, Any], per_arm: dict[str, dict[str, Any] | None]) -> str:
    """The staged claim's per-type table (HTML): for each knowledge type, the injected model's closed-book EM, then
    each arm's EM, retrievals per question, over-retrieval (searched on an all-known question) and under-retrieval
    (answered an unknown-hop question without searching), as the evaluation measured them, with 95% intervals."""
    head = "<tr><th>questions</th><th>n</th><th>closed-book EM % (injected model)</th>" + "".join(
        f"<th>{html.escape(arm)} EM %</th><th>{html.escape(arm)} retrievals</th><th>{html.escape(arm)} over-retrieval %"
        f"</th><th>{html.escape(arm)} under-retrieval %</th>" for arm in per_arm) + "</tr>"
    rows = []
    for kind in KNOWLEDGE_ROWS:
        known = boundary.get(kind)
        arms = [(stats or {}).get(kind) for stats in per_arm.values()]
        n = next((s["n"] for s in [known, *arms] if s), None)
        if n is None:
            continue
        cells = "".join(f"<td>{_cell(s, 'em', True)}</td><td>{_cell(s, 'retrieval_count', False)}</td>"
                        f"<td>{_cell(s, 'over_retrieval', True)}</td><td>{_cell(s, 'under_retrieval', True)}</td>"
                        for s in arms)
        rows.append(f"<tr><td>{kind}</td><td>{n}</td><td>{_cell(known, 'em', True)}</td>{cells}</tr>")
    return ("<table id='knowledge'><caption>By knowledge type: the boundary and each arm's retrieval behaviour "
            "(over-retrieval: searched on an all-known question; under-retrieval: answered a question with an unknown "
            "hop without searching)</caption>\n" + head + "\n" + "\n".join(rows) + "\n</table>\n")

