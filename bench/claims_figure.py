"""Issue 25: the figures of docs/results.md's "Claims" section, not timings.

`claim RUN`: a claim's result folder as committed under bench/results/claims/<run>/ (report.json, and per arm
<arm>/per_question.jsonl and <arm>/metrics.jsonl): held-out EM per question type for each arm with 95%
percentile-bootstrap intervals, and the training curves of the chosen metrics per RL step.
`curve DIR`: a claim folder packed by bench/claims_pack.py (its why.json) whose evaluations are named
<method>_<training questions> (the s3 claim): EM and the share of questions whose supporting passages all reached
the answerer, against RL training questions, per method, with 95% intervals.
`types DIR --evaluations A B .. --key em|cover_em|all_support_served`: why.json's per-type values, bars per evaluation.
`injection JSON`: bench/injection_calibration.py's results: closed-book EM on known vs unknown statements against
injection epochs, one line pair per setting (learning rate x statements a step), with their 95% intervals.

    PYTHONPATH=src python bench/claims_figure.py claim bench/results/claims/r_search_gpu_h100 \
        --curves reward/answer_f1 reward/evidence_f1 --out docs/claims/r_search_gpu_h100.png
    PYTHONPATH=src python bench/claims_figure.py injection bench/results/knowledge_injection_calibration_cpu.json \
        --out docs/claims/knowledge_boundary_cpu.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from sleuth.appendlog import read_appended
from sleuth.claims.report import seeds_figure
from sleuth.eval.stats import bootstrap_ci
from sleuth.utils import atomic_open


def read_jsonl(path: Path) -> list[dict]:
    return read_appended(path).records


def save_png(fig: Figure, out: Path) -> None:
    with atomic_open(out, "wb") as handle:  # never a half-written figure
        fig.savefig(handle, format="png")


def em_by_type(rows: list[dict], key: str = "em") -> dict[str, tuple[float, float, float, int]]:
    """Question type -> (mean of `key`, low, high, n), plus "all"."""
    groups: dict[str, list[float]] = {}
    for row in rows:
        groups.setdefault(row["dataset"], []).append(float(row[key]))
        groups.setdefault("all", []).append(float(row[key]))
    out = {}
    for name, values in sorted(groups.items(), key=lambda kv: (kv[0] == "all", kv[0])):
        arr = np.asarray(values)
        low, high = bootstrap_ci(arr)
        out[name] = (float(arr.mean()), low, high, len(arr))
    return out


def _type_bars(ax: Any, stats: dict[str, tuple[float, float, float, int]], i: int, arms: int, arm: str,
               scale: float) -> None:  # fmt: skip
    """One arm's bars (mean and 95% interval per question type) beside the other arms' on `ax`."""
    width = 0.8 / arms
    values = [scale * s[0] for s in stats.values()]
    errors = [
        [scale * (s[0] - s[1]) for s in stats.values()],
        [scale * (s[2] - s[0]) for s in stats.values()],
    ]
    ax.bar(np.arange(len(stats)) + i * width, values, width, yerr=errors, capsize=3, label=arm)
    ax.set_xticks(
        np.arange(len(stats)) + width * (arms - 1) / 2, [f"{name}\n(n={s[3]})" for name, s in stats.items()]
    )


def draw(run: Path, curves: list[str], out: Path, retrievals: bool = False) -> dict:
    """The claim run's figure; `retrievals` adds a panel of retrievals per question by type (the staged claim)."""
    report = json.loads((run / "report.json").read_text())
    arms = report["arms"]
    panels = 3 if retrievals else 2
    fig = Figure(figsize=(5 * panels, 3.6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    bars, lines = fig.add_subplot(1, panels, 1), fig.add_subplot(1, panels, panels)
    counts = fig.add_subplot(1, panels, 2) if retrievals else None
    summary = {}
    for i, arm in enumerate(arms):
        rows = read_jsonl(run / arm / "per_question.jsonl")
        stats = em_by_type(rows)
        summary[arm] = stats
        _type_bars(bars, stats, i, len(arms), arm, 100)
        if counts is not None:
            _type_bars(counts, em_by_type(rows, "retrieval_count"), i, len(arms), arm, 1)
        metrics = read_jsonl(run / arm / "metrics.jsonl")
        for key, style in zip(curves, ("-", "--", ":", "-."), strict=False):
            steps = [m["step"] for m in metrics if key in m]
            lines.plot(
                steps, [m[key] for m in metrics if key in m], style, color=f"C{i}", label=f"{arm}: {key}"
            )
    bars.set_ylabel("held-out EM (%)")
    bars.set_ylim(0, 105)
    bars.legend(loc="lower left", fontsize=8)
    bars.set_title(f"{report['claim']['method']}: EM by question type, 95% bootstrap")
    if counts is not None:
        counts.set_ylabel("retrievals per question")
        counts.legend(loc="lower left", fontsize=8)
        counts.set_title("retrievals per question by type, 95% bootstrap")
    lines.set_xlabel("RL step")
    lines.set_title("training batch means per step")
    lines.legend(fontsize=7)
    save_png(fig, out)
    return summary


def draw_curve(run: Path, out: Path) -> dict[str, list[tuple[int, float, float]]]:
    """EM and all-support-served against training questions per method (why.json); method -> [(size, em, served)]."""
    analysis = json.loads((run / "why.json").read_text())
    series: dict[str, list[tuple[int, dict]]] = {}
    for name, groups in analysis.items():
        method, _, size = name.rpartition("_")
        if size.isdigit():
            series.setdefault(method, []).append((int(size), groups["all"]))
    fig = Figure(figsize=(10, 3.6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    panels = {"em": fig.add_subplot(1, 2, 1), "all_support_served": fig.add_subplot(1, 2, 2)}
    for method, points in sorted(series.items()):
        points.sort(key=lambda p: p[0])
        for key, ax in panels.items():
            stats = [p[1][key] for p in points]
            errors = [
                [100 * (s["mean"] - s["ci"][0]) for s in stats],
                [100 * (s["ci"][1] - s["mean"]) for s in stats],
            ]
            ax.errorbar(
                [p[0] for p in points],
                [100 * s["mean"] for s in stats],
                yerr=errors,
                marker="o",
                capsize=3,
                label=method,
            )
    for ax in panels.values():
        ax.set_xscale("log")
        ax.set_xlabel("RL training questions")
        ax.set_ylim(0, 105)
        ax.legend(loc="lower right", fontsize=8)
    panels["em"].set_ylabel("held-out EM (%)")
    panels["em"].set_title("EM, 95% bootstrap")
    panels["all_support_served"].set_ylabel("questions (%)")
    panels["all_support_served"].set_title("every supporting passage reached the answerer")
    save_png(fig, out)
    return {
        m: [(size, g["em"]["mean"], g["all_support_served"]["mean"]) for size, g in sorted(points)]
        for m, points in series.items()
    }


def draw_types(run: Path, evaluations: list[str], key: str, out: Path) -> dict[str, dict[str, float]]:
    """why.json's `key` per question type, bars per evaluation with 95% intervals; evaluation -> type -> mean."""
    analysis = json.loads((run / "why.json").read_text())
    missing = [name for name in evaluations if name not in analysis]
    if missing:
        raise SystemExit(
            f"{run / 'why.json'} has no evaluation {', '.join(missing)}: it has {', '.join(analysis)}"
        )
    fig = Figure(figsize=(8, 3.6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, name in enumerate(evaluations):
        groups = dict(sorted(analysis[name].items(), key=lambda kv: (kv[0] == "all", kv[0])))
        stats = {
            kind: (g[key]["mean"], g[key]["ci"][0], g[key]["ci"][1], g[key]["n"])
            for kind, g in groups.items()
        }
        _type_bars(ax, stats, i, len(evaluations), name, 100)
    ax.set_ylabel(f"{key} (%)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=7)
    ax.set_title(f"{key} by question type, 95% bootstrap")
    save_png(fig, out)
    return {name: {kind: g[key]["mean"] for kind, g in analysis[name].items()} for name in evaluations}


def draw_injection(calibration: Path, out: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Known and unknown closed-book EM against epochs per setting; returns setting -> [(epochs, known, unknown)]."""
    data = json.loads(calibration.read_text())
    series: dict[str, list[dict]] = {}
    for row in data["results"]:
        if "epochs" in row:
            series.setdefault(f"lr {row['lr']:g} x {row['batch_size']}", []).append(row)
    fig = Figure(figsize=(6, 3.6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    summary = {}
    for i, (name, rows) in enumerate(sorted(series.items())):
        rows.sort(key=lambda r: r["epochs"])
        epochs = [r["epochs"] for r in rows]
        for part, style in (("known", "-o"), ("unknown", "--s")):
            ems = [100 * r[part]["em"] for r in rows]
            errors = [
                [100 * (r[part]["em"] - r[part]["em_ci"][0]) for r in rows],
                [100 * (r[part]["em_ci"][1] - r[part]["em"]) for r in rows],
            ]
            ax.errorbar(
                epochs, ems, yerr=errors, fmt=style, color=f"C{i}", capsize=3, label=f"{name}: {part}"
            )
        summary[name] = [(r["epochs"], r["known"]["em"], r["unknown"]["em"]) for r in rows]
    eval_sizes = data["eval"]
    ax.set_xlabel("injection epochs")
    ax.set_ylabel("closed-book EM (%)")
    ax.set_ylim(0, 105)
    ax.set_title(
        f"{data['model']}: known ({eval_sizes['known']}) vs unknown ({eval_sizes['unknown']}) statements"
    )
    ax.legend(fontsize=7)
    save_png(fig, out)
    return summary


def draw_seeds(runs: list[Path], out: Path) -> list[tuple[str, dict]]:
    """One panel per decisive test of each run's report.json (sleuth.claims.report.seeds_figure)."""
    named = []
    for run in runs:
        report = json.loads((run / "report.json").read_text())
        named += [(f"{report['claim']['method']}: {t['row']}", t) for t in report["table"]["seeds"]["tests"]]
    save_png(seeds_figure([t for _, t in named], [name for name, _ in named]), out)
    return named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="figure", required=True)
    claim = sub.add_parser("claim", help="a committed claim run's figure")
    claim.add_argument("run", type=Path, help="a claim's result folder (bench/results/claims/<run>)")
    claim.add_argument(
        "--curves", nargs="+", default=["reward/mean"], help="metrics.jsonl keys to plot per step"
    )
    claim.add_argument(
        "--retrievals", action="store_true", help="add retrievals per question by type (staged)"
    )
    claim.add_argument("--out", type=Path, required=True, help="the PNG to write")
    curve = sub.add_parser("curve", help="EM and supporting passages served against training questions")
    curve.add_argument("run", type=Path, help="a folder packed by bench/claims_pack.py (why.json)")
    curve.add_argument("--out", type=Path, required=True, help="the PNG to write")
    types = sub.add_parser("types", help="a why.json value per question type, bars per evaluation")
    types.add_argument("run", type=Path, help="a folder packed by bench/claims_pack.py (why.json)")
    types.add_argument("--evaluations", nargs="+", required=True)
    types.add_argument(
        "--key", default="em", choices=["em", "cover_em", "all_support_served", "answer_in_served"]
    )
    types.add_argument("--out", type=Path, required=True, help="the PNG to write")
    seeds = sub.add_parser("seeds", help="each claim's per-seed, pooled and noise-floor differences")
    seeds.add_argument("runs", type=Path, nargs="+", help="claim result folders holding report.json")
    seeds.add_argument("--out", type=Path, required=True, help="the PNG to write")
    injection = sub.add_parser("injection", help="the knowledge injection's boundary against epochs")
    injection.add_argument("calibration", type=Path, help="bench/injection_calibration.py's JSON")
    injection.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args()
    if args.figure == "claim":
        for arm, stats in draw(args.run, args.curves, args.out, args.retrievals).items():
            for name, (em, low, high, n) in stats.items():
                print(
                    f"{arm:>18} {name:>12} n={n:4d} EM {100 * em:5.1f} [{100 * low:5.1f}, {100 * high:5.1f}]"
                )
    elif args.figure == "curve":
        for method, points in draw_curve(args.run, args.out).items():
            for size, em, served in points:
                print(
                    f"{method:>12} {size:>6} questions: EM {100 * em:5.1f}, all support served {100 * served:5.1f}"
                )
    elif args.figure == "seeds":
        for name, test in draw_seeds(args.runs, args.out):
            pooled = test["pooled"]
            print(
                f"{name}: pooled {pooled['diff']:+.4f} {pooled['ci']} over {pooled['seeds']} seeds, {test['verdict']}"
            )
    elif args.figure == "types":
        for name, by_type in draw_types(args.run, args.evaluations, args.key, args.out).items():
            print(name, {kind: round(100 * v, 1) for kind, v in by_type.items()})
    else:
        for name, points in draw_injection(args.calibration, args.out).items():
            for epochs, known, unknown in points:
                print(
                    f"{name:>16} epochs {epochs:>2}: known EM {100 * known:5.1f}, unknown {100 * unknown:5.1f}"
                )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
