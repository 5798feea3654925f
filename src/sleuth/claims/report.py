"""The report of `sleuth reproduce`: OUT/report.json and OUT/report.html, which opens with the verdict, then the
verdict over seeds with the noise floor, the premise check, every measure, and the claim's figure."""

from __future__ import annotations

import html
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sleuth.appendlog import read_appended
from sleuth.claims.base import PREMISE, predictions
from sleuth.eval.stats import bootstrap_ci
from sleuth.utils import atomic_write_json, atomic_write_text

STYLE = """
:root { --fg:#1d2330; --muted:#5d6678; --line:#dde1e8; --bg:#f6f7f9; --good:#1f8a3b; --bad:#c0392b; --warn:#b7791f; }
body { margin:0; font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif; color:var(--fg);
       background:var(--bg); }
header { background:#1d2330; color:#fff; padding:18px 28px; } header h1 { margin:0 0 4px; font-size:21px; }
header .sub { color:#b8c0cf; font-size:12px; }
main { max-width:1100px; margin:0 auto; padding:8px 28px 40px; }
section { background:#fff; border:1px solid var(--line); border-radius:8px; padding:14px 18px; margin:16px 0; }
h2 { font-size:17px; margin:0 0 10px; }
.banner { font-size:18px; font-weight:600; padding:12px 18px; border-radius:8px; margin:16px 0; color:#fff; }
.banner.holds { background:var(--good); } .banner.does-not-hold { background:var(--bad); }
.banner.not-shown { background:var(--warn); } .banner .why { font-weight:400; font-size:13px; display:block; }
table { border-collapse:collapse; margin:6px 0 12px; font-variant-numeric:tabular-nums; }
caption { text-align:left; font-weight:600; padding:4px 0; }
th, td { border:1px solid var(--line); padding:3px 9px; text-align:right; } th { background:#f0f2f5; }
td:first-child, th:first-child { text-align:left; }
.met { color:var(--good); font-weight:600; } .unmet { color:var(--bad); font-weight:600; }
.note { color:var(--muted); } code { font-size:12px; }
"""


def _fmt(value: float | None, pct: bool) -> str:
    if value is None:
        return "-"
    return f"{100 * value:+.1f}" if pct else f"{value:+.2f}"


def _value(value: float | None, pct: bool) -> str:
    return "-" if value is None else (f"{100 * value:.1f}" if pct else f"{value:.2f}")


def _interval(ci: list[float] | None, pct: bool) -> str:
    return f"[{_fmt(ci[0], pct)}, {_fmt(ci[1], pct)}]" if ci else "-"


def paired_row(label: str, row: dict[str, Any], pct: bool) -> str:
    """One paired row (`sleuth.claims.stats.paired`): n, each side, the difference and its interval."""
    return (
        f"<tr><td>{label}</td><td>{row['n']}</td><td>{_value(row['a'], pct)}</td><td>{_value(row['b'], pct)}</td>"
        f"<td>{_fmt(row['diff'], pct)}</td><td>{_interval(row['ci'], pct)}</td></tr>"
    )


def _rows_table(table: dict[str, Any], columns: tuple[str, str], seed: int) -> str:
    cells = []
    for name, row in table["rows"].items():
        pct = not name.startswith("retrievals")  # accuracies in points, retrieval counts as they are
        cells.append(paired_row(html.escape(name), row, pct))
    return (
        f"<table id='claim'><caption>Every measure, training seed {seed} (paired by question)</caption>\n"
        f"<tr><th>measure</th><th>n</th><th>{html.escape(columns[0])}</th><th>{html.escape(columns[1])}</th>"
        "<th>difference</th><th>95% interval (paired bootstrap)</th></tr>\n"
        + "\n".join(cells)
        + "\n</table>\n"
    )


