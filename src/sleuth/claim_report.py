"""The report of `sleuth reproduce`: OUT/report.json and OUT/report.html, which opens with the claim table
(and, for s3, the curve of held-out EM against RL training questions)."""

from __future__ import annotations

import html
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sleuth.utils import atomic_write_json, atomic_write_text


def _fmt(value: float | None, pct: bool) -> str:
    if value is None:
        return "-"
    return f"{100 * value:+.1f}" if pct else f"{value:+.2f}"


def write_report(out: Path, claim: Any, table: dict[str, Any], arms: tuple[str, str], details: dict,
                 figure: str = "") -> Path:  # fmt: skip
    """OUT/report.json and OUT/report.html for `claim` (a `sleuth.reproduce.Claim`); the page opens with the claim
    table (then `figure`, HTML)."""
    atomic_write_json(out / "report.json", {"claim": asdict(claim), "arms": list(arms), "table": table, **details})
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
        f"<p>{html.escape(table['rule'])}</p>\n{figure}"
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