def _seeds_table(seeds: dict[str, Any]) -> str:
    """Each decisive test: every seed's paired difference, the pooled one, the noise floor, the verdict."""
    parts = []
    for test in seeds["tests"]:
        pct = test["points"]
        unit = "points" if pct else "per question"
        rows = [paired_row(f"seed {r['seed']}", r, pct) for r in test["per_seed"]]
        pooled = test["pooled"]
        rows.append(
            f"<tr><th>pooled ({pooled['seeds']} seeds)</th><td></td><td></td><td></td>"
            f"<th>{_fmt(pooled['diff'], pct)}</th><th>{_interval(pooled['ci'], pct)}</th></tr>"
        )
        floor = test["floor"]
        if floor is None:
            rows.append(
                "<tr><td>noise floor</td><td colspan='5' class='note'>not measured: one seed</td></tr>"
            )
        else:
            rows.append(
                paired_row(
                    f"noise floor: baseline seed {floor['seeds'][1]} vs seed {floor['seeds'][0]}", floor, pct
                )
            )
        side = "above" if test["side"] == "above" else "below"
        parts.append(
            f"<table class='seeds'><caption>{html.escape(test['row'])}: {html.escape(test['treated'])} minus "
            f"{html.escape(test['baseline'])}, claimed {side} {_fmt(test['threshold'], pct)} ({unit}) &mdash; "
            f"<span class='{_css(test['verdict'])}'>{html.escape(test['verdict'])}</span></caption>\n"
            "<tr><th>comparison</th><th>n</th><th>treated</th><th>baseline</th><th>difference</th>"
            "<th>95% interval</th></tr>\n"
            + "\n".join(rows)
            + f"\n</table>\n<p class='note'>{html.escape(test['why'])}"
            "</p>\n"
        )
    figure = (
        f"<figure id='seeds-figure'><img alt='each seed, pooled and the noise floor: differences with 95% intervals' "
        f"src='{_png(seeds_figure(seeds['tests']))}'></figure>\n"
    )
    return "<section id='seeds'><h2>Verdict over seeds</h2>\n" + "".join(parts) + figure + "</section>\n"


def _premise_section(premise: dict[str, Any] | None, after_arms: bool = False) -> str:
    """The premise check before the arms, or (`after_arms`) a claim's check of it with what its arms learned."""
    if premise is None:
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(c['check'])}</td><td>{html.escape(str(c['value']))}</td>"
        f"<td>{html.escape(str(c['needed']))}</td><td class='{'met' if c['met'] else 'unmet'}'>"
        f"{'met' if c['met'] else 'not met'}</td></tr>"
        for c in premise["checks"]
    )
    if premise["met"]:
        state = "met"
    elif after_arms:
        state = "not met: what the arms learned makes the mechanism the claim tests unrewarded"
    else:
        state = (
            "not met: the arms were trained anyway (--force, or a rehearsal profile), so "
            "the verdict is at most 'not shown'"
        )
    table = (
        "<table id='premise'><tr><th>check</th><th>measured</th><th>needed</th><th></th></tr>"
        + rows
        + "</table>"
        if rows
        else ""
    )
    return (
        f"<section id='{'premise-as-trained' if after_arms else 'premise-check'}'><h2>"
        f"{'Premise again, after the arms' if after_arms else 'Premise'}: {state}</h2>{table}<p class='note'>"
        f"{html.escape(premise.get('note', ''))}</p></section>\n"
    )


def verdict_sentence(verdict: str) -> str:
    return {
        "holds": "The claim holds.",
        "not shown": "The claim is not shown.",
        "does not hold": "The claim does not hold.",
    }.get(verdict, f"Verdict: {verdict}.")


def _css(verdict: str) -> str:
    return verdict.replace(" ", "-")


def _stage_list(out: Path, details: dict[str, Any]) -> str:
    """The stages' names and the folders they wrote, relative to OUT (the records hold the rest)."""
    root = str(out)
    items = []
    for name, result in details.items():
        paths = (
            sorted(
                {
                    str(v).replace(root + "/", "")
                    for v in (result or {}).values()
                    if isinstance(v, str) and v.startswith(root + "/")
                }
            )
            if isinstance(result, dict)
            else []
        )
        items.append(
            f"<li><b>{html.escape(name)}</b>"
            + (f": <code>{html.escape(', '.join(paths))}</code>" if paths else "")
            + "</li>"
        )
    return (
        "<section id='stages'><h2>Stages</h2><ul>"
        + "".join(items)
        + "</ul><p class='note'>Each stage's full record: OUT/stages/&lt;name&gt;.json.</p></section>\n"
    )


def _figures(run: Any, seeds: dict[str, Any]) -> str:
    """The first seed's training curves of every arm and the decisive tests' measures by question type."""
    runs = {
        name.removeprefix("train_"): Path(result["run"])
        for name, result in run.results.items()
        if name.startswith("train_") and "." not in name and isinstance(result, dict) and "run" in result
    }
    parts = [training_figure(runs)]
    for spec_test, test in zip(run.spec.tests(run.profile_name), seeds["tests"], strict=True):
        parts.append(
            type_bars_figure(
                test,
                predictions(run, spec_test.treated),
                predictions(run, spec_test.baseline),
                spec_test.value,
            )
        )
    body = "".join(parts)
    return (
        f"<section id='figures'><h2>Training and question types (seed {run.base_seed})</h2>{body}</section>\n"
    )


def write_report(run: Any, table: dict[str, Any]) -> Path:
    """OUT/report.json and OUT/report.html of a claim run (`sleuth.claims.runner.ClaimRun`): a verdict banner, the
    verdict over seeds (each seed, pooled, the noise floor), the premise check, every measure of the first seed, then
    the claim's figure and the plan."""
    out, spec, seeds = run.out, run.spec, table["seeds"]
    premise = run.results.get(PREMISE)
    table["holds"] = seeds["holds"]
    atomic_write_json(
        out / "report.json",
        {
            "claim": asdict(spec.text),
            "arms": list(spec.columns),
            "table": table,
            "seed": run.base_seed,
            "seeds": list(run.seeds),
            "verdict": seeds["verdict"],
            "premise": premise,
            "profile": run.profile_name,
            **run.results,
        },
    )
    verdict = seeds["verdict"]
    why = "; ".join(f"{t['row']}: {t['verdict']} ({t['why']})" for t in seeds["tests"])
    if not seeds.get("premise_met", True):
        why = f"The premise is not met, so the arms cannot test the claim. {why}"
    page = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>sleuth reproduce {html.escape(spec.method)}: {verdict}</title><style>{STYLE}</style></head><body>\n"
        f"<header><h1>Claim ({html.escape(spec.method)}): {html.escape(spec.text.claim)}</h1>"
        f"<div class='sub'>profile {html.escape(run.profile_name)}; training seeds "
        f"{', '.join(map(str, run.seeds))}; {table['questions']} held-out questions</div></header><main>\n"
        f"<div class='banner {_css(verdict)}' id='verdict'>{verdict_sentence(verdict)}"
        f"<span class='why'>{html.escape(why)}</span></div>\n"
        + _seeds_table(seeds)
        + _premise_section(premise)
        # a claim may check its premise again with what the arms learned (staged: the trained policy's own search)
        + _premise_section(table.get("premise_as_trained"), after_arms=True)
        + "<section><h2>Every measure</h2>"
        + _rows_table(table, spec.columns, run.base_seed)
        + f"<p class='note'>{html.escape(table['rule'])}</p><p>Training seed of the arms: {run.base_seed}.</p>"
        + spec.figure_html(run, table)
        + "</section>\n"
        + _figures(run, seeds)
        + "<section><h2>Plan</h2><ul>"
        + "".join(f"<li><b>{k}</b>: {html.escape(str(v))}</li>" for k, v in asdict(spec.text).items())
        + "</ul></section>\n"
        + _stage_list(out, run.results)
        + "</main></body></html>\n"
    )
    atomic_write_text(out / "report.html", page)
    return out / "report.html"


def _png(fig: Any) -> str:
    import base64
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def seeds_figure(tests: list[dict[str, Any]], titles: list[str] | None = None) -> Any:
    """A matplotlib Figure, one panel a decisive test (`sleuth.claims.stats` verdict rows): each seed's paired
    difference, the pooled one and the noise floor, with 95% intervals, against the claim's threshold."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 0.6 + 2.4 * len(tests)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    for k, test in enumerate(tests):
        ax = fig.add_subplot(len(tests), 1, k + 1)
        scale = 100 if test["points"] else 1
        rows = [(f"seed {r['seed']}", r, "C0") for r in test["per_seed"]]
        rows.append((f"pooled ({test['pooled']['seeds']} seeds)", test["pooled"], "C3"))
        if test["floor"] is not None:
            floor = test["floor"]
            rows.append(
                (f"noise floor (baseline, seed {floor['seeds'][1]} vs {floor['seeds'][0]})", floor, "C7")
            )
        for y, (_, row, color) in enumerate(reversed(rows)):
            diff, (lo, hi) = scale * row["diff"], (scale * v for v in row["ci"])
            ax.errorbar(diff, y, xerr=[[diff - lo], [hi - diff]], fmt="o", color=color, capsize=3)
        ax.axvline(scale * test["threshold"], color="k", linewidth=0.8, linestyle="--")
        ax.set_yticks(range(len(rows)), [label for label, _, _ in reversed(rows)], fontsize=8)
        unit = "points" if test["points"] else "per question"
        ax.set_xlabel(
            f"difference ({unit}), treated minus baseline; dashed: the claim's threshold", fontsize=8
        )
        title = titles[k] if titles else test["row"]
        ax.set_title(textwrap.fill(f"{title}: {test['verdict']}", 90), fontsize=9)
    return fig


def training_figure(runs: dict[str, Path]) -> str:
    """Each arm's mean reward and retrievals per rollout over its GRPO steps (metrics.jsonl of its run), one line an
    arm (inline PNG; empty when no run has metrics)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = {}
    for arm, run in runs.items():
        path = Path(run) / "metrics.jsonl"
        if path.is_file():
            rows = [r for r in read_appended(path).records if "step" in r]
            series[arm] = rows
    if not series:
        return ""
    fig = Figure(figsize=(9, 3.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    for i, (key, label) in enumerate(
        (("reward/mean", "mean reward"), ("retrieval_count", "retrievals a rollout"))
    ):
        ax = fig.add_subplot(1, 2, i + 1)
        for arm, rows in series.items():
            points = [(r["step"], r[key]) for r in rows if key in r]
            if points:
                ax.plot(*zip(*points, strict=True), marker=".", label=arm)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(label)
    fig.axes[0].legend(fontsize=8)
    return f"<figure id='training'><img alt='reward and retrievals per GRPO step, each arm' src='{_png(fig)}'></figure>\n"


def type_bars_figure(test: dict[str, Any], treated: dict[str, dict], baseline: dict[str, dict],
                     value: Any) -> str:  # fmt: skip
    """The decisive test's measure per question type (the evaluation's dataset label: hops or knowledge type) for
    its two arms, with 95% bootstrap intervals (inline PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    kinds = sorted({r.get("dataset", "all") for r in treated.values()})
    fig = Figure(figsize=(6, 3.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    scale = 100 if test["points"] else 1
    width = 0.4
    for j, (name, preds) in enumerate(((test["treated"], treated), (test["baseline"], baseline))):
        means, errors = [], [[], []]
        for kind in kinds:
            values = [value(r) for r in preds.values() if r.get("dataset", "all") == kind]
            mean = sum(values) / len(values) if values else 0.0
            lo, hi = bootstrap_ci(values) if values else (0.0, 0.0)
            means.append(scale * mean)
            errors[0].append(scale * (mean - lo))
            errors[1].append(scale * (hi - mean))
        ax.bar(
            [i + (j - 0.5) * width for i in range(len(kinds))],
            means,
            width,
            yerr=errors,
            capsize=3,
            label=name.removeprefix("eval_"),
        )
    ax.set_xticks(range(len(kinds)), kinds, fontsize=8)
    ax.set_ylabel(test["row"][:40])
    ax.legend(fontsize=8)
    return (
        f"<figure id='types'><img alt='the decisive measure by question type' src='{_png(fig)}'></figure>\n"
    )


def curve_figure(curve: dict[str, list[dict[str, Any]]]) -> str:
    """Held-out EM against RL training questions, one line per method with its 95% intervals (inline PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for method, points in curve.items():
        xs = [p["questions"] for p in points]
        ys = [100 * p["em"] for p in points]
        errors = [
            [100 * (p["em"] - p["em_ci"][0]) for p in points],
            [100 * (p["em_ci"][1] - p["em"]) for p in points],
        ]
        ax.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=method)
    ax.set_xscale("log")
    ax.set_xlabel("RL training questions")
    ax.set_ylabel("held-out EM (%)")
    ax.legend()
    return f"<figure id='curve'><img alt='EM against RL training questions' src='{_png(fig)}'></figure>\n"


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
    head = (
        "<tr><th>questions</th><th>n</th><th>closed-book EM % (injected model)</th>"
        + "".join(
            f"<th>{html.escape(arm)} EM %</th><th>{html.escape(arm)} retrievals</th><th>{html.escape(arm)} over-retrieval %"
            f"</th><th>{html.escape(arm)} under-retrieval %</th>"
            for arm in per_arm
        )
        + "</tr>"
    )
    rows = []
    for kind in KNOWLEDGE_ROWS:
        known = boundary.get(kind)
        arms = [(stats or {}).get(kind) for stats in per_arm.values()]
        n = next((s["n"] for s in [known, *arms] if s), None)
        if n is None:
            continue
        cells = "".join(
            f"<td>{_cell(s, 'em', True)}</td><td>{_cell(s, 'retrieval_count', False)}</td>"
            f"<td>{_cell(s, 'over_retrieval', True)}</td><td>{_cell(s, 'under_retrieval', True)}</td>"
            for s in arms
        )
        rows.append(f"<tr><td>{kind}</td><td>{n}</td><td>{_cell(known, 'em', True)}</td>{cells}</tr>")
    return (
        "<table id='knowledge'><caption>By knowledge type: the boundary and each arm's retrieval behaviour "
        "(over-retrieval: searched on an all-known question; under-retrieval: answered a question with an unknown "
        "hop without searching)</caption>\n" + head + "\n" + "\n".join(rows) + "\n</table>\n"
    )
